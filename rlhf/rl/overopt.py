"""Reward over-optimization (Gao et al. 2022): a policy pushed against a learned reward model (the proxy) gains proxy
reward while its true quality first rises, then falls. The judge, a reward adapter trained with its own seed on
preference pairs that no stage trains on (data.judge_fraction), stands in for the true quality. Every
<stage>.judge_every iterations, and once after the last update, the policy samples the same judge_prompts training
prompts with the same seed, at the held-out check's sampling settings (eval.*), and both score them (`overopt/proxy`,
`overopt/judge`, each on its own held-out scale; `overopt/truth` when the task has a ground truth). The first
measurement is the SFT policy's own samples: each later one is compared with it prompt by prompt
(`overopt/judge_gain` and its standard error), so the measurement noise that prompts add cancels; `overopt/judge_win`
and its interval are the win rate against a second SFT draw at a seed no measurement uses (the same-seed draw's win
rate drifts as the policy's samples decorrelate from it: guard.py). The statistics are rlhf/maths/guard.py's.

- **A fall** is the evidence: the judge's paired scores fall below those of its best measured policy (the peak) by
  more than the threshold for the run's planned number of measurements (guard.fall_z: a false fall anywhere in a
  run within <stage>.overopt_alpha; <stage>.overopt_z fixes it instead), confirmed on fresh prompts of its own when
  the run has a playoff, beyond <stage>.fall_margin of the peak's gain (a fall they do not confirm is reported,
  `judge_unconfirmed`, and counts for nothing). With
  <stage>.overopt_stop the run stops at a fall that counts.
- **The KL budget** (<stage>.kl_band's high end): the KL the reward model is trusted to back. The run leaves it when
  kl/ref averaged over judge_every iterations exceeds it (with beta 0, when the KL of the judge's own samples does);
  it is flagged, and with overopt_stop it stops there. A judge trained like the reward model can share its
  shortcuts (on the tiny task a 440-pair judge rose with a 60-pair RM while the ground truth fell,
  tests/test_reward_pipeline.py): the budget is what catches that.
- **The flag** fires on a fall (reward over-optimization when the proxy stands above its value at the peak: the
  policy was trained further against the reward model's errors; a broken update when it does not), when the run
  left its KL budget, or when the saved policy's held-out judge win against SFT is significantly below 0.5 (its 95%
  interval under 0.5).
- **The kept policy** (<stage>.keep: judge, or auto with a judge): the last policy (measured after the last update)
  when the run neither fell nor left its KL budget; otherwise the one-standard-error rule over the measured policies
  within the budget, the earliest whose paired gain is within one standard error of the best gain (the SFT policy
  when none stands out). Past the budget the judge, a reward model too, is no longer trusted: on the tiny task a
  policy pushed to 26 nats fooled it (studies/flag_calibration.py). The kept policy and the last one are graded on
  the held-out prompts, which selected nothing (`judge_kept_policy`, `judge_last_policy`; the judge prompts'
  figures that selected it under `measured`).
"""
from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from rlhf.rl import checks, generation, rewards
from rlhf.infra import dist
from rlhf.maths import guard
from rlhf.maths.curves import plot, summary
from rlhf.experiment.sections import EvalConfig, RewardConfig
from rlhf.maths.guard import Z95
from rlhf.rl.roles import Roles, Scorer, reward_scales

OBSERVE_MEASUREMENTS: ContextVar[Callable[[Judge, dict], None] | None] = ContextVar("observe_measurements",
                                                                                  default=None)
"""A study's observer of the judge's measurements (studies/guard_study.py grades every measured policy on held-out
prompts by the ground truth): called as observe(judge, point) after each measurement, with the policy measured in
place and the training RNG streams forked. None: no study."""


def sampling(e: EvalConfig, gen_kwargs: dict) -> dict:
    """The judge's sampling settings: the stage's (`gen_kwargs`: its batch and dequantized copy) with the held-out
    check's temperature, top_p and max_new_tokens (eval.*), so that it selects among the policies as they are graded
    and used, not as they were trained (`e`: the eval section)."""
    return {**gen_kwargs, "temperature": e.temperature, "top_p": e.top_p, "max_new_tokens": e.max_new_tokens}


@dataclass(frozen=True)
class Settings:
    """What the judge of one online run reads, resolved from the experiment before anything loads (settings)."""

    on: bool
    """Whether it measures: judge_every > 0, a judge (the RM stage's adapter or the user's) and a proxy to compare."""
    keep: bool
    """Whether it keeps CPU copies of the policies the selection may choose (keep=judge or auto, and on)."""
    stop: bool
    """overopt_stop, and on."""
    every: int
    budget: float
    """The KL budget: kl_band's high end."""
    z: float
    """The fall test's threshold: overopt_z, or (0, the default) from overopt_alpha and the planned measurements."""
    rows: list[dict]
    """This rank's judge prompts (the same every measurement)."""
    gen_kwargs: dict
    """Its sampling settings (sampling)."""
    score_rows: int
    """Rows per scoring pass."""
    kl_temperature: float
    reference: str | None
    rollout_kl: bool
    """Whether each rollout measures kl/ref; GRPO and RLOO with beta 0 do not, and the KL budget then reads the KL of
    the judge's own samples at its measurements (the reference adapter is loaded for it: guard.guarded)."""
    own: bool
    """The user's judge (reward.judge_functions, reward.judge_model) grades instead of the RM stage's adapter."""
    seed: int
    """Its samples' seed (the experiment's + 1; the playoff's: + 2, SFT's reference draw for the win rate: + 3, and a
    fall's confirmation on its own prompts: + 4, which no measurement uses)."""
    reward_model: bool
    """Whether the reward model is part of the reward (the proxy is its score; else the reward functions')."""
    graders: tuple = ()
    """The task's ground truth or the experiment's reward functions (rewards.graders): overopt/truth."""
    independence: dict | None = None
    """The RM stage's measure of the errors the judge shares with the reward model (rm.judge_independence)."""
    judge_scale: tuple[float, float] | None = None
    """The RM stage's judge's held-out (mean, std); None: the user's judge, on its own scale."""
    proxy_scale: tuple[tuple[float, float], ...] | None = None
    """Each reward member's held-out (mean, std): the scale of overopt/proxy."""
    playoff_rows: list[dict] = field(default_factory=list)
    """This rank's fresh prompts of the final playoff (after the judge's; empty: no playoff)."""
    playoff_alpha: float = 0.0
    """The playoff's one-sided level, and a fall's confirmation's (section.playoff_alpha; 0: none)."""
    playoff_margin: float = 0.0
    """The share of the guard's choice's gain its challenger must beat it by (section.playoff_margin)."""
    fall_margin: float = 0.0
    """The share of the peak's gain a fall must exceed on fresh prompts to count (section.fall_margin)."""
    confirm_rows: list[dict] = field(default_factory=list)
    """This rank's fresh prompts on which a fall is confirmed before it counts (after the playoff's, as many; empty:
    no playoff, or too few prompts left: a fall counts as seen)."""


def settings(section, r: RewardConfig, e: EvalConfig, source: str, seed: int, rm: dict | None, ensemble: int,
             prompts: list[dict], gen_kwargs: dict, score_rows: int) -> Settings:
    """The judge's Settings for an online `section` with reward section `r`, eval section `e`, data source `source`
    (its ground truth) and the experiment's `seed`, whose reward model run is `rm` (None: none; `ensemble` members),
    training on `prompts`, sampling with `gen_kwargs` (the stage's) and `score_rows` rows per scoring pass."""
    own = rewards.own_judge(r)
    judge = own or bool((rm or {}).get("judge"))  # the roles load the RM stage's judge when its run has one
    # the proxy: the reward model's score, else (no RM in the reward) the reward functions' sum
    on = bool(section.judge_every and judge and (r.model or r.functions))
    ws = dist.world_size()
    n = min(section.judge_prompts, len(prompts)) // ws * ws
    m = min(section.playoff_prompts or 4 * section.judge_prompts, len(prompts) - n) // ws * ws
    playoff = on and section.keep in ("judge", "auto") and section.playoff_alpha > 0 and m >= 8 * ws
    c = min(m, len(prompts) - n - m) // ws * ws  # the confirmation's, after the playoff's
    confirm = playoff and c >= 8 * ws
    measured = (rm or {}).get("own_judge") if own else (rm or {}).get("judge")
    if own and (measured or {}).get("judge") != rewards.judge_spec(r):
        measured = None  # the RM stage measured another judge (or none of the user's)
    stats = rm["judge"]["reward_stats"] if on and not own else None
    return Settings(
        on=on, keep=on and section.keep in ("judge", "auto"), stop=section.overopt_stop and on,
        every=section.judge_every, budget=section.kl_band[1], z=guard.threshold(section, n),
        rows=dist.local_rows(prompts[:n], n), gen_kwargs=sampling(e, gen_kwargs), score_rows=score_rows,
        kl_temperature=section.temperature, reference=section.reference,
        rollout_kl=getattr(section, "beta", None) != 0, own=own, seed=seed + 1,
        reward_model=bool(r.model), graders=tuple(rewards.graders(r, source)[0]),
        independence=(measured or {}).get("independence") if on else None,
        judge_scale=(stats["mean"], stats["std"]) if stats else None,
        proxy_scale=tuple(reward_scales(section, rm, ensemble, heldout=True)) if on and r.model else None,
        playoff_rows=dist.local_rows(prompts[n:n + m], m) if playoff else [],
        playoff_alpha=section.playoff_alpha if playoff else 0.0, playoff_margin=section.playoff_margin,
        fall_margin=section.fall_margin, confirm_rows=dist.local_rows(prompts[n + m:n + m + c], c) if confirm else [])


class Judge:
    """The judge along an online run (the module docstring): every section.judge_every iterations from the first, the
    policy samples the same section.judge_prompts training prompts with the same seed (common random numbers: the
    curves move with the policy, not with the prompts drawn), before the iteration's update, and once more after the
    last update (measure_final: the final policy is a candidate too); it samples as the held-out check grades
    (eval.temperature, top_p, max_new_tokens), so it selects at the settings the policy is graded and used at. Those
    responses are scored by the judge and by the reward model, each on its held-out scale (the proxy: the score the
    stage optimizes, the ensemble's mean - lambda x std when rm.ensemble > 1), and by the task's ground truth or
    reward functions when they exist. The training RNG streams are left as they were. With keep=judge, a CPU copy of
    each measured policy that the selection may still choose is kept (in every checkpoint too) and the chosen one is
    put back before the run saves its policy. The judge: the RM stage's adapter, or the user's
    (reward.judge_functions, reward.judge_model); the proxy: the reward model's score, or the reward functions' when
    the reward model is out of the reward. Off without a judge. What the measurements decide (the fall, the KL budget,
the early stop, the kept policy) is its `guard`'s (guard.Guard); the judge holds the copies of the policies that the
guard still holds."""

    def __init__(self, s: Settings, roles: Roles, scorer: Scorer, judges: list | None = None):
        """`judges`: the user's judge functions and model (rewards.judges, loaded), when the settings say `own`."""
        self.s, self.roles, self.scorer, self.every = s, roles, scorer, s.every
        self.fns = list(judges or []) if s.own else []
        """The user's judge (reward.judge_functions, reward.judge_model) grades instead of the RM stage's adapter."""
        self.on, self.keep = s.on, s.keep
        self.rows, self.gen_kwargs, self.score_rows = s.rows, s.gen_kwargs, s.score_rows
        self.kl_temperature, self.reference = s.kl_temperature, s.reference
        self.independence = s.independence
        self.judge_std = s.judge_scale[1] if s.judge_scale else 1.0
        """The judge's held-out standard deviation: its scores are divided by it (1: the user's, on their own scale)."""
        if s.judge_scale:
            self.judge_scale = torch.tensor([s.judge_scale], dtype=torch.float32)
        if s.proxy_scale:
            self.proxy_scale = torch.tensor(s.proxy_scale, dtype=torch.float32)
        self.guard = guard.Guard(s.every, s.budget, s.z, s.keep, s.stop, s.rollout_kl,
                                 confirm_alpha=s.playoff_alpha if s.confirm_rows else 0.0, fall_margin=s.fall_margin)
        """The decisions its measurements make: the fall test (a fall bigger than its margin, confirmed on fresh
        prompts, before it counts),
        the KL budget, the early stop, the kept policy."""
        self.peak_fresh: dict[int, list[float]] = {}
        """The judge's scores of each peak a fall was tested against, on the confirmation's prompts (the same
        weights, prompts and seed give the same scores: drawn once)."""
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        """keep=judge: CPU copies of the measured policies the guard still holds (the selection may choose them)."""
        self.final: dict[str, float] = {}
        """The final measurement's logged metrics (measure_final), for the curves."""
        self.playoff_s = 0.0
        """Seconds the final playoff took (keep_selected): part of throughput.judge_share."""

    def measure(self, step: int) -> dict[str, float]:
        """{overopt/judge, overopt/proxy, overopt/judge_gain, overopt/judge_gain_se, overopt/judge_win, overopt/kl[,
        overopt/truth]} of the current policy, over every rank, at the iterations judged ({} at the others)."""
        if not self.on or (step - 1) % self.every:
            return {}
        return self._measure(step)

    def measure_final(self, updates: int) -> dict[str, float]:
        """The policy after the last update (`updates` of them: the run's end or its early stop), measured as
        iteration updates + 1, so that it can be kept; its KL is that of the judge's own samples (no rollout). {} when
        the judge is off or has measured it already."""
        g = self.guard
        if not self.on or (g.points and g.points[-1]["iteration"] > updates):
            return {}
        stopped = g.should_stop  # an early stop's last policy is reported, never kept
        self.final = self._measure(updates + 1)
        g.points[-1].update(kl_ref=g.points[-1]["kl"] or 0.0, final=True, **({"stopped": True} if stopped else {}))
        g.prune()
        self._let_go()
        return self.final

    @torch.no_grad()
    def _measure(self, step: int) -> dict[str, float]:
        dev = self.roles.device
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            drawn = None
            if self.guard.reference is None:  # the SFT policy (the first measurement): its independent draw first
                t0 = time.perf_counter()
                self.guard.reference = self._sample_and_judge(self.rows, self.s.seed + 2)[-1]
                drawn = time.perf_counter() - t0
            r, parts, texts, ids, scores = self._sample_and_judge(self.rows, self.s.seed)
            truth = checks.function_scores(list(self.s.graders), self.rows, texts, ids) if self.s.graders else None
            truth_mean = (dist.all_gather_rows(torch.tensor(truth, dtype=torch.float32)).mean().item()
                          if truth is not None else None)
            if self.s.reward_model:
                raw = torch.cat([self.roles.score(part) for part in parts])
                proxy = dist.all_gather_rows(self.scorer.model_score(raw, self.proxy_scale)).mean().item()
            else:  # the reward functions the stage optimizes (graded as its truth: grader_scores)
                proxy = truth_mean
            kl = self._kl(r)
            base = self.guard.points[0]["scores"] if self.guard.points else scores
            gain, win = guard.paired(scores, base), checks.win_rate(scores, self.guard.reference)
            point = {"iteration": step, "judge": sum(scores) / len(scores), "proxy": proxy, "gain": gain["mean"],
                     "gain_se": gain["se"], "win": win["win_rate"], "win_ci95": [win["ci_low"], win["ci_high"]],
                     "scores": scores, "kl": kl.get("overopt/kl")}
            self.guard.add(point)  # the decisions: the fall test, and whether the selection may choose it
            if self.keep:
                self.weights[step] = self.policy_weights()
            if self.guard.pending:  # a fall seen on the judge's prompts: tested on fresh ones before it counts
                self._confirm(step)
            observe = OBSERVE_MEASUREMENTS.get()
            if observe:
                observe(self, point)
        out = {"overopt/judge": point["judge"], "overopt/proxy": proxy, "overopt/judge_gain": gain["mean"],
               "overopt/judge_gain_se": gain["se"], "overopt/judge_win": win["win_rate"], **kl}
        if drawn is not None:  # once a run, inside this measurement's time/judge_s: gpumetrics.as_shipped takes it out
            out["time/judge_reference_s"] = drawn
        if truth_mean is not None:
            out["overopt/truth"] = truth_mean
        return out

    def _sample_and_judge(self, rows: list[dict], seed: int):
        """The policy's samples of `rows` (this rank's) drawn with `seed` at the judge's settings, and the judge's score
        of each (over every rank, in order): (rollout, its scoring chunks, texts, response ids, scores)."""
        torch.manual_seed(seed)
        r = generation.generate(self.roles.model, self.roles.tok, [q["prompt"] for q in rows], **self.gen_kwargs,
                                desc="judge")
        parts = r.chunks(self.score_rows)
        texts, ids = generation.decode(self.roles.tok, r), generation.response_ids(r)
        if self.fns:  # the user's judge functions, on their own scale
            judged = torch.tensor(checks.function_scores(self.fns, rows, texts, ids), dtype=torch.float32)
        else:
            judged = torch.cat([self.roles.score_by(part, "judge", self.roles.judge_head) for part in parts])
            judged = Scorer.normalized(judged[:, None], self.judge_scale)[:, 0]
        return r, parts, texts, ids, dist.all_gather_rows(judged).tolist()

    def _confirm(self, step: int) -> None:
        """The pending fall tested on fresh prompts (guard.Guard.confirm): the current policy and the peak's sample
        the confirmation's own prompts with the same seed (one no measurement or playoff uses), the judge scores both
        (the peak's once: peak_fresh); the current policy is then put back as it was. Inside _measure: the training
        RNG streams are left as they were."""
        rows, seed, peak = self.s.confirm_rows, self.s.seed + 3, self.guard.pending["peak"]
        current = self._sample_and_judge(rows, seed)[-1]
        if peak not in self.peak_fresh:
            self.load_policy(self.weights[peak])
            self.peak_fresh[peak] = self._sample_and_judge(rows, seed)[-1]
            self.load_policy(self.weights[step])
        self.guard.confirm(self.peak_fresh[peak], current)

    @torch.no_grad()
    def _playoff(self, chosen: dict, challenger: dict) -> dict:
        """The final playoff (guard.playoff): both policies sample the fresh playoff prompts with the same seed (one
        no measurement used) and the judge scores them; the challenger must beat the guard's choice by more than
        playoff_margin x its measured gain (when positive). The training RNG streams are left as they were."""
        dev, scores = self.roles.device, {}
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            for point in (chosen, challenger):
                self.load_policy(self.weights[point["iteration"]])
                scores[point["iteration"]] = self._sample_and_judge(self.s.playoff_rows, self.s.seed + 1)[-1]
        return guard.playoff(scores[chosen["iteration"]], scores[challenger["iteration"]], self.s.playoff_alpha,
                             guard.margin(self.s.playoff_margin, chosen["gain"]))

    def _kl(self, r) -> dict[str, float]:
        """{"overopt/kl": the exact KL to the reference of the measured samples at the stage's training temperature
        (checks.kl_to_reference, the one KL every stage reports), over every rank}: the plot's sqrt(KL) axis, and the
        KL budget's reading when the rollout measures none (beta 0); {} when the run holds no reference."""
        ref = "ref" if self.reference == "sft" else None
        if ref and ref not in self.roles.model.peft_config:
            return {}
        kl = checks.kl_to_reference(self.roles.model, r, self.roles.use, lambda: self.roles.active(ref),
                                    self.kl_temperature, self.score_rows)
        self.roles.use("policy")
        return {"overopt/kl": dist.all_gather_rows(torch.tensor([kl])).mean().item()}

    def end_iteration(self, step: int, kl: float) -> None:
        """The iteration's KL to the reference (kl/ref of its rollout) for the guard (guard.Guard.read_kl: the KL
        budget, and the policies the selection can no longer choose, whose copies are dropped)."""
        if not self.on:
            return
        self.guard.read_kl(step, kl)
        self._let_go()

    def _let_go(self) -> None:
        """Drop the copies of the policies the guard no longer needs (guard.Guard.copies)."""
        for it in set(self.weights) - self.guard.copies:
            del self.weights[it]

    def state(self) -> tuple[dict, dict]:
        """(JSON state, tensors) for a checkpoint."""
        tensors = {f"{step}/{k}": v for step, w in self.weights.items() for k, v in w.items()}
        return self.guard.state(), tensors

    def restore(self, state: dict) -> None:
        self.weights = {}
        for key, v in (state.get("tensors") or {}).items():
            step, name = key.split("/", 1)
            self.weights.setdefault(int(step), {})[name] = v
        self.guard.restore(state, set(self.weights))

    def policy_weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the policy adapter's weights."""
        return {k: v.detach().to("cpu", copy=True) for k, v in
                get_peft_model_state_dict(self.roles.model, adapter_name="policy").items()}

    def load_policy(self, weights: dict[str, torch.Tensor]) -> None:
        """Put `weights` (policy_weights') into the policy adapter."""
        dev = self.roles.device
        set_peft_model_state_dict(self.roles.model, {k: v.to(dev) for k, v in weights.items()}, adapter_name="policy")

    @staticmethod
    def describe(point: dict) -> dict:
        """A measured policy as the judge measured it along training, on the judge prompts (for the kept policy, the
        samples that selected it: its gain there is biased upward): its KL to the reference, the judge's paired gain
        over SFT and win rate, with their 95% intervals."""
        return {"kl_ref": point.get("kl_ref"), "judge_gain": point["gain"],
                "judge_gain_ci95": [point["gain"] - Z95 * point["gain_se"], point["gain"] + Z95 * point["gain_se"]],
                "judge_win": point["win"], "judge_win_ci95": point["win_ci95"], "judge_prompts": len(point["scores"])}

    def keep_selected(self) -> dict | None:
        """keep=judge: put the policy the guard selects, or the challenger that beat it in the final playoff
        (_playoff), back into the policy adapter; {"keep", "rule", "iteration", "last": whether it is the run's last
        policy, "playoff": its figures or why it was skipped} (None: keep=last, or nothing judged)."""
        g = self.guard
        if not (self.keep and g.points):
            return None
        chosen = g.select()
        rule, playoff = g.rule(chosen), {"skipped": "off (playoff_alpha 0, or too few fresh training prompts)"}
        challenger = g.challenger(chosen) if self.s.playoff_alpha else None
        if self.s.playoff_alpha and challenger is None:
            playoff = {"skipped": "no other candidate within the KL budget"}
        if challenger is not None:
            t0 = time.perf_counter()
            playoff = {"incumbent": chosen["iteration"], "challenger": challenger["iteration"],
                       "alpha": self.s.playoff_alpha, **self._playoff(chosen, challenger)}
            self.playoff_s = time.perf_counter() - t0
            if playoff["won"]:
                chosen, rule = challenger, f"the final playoff: iteration {challenger['iteration']} over {rule}"
        self.load_policy(self.weights[chosen["iteration"]])
        return {"keep": "judge", "rule": rule, "iteration": chosen["iteration"],
                "last": chosen is g.points[-1] and bool(chosen.get("final")), "playoff": playoff}

    def heldout(self, check: dict) -> dict:
        """The judge's figures of a policy on the held-out check's prompts and samples (which selected nothing): its
        paired gain over SFT on the measurements' scale (judge standard deviations) and its win rate, with their 95%
        intervals; {} without them (a rank other than 0)."""
        w = (check.get("eval_win_rates") or {}).get("judge")
        if not w:
            return {}
        g = w["gain"]
        return {"judge_gain": g["mean"] / self.judge_std, "judge_gain_ci95": [x / self.judge_std for x in g["ci95"]],
                "judge_win": w["win_rate"], "judge_win_ci95": w["ci95"], "judge_prompts": w["n"],
                "grader": w["grader"]}


def report(stage: str, section, session, history: list[dict], final: dict, judge: Judge, kept: dict | None,
           last: dict | None = None) -> tuple[dict, list[str], list[str]]:
    """A finished run's over-optimization report: the curves' figures; the kept policy and the last one, each graded
    on the held-out prompts (`final`: the saved policy's check; `last`: {"check", "kept_minus_last"} when the kept
    policy is not the last, from save_and_check) beside the judge's measurement of it along training (`measured`);
    the early stop and the iterations it saved; the flags and the notes for the summary's warnings (a weak judge, a
    last policy set aside for its KL alone: both printed) and, on rank 0, overoptimization.png in the run record (when
    the judge was measured)."""
    curve, g = history + ([judge.final] if judge.final else []), judge.guard
    metrics = summary(curve)
    if g.points:
        end = g.points[-1]
        metrics["judge_last_policy"] = {"iteration": end["iteration"], "kl_ref": end.get("kl_ref"),
                                        **judge.heldout(last["check"] if last else final),
                                        "measured": judge.describe(end)}
        if kept:
            (point,) = (p for p in g.points if p["iteration"] == kept["iteration"])
            metrics["judge_kept_policy"] = {"iteration": point["iteration"], "kl_ref": point.get("kl_ref"),
                                            **judge.heldout(final), "measured": judge.describe(point)}
        if last:
            metrics["heldout_kept_minus_last"] = last["kept_minus_last"]
    if g.fell:
        metrics["judge_fell"] = dict(g.fell)
    if g.unconfirmed:  # falls the judge's prompts saw and fresh prompts did not confirm: the run went on
        metrics["judge_unconfirmed"] = [dict(u) for u in g.unconfirmed]
    if g.left:
        metrics["kl_budget_left"] = dict(g.left)
    if len(history) < section.steps:  # stopped at a fall or a budget exit (an interrupted run does not get here)
        metrics["stopped_early"] = {"iteration": len(history), "steps_saved": section.steps - len(history),
                                    "compute_saved": round(1 - len(history) / section.steps, 4)}
    flags_ = guard.flags(stage, g.fell, final, g.left, keeps=bool(judge.keep))
    if judge.independence:
        metrics["judge_independence"] = judge.independence
    notes = [guard.weak_judge(stage, judge.independence)] if (judge.independence or {}).get("weak") else []
    aside = guard.set_aside_for_kl(stage, kept, g.points[-1] if g.points else {}, g.budget, bool(g.left or g.fell))
    notes += [aside] if aside else []
    for f in flags_ + notes:
        dist.warn(f)
    if dist.is_main():
        plot(curve, session.run.dir / "overoptimization.png",
             f"{session.name} / {stage} / {session.run.dir.name}")
    return metrics, flags_, notes
