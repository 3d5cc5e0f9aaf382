"""Reproducibility on CPU: lineage fingerprints and --reuse, bitwise-identical reruns, kill-and-resume equal to an
uninterrupted run, and no secret from the environment or a URL's password in any run record."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf import cli
from rlhf.inputs import data
from rlhf.recipes import dpo, grpo, ppo, rm, sft
from rlhf.runs import lineage, records

from .avx512bf16.sitecustomize import force as force_avx512bf16
from .conftest import ROOT, TINY, printed_run_dir, tiny

DATA = ("data.sft_examples=64", "data.pref_pairs=80", "data.ppo_prompts=64", "data.eval_examples=16",
        "eval.prompts=16")
SMALL = ("sft.epochs=1", "sft.batch_size=4", "sft.logging_steps=3", "sft.save_steps=2",
         "rm.epochs=1", "rm.batch_size=8", "rm.logging_steps=1",
         "dpo.epochs=1", "dpo.batch_size=4", "dpo.logging_steps=3", "dpo.save_steps=2", "dpo.discopop_tau=0.1",
         "ppo.steps=4", "ppo.save_steps=2", "ppo.rollout_batch=16", "ppo.minibatch=8", "ppo.micro_batch=8",
         "ppo.num_ppo_epochs=1", "ppo.log_samples_every=2",
         "grpo.steps=4", "grpo.save_steps=2", "grpo.rollout_batch=16", "grpo.num_generations=4", "grpo.minibatch=8",
         "grpo.micro_batch=8", "grpo.num_iterations=1", "grpo.log_samples_every=2")
ALL = DATA + SMALL
"""SFT and DPO log every 3 steps and checkpoint every 2: a kill after checkpoint-2 resumes with two steps the
trainer had not logged yet, which the first log after the resume averages in (trainers.restore_unlogged). DPO's
discopop_tau without the discopop loss changes nothing, which its stage says."""
TRAIN = {"sft": sft.train, "rm": rm.train, "dpo": dpo.train, "ppo": ppo.train, "grpo": grpo.train}
VOLATILE_SUFFIXES = ("time", "_runtime", "_per_second", "tokens_per_s")  # time, train_runtime, eval_..._per_second


def stable(row: dict) -> dict:
    """A metrics line without wall-clock, throughput and memory figures."""
    return {k: v for k, v in row.items() if not k.endswith(VOLATILE_SUFFIXES) and not k.startswith(("time/", "memory/"))}


def metric_lines(run_dir) -> list[dict]:
    return [stable(json.loads(line)) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def summary(run_dir) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def run_dirs(root, stage) -> set[Path]:
    return {d for d in records.stage_root(tiny(root), stage).glob("2*") if d.is_dir()}


@pytest.fixture(scope="module")
def twice(tmp_path_factory):
    """Every stage run twice in a row with the same config and seed: {stage: (summary A, summary B)}. B runs with
    bitsandbytes deciding as on a CPU with AVX512-BF16 (tests/avx512bf16), A as this CPU decides: equal results mean
    the CPU does not change what a stage learns, samples or measures."""
    root = tmp_path_factory.mktemp("repro")
    exp = tiny(root, *ALL)
    out = {"root": root, "exp": exp}
    for stage, fn in TRAIN.items():
        a = fn(exp)
        with pytest.MonkeyPatch.context() as mp:
            refused = force_avx512bf16(mp.setattr)
            out[stage] = (a, fn(exp))
        assert refused == [], stage
    return out


def test_stage_config_hash_covers_only_what_the_stage_uses(tmp_path):
    base = tiny(tmp_path, *ALL)
    h = {s: lineage.sha256_json(lineage.stage_config(base, s)) for s in TRAIN}

    def changed(override):
        exp = tiny(tmp_path, *ALL, override)
        return {s for s in TRAIN if lineage.sha256_json(lineage.stage_config(exp, s)) != h[s]}

    assert changed("sft.learning_rate=1e-3") == {"sft"}
    assert changed("ppo.kl_coef=0.2") == {"ppo"}
    assert changed("data.ppo_prompts=32") == {"ppo", "grpo"}  # the prompts every online RL stage samples
    assert changed("grpo.beta=0.1") == {"grpo"}
    assert changed("reward.functions={rlhf.inputs.data:letters_reward: 1}") == {"ppo", "grpo"}  # what scores responses
    assert changed("dpo.beta=0.5") == {"dpo"}
    assert changed("lora.r=8") == set(TRAIN)
    assert changed("seed=1") == set(TRAIN)
    assert changed("memory.budget_gb=8") == changed("tracking.backend=wandb") == changed("name=other") == set()


def test_deterministic_mode_restricts_torch_and_reaches_trl(tmp_path, monkeypatch):
    import torch

    from rlhf.runs.runtime import seed_everything
    from rlhf.recipes.trainers import settings, training_args
    from trl import SFTConfig

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    exp = tiny(tmp_path, "deterministic=true")
    try:
        seed_everything(0, True)
        assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        seed_everything(0, False)
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)

    class _Run:
        dir, stage = tmp_path, "sft"

    args = training_args(SFTConfig, settings(exp), exp.sft, type("S", (), {"run": _Run})())
    assert args.full_determinism and args.seed == exp.seed and args.data_seed == exp.seed
    assert lineage.compute(exp, "sft", {"train": [1]})["determinism"]["mode"] == "deterministic"
    assert lineage.compute(exp, "sft", {"train": [1]})["fingerprint"] != \
        lineage.compute(tiny(tmp_path), "sft", {"train": [1]})["fingerprint"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(TRAIN))
def test_reruns_are_bitwise_identical(twice, stage):
    """...also when bitsandbytes decides as on another CPU (B: as on one with AVX512-BF16)."""
    a, b = twice[stage]
    assert a["run_dir"] != b["run_dir"]
    assert a["metrics"] == b["metrics"]
    lines_a, lines_b = metric_lines(a["run_dir"]), metric_lines(b["run_dir"])
    assert len(lines_a) >= 4 and lines_a == lines_b
    assert a["lineage"]["fingerprint"] == b["lineage"]["fingerprint"]
    assert a["lineage"]["adapter_sha256"] == b["lineage"]["adapter_sha256"] is not None
    assert a["lineage"]["determinism"] == {"seed": 0, "mode": "default", "device": "cpu", "torch_deterministic": False}
    if stage != "sft":  # B consumed the second SFT run: another record, the same fingerprint and adapter bytes
        up_a, up_b = a["lineage"]["upstream"]["sft"], b["lineage"]["upstream"]["sft"]
        assert up_a["fingerprint"] == up_b["fingerprint"] and up_a["adapter_sha256"] == up_b["adapter_sha256"]


@pytest.mark.slow
def test_a_dpo_option_that_changes_nothing_is_the_dpo_stages_warning(twice):
    """Set in the config and read by no loss it names, the option is said once, by the DPO stage as it starts, among
    its summary's warnings: not by the other stages that load the same config."""
    note = "dpo: dpo.discopop_tau is read only by loss_type discopop: it changes nothing here"
    assert twice["dpo"][0]["warnings"].count(note) == 1, twice["dpo"][0]["warnings"]
    assert not [s for s in TRAIN if s != "dpo" and note in twice[s][0].get("warnings", [])]


@pytest.mark.slow
def test_lineage_names_the_consumed_runs(twice):
    ppo_b = twice["ppo"][1]
    up = ppo_b["lineage"]["upstream"]
    assert set(up) == {"sft", "rm"}
    assert up["sft"]["run"] == twice["sft"][1]["run_dir"] and up["rm"]["run"] == twice["rm"][1]["run_dir"]
    assert up["rm"]["fingerprint"] == twice["rm"][1]["lineage"]["fingerprint"]
    assert up["sft"]["adapter_sha256"] == lineage.adapter_sha256(twice["sft"][1]["model"]["adapter"])
    assert ppo_b["lineage"]["data_sizes"] == {"train": 64, "eval": 16}
    eval_ids = [r["id"] for r in data.load(twice["exp"]).eval[:16]]
    assert ppo_b["lineage"]["data_hash"] == lineage.sha256_json({"train": ppo_b["inputs"]["train_ids"],
                                                                 "eval": eval_ids})
    assert json.loads((Path(ppo_b["run_dir"]) / "lineage.json").read_text())["fingerprint"] == \
        ppo_b["lineage"]["fingerprint"]


def printed_summary(out: str) -> dict:
    """The summary of the run whose table the CLI prints last (the trainer's bars come before it)."""
    return json.loads((Path(printed_run_dir(out)) / "summary.json").read_text())


def _main(capsys, stage, *overrides, reuse=True):
    rc = cli.main([stage, "--exp", str(TINY), *(["--reuse"] if reuse else []), *overrides])
    out = capsys.readouterr().out
    assert rc == 0, out
    return out


@pytest.mark.slow
def test_reuse_skips_unchanged_stages_and_reruns_changed_ones(twice, capsys):
    root = twice["root"]
    args = (f"results_dir={root}", *ALL)
    sft_b, rm_b, ppo_b = twice["sft"][1]["run_dir"], twice["rm"][1]["run_dir"], twice["ppo"][1]["run_dir"]
    n_sft, n_rm = len(run_dirs(root, "sft")), len(run_dirs(root, "rm"))
    assert _main(capsys, "sft", *args).strip() == f"reusing {sft_b}"
    assert _main(capsys, "rm", *args).strip() == f"reusing {rm_b}"
    assert str(cli.reusable("ppo", tiny(root, *ALL))) == ppo_b
    # a PPO-only change reruns PPO, not SFT or RM
    assert _main(capsys, "sft", *args, "ppo.kl_coef=0.2").startswith("reusing")
    assert _main(capsys, "rm", *args, "ppo.kl_coef=0.2").startswith("reusing")
    assert cli.reusable("ppo", tiny(root, *ALL, "ppo.kl_coef=0.2")) is None
    assert (len(run_dirs(root, "sft")), len(run_dirs(root, "rm"))) == (n_sft, n_rm)
    # a changed SFT config retrains SFT, saying why, and so RM (its fingerprint contains SFT's) - once
    assert cli.main(["sft", "--exp", str(TINY), "--reuse", *args, "sft.learning_rate=1e-3"]) == 0
    out, err = capsys.readouterr()
    assert not out.startswith("reusing") and len(run_dirs(root, "sft")) == n_sft + 1
    assert f"sft: not reusing {sft_b}: its inputs differ (sft.learning_rate: 0.003 -> 0.001); a new run trains\n" in err
    assert cli.reusable("rm", tiny(root, *ALL, "sft.learning_rate=1e-3")) is None
    with pytest.raises(records.StageInputError, match="another SFT adapter"):  # PPO needs the RM rerun first
        cli.reusable("ppo", tiny(root, *ALL, "sft.learning_rate=1e-3"))
    out = _main(capsys, "rm", *args, "sft.learning_rate=1e-3")
    assert not out.startswith("reusing") and len(run_dirs(root, "rm")) == n_rm + 1
    new_rm = printed_summary(out)["run_dir"]
    assert _main(capsys, "rm", *args, "sft.learning_rate=1e-3").strip() == f"reusing {new_rm}"
    assert cli.reusable("ppo", tiny(root, *ALL, "sft.learning_rate=1e-3")) is None
    # back to the first SFT config: reused, and `latest` points at it again; PPO refuses the RM of the other SFT
    assert _main(capsys, "sft", *args).strip() == f"reusing {sft_b}"
    with pytest.raises(records.StageInputError, match="another SFT adapter"):
        ppo.prepare(tiny(root, *ALL))
    # the original configs are all reused again
    assert _main(capsys, "rm", *args).strip() == f"reusing {rm_b}"
    assert str(cli.reusable("ppo", tiny(root, *ALL))) == ppo_b
    # without --reuse a stage always trains
    out = _main(capsys, "sft", *args, reuse=False)
    assert printed_summary(out)["run_dir"] not in (sft_b,) and len(run_dirs(root, "sft")) == n_sft + 2


def _command(root, stage):
    return [sys.executable, "-m", "rlhf", stage, "--exp", str(TINY), f"results_dir={root}", *ALL]


def signal_when(cmd: list[str], sig: int, ready, env: dict, poll: float = 0.02, timeout: float = 300):
    """Run the stage command `cmd` and send `sig` to the process training its run (the owner.json of the run dir
    `ready()`, called every `poll` seconds, returns: `cmd`'s own process, or the fork server's child that serves
    it, the client then ending as its child did) as soon as there is one; (that run dir, or None when the process
    ended first, the process, its stderr)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + timeout
    run = None
    while time.time() < deadline and proc.poll() is None:
        run = ready()
        if run is not None:
            with contextlib.suppress(ProcessLookupError, FileNotFoundError):  # it ended meanwhile: the caller says so
                os.kill(json.loads((run / "owner.json").read_text())["pid"], sig)
            break
        time.sleep(poll)
    _, err = proc.communicate(timeout=timeout)
    return run, proc, err


def kill_then_resume(root, stage: str, sig: int, checkpoint: str, env: dict):
    """Run `stage` in a subprocess, send `sig` once `checkpoint` is complete, then rerun the same command; both
    with `env` (bitsandbytes deciding as on a CPU with AVX512-BF16: conftest's avx512bf16_env)."""
    before = run_dirs(root, stage)
    marker = "state.json" if checkpoint.startswith("step-") else "rlhf_state.json"

    def ready():
        new = run_dirs(root, stage) - before
        return next(iter(new)) if new and (next(iter(new)) / "checkpoints" / checkpoint / marker).exists() else None

    run, proc, err = signal_when(_command(root, stage), sig, ready, env)
    assert run is not None, f"no {checkpoint} before the run ended: {err[-2000:]}"
    assert not (run / "summary.json").exists(), "the run finished before the signal landed"
    again = subprocess.run(_command(root, stage), cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    return run, proc, err, again


def assert_same_result(resumed: dict, reference: dict):
    for k, v in reference["metrics"].items():
        if k == "train_loss":  # re-summed from the checkpoint's loss sum: same terms, another order
            assert resumed["metrics"][k] == pytest.approx(v, rel=0, abs=1e-9), k
        else:
            assert resumed["metrics"][k] == v, k
    lines, ref = metric_lines(resumed["run_dir"]), metric_lines(reference["run_dir"])
    assert len(lines) == len(ref)
    for a, b in zip(lines, ref):
        assert a.keys() == b.keys()
        assert {k: v for k, v in a.items() if k != "train_loss"} == {k: v for k, v in b.items() if k != "train_loss"}
    assert resumed["lineage"]["fingerprint"] == reference["lineage"]["fingerprint"]
    assert resumed["lineage"]["adapter_sha256"] == reference["lineage"]["adapter_sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_sigkill_then_rerun_resumes_to_the_same_result(twice, stage, avx512bf16_env):
    run, proc, err, again = kill_then_resume(twice["root"], stage, signal.SIGKILL, "checkpoint-2", avx512bf16_env)
    assert proc.returncode == -signal.SIGKILL
    assert f"resuming {run} from checkpoint-" in again.stderr
    resumed = summary(run)
    assert resumed["run_dir"] == str(run) and resumed["resumed_from"]["step"] >= 2
    assert resumed["metrics"]["train_steps"] == 16 and resumed["resumed_from"]["step"] < 16
    assert_same_result(resumed, twice[stage][0])
    times = [json.loads(x)["time"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert times == sorted(times) and resumed["wall_time_s"] >= times[-1]  # the clock went on from the kept lines


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["ppo", "grpo"])
def test_sigterm_checkpoints_stops_and_rerun_resumes_online_rl(twice, stage, avx512bf16_env):
    run, proc, err, again = kill_then_resume(twice["root"], stage, signal.SIGTERM, "step-2", avx512bf16_env)
    assert proc.returncode == 143 and "rerun the same command to resume" in err and "Traceback" not in err
    resumed = summary(run)
    stopped_at = resumed["resumed_from"]["step"]
    assert 2 <= stopped_at < 4 and (run / "checkpoints" / f"step-{stopped_at}" / "state.json").exists()
    assert_same_result(resumed, twice[stage][0])
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [x["step"] for x in logged]
    # four iterations, then the judge's measurement of the policy after the last update (iteration 5)
    assert steps == sorted(steps) and max(x["step"] for x in logged if "kl/ref" in x) == 4
    assert steps[-1] == 5 and "overopt/judge" in logged[-1] and "kl/ref" not in logged[-1]


@pytest.mark.parametrize("text, shown", [
    ("postgresql://alice:s3cr3t@db:5432/sweeps", "postgresql://alice:<redacted>@db:5432/sweeps"),
    ("error: x.yaml: storage 'postgresql+psycopg2://a:p%40ss@h/db': refused",
     "error: x.yaml: storage 'postgresql+psycopg2://a:<redacted>@h/db': refused"),
    ("https://user:hf_tok@huggingface.co/x and https://wandb.ai/?api_key=abc&x=1",
     "https://user:<redacted>@huggingface.co/x and https://wandb.ai/?api_key=<redacted>&x=1"),
    ("postgresql://h/db?password=zz&sslmode=require", "postgresql://h/db?password=<redacted>&sslmode=require"),
    ("postgresql://alice@db/sweeps, sqlite:///results/sweeps/x.db", "postgresql://alice@db/sweeps, "
                                                                     "sqlite:///results/sweeps/x.db"),
])
def test_scrub_redacts_the_credentials_of_every_url(text, shown):
    assert records.scrub(text, []) == shown
    assert records.scrub({"a": [text]}, []) == {"a": [shown]}


def test_scrub_redacts_a_password_of_a_url_in_the_environment_wherever_it_appears(monkeypatch):
    monkeypatch.setenv("RLHF_SWEEP_STORAGE", "postgresql://alice:hunter2x@db/sweeps")
    monkeypatch.setenv("PGPASSWORD", "another-pass")
    assert records.scrub("auth failed for hunter2x; another-pass") == "auth failed for <redacted>; <redacted>"


@pytest.mark.slow
def test_no_secret_from_the_environment_reaches_the_run_record(tmp_path):
    secrets = {"WANDB_API_KEY": "sentinel-wandb-0123456789abcdef", "HF_TOKEN": "hf_sentinelTOKEN42",
               "HUGGING_FACE_HUB_TOKEN": "hf_sentinelHUB43", "MY_SERVICE_SECRET": "sentinel-other-secret"}
    env = {k: v for k, v in os.environ.items() if k != "RLHF_DISABLE_TRACKING"}
    env.update(secrets, WANDB_MODE="offline")
    env.pop("WANDB_SILENT", None)
    cmd = [sys.executable, "-m", "rlhf", "sft", "--exp", str(TINY), f"results_dir={tmp_path}", *DATA,
           "sft.max_steps=2", "sft.batch_size=8", "sft.logging_steps=1", "sft.save_steps=1", "tracking.backend=wandb",
           f"data.path=https://user:{secrets['HF_TOKEN']}@example.com/x.jsonl"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = run_dirs(tmp_path, "sft")
    assert list((run / "wandb").rglob("*")), "the W&B offline run wrote nothing"
    # W&B is silent; the summary's last rows say where its run is and how to upload it, in one line
    offline = json.loads((run / "summary.json").read_text())["tracking"]["offline_dir"]
    assert Path(offline).parent == run / "wandb" and Path(offline).is_dir()
    assert re.search(rf"^  W&B +offline; upload with: wandb sync {re.escape(offline)}$", out.stdout, re.M), out.stdout
    assert "wandb:" not in out.stdout + out.stderr, out.stdout + out.stderr
    assert "<redacted>" in (run / "config.yaml").read_text()
    files = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert len(files) > 20
    for f in files:
        blob = f.read_bytes()
        for name, value in secrets.items():
            assert value.encode() not in blob, f"{name} in {f}"
    for value in secrets.values():
        assert value not in out.stdout + out.stderr
