"""An online stage's plan (PPO, GRPO, RLOO), resolved once from the experiment before any model loads: this rank's
rows of each batch, the copies of the base and the sampling rows the memory plan chose (the predictor decides here,
off the training path), the sampling settings, what the reward is made of and the judge's settings. The run
(online.setup) and the parts it is built from (roles.Scorer, overopt.Judge) read these plain values, never the
experiment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rlhf.infra import dist
from rlhf.rl import checks, generation, overopt, rewards
from rlhf.inputs import models
from rlhf.experiment import online_sections, stages
from rlhf.experiment.config import ConfigError, Experiment
from rlhf.maths import guard
from rlhf.memory import copies, memplan
from rlhf.runs.records import StageInputError
from rlhf.rl.roles import Scoring, reward_scales, scoring
from rlhf.inputs import data
from rlhf.runs.runtime import Plan, upstream_rm, upstream_sft


@dataclass(frozen=True)
class OnlinePlan:
    """What an online run needs to know before it loads anything (resolve)."""

    stage: str
    section: object
    """The stage's config section (PPOConfig, GRPOConfig, RLOOConfig)."""
    inputs: Plan
    """The stage's inputs and lineage (policy_plan): inputs.data holds the SFT and RM runs, the tokenizer,
    the prompts and the splits."""
    rb: int
    """This rank's rows of the rollout batch; mb_rows and micro_rows: of a minibatch and of a micro-batch."""
    mb_rows: int
    micro_rows: int
    train_copy: float
    """Bytes of the dequantized copy of the 4-bit base the run trains through from start to end (models.dequantized;
    the memory plan's choice, memory/memplan.py)."""
    sampler_copy: float
    """Bytes of the merged sampler's copy of the base (rlhf/rl/sampler.py)."""
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
    check: checks.Check
    """How the end-of-run check samples and grades (checks.policy_vs_sft), and how the base loads (its `loading`)."""
    ensemble: int
    """The reward model's members (rm.ensemble)."""
    seed: int
    """The seeded prompt order's seed (checkpoints.PromptOrder)."""
    eval_rows: list[dict]
    """The held-out rows of the end-of-run check."""
    warnings: tuple[str, ...] = ()
    """Said at setup and kept in the summary's `warnings`, apart from the guard's calibrated `flags`: prompts longer
    than data.max_prompt_length (generation.cut_prompts), held-out chosen responses longer than the sampling limits
    (generation.cut_responses, of the eval.prompts rows the check samples, as the offline stages count them), a
    reward model not shown to rank better than chance, in the reward or grading the check (guard.rm_at_chance)."""

    @property
    def data(self):
        return self.inputs.data

    @property
    def loading(self) -> models.Loading:
        """How the base is loaded (models.load_base: the roles' and the check's)."""
        return self.check.loading


def resolve(exp: Experiment, stage: str, section, prepare: Callable[[], Plan], group: int = 1) -> OnlinePlan:
    """The online stage's plan, in this order: this rank's batch sizes (its rollout rows a multiple of `group`), the
    judge's config check, the stage's inputs (`prepare()`), the judge's inputs, then the memory plan's copies and
    rows, the sampling settings, the reward's scales and parts and the judge's settings."""
    where = exp.source or "config"
    # data parallel: each rank samples its share of every global rollout batch and updates on its share of each
    # minibatch; gradients and the statistics that must be global (whitening, KL, metrics) are reduced over ranks
    rb, mb_rows, micro_rows = (dist.per_device(getattr(section, k), f"{stage}.{k}", where)
                               for k in stages.get(stage).batches)
    if rb % group:
        step = group * (section.rollout_batch // rb)  # num_generations x processes
        near = " or ".join(str(k * step) for k in (rb // group, rb // group + 1) if k)
        raise ConfigError(f"{where}: {stage}.rollout_batch / processes ({rb}) must be a multiple of "
                          f"{stage}.num_generations ({group}): each rank samples whole groups; set "
                          f"{stage}.rollout_batch to a multiple of {step} ({near}; its minibatch and micro_batch "
                          f"split it)",
                          key=(f"{stage}.rollout_batch", f"{stage}.num_generations"))
    check_keep(exp, stage, section)
    inputs = prepare()
    d = inputs.data
    if section.keep == "judge" and not rewards.own_judge(exp.reward) and not (d.rm or {}).get("judge"):
        raise StageInputError(f"{stage}.keep=judge: the reward model run has no judge (it was trained with "
                              f"data.judge_fraction = 0, or before there was one); rerun `make rm`")
    k, eval_rows = exp.rm.ensemble, d.splits.eval[: exp.eval.prompts]
    cut = generation.cut_prompts(d.tok, {"training prompts": [row["prompt"] for row in d.prompts],
                                         "held-out prompts": [row["prompt"] for row in eval_rows]},
                                 exp.data.max_prompt_length)
    long = generation.cut_responses(d.tok, [r["chosen"] for r in eval_rows if r.get("chosen")],
                                    {f"{stage}.{section.length_key}": section.max_new_tokens,
                                     "eval.max_new_tokens": exp.eval.max_new_tokens})
    # a reward model at chance: the reward is noise where it takes part, its win rates in the check where it grades
    at_chance = guard.rm_at_chance if exp.reward.model else checks.grading_rm_at_chance
    chance = d.rm and at_chance(stage, d.rm)
    train_copy, sampler_copy, rows = copies.copies(exp, stage)  # the training path's copy, the sampler's
    gen_kwargs = dict(max_new_tokens=section.max_new_tokens, temperature=section.temperature, top_p=section.top_p,
                      max_prompt_length=exp.data.max_prompt_length, batch_size=rows, copy_bytes=sampler_copy)
    score_rows = memplan.scoring_rows(section, rows, rb)
    check = checks.plan(exp, stage, eval_rows, (sampler_copy, rows), d.prompts)
    judging = overopt.settings(section, exp.reward, exp.eval, exp.data.source, exp.seed, d.rm, k, d.prompts,
                               gen_kwargs, score_rows)
    return OnlinePlan(
        stage, section, inputs, rb, mb_rows, micro_rows, train_copy, sampler_copy, rows, score_rows,
        exp.data.max_prompt_length + max(section.max_new_tokens, exp.eval.max_new_tokens), gen_kwargs,
        scoring(exp.reward, exp.data.source, reward_scales(section, d.rm, k), section, len(d.prompts)),
        judging, check, k, exp.seed, eval_rows,
        tuple(w for w in (cut and f"{stage}: {cut}", long and f"{stage}: {long}", chance,
                          unjudged(stage, online_sections.judge_missing(exp, stage, section), exp.reward.model,
                                   judging.on), check.short) if w))


def unjudged(stage: str, missing: list[str], reward_model: float, on: bool) -> str | None:
    """Said at setup when no judge will watch the run (`on`: overopt.Settings.on): what it lacks (`missing`: the
    config's, online_sections.judge_missing; else the judge the reward model run has not), and that nothing flags
    over-optimization, stops the run or chooses among its policies (the last is saved)."""
    if on:
        return None
    missing = missing or [
        "a judge: the reward model run it loads has none (data.judge_fraction was 0)" if reward_model else
        "a judge: the RM stage's is not loaded with reward.model 0; name reward.judge_functions or reward.judge_model"]
    return (f"{stage}: no judge watches this run (it needs {'; '.join(missing)}): nothing flags reward "
            f"over-optimization, stops the run or chooses among its policies; the last policy is saved")


def check_keep(exp: Experiment, stage: str, section) -> None:
    """keep=judge needs the judge: refused, naming what is missing, before anything loads (checked when the
    stage runs: another stage of the same experiment may do without it)."""
    if section.keep != "judge":
        return
    missing = online_sections.judge_missing(exp, stage, section)
    if missing:
        raise ConfigError(f"{exp.source or 'config'}: {stage}.keep=judge needs the judge: {', '.join(missing)}; "
                          f"or set {stage}.keep=last (or auto: the judge's choice when the run has one)")


def policy_plan(exp: Experiment, stage: str, with_rm: bool) -> Plan:
    """An online RL stage's inputs, before any model loads: the SFT run it starts from, the reward model's run (when
    `with_rm`), the prompts it samples and the held-out rows of its end-of-run check."""
    rewards.configured(exp.reward)  # an import path that does not resolve fails here, before any model is loaded
    splits = data.load(exp)
    sft_dir, sft, tok = upstream_sft(exp, stage, splits.eval)
    splits.render(tok)  # conversational prompts -> text with the SFT tokenizer's chat template
    upstream, rm = {"sft": (sft_dir, sft)}, None
    if with_rm:
        rm_dir, rm = upstream_rm(exp, stage, sft_dir, sft, tok)
        upstream["rm"] = (rm_dir, rm)
    prompts = splits.prompts(exp.data.ppo_prompts)
    ids = {"train": [q["id"] for q in prompts], "eval": [r["id"] for r in splits.eval[: exp.eval.prompts]]}
    inputs = {"sft_run": str(sft_dir), "rm_run": str(upstream["rm"][0]) if rm else None, "data": splits.source,
              "train_ids": ids["train"]}
    return Plan.make(exp, stage, inputs, ids, upstream, sft=sft, rm=rm, tok=tok, prompts=prompts, splits=splits)
