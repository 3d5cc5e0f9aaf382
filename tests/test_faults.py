"""Faults of the machine on the tiny task: the disk filling up during an SFT checkpoint or an export's merged model, a
read-only results directory, kill -9 at random moments of a PPO run that checkpoints every iteration, and an RM run
stopped while its judge trains. Each ends in one line (or a killed process), nothing half-written is ever taken as
complete, and the rerun finishes identical to a run that was never interrupted."""

import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import peft.peft_model
import pytest
from safetensors import SafetensorError, safe_open

from rlhf import cli
from rlhf.infra import faults, ranks
from rlhf.recipes import export, ppo, rm, sft
from rlhf.runs import records

from .conftest import ROOT, TINY, real_process_env, tiny
from .test_repro import assert_same_result, metric_lines, run_dirs, signal_when, summary

DATA = ("data.sft_examples=64", "data.pref_pairs=64", "data.ppo_prompts=64", "data.eval_examples=16",
        "eval.prompts=16", "data.judge_fraction=0")
SFT = ("sft.epochs=1", "sft.batch_size=8", "sft.logging_steps=1", "sft.save_steps=2")  # checkpoint-2, -4, -6, -8
RM = ("rm.epochs=1", "rm.batch_size=16", "rm.logging_steps=1")
PPO = ("ppo.steps=8", "ppo.save_steps=1", "ppo.rollout_batch=16", "ppo.minibatch=8", "ppo.micro_batch=8",
       "ppo.num_ppo_epochs=1")  # a checkpoint every iteration
ARGS = DATA + SFT + RM + PPO
# what safetensors raises when the disk fills up under it (measured on a full tmpfs)
ENOSPC = "Error while serializing: I/O error: No space left on device (os error 28)"


# how writers report a full or read-only disk (safetensors and torch measured on a tmpfs) and other failures
@pytest.mark.parametrize("raised, found", [
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on device"),
    (SafetensorError(ENOSPC), "no space left on device"),
    (SafetensorError('Error while serializing: I/O error: Read-only file system (os error 30) at path "/r/.tmpX"'),
     "read-only file system"),
    (RuntimeError("[enforce fail at inline_container.cc:747] . open file failed with strerror: Read-only file system"),
     "read-only file system"),
    (PermissionError(errno.EACCES, "Permission denied", "/r/x"), "permission denied"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota exceeded"),
    (MemoryError(), "out of memory"),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 2147483648 bytes."),
     "out of memory"),
    (ValueError("no_such_schedule is not a valid SchedulerType"), None),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/r/x"), None),
])
def test_faults_of_the_machine_are_told_from_other_errors(raised, found):
    try:
        try:
            raise raised
        except Exception as e:
            raise RuntimeError("a library's wrapper") from e  # found along the chain too
    except RuntimeError as e:
        fault = faults.fault_of(e)
    assert (fault.cause if fault else None) == found
    if isinstance(raised, OSError) and fault:
        assert fault.path == raised.filename
    if "tried to allocate" in str(raised):
        assert fault.needed == 2147483648 and "needs about 2.1 GB" in str(fault)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted SFT, RM and PPO runs of the settings the tests interrupt: {"root", stage: summary}."""
    root = tmp_path_factory.mktemp("faults")
    exp = tiny(root, *ARGS)
    return {"root": root, "sft": sft.train(exp), "rm": rm.train(exp), "ppo": ppo.train(exp)}


def bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def error_line(err: str) -> str:
    """The one `error:` line of a stage's stderr, asserted to be its last and the only one, with no traceback."""
    lines = err.replace("\r", "\n").splitlines()
    assert "Traceback" not in err and [line for line in lines if line.startswith("error:")] == lines[-1:], err[-3000:]
    return lines[-1]


def sft_stopped_by_a_full_disk(root: Path, monkeypatch, capsys) -> tuple[Path, str]:
    """`python -m rlhf sft` (in this process) whose disk fills up halfway through writing checkpoint-4's weights:
    (the run dir, the error line)."""
    real_save = peft.peft_model.safe_save_file

    def full_at_checkpoint_4(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        if "checkpoint-4" in Path(filename).parts:  # half of the file reached the disk, then it was full
            Path(filename).write_bytes(Path(filename).read_bytes()[: Path(filename).stat().st_size // 2])
            raise SafetensorError(ENOSPC)

    with monkeypatch.context() as m:
        m.setattr(peft.peft_model, "safe_save_file", full_at_checkpoint_4)
        assert cli.main(["sft", "--exp", str(TINY), f"results_dir={root}", *ARGS]) == 2
    (run,) = run_dirs(root, "sft")
    return run, error_line(capsys.readouterr().err)


def rerun_sft(root: Path, capsys) -> str:
    """The same command again, with room: its stderr."""
    assert cli.main(["sft", "--exp", str(TINY), f"results_dir={root}", *ARGS]) == 0
    return capsys.readouterr().err


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_rerun_resumes_to_the_same_result(
        reference, tmp_path, monkeypatch, capsys):
    run, line = sft_stopped_by_a_full_disk(tmp_path, monkeypatch, capsys)
    ckpts = run / "checkpoints"
    m = re.fullmatch(rf"error: sft: no space left on device while writing checkpoint "
                     rf"{re.escape(str(ckpts / 'checkpoint-4'))} \(needs about ([\d.]+) kB, [\d.]+ [kMG]?B free\)\. "
                     rf"Free some space and rerun the same command: it resumes from "
                     rf"{re.escape(str(ckpts / 'checkpoint-2'))}", line)
    assert m, line
    assert float(m.group(1)) * 1e3 == pytest.approx(bytes_under(ckpts / "checkpoint-2"), abs=100)
    # nothing half-written is left to be taken as complete: checkpoint-4 is gone, no summary, no `latest`
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["checkpoint-2"]
    assert not (run / "summary.json").exists() and not (run.parent / "latest").exists()

    err = rerun_sft(tmp_path, capsys)
    assert f"resuming {run} from checkpoint-2" in err
    resumed = summary(run)
    assert resumed["resumed_from"]["step"] == 2 and (run.parent / "latest").read_text().strip() == run.name
    assert_same_result(resumed, reference["sft"])


def read_only(path: Path, cmd: list[str]) -> subprocess.CompletedProcess:
    """`cmd` in a process that sees `path` as a read-only file system (a read-only bind mount in a user and mount
    namespace of its own: util-linux's unshare)."""
    mount = 'mount --bind -o ro "$1" "$1" && shift && exec "$@"'
    return subprocess.run(["unshare", "--map-root-user", "--mount", "sh", "-c", mount, "sh", str(path), *cmd],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=real_process_env())


def can_mount_read_only(path: Path) -> bool:
    return bool(shutil.which("unshare")) and read_only(path, ["true"]).returncode == 0


def files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(f.relative_to(root)): (f.stat().st_size, f.stat().st_mtime_ns) for f in root.rglob("*")}


@pytest.mark.slow
def test_a_read_only_results_directory_is_one_line_and_loses_nothing(reference, tmp_path, monkeypatch, capsys):
    if not can_mount_read_only(tmp_path):
        pytest.skip("no read-only bind mount here (unshare --map-root-user --mount is refused)")
    run, _ = sft_stopped_by_a_full_disk(tmp_path, monkeypatch, capsys)
    before = files(tmp_path)
    out = read_only(tmp_path, [sys.executable, "-m", "rlhf", "sft", "--exp", str(TINY), f"results_dir={tmp_path}",
                               *ARGS])
    assert out.returncode == 2
    assert error_line(out.stderr) == (
        f"error: sft: read-only file system while writing file {run / 'metrics.jsonl'}. Make {run} writable and "
        f"rerun the same command: it resumes from {run / 'checkpoints' / 'checkpoint-2'}")
    assert files(tmp_path) == before  # nothing written, nothing removed
    assert f"resuming {run} from checkpoint-2" in rerun_sft(tmp_path, capsys)
    assert_same_result(summary(run), reference["sft"])


# ------------------------------------------------------------------------------------------------ kill -9 and rerun
def complete(ckpt: Path, like: Path) -> bool:
    """Whether the checkpoint `ckpt` has every file of the complete checkpoint `like`, each of them readable."""
    names = {str(f.relative_to(like)) for f in like.rglob("*") if f.is_file()}
    if {str(f.relative_to(ckpt)) for f in ckpt.rglob("*") if f.is_file()} != names:
        return False
    for name in names:
        if name.endswith(".safetensors"):
            with safe_open(str(ckpt / name), "pt") as f:
                [f.get_tensor(k) for k in f.keys()]
        elif name.endswith(".json"):
            json.loads((ckpt / name).read_text())
    return True


def claimed(stage_root: Path, since: float) -> Path | None:
    """The run dir a stage process started after `since` is training in (it wrote the run's owner.json, new or
    resumed), or None yet: one stage process at a time."""
    for owner in stage_root.glob("2*/owner.json"):
        try:
            if owner.stat().st_mtime >= since:
                return owner.parent
        except OSError:
            pass  # replaced meanwhile
    return None


def at_random(stage_root: Path, since: float, delay: float):
    """ready() for signal_when: `delay` seconds after the process claimed its run."""
    state = {}

    def ready():
        run = state.get("run") or claimed(stage_root, since)
        if run is not None:
            state.setdefault("run", run)
            state.setdefault("t", time.time())
        return run if run is not None and time.time() - state["t"] >= delay else None

    return ready


def after_a_checkpoint(stage_root: Path, since: float, delay: float):
    """ready() for signal_when: `delay` seconds after the process's run has a complete checkpoint (`last` names one),
    so that the rerun has one to take up whatever the machine's load time."""
    state = {}

    def ready():
        run = state.get("run") or claimed(stage_root, since)
        if run is not None and "t" not in state and (run / "checkpoints" / "last").exists():
            state.update(run=run, t=time.time())
        return run if "t" in state and time.time() - state["t"] >= delay else None

    return ready


def half_written(run: Path, since: float) -> bool:
    """Whether the run has a checkpoint temp dir begun after `since` with some of its files in it."""
    for tmp in (run / "checkpoints").glob(".step-*.tmp"):
        try:
            if tmp.stat().st_mtime > since and any(tmp.iterdir()):
                return True
        except OSError:
            pass  # renamed meanwhile
    return False


def inside_a_write(stage_root: Path, since: float):
    """ready() for signal_when: as soon as the process has written some of a checkpoint's files."""
    def ready():
        run = claimed(stage_root, since)
        return run if run is not None and half_written(run, since) else None

    return ready


def taken_up(run: Path, like: Path) -> Path | None:
    """The checkpoint a killed run's `last` names, asserted whole (`like`: a complete one) and the newest but for
    one renamed into place as the kill came (before `last` moved); None: no checkpoint was complete."""
    last = run / "checkpoints" / "last"
    if not last.exists():
        return None
    ckpt = run / "checkpoints" / last.read_text().strip()
    assert complete(ckpt, like), f"{last} names a checkpoint that is not whole: {ckpt}"
    newer = [p for p in ckpt.parent.glob("step-*") if int(p.name[len("step-"):]) > int(ckpt.name[len("step-"):])]
    assert len(newer) <= 1, newer
    return ckpt


def newest_checkpoint(killed: list[Path], like: Path) -> Path | None:
    """The checkpoint a rerun takes up: the one `last` names in the newest killed run that has one."""
    for run in sorted(killed, key=lambda r: r.name, reverse=True):
        found = taken_up(run, like)
        if found:
            return found
    return None


@pytest.mark.slow
def test_kill_9_at_random_moments_of_ppo_then_rerun_each_time_ends_identical(reference):
    """A PPO run that checkpoints every iteration is killed (SIGKILL) four times - at random moments of the stage
    (seeded; the last at a random moment after its first complete checkpoint, so that a rerun always has one to take
    up, however long the machine takes to load), and once the moment it has begun writing a checkpoint - and rerun
    after each kill. Every rerun resumes from the newest complete checkpoint (never a half-written one), and the last
    one finishes with the metrics of the uninterrupted run."""
    root, ref = reference["root"], reference["ppo"]
    stage_root = Path(ref["run_dir"]).parent
    like = Path(ref["run_dir"]) / "checkpoints" / "step-1"
    cmd = [sys.executable, "-m", "rlhf", "ppo", "--exp", str(TINY), f"results_dir={root}", *ARGS]
    rng = random.Random(37)
    span = ref["wall_time_s"]
    expected, killed, halves, resumed = None, [], 0, 0
    for i in range(4):
        since = time.time()
        delay = rng.uniform(0, span / 2)
        ready = (inside_a_write(stage_root, since) if i == 1 else
                 after_a_checkpoint(stage_root, since, delay / 4) if i == 3 else at_random(stage_root, since, delay))
        run, proc, err = signal_when(cmd, signal.SIGKILL, ready, dict(os.environ), poll=0.001)
        if expected is not None:  # the rerun took up the newest complete checkpoint of the runs killed before it
            assert f"resuming {expected.parent.parent} from {expected.name}" in err, err[-2000:]
            resumed += 1
        if run is None:  # it finished before the kill
            assert proc.returncode == 0, err[-3000:]
            expected = None
            continue
        assert proc.returncode == -signal.SIGKILL and not (run / "summary.json").exists()
        killed.append(run)
        halves += half_written(run, since)
        assert (stage_root / "latest").read_text().strip() == Path(ref["run_dir"]).name  # no unfinished run
        expected = newest_checkpoint(killed, like)  # what a rerun takes up is whole
    assert len(killed) >= 3 and halves >= 1, (killed, halves)

    last = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert last.returncode == 0, last.stderr[-3000:]
    run_dir, final = records.latest(tiny(root, *ARGS), "ppo", "test")
    if expected is not None:
        assert f"resuming {expected.parent.parent} from {expected.name}" in last.stderr
        assert run_dir == expected.parent.parent and final["resumed_from"]["checkpoint"] == str(expected)
        resumed += 1
    assert resumed >= 1
    assert_same_result(final, ref)
    print(f"{len(killed)} kills ({halves} inside a checkpoint write), {resumed} reruns resumed")


@pytest.mark.slow
def test_a_run_the_guard_stopped_killed_in_its_final_checks_resumes_to_the_same_end(reference, tmp_path):
    """A PPO run the guard stops early (it leaves a tiny KL budget at a judge measurement: its checkpoint there, then
    the final checks) is killed (SIGKILL) once that checkpoint is complete; the rerun resumes from it and finishes
    as the uninterrupted run did, without training past the stop (it trained one iteration more before)."""
    root = tmp_path / "results"
    shutil.copytree(reference["root"], root)  # its SFT and RM, in a folder of this test's own (`latest` moves here)
    args = (*ARGS, "ppo.kl_band=[0.0,0.0001]", "ppo.judge_every=2", "ppo.judge_prompts=16",
            "reward.judge_functions={rlhf.inputs.data:letters_reward: 1}")  # the task's truth as the judge
    cmd = [sys.executable, "-m", "rlhf", "ppo", "--exp", str(TINY), f"results_dir={root}", *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ref = records.latest(tiny(root, *args), "ppo", "test")[1]
    stop = ref["metrics"]["stopped_early"]["iteration"]
    assert stop < 8 and ref["flags"], ref["metrics"]["stopped_early"]
    stage_root = Path(ref["run_dir"]).parent
    since = time.time()

    def at_the_stop():  # the stop's checkpoint is complete: the run is in its final checks
        run = claimed(stage_root, since)
        last = run / "checkpoints" / "last" if run else None
        return run if last and last.exists() and last.read_text().strip() == f"step-{stop}" else None

    run, proc, err = signal_when(cmd, signal.SIGKILL, at_the_stop, dict(os.environ), poll=0.001)
    assert run is not None and proc.returncode == -signal.SIGKILL, err[-3000:]
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and f"resuming {run} from step-{stop}" in again.stderr, again.stderr[-3000:]
    resumed = summary(run)
    assert resumed["metrics"]["stopped_early"] == ref["metrics"]["stopped_early"]
    assert resumed["flags"] == ref["flags"] and not (run / "checkpoints" / f"step-{stop + 1}").exists()
    assert_same_result(resumed, ref)


def test_ctrl_c_while_the_command_starts_is_one_line(tmp_path):
    """Ctrl-C while `python -m rlhf` still imports (before the stage's handler is in place): one line and 130, where
    Python printed a KeyboardInterrupt traceback (a whole screen of them with NPROC ranks), and where a Ctrl-C that
    landed in numpy's import (under torch's, under transformers') came out as transformers' ModuleNotFoundError, exit
    1: a window a few tens of milliseconds wide, so the Ctrl-C lands at ten points of the imports' first 2 s (they
    take 5-16 s on the machines seen)."""
    said = []
    for delay in [0.2 * i for i in range(1, 11)]:
        proc = subprocess.Popen([sys.executable, "-m", "rlhf", "sft", "--exp", str(TINY), f"results_dir={tmp_path}"],
                                cwd=ROOT, env=real_process_env(), stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=120)[1]
        said.append((delay, proc.returncode, err.strip()))
    stopped = ranks.STOPPED
    assert all(status == 130 and err == stopped for _, status, err in said), [
        s for s in said if s[1] != 130 or s[2] != stopped]
    assert not list(tmp_path.iterdir())  # nothing of a run was made


def test_ctrl_c_to_memcheck_stops_its_stage_and_removes_its_folder(tmp_path):
    """Ctrl-C to `make memcheck` (the terminal signals its process group) while a stage it measures runs: the
    command stops that stage, removes its temporary results folder and ends with one line and 130; the handler that
    covers the imports (exit at once) is gone by then (cli.imported), which would have left both behind."""
    proc = subprocess.Popen([sys.executable, "-m", "rlhf", "memcheck", "--stages", "sft"], cwd=ROOT,
                            env=real_process_env(TMPDIR=str(tmp_path)), stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 240
    while not list(tmp_path.glob("memcheck-*/memcheck/sft/*/")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)  # the stage's run folder: its process has started the stage
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    os.killpg(proc.pid, signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130 and err.strip().splitlines() == [ranks.STOPPED], err[-3000:]
    time.sleep(1)
    assert not list(tmp_path.glob("memcheck-*")), list(tmp_path.rglob("*"))[:20]  # removed, and nothing re-made it


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stage_a_signal_stopped_exits_as_the_shell_reports_that_signal(tmp_path, monkeypatch, capsys, sig, status):
    """Ctrl-C (SIGINT) exits 130 and SIGTERM 143, 128 + the signal as a shell reports it, after the stage's own
    checkpoint-and-stop (runtime.Interrupted)."""
    from rlhf.runs import runtime

    def stage_stopped_by_the_signal(stage, exp, **kwargs):
        signal.getsignal(sig)(sig, None)  # the handler cli.main installed, as the signal would call it
        raise runtime.Interrupted("sft stopped at step 2 with a checkpoint; rerun the same command to resume")

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(cli, "run_stage", stage_stopped_by_the_signal)
    monkeypatch.setattr(runtime._Stop, "requested", False)
    monkeypatch.setattr(runtime._Stop, "signum", 0)
    try:
        assert cli.main(["sft", "--exp", str(TINY), f"results_dir={tmp_path}"]) == status
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert "stopped: sft stopped at step 2" in capsys.readouterr().err


# a few steps of SFT to export and of the RM to resume: member 0, one ensemble member and the judge, 40 pairs each,
# an epoch of 5 steps
SMALL = ("data.sft_examples=32", "data.pref_pairs=80", "data.eval_examples=8", "eval.prompts=8", "sft.max_steps=2",
         "sft.batch_size=8", "rm.epochs=1", "rm.save_steps=2", "rm.logging_steps=1", "rm.batch_size=8",
         "rm.ensemble=2", "data.judge_fraction=0.5")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A results dir with a short SFT run: (root, its experiment)."""
    root = tmp_path_factory.mktemp("small")
    exp = tiny(root, *SMALL)
    sft.train(exp)
    return root, exp


def export_cmd(root: Path) -> list[str]:
    return ["export", "--exp", str(TINY), "--from-stage", "sft", "--merge", f"results_dir={root}", *SMALL]


def new_export(root: Path, before: set[Path]) -> Path:
    (run,) = run_dirs(root, "export") - before
    return run


@pytest.mark.slow
def test_a_merged_export_is_renamed_into_place_once_verified(small, monkeypatch, capsys):
    """The export's adapter and merged model are written to temp dirs: while the merged model is checked nothing is
    at adapter/ or merged/ (a kill there leaves nothing that looks exported); once it passed, both are in place and
    no temp dir is left."""
    from rlhf.recipes import export

    root, exp = small
    before, seen = run_dirs(root, "export"), []
    real = export.greedy

    def greedy(model, tok, prompts, e):
        run = (run_dirs(root, "export") - before).pop()
        seen.append(sorted(p.name for p in run.iterdir() if p.is_dir()))
        return real(model, tok, prompts, e)

    monkeypatch.setattr(export, "greedy", greedy)
    assert cli.main(export_cmd(root)) == 0
    run = new_export(root, before)
    # the adapter model's greedy tokens, then the merged model's reloaded from its temp dir
    assert seen == [[".adapter.tmp", ".merged.tmp"]] * 2
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["adapter", "merged"]
    assert (run / "merged" / "model.safetensors").exists() and (run / "adapter" / "adapter_config.json").exists()
    done = summary(run)
    assert done["metrics"]["greedy_tokens_match"] is True and done["metrics"]["merged"] == str(run / "merged")
    assert records.latest(exp, "export", "test")[0] == run


def _unfinished_export(root: Path, exp, name: str, pid: int, start: str | None) -> Path:
    """An export run dir as a kill of process `pid` leaves it: owner.json, a temp adapter and merged model, no
    summary."""
    run = records.stage_root(exp, "export") / name
    for tmp in (".adapter.tmp", ".merged.tmp"):
        (run / tmp).mkdir(parents=True)
        (run / tmp / "model.safetensors").write_bytes(b"x" * 3000)
    records.write_json(run / "owner.json", {**records.owner(), "pid": pid, "start": start})
    return run


@pytest.mark.slow
def test_an_export_removes_what_a_killed_export_left(small, capsys):
    """A SIGKILLed export leaves its temp adapter and merged model (a 7B's 14 GB) in a run that is never taken up
    again: the next export on the same host removes them, saying so, and leaves those of an export still running,
    and another host's (another container's), which it names."""
    root, exp = small
    dead = _unfinished_export(root, exp, "19990101-000000", _dead_pid(), None)
    live = _unfinished_export(root, exp, "19990101-000001", os.getppid(), records.process_start(os.getppid()))
    elsewhere = _unfinished_export(root, exp, "19990101-000002", _dead_pid(), None)  # another host's (a container)
    records.write_json(elsewhere / "owner.json", {**json.loads((elsewhere / "owner.json").read_text()),
                                                  "host": "another-host"})
    capsys.readouterr()
    assert cli.main(["export", "--exp", str(TINY), "--from-stage", "sft", f"results_dir={root}", *SMALL]) == 0
    err = capsys.readouterr().err
    assert not list(dead.glob(".*.tmp")) and (dead / "owner.json").exists()
    for kept in (live, elsewhere):  # a write that may be going on is kept; another host's is named
        assert sorted(p.name for p in kept.glob(".*.tmp")) == [".adapter.tmp", ".merged.tmp"]
    assert (f"{elsewhere / '.merged.tmp'} (3.0 kB) is an unfinished write of a export run on host another-host: "
            f"remove it once that run has ended") in err
    for tmp in (".adapter.tmp", ".merged.tmp"):
        assert f"removed {dead / tmp} (3.0 kB): the unfinished write of a killed export run" in err, err
    assert str(live) not in err
    for run in (dead, live, elsewhere):
        shutil.rmtree(run)


def _dead_pid() -> int:
    """The pid of a process that has ended."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["full disk", "error"])
def test_a_merged_export_that_fails_while_written_leaves_nothing(small, monkeypatch, capsys, failure):
    """The disk fills up (or the save raises) once the merged model's weights are written: the error is one line
    naming merged/ and what it needs, and the run dir keeps no adapter/, no merged/ and no temp dir (their space is
    given back); no summary, and `latest` still names the export before."""
    import transformers

    root, exp = small
    before = run_dirs(root, "export")
    latest = (records.stage_root(exp, "export") / "latest")
    pointer = latest.read_text() if latest.exists() else None
    real = transformers.PreTrainedModel.save_pretrained

    def save_then_fail(self, path, *args, **kwargs):
        real(self, path, *args, **kwargs)
        assert (Path(path) / "model.safetensors").exists()
        raise SafetensorError(ENOSPC) if failure == "full disk" else RuntimeError("the save broke")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", save_then_fail)
    if failure == "full disk":
        assert cli.main(export_cmd(root)) == 2
        run = new_export(root, before)
        line = error_line(capsys.readouterr().err)
        assert re.match(rf"error: export: no space left on device while writing merged model "
                        rf"{re.escape(str(run / 'merged'))} \(needs about [\d.]+ [kM]B, [\d.]+ [kMG]?B free\)", line)
    else:
        with pytest.raises(RuntimeError, match="the save broke"):
            export.export(exp, "sft", merge=True)
        run = new_export(root, before)
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == []
    assert not (run / "summary.json").exists()
    assert (latest.read_text() if latest.exists() else None) == pointer


@pytest.mark.slow
def test_a_merged_model_that_fails_its_greedy_check_is_not_left(small, monkeypatch):
    """The merged model reloaded generates other tokens than the adapter model: the export fails and leaves no
    merged/ (nor adapter/, nor a temp dir)."""
    root, exp = small
    before, calls = run_dirs(root, "export"), []
    real = export.greedy

    def greedy(*args):
        calls.append(1)
        out = real(*args)
        return out if len(calls) == 1 else out + 1  # the merged model's differ

    monkeypatch.setattr(export, "greedy", greedy)
    with pytest.raises(RuntimeError, match="does not generate what the adapter model does"):
        export.export(exp, "sft", merge=True)
    run = new_export(root, before)
    assert len(calls) == 2 and sorted(p.name for p in run.iterdir() if p.is_dir()) == []
    assert not (run / "summary.json").exists()


@pytest.mark.slow
def test_a_resumed_rm_logs_its_judge_and_ensemble_members_as_an_uninterrupted_run(small, monkeypatch):
    """The RM stopped while its judge trains (member 0 checkpointed at steps 2, 4 and 5, ensemble-1 trained), then
    rerun: it resumes member 0 from checkpoint-5 and trains ensemble-1 and the judge again from step 0; its
    metrics.jsonl has the same lines as a run never stopped, each member's every step once."""
    from rlhf.recipes import trainers

    root, exp = small
    reference = rm.train(exp)
    real = trainers.RecordCallback.on_step_end

    def killed_in_the_judge(self, args, state, control, **kwargs):
        if self.member == "judge" and state.global_step == 2:
            raise RuntimeError("killed")
        return real(self, args, state, control, **kwargs)

    before = run_dirs(root, "rm")
    with monkeypatch.context() as m:
        m.setattr(trainers.RecordCallback, "on_step_end", killed_in_the_judge)
        with pytest.raises(RuntimeError, match="killed"):
            rm.train(exp)
    (run,) = run_dirs(root, "rm") - before
    assert sorted(p.name for p in (run / "checkpoints").glob("checkpoint-*")) == [f"checkpoint-{n}" for n in (2, 4, 5)]
    resumed = rm.train(exp)
    assert resumed["run_dir"] == str(run) and resumed["resumed_from"]["step"] == 5
    lines, ref = metric_lines(run), metric_lines(reference["run_dir"])
    for member in ("judge", "ensemble-1"):
        steps = [row["step"] for row in lines if f"{member}/loss" in row]
        assert steps == [1, 2, 3, 4, 5], member  # every step once
    assert len(lines) == len(ref)
    for a, b in zip(lines, ref):
        assert {k: v for k, v in a.items() if k != "train_loss"} == {k: v for k, v in b.items() if k != "train_loss"}


@pytest.mark.slow
@pytest.mark.parametrize("length", ["sft.max_steps=3", "sft.epochs=0.375"])  # 3 steps of an 8-step epoch, both
def test_a_run_killed_after_its_last_checkpoint_resumes_there_without_a_step_past_its_end(tmp_path, length):
    """Killed once its checkpoint at its last step (mid-epoch: max_steps, or a fraction of an epoch) is written,
    before its summary: the rerun takes that checkpoint as the run's end. transformers, resumed there, trained one
    step more (checkpoint-4 of 3), which at a constant learning rate changed the adapter."""
    exp = tiny(tmp_path, *DATA, length, "sft.save_steps=3", "sft.batch_size=8", "sft.logging_steps=2",
               "sft.lr_scheduler=constant")  # step 3 is not logged yet when its checkpoint is written
    done = sft.train(exp)
    run = Path(done["run_dir"])
    lines = metric_lines(run)
    shutil.rmtree(run / "adapter")  # what a kill after checkpoint-3 leaves: no adapter, summary or `latest`
    (run / "summary.json").unlink()
    (run.parent / "latest").unlink()
    resumed = sft.train(exp)
    assert resumed["run_dir"] == str(run) and resumed["resumed_from"]["step"] == 3
    assert sorted(p.name for p in (run / "checkpoints").glob("checkpoint-*")) == ["checkpoint-3"]
    assert resumed["throughput"]["trained_tokens"] == 0  # nothing left to train
    for k, v in done["metrics"].items():
        assert resumed["metrics"][k] == (pytest.approx(v, rel=1e-12) if k == "train_loss" else v), k
    again = metric_lines(run)
    assert [{k: v for k, v in a.items() if k != "train_loss"} for a in again] == [
        {k: v for k, v in a.items() if k != "train_loss"} for a in lines]
    losses = [[a["train_loss"] for a in rows if "train_loss" in a] for rows in (again, lines)]
    assert len(losses[0]) == 1 and losses[0] == pytest.approx(losses[1], rel=1e-12)  # train()'s last line, re-summed
    assert resumed["lineage"]["adapter_sha256"] == done["lineage"]["adapter_sha256"]
