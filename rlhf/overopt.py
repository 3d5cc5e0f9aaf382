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
