"""Experiment trackers: a no-op one by default and W&B (offline unless WANDB_API_KEY is set). Stages call the same
methods whichever is active - no `if use_wandb:` branches.

A W&B run is grouped by experiment (group = experiment name, job_type = stage), named by what tells it apart from the
others (`run_name`: experiment, stage and run id; a sweep trial's study, trial and swept values) and tagged
experiment:<name>, stage:<stage>, commit:<git commit> (and sweep:<study>) to be found. Its logged keys are TRL's
(`trl_keys`, the convention of transformers' WandbCallback) for every stage, the online ones included; the run record
(metrics.jsonl, summary.json) keeps the keys as logged. No code, diff or secret value is sent (the commit is a tag):
every config value, metric, table cell and summary goes through records.scrub first. RLHF_DISABLE_TRACKING=1 (the
tests) turns it off. W&B runs silent (WANDB_SILENT=false gives its own console lines back): the stage's summary says
where the run went, its page or the offline folder and the `wandb sync` that uploads it."""

from __future__ import annotations

import json
import os

from rlhf.experiment.config import Experiment, first_line, to_dict
from rlhf.runs.records import git_state, scrub

STEP = "train/global_step"
"""The x axis of every logged key, as TRL's runs have it."""


class TrackingError(RuntimeError):
    """The tracker could not start its run (W&B online, unreachable or refused)."""


class NoOpTracker:
    def log(self, metrics: dict, step: int) -> None:
        pass

    def table(self, name: str, columns: list[str], rows: list[list]) -> None:
        pass

    def summary(self, summary: dict) -> None:
        pass

    def finish(self) -> None:
        pass

    def where(self) -> dict | None:
        """Where the run's tracking went, for the summary and the console (None: nowhere)."""
        return None


def trl_keys(metrics: dict) -> dict:
    """`metrics` under the keys TRL's trainers log to W&B (transformers' WandbCallback): `eval_<k>` as `eval/<k>`,
    `test_<k>` as `test/<k>`, any other key as `train/<k>`. So SFT's `loss` and `eval_loss` are `train/loss` and
    `eval/loss`, and the online stages' `reward/mean` and `kl/ref` are `train/reward/mean` and `train/kl/ref`."""
    out = {}
    for key, value in metrics.items():
        split = next((p for p in ("eval", "test") if key.startswith(p + "_")), None)
        out[f"{split}/{key[len(split) + 1:]}" if split else f"train/{key}"] = value
    return out


def sweep_trial() -> dict | None:
    """The sweep trial whose stage this process runs ({study, trial, params}: RLHF_SWEEP, set by rlhf.sweeps), or
    None."""
    return json.loads(os.environ["RLHF_SWEEP"]) if os.environ.get("RLHF_SWEEP") else None


def run_name(experiment: str, stage: str, run_id: str, trial: dict | None = None) -> str:
    """`tiny ppo 20261126-004044-092882`; a sweep trial's stage: `tiny dpo dpo-beta-lr trial 3 dpo.beta=0.3
    dpo.learning_rate=0.0005` (the swept values, as the sweep file names them, floats to 4 significant digits)."""
    if trial is None:
        return f"{experiment} {stage} {run_id}"
    swept = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in (trial.get("params") or {}).items()]
    return " ".join([experiment, stage, str(trial["study"]), f"trial {trial['trial']}", *swept])


def run_tags(experiment: str, stage: str, trial: dict | None = None) -> list[str]:
    """experiment:<name>, stage:<stage>, commit:<the first 12 hex digits of the git commit, `-dirty` with uncommitted
    changes> and, for a sweep trial, sweep:<study>; each cut to W&B's 64 characters."""
    commit, dirty = git_state()
    tags = [f"experiment:{experiment}", f"stage:{stage}",
            f"commit:{commit[:12] if commit else 'unknown'}{'-dirty' if dirty else ''}"]
    if trial is not None:
        tags.append(f"sweep:{trial['study']}")
    return [t[:64] for t in tags]


def wandb_defaults() -> None:
    """What a W&B run of ours does unless the environment says otherwise: offline without WANDB_API_KEY, no code or
    git upload, and silent (its banner and history tables; the stage's summary says where the run went instead)."""
    os.environ.setdefault("WANDB_MODE", "online" if os.environ.get("WANDB_API_KEY") else "offline")
    os.environ.setdefault("WANDB_DISABLE_CODE", "true")
    os.environ.setdefault("WANDB_DISABLE_GIT", "true")
    os.environ.setdefault("WANDB_SILENT", "true")


class WandbTracker(NoOpTracker):
    def __init__(self, exp: Experiment, stage: str, run_dir):
        wandb_defaults()
        import wandb

        trial = sweep_trial()
        self.wandb = wandb
        try:
            self.run = wandb.init(project=exp.tracking.project, group=exp.name, job_type=stage,
                                  name=scrub(run_name(exp.name, stage, run_dir.name, trial)),
                                  id=f"{exp.name}-{stage}-{run_dir.name}", resume="allow", dir=str(run_dir),
                                  config=scrub(to_dict(exp)), tags=scrub(run_tags(exp.name, stage, trial)),
                                  settings=wandb.Settings(save_code=False, disable_git=True,
                                                          x_disable_meta=True))  # no argv, host or git upload
        except wandb.errors.Error as e:  # unreachable or refused online: one line, not W&B's traceback
            raise TrackingError(f"W&B could not start this run ({first_line(e)}). Check the network and WANDB_API_KEY, "
                                f"or run offline with WANDB_MODE=offline (upload later with `wandb sync`)") from None
        # TRL's x axis: a step of its own, so a resumed run or a second model trained in the run (the RM stage's
        # judge) logs from its own step 0 without W&B dropping the lines
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP, step_sync=True)
        if self.run.url:  # online: the page to watch the run on, from its start (the summary says it again)
            print(f"W&B run: {self.run.url}", flush=True)

    def log(self, metrics, step):
        self.run.log(scrub({**trl_keys(metrics), STEP: step}))

    def table(self, name, columns, rows):
        self.run.log({name: self.wandb.Table(columns=columns, data=scrub(rows))})

    def summary(self, summary):
        self.run.summary.update(scrub(_flatten(summary)))

    def finish(self):
        self.run.finish()

    def where(self):
        """The run's page when it went online; offline, the folder `wandb sync` uploads."""
        if self.run.settings.mode == "offline":
            return {"backend": "wandb", "offline_dir": str(self.run.settings.sync_dir)}
        return {"backend": "wandb", "url": self.run.url}


def _flatten(d: dict, prefix: str = "") -> dict:
    """Nested summary -> {"metrics/eval_loss": ..., "memory/peak_gb": ...}, scalars only."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[f"{prefix}{k}"] = v
    return out


def make(exp: Experiment, stage: str, run_dir) -> NoOpTracker:
    if exp.tracking.backend == "wandb" and not os.environ.get("RLHF_DISABLE_TRACKING"):
        return WandbTracker(exp, stage, run_dir)
    return NoOpTracker()
