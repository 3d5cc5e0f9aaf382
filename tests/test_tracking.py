"""W&B runs that can be found and compared: named by experiment, stage and run (a sweep trial's by its swept
values), tagged experiment:, stage:, commit:, and every stage's keys under TRL's convention (rlhf/runs/tracking.py). Read
back from the offline run's own log (WANDB_MODE=offline: no account)."""

import json
import time
from pathlib import Path

from transformers.integrations.integration_utils import rewrite_logs
from wandb.proto import wandb_internal_pb2

from rlhf.runs import records, tracking

from .conftest import tiny

# what the stages log (metrics.jsonl): TRL's trainers' keys, an RM judge's, and the online stages' namespaced ones
TRL_LOGS = {"loss": 0.9, "grad_norm": 1.2, "learning_rate": 1e-4, "epoch": 0.5, "memory/peak_gb": 0.1}
EVAL_LOGS = {"eval_loss": 1.1, "eval_accuracy": 0.8, "judge/eval_loss": 1.3}
ONLINE_LOGS = {"reward/mean": 0.4, "reward/kl_penalty": 0.02, "kl/ref": 1.5, "policy_loss": -0.1,
               "overopt/judge_gain": 0.2}


def offline_records(run_dir: Path):
    """The protobuf records of the one offline W&B run under `run_dir` (its run-*.wandb log: a 7-byte header, then
    32 KiB blocks of records, each a 7-byte header - checksum, length, kind - and its bytes; kind 1 is a whole
    record, 2-4 the first, middle and last piece of one)."""
    paths = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(paths) <= 1, paths
    data, pos, piece = paths[0].read_bytes() if paths else b"", 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # still being written
            return
        piece += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(piece)
            piece = b""
            yield record


def logged_run(tmp_path, monkeypatch, stage: str, logs: list[dict], sweep: dict | None = None):
    """A W&B offline run of `stage` that logs `logs`, one step each; (its run record, every logged key)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    if sweep is None:
        monkeypatch.delenv("RLHF_SWEEP", raising=False)
    else:
        monkeypatch.setenv("RLHF_SWEEP", json.dumps(sweep))
    run_dir = tmp_path / "20261126-000000-000001"
    run_dir.mkdir()
    tracker = tracking.WandbTracker(tiny(tmp_path, "tracking.backend=wandb"), stage, run_dir)
    for step, metrics in enumerate(logs):
        tracker.log(metrics, step)
    tracker.finish()
    deadline = time.time() + 60  # W&B's service writes the log apart from this process: until the run's exit record
    while True:
        found = list(offline_records(run_dir))
        if any(r.WhichOneof("record_type") == "exit" for r in found):
            break
        assert time.time() < deadline, [r.WhichOneof("record_type") for r in found]
        time.sleep(0.2)
    (run,) = [r.run for r in found if r.WhichOneof("record_type") == "run"]
    keys = {item.key or "/".join(item.nested_key) for r in found if r.WhichOneof("record_type") == "history"
            for item in r.history.item}
    return run, {k for k in keys if not k.startswith("_")}


def test_a_stage_run_is_named_and_tagged_and_logs_trls_keys(tmp_path, monkeypatch):
    run, keys = logged_run(tmp_path, monkeypatch, "sft", [TRL_LOGS, EVAL_LOGS])
    commit, dirty = records.git_state()
    assert run.display_name == "tiny sft 20261126-000000-000001"
    assert list(run.tags) == ["experiment:tiny", "stage:sft", f"commit:{commit[:12]}{'-dirty' if dirty else ''}"]
    assert keys == {"train/loss", "train/grad_norm", "train/learning_rate", "train/epoch", "train/memory/peak_gb",
                    "eval/loss", "eval/accuracy", "train/judge/eval_loss", "train/global_step"}


def test_an_online_sweep_trials_run_names_its_swept_values_and_logs_under_train(tmp_path, monkeypatch):
    trial = {"study": "grpo-beta", "trial": 7, "params": {"grpo.beta": 0.0123456, "lora.r": 8}}
    run, keys = logged_run(tmp_path, monkeypatch, "grpo", [ONLINE_LOGS, ONLINE_LOGS], trial)
    assert run.display_name == "tiny grpo grpo-beta trial 7 grpo.beta=0.01235 lora.r=8"
    assert list(run.tags)[:2] == ["experiment:tiny", "stage:grpo"] and list(run.tags)[3] == "sweep:grpo-beta"
    assert keys == {f"train/{k}" for k in ONLINE_LOGS} | {"train/global_step"}


def test_the_keys_are_the_ones_transformers_wandb_callback_logs():
    for logs in (TRL_LOGS, EVAL_LOGS, ONLINE_LOGS, {"test_loss": 1.0, "train_loss": 2.0}):
        assert tracking.trl_keys(logs) == rewrite_logs(logs)


def test_a_finished_record_is_readable_by_others_as_the_umask_says(tmp_path, monkeypatch):
    """A run record's files get the mode any new file gets here (0o644 under umask 022), not mkstemp's or safetensors'
    0o600: results a container wrote as root (`make docker-run` mounts results/) read on the host."""
    import os
    import stat

    import torch
    from safetensors.torch import save_file

    monkeypatch.setattr(records, "FILE_MODE", 0o644)  # the suite's umask may be anything: the usual one's mode
    run = records.Run(tiny(tmp_path), "sft")
    (run.dir / "adapter").mkdir()
    save_file({"w": torch.zeros(2)}, str(run.dir / "adapter" / "adapter_model.safetensors"))
    assert stat.S_IMODE((run.dir / "adapter" / "adapter_model.safetensors").stat().st_mode) == 0o600  # the library's
    os.chmod(run.dir / "metrics.jsonl", 0o640)  # a mode someone chose (not owner-only) is left alone
    run.finish({"metrics": {}})
    modes = {p.relative_to(run.dir).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in run.dir.rglob("*") if p.is_file()}
    assert modes.pop("metrics.jsonl") == 0o640
    assert modes == dict.fromkeys(("config.yaml", "env.json", "owner.json", "summary.json",
                                   "adapter/adapter_model.safetensors"), 0o644), modes
    assert stat.S_IMODE((run.dir.parent / "latest").stat().st_mode) == 0o644


def test_a_local_base_is_the_same_however_its_path_is_written(tmp_path, monkeypatch):
    """An SFT run made with model.name=./mymodel is the base of an experiment naming the folder's absolute path (a
    new user's `make eval` was refused: the paths differed as strings), and --reuse takes it; another folder, or a
    hub id, is not."""
    (tmp_path / "mymodel").mkdir()
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path)
    assert records.same_base("./mymodel", str(tmp_path / "mymodel")) and records.same_base("mymodel", "./mymodel/")
    assert not records.same_base("./mymodel", str(tmp_path / "other"))
    assert not records.same_base("org/mymodel", "mymodel") and not records.same_base(None, "mymodel")
    assert records.same_base("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-7b-hf")
    # and --reuse takes a run of ./mymodel for one of its absolute path: one fingerprint (a new user's SFT retrained)
    from rlhf.runs import lineage

    def fingerprint(name):
        return lineage.sha256_json(lineage.stage_config(tiny(tmp_path, f"model.name={name}"), "sft"))
    assert fingerprint("./mymodel") == fingerprint(str(tmp_path / "mymodel")) == fingerprint("mymodel/")
    assert fingerprint("./mymodel") != fingerprint("./other") and records.base_key("./other") == \
        str((tmp_path / "other").resolve())
    assert records.base_key("org/mymodel") == "org/mymodel"  # a hub id (no such folder) as given


def test_an_upstream_run_of_another_tiny_base_is_refused_naming_the_field(tmp_path):
    """`rlhf dpo model.hidden_size=32` after an SFT run of width 64 once trained on the 64-wide base and recorded 32:
    an upstream run is taken only with the model fields that make its base (tiny: the architecture; a hub model: its
    revision), read from its recorded config.yaml (a run recorded without one is not refused)."""
    import pytest

    from rlhf.experiment import config

    exp = tiny(tmp_path)
    run = tmp_path / "sft-run"
    run.mkdir()
    upstream = {"run_dir": str(run), "model": {"base_model": "tiny", "tokenizer_hash": "h"}}
    records.check_same_base(exp, upstream, "sft", "dpo", "h")  # no config.yaml: an older record
    (run / "config.yaml").write_text(config.dump(exp))
    records.check_same_base(exp, upstream, "sft", "dpo", "h")
    records.check_same_base(tiny(tmp_path, "model.gradient_checkpointing=true", "lora.r=4"), upstream, "sft", "dpo",
                            "h")  # not the base: the stage's own settings
    for field, value, was in (("hidden_size", 32, 64), ("num_kv_heads", 2, 0), ("tie_embeddings", True, False)):
        with pytest.raises(records.StageInputError) as e:
            records.check_same_base(tiny(tmp_path, f"model.{field}={value}"), upstream, "sft", "dpo", "h")
        assert f"was trained with model.{field}={was!r}, but this experiment's is {value!r}" in str(e.value)
        assert str(e.value).startswith(f"dpo: the sft output at {run} ") and "Run `make sft` with" in str(e.value)
    elsewhere = tmp_path / "elsewhere"  # the summary's run_dir as recorded (relative): the folder itself counts
    records.check_same_base(exp, {**upstream, "run_dir": "gone"}, "sft", "dpo", "h", run)
    with pytest.raises(records.StageInputError, match="model.hidden_size=64"):
        records.check_same_base(tiny(tmp_path, "model.hidden_size=32"), {**upstream, "run_dir": str(elsewhere)},
                                "sft", "dpo", "h", run)


def test_wandb_that_cannot_start_online_is_one_line_and_the_rerun_starts_fresh(tmp_path, monkeypatch, capsys):
    """Online with W&B unreachable (a bad key, no network): `wandb.init` raises after its retries. The stage ends with
    one line, what to do included, not W&B's traceback, and leaves no run a rerun would resume."""
    import wandb

    from rlhf import cli
    from rlhf.runs import lineage

    from .conftest import TINY

    monkeypatch.delenv("RLHF_DISABLE_TRACKING", raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")

    def unreachable(**kwargs):
        raise wandb.errors.CommError("Failed to get resume status for run x: context deadline exceeded\nwhile ...")

    monkeypatch.setattr(wandb, "init", unreachable)
    argv = ["sft", "--exp", str(TINY), f"results_dir={tmp_path}", "tracking.backend=wandb", "sft.max_steps=1"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: W&B could not start this run (Failed to get resume status for run x: context deadline "
                       "exceeded). Check the network and WANDB_API_KEY, or run offline with WANDB_MODE=offline "
                       "(upload later with `wandb sync`)"), err
    assert not any("Traceback" in line for line in err)
    assert lineage.resume_point(tiny(tmp_path), "sft") is None


def test_an_online_wandb_run_names_its_page_at_the_start_and_in_the_summary(tmp_path, monkeypatch, capsys):
    """Online (a fake W&B run: no account here), W&B is silent: the tracker says the page at the start, for a run
    of hours to be watched, and `where` gives it to the summary's last lines."""
    import types

    import wandb

    url = "https://wandb.ai/team/rlhf-harness/runs/tiny-sft-1"
    run = types.SimpleNamespace(url=url, settings=types.SimpleNamespace(mode="online"), define_metric=lambda *a, **k: 0)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setattr(wandb, "init", lambda **kwargs: run)
    tracker = tracking.WandbTracker(tiny(tmp_path, "tracking.backend=wandb"), "sft", tmp_path / "1")
    assert capsys.readouterr().out == f"W&B run: {url}\n"
    assert tracker.where() == {"backend": "wandb", "url": url}
    from rlhf import cli

    summary = {"stage": "sft", "experiment": "tiny", "run_dir": "/r/1", "tracking": tracker.where()}
    assert f"  W&B  {url}" in cli.console_summary(summary).splitlines()


def test_a_rerun_says_why_it_does_not_resume_a_run_and_a_resumed_run_records_what_changed(tmp_path):
    """A killed run a rerun passes over is named with why (another live process owns it, or the keys of the stage's
    config that changed); a process given a dead owner's pid later does not hold the run; a resumed run's
    config.yaml is the config it finishes under, with what changed since it started (outside its fingerprint)."""
    import os
    import subprocess
    import sys

    import yaml

    from rlhf.runs import lineage

    exp = tiny(tmp_path)
    run = records.Run(exp, "sft", lineage={"fingerprint": "F"})
    checkpoint = run.dir / "checkpoints" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "rlhf_state.json").write_text("{}")
    owner = json.loads((run.dir / "owner.json").read_text())
    assert owner == {"pid": os.getpid(), "host": owner["host"], "start": records.process_start(os.getpid())}
    assert owner["start"]  # Linux: the boot's id and the process's start tick
    assert lineage.find_resumable(exp, "sft", "F") == (run.dir, checkpoint, 2)
    lr = exp.sft.learning_rate
    assert lineage.passed_over(tiny(tmp_path, f"sft.learning_rate={lr * 10}"), "sft", "G") == (
        f"sft: not resuming {run.dir} (checkpoint-2): its inputs differ (sft.learning_rate: {lr!r} -> {lr * 10!r}); "
        f"it is left as it is; a new run starts")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run.dir / "owner.json").write_text(json.dumps({**owner, "pid": live.pid,
                                                        "start": records.process_start(live.pid)}))
        assert lineage.find_resumable(exp, "sft", "F") is None
        assert lineage.passed_over(exp, "sft", "F") == (
            f"sft: not resuming {run.dir} (checkpoint-2): another live process owns it (pid {live.pid}); stop it, "
            f"then rerun to resume it; a new run starts")
        assert "its inputs differ (sft.learning_rate" in lineage.passed_over(  # another config: never resumed
            tiny(tmp_path, f"sft.learning_rate={lr * 10}"), "sft", "G")
        # the same pid, another process (a reboot, pids wrapping round): the run is free
        (run.dir / "owner.json").write_text(json.dumps({**owner, "pid": live.pid, "start": "another boot:1"}))
        assert lineage.find_resumable(exp, "sft", "F") == (run.dir, checkpoint, 2)
    finally:
        live.kill()
        live.wait()
    resumed = records.Run(tiny(tmp_path, "eval.prompts=40"), "sft", lineage={"fingerprint": "F"}, resume=(run.dir, 0))
    assert resumed.changed == [f"eval.prompts: {exp.eval.prompts} -> 40"]
    assert yaml.safe_load((run.dir / "config.yaml").read_text())["eval"]["prompts"] == 40


def test_a_field_added_since_runs_were_recorded_leaves_their_fingerprints_as_they_were(tmp_path):
    """A section's fields added later (sections.ADDED) are left out of a stage's hashed config at their defaults, so
    the runs recorded before they existed keep their fingerprints (reused, resumed); set otherwise, they count. A
    resumed run's config.yaml from before them has no such key, which is no change."""
    from dataclasses import fields

    from rlhf.experiment import sections
    from rlhf.runs import lineage

    added = {(c.__name__, f.name) for c in (sections.SFTConfig, sections.DPOConfig) for f in fields(c)
             if f.metadata.get("added")}
    assert ("SFTConfig", "loss_type") in added and ("DPOConfig", "label_smoothing") in added and len(added) == 12
    exp = tiny(tmp_path)
    recorded = {f.name for f in fields(sections.SFTConfig)} - {name for c, name in added if c == "SFTConfig"}
    assert set(lineage.stage_config(exp, "sft")["sft"]) == recorded  # the keys runs were fingerprinted with
    dft = tiny(tmp_path, "sft.loss_type=dft")
    assert lineage.stage_config(dft, "sft")["sft"]["loss_type"] == "dft"
    hashed = [lineage.sha256_json(lineage.stage_config(e, "sft")) for e in (dft, exp)]
    assert hashed[0] != hashed[1]
    before, after = {"sft": {"epochs": 1}}, {"sft": {"epochs": 1, "loss_type": "nll"}}
    assert records.config_changes(before, after) == [] and records.config_changes(after, before) == [
        "sft.loss_type: 'nll' -> None"]
