"""What the online loops (ppo.py, grpo.py) compute over a rollout beside their algorithm: its no-grad passes in
bounded chunks (a Trajectory), the figures they log of it (the reward before and after the KL penalty, the sampler's
log-prob gap to the training path), the NaN stop, and the seconds of each timed part. The run around them is
online.py's OnlineRun."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch

from rlhf.infra import dist
from rlhf.maths import losses
from rlhf.rl import generation


class Timer:
    """Seconds spent per named part of a step (`with timer("ref"): ...`), summed until reset."""

    def __init__(self):
        self.s: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t0


@dataclass
class Trajectory:
    """What a rollout's no-grad passes computed (ppo/grpo rollout_stats), a row per sequence; None where the stage
    does not compute it. Per response token (B, R) but raw_score (B, K)."""

    logp: torch.Tensor | None = None
    """The sampling policy's log-probs of the response tokens (the old log-probs of the ratio)."""
    entropy: torch.Tensor | None = None
    """The sampling policy's entropy at each response position."""
    values: torch.Tensor | None = None
    """The value head's value at each response position (PPO)."""
    ref_logp: torch.Tensor | None = None
    """The reference's log-probs of the response tokens."""
    kl: torch.Tensor | None = None
    """The exact per-token KL(policy || reference), 0 outside the mask."""
    raw_score: torch.Tensor | None = None
    """The reward model's raw score of each response by each of its K members (when it takes part)."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields computed, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def rows(self, idx) -> Trajectory:
        """The rows `idx` of every field computed."""
        return Trajectory(**{k: v[idx] for k, v in self.tensors().items()})

    @staticmethod
    def cat(parts: list[Trajectory]) -> Trajectory:
        """Parts of one rollout, their rows in order."""
        return Trajectory(**{k: torch.cat([part.tensors()[k] for part in parts]) for k in parts[0].tensors()})


def in_chunks(fn: Callable[[generation.Rollout], Trajectory], r: generation.Rollout, rows: int) -> Trajectory:
    """fn(part) over `rows` sequences of `r` at a time (Rollout.chunks), concatenated: the no-grad passes of a rollout
    in bounded pieces."""
    return Trajectory.cat([fn(part) for part in r.chunks(rows)])


class NonFiniteError(RuntimeError):
    pass


def check_finite(stage: str, step: int, **tensors) -> None:
    """Stop on NaN/inf - on every rank together when data parallel (a lone rank stopping would hang the others)."""
    for name, t in tensors.items():
        if dist.any_rank(not bool(torch.isfinite(torch.as_tensor(t)).all())):
            raise NonFiniteError(f"{stage.upper()} step {step}: {name} is NaN/inf; stopping (the last good checkpoint "
                                 f"is kept)")


def sampler_gap(sample_logp: torch.Tensor | None, logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far what sampled the rollout (the merged sampler: rlhf/rl/sampler.py) is from the training path whose
    log-probs (`logp`, the old log-probs of the ratio) the update uses, over every rank's response tokens:
    `rollout/logprob_gap_max` and `rollout/logprob_gap_mean` of |log q - log pi_old|, and `rollout/sampler_ratio_std`,
    the standard deviation over those tokens of the ratio pi_old / q that the sampler correction weighs by
    (sampler_is_correction; docs/algorithms.md)."""
    if sample_logp is None:
        return {}
    diff = dist.all_gather_rows((logp.detach() - sample_logp) * mask)
    m = dist.all_gather_rows(mask)
    gap, n = diff.abs(), m.sum().clamp(min=1)
    ratio = torch.exp(diff)
    mean = (ratio * m).sum() / n
    std = (((ratio - mean) ** 2 * m).sum() / (n - 1).clamp(min=1)).sqrt()
    return {"rollout/logprob_gap_max": gap.max().item(), "rollout/logprob_gap_mean": (gap.sum() / n).item(),
            "rollout/sampler_ratio_std": std.item()}


def sampler_correction(section, old_logp: torch.Tensor, sample_logp: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor | None:
    """The weight an online `section`'s policy terms take for the sampler's gap (sampler_is_correction: its mode and
    bounds, losses.sampler_is_weight), or None when the correction is off."""
    if not section.sampler_is_correction:
        return None
    return losses.sampler_is_weight(old_logp, sample_logp, mask, section.sampler_is_mode, section.sampler_is_clip_min,
                                    section.sampler_is_clip_max)


def reward_metrics(reward: torch.Tensor, penalty: torch.Tensor, group: int = 0) -> dict[str, float]:
    """The reward an online stage logs, over every rank's rows: `reward/mean` and `reward/std` of the reward before
    any KL penalty (the score, less the EOS penalty: comparable across PPO, GRPO and RLOO), `reward/kl_penalty` the
    mean KL penalty subtracted from it for the update (0 where the KL is a loss term); with `group` (G), also
    `reward/group_std` and `groups/zero_std_frac` (groups whose G rewards are all equal), before the penalty too."""
    a, pen = dist.all_gather_rows(reward), dist.all_gather_rows(penalty)
    out = {"reward/mean": a.mean().item(), "reward/std": a.std().item(), "reward/kl_penalty": pen.mean().item()}
    if group:
        group_std = a.view(-1, group).std(1)
        out.update({"reward/group_std": group_std.mean().item(),
                    "groups/zero_std_frac": (group_std == 0).float().mean().item()})
    return out
