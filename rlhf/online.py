"""What the online loops (ppo.py, grpo.py) share: their plan and setup, the no-grad passes over a rollout in chunks
(a Trajectory), NaN stops, timers, the reward they log, each iteration's record and checkpoint, and the end-of-run
check and summary. The roles and a rollout's scoring are in roles.py, checkpoints in checkpoints.py, the collectives
in dist.py, the maths in losses.py."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from tqdm import tqdm

from . import data, dist, faults, generation, overopt, rewards
from .checkpoints import PromptOrder, load_checkpoint, save_checkpoint
from .config import ConfigError, Experiment
from .memory import copies
from .roles import Roles, Scorer, reward_scales
from .records import StageInputError
from .runtime import Inputs, Interrupted, Plan, Session, stop_requested, upstream_rm, upstream_sft

OBSERVE_ITERATIONS: ContextVar[Callable[[tqdm], Iterable[int]] | None] = ContextVar("observe_iterations", default=None)
"""A tool's wrapper around the iterations of the online runs set up in its context (the loop as written, its `bar`
passed through the wrapper): tools/gpuprofile.py profiles one iteration of the real loop with it. None: no tool."""


def policy_plan(exp: Experiment, stage: str, with_rm: bool) -> Plan:
    """An online RL stage's inputs, before any model loads: the SFT run it starts from, the reward model's run (when
    `with_rm`), the prompts it samples and the held-out rows of its end-of-run check."""
    rewards.configured(exp)  # an import path that does not resolve fails here, before any model is loaded
    splits = data.load(exp)
    sft_dir, sft, tok = upstream_sft(exp, stage)
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


def optimizer_settings(p) -> dict:
    """An online section's AdamW settings, passed alike to either optimizer (online_sections.OnlineConfig)."""
    return dict(lr=p.learning_rate, betas=(p.adam_beta1, p.adam_beta2), eps=p.adam_epsilon,
                weight_decay=p.weight_decay)


def make_optimizer(params, p) -> torch.optim.Optimizer:
    """The online section `p`'s optimizer over `params`: torch's AdamW or bitsandbytes' paged 8-bit AdamW, with the
    same learning rate, betas, eps and weight decay (never either library's own defaults)."""
    if p.optim == "paged_adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.PagedAdamW8bit(params, **optimizer_settings(p))
    # foreach: one kernel per step over all tensors (the default on CUDA only; same values on a CPU, fewer launches)
    return torch.optim.AdamW(params, **optimizer_settings(p), foreach=True)


@dataclass
class OnlineRun:
    """One online run (setup() makes it): what the loop starts from, and what every iteration ends with and the run
    finishes with, so that ppo.py and grpo.py hold their algorithm: sample, score, advantage, update."""

    exp: Experiment
    stage: str
    section: object
    """The stage's config section (PPOConfig, GRPOConfig, RLOOConfig)."""
    data: Inputs
    """The plan's inputs: the SFT and RM runs (sft, rm), the tokenizer, prompts and splits."""
    session: Session
    roles: Roles
    opt: torch.optim.Optimizer
    scorer: Scorer
    order: PromptOrder
    gen_kwargs: dict
    """generation.generate's settings from the stage's section (with the merged sampler's bytes and rows)."""
    copy: float
    """Bytes of the dequantized copy of the 4-bit base the run trains through from start to end (the loop holds it:
    models.dequantized; memory/copies.py)."""
    ckpt_dir: Path
    history: list[dict]
    """Every iteration's metrics so far (restored on resume)."""
    state: dict | None
    """The state of the checkpoint the run resumes from (with the stage's own, PPO's kl_beta); None: a fresh run."""
    bar: tqdm
    """The iterations still to run, with rank 0's progress bar."""
    rb: int
    """This rank's rows of the rollout batch; mb_rows and micro_rows: of a minibatch and of a micro-batch."""
    mb_rows: int
    micro_rows: int
    score_rows: int
    """Rows per no-grad scoring pass (copies.scoring_rows)."""
    judge: overopt.Judge
    """The judge's measurements along training, its early stop and the policy it selects (keep=judge)."""
    cut: str | None = None
    """The warning about prompts longer than data.max_prompt_length (generation.cut_prompts): the summary's
    `warnings`, apart from the guard's calibrated `flags`."""

    def end_iteration(self, step: int, t0: float, metrics: dict, samples, **state) -> bool:
        """The iteration's record and checkpoint (end_iteration); `state`: the stage's own, saved with it. True: the
        run stops here, the judge having fallen significantly from its peak (overopt_stop)."""
        self.judge.end_iteration(step, metrics["kl/ref"])
        return end_iteration(self.stage, self.section, self.session, step, t0, metrics, self.history, samples,
                             self.roles, self.opt, self.order, self.ckpt_dir, self.judge, **state)

    def finish(self, parts: tuple[str, ...], metrics: dict, model: dict) -> dict:
        """The run's summary: the policy saved and compared with SFT on held-out prompts (save_and_check), the
        over-optimization report (overopt.report), the training figures and time per part (summarize) with the
        stage's own `metrics` (which override), and its `model` fields beside the SFT run's."""
        o = self.section
        adapter, final, kept = save_and_check(self.exp, self.session, self.roles,
                                              self.data.splits.eval[: self.exp.eval.prompts], self.stage,
                                              self.score_rows, self.judge)
        judged, flags = overopt.report(self.stage, o, self.session, self.history, final, self.judge, kept)
        trained, throughput = summarize(self.history, o.kl_band, parts)
        return self.session.finish({
            "metrics": {**final, **trained, **judged, **metrics, "steps": o.steps,
                        "episodes": o.steps * o.rollout_batch},
            "flags": flags,
            "warnings": [self.cut] if self.cut else [],
            "throughput": throughput,
            "model": {**self.data.sft["model"], "adapter": str(adapter) + "/policy", "reference": o.reference,
                      **model, "kept": kept},
        })


def setup(exp: Experiment, stage: str, section, resume: bool, prepare: Callable[[], Plan],
          make_roles: Callable[[Inputs], Roles], group: int = 1) -> OnlineRun:
    """Everything before an online stage's first iteration, in this order: this rank's batch sizes (its rollout rows
    a multiple of `group`), the plan (`prepare()`), the seeded session, the roles (`make_roles(plan.data)`), the
    optimizer, scorer and prompt order, then the checkpoint's state when the session resumes one."""
    where = exp.source or "config"
    # data parallel: each rank samples its share of every global rollout batch and updates on its share of each
    # minibatch; gradients and the statistics that must be global (whitening, KL, metrics) are reduced over ranks
    rb, mb_rows, micro_rows = (dist.per_device(getattr(section, k), f"{stage}.{k}", where)
                               for k in ("rollout_batch", "minibatch", "micro_batch"))
    if rb % group:
        raise ConfigError(f"{where}: {stage}.rollout_batch / processes ({rb}) must be a multiple of "
                          f"{stage}.num_generations ({group}): each rank samples whole groups")
    check_keep(exp, stage, section)
    plan = prepare()
    d = plan.data
    if section.keep == "judge" and not rewards.own_judge(exp) and not (d.rm or {}).get("judge"):
        raise StageInputError(f"{stage}.keep=judge: the reward model run has no judge (it was trained with "
                              f"data.judge_fraction = 0, or before there was one); rerun `make rm`")
    session = Session.start(exp, plan, resume=resume)
    cut = generation.cut_prompts(d.tok, [row["prompt"] for row in d.prompts], exp.data.max_prompt_length)
    if cut and dist.is_main():
        print(f"warning: {cut}", file=sys.stderr, flush=True)
    with session.probe.phase("load"):
        roles = make_roles(d)
    opt = make_optimizer(roles.trainable, section)
    scorer = Scorer(exp, roles, reward_scales(exp, section, d.rm), section, len(d.prompts))
    order = PromptOrder(len(d.prompts), exp.seed)  # sampling and minibatch shuffles use torch's seeded RNG
    copy, sampler_copy, rows = copies.copies(exp, stage)  # the training path's copy, the sampler's
    gen_kwargs = dict(max_new_tokens=section.max_new_tokens, temperature=section.temperature, top_p=section.top_p,
                      max_prompt_length=exp.data.max_prompt_length, batch_size=rows, copy_bytes=sampler_copy)
    score_rows = copies.scoring_rows(section, rows, rb)
    smp = generation.sampler_for(roles.model, sampler_copy, rows, exp.data.max_prompt_length
                                 + max(section.max_new_tokens, exp.eval.max_new_tokens))
    if smp is not None:
        smp.watch(opt)  # merged again after every optimizer step
    ckpt_dir = session.run.dir / "checkpoints"
    history: list[dict] = []
    state, first = None, 1
    judge = overopt.Judge(exp, section, roles, scorer, d.rm, d.prompts, gen_kwargs, score_rows)
    if session.checkpoint:
        state = load_checkpoint(roles, opt, order, session.checkpoint)
        history, first = state["history"], state["step"] + 1
        judge.restore(state)
    bar = tqdm(range(first, section.steps + 1), desc=stage, unit="it", initial=first - 1, total=section.steps,
               disable=not dist.is_main())
    observe = OBSERVE_ITERATIONS.get()
    return OnlineRun(exp, stage, section, d, session, roles, opt, scorer, order, gen_kwargs, copy, ckpt_dir, history,
                     state, observe(bar) if observe else bar, rb, mb_rows, micro_rows, score_rows, judge, cut)


def check_keep(exp: Experiment, stage: str, section) -> None:
    """keep=judge needs the judge: refused, naming what is missing, before anything loads (checked when the
    stage runs: another stage of the same experiment may do without it)."""
    if section.keep != "judge":
        return
    r = exp.reward
    missing = [what for ok, what in ((section.judge_every > 0, f"{stage}.judge_every > 0"),
                                     (exp.data.judge_fraction > 0 or rewards.own_judge(exp),
                                      "data.judge_fraction > 0, reward.judge_functions or reward.judge_model"),
                                     (r.model > 0 or bool(r.functions),
                                      "a reward to guard (reward.model > 0 or reward.functions)"))
               if not ok]
    if missing:
        raise ConfigError(f"{exp.source or 'config'}: {stage}.keep=judge needs the judge: {', '.join(missing)}; "
                          f"or set {stage}.keep=last (or auto: the judge's choice when the run has one)")


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
    """How far what sampled the rollout (the merged sampler: rlhf/sampler.py) is from the training path whose
    log-probs (`logp`, the old log-probs of the ratio) the update uses, over every rank's response tokens:
    `rollout/logprob_gap_max` and `rollout/logprob_gap_mean` of |log q - log pi_old| (docs/algorithms.md)."""
    if sample_logp is None:
        return {}
    gap = dist.all_gather_rows((sample_logp - logp.detach()).abs() * mask)
    m = dist.all_gather_rows(mask)
    return {"rollout/logprob_gap_max": gap.max().item(), "rollout/logprob_gap_mean": (gap.sum() / m.sum().clamp(
        min=1)).item()}


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


def end_iteration(stage: str, o, session, step: int, t0: float, metrics: dict, history: list[dict], samples,
                  roles: Roles, opt, order: PromptOrder, ckpt_dir: Path, judge: overopt.Judge | None = None,
                  **state) -> None:
    """An iteration's record: memory figures, the metrics line, a few `samples` (score name, [prompt, response,
    score] rows[, {column: values} the reward functions logged with log_extra, one value per response of the batch,
    added as columns]) every o.log_samples_every, the iteration's time; then a checkpoint (with the `judge`'s state
    and kept policies) every o.save_steps, at the end, at the judge's fall (overopt_stop: returns True, the run ends
    there) or on a stop request (rank 0: the ranks hold the same state), after which a stop raises Interrupted."""
    session.probe.sample(step)
    metrics.update({f"memory/{k}": v for k, v in session.probe.read().items()})
    session.log(step, metrics)
    history.append(metrics)
    if o.log_samples_every and step % o.log_samples_every == 0:
        name, rows, extra = (*samples, {})[:3]
        columns = ["prompt", "response", name, *extra]
        rows = [[*row, *(v[i] if i < len(v) else None for v in extra.values())] for i, row in enumerate(rows)]
        session.tracker.table("samples", columns, rows)
        session.run.log(step, {"samples": rows, **({"sample_columns": columns} if extra else {})})
    metrics["time/step_s"] = time.time() - t0  # the whole iteration: rollout, update, bookkeeping
    stop = dist.any_rank(stop_requested()) and step < o.steps  # every rank stops at the same step
    fell = bool(judge and judge.should_stop)  # the same on every rank: the judge's scores are gathered
    if ((o.save_steps and step % o.save_steps == 0) or step == o.steps or stop or fell) and dist.is_main():
        kept, tensors = judge.state() if judge else ({}, {})
        save_checkpoint(roles, opt, step, ckpt_dir, order=order, history=history, metrics_lines=session.run.lines,
                        tensors=tensors, **kept, **state)
    if stop:
        raise Interrupted(f"{stage} stopped at step {step} with a checkpoint in {ckpt_dir}; rerun the same command "
                          f"to resume")
    return fell


def save_and_check(exp: Experiment, session, roles: Roles, rows: list[dict], stage: str,
                   per_pass: int, judge: overopt.Judge | None = None) -> tuple[Path, dict, dict | None]:
    """The policy adapter saved (rank 0; the `judge`'s choice with keep=judge), then compared with SFT on the held-out
    `rows` (checks); (adapter dir, the check's metrics, what keep=judge kept or None)."""
    from . import checks

    kept = judge.keep_selected() if judge else None
    adapter, final = session.run.dir / "adapter", {}
    if dist.is_main():  # the final comparison is rank 0's (the other ranks hold the same policy)
        with faults.writing(adapter, "adapter"):
            roles.model.save_pretrained(adapter, selected_adapters=["policy"])
            roles.tok.save_pretrained(adapter / "policy")  # the adapter dir the summary names loads on its own
        with session.probe.phase("eval"):
            final = checks.policy_vs_sft(exp, roles, roles.tok, rows, stage, per_pass)
    return adapter, final, kept


def summarize(history: list[dict], kl_band: list[float], parts: tuple[str, ...]) -> tuple[dict, dict]:
    """(metrics, throughput) of a finished run: the last five iterations' mean KL to the reference (and whether it
    is inside `kl_band`) and reward; the mean seconds per iteration, in all and by part, and `judge_share`: the
    judge's measurements' share of the run's iteration time (sampling and scoring judge_prompts every judge_every
    iterations)."""
    last = history[-min(5, len(history)):]
    kl_last = sum(h["kl/ref"] for h in last) / len(last)  # the exact KL to the reference (kl/ref), as kl_band

    def mean(k):
        return sum(h.get(k, 0.0) for h in history) / len(history)

    return ({"train_kl_ref_last5": kl_last, "kl_within_band": kl_band[0] <= kl_last <= kl_band[1],
             "train_reward_last5": sum(h["reward/mean"] for h in last) / len(last)},
            {"tokens_per_s": mean("tokens_per_s"), "rollout_s_per_step": mean("time/rollout_s"),
             "update_s_per_step": mean("time/update_s"), "step_s": mean("time/step_s"),
             "judge_share": mean("time/judge_s") / max(mean("time/step_s"), 1e-12),
             **{f"{k}_s_per_step": mean(f"time/{k}_s") for k in parts}})
