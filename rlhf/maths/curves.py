"""The over-optimization curves of an online run (Gao et al. 2022's picture): the reward model's score (the proxy),
the judge's and the ground truth's at each of the judge's measurements, against the iteration and against the square
root of the KL to the reference; their last and peak values and how well each tracks the ground truth
(rlhf/rl/overopt.py measures them, and draws overoptimization.png with plot)."""

from __future__ import annotations

import math

from rlhf.maths.guard import correlation


def series(history: list[dict], key: str) -> list[tuple[int, float, float]]:
    """(iteration, KL, value) of the iterations that logged `key`; the KL is that of the judge's own samples
    (overopt/kl) where it was measured, else the iteration's rollout's (kl/ref): the same quantity."""
    return [(i + 1, h.get("overopt/kl", h.get("kl/ref")) or 0.0, h[key]) for i, h in enumerate(history)
            if h.get(key) is not None]


def judged(history: list[dict], key: str) -> list[tuple[int, float, float]]:
    """series(history, key) at the iterations the judge measured (where overopt/judge was logged)."""
    at = {i for i, *_ in series(history, "overopt/judge")}
    return [t for t in series(history, key) if t[0] in at]


def summary(history: list[dict], truth: str = "overopt/truth") -> dict:
    """The curves' last and peak values and, when the task's ground truth (or the reward functions) scored the same
    responses (`truth`), Pearson's r of each curve with it over training: how well the judge and the proxy track
    it. The peak is the maximum of noisy measurements, so biased upward (the winner's curse: in
    studies/fall_simulation.py the best of 13 to 61 measurements sits +1.0 to +1.5 of its standard errors above its
    true gain); the last is not."""
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
