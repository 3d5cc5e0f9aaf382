"""Whether a data-parallel run killed and rerun ends where an uninterrupted one ends, and whether its ranks die with
their launcher (docs/multi-gpu.md, "Killed and resumed"): each stage on NPROC ranks (torchrun; gloo on CPU), first
uninterrupted, then killed (SIGKILL) at three moments in turn, each launch resuming the last, then run to its end.

    python studies/dp_kill_resume.py OUT [--stages ppo,grpo,sft] [--nproc 2] [KEY=VALUE ...]

The kills come from inside rank 0 (tests/killpoint.py): PPO and GRPO inside a checkpoint write, inside a judge
measurement, and by a kill of the launcher alone inside a later checkpoint write (the ranks must then die on their
own); SFT as an optimizer step begins, inside a checkpoint write, and the launcher alone as a later step begins.
Prints, per stage, the checkpoints the reruns resumed from, how long the ranks outlived their launcher at most, and
how many final metrics and metrics.jsonl figures (time and memory left out: studies/same_runs.py) differ from the
uninterrupted run's. Exit 1 when any differs, a kill came too late, or a rank outlived its launcher by 30 s.
KEY=VALUE overrides go after the defaults below (tiny.yaml, shortened to run in minutes on a CPU)."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from studies.same_runs import figures  # noqa: E402

EXP = ROOT / "experiments" / "tiny.yaml"
DEFAULTS = ["data.sft_examples=128", "data.pref_pairs=64", "data.ppo_prompts=64", "data.eval_examples=16",
            "data.judge_fraction=0.25", "eval.prompts=8",
            "sft.epochs=1", "sft.batch_size=16", "sft.logging_steps=1", "sft.save_steps=1", "sft.warmup_ratio=0",
            "rm.epochs=1", "rm.batch_size=16", "rm.logging_steps=1",
            *(f"{s}.{k}" for s in ("ppo", "grpo") for k in (
                "steps=8", "save_steps=1", "rollout_batch=8", "minibatch=8", "micro_batch=4", "epochs=1",
                "judge_every=3", "judge_prompts=8")),
            "grpo.num_generations=4"]
KILLS = {"ppo": ["write:2", "judge:4", "write:6:launcher"], "grpo": ["write:2", "judge:4", "write:6:launcher"],
         "sft": ["train:3", "write:5", "train:7:launcher"]}
OUTLIVE_S = 30  # the longest a rank may outlive its launcher


def alive(pid: int) -> bool:
    """A process that has not exited (a zombie waiting for its reaper has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def launch(stage: str, args: list[str], work: Path, kill: str | None = None, nproc: int = 2,
           env: dict | None = None) -> tuple[int, str, float]:
    """`python -m rlhf STAGE --exp tiny.yaml ARGS` on `nproc` ranks under torchrun, killed at `kill` (RLHF_TEST_KILL:
    tests/killpoint.py; None: run to the end): (the launcher's exit status, its stderr, the seconds the last rank
    outlived the launcher, at most OUTLIVE_S: a rank still there then is killed). Output goes to files in `work`:
    a rank that outlived the launcher would hold a pipe open."""
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("rank-*.pid"):
        old.unlink()
    env = {**(env or os.environ), "PYTHONPATH": str(ROOT), "RLHF_TEST_PIDS": str(work)}
    env.pop("RLHF_TEST_KILL", None)
    env.pop("RLHF_FORKSERVER", None)  # a process of its own: torchrun's
    if kill:
        env["RLHF_TEST_KILL"] = kill
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           free_port(), "-m", "tests.killpoint", stage, "--exp", str(EXP), *args]
    with open(work / "out", "w+") as out, open(work / "err", "w+") as err:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, timeout=1800).returncode
        gone = time.time()
        err.seek(0)
        text = err.read()
    ranks = [int(p.read_text()) for p in work.glob("rank-*.pid")]
    while any(map(alive, ranks)) and time.time() - gone < OUTLIVE_S:
        time.sleep(0.1)
    outlived = time.time() - gone
    for pid in ranks:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    return code, text, outlived


def resumed_from(err: str) -> tuple[str, str] | None:
    """(run, checkpoint) a launch resumed (its stderr's "resuming RUN from CHECKPOINT"), or None."""
    m = re.search(r"resuming (\S+) from (\S+)", err)
    return (m.group(1), m.group(2)) if m else None


def differing(run: Path, reference: Path) -> dict:
    """The figures (final metrics, metrics.jsonl lines; not time or memory) that differ: {name: (run's,
    reference's)}."""
    a, b = figures(run), figures(reference)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k, "absent") != b.get(k, "absent")}


def latest(out: Path, name: str, stage: str) -> Path:
    d = out / name / stage
    return d / (d / "latest").read_text().strip()


def check(out: Path, stage: str, kills: list[str], args: list[str], nproc: int = 2) -> tuple[bool, str]:
    """One stage: the uninterrupted run, then the killed ones and the last rerun (under OUT/<stage>-killed); (ok, its
    report line)."""
    base = [f"results_dir={out}", *DEFAULTS, *args]
    for up in (["sft"] if stage in ("ppo", "grpo") else []) + (["rm"] if stage in ("ppo", "grpo") else []):
        p = subprocess.run([sys.executable, "-m", "rlhf", up, "--reuse", "--exp", str(EXP), *base, f"name=dp-{stage}"],
                           cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"{up} (upstream of {stage}) failed:\n{p.stderr[-3000:]}")
    work = out / "launches"
    code, err, _ = launch(stage, [*base, f"name=dp-{stage}"], work, None, nproc)
    if code:
        raise SystemExit(f"the uninterrupted {stage} run failed:\n{err[-3000:]}")
    reference = latest(out, f"dp-{stage}", stage)
    resumed, outlived, problems = [], 0.0, []
    for kill in [*kills, None]:
        code, err, s = launch(stage, [*base, f"name=dp-{stage}"], work, kill, nproc)
        outlived = max(outlived, s)
        found = resumed_from(err)
        if found:
            resumed.append(Path(found[1]).name)
        if kill and code == 0:
            problems.append(f"finished before the kill at {kill}")
        if kill is None and code:
            raise SystemExit(f"the last {stage} rerun failed:\n{err[-3000:]}")
    if outlived >= OUTLIVE_S:
        problems.append(f"a rank outlived its launcher by {OUTLIVE_S} s")
    final = latest(out, f"dp-{stage}", stage)
    diff = differing(final, reference) if final != reference else {"run": ("not a new run", "")}
    n = len(figures(reference))
    line = (f"{stage}: {len(kills)} kills ({', '.join(kills)}), reruns resumed from {', '.join(resumed) or 'nothing'}; "
            f"ranks outlived their launcher by at most {outlived:.1f} s; {len(diff)} of {n} figures differ from the "
            f"uninterrupted {nproc}-rank run")
    for k, (a, b) in list(diff.items())[:10]:
        line += f"\n  {k}: {a} (killed and rerun) vs {b}"
    for p in problems:
        line += f"\n  {p}"
    return not diff and not problems, line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--stages", default="ppo,grpo,sft")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    ok = True
    for stage in args.stages.split(","):
        good, line = check(args.out.resolve(), stage, KILLS[stage], args.overrides, args.nproc)
        print(line, flush=True)
        ok &= good
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
