"""Reward over-optimization (Gao et al. 2022): a policy pushed against a learned reward model (the proxy) gains proxy
reward while its true quality first rises, then falls. The judge, a reward adapter trained with its own seed on
preference pairs that no stage trains on (data.judge_fraction), stands in for the true quality. Every
<stage>.judge_every iterations, and once after the last update, the policy samples the same judge_prompts training
prompts with the same seed, at the held-out check's sampling settings (eval.*), and both score them (`overopt/proxy`,
`overopt/judge`, each on its own held-out scale; `overopt/truth` when the task has a ground truth). The first
measurement is the SFT policy's own samples: each later one is compared with it prompt by prompt
(`overopt/judge_gain` and its standard error, `overopt/judge_win` and its interval), so the measurement noise that
prompts add cancels. The statistics are rlhf/guard.py's.

- **A fall** is the evidence: the judge's paired scores fall below those of its best measured policy (the peak) by
  more than the threshold for the run's planned number of measurements (guard.fall_z: a false fall anywhere in a
  run within <stage>.overopt_alpha; <stage>.overopt_z fixes it instead). With <stage>.overopt_stop the run stops.
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

import sys
from contextvars import ContextVar
from typing import Callable

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from . import checks, dist, generation, guard, rewards
from .curves import plot, summary
from .config import ConfigError, Experiment
from .guard import Z95
from .roles import Roles, Scorer, reward_scales

OBSERVE_MEASUREMENTS: ContextVar[Callable[[Judge, dict], None] | None] = ContextVar("observe_measurements",
                                                                                  default=None)
"""A study's observer of the judge's measurements (studies/guard_study.py grades every measured policy on held-out
prompts by the ground truth): called as observe(judge, point) after each measurement, with the policy measured in
place and the training RNG streams forked. None: no study."""


def sampling(exp: Experiment, gen_kwargs: dict) -> dict:
    """The judge's sampling settings: the stage's (`gen_kwargs`: its batch and dequantized copy) with the held-out
    check's temperature, top_p and max_new_tokens (eval.*), so that it selects among the policies as they are graded
    and used, not as they were trained."""
    e = exp.eval
    return {**gen_kwargs, "temperature": e.temperature, "top_p": e.top_p, "max_new_tokens": e.max_new_tokens}


def check_keep(exp: Experiment, stage: str, section) -> None:
    """keep=judge needs the judge: refused, naming what is missing, before anything loads (checked when the
    stage runs: another stage of the same experiment may do without it)."""
    if section.keep != "judge":
        return
    missing = guard.judge_missing(exp, stage, section)
    if missing:
        raise ConfigError(f"{exp.source or 'config'}: {stage}.keep=judge needs the judge: {', '.join(missing)}; "
                          f"or set {stage}.keep=last (or auto: the judge's choice when the run has one)")


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
    the reward model is out of the reward. Off without a judge."""

    def __init__(self, exp: Experiment, section, roles: Roles, scorer: Scorer, rm: dict | None, prompts: list[dict],
                 gen_kwargs: dict, score_rows: int):
        self.exp, self.roles, self.scorer, self.every = exp, roles, scorer, section.judge_every
        self.fns = rewards.own_judge(exp)
        """The user's judge (reward.judge_functions, reward.judge_model) grades instead of the RM stage's adapter."""
        if self.fns and self.every:
            rewards.judges(exp)  # a judge model loads now: a path that is not a reward model fails before training
        judge = self.fns or roles.judge_head is not None
        # the proxy: the reward model's score, else (no RM in the reward) the reward functions' sum
        self.on = bool(self.every and judge and (exp.reward.model or exp.reward.functions))
        self.keep = self.on and section.keep in ("judge", "auto")
        self.stop, self.budget = section.overopt_stop and self.on, section.kl_band[1]
        n = min(section.judge_prompts, len(prompts)) // dist.world_size() * dist.world_size()
        self.rows = dist.local_rows(prompts[:n], n)
        self.z = guard.threshold(section, n)
        """The fall test's threshold: overopt_z, or (0, the default) from overopt_alpha and the planned measurements."""
        self.rollout_kl = getattr(section, "beta", None) != 0
        """Whether each rollout measures kl/ref; GRPO and RLOO with beta 0 do not, and the KL budget then reads the KL
        of the judge's own samples at its measurements (the reference adapter is loaded for it: overopt.guarded)."""
        self.gen_kwargs = sampling(exp, gen_kwargs)
        self.score_rows = score_rows  # rows per scoring pass
        self.kl_temperature, self.reference = section.temperature, section.reference
        measured = (rm or {}).get("own_judge") if self.fns else (rm or {}).get("judge")
        if self.fns and (measured or {}).get("judge") != rewards.judge_spec(exp):
            measured = None  # the RM stage measured another judge (or none of the user's)
        self.independence = (measured or {}).get("independence") if self.on else None
        """The RM stage's measure of the errors the judge shares with the reward model (rm.judge_independence)."""
        self.judge_std = 1.0
        """The judge's held-out standard deviation: its scores are divided by it (1: the user's, on their own scale)."""
        if self.on and not self.fns:
            stats = rm["judge"]["reward_stats"]
            self.judge_scale = torch.tensor([(stats["mean"], stats["std"])], dtype=torch.float32)
            self.judge_std = stats["std"]
        if self.on and exp.reward.model:
            self.proxy_scale = torch.tensor(reward_scales(exp, section, rm, heldout=True), dtype=torch.float32)
        self.points: list[dict] = []
        """Each measurement: {"iteration", "judge", "proxy", "gain", "gain_se", "win", "win_ci95", "scores" (the judge's
        per prompt, over every rank), "kl" (overopt/kl), "kl_ref"}; the first is the SFT policy's (gain 0), the last
        (measure_final) the final policy's, as iteration (updates + 1)."""
        self.fell: dict | None = None
        """The judge's first significant fall from its peak (guard.fall), with the iteration and the proxy's rise."""
        self.kls: list[float] = []
        """The KL of the last judge_every iterations (kl/ref; with beta 0, the judge's measurements of it)."""
        self.left: dict | None = None
        """Where the run first left the KL budget: their mean above kl_band's high end."""
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        """keep=judge: CPU copies of the measured policies the selection may still choose, by iteration."""
        self.final: dict[str, float] = {}
        """The final measurement's logged metrics (measure_final), for the curves."""

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
        if not self.on or (self.points and self.points[-1]["iteration"] > updates):
            return {}
        stopped = self.should_stop  # an early stop's last policy is reported, never kept
        self.final = self._measure(updates + 1)
        self.points[-1].update(kl_ref=self.points[-1]["kl"] or 0.0, final=True,
                               **({"stopped": True} if stopped else {}))
        self._prune()
        return self.final

    @torch.no_grad()
    def _measure(self, step: int) -> dict[str, float]:
        dev = self.roles.device
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(self.exp.seed + 1)
            r = generation.generate(self.roles.model, self.roles.tok, [q["prompt"] for q in self.rows],
                                    **self.gen_kwargs, desc="judge")
            parts = r.chunks(self.score_rows)
            texts, ids = generation.decode(self.roles.tok, r), generation.response_ids(r)
            truth, _ = checks.grader_scores(self.exp, self.rows, texts, ids)
            if self.fns:  # the user's judge functions, on their own scale
                judged = torch.tensor(checks.judge_scores(self.exp, self.rows, texts, ids), dtype=torch.float32)
            else:
                judged = torch.cat([self.roles.score_by(part, "judge", self.roles.judge_head) for part in parts])
                judged = Scorer.normalized(judged[:, None], self.judge_scale)[:, 0]
            scores = dist.all_gather_rows(judged).tolist()
            truth_mean = (dist.all_gather_rows(torch.tensor(truth, dtype=torch.float32)).mean().item()
                          if truth is not None else None)
            if self.exp.reward.model:
                raw = torch.cat([self.roles.score(part) for part in parts])
                proxy = dist.all_gather_rows(self.scorer.model_score(raw, self.proxy_scale)).mean().item()
            else:  # the reward functions the stage optimizes (graded as its truth: grader_scores)
                proxy = truth_mean
            kl = self._kl(r)
            base = self.points[0]["scores"] if self.points else scores
            gain, win = guard.paired(scores, base), checks.win_rate(scores, base)
            point = {"iteration": step, "judge": sum(scores) / len(scores), "proxy": proxy, "gain": gain["mean"],
                     "gain_se": gain["se"], "win": win["win_rate"], "win_ci95": [win["ci_low"], win["ci_high"]],
                     "scores": scores, "kl": kl.get("overopt/kl")}
            self.add(point, self.policy_weights() if self.keep else None)
            observe = OBSERVE_MEASUREMENTS.get()
            if observe:
                observe(self, point)
        out = {"overopt/judge": point["judge"], "overopt/proxy": proxy, "overopt/judge_gain": gain["mean"],
               "overopt/judge_gain_se": gain["se"], "overopt/judge_win": win["win_rate"], **kl}
        if truth_mean is not None:
            out["overopt/truth"] = truth_mean
        return out

    def add(self, point: dict, weights=None) -> None:
        """A measurement joins the run's: the fall test against the peak so far (the first fall is kept, with the
        proxy's rise since the peak), then the point and, with keep, the measured policy's `weights`."""
        fell = guard.fall(self.points, point["scores"], self.z)
        if fell and self.fell is None:
            peak = next(p for p in self.points if p["iteration"] == fell["peak"])
            self.fell = {"iteration": point["iteration"], **fell, "proxy_rise": point["proxy"] - peak["proxy"]}
        self.points.append(point)
        if self.keep:
            self.weights[point["iteration"]] = weights

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
        """The iteration's KL to the reference (kl/ref of its rollout, sampled by the policy the judge measured before
        the update; with beta 0, none: the judge's own measurement of it, at its iterations): the run leaves the KL
        budget when the mean over the last judge_every iterations (with beta 0: the last measurement) exceeds it
        (`left`); it joins the iteration's measurement, if any, and then the copies the selection can no longer
        choose are dropped (_prune)."""
        if not self.on:
            return
        measured = bool(self.points) and self.points[-1]["iteration"] == step
        if not self.rollout_kl:
            kl = self.points[-1]["kl"] if measured else None
        if kl is not None:
            window = self.every if self.rollout_kl else 1
            self.kls = (self.kls + [kl])[-window:]
            mean = sum(self.kls) / len(self.kls)
            if self.left is None and len(self.kls) == window and mean > self.budget:
                self.left = {"iteration": step, "kl_ref": mean, "window": window, "budget": self.budget,
                             **({} if self.rollout_kl else {"measured_by": "judge"})}
        if not measured:
            return
        self.points[-1]["kl_ref"] = 0.0 if step == 1 else (kl or 0.0)  # iteration 1: the SFT policy itself
        self._prune()

    def _prune(self) -> None:
        """Drop the copies the selection can no longer choose: all but the latest that are outside the KL budget, or
        with a gain below the best eligible gain less two of its standard errors (a margin over the one-SE rule's
        one: a later best with a larger error can lower the threshold)."""
        if not self.keep:
            return
        eligible = self.eligible()
        best = max(eligible, key=lambda p: p["gain"])
        keep = {p["iteration"] for p in eligible if p["gain"] >= best["gain"] - 2 * best["gain_se"]}
        keep.add(self.points[-1]["iteration"])  # the latest: the last policy, while no fall or budget exit
        for it in set(self.weights) - keep:
            del self.weights[it]

    def eligible(self) -> list[dict]:
        """The measured policies within the KL budget (kl_band's high end: the KL the reward model is trusted to back;
        the judge, a reward model too, is not trusted far beyond it), the SFT policy always; not the policy after an
        early stop's update (the guard stopped the run before it)."""
        return [p for p in self.points if ((p.get("kl_ref") or 0.0) <= self.budget and not p.get("stopped"))
                or p["iteration"] == 1]

    @property
    def should_stop(self) -> bool:
        """overopt_stop: the judge has fallen significantly from its peak, or the run has left its KL budget (no later
        policy could be kept)."""
        return self.stop and (self.fell is not None or self.left is not None)

    def state(self) -> tuple[dict, dict]:
        """(JSON state, tensors) for a checkpoint."""
        tensors = {f"{step}/{k}": v for step, w in self.weights.items() for k, v in w.items()}
        return {"judge_points": self.points, "judge_fell": self.fell, "judge_kls": self.kls,
                "judge_left": self.left}, tensors

    def restore(self, state: dict) -> None:
        self.points, self.fell = state.get("judge_points") or [], state.get("judge_fell")
        self.kls, self.left = state.get("judge_kls") or [], state.get("judge_left")
        self.weights = {}
        for key, v in (state.get("tensors") or {}).items():
            step, name = key.split("/", 1)
            self.weights.setdefault(int(step), {})[name] = v

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
        """keep=judge: put the policy the selection chooses back into the policy adapter; {"keep", "rule",
        "iteration", "last": whether it is the run's last policy} (None: keep=last, or nothing judged)."""
        if not (self.keep and self.points):
            return None
        chosen = self.select()
        self.load_policy(self.weights[chosen["iteration"]])
        rule = ("the last policy: no fall, within kl_band" if chosen is self.points[-1] and not (self.fell or self.left)
                else "one standard error, within kl_band")
        return {"keep": "judge", "rule": rule, "iteration": chosen["iteration"],
                "last": chosen is self.points[-1] and bool(chosen.get("final"))}

    def select(self) -> dict:
        """The measured policy keep=judge keeps (the module docstring's rule): the last one when the run neither fell
        nor left its KL budget (it is then eligible), else the one-standard-error rule within the budget."""
        eligible = self.eligible()
        if not (self.fell or self.left) and eligible[-1] is self.points[-1]:
            return self.points[-1]
        chosen = guard.one_se(eligible)
        if chosen["iteration"] not in self.weights:  # pruned by a best whose error grew: the earliest still held
            chosen = next(p for p in self.points if p["iteration"] in self.weights)
        return chosen

    @classmethod
    def bare(cls, every: int, budget: float, z: float, keep: bool = True, stop: bool = True,
             rollout_kl: bool = True) -> Judge:
        """A judge without a model, for its decisions alone: measurements added by hand (add, end_iteration), as
        the tests and the studies' replays of recorded runs do."""
        j = cls.__new__(cls)
        j.on, j.every, j.budget, j.z, j.keep, j.stop, j.rollout_kl = True, every, budget, z, keep, stop, rollout_kl
        j.points, j.fell, j.kls, j.left, j.weights, j.final = [], None, [], None, {}, {}
        return j

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
           last: dict | None = None) -> tuple[dict, list[str]]:
    """A finished run's over-optimization report: the curves' figures; the kept policy and the last one, each graded
    on the held-out prompts (`final`: the saved policy's check; `last`: {"check", "kept_minus_last"} when the kept
    policy is not the last, from save_and_check) beside the judge's measurement of it along training (`measured`);
    the early stop and the iterations it saved; the flags (also printed as warnings) and, on rank 0,
    overoptimization.png in the run record (when the judge was measured)."""
    curve = history + ([judge.final] if judge.final else [])
    metrics = summary(curve)
    if judge.points:
        end = judge.points[-1]
        metrics["judge_last_policy"] = {"iteration": end["iteration"], "kl_ref": end.get("kl_ref"),
                                        **judge.heldout(last["check"] if last else final),
                                        "measured": judge.describe(end)}
        if kept:
            (point,) = (p for p in judge.points if p["iteration"] == kept["iteration"])
            metrics["judge_kept_policy"] = {"iteration": point["iteration"], "kl_ref": point.get("kl_ref"),
                                            **judge.heldout(final), "measured": judge.describe(point)}
        if last:
            metrics["heldout_kept_minus_last"] = last["kept_minus_last"]
    if judge.fell:
        metrics["judge_fell"] = dict(judge.fell)
    if judge.left:
        metrics["kl_budget_left"] = dict(judge.left)
    if len(history) < section.steps:  # stopped at a fall or a budget exit (an interrupted run does not get here)
        metrics["stopped_early"] = {"iteration": len(history), "steps_saved": section.steps - len(history),
                                    "compute_saved": round(1 - len(history) / section.steps, 4)}
    flags_ = guard.flags(stage, judge.fell, final, judge.left)
    if judge.independence:
        metrics["judge_independence"] = judge.independence
    notes = [guard.weak_judge(stage, judge.independence)] if (judge.independence or {}).get("weak") else []
    if dist.is_main():
        for f in flags_ + notes:
            print(f"warning: {f}", file=sys.stderr, flush=True)
        plot(curve, session.run.dir / "overoptimization.png",
             f"{session.exp.name} / {stage} / {session.run.dir.name}")
    return metrics, flags_
