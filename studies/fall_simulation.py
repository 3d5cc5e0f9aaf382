"""The fall test's error rates by simulation (numpy, no model): many runs of K judge measurements on n prompts each,
the per-prompt scores a curve plus noise, and the fall test of rlhf/maths/guard.py (`fall`: the paired drop from the best
measurement so far, in paired standard errors) applied at every measurement after the first, as a run applies it.

- **False falls**: the share of runs flagged for a fall when nothing falls: a plateau from the first measurement, or
  a rise to a plateau (the peak is then the best of the plateau's noisy gains). Measurements independent, or
  correlated as the judge's are (each prompt's noise an AR(1) series over the measurements: the same prompts and
  sampling seed give a slowly changing policy similar samples), normal or heavy-tailed (Student's t, 3 degrees of
  freedom, scaled to unit variance).
- **Detection**: the share of runs flagged when the curve rises, then falls by a given drop (in units of the
  per-prompt noise's standard deviation), and how many measurements after the peak it took.

The thresholds compared, each on both statistics guard.fall tests (the mean gain, and the win rate against SFT's
reference draw, independent of every measurement's noise; each statistic alone and the win rate against SFT's
same-seed first measurement, the former rule, are reported beside them): a fixed z = 3, and the shipped one
(guard.fall_z: alpha = 0.05 spread over the K (K - 1) / 2 pairs of measurements the test can compare and the two
statistics), for K = 13, 21 and 61 (tiny's PPO, 60 iterations, judge every 5; the 7B experiments' GRPO/RLOO, 300
every 15; and PPO, 300 every 5; each with the final measurement after the last update).

    .venv/bin/python studies/fall_simulation.py                     # 20,000 runs per cell
    .venv/bin/python studies/fall_simulation.py --runs 2000 --looks 13
    .venv/bin/python studies/fall_simulation.py --runs 10000 --parts playoff --margins 0 0.1 0.2

Writes results/calibration/<date>-fall-sim.{md,json} (one part: <date>-fall-sim-<part>.{md,json}).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlhf.experiment.online_sections import OnlineConfig  # noqa: E402
from rlhf.maths.guard import fall_z  # noqa: E402
from studies.harness import OUT, wilson, write  # noqa: E402

NOISE = {"independent": (0.0, "normal"), "AR(1) 0.5": (0.5, "normal"), "AR(1) 0.9": (0.9, "normal"),
         "heavy-tailed, AR(1) 0.5": (0.5, "t3")}
"""name: (correlation between consecutive measurements of a prompt, the noise's distribution)."""


def curve(kind: str, looks: int, drop: float = 0.0) -> np.ndarray:
    """The judge's mean score at each measurement, in per-prompt noise standard deviations: plateau (0 throughout),
    rise (up to 0.6 over the first quarter, then flat), fall (the rise to 0.6 by 40% of the run, then down by `drop`
    at the end, linearly)."""
    k = np.arange(looks, dtype=float)
    if kind == "plateau":
        return np.zeros(looks)
    if kind == "rise":
        return 0.6 * np.minimum(k / max(0.25 * (looks - 1), 1.0), 1.0)
    peak = 0.4 * (looks - 1)
    up = 0.6 * np.minimum(k / peak, 1.0)
    return up - drop * np.clip((k - peak) / (looks - 1 - peak), 0.0, None)


def noise(rng, dist: str, shape) -> np.ndarray:
    """Unit-variance noise: normal, or ("t3") Student's t with 3 degrees of freedom, scaled."""
    if dist == "t3":
        return rng.standard_t(3, size=shape) / np.sqrt(3.0)  # t(3) has variance 3
    return rng.standard_normal(shape)


def wins(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per prompt, whether a beats b (guard.wins): 1, 0.5 for a tie, else 0."""
    return np.where(a > b, 1.0, np.where(a == b, 0.5, 0.0))


def scores(rng, runs: int, looks: int, n: int, rho: float, dist: str, mean: np.ndarray):
    """(runs, looks, n) per-prompt scores: mean[k] + a prompt's own effect (the same at every measurement) + noise,
    an AR(1) series over the measurements with unit variance; and (runs, n) SFT's reference draw (guard.Guard.
    reference): mean[0] + the same prompt effects + noise independent of every measurement's (a seed none uses)."""
    def draw(shape):
        return noise(rng, dist, shape)
    e = np.empty((runs, looks, n), dtype=np.float64)
    e[:, 0] = draw((runs, n))
    for k in range(1, looks):
        e[:, k] = rho * e[:, k - 1] + np.sqrt(1 - rho * rho) * draw((runs, n))
    effect = draw((runs, 1, n))
    return e + mean[None, :, None] + effect, mean[0] + effect[:, 0] + draw((runs, n))


STATISTICS = ("gain", "win rate")


def first_fall(s: np.ndarray, z: float, ref: np.ndarray | None = None, statistics=STATISTICS) -> np.ndarray:
    """For each run, the first measurement at which guard.fall fires, or -1: for any of `statistics` (the per-prompt
    score, whose mean less SFT's is the gain, and the per-prompt win against SFT's reference draw `ref`; None: its
    first measurement, the same-seed draw), the paired drop from the measurement where it was best so far exceeds z
    paired standard errors."""
    runs, looks, n = s.shape
    base = s[:, 0] if ref is None else ref
    stats = {"gain": s, "win rate": wins(s, base[:, None])}
    out = np.full(runs, -1)
    rows = np.arange(runs)
    for name in statistics:
        stat = stats[name]
        means = stat.mean(2)
        for k in range(1, looks):
            peak = means[:, :k].argmax(1)
            d = stat[rows, peak] - stat[:, k]
            mean, se = d.mean(1), d.std(1, ddof=1) / np.sqrt(n)
            fired = (mean > 0) & (mean > z * se) & ((out < 0) | (out > k))
            out[fired] = k
    return out


def confirmed_fall(rng, s: np.ndarray, z: float, ref: np.ndarray, mean: np.ndarray, alpha: float,
                   fresh: int, dist: str = "normal", margin: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """For each run, the first measurement at which a fall guard.fall sees is confirmed on `fresh` fresh prompts
    (guard.Guard.confirm at `alpha`), or -1; and how many falls each run sent to the confirmation. At every measurement
    the run has not stopped at, the test fires as guard.fall does (the mean gain first, then the win rate against
    `ref`, each from its peak so far); a fall is then drawn afresh: the peak's and the current policy's true means
    (`mean`) plus a prompt effect they share and independent unit noise on each (`dist`: normal, or t3 at unit
    variance), and the statistic that fell, less `margin` (fall_margin) x what the peak gained over SFT by it on the
    judge's prompts (its measured mean gain, or its win rate against `ref` less one half; none when not positive), is
    tested one-sided (the paired drop, or the peak's wins over the current policy above one half) with Student's t.
    Unconfirmed, the run goes on. Two simplifications against the guard:
    every confirmation draws new prompts and noise, where the guard reuses its prompts, seed and the peak's scores
    (its repeated tests of one peak are correlated, so fewer of them confirm a false fall than independent ones
    would: the simulated false stops are an upper bound), and the two policies' noise is independent, where the
    shared seed correlates it (which makes the guard's paired test tighter: detection here is conservative too)."""
    from rlhf.maths.guard import t_quantile

    runs, looks, n = s.shape
    stats = {"gain": s, "win rate": wins(s, ref[:, None])}
    means = {k: v.mean(2) for k, v in stats.items()}
    out, tested = np.full(runs, -1), np.zeros(runs, dtype=int)
    tq = t_quantile(1 - alpha, fresh - 1)
    rows = np.arange(runs)
    for k in range(1, looks):
        open_ = out < 0
        which, peak, gained = np.full(runs, -1), np.zeros(runs, dtype=int), np.zeros(runs)
        for i, name in enumerate(STATISTICS):  # guard.fall: the first statistic that fell
            p = means[name][:, :k].argmax(1)
            d = stats[name][rows, p] - stats[name][:, k]
            m, se = d.mean(1), d.std(1, ddof=1) / np.sqrt(n)
            fired = open_ & (which < 0) & (m > 0) & (m > z * se)
            which[fired], peak[fired] = i, p[fired]
            level = means[name][rows, p] - (means[name][:, 0] if name == "gain" else 0.5)  # guard.gained
            gained[fired] = level[fired]
        idx = np.flatnonzero(which >= 0)
        if not len(idx):
            continue
        tested[idx] += 1
        shape = (len(idx), fresh)
        effect = noise(rng, dist, shape)
        at_peak = mean[peak[idx]][:, None] + effect + noise(rng, dist, shape)
        now = mean[k] + effect + noise(rng, dist, shape)
        d = np.where((which[idx] == 0)[:, None], at_peak - now, wins(at_peak, now) - 0.5)
        m = d.mean(1) - margin * np.maximum(gained[idx], 0.0)
        se = d.std(1, ddof=1) / np.sqrt(fresh)
        t = np.where(se > 0, m / np.where(se > 0, se, 1.0), np.where(m > 0, np.inf, 0.0))
        out[idx[t > tq]] = k
    return out, tested


def selection_bias(rng, runs: int, looks: int, n: int, z: float, chunk: int = 2000) -> dict:
    """The winner's curse of a kept policy's own measurement, on a rise to a plateau (AR(1) 0.5 noise): for the
    one-standard-error rule, the best measurement and the shipped rule (the last measurement unless the run fell at
    threshold z, then the one-SE rule), the mean of (measured gain - true gain) / its standard error and how often
    the measurement's 95% interval covers the true gain."""
    mean = curve("rise", looks)
    out = {k: {"bias": 0.0, "covered": 0} for k in ("one-SE", "best", "shipped")}
    for i in range(0, runs, chunk):
        s, ref = scores(rng, min(chunk, runs - i), looks, n, 0.5, "normal", mean)
        d = s - s[:, :1]
        gains, se = d.mean(2), d.std(2, ddof=1) / np.sqrt(n)
        se[:, 0] = 1.0  # SFT against itself: gain 0, no error
        rows = np.arange(len(s))
        best = gains.argmax(1)
        within = gains >= (gains[rows, best] - se[rows, best])[:, None]
        one = within.argmax(1)  # the earliest within one standard error of the best
        fell = first_fall(s, z, ref) >= 0
        shipped = np.where(fell, one, looks - 1)
        for name, k in (("one-SE", one), ("best", best), ("shipped", shipped)):
            t = (gains[rows, k] - mean[k]) / se[rows, k]
            real = k > 0  # SFT's own gain is exactly 0
            out[name]["bias"] += float(np.where(real, t, 0.0).sum())
            out[name]["covered"] += int((~real | (np.abs(t) <= 1.959964)).sum())
    return {k: {"bias_se": v["bias"] / runs, "coverage": v["covered"] / runs} for k, v in out.items()}


def playoff_cell(rng, runs: int, looks: int, n: int, z: float, alpha: float, kind: str, drop: float = 0.0,
                 fresh: int = 0, margin: float = 0.0, chunk: int = 2000) -> dict:
    """What the guard saves with and without the final playoff (guard.playoff), in true gains over SFT (per-prompt
    noise standard deviations), on a rise to a plateau or a rise then a decline by `drop` (AR(1) 0.5 noise): the
    guard alone keeps the last measurement unless the fall test fires at k, then the one-SE rule over 0..k (the run
    stops there); its challenger is the best measured gain (against the last) or the latest measurement (against an
    early pick), and the playoff draws both on n fresh prompts (a prompt effect they share, independent noise) and
    keeps the challenger when its paired gain less `margin` x the guard's pick's measured gain (when positive; the
    shipped playoff_margin) exceeds Student's one-sided quantile at alpha in t (`fresh` prompts: 0, 2n, playoff_prompts'
    default 4n; 2n, the former). The judge here is the truth (no proxy error): the margin can only cost. Reported: the mean true gain
    of the saved policy with and without the playoff, of the last and the best-measured policies and the best true
    gain measured (the oracle), how often the playoff switched, and how often it saved a policy truly worse than the
    guard's own choice."""
    from rlhf.maths.guard import t_quantile

    fresh = fresh or 4 * n
    mean, tq = curve(kind, looks, drop), t_quantile(1 - alpha, fresh - 1)
    acc = {k: 0.0 for k in ("guard", "playoff", "last", "best_measured", "oracle")}
    switched = worse = 0
    for i in range(0, runs, chunk):
        m = min(chunk, runs - i)
        s, ref = scores(rng, m, looks, n, 0.5, "normal", mean)
        d = s - s[:, :1]
        gains, se = d.mean(2), d.std(2, ddof=1) / np.sqrt(n)
        first = first_fall(s, z, ref)
        rows = np.arange(m)
        guard_pick, challenger = np.empty(m, int), np.empty(m, int)
        for r in rows:
            end = first[r] if first[r] >= 0 else looks - 1  # the run stops at a fall
            g, e = gains[r, :end + 1], se[r, :end + 1]
            best = int(g.argmax())
            if first[r] < 0:
                guard_pick[r], challenger[r] = end, best
            else:
                guard_pick[r] = int(np.argmax(g >= g[best] - e[best]))  # the earliest within one SE of the best
                challenger[r] = end
        effect = rng.standard_normal((m, fresh))  # the fresh prompts, the same for both policies of a run
        inc = mean[guard_pick][:, None] + effect + rng.standard_normal((m, fresh))
        ch = mean[challenger][:, None] + effect + rng.standard_normal((m, fresh))
        diff = ch - inc
        by = margin * np.maximum(gains[rows, guard_pick], 0.0)
        t = (diff.mean(1) - by) / (diff.std(1, ddof=1) / np.sqrt(fresh))
        won = (challenger != guard_pick) & (t > tq)
        kept = np.where(won, challenger, guard_pick)
        acc["guard"] += float(mean[guard_pick].sum())
        acc["playoff"] += float(mean[kept].sum())
        acc["last"] += float(mean[np.where(first >= 0, first, looks - 1)].sum())
        acc["best_measured"] += float(mean[gains.argmax(1)].sum())
        acc["oracle"] += float(mean.max() * m)
        switched += int(won.sum())
        worse += int((mean[kept] < mean[guard_pick] - 1e-12).sum())
    return {**{k: v / runs for k, v in acc.items()}, "switched": rate(switched, runs), "worse": rate(worse, runs)}


def rate(fired: int, runs: int) -> dict:
    lo, hi = wilson(fired, runs)
    return {"k": fired, "n": runs, "rate": fired / runs, "ci95": [lo, hi]}


def cell(rng, runs: int, looks: int, n: int, noise: str, kind: str, z: float, drop: float = 0.0,
         chunk: int = 2000, alpha: float = 0.05, fresh: int = 0, crng=None, fall_margin: float = 0.0) -> dict:
    """The share of runs flagged (both statistics, as the guard tests them) and, under "by", each statistic alone
    and the win rate against SFT's same-seed draw (the former rule), on the same simulated runs; under "confirmed",
    the share whose fall fresh prompts confirmed (confirmed_fall at `alpha` on `fresh` prompts, 4n by default: the
    playoff's, with `fall_margin`), as the shipped guard stops, with the falls it tested per run; its fresh draws from `crng` (a generator
    of their own, so that the other figures stay as an earlier version of the study drew them)."""
    rho, dist = NOISE[noise]
    mean = curve(kind, looks, drop)
    rules = {"gain": (True, ("gain",)), "win rate": (True, ("win rate",)),
             "win rate, same-seed SFT": (False, ("win rate",))}
    first = {k: [] for k in rules}
    confirmed, tested = [], []
    for i in range(0, runs, chunk):
        s, ref = scores(rng, min(chunk, runs - i), looks, n, rho, dist, mean)
        for k, (independent, stats) in rules.items():
            first[k].append(first_fall(s, z, ref if independent else None, stats))
        c, t = confirmed_fall(crng if crng is not None else rng, s, z, ref, mean, alpha, fresh or 4 * n, dist,
                              fall_margin)
        confirmed.append(c)
        tested.append(t)
    first = {k: np.concatenate(v) for k, v in first.items()}
    confirmed, tested = np.concatenate(confirmed), np.concatenate(tested)
    g, w = first["gain"], first["win rate"]  # both, as the guard tests them: the earlier of the two statistics' falls
    first["both"] = np.where(g < 0, w, np.where(w < 0, g, np.minimum(g, w)))
    hit = first["both"] >= 0
    out = {**rate(int(hit.sum()), runs), "by": {k: rate(int((v >= 0).sum()), runs) for k, v in first.items()
                                                 if k != "both"}}
    if kind == "fall" and hit.any():  # measurements after the peak it took (the fall starts at 40% of the run)
        out["delay_median"] = float(np.median(first["both"][hit] - 0.4 * (looks - 1)))
    hit = confirmed >= 0
    out["confirmed"] = {**rate(int(hit.sum()), runs), "tested_mean": float(tested.mean())}
    if kind == "fall" and hit.any():
        out["confirmed"]["delay_median"] = float(np.median(confirmed[hit] - 0.4 * (looks - 1)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20000)
    ap.add_argument("--looks", type=int, nargs="+", default=[13, 21, 61])
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--drops", type=float, nargs="+", default=[0.15, 0.3, 0.6])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", nargs="+", default=["falls", "playoff"], choices=["falls", "playoff"],
                    help="the fall test's tables, the playoff's, or both (the default: <date>-fall-sim; one part: "
                         "<date>-fall-sim-<part>)")
    ap.add_argument("--margins", type=float, nargs="+", default=[0.0, OnlineConfig.playoff_margin],
                    help="the playoff's margins (playoff_margin; default 0 and the shipped one)")
    ap.add_argument("--fall-margin", type=float, default=OnlineConfig.fall_margin,
                    help="the confirmation's margin (fall_margin; default the shipped one)")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    rng, crng = np.random.default_rng(a.seed), np.random.default_rng(a.seed + 1)
    rules = {"z = 3": lambda k: 3.0, "shipped": lambda k: fall_z(k, a.alpha, a.prompts)}
    rows, curse, playoffs = [], {}, []
    for looks in a.looks if "falls" in a.parts else ():
        for rule, zf in rules.items():
            z = zf(looks)
            for kind in ("plateau", "rise"):
                for noise in NOISE:
                    rows.append({"looks": looks, "rule": rule, "z": z, "curve": kind, "noise": noise,
                                 **cell(rng, a.runs, looks, a.prompts, noise, kind, z, crng=crng,
                                        fall_margin=a.fall_margin)})
            for drop in a.drops:
                rows.append({"looks": looks, "rule": rule, "z": z, "curve": "fall", "drop": drop,
                             "noise": "AR(1) 0.5", **cell(rng, a.runs, looks, a.prompts, "AR(1) 0.5", "fall", z,
                                                          drop, crng=crng, fall_margin=a.fall_margin)})
            print(f"{looks} looks, {rule}: done", file=sys.stderr, flush=True)
    if "falls" in a.parts:
        curse = {looks: selection_bias(rng, a.runs, looks, a.prompts, fall_z(looks, a.alpha, a.prompts))
                 for looks in a.looks}
    if "playoff" in a.parts:
        playoffs = [{"looks": looks, "curve": kind, "drop": drop, "margin": margin,
                     **playoff_cell(rng, a.runs, looks, a.prompts, fall_z(looks, a.alpha, a.prompts), a.alpha, kind,
                                    drop, margin=margin)}
                    for margin in a.margins
                    for looks in a.looks for kind, drop in (("rise", 0.0), *(("fall", d) for d in a.drops))]
    md = markdown(rows, a, curse, playoffs)
    print(md)
    name = "fall-sim" if len(a.parts) == 2 else f"fall-sim-{a.parts[0]}"
    write(a.out, name, md, {"rows": rows, "selection_bias": curse, "playoff": playoffs})
    return 0


def markdown(rows: list[dict], a, curse: dict, playoffs: list[dict] | None = None) -> str:
    def fmt(r):
        return f"{r['rate']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"
    lines = []
    if rows:
        lines += falls_markdown(rows, a, curse, fmt)
    if playoffs:
        lines += ["", f"The final playoff (a challenger against the guard's choice on {4 * a.prompts} fresh prompts, "
                  f"one-sided at alpha {a.alpha}, {a.runs} runs per row; AR(1) 0.5 noise): the mean true gain over SFT "
                  "of what is saved, in per-prompt noise standard deviations, and how often the playoff switched and "
                  "saved a policy truly worse than the guard's choice; the margin is playoff_margin, a share of the "
                  "guard's choice's measured gain:", "",
                  "| margin | measurements | curve | guard alone | with the playoff | last | best measured | best "
                  "measured, true (oracle) | switched | worse than the guard's |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in playoffs:
            name = "rise to a plateau" if r["curve"] == "rise" else f"rise, then a decline of {r['drop']:g}"
            lines.append(f"| {r.get('margin', 0):g} | {r['looks']} | {name} | {r['guard']:.3f} | "
                         f"{r['playoff']:.3f} | {r['last']:.3f} | {r['best_measured']:.3f} | {r['oracle']:.3f} | "
                         f"{fmt(r['switched'])} | {fmt(r['worse'])} |")
    return "\n".join(lines).lstrip("\n") + "\n"


def falls_markdown(rows: list[dict], a, curse: dict, fmt) -> list[str]:
    """The false falls, each statistic's, the detection, the confirmed stop's and the winner's curse tables."""
    noises = list(NOISE)
    lines = [f"The fall test by simulation ({a.runs} runs per cell, {a.prompts} prompts per measurement; "
             f"studies/fall_simulation.py --runs {a.runs}): the share of runs flagged for a fall, with Wilson's 95% "
             f"interval.", "", "False falls (nothing falls):", "",
             "| measurements | threshold | curve | " + " | ".join(noises) + " |",
             "|---|---|---|" + "---|" * len(noises)]
    for looks in a.looks:
        for rule in ("z = 3", "shipped"):
            for kind in ("plateau", "rise"):
                rs = {r["noise"]: r for r in rows if (r["looks"], r["rule"], r["curve"]) == (looks, rule, kind)}
                z = next(iter(rs.values()))["z"]
                lines.append(f"| {looks} | {rule} ({z:.2f}) | {kind} | " + " | ".join(fmt(rs[x]) for x in noises)
                             + " |")
    by = list(next(r for r in rows if r["curve"] != "fall")["by"])
    lines += ["", "Each statistic alone under the shipped threshold (the share of runs it alone would flag; the "
              "guard's alpha is split between the two, so each should stay within alpha / 2), and the win rate "
              "against SFT's same-seed draw, the rule before SFT's reference draw, on the same runs:", "",
              "| measurements | curve | statistic | " + " | ".join(noises) + " |",
              "|---|---|---|" + "---|" * len(noises)]
    for looks in a.looks:
        for kind in ("plateau", "rise"):
            rs = {r["noise"]: r for r in rows if (r["looks"], r["rule"], r["curve"]) == (looks, "shipped", kind)}
            for stat in by:
                lines.append(f"| {looks} | {kind} | {stat} | " + " | ".join(fmt(rs[x]["by"][stat]) for x in noises)
                             + " |")
    lines += ["", "Detection (the curve rises to 0.6 by 40% of the run, then falls by the drop; AR(1) 0.5 noise; the "
              "median number of measurements from the peak to the flag):", "",
              "| measurements | threshold | " + " | ".join(f"drop {d:g}" for d in a.drops) + " |",
              "|---|---|" + "---|" * len(a.drops)]
    for looks in a.looks:
        for rule in ("z = 3", "shipped"):
            rs = {r["drop"]: r for r in rows if (r["looks"], r["rule"], r["curve"]) == (looks, rule, "fall")}
            lines.append(f"| {looks} | {rule} | " + " | ".join(
                f"{fmt(rs[d])}, {rs[d].get('delay_median', float('nan')):.0f} after" for d in a.drops) + " |")
    lines += ["", f"The shipped guard: a fall counts (flags, stops a run) once {4 * a.prompts} fresh prompts confirm it (the statistic that "
              f"fell, less fall_margin {a.fall_margin:g} of what the peak gained, one-sided at alpha {a.alpha}; "
              "unconfirmed, the run goes on). The share of runs stopped, and "
              "the falls sent to the confirmation per run:", "",
              "| measurements | curve | " + " | ".join(noises) + " |", "|---|---|" + "---|" * len(noises)]
    for looks in a.looks:
        for kind in ("plateau", "rise"):
            rs = {r["noise"]: r for r in rows if (r["looks"], r["rule"], r["curve"]) == (looks, "shipped", kind)}
            lines.append(f"| {looks} | {kind} | " + " | ".join(
                f"{fmt(rs[x]['confirmed'])}, {rs[x]['confirmed']['tested_mean']:.3f} tested" for x in noises) + " |")
    lines += ["", "Its detection (the same falls as above, AR(1) 0.5; the median number of measurements from the peak "
              "to the stop):", "", "| measurements | " + " | ".join(f"drop {d:g}" for d in a.drops) + " |",
              "|---|" + "---|" * len(a.drops)]
    for looks in a.looks:
        rs = {r["drop"]: r for r in rows if (r["looks"], r["rule"], r["curve"]) == (looks, "shipped", "fall")}
        lines.append(f"| {looks} | " + " | ".join(
            f"{fmt(rs[d]['confirmed'])}, {rs[d]['confirmed'].get('delay_median', float('nan')):.0f} after"
            for d in a.drops) + " |")
    lines += ["", "The winner's curse of the kept policy's own measurement (a rise to a plateau, AR(1) 0.5 noise): the "
              "mean of (measured gain - true gain) in its standard errors, and how often its 95% interval covers the "
              "true gain:", "", "| measurements | one-SE rule | best measured | shipped (last unless it fell) |",
              "|---|---|---|---|"]
    for looks, c in curse.items():
        lines.append(f"| {looks} | " + " | ".join(f"{c[k]['bias_se']:+.2f}, covers {c[k]['coverage']:.1%}"
                                                    for k in ("one-SE", "best", "shipped")) + " |")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
