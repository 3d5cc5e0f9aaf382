"""Experiment trackers: a no-op one by default and W&B (offline unless WANDB_API_KEY is set). Stages call the same
methods whichever is active - no `if use_wandb:` branches."""

from __future__ import annotations

import os

from .config import Experiment, to_dict


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
        import wandb

        os.environ.setdefault("WANDB_MODE", "online" if os.environ.get("WANDB_API_KEY") else "offline")
        os.environ.setdefault("WANDB_DISABLE_CODE", "true")
        self.wandb = wandb
        self.run = wandb.init(project=exp.tracking.project, group=exp.name, job_type=stage,
                              name=f"{exp.name}-{stage}-{run_dir.name}", dir=str(run_dir), config=to_dict(exp),
                              settings=wandb.Settings(x_disable_stats=False, anonymous="never"))

    def log(self, metrics, step):
        self.run.log(metrics, step=step)

    def table(self, name, columns, rows):
        self.run.log({name: self.wandb.Table(columns=columns, data=rows)})

    def summary(self, summary):
        self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})

    def finish(self):
        self.run.finish()


def make(exp: Experiment, stage: str, run_dir) -> NoOpTracker:
    if exp.tracking.backend == "wandb" and not os.environ.get("RLHF_DISABLE_TRACKING"):
        return WandbTracker(exp, stage, run_dir)
    return NoOpTracker()
