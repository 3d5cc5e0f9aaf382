"""What the online loops (ppo.py, grpo.py) share: their setup and the run it makes (OnlineRun), which holds the
bookkeeping around each iteration of their algorithm (its clock and timed parts, memory phases, the judge's
measurements, the collectives behind global figures, the record and checkpoint) and the end-of-run check and summary.
A rollout's no-grad passes and logged figures are in trajectory.py, the roles and a rollout's scoring in roles.py,
checkpoints in checkpoints.py, the collectives in dist.py, the maths in losses.py."""

from __future__ import annotations

import contextlib
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
from tqdm import tqdm

from . import dist, faults, generation, guard, losses, models, overopt, rewards
from .checkpoints import PromptOrder, load_checkpoint, save_checkpoint
from .config import ConfigError, Experiment
from .memory import copies
from .roles import Roles, Scorer, reward_scales
from .records import StageInputError
from .runtime import Inputs, Interrupted, Plan, Session, stop_requested
from .trajectory import Timer, sampler_gap

OBSERVE_ITERATIONS: ContextVar[Callable[[tqdm], Iterable[int]] | None] = ContextVar("observe_iterations", default=None)
"""A tool's wrapper around the iterations of the online runs set up in its context (the loop as written, its `bar`
passed through the wrapper): tools/gpuprofile.py profiles one iteration of the real loop with it. None: no tool."""


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
    it: Iteration | None = None
    """The iteration in progress (iterations())."""

    # ---- the bookkeeping around each iteration of the algorithm: its clock and timed parts, the memory phases, the
    # judge's measurements, and the collectives behind the figures that are global over data-parallel ranks
    def iterations(self):
        """The iterations still to run (rank 0's progress bar), each with its own clock and timer, inside the
        run-long dequantized base where it fits (memplan; a loop that breaks out closes it at once)."""
        with models.dequantized(self.roles.model, self.copy):
            for step in self.bar:
                self.it = Iteration(step)
                yield step

    @property
    def timer(self) -> Timer:
        """The iteration's timed parts (time/<part>_s)."""
        return self.it.timer

    @property
    def ranks(self) -> int:
        """Data-parallel ranks (1 in a single process)."""
        return dist.world_size()

    def prompts(self, n: int) -> list[dict]:
        """This rank's share of the next `n` training prompts in the seeded order."""
        return dist.local_rows([self.data.prompts[i] for i in self.order.take(n)], n)

    @contextlib.contextmanager
    def rollout(self):
        """The rollout's memory phase: sampling and the no-grad passes over it."""
        with self.session.probe.phase("rollout"):
            yield

    def generate(self, rows: list[dict], **kwargs) -> generation.Rollout:
        """The policy's responses to the `rows`' prompts with the stage's sampling settings (timed as generate)."""
        self.it.rows = rows
        with self.timer("generate"):
            self.it.r = generation.generate(self.roles.model, self.data.tok, [row["prompt"] for row in rows],
                                            **self.gen_kwargs, **kwargs, desc="rollout")
        return self.it.r

    def score(self, raw: torch.Tensor | None, rows: list[dict], r: generation.Rollout, step: int) -> torch.Tensor:
        """Each response's reward (roles.Scorer: the reward model's `raw` scores on the stage's scale and/or the
        reward functions'); then the judge measures this policy (every judge_every iterations, before the update:
        keep=judge may keep it)."""
        self.it.texts = generation.decode(self.data.tok, r)
        reward, self.it.parts = self.scorer(raw, rows, self.it.texts, self.timer, generation.response_ids(r), step)
        with self.timer("judge"):  # every judge_every iterations, before the update (keep=judge may keep this policy)
            self.it.judged = self.judge.measure(step)
        return reward

    def total(self, x) -> float | list[float]:
        """`x` (a number, a list of them or a tensor) summed over every rank, in float64."""
        return dist.all_reduce_(torch.as_tensor(x, dtype=torch.float64)).tolist()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of `x`, in rank order: the global rollout batch."""
        return dist.all_gather_rows(x)

    @contextlib.contextmanager
    def update(self):
        """The update, timed from the rollout's end, in its memory phase and train mode (gradient checkpointing acts
        in train mode only; dropout is off); eval mode after."""
        it = self.it
        it.rollout_s = time.time() - it.t0
        t1 = time.time()
        self.roles.model.train()
        with self.session.probe.phase("update"):
            yield
        self.roles.model.eval()
        it.update_s = time.time() - t1

    def accumulate(self, stats: dict[str, float], m: torch.Tensor) -> None:
        """A micro-batch's statistics, weighted by its response tokens (`m`: its mask), for update_stats."""
        w, weighted = float(m.sum()), self.it.weighted
        weighted["_w"] += w
        for k, v in stats.items():
            weighted[k] = weighted.get(k, 0.0) + v * w

    def optimizer_step(self, max_grad_norm: float) -> None:
        """The minibatch's gradients summed over ranks, clipped to `max_grad_norm` (the norm logged), one optimizer
        step (timed as optimizer)."""
        with self.timer("optimizer"):
            dist.average_gradients(self.roles.trainable)
            self.it.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.roles.trainable, max_grad_norm)))
            self.opt.step()

    @property
    def optimizer_steps(self) -> int:
        """The iteration's optimizer steps so far."""
        return len(self.it.grad_norms)

    def update_stats(self) -> dict[str, float]:
        """The update's statistics (accumulate) as token-weighted means over every micro-batch and rank, and the
        mean gradient norm (the same on every rank)."""
        return {**dist.global_means(self.it.weighted), "grad_norm": sum(self.it.grad_norms) / self.optimizer_steps}

    def responses(self, entropy: torch.Tensor) -> dict[str, float]:
        """The sampled responses over every rank: `entropy` (per token, the sampling policy's) as a token mean,
        their mean length and the fraction that ended with EOS."""
        r = self.it.r
        mask, ended, ent = (self.gather(x) for x in (r.mask.float(), r.ended.float(), entropy))
        return {"entropy": losses.masked_mean(ent, mask).item(), "response/length": mask.sum(1).mean().item(),
                "response/eos_frac": ended.mean().item()}

    def logged(self, pi_old: torch.Tensor) -> dict[str, float]:
        """What every iteration logs after its algorithm's figures: the seconds of the rollout, the update and each
        timed part; sampled tokens per second; the sampler's log-prob gap to `pi_old`, the log-probs the update's
        ratio took as old (sampler_gap); the reward's parts (reward/<component>, ...) and the judge's measurement."""
        it = self.it
        n_tokens = int(dist.all_reduce_(it.r.attention_mask.sum().double()))
        return {"time/rollout_s": it.rollout_s, "time/update_s": it.update_s,
                **{f"time/{k}_s": v for k, v in it.timer.s.items()},
                "tokens_per_s": n_tokens / (it.rollout_s + it.update_s),
                **sampler_gap(it.r.sample_logp, pi_old, it.r.mask.float()),
                **self.scorer.metrics(it.parts),  # reward/<component>, reward/<function>/none, reward_fn/<logged>
                **it.judged}

    def end_iteration(self, step: int, metrics: dict, shown: tuple[str, torch.Tensor], **state) -> bool:
        """The iteration's record and checkpoint (end_iteration) with a few responses and `shown` (a name, a score
        per response); `state`: the stage's own, saved with it. True: the run stops here, the judge having fallen
        significantly from its peak (overopt_stop)."""
        it, (name, scores) = self.it, shown
        beta = {"beta": f"{metrics['kl/beta']:.3f}"} if "kl/beta" in metrics else {}
        self.bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", kl=f"{metrics['kl/ref']:.2f}", **beta)
        t0, samples = it.t0, (name, [[row["prompt"], t, round(float(x), 3)]
                                     for row, t, x in zip(it.rows[:4], it.texts[:4], scores[:4])],
                              self.scorer.log.extra)  # + the columns reward functions logged with log_extra
        self.judge.end_iteration(step, metrics["kl/ref"])
        return end_iteration(self.stage, self.section, self.session, step, t0, metrics, self.history, samples,
                             self.roles, self.opt, self.order, self.ckpt_dir, self.judge, **state)

    def finish(self, parts: tuple[str, ...], metrics: dict, model: dict) -> dict:
        """The run's summary: the judge's measurement of the final policy (after the last update), the policy saved
        and compared with SFT on held-out prompts (save_and_check), the over-optimization report (overopt.report),
        the training figures and time per part (summarize) with the stage's own `metrics` (which override), and its
        `model` fields beside the SFT run's."""
        o = self.section
        measured = self.judge.measure_final(len(self.history))  # after the last update: the final policy
        if measured:
            self.session.log(len(self.history) + 1, measured)
        adapter, final, kept, last = save_and_check(self.exp, self.session, self.roles,
                                                    self.data.splits.eval[: self.exp.eval.prompts], self.stage,
                                                    self.score_rows, self.judge)
        judged, flags = overopt.report(self.stage, o, self.session, self.history, final, self.judge, kept, last)
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
    overopt.check_keep(exp, stage, section)
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
    dist.seed_apart(exp.seed)  # the model is built alike on every rank; now each rank samples with its own noise
    if session.checkpoint:
        state = load_checkpoint(roles, opt, order, session.checkpoint)
        history, first = state["history"], state["step"] + 1
        judge.restore(state)
    bar = tqdm(range(first, section.steps + 1), desc=stage, unit="it", initial=first - 1, total=section.steps,
               disable=not dist.is_main())
    observe = OBSERVE_ITERATIONS.get()
    return OnlineRun(exp, stage, section, d, session, roles, opt, scorer, order, gen_kwargs, copy, ckpt_dir, history,
                     state, observe(bar) if observe else bar, rb, mb_rows, micro_rows, score_rows, judge, cut)


@dataclass
class Iteration:
    """One iteration's bookkeeping (OnlineRun.iterations): its clock and timed parts, the rollout it sampled, the
    update's statistics and the judge's measurement."""

    step: int
    t0: float = field(default_factory=time.time)
    timer: Timer = field(default_factory=lambda: Timer())
    rows: list[dict] = field(default_factory=list)
    r: generation.Rollout | None = None
    texts: list[str] = field(default_factory=list)
    parts: dict = field(default_factory=dict)
    """The reward's parts (Scorer), for the log."""
    judged: dict = field(default_factory=dict)
    rollout_s: float = 0.0
    update_s: float = 0.0
    grad_norms: list[float] = field(default_factory=list)
    weighted: dict[str, float] = field(default_factory=lambda: {"_w": 0.0})
    """Micro-batch statistics x their token counts, and the counts' sum (_w)."""


def end_iteration(stage: str, o, session, step: int, t0: float, metrics: dict, history: list[dict], samples,
                  roles: Roles, opt, order: PromptOrder, ckpt_dir: Path, judge: overopt.Judge | None = None,
                  **state) -> None:
    """An iteration's record: memory figures, the metrics line, a few `samples` (score name, [prompt, response,
    score] rows[, {column: values} the reward functions logged with log_extra, one value per response of the batch,
    added as columns]) every o.log_samples_every, the iteration's time; then a checkpoint (with the `judge`'s state
    and kept policies) every o.save_steps, at the end, at the judge's fall (overopt_stop: returns True, the run ends
    there) or on a stop request (every rank: checkpoints.save_checkpoint), after which a stop raises Interrupted."""
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
    if (o.save_steps and step % o.save_steps == 0) or step == o.steps or stop or fell:
        kept, tensors = judge.state() if judge else ({}, {})
        save_checkpoint(roles, opt, step, ckpt_dir, order=order, history=history, metrics_lines=session.run.lines,
                        tensors=tensors, **kept, **state)
    if stop:
        raise Interrupted(f"{stage} stopped at step {step} with a checkpoint in {ckpt_dir}; rerun the same command "
                          f"to resume")
    return fell


def save_and_check(exp: Experiment, session, roles: Roles, rows: list[dict], stage: str, per_pass: int,
                   judge: overopt.Judge | None = None) -> tuple[Path, dict, dict | None, dict | None]:
    """The policy adapter saved (rank 0; the `judge`'s choice with keep=judge), then compared with SFT on the held-out
    `rows` (checks; the judge's win labelled as the grader that also selected it). When the kept policy is not the
    run's last, the last one is compared on the same prompts and samples too, and each grader's paired difference
    between the two per prompt is reported: what the selection gained or lost, on prompts that selected nothing.
    (adapter dir, the check's metrics, what keep=judge kept or None, {"check", "kept_minus_last"} or None)."""
    from . import checks

    # the judge holds a CPU copy of every policy it may keep, the last one measured (the final policy) among them
    last_weights = judge.weights.get(judge.points[-1]["iteration"]) if judge and judge.keep and judge.points else None
    kept = judge.keep_selected() if judge else None
    adapter, final, last = session.run.dir / "adapter", {}, None
    both = bool(kept and not kept["last"])
    if dist.is_main():  # the final comparison is rank 0's (the other ranks hold the same policy)
        with faults.writing(adapter, "adapter"):
            roles.model.save_pretrained(adapter, selected_adapters=["policy"])
            roles.tok.save_pretrained(adapter / "policy")  # the adapter dir the summary names loads on its own
        cache: dict = {}  # SFT's samples and scores, drawn once for both checks
        with session.probe.phase("eval"):
            final = checks.policy_vs_sft(exp, roles, roles.tok, rows, stage, per_pass, kept and "judge", cache)
            if both:
                judge.load_policy(last_weights)
                check = checks.policy_vs_sft(exp, roles, roles.tok, rows, stage, per_pass, None, cache)
                judge.load_policy(judge.weights[kept["iteration"]])
                ours, theirs = final.pop("_scores", {}), check.pop("_scores", {})
                last = {"check": check, "kept_minus_last": {
                    k: {key: v for key, v in guard.paired(ours[k], theirs[k]).items() if key != "n"}
                    for k in ours}}
        final.pop("_scores", None)
    return adapter, final, kept, last


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
