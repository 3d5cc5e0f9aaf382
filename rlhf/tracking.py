"""Experiment trackers: a no-op one by default and W&B (offline unless WANDB_API_KEY is set). Stages call the same
methods whichever is active - no `if use_wandb:` branches. W&B runs are grouped by experiment (group = experiment
name, job_type = stage, name = run id); no code, git state or secret value is sent: every config value, metric,
table cell and summary goes through records.scrub first. RLHF_DISABLE_TRACKING=1 (the tests) turns it off."""

from __future__ import annotations

import os

from .config import Experiment, to_dict
from .records import scrub


class NoOpTracker:
    def log(self, metrics: dict, step: int) -> None:
        pass

    def table(self, name: str, columns: list[str], rows: list[list]) -> None:
        pass

    def summary(self, summary: dict) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbTracker(NoOpTracker):
    def __init__(self, exp: Experiment, stage: str, run_dir):
        os.environ.setdefault("WANDB_MODE", "online" if os.environ.get("WANDB_API_KEY") else "offline")
        os.environ.setdefault("WANDB_DISABLE_CODE", "true")
        os.environ.setdefault("WANDB_DISABLE_GIT", "true")
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=exp.tracking.project, group=exp.name, job_type=stage, name=run_dir.name,
                              id=f"{exp.name}-{stage}-{run_dir.name}", resume="allow", dir=str(run_dir),
                              config=scrub(to_dict(exp)), tags=[stage],
                              settings=wandb.Settings(save_code=False, disable_git=True, anonymous="never",
                                                      x_disable_meta=True))  # no argv, host or git upload

    def log(self, metrics, step):
        self.run.log(scrub(metrics), step=step)

    def table(self, name, columns, rows):
        self.run.log({name: self.wandb.Table(columns=columns, data=scrub(rows))})

    def summary(self, summary):
        self.run.summary.update(scrub(_flatten(summary)))

    def finish(self):
        self.run.finish()


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
