"""Reward over-optimization (Gao et al. 2022): a policy pushed against a learned reward model (the proxy) gains proxy
reward while its true quality first rises, then falls. The judge, a reward adapter trained with its own seed on
preference pairs that no stage trains on (data.judge_fraction), stands in for the true quality. Every
<stage>.judge_every iterations the policy samples the same judge_prompts training prompts with the same seed, and
both score them (`overopt/proxy`, `overopt/judge`, each on its own held-out scale; `overopt/truth` when the task has a
ground truth). The first measurement is the SFT policy's own samples: each later one is compared with it prompt by
prompt (`overopt/judge_gain` and its standard error, `overopt/judge_win` and its interval), so the measurement noise
that prompts add cancels.

- **A fall** is the evidence: the judge's paired scores fall below those of its best measured policy (the peak) by
  more than <stage>.overopt_z standard errors. With <stage>.overopt_stop the run stops there.
- **The KL budget** (<stage>.kl_band's high end): the KL the reward model is trusted to back. The run leaves it when
  kl/ref averaged over judge_every iterations exceeds it; it is flagged, and with overopt_stop it stops there. A judge
  trained like the reward model can share its shortcuts (on the tiny task a 440-pair judge rose with a 60-pair RM
  while the ground truth fell, tests/test_reward_pipeline.py): the budget is what catches that.
- **The flag** fires on a fall (reward over-optimization when the proxy stands above its value at the peak: the
  policy was trained further against the reward model's errors; a broken update when it does not), when the run
  left its KL budget, or when the saved policy's held-out judge win against SFT is significantly below 0.5 (its 95%
  interval under 0.5).
- **The kept policy** (<stage>.keep: judge, or auto with a judge): the one-standard-error rule over the measured
  policies within the KL budget (<stage>.kl_band's high end), the earliest whose paired gain is within one standard
  error of the best gain (the SFT policy when none stands out). Past the budget the judge, a reward model too, is no
  longer trusted: on the tiny task a policy pushed to 26 nats fooled it (scripts/flag_calibration.py). The judge
  prompts select the policy; the held-out check grades it on prompts that did not.
"""

from __future__ import annotations

import math
import sys

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from . import checks, dist, generation, rewards
from .config import Experiment
from .roles import Roles, Scorer, reward_scales


def series(history: list[dict], key: str) -> list[tuple[int, float, float]]:
    """(iteration, KL, value) of the iterations that logged `key`; the KL is that of the judge's own samples
    (overopt/kl) where it was measured, else the iteration's rollout's (kl/ref): the same quantity."""
    return [(i + 1, h.get("overopt/kl", h.get("kl/ref")) or 0.0, h[key]) for i, h in enumerate(history)
            if h.get(key) is not None]


def judged(history: list[dict], key: str) -> list[tuple[int, float, float]]:
    """series(history, key) at the iterations the judge measured (where overopt/judge was logged)."""
    at = {i for i, *_ in series(history, "overopt/judge")}
    return [t for t in series(history, key) if t[0] in at]


Z95 = 1.959964
"""The normal quantile of a two-sided 95% interval."""


def wilson(k: int, n: int) -> list[float]:
    """Wilson's 95% interval of a rate of k in n (sound at 0 and n, where the normal approximation's is empty)."""
    if n == 0:
        return [0.0, 1.0]
    p, z2 = k / n, Z95 * Z95
    centre, half = p + z2 / (2 * n), Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return [max(0.0, (centre - half) / (1 + z2 / n)), min(1.0, (centre + half) / (1 + z2 / n))]


def paired(a: list[float], b: list[float]) -> dict:
    """The mean of a - b over paired items (the same prompts), its standard error (sample sd / sqrt(n); 0 for fewer
    than two items) and 95% interval: {"mean", "se", "ci95", "n"}."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    n = len(d)
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else 0.0
    return {"mean": mean, "se": se, "ci95": [mean - Z95 * se, mean + Z95 * se], "n": n}


def one_se(points: list[dict]) -> dict:
    """The one-standard-error rule over measurements ({"iteration", "gain", "gain_se"}, in order): the earliest whose
    gain is within one standard error of the best gain (the best's own)."""
    best = max(points, key=lambda p: p["gain"])
    return next(p for p in points if p["gain"] >= best["gain"] - best["gain_se"])


def fall(points: list[dict], scores: list[float], z: float) -> dict | None:
    """Whether `scores` (a new measurement's per-prompt judge scores) fall significantly below the peak of `points`
    (the measurement with the best gain so far, its "scores" on the same prompts): the paired drop exceeds z standard
    errors. {"peak": the peak's iteration, "drop": mean, "se", "z"} or None."""
    if not points:
        return None
    peak = max(points, key=lambda p: p["gain"])
    d = paired(peak["scores"], scores)
    if d["se"] > 0 and d["mean"] > z * d["se"]:
        return {"peak": peak["iteration"], "drop": d["mean"], "se": d["se"], "z": d["mean"] / d["se"]}
    return None


def flags(stage: str, fell: dict | None, check: dict, left: dict | None = None) -> list[str]:
    """The over-optimization warnings of a finished run (the module docstring's rules): `fell`, the judge's first
    significant fall with the proxy's rise since the peak ({"iteration", "peak", "drop", "se", "z", "proxy_rise"});
    `check`, the held-out check of the saved policy; `left`, where the run left its KL budget ({"iteration",
    "kl_ref", "window", "budget"})."""
    out = []
    if left:
        out.append(f"{stage}: the policy left its KL budget: kl/ref averaged {left['kl_ref']:.2f} over the "
                   f"{left['window']} iterations to {left['iteration']}, above {stage}.kl_band's high end "
                   f"({left['budget']:g}); past it the reward model, and the judge with it, are not trusted, and the "
                   f"kept policy is chosen within it")
    if fell:
        why = (f"while the reward model's score rose {fell['proxy_rise']:.3f} (each on its held-out scale): reward "
               f"over-optimization" if fell["proxy_rise"] > 0 else
               f"and the reward model's score did not rise ({fell['proxy_rise']:+.3f}): the update itself went wrong")
        out.append(f"{stage}: at iteration {fell['iteration']} the judge had fallen {fell['drop']:.3f} below its peak "
                   f"at iteration {fell['peak']} ({fell['z']:.1f} standard errors, paired per prompt) {why}")
    wj = check.get("eval_win_rates", {}).get("judge")
    if wj and wj["ci95"][1] < 0.5:
        out.append(f"{stage}: the saved policy loses to SFT by the judge on held-out prompts: win rate "
                   f"{wj['win_rate']:.3f} [{wj['ci95'][0]:.3f}, {wj['ci95'][1]:.3f}], n={check.get('eval_prompts')}")
    return out


def weak_judge(stage: str, ind: dict) -> str:
    """The warning for a weak judge (rm.judge_independence's `weak`), as the RM stage and the online stages print it:
    a caveat on the judge, not evidence about a policy, so never a flag."""
    return (f"{stage}: the judge is weak: it is wrong on {ind['judge_error_rate_on_rm_errors']:.0%} "
            f"[{ind['ci95'][0]:.0%}, {ind['ci95'][1]:.0%}] of the {ind['rm_errors']} held-out pairs the reward model "
            f"gets wrong (overall {ind['judge_error_rate']:.0%}): it shares the reward model's errors, so an absent "
            f"over-optimization flag is weak evidence that nothing went wrong")


def correlation(a: list[float], b: list[float]) -> float | None:
    """Pearson's r of two equally long series (None: fewer than three points, or a constant one)."""
    n = len(a)
    if n < 3:
        return None
    ma, mb = sum(a) / n, sum(b) / n
    va, vb = sum((x - ma) ** 2 for x in a), sum((y - mb) ** 2 for y in b)
    if va == 0 or vb == 0:
        return None
    return sum((x - ma) * (y - mb) for x, y in zip(a, b)) / math.sqrt(va * vb)


def summary(history: list[dict], truth: str = "overopt/truth") -> dict:
    """The curves' last and peak values and, when the task's ground truth (or the reward functions) scored the same
    responses (`truth`), Pearson's r of each curve with it over training: how well the judge and the proxy track
    it."""
    judge, proxy = series(history, "overopt/judge"), series(history, "overopt/proxy")
    if not judge:
        return {}
    out = {"overopt_judge_last": judge[-1][2], "overopt_judge_peak": max(v for *_, v in judge),
           "overopt_judge_peak_iteration": max(judge, key=lambda t: t[2])[0], "overopt_proxy_last": proxy[-1][2]}
    gt = [v for *_, v in judged(history, truth)]
    if len(gt) == len(judge):
        out["overopt_corr_judge_truth"] = correlation([v for *_, v in judge], gt)
        out["overopt_corr_proxy_truth"] = correlation([v for *_, v in proxy], gt)
    return out


def plot(history: list[dict], path, title: str = "", truth: str = "overopt/truth") -> bool:
    """Gao et al.'s picture of a run: the proxy's and the judge's scores (and the ground truth, when logged) against
    the iteration and against sqrt(KL to the reference); False when the run logged no judge scores."""
    judge, proxy = series(history, "overopt/judge"), series(history, "overopt/proxy")
    if not judge:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gt = judged(history, truth)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, x in zip(axes, (0, 1)):
        for name, pts, style in (("reward model (proxy)", proxy, "-o"), ("judge", judge, "-s"),
                                 ("ground truth", gt, "--^")):
            if pts:
                xs = [t[0] if x == 0 else math.sqrt(max(t[1], 0.0)) for t in pts]
                # against the KL: points (the KL of each measured policy's rollout does not rise monotonically)
                ax.plot(xs, [t[2] for t in pts], style if x == 0 else style.strip("-"), ms=3 if x == 0 else 5,
                        label=name)
        ax.set_xlabel("iteration" if x == 0 else "sqrt(KL to the reference, nats)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("score (proxy, judge: each on its held-out scale)")
    axes[0].legend()
    fig.suptitle(title or "reward model against judge")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


class Judge:
    """The judge along an online run (the module docstring): every section.judge_every iterations from the first, the
    policy samples the same section.judge_prompts training prompts with the same seed (common random numbers: the
    curves move with the policy, not with the prompts drawn), before the iteration's update; those responses are
    scored by the judge and by the reward model, each on its held-out scale (the proxy: the score the stage optimizes,
    the ensemble's mean - lambda x std when rm.ensemble > 1), and by the task's ground truth or reward functions when
    they exist. The training RNG streams are left as they were. With keep=judge, a CPU copy of each measured policy
    that the one-SE rule may still choose is kept (in every checkpoint too) and the chosen one is put back before the
    run saves its policy. The judge: the RM stage's adapter, or the user's (reward.judge_functions,
    reward.judge_model); the proxy: the reward model's score, or the reward functions' when the reward model is out of
    the reward. Off without a judge."""

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
        self.z, self.stop = section.overopt_z, section.overopt_stop and self.on
        self.budget = section.kl_band[1]
        n = min(section.judge_prompts, len(prompts)) // dist.world_size() * dist.world_size()
        self.rows = dist.local_rows(prompts[:n], n)
        self.gen_kwargs = gen_kwargs
        self.score_rows = score_rows  # rows per scoring pass
        self.reference = section.reference
        measured = (rm or {}).get("own_judge") if self.fns else (rm or {}).get("judge")
        if self.fns and (measured or {}).get("judge") != rewards.judge_spec(exp):
            measured = None  # the RM stage measured another judge (or none of the user's)
        self.independence = (measured or {}).get("independence") if self.on else None
        """The RM stage's measure of the errors the judge shares with the reward model (rm.judge_independence)."""
        if self.on and not self.fns:
            stats = rm["judge"]["reward_stats"]
            self.judge_scale = torch.tensor([(stats["mean"], stats["std"])], dtype=torch.float32)
        if self.on and exp.reward.model:
            self.proxy_scale = torch.tensor(reward_scales(exp, section, rm, heldout=True), dtype=torch.float32)
        self.points: list[dict] = []
        """Each measurement: {"iteration", "judge", "proxy", "gain", "gain_se", "win", "win_ci95", "scores" (the judge's
        per prompt, over every rank)}; the first is the SFT policy's (gain 0)."""
        self.fell: dict | None = None
        """The judge's first significant fall from its peak (fall()), with the iteration and the proxy's rise."""
        self.kls: list[float] = []
        """kl/ref of the last judge_every iterations."""
        self.left: dict | None = None
        """Where the run first left the KL budget: their mean above kl_band's high end."""
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        """keep=judge: CPU copies of the measured policies the one-SE rule may still choose, by iteration."""

    @torch.no_grad()
    def measure(self, step: int) -> dict[str, float]:
        """{overopt/judge, overopt/proxy, overopt/judge_gain, overopt/judge_gain_se, overopt/judge_win[,
        overopt/truth]} of the current policy, over every rank, at the iterations judged ({} at the others)."""
        if not self.on or (step - 1) % self.every:
            return {}
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
        base = self.points[0]["scores"] if self.points else scores
        gain, win = paired(scores, base), checks.win_rate(scores, base)
        point = {"iteration": step, "judge": sum(scores) / len(scores), "proxy": proxy, "gain": gain["mean"],
                 "gain_se": gain["se"], "win": win["win_rate"], "win_ci95": [win["ci_low"], win["ci_high"]],
                 "scores": scores}
        fell = fall(self.points, scores, self.z)
        if fell and self.fell is None:
            peak = next(p for p in self.points if p["iteration"] == fell["peak"])
            self.fell = {"iteration": step, **fell, "proxy_rise": proxy - peak["proxy"]}
        self.points.append(point)
        if self.keep:
            self.weights[step] = {k: v.detach().to("cpu", copy=True) for k, v in
                                  get_peft_model_state_dict(self.roles.model, adapter_name="policy").items()}
        out = {"overopt/judge": point["judge"], "overopt/proxy": proxy, "overopt/judge_gain": gain["mean"],
               "overopt/judge_gain_se": gain["se"], "overopt/judge_win": win["win_rate"], **self._kl(r)}
        if truth_mean is not None:
            out["overopt/truth"] = truth_mean
        return out

    def _kl(self, r) -> dict[str, float]:
        """{"overopt/kl": the exact KL to the reference of the measured samples (checks.kl_to_reference, the one KL
        every stage reports), over every rank} for the plot's sqrt(KL) axis; {} when the run holds no reference (GRPO
        with beta 0 and reference sft)."""
        ref = "ref" if self.reference == "sft" else None
        if ref and ref not in self.roles.model.peft_config:
            return {}
        kl = checks.kl_to_reference(self.roles.model, r, self.roles.use, lambda: self.roles.active(ref),
                                    self.gen_kwargs["temperature"], self.score_rows)
        self.roles.use("policy")
        return {"overopt/kl": dist.all_gather_rows(torch.tensor([kl])).mean().item()}

    def end_iteration(self, step: int, kl: float) -> None:
        """The iteration's KL to the reference (kl/ref of its rollout, sampled by the policy the judge measured before
        the update): the run leaves the KL budget when the mean over the last judge_every iterations exceeds it
        (`left`); it joins the iteration's measurement, if any, and then the copies the selection can no longer
        choose are dropped: outside the KL budget, or with a gain below the best eligible gain less two of its
        standard errors (a margin over the rule's one: a later best with a larger error can lower the threshold)."""
        if not self.on:
            return
        self.kls = (self.kls + [kl])[-self.every:]
        mean = sum(self.kls) / len(self.kls)
        if self.left is None and len(self.kls) == self.every and mean > self.budget:
            self.left = {"iteration": step, "kl_ref": mean, "window": self.every, "budget": self.budget}
        if not self.points or self.points[-1]["iteration"] != step:
            return
        self.points[-1]["kl_ref"] = 0.0 if step == 1 else kl  # iteration 1: the SFT policy itself
        if not self.keep:
            return
        eligible = self.eligible()
        best = max(eligible, key=lambda p: p["gain"])
        keep = {p["iteration"] for p in eligible if p["gain"] >= best["gain"] - 2 * best["gain_se"]}
        for it in set(self.weights) - keep:
            del self.weights[it]

    def eligible(self) -> list[dict]:
        """The measured policies within the KL budget (kl_band's high end: the KL the reward model is trusted to back;
        the judge, a reward model too, is not trusted far beyond it), the SFT policy always."""
        return [p for p in self.points if p.get("kl_ref", 0.0) <= self.budget or p["iteration"] == 1]

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

    @staticmethod
    def describe(point: dict) -> dict:
        """A measured policy for the summary: its iteration, KL to the reference (kl/ref of that iteration's rollout,
        sampled by the same policy), the judge's paired gain over SFT and win rate, with their 95% intervals."""
        return {"iteration": point["iteration"], "kl_ref": point.get("kl_ref"), "judge_gain": point["gain"],
                "judge_gain_ci95": [point["gain"] - Z95 * point["gain_se"], point["gain"] + Z95 * point["gain_se"]],
                "judge_win": point["win"], "judge_win_ci95": point["win_ci95"], "judge_prompts": len(point["scores"])}

    def keep_selected(self) -> dict | None:
        """keep=judge: put the policy the one-SE rule chooses back into the policy adapter; {"keep", "rule",
        "iteration"} (None: keep=last, or nothing judged)."""
        if not (self.keep and self.points):
            return None
        chosen = one_se(self.eligible())
        if chosen["iteration"] not in self.weights:  # pruned by a best whose error grew: the earliest still held
            chosen = next(p for p in self.points if p["iteration"] in self.weights)
        dev = self.roles.device
        set_peft_model_state_dict(self.roles.model, {k: v.to(dev) for k, v in self.weights[chosen["iteration"]].items()},
                                  adapter_name="policy")
        return {"keep": "judge", "rule": "one standard error, within kl_band", "iteration": chosen["iteration"]}


def report(stage: str, section, session, history: list[dict], final: dict, judge: Judge,
           kept: dict | None) -> tuple[dict, list[str]]:
    """A finished run's over-optimization report: the curves' figures; the judge's view of the last measured policy
    and of the kept one (`kept`: Judge.keep_selected's), each with its intervals; the early stop and the iterations
    it saved; the flags (also printed as warnings) and, on rank 0, overoptimization.png in the run record (when the
    judge was measured)."""
    metrics = summary(history)
    if judge.points:
        metrics["judge_last_policy"] = judge.describe(judge.points[-1])
        if kept:
            (point,) = (p for p in judge.points if p["iteration"] == kept["iteration"])
            metrics["judge_kept_policy"] = judge.describe(point)
    if judge.fell:
        metrics["judge_fell"] = dict(judge.fell)
    if judge.left:
        metrics["kl_budget_left"] = dict(judge.left)
    if len(history) < section.steps:  # stopped at a fall or a budget exit (an interrupted run does not get here)
        metrics["stopped_early"] = {"iteration": len(history), "steps_saved": section.steps - len(history),
                                    "compute_saved": round(1 - len(history) / section.steps, 4)}
    flags_ = flags(stage, judge.fell, final, judge.left)
    if judge.independence:
        metrics["judge_independence"] = judge.independence
    notes = [weak_judge(stage, judge.independence)] if (judge.independence or {}).get("weak") else []
    if dist.is_main():
        for f in flags_ + notes:
            print(f"warning: {f}", file=sys.stderr, flush=True)
        plot(history, session.run.dir / "overoptimization.png",
             f"{session.exp.name} / {stage} / {session.run.dir.name}")
    return metrics, flags_
