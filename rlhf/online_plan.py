"""An online stage's plan (PPO, GRPO, RLOO), resolved once from the experiment before any model loads: this rank's
rows of each batch, the copies of the base and the sampling rows the memory plan chose (the predictor decides here,
off the training path), the sampling settings, what the reward is made of and the judge's settings. The run
(online.setup) and the parts it is built from (roles.Scorer, overopt.Judge) read these plain values, never the
experiment."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

from . import dist, generation, overopt, rewards
from .config import ConfigError, Experiment
from .memory import copies, memplan
from .records import StageInputError
from .roles import Scoring, reward_scales, scoring
from .runtime import Plan


@dataclass(frozen=True)
class OnlinePlan:
    """What an online run needs to know before it loads anything (resolve)."""

    stage: str
    section: object
    """The stage's config section (PPOConfig, GRPOConfig, RLOOConfig)."""
    inputs: Plan
    """The stage's inputs and lineage (runtime.policy_plan): inputs.data holds the SFT and RM runs, the tokenizer,
    the prompts and the splits."""
    rb: int
    """This rank's rows of the rollout batch; mb_rows and micro_rows: of a minibatch and of a micro-batch."""
    mb_rows: int
    micro_rows: int
    train_copy: float
    """Bytes of the dequantized copy of the 4-bit base the run trains through from start to end (models.dequantized;
    the memory plan's choice, memory/memplan.py)."""
    sampler_copy: float
    """Bytes of the merged sampler's copy of the base (rlhf/sampler.py)."""
    sampling_rows: int
    """Rows per sampling pass (the plan's: its KV cache's)."""
    score_rows: int
    """Rows per no-grad scoring pass (memplan.scoring_rows)."""
    sampler_length: int
    """The longest sequence the sampler decodes: a prompt and the longest of the stage's and the check's responses."""
    gen_kwargs: dict
    """generation.generate's settings from the stage's section (with the merged sampler's bytes and rows)."""
    scoring: Scoring
    """What the rollout's reward is made of (roles.Scorer)."""
    judge: overopt.Settings
    """The judge's settings (overopt.Judge)."""
    seed: int
    """The seeded prompt order's seed (checkpoints.PromptOrder)."""
    eval_rows: list[dict]
    """The held-out rows of the end-of-run check."""
    cut: str | None = None
    """The warning about prompts longer than data.max_prompt_length (generation.cut_prompts): the summary's
    `warnings`, apart from the guard's calibrated `flags`."""

    @property
    def data(self):
        return self.inputs.data


def resolve(exp: Experiment, stage: str, section, prepare: Callable[[], Plan], group: int = 1) -> OnlinePlan:
    """The online stage's plan, in this order: this rank's batch sizes (its rollout rows a multiple of `group`), the
    judge's config check, the stage's inputs (`prepare()`), the judge's inputs, then the memory plan's copies and
    rows, the sampling settings, the reward's scales and parts and the judge's settings."""
    where = exp.source or "config"
    # data parallel: each rank samples its share of every global rollout batch and updates on its share of each
    # minibatch; gradients and the statistics that must be global (whitening, KL, metrics) are reduced over ranks
    rb, mb_rows, micro_rows = (dist.per_device(getattr(section, k), f"{stage}.{k}", where)
                               for k in ("rollout_batch", "minibatch", "micro_batch"))
    if rb % group:
        raise ConfigError(f"{where}: {stage}.rollout_batch / processes ({rb}) must be a multiple of "
                          f"{stage}.num_generations ({group}): each rank samples whole groups")
    overopt.check_keep(exp, stage, section)
    inputs = prepare()
    d = inputs.data
    if section.keep == "judge" and not rewards.own_judge(exp) and not (d.rm or {}).get("judge"):
        raise StageInputError(f"{stage}.keep=judge: the reward model run has no judge (it was trained with "
                              f"data.judge_fraction = 0, or before there was one); rerun `make rm`")
    cut = generation.cut_prompts(d.tok, [row["prompt"] for row in d.prompts], exp.data.max_prompt_length)
    train_copy, sampler_copy, rows = copies.copies(exp, stage)  # the training path's copy, the sampler's
    gen_kwargs = dict(max_new_tokens=section.max_new_tokens, temperature=section.temperature, top_p=section.top_p,
                      max_prompt_length=exp.data.max_prompt_length, batch_size=rows, copy_bytes=sampler_copy)
    score_rows = memplan.scoring_rows(section, rows, rb)
    return OnlinePlan(
        stage, section, inputs, rb, mb_rows, micro_rows, train_copy, sampler_copy, rows, score_rows,
        exp.data.max_prompt_length + max(section.max_new_tokens, exp.eval.max_new_tokens), gen_kwargs,
        scoring(exp, reward_scales(exp, section, d.rm), section, len(d.prompts)),
        overopt.settings(exp, section, d.rm, d.prompts, gen_kwargs, score_rows), exp.seed,
        d.splits.eval[: exp.eval.prompts], cut)


def warn(plan: OnlinePlan) -> None:
    """Rank 0 prints the plan's warning (prompts cut) once."""
    if plan.cut and dist.is_main():
        print(f"warning: {plan.cut}", file=sys.stderr, flush=True)
