"""What the online loops (ppo.py, grpo.py) share: their setup and the run it makes (OnlineRun) from its plan
(online_plan.py, resolved before anything loads) and a few named parts, each made by one function: the models and
their optimizer (models_and_optimizer), the merged sampler (attach_sampler), the judge (make_judge) and the record
(Record: the metrics line, samples and checkpoint). The run holds the bookkeeping around each iteration of their
algorithm (its clock and timed parts, memory phases, the collectives behind global figures) and the end-of-run check
and summary. A rollout's no-grad passes and logged figures are in trajectory.py, the roles and a rollout's scoring in
roles.py, checkpoints in checkpoints.py, the collectives in dist.py, the maths in losses.py."""

from __future__ import annotations

import contextlib
import math
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
from tqdm import tqdm

from rlhf.infra import dist, faults
from rlhf.rl import checks, generation, overopt, rewards
from rlhf.maths import guard, losses
from rlhf.inputs import models
from rlhf.rl.checkpoints import PromptOrder, load_checkpoint, save_checkpoint
from rlhf.rl.online_plan import OnlinePlan
from rlhf.rl.roles import Roles, Scorer
from rlhf.runs.runtime import Inputs, Interrupted, Session, stop_requested
from rlhf.rl.trajectory import Timer, sampler_gap

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
class Scored:
    """A rollout's reward (OnlineRun.score): each response's `total`, its decoded `texts` and the reward's `parts`
    (roles.Scorer: per component, for the log)."""

    total: torch.Tensor
    texts: list[str]
    parts: dict


@dataclass
class Iteration:
    """One iteration's clock and timed parts and its update's statistics (OnlineRun.iterations)."""

    step: int
    t0: float = field(default_factory=time.time)
    timer: Timer = field(default_factory=lambda: Timer())
    rollout_s: float = 0.0
    update_s: float = 0.0
    grad_norms: list[float] = field(default_factory=list)
    weighted: dict[str, float] = field(default_factory=lambda: {"_w": 0.0})
    """Micro-batch statistics x their token counts, and the counts' sum (_w)."""


@dataclass
class Record:
    """An online run's record along its iterations (make_record): the metrics line with the memory figures, a few
    samples every log_samples_every, and the checkpoint (with the judge's state and kept policies) every save_steps,
    at the end, at the judge's fall or on a stop request."""

    stage: str
    section: object
    """The stage's section: log_samples_every, save_steps, steps."""
    session: Session
    roles: Roles | None
    opt: torch.optim.Optimizer | None
    order: PromptOrder | None
    ckpt_dir: Path
    judge: overopt.Judge | None = None
    history: list[dict] = field(default_factory=list)
    """Every iteration's metrics so far (restored on resume)."""

    def end(self, step: int, t0: float, metrics: dict, samples, **state) -> bool:
        """The iteration's record: memory figures, the iteration's time (from `t0`), the metrics line, a few `samples`
        (score name, [prompt, response, score] rows[, {column: values} the reward functions logged with log_extra,
        one value per response of the batch, added as columns]) every log_samples_every; then a checkpoint with
        `state` (the stage's own) every save_steps, at the end, at the judge's fall (overopt_stop: returns True, the
        run ends there) or on a stop request (every rank, each saving its RNG states), after which a stop raises
        Interrupted."""
        o, session = self.section, self.session
        session.probe.sample(step)
        metrics.update({f"memory/{k}": v for k, v in session.probe.read().items()})
        metrics["time/step_s"] = time.time() - t0  # the whole iteration: rollout, update, bookkeeping
        session.log(step, metrics)
        self.history.append(metrics)
        if o.log_samples_every and step % o.log_samples_every == 0:
            name, rows, extra = (*samples, {})[:3]
            columns = ["prompt", "response", name, *extra]
            rows = [[*row, *(v[i] if i < len(v) else None for v in extra.values())] for i, row in enumerate(rows)]
            session.tracker.table("samples", columns, rows)
            session.run.log(step, {"samples": rows, **({"sample_columns": columns} if extra else {})})
        stop = dist.any_rank(stop_requested()) and step < o.steps  # every rank stops at the same step
        fell = bool(self.judge and self.judge.guard.should_stop)  # the same on every rank: the scores are gathered
        if (o.save_steps and step % o.save_steps == 0) or step == o.steps or stop or fell:  # every rank: its RNGs
            kept, tensors = self.judge.state() if self.judge else ({}, {})
            save_checkpoint(self.roles, self.opt, step, self.ckpt_dir, order=self.order, history=self.history,
                            metrics_lines=session.run.lines, tensors=tensors, **kept, **state)
        if stop:
            raise Interrupted(f"{self.stage} stopped at step {step} with a checkpoint in {self.ckpt_dir}; rerun the "
                              f"same command to resume")
        return fell


@dataclass
class OnlineRun:
    """One online run (setup() makes it): its plan and its parts, what the loop starts from, and what every iteration
    ends with and the run finishes with, so that ppo.py and grpo.py hold their algorithm: sample, score, judge,
    advantage, update."""

    plan: OnlinePlan
    session: Session
    roles: Roles
    opt: torch.optim.Optimizer
    scorer: Scorer
    order: PromptOrder
    judge: overopt.Judge
    """The judge's measurements along training, its early stop and the policy it selects (keep=judge)."""
    record: Record
    state: dict | None
    """The state of the checkpoint the run resumes from (with the stage's own, PPO's kl_beta); None: a fresh run."""
    bar: tqdm
    """The iterations still to run, with rank 0's progress bar."""
    it: Iteration | None = None
    """The iteration in progress (iterations()): its clock, timer and update statistics."""

    @property
    def data(self) -> Inputs:
        return self.plan.data

    @property
    def rb(self) -> int:
        """This rank's rows of the rollout batch (the plan's); mb_rows and micro_rows: of a minibatch and of a
        micro-batch."""
        return self.plan.rb

    @property
    def mb_rows(self) -> int:
        return self.plan.mb_rows

    @property
    def micro_rows(self) -> int:
        return self.plan.micro_rows

    @property
    def score_rows(self) -> int:
        """Rows per no-grad scoring pass (the plan's)."""
        return self.plan.score_rows

    # ---- the bookkeeping around each iteration of the algorithm: its clock and timed parts, the memory phases, and
    # the collectives behind the figures that are global over data-parallel ranks
    def iterations(self):
        """The iterations still to run (rank 0's progress bar), each with its own clock and timer, inside the
        run-long dequantized base where it fits (the plan's train_copy; a loop that breaks out closes it at once)."""
        with models.dequantized(self.roles.model, self.plan.train_copy):
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
        with self.timer("generate"):
            return generation.generate(self.roles.model, self.data.tok, [row["prompt"] for row in rows],
                                       **self.plan.gen_kwargs, **kwargs, desc="rollout")

    def score(self, raw: torch.Tensor | None, rows: list[dict], r: generation.Rollout, step: int) -> Scored:
        """Each response's reward (roles.Scorer: the reward model's `raw` scores on the stage's scale and/or the
        reward functions'), with the decoded responses and the reward's parts."""
        texts = generation.decode(self.data.tok, r)
        total, parts = self.scorer(raw, rows, texts, self.timer, generation.response_ids(r), step)
        return Scored(total, texts, parts)

    def measure(self, step: int) -> dict[str, float]:
        """The judge's measurement of the policy (overopt.Judge.measure: every judge_every iterations, before the
        update, so that keep=judge may keep this policy), timed as judge; {} at the other iterations."""
        with self.timer("judge"):
            return self.judge.measure(step)

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
        """The minibatch's gradients summed over ranks, clipped to `max_grad_norm` (0: not clipped, TRL's meaning;
        the norm logged), one optimizer step (timed as optimizer)."""
        with self.timer("optimizer"):
            dist.average_gradients(self.roles.trainable)
            bound = max_grad_norm or math.inf
            self.it.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.roles.trainable, bound)))
            self.opt.step()

    @property
    def optimizer_steps(self) -> int:
        """The iteration's optimizer steps so far."""
        return len(self.it.grad_norms)

    def update_stats(self) -> dict[str, float]:
        """The update's statistics (accumulate) as token-weighted means over every micro-batch and rank, and the
        mean gradient norm (the same on every rank)."""
        return {**dist.global_means(self.it.weighted), "grad_norm": sum(self.it.grad_norms) / self.optimizer_steps}

    def responses(self, r: generation.Rollout, entropy: torch.Tensor) -> dict[str, float]:
        """The sampled responses `r` over every rank: `entropy` (per token, the sampling policy's) as a token mean,
        their mean length and the fraction that ended with EOS."""
        mask, ended, ent = (self.gather(x) for x in (r.mask.float(), r.ended.float(), entropy))
        return {"entropy": losses.masked_mean(ent, mask).item(), "response/length": mask.sum(1).mean().item(),
                "response/eos_frac": ended.mean().item()}

    def logged(self, r: generation.Rollout, pi_old: torch.Tensor, scored: Scored, judged: dict) -> dict[str, float]:
        """What every iteration logs after its algorithm's figures: the seconds of the rollout, the update and each
        timed part; sampled tokens per second of `r`; the sampler's log-prob gap to `pi_old`, the log-probs the
        update's ratio took as old (sampler_gap); the reward's parts (reward/<component>, ...) of `scored` and the
        judge's measurement `judged`."""
        it = self.it
        n_tokens = int(dist.all_reduce_(r.attention_mask.sum().double()))
        return {"time/rollout_s": it.rollout_s, "time/update_s": it.update_s,
                **{f"time/{k}_s": v for k, v in it.timer.s.items()},
                "tokens_per_s": n_tokens / (it.rollout_s + it.update_s),
                **sampler_gap(r.sample_logp, pi_old, r.mask.float()),
                **self.scorer.metrics(scored.parts),  # reward/<component>, reward/<function>/none, reward_fn/<logged>
                **judged}

    def end_iteration(self, step: int, metrics: dict, rows: list[dict], scored: Scored,
                      shown: tuple[str, torch.Tensor], **state) -> bool:
        """The iteration's end: the judge reads its KL (overopt.Judge.end_iteration: the KL budget), then the record
        (Record.end) with a few of the `rows`' responses and `shown` (a name, a score per response); `state`: the
        stage's own, saved with the checkpoint. True: the run stops here, the judge having fallen significantly from
        its peak or the run having left its KL budget (overopt_stop)."""
        name, scores = shown
        beta = {"beta": f"{metrics['kl/beta']:.3f}"} if "kl/beta" in metrics else {}
        self.bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", kl=f"{metrics['kl/ref']:.2f}", **beta)
        samples = (name, [[row["prompt"], t, round(float(x), 3)] for row, t, x in zip(rows[:4], scored.texts[:4],
                                                                                       scores[:4])],
                   self.scorer.log.extra)  # + the columns reward functions logged with log_extra
        self.judge.end_iteration(step, metrics["kl/ref"])
        return self.record.end(step, self.it.t0, metrics, samples, **state)

    def finish(self, parts: tuple[str, ...], metrics: dict, model: dict) -> dict:
        """The run's summary: the judge's measurement of the final policy (after the last update), the policy saved
        and compared with SFT on held-out prompts (save_and_check), the over-optimization report (overopt.report),
        the training figures and time per part (summarize) with the stage's own `metrics` (which override), and its
        `model` fields beside the SFT run's."""
        o, history, stage = self.plan.section, self.record.history, self.plan.stage
        measured = self.judge.measure_final(len(history))  # after the last update: the final policy
        if measured:
            self.session.log(len(history) + 1, measured)
        adapter, final, kept, last = save_and_check(self.plan.check, self.session, self.roles, self.plan.eval_rows,
                                                    self.data.sft, self.score_rows, self.judge)
        judged, flags, notes = overopt.report(stage, o, self.session, history, final, self.judge, kept, last)
        trained, throughput = summarize(history, o.kl_band, parts, self.judge.playoff_s)
        unguarded = [] if self.judge.on else dist.warn(unguarded_kl(stage, {**trained, **metrics}, o.kl_band))
        return self.session.finish({
            "metrics": {**final, **trained, **judged, **metrics, "steps": o.steps,  # planned; stopped_early: where it
                        "episodes": len(history) * o.rollout_batch},  # ended; episodes: those the run trained on
            "flags": flags,
            "warnings": [*self.plan.warnings, *notes, *unguarded],
            "throughput": throughput,
            "sampler": generation.sampler_state(self.roles.model, self.plan.sampler_copy, self.plan.sampling_rows),
            "model": {**self.data.sft["model"], "adapter": str(adapter) + "/policy", "reference": o.reference,
                      **model, "kept": kept},
        })


# ---- the run's parts, each made by one function from the plan
def models_and_optimizer(plan: OnlinePlan, session: Session,
                         make_roles: Callable[[OnlinePlan], Roles]) -> tuple[Roles, torch.optim.Optimizer]:
    """The roles on the one base (`make_roles(plan)`, in the load memory phase) and the optimizer over their
    trained parameters."""
    with session.probe.phase("load"):
        roles = make_roles(plan)
    return roles, make_optimizer(roles.trainable, plan.section)


def attach_sampler(plan: OnlinePlan, roles: Roles, opt: torch.optim.Optimizer) -> None:
    """The merged sampler of the plan's copy and rows on the policy (generation.sampler_for; none when the plan holds
    no copy), merged again after every optimizer step."""
    smp = generation.sampler_for(roles.model, plan.sampler_copy, plan.sampling_rows, plan.sampler_length)
    if smp is not None:
        smp.watch(opt)


def make_judge(plan: OnlinePlan, roles: Roles, scorer: Scorer) -> overopt.Judge:
    """The judge with the plan's settings, with the user's judge (rewards.judges) loaded when the settings name it
    and measure: a path that is not a reward model fails before training."""
    s, c = plan.judge, plan.check
    return overopt.Judge(s, roles, scorer, rewards.judges(c.reward, c.loading, c.eval.batch_size)
                         if s.own and s.every else None)


def make_record(plan: OnlinePlan, session: Session, roles: Roles, opt, order: PromptOrder,
                judge: overopt.Judge) -> Record:
    """The run's record, in the session's run directory (its checkpoints under checkpoints/)."""
    return Record(plan.stage, plan.section, session, roles, opt, order, session.run.dir / "checkpoints", judge)


def setup(plan: OnlinePlan, session: Session, make_roles: Callable[[OnlinePlan], Roles]) -> OnlineRun:
    """Everything before an online stage's first iteration, from its `plan` (online_plan.resolve) and its `session`
    (Session.start, seeded, its run record resumed or new): the models and optimizer, the scorer and prompt order,
    the sampler, the judge and the record, then the checkpoint's state when the session resumes one."""
    for warning in plan.warnings:
        dist.warn(warning)
    roles, opt = models_and_optimizer(plan, session, make_roles)
    scorer = Scorer(plan.scoring, roles)
    order = PromptOrder(len(plan.data.prompts), plan.seed)  # sampling and minibatch shuffles use torch's seeded RNG
    attach_sampler(plan, roles, opt)
    judge = make_judge(plan, roles, scorer)
    record = make_record(plan, session, roles, opt, order, judge)
    state, first = None, 1
    dist.seed_apart(plan.seed)  # the model is built alike on every rank; now each rank samples with its own noise
    if session.checkpoint:
        state = load_checkpoint(roles, opt, order, session.checkpoint)
        record.history, first = state["history"], state["step"] + 1
        judge.restore(state)
    o = plan.section
    # a checkpoint the guard stopped the run at (overopt_stop) resumes to the final checks: no iteration after it
    last = first - 1 if judge.guard.should_stop else o.steps
    bar = tqdm(range(first, last + 1), desc=plan.stage, unit="it", initial=first - 1, total=o.steps,
               disable=not dist.is_main())
    observe = OBSERVE_ITERATIONS.get()
    return OnlineRun(plan, session, roles, opt, scorer, order, judge, record, state, observe(bar) if observe else bar)


def save_and_check(check: checks.Check, session, roles: Roles, rows: list[dict], sft: dict, per_pass: int,
                   judge: overopt.Judge | None = None) -> tuple[Path, dict, dict | None, dict | None]:
    """The policy adapter saved (rank 0; the `judge`'s choice with keep=judge), then compared with the `sft` run's
    policy on the held-out `rows` (checks: as `check` says; the judge's win labelled as the grader that also
    selected it). When the kept policy is not the
    run's last, the last one is compared on the same prompts and samples too, and each grader's paired difference
    between the two per prompt is reported: what the selection gained or lost, on prompts that selected nothing.
    (adapter dir, the check's metrics, what keep=judge kept or None, {"check", "kept_minus_last"} or None)."""
    # the judge holds a CPU copy of every policy it may keep, the last one measured (the final policy) among them
    points = judge.guard.points if judge else []
    last_weights = judge.weights.get(points[-1]["iteration"]) if judge and judge.keep and points else None
    kept = judge.keep_selected() if judge else None
    adapter, final, last = session.run.dir / "adapter", {}, None
    both = bool(kept and not kept["last"])
    if dist.is_main():  # the final comparison is rank 0's (the other ranks hold the same policy)
        with faults.writing(adapter, "adapter"):
            roles.model.save_pretrained(adapter, selected_adapters=["policy"])
            models.save_tokenizer(roles.tok, adapter / "policy")  # the adapter dir the summary names loads on its own
        cache: dict = {}  # SFT's samples and scores, drawn once for both checks
        with session.probe.phase("eval"):
            final = checks.policy_vs_sft(check, roles, roles.tok, rows, sft, per_pass, kept and "judge", cache)
            if both:
                judge.load_policy(last_weights)
                other = checks.policy_vs_sft(check, roles, roles.tok, rows, sft, per_pass, None, cache)
                judge.load_policy(judge.weights[kept["iteration"]])
                ours, theirs = final.pop("_scores", {}), other.pop("_scores", {})
                last = {"check": other, "kept_minus_last": {
                    k: {key: v for key, v in guard.paired(ours[k], theirs[k]).items() if key != "n"}
                    for k in ours}}
        final.pop("_scores", None)
    return adapter, final, kept, last


def unguarded_kl(stage: str, m: dict, kl_band: list[float]) -> str | None:
    """A run the guard did not watch (no judge, or judge_every 0) that ended above kl_band (past its KL budget), said:
    the budget flags and stops only a guarded run, so the console's "outside kl_band" would otherwise stand alone."""
    kl = m.get("train_kl_ref_last5")
    if m.get("kl_within_band") is not False or kl is None or kl <= kl_band[1]:
        return None
    return (f"{stage}: kl/ref averaged {kl:.2f} over {guard.kl_window(m)}, above "
            f"{stage}.kl_band {list(kl_band)}; no judge watched this run (none trained or named, or "
            f"{stage}.judge_every = 0), so nothing flagged it or chose a policy within the band: the last is saved")


def summarize(history: list[dict], kl_band: list[float], parts: tuple[str, ...],
              playoff_s: float = 0.0) -> tuple[dict, dict]:
    """(metrics, throughput) of a finished run: the last five iterations' mean KL to the reference (and whether it
    is inside `kl_band`) and reward; the mean seconds per iteration, in all and by part, and `judge_share`: the
    judge's share of the run's time (sampling and scoring judge_prompts every judge_every iterations, and the final
    playoff's `playoff_s`, over the iterations' time and the playoff's)."""
    last = history[-min(5, len(history)):]
    kl_last = sum(h["kl/ref"] for h in last) / len(last)  # the exact KL to the reference (kl/ref), as kl_band

    def mean(k):
        return sum(h.get(k, 0.0) for h in history) / len(history)

    return ({"train_kl_ref_last5": kl_last, "train_kl_ref_window": len(last),  # iterations it is over (up to 5)
             "kl_within_band": kl_band[0] <= kl_last <= kl_band[1],
             "train_reward_last5": sum(h["reward/mean"] for h in last) / len(last)},
            {"tokens_per_s": mean("tokens_per_s"), "rollout_s_per_step": mean("time/rollout_s"),
             "update_s_per_step": mean("time/update_s"), "step_s": mean("time/step_s"),
             "judge_share": (mean("time/judge_s") * len(history) + playoff_s)
             / max(mean("time/step_s") * len(history) + playoff_s, 1e-12), "playoff_s": playoff_s,
             **{f"{k}_s_per_step": mean(f"time/{k}_s") for k in parts}})
