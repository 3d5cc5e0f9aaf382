"""Reward over-optimization (Gao et al. 2022): a policy pushed against a learned reward model (the proxy) gains proxy
reward while its true quality first rises, then falls. The judge, a reward adapter trained on preference pairs that
no stage trains on (data.judge_fraction), stands in for the true quality. The online stages score the same prompts,
sampled with the same seed, with both every <stage>.judge_every iterations (`overopt/proxy`, `overopt/judge`, each on
its own held-out scale; `overopt/truth` when the task has a ground truth), and the held-out check reports the win
rate against SFT by both. A run is flagged when the two disagree:

- along training: since the first measurement (the SFT policy's own samples), the judge confirms less than
  <stage>.overopt_confirm of the reward model's gain (each gain in its own held-out standard deviations);
- on held-out prompts: the proxy says the policy beats SFT (win rate > 0.5) and the judge says it does not (< 0.5).

With <stage>.keep = judge_best the run keeps, among the measured policies whose gain the judge confirms, the one it
scores highest (the SFT policy itself when none is confirmed).
"""

from __future__ import annotations

import math
import sys

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from . import checks, dist, generation
from .config import Experiment
from .roles import Roles, Scorer, reward_scales


def series(history: list[dict], key: str) -> list[tuple[int, float, float]]:
    """(iteration, kl/ref, value) of the iterations that logged `key`."""
    return [(i + 1, h.get("kl/ref") or 0.0, h[key]) for i, h in enumerate(history) if h.get(key) is not None]


def judged(history: list[dict], key: str) -> list[tuple[int, float, float]]:
    """series(history, key) at the iterations the judge measured (where overopt/judge was logged)."""
    at = {i for i, *_ in series(history, "overopt/judge")}
    return [t for t in series(history, key) if t[0] in at]


def confirmed(first: dict, now: dict, confirm: float) -> bool:
    """Whether the judge confirms at least `confirm` of the proxy's gain from the measurement `first` to `now`
    ({"judge", "proxy"}: scores on their held-out scales); a proxy that did not gain needs no confirming."""
    gain = now["proxy"] - first["proxy"]
    return gain <= 0 or now["judge"] - first["judge"] >= confirm * gain - 1e-9


def flags(stage: str, history: list[dict], check: dict, confirm: float) -> list[str]:
    """The over-optimization warnings of a finished run (the module docstring's two rules); [] when there is no judge
    or no sign of it."""
    out = []
    judge, proxy = series(history, "overopt/judge"), series(history, "overopt/proxy")
    if len(judge) >= 2 and len(proxy) == len(judge):
        first, last = ({"judge": judge[i][2], "proxy": proxy[i][2]} for i in (0, -1))
        if not confirmed(first, last, confirm):
            out.append(f"{stage}: reward over-optimization: since iteration {judge[0][0]} the reward model's score "
                       f"rose by {last['proxy'] - first['proxy']:.2f} and the judge's by only "
                       f"{last['judge'] - first['judge']:.2f} (each in its held-out standard deviations; "
                       f"{stage}.overopt_confirm={confirm:g})")
    wins = check.get("eval_win_rates", {})
    if "judge" in wins and "reward_model" in wins:
        wj, wp = wins["judge"]["win_rate"], wins["reward_model"]["win_rate"]
        if wp > 0.5 > wj:
            out.append(f"{stage}: reward over-optimization on held-out prompts: the reward model prefers the policy "
                       f"to SFT (win rate {wp:.2f}), the judge prefers SFT (win rate {wj:.2f})")
    return out


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
                ax.plot(xs, [t[2] for t in pts], style, ms=3, label=name)
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
    """The judge along an online run. Every section.judge_every iterations from the first, the
    policy samples the same section.judge_prompts training prompts with the same seed (common random numbers: the
    curves move with the policy, not with the prompts drawn), and those responses are scored by the judge and by the
    reward model, each on its held-out scale (`overopt/judge`, `overopt/proxy`: the score the stage optimizes, the
    ensemble's mean - lambda x std when rm.ensemble > 1), and by the task's ground truth or reward functions when
    they exist (`overopt/truth`). The training RNG streams are left as they were. With section.keep = judge_best, a
    CPU copy of the policy adapter the judge scored highest is kept in every checkpoint and put back before the run
    saves its policy (overopt.py: among the policies whose gain the judge confirms). Off without a judge or with the
    reward model out of the reward."""

    def __init__(self, exp: Experiment, section, roles: Roles, scorer: Scorer, rm: dict | None, prompts: list[dict],
                 gen_kwargs: dict):
        self.exp, self.roles, self.scorer, self.every = exp, roles, scorer, section.judge_every
        self.on = bool(self.every and roles.judge_head is not None and exp.reward.model)  # a judge: an RM run
        self.keep = section.keep == "judge_best" and self.on
        n = min(section.judge_prompts, len(prompts)) // dist.world_size() * dist.world_size()
        self.rows = dist.local_rows(prompts[:n], n)
        self.gen_kwargs = gen_kwargs
        if self.on:
            judge = rm["judge"]["reward_stats"]
            self.judge_scale = torch.tensor([(judge["mean"], judge["std"])], dtype=torch.float32)
            self.proxy_scale = torch.tensor(reward_scales(exp, section, rm, heldout=True), dtype=torch.float32)
        self.confirm = section.overopt_confirm
        self.first: dict | None = None
        """{"judge", "proxy"} of the first measurement (the SFT policy's samples)."""
        self.best: dict | None = None
        """{"iteration", "judge", "proxy"} of the best-scored confirmed policy so far (keep=judge_best)."""
        self.weights: dict[str, torch.Tensor] | None = None

    @torch.no_grad()
    def measure(self, step: int) -> dict[str, float]:
        """{overopt/judge, overopt/proxy[, overopt/truth]} of the current policy, over every rank, at the iterations
        judged ({} at the others)."""
        if not self.on or (step - 1) % self.every:
            return {}
        dev = self.roles.device
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(self.exp.seed + 1)
            r = generation.generate(self.roles.model, self.roles.tok, [q["prompt"] for q in self.rows],
                                    **self.gen_kwargs)
        parts = r.chunks(self.gen_kwargs["batch_size"])
        raw = torch.cat([self.roles.score(part) for part in parts])
        judged = torch.cat([self.roles.score_by(part, "judge", self.roles.judge_head) for part in parts])
        judge = dist.all_gather_rows(Scorer.normalized(judged[:, None], self.judge_scale)[:, 0]).mean().item()
        proxy = dist.all_gather_rows(self.scorer.model_score(raw, self.proxy_scale)).mean().item()
        out = {"overopt/judge": judge, "overopt/proxy": proxy}
        truth, _ = checks.grader_scores(self.exp, self.rows, generation.decode(self.roles.tok, r),
                                         generation.response_ids(r))
        if truth is not None:
            out["overopt/truth"] = dist.all_gather_rows(torch.tensor(truth, dtype=torch.float32)).mean().item()
        now = {"judge": judge, "proxy": proxy}
        self.first = self.first or now
        if self.keep and confirmed(self.first, now, self.confirm) and (
                self.best is None or judge > self.best["judge"]):
            self.best = {"iteration": step, **now}
            self.weights = {k: v.detach().to("cpu", copy=True) for k, v in
                            get_peft_model_state_dict(self.roles.model, adapter_name="policy").items()}
        return out

    def state(self) -> tuple[dict, dict]:
        """(JSON state, tensors) for a checkpoint."""
        return {"judge_first": self.first, "judge_best": self.best}, (self.weights or {})

    def restore(self, state: dict) -> None:
        self.first, self.best = state.get("judge_first"), state.get("judge_best")
        self.weights = state.get("tensors") or None

    def keep_best(self) -> dict | None:
        """keep=judge_best: put the best-scored policy back into the policy adapter; what was kept (None: keep=last,
        or nothing judged)."""
        if not (self.keep and self.weights):
            return None
        dev = self.roles.device
        set_peft_model_state_dict(self.roles.model, {k: v.to(dev) for k, v in self.weights.items()},
                                  adapter_name="policy")
        return {"keep": "judge_best", **self.best}


def report(stage: str, section, session, history: list[dict], final: dict) -> tuple[dict, list[str]]:
    """A finished run's over-optimization report: the curves' figures, its flags (also printed as
    warnings) and, on rank 0, overoptimization.png in the run record (when the judge was measured)."""
    metrics = summary(history)
    flags_ = flags(stage, history, final, section.overopt_confirm)
    if dist.is_main():
        for f in flags_:
            print(f"warning: {f}", file=sys.stderr, flush=True)
        plot(history, session.run.dir / "overoptimization.png",
                     f"{session.exp.name} / {stage} / {session.run.dir.name}")
    return metrics, flags_
