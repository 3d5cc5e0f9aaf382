"""Lineage of a run: content hashes of what went into it, so any result can be traced back and an unchanged stage
reused instead of retrained.

    config_hash  sha256 of the parts of the resolved config that affect the stage (its own section, the model, LoRA,
                 quantization, data and seed; not the other stages' sections, paths, memory budget or tracking;
                 not a field added since runs were recorded while it holds its default: sections.ADDED)
    data_hash    sha256 of the exact example ids the stage used
    upstream     per upstream run consumed (sft, rm): its run dir, fingerprint and adapter_sha256
    fingerprint  hash of all the above: two runs with the same fingerprint had the same inputs. A downstream
                 fingerprint contains its upstream fingerprints and adapter hashes, so a changed SFT cascades.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
from dataclasses import is_dataclass
from pathlib import Path

from rlhf.infra import dist, faults
from rlhf.runs import records
from rlhf.experiment import stages
from rlhf.experiment import config
from rlhf.experiment.config import ConfigError, Experiment, to_dict
from rlhf.experiment.sections import added_at_default

COMMON = ("seed", "deterministic", "device", "model", "quantization", "lora", "data")


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def file_sha256(path: Path) -> str | None:
    path = Path(path)
    if not path.is_file():
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def adapter_sha256(adapter_dir) -> str | None:
    return file_sha256(Path(adapter_dir) / "adapter_model.safetensors")


def stage_config(exp: Experiment, stage: str) -> dict:
    """The parts of the resolved config that affect `stage`."""
    d = to_dict(exp)
    out = {k: d[k] for k in COMMON}
    out["model"] = {**out["model"], "name": records.base_key(exp.model.name)}  # ./m and m: one base, one fingerprint
    # data.* counts that only pick another stage's subset; the data hash covers what a stage really used
    others = set().union(*(s.consumes for s in stages.REGISTRY.values())) - set(stages.get(stage).consumes)
    out["data"] = {k: v for k, v in d["data"].items() if k not in others}
    for k in stages.get(stage).sections:
        out[k] = d[k]
    for k, v in out.items():  # fields added since runs were recorded, at their defaults: as those runs had them
        if is_dataclass(getattr(exp, k, None)):
            out[k] = {f: x for f, x in v.items() if f not in added_at_default(getattr(exp, k))}
    return out


def compute(exp: Experiment, stage: str, data_ids: dict, upstream: dict | None = None) -> dict:
    """The lineage of a `stage` run: upstream = {name: (run_dir, summary)} of the runs it consumes."""
    up = {}
    for name, (run_dir, summary) in (upstream or {}).items():
        up[name] = {"run": str(run_dir), "fingerprint": summary.get("lineage", {}).get("fingerprint"),
                    "adapter_sha256": adapter_sha256(summary["model"]["adapter"])}
    config_hash, data_hash = sha256_json(stage_config(exp, stage)), sha256_json(data_ids)
    fingerprint = sha256_json({"stage": stage, "config": config_hash, "data": data_hash,
                               "upstream": {k: [v["fingerprint"], v["adapter_sha256"]] for k, v in up.items()}})
    return {"fingerprint": fingerprint[:20], "config_hash": config_hash, "data_hash": data_hash,
            "data_sizes": {k: len(v) for k, v in data_ids.items()}, "upstream": up,
            "determinism": {"seed": exp.seed, "mode": "deterministic" if exp.deterministic else "default"}}


def upstream(summary: dict, name: str) -> dict:
    """What a run's summary records of the upstream run `name` (sft, rm) it consumed: {run, fingerprint,
    adapter_sha256}; {} for a run that consumed none, or one recorded before lineage was."""
    return ((summary.get("lineage") or {}).get("upstream") or {}).get(name) or {}


def from_other_sft(summary: dict, sft_sha: str | None) -> bool:
    """Whether the run of `summary` was trained from another SFT adapter than the one whose sha256 is `sft_sha`
    (False where either is unknown: a run recorded before lineage was, an adapter file gone)."""
    recorded = upstream(summary, "sft").get("adapter_sha256")
    return bool(recorded and sft_sha) and recorded != sft_sha


def trained_on(summary: dict, rows) -> list[str]:
    """The ids of `rows` (records with an "id") that the run of `summary` trained on (its inputs.train_ids); [] for a
    run that records none."""
    train = set((summary.get("inputs") or {}).get("train_ids") or ())
    return [r["id"] for r in rows if r["id"] in train]


def held_out_overlap(summary: dict, run_dir, held_out, needed_by: str) -> str | None:
    """Why held-out rows `held_out` cannot grade a stage that starts from the SFT run `run_dir` (its `summary`): some
    are rows that run trained on (its split was drawn under other data settings: data.eval_examples, data.pref_pairs,
    ... reshuffle the pool); None when none are."""
    seen = trained_on(summary, held_out)
    if not seen:
        return None
    return (f"{needed_by}: {len(seen)} of its {len(held_out)} held-out rows are rows the SFT run {run_dir} trained on "
            f"(e.g. {seen[0]}): these data settings draw another split than that run's. Keep the SFT run's data.* "
            f"settings, or train SFT with these too")


def _runs(exp: Experiment, stage: str) -> list[Path]:
    root = records.stage_root(exp, stage)
    return sorted((d for d in root.iterdir() if d.is_dir()), key=lambda d: d.name, reverse=True) if root.is_dir() else []


def _fingerprint(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / "lineage.json").read_text()).get("fingerprint")
    except (OSError, ValueError):
        return None


def find_finished(exp: Experiment, stage: str, fingerprint: str) -> Path | None:
    """A finished run of `stage` with this fingerprint whose adapter exists (the `latest` one first); the stage's
    `latest` pointer is moved to it, so downstream stages consume it."""
    root = records.stage_root(exp, stage)
    first = [run for run in [records.latest_run(root)] if run]
    for run_dir in first + _runs(exp, stage):
        summary_path = run_dir / "summary.json"
        if not summary_path.exists() or _fingerprint(run_dir) != fingerprint:
            continue
        summary = json.loads(summary_path.read_text())
        if not (Path(summary.get("model", {}).get("adapter", "")) / "adapter_config.json").exists():
            continue
        if run_dir not in first:
            records.atomic_write(root / "latest", run_dir.name + "\n")
        return run_dir
    return None


def latest_checkpoint(run_dir: Path) -> tuple[Path, int] | None:
    """The newest complete checkpoint of a run: PPO's `checkpoints/last` pointer, or the TRL checkpoint-N with the
    highest N that has our resume state (written after the trainer's own files)."""
    ckpts = run_dir / "checkpoints"
    last = ckpts / "last"
    if last.exists():
        path = ckpts / last.read_text().strip()
        if (path / "state.json").exists():
            return path, int(path.name.split("-")[1])
    done = [(int(p.name.split("-")[1]), p) for p in ckpts.glob("checkpoint-*") if (p / "rlhf_state.json").exists()]
    if done:
        step, path = max(done)
        return path, step
    return None


def _owner(run_dir: Path) -> dict:
    """The run dir's owner.json (records.Run writes it: the pid and host of the process running the run); {} when
    it is missing or unreadable."""
    try:
        return json.loads((run_dir / "owner.json").read_text())
    except (OSError, ValueError):
        return {}


def _alive(owner: dict) -> bool:
    """Whether the process that owns a run dir (its owner.json, `owner`) is still running (on this host): its pid is,
    and it is the process that wrote owner.json, not a later one given the same pid (its start, where recorded)."""
    if owner.get("host") != socket.gethostname() or owner.get("pid") == os.getpid():
        return False
    try:
        os.kill(int(owner["pid"]), 0)
    except (OSError, ValueError, KeyError):
        return False
    return not owner.get("start") or owner["start"] == records.process_start(int(owner["pid"]))


def _owned(owner: dict) -> bool:
    """Whether this process (on this host) owns the run dir whose owner.json is `owner`: its pid, and its start where
    recorded (not an earlier process given the same pid)."""
    me = records.owner()
    same = (owner.get("pid"), owner.get("host")) == (me["pid"], me["host"])
    return same and owner.get("start") in (None, me["start"])


def resume_point(exp: Experiment, stage: str) -> Path | None:
    """The checkpoint a rerun of `stage` continues from once this process has failed: the newest complete checkpoint
    of its own unfinished run, or, when it failed before claiming one (owner.json), of the newest unfinished run that
    no live process owns. None: a rerun starts again."""
    unfinished = [d for d in _runs(exp, stage) if not (d / "summary.json").exists()]
    mine = [d for d in unfinished if _owned(_owner(d))]
    for run_dir in mine or [d for d in unfinished if not _alive(_owner(d))]:
        found = latest_checkpoint(run_dir)
        if found:
            return found[0]
    return None


def release(exp: Experiment, stage: str) -> None:
    """This process gives up its unfinished run of `stage` (the stage failed): its owner.json is removed, so that a
    rerun in any process takes the run up even while this one lives on (a notebook, a test)."""
    for run_dir in _runs(exp, stage):
        if _owned(_owner(run_dir)) and not (run_dir / "summary.json").exists():
            with contextlib.suppress(OSError):  # a read-only directory keeps it: the owner's death frees it
                (run_dir / "owner.json").unlink()


def clear_killed_writes(exp: Experiment, stage: str) -> list[str]:
    """The temp dirs that writes killed midway left (records.atomic_dir's `.NAME.tmp`: an export's adapter and merged
    model, a PPO checkpoint) in the unfinished runs of `stage`: removed where this host's process that owned the run
    has ended (nothing reads them, and an export's run is never taken up again, so its merged model's copy, a 7B's
    14 GB, would stay); named, not removed, where another host owns the run (each `docker run` is a host of its own
    name, and a process of another cannot be seen: its write may be going on). One line per dir, with its size."""
    said = []
    for run_dir in _runs(exp, stage):
        owner = _owner(run_dir)
        if (run_dir / "summary.json").exists() or _alive(owner) or _owned(owner):
            continue
        for tmp in [*run_dir.glob(".*.tmp"), *(run_dir / "checkpoints").glob(".*.tmp")]:
            size = faults.human(faults.tree_bytes(tmp) or 0)
            if owner.get("host") not in (None, socket.gethostname()):
                said.append(f"{tmp} ({size}) is an unfinished write of a {stage} run on host {owner['host']}: "
                            f"remove it once that run has ended")
                continue
            shutil.rmtree(tmp, ignore_errors=True)
            if not tmp.exists():
                said.append(f"removed {tmp} ({size}): the unfinished write of a killed {stage} run")
    return said


def find_resumable(exp: Experiment, stage: str, fingerprint: str) -> tuple[Path, Path, int] | None:
    """The newest unfinished run of `stage` with this fingerprint that has a checkpoint and no live process:
    (run_dir, checkpoint, step)."""
    for run_dir in _runs(exp, stage):
        if (run_dir / "summary.json").exists() or _fingerprint(run_dir) != fingerprint or _alive(_owner(run_dir)):
            continue
        found = latest_checkpoint(run_dir)
        if found:
            return run_dir, *found
    return None


@contextlib.contextmanager
def quiet(logger: str):
    """The logger `logger` says nothing below an error inside the block."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def passed_over(exp: Experiment, stage: str, fingerprint: str) -> str | None:
    """Why a rerun of `stage` with this fingerprint does not resume the newest unfinished run that has a checkpoint
    (when find_resumable found none): another live process owns it, or its inputs differ (the keys of the stage's
    config that changed, else its upstream runs or data). None: there is no such run."""
    for run_dir in _runs(exp, stage):
        found = not (run_dir / "summary.json").exists() and latest_checkpoint(run_dir)
        if not found:
            continue
        if _fingerprint(run_dir) == fingerprint:  # resumable but for its owner
            o = _owner(run_dir)
            why = f"another live process owns it (pid {o.get('pid')}); stop it, then rerun to resume it"
        else:
            why = f"{_differs(exp, stage, run_dir)}; it is left as it is"
        return f"{stage}: not resuming {run_dir} ({found[0].name}): {why}; a new run starts"
    return None


def not_reused(exp: Experiment, stage: str, fingerprint: str) -> str | None:
    """Why --reuse trains `stage` again (when find_finished found no run to take) where it has a `latest` finished
    run: that run's inputs differ (said as passed_over says them), or they are the same and its adapter is gone.
    None: `latest` names no finished run."""
    run_dir = records.latest_run(records.stage_root(exp, stage))
    if run_dir is None or not (run_dir / "summary.json").exists():
        return None
    if _fingerprint(run_dir) == fingerprint:
        adapter = json.loads((run_dir / "summary.json").read_text()).get("model", {}).get("adapter")
        return f"{stage}: not reusing {run_dir}: its adapter ({adapter}) is gone; a new run trains"
    return f"{stage}: not reusing {run_dir}: {_differs(exp, stage, run_dir)}; a new run trains"


def _differs(exp: Experiment, stage: str, run_dir: Path) -> str:
    """How the inputs of `run_dir`, a run of `stage`, differ from `exp`'s: the keys of the stage's config that
    changed (old -> new), else its upstream runs or data."""
    try:
        with quiet("rlhf.experiment.trl_names"):  # the old config's notes are not this command's
            before = stage_config(config.load(run_dir / "config.yaml"), stage)
    except (ConfigError, OSError):
        before = None
    changed = records.config_changes(before, stage_config(exp, stage)) if before else []
    return f"its inputs differ ({'; '.join(changed) if changed else 'its upstream runs or data'})"


def ranks_of(checkpoint: Path) -> int:
    """How many data-parallel ranks wrote `checkpoint`: ours (state.json's world_size; 1 before it was recorded) or
    the Trainer's (transformers writes rng_state.pth in a single process, rng_state_<rank>.pth for each of N)."""
    state = checkpoint / "state.json"
    if state.exists():
        return int(json.loads(state.read_text()).get("world_size", 1))
    return len(list(checkpoint.glob("rng_state_*.pth"))) or 1


def check_ranks(checkpoint: Path) -> None:
    """Refuse to resume `checkpoint` with another number of ranks than wrote it: each rank restores its own RNG
    states (and the global batches are split by rank), so another split would not continue the same run."""
    n, here = ranks_of(checkpoint), dist.world_size()
    if n != here:
        raise ConfigError(f"{checkpoint}: written by {n} data-parallel rank(s), resumed with {here}; rerun with "
                          f"{n} (--nproc_per_node {n}, make NPROC={n}), or pass --fresh to start a new run")
