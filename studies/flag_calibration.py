"""The over-optimization guard's error rates on the tiny task, whose ground truth no stage sees: `--seeds` runs of
each scenario (SFT, RM, then the online stage, each as `python -m rlhf <stage>` types it, with the shipped settings
plus the scenario's), healthy ones and ones that lose to SFT by the ground truth, and per scenario:

- how often the run was flagged (a false flag on a healthy run, a detection on a losing one), with 95% intervals;
- the saved policy's ground-truth win rate against SFT on the 200 held-out prompts (mean over seeds, and how many
  were significantly below 0.5), the kept iteration and the iterations the early stop saved.

A losing run is one whose policy, trained to the end with keep=last and no early stop, loses to SFT by the ground
truth (`--check-losing` reruns it that way and counts how many did; the detection rate then counts the seeds
whose unguarded run lost). `--merge` folds in the runs of earlier records (more seeds, one table). The goals (issue
40): a false-flag rate of at most 5% and a detection rate of at least 90%.

    OMP_NUM_THREADS=1 .venv/bin/python studies/flag_calibration.py --seeds 10            # make flag-calibration
    OMP_NUM_THREADS=1 .venv/bin/python studies/flag_calibration.py --seeds 1 --scenarios healthy --steps 10
    OMP_NUM_THREADS=1 .venv/bin/python studies/flag_calibration.py --first-seed 11 --seeds 20 --check-losing \
        --merge results/calibration/2026-11-25-flag.json          # seeds 11-30 added to an earlier 1-10

Writes results/calibration/<date>-flag.{json,md} (--out to choose another directory, --name another name).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlhf.experiment import config  # noqa: E402
from rlhf.maths import guard  # noqa: E402
from studies.harness import (TINY, below, mean_and_se, parse, rate_interval, run, t_interval, traced,
                             truth_win, write)  # noqa: E402

SCENARIOS = {
    "healthy": ("ppo", [], "tiny.yaml as shipped"),
    "healthy-grpo": ("grpo", [], "GRPO with the reward model, tiny.yaml as shipped"),
    "healthy-rloo": ("rloo", [], "RLOO with the reward model, tiny.yaml as shipped"),
    "weak-rm": ("ppo", ["data.pref_pairs=500", "data.judge_fraction=0.88", "ppo.kl_coef=0.002"],
                "a reward model of 60 pairs (the judge on 440) pushed far: beta 0.002"),
    "high-kl": ("ppo", ["data.pref_pairs=500", "data.judge_fraction=0.7", "ppo.kl_coef=0.005"],
                "a reward model of 150 pairs (0.82 held-out) at beta 0.005: a high KL its judge rises with"),
    "broken-update": ("ppo", ["ppo.learning_rate=0.03"], "an update that breaks the policy: learning rate 0.03"),
    "decline": ("ppo", ["data.pref_pairs=700", "data.judge_fraction=0.7", "ppo.kl_coef=0.03"],
                "a decline inside the KL budget: a reward model of 210 pairs (the judge on 490) at beta 0.03; the truth "
                "rises, then gives back part of its gain with the KL near the budget's 6 nats"),
    "slow-decline": ("ppo", ["data.pref_pairs=2000", "data.judge_fraction=0.9", "ppo.kl_coef=0.03"],
                     "a slow decline the judge partly sees: a reward model of 200 pairs at beta 0.03, the judge on "
                     "1,800 (the same base, more of the same data); the truth rises, then gives back part or all of "
                     "its gain, mostly inside the KL budget"),
    "weak-rm-grpo": ("grpo", ["data.pref_pairs=500", "data.judge_fraction=0.88", "grpo.beta=0.004"],
                     "GRPO on a reward model of 60 pairs (the judge on 440) pushed far: beta 0.004"),
    "broken-update-grpo": ("grpo", ["grpo.learning_rate=0.03"], "GRPO with an update that breaks the policy: "
                           "learning rate 0.03"),
}
"""name: (stage, overrides, what it is). Healthy ones start with 'healthy'."""


def one(name: str, seed: int, results: str, steps: int, plain: bool) -> dict:
    """One run of a scenario (plain: keep=last, no early stop), its online stage traced (studies/guard_trace.py):
    its summary's figures, and the held-out ground truth of the policies it measured, kept or discarded: the saved
    one's, the last one's (the policy after the last update) and the best one's by that truth, with whether the saved
    policy is significantly below either (paired per prompt on the same held-out samples)."""
    stage, extra, _ = SCENARIOS[name]
    ov = [f"results_dir={results}", f"seed={seed}", *extra, *([f"{stage}.steps={steps}"] if steps else [])]
    if plain:
        ov += [f"{stage}.keep=last", f"{stage}.overopt_stop=false"]
    run(("sft", "rm"), ov)
    path = traced(stage, ov)
    s = json.loads((path.parent / "summary.json").read_text())
    pts = json.loads(path.read_text())["points"]
    m = s["metrics"]
    gt = m["eval_win_rates"]["ground_truth"]
    kept = (s["model"].get("kept") or {}).get("iteration")
    saved = next(p for p in pts if p["iteration"] == kept) if kept else pts[-1]
    best = max(pts, key=lambda p: truth_win(p, pts[0]))
    playoff = playoff_of(s, pts)
    return {"scenario": name, "seed": seed, "plain": plain, "steps": s["metrics"]["steps"], "measurements": len(pts),
            "flags": s["flags"], "truth_win": gt["win_rate"], "truth_ci95": gt["ci95"], "kept": kept,
            "stopped_early": m.get("stopped_early"), "eval_kl_ref": m["eval_kl_ref"],
            "fell": bool(m.get("judge_fell")), "left_budget": bool(m.get("kl_budget_left")),
            "unconfirmed": [[u["iteration"], u["peak"], u["statistic"], round(u["fresh"]["t"], 2)]
                            for u in m.get("judge_unconfirmed") or []],
            "last_truth_win": truth_win(pts[-1], pts[0]), "best_truth_win": truth_win(best, pts[0]),
            "best_iteration": best["iteration"], "saved_below_last": below(saved, pts[-1]),
            "saved_below_best": below(saved, best), "judge_independence": m.get("judge_independence"),
            "measured": [[p["iteration"], round(p["kl_ref"], 3), round(p["gain"], 4), round(truth_win(p, pts[0]), 4)]
                         for p in pts], "halves": halves(pts), "playoff": playoff, "fall": fall_of(m, pts),
            "below_last_at": playoff_below_last(playoff, pts), "trace": str(path)}


def playoff_below_last(playoff: dict | None, pts: list[dict]) -> dict[str, bool]:
    """Whether each of the playoff's two policies is significantly below the last one by the held-out truth (below):
    what a replay of another margin needs (below_last), kept in the record so that it needs no trace."""
    if not playoff:
        return {}
    by = {p["iteration"]: p for p in pts}
    return {str(i): below(by[i], pts[-1]) for i in (playoff["incumbent"], playoff["challenger"])}


def fall_of(metrics: dict, pts: list[dict]) -> dict | None:
    """The run's fall as fresh prompts confirmed it (metrics.judge_fell: where, from which peak, the fresh test's
    drop, error, prompts, threshold and margin), with what the peak gained over SFT (`gained`, what fall_margin is a
    share of; a record from before the margin: the peak's mean gain, the statistic every fall of those runs took, and
    margin 0); None when nothing fell or the fall was not tested on fresh prompts."""
    f = metrics.get("judge_fell") or {}
    c = f.get("fresh") or {}
    if "t" not in c:
        return None
    gained = f["gained"] if "gained" in f else next(p["gain"] for p in pts if p["iteration"] == f["peak"])
    return {"iteration": f["iteration"], "peak": f["peak"], "statistic": f["statistic"], "gained": gained,
            **{k: c[k] for k in ("drop", "se", "prompts", "t", "threshold")}, "margin": c.get("margin", 0.0)}


def reconfirmed(f: dict, share: float) -> bool:
    """Whether a recorded confirmed fall (fall_of's) would still count had fall_margin been `share`: its fresh drop
    less that share of the peak's gain, over its error, above the recorded threshold (guard.confirm's test)."""
    return guard.t_of({"mean": f["drop"] - guard.margin(share, f["gained"]), "se": f["se"]}) > f["threshold"]


def refalls(runs: list[dict], shares: list[float]) -> dict:
    """Per fall_margin share, which of these runs' confirmed falls would still count (reconfirmed): the seeds kept and
    those let go. A fall let go would have let its run go on, which a replay cannot show: for choosing, not grading."""
    falls = [(r["seed"], r["fall"]) for r in runs if r.get("fall")]
    return {f"{m:g}": {"kept": [s for s, f in falls if reconfirmed(f, m)],
                       "let_go": [s for s, f in falls if not reconfirmed(f, m)]} for m in shares}


def playoff_of(summary: dict, pts: list[dict]) -> dict | None:
    """The run's final playoff as its summary recorded it (model.kept.playoff: the two iterations, the paired gain,
    its error, the level), with the guard's choice's measured gain (`incumbent_gain`, what playoff_margin is a share
    of); None when it was skipped."""
    p = (summary["model"].get("kept") or {}).get("playoff") or {}
    if "gain" not in p:
        return None
    return {**p, "incumbent_gain": next(q["gain"] for q in pts if q["iteration"] == p["incumbent"])}


def replayed(r: dict, margin: float) -> int:
    """The iteration the run would have kept had its playoff asked the challenger for `margin` of the guard's choice's
    gain (guard.playoff's test, beyond_margin, on the recorded gain and error); the kept one when the run had no
    playoff."""
    p = r.get("playoff")
    if not p:
        return r["kept"]
    d = {"mean": p["gain"], "se": p["se"], "n": p["prompts"]}
    t, threshold = guard.beyond_margin(d, p["alpha"], guard.margin(margin, p["incumbent_gain"]))
    return p["challenger"] if t > threshold else p["incumbent"]


def below_last(k: dict, r: dict) -> bool:
    """Whether run `r`'s policy `k["kept"]` is significantly below its last one by the held-out truth (below): the
    record's own answer when it is the kept one, else from the run's trace (its per-prompt truth)."""
    if k["kept"] == r["kept"]:
        return r["saved_below_last"]
    if str(k["kept"]) in r.get("below_last_at", {}):
        return r["below_last_at"][str(k["kept"])]
    if not Path(r["trace"]).exists():
        raise SystemExit(f"flag_calibration --replay-margins: {r['scenario']} seed {r['seed']}'s record predates "
                         f"below_last_at and its trace {r['trace']} is not on this machine; rerun its runs (the "
                         f"record's argv) to replay it")
    pts = {p["iteration"]: p for p in json.loads(Path(r["trace"]).read_text())["points"]}
    return below(pts[k["kept"]], pts[max(pts)])


def replay(runs: list[dict], margins: list[float]) -> dict:
    """Per margin, on these runs' recorded playoffs: how many would have switched to the challenger, and the saved
    policy against what the run discarded (against) with that margin's choice. A choice of the margin made on these
    runs is graded by them too: for choosing, not for reporting a margin's figures."""
    measured = [r for r in runs if r.get("measured")]
    out = {}
    for m in margins:
        kept = [{**r, "kept": replayed(r, m)} for r in measured]
        out[f"{m:g}"] = {"switched": sum(bool(k.get("playoff")) and k["kept"] == k["playoff"]["challenger"]
                                         for k in kept),
                         "playoffs": sum(bool(k.get("playoff")) for k in kept), "against": against(kept),
                         "below_last": [below_last(k, r) for k, r in zip(kept, measured)].count(True)}
    return out


def halves(pts: list[dict]) -> list[list[float]]:
    """Each traced policy's ground-truth win rate against SFT on the even- and on the odd-numbered held-out prompts:
    a policy chosen by the truth on one half is graded on the other (`against`)."""
    def half(p: dict, h: int) -> dict:
        return {"truth_heldout": p["truth_heldout"][h::2]}
    return [[round(truth_win(half(p, h), half(pts[0], h)), 4) for h in (0, 1)] for p in pts]


def summarize(name: str, runs: list[dict], plain_runs: list[dict]) -> dict:
    n = len(runs)
    flagged = sum(bool(r["flags"]) for r in runs)
    under = sum(r["truth_ci95"][1] < 0.5 for r in runs)
    saved = [r["stopped_early"]["compute_saved"] for r in runs if r["stopped_early"]]
    out = {"scenario": name, "what": SCENARIOS[name][2], "n": n, "flagged": flagged,
           "flag_rate": round(flagged / n, 4), "flag_ci95": rate_interval(flagged, n),
           "saved_truth_win_mean": round(sum(r["truth_win"] for r in runs) / n, 4),
           "saved_significantly_below_sft": under, "stopped_early": len(saved),
           "compute_saved_mean": round(sum(saved) / len(saved), 4) if saved else 0.0}
    traced_runs = [r for r in runs if "last_truth_win" in r]  # records before issue 48 graded the saved one alone
    if traced_runs:
        t = len(traced_runs)
        out.update({"steps": traced_runs[0]["steps"], "measurements": max(r["measurements"] for r in traced_runs),
                    "flagged_or_stopped": sum(bool(r["flags"] or r["stopped_early"]) for r in traced_runs),
                    "traced": t, **{f"{k}_mean": round(sum(r[k] for r in traced_runs) / t, 4)
                                    for k in ("truth_win", "last_truth_win", "best_truth_win")},
                    **{k: sum(r[k] for r in traced_runs) for k in ("saved_below_last", "saved_below_best")}})
        out["flagged_or_stopped_ci95"] = rate_interval(out["flagged_or_stopped"], t)
        measured = [r for r in traced_runs if r.get("measured")]  # records before issue 57 lack the traces
        if measured:
            out["against"] = against(measured)
        out["saved_below_last_ci95"] = rate_interval(out["saved_below_last"], t)
        # the delay: iterations from the best measured policy by the truth to where the guard stopped the run
        delays = sorted(r["stopped_early"]["iteration"] - r["best_iteration"] for r in traced_runs
                        if r["stopped_early"] and "best_iteration" in r)
        if delays:
            out["stop_delay"] = {"median": statistics.median(delays), "min": delays[0], "max": delays[-1],
                                 "n": len(delays)}
        confirming = [r for r in traced_runs if "unconfirmed" in r]  # records before the confirmation lack it
        if confirming:  # falls the judge's prompts saw and fresh prompts did not confirm (the run went on)
            out["unconfirmed"] = {"runs": sum(bool(r["unconfirmed"]) for r in confirming), "n": len(confirming),
                                  "falls": sum(len(r["unconfirmed"]) for r in confirming)}
    if plain_runs:
        lost = {r["seed"] for r in plain_runs if r["truth_win"] < 0.5}
        caught = sum(bool(r["flags"]) for r in runs if r["seed"] in lost)
        out.update({"plain_lost": len(lost), "plain_truth_win_mean":
                    round(sum(r["truth_win"] for r in plain_runs) / len(plain_runs), 4),
                    "detected": caught, "detected_ci95": rate_interval(caught, len(lost))})
    return out


AGAINST = ("last", "best by the judge", "best by the truth", "best by the truth, held out")
"""What `against` compares the saved policy with."""


def against(runs: list[dict]) -> dict:
    """The saved policy's held-out ground truth against what the run discarded, per run on the trace's grading of
    each measured policy (the same held-out samples; `measured`: iteration, KL, judge gain, truth win), then the mean
    over runs of the difference with its standard error and 95% interval (Student's t over the runs): against the
    last policy, the best measured by the judge (its gain, what the guard saw), the best measured by the truth
    (optimistic: chosen on the samples it is graded on) and, where the run kept its `halves`, the best by the truth
    held out (chosen on one half of the prompts, graded with the saved one on the other)."""
    diffs = {k: [] for k in AGAINST}
    for r in runs:
        its = [m[0] for m in r["measured"]]
        k = its.index(r["kept"]) if r["kept"] in its else len(its) - 1
        saved = r["measured"][k][3]
        diffs["last"].append(saved - r["measured"][-1][3])
        diffs["best by the judge"].append(saved - max(r["measured"], key=lambda m: m[2])[3])
        diffs["best by the truth"].append(saved - max(m[3] for m in r["measured"]))
        if "halves" in r:  # chosen on one half of the prompts, graded on the other; the two halves averaged
            h = r["halves"]
            diffs["best by the truth, held out"].append(sum(
                h[k][1 - c] - h[max(range(len(h)), key=lambda i: h[i][c])][1 - c] for c in (0, 1)) / 2)
    out = {}
    for k, xs in diffs.items():
        if not xs:  # records before the halves were kept
            continue
        mean, se = mean_and_se(xs, 0.0)
        ci = t_interval(xs)["ci95"] or [mean, mean]
        out[k] = {"mean": round(mean, 4), "se": round(se, 4), "ci95": [round(x, 4) for x in ci], "n": len(xs)}
    return out


def difference(c: dict | None, n: int | None = None) -> str:
    """A mean difference over runs (against's) as a table cell: mean +- its error [its 95% interval], with its n when
    that is not the table's `n`; "-" for none."""
    if not c:
        return "-"
    return (f"{c['mean']:+.3f} +- {c['se']:.3f} [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}]"
            + (f" (n {c['n']})" if n is not None and c["n"] != n else ""))


def table(intro: str, columns: list[str]) -> list[str]:
    """A markdown table's opening lines: a blank line, its introduction, a blank line, the header and its rule."""
    return ["", intro, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def markdown(rows: list[dict], seeds: int) -> str:
    lines = [f"Over-optimization guard on the tiny task, up to {seeds} seed(s) per scenario (n); win rates by the "
             "task's ground truth against SFT on 200 held-out prompts (studies/flag_calibration.py).", "",
             "| scenario | steps | n | flagged [95%] | saved policy's truth win (mean) | saved below SFT "
             "(significant) | stopped early (compute saved) | without the guard: lost to SFT, truth win (mean) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        plain = (f"{r['plain_lost']}/{r['n']}, {r['plain_truth_win_mean']:.3f}; flagged {r['detected']}/"
                 f"{r['plain_lost']}" if "plain_lost" in r else "-")
        lines.append(f"| {r['scenario']} | {r.get('steps', '-')} | {r['n']} | {r['flagged']}/{r['n']} = "
                     f"{r['flag_rate']:.2f} "
                     f"[{r['flag_ci95'][0]:.2f}, {r['flag_ci95'][1]:.2f}] | {r['saved_truth_win_mean']:.3f} | "
                     f"{r['saved_significantly_below_sft']}/{r['n']} | {r['stopped_early']}/{r['n']} "
                     f"({r['compute_saved_mean']:.0%}) | {plain} |")
    graded = [r for r in rows if "traced" in r]
    if graded:
        lines += table("What each run measured, kept and discarded, by the ground truth on the held-out prompts "
                       "(every measured policy graded there; the best one chosen on those same samples, so its figure "
                       "is optimistic): the win rate against SFT of the saved policy, the last one (after the last "
                       "update) and the best measured, means over the runs; the runs whose saved policy is "
                       "significantly below the last or the best measured one (paired per prompt, 95%).",
                       ["scenario", "steps", "measurements", "n", "flagged or stopped [95%]",
                        "truth win: saved / last / best measured", "saved below its last [95%]",
                        "saved below the best measured"])
        for r in graded:
            lo, hi = r["flagged_or_stopped_ci95"]
            blo, bhi = r["saved_below_last_ci95"]
            lines.append(f"| {r['scenario']} | {r['steps']} | {r['measurements']} | {r['traced']} | "
                         f"{r['flagged_or_stopped']}/{r['traced']} [{lo:.2f}, {hi:.2f}] | "
                         f"{r['truth_win_mean']:.3f} / {r['last_truth_win_mean']:.3f} / "
                         f"{r['best_truth_win_mean']:.3f} | "
                         f"{r['saved_below_last']}/{r['traced']} [{blo:.2f}, {bhi:.2f}] | "
                         f"{r['saved_below_best']}/{r['traced']} |")
    compared = [r for r in rows if "against" in r]
    if compared:
        lines += table("The saved policy's held-out ground-truth win rate less that of a policy the run discarded, "
                       "mean over the runs with its standard error and 95% interval (Student's t over the runs; each "
                       "run's policies graded on the same held-out samples): the last policy, the best measured by the "
                       "judge (what the guard saw), the best measured by the truth (chosen on the samples it is graded "
                       "on: optimistic) and the best by the truth held out (chosen on half of the prompts, the even- "
                       "or the odd-numbered, and graded with the saved policy on the other half; the two halves "
                       "averaged: a fair best, though on half the prompts).",
                       ["scenario", "n", *(f"saved - {k}" for k in AGAINST)])
        for r in compared:  # n: runs without halves are left out
            n = r["against"]["last"]["n"]
            lines.append(f"| {r['scenario']} | {n} | " + " | ".join(difference(r["against"].get(k), n)
                                                                   for k in AGAINST) + " |")
    replays = [r for r in rows if "replay" in r]
    if replays:
        lines += table("What the final playoff would have kept at each margin (playoff_margin: the share of the "
                       "guard's choice's measured gain the challenger must beat it by, significantly), replayed on "
                       "these runs' recorded playoffs (the paired gain, its error, the level), graded as above (a run "
                       "without a playoff keeps what it kept). A margin chosen on these runs is graded by them too: this "
                       "table is for choosing one, fresh seeds for its figures.",
                       ["scenario", "margin", "switched / playoffs", "saved below its last",
                        *(f"saved - {k}" for k in AGAINST if k != AGAINST[2])])
        for r in replays:
            for m, x in r["replay"].items():
                lines.append(f"| {r['scenario']} | {m} | {x['switched']}/{x['playoffs']} | {x['below_last']} | "
                             + " | ".join(difference(x["against"].get(k)) for k in AGAINST if k != AGAINST[2]) + " |")
    refalled = [r for r in rows if r.get("refalls")]
    if refalled:
        lines += table("Which confirmed falls would still count at each fall_margin (the share of the peak's measured "
                       "gain a fall must exceed on its fresh prompts, significantly), replayed on the recorded "
                       "confirmations (drop, error, threshold): the seeds kept and let go. A fall let go would have let "
                       "its run go on, which no replay shows: for choosing a margin, fresh seeds for its figures.",
                       ["scenario", "fall_margin", "confirmed falls kept", "let go"])
        for r in refalled:
            for m, x in r["refalls"].items():
                lines.append(f"| {r['scenario']} | {m} | {len(x['kept'])}: {', '.join(map(str, x['kept'])) or '-'} | "
                             f"{len(x['let_go'])}: {', '.join(map(str, x['let_go'])) or '-'} |")
    for r in rows:
        if "stop_delay" in r:
            d = r["stop_delay"]
            lines.append(f"\n{r['scenario']}: the {d['n']} early stop(s) came a median {d['median']:g} iterations "
                         f"after the best measured policy by the truth (from {d['min']} to {d['max']})")
        if "unconfirmed" in r:
            u = r["unconfirmed"]
            lines.append(f"\n{r['scenario']}: {u['falls']} fall(s) in {u['runs']} of {u['n']} runs were not confirmed "
                         f"on fresh prompts (the runs went on)")
    healthy = [r for r in rows if r["scenario"].startswith("healthy")]
    losing = [r for r in rows if not r["scenario"].startswith("healthy")]
    if healthy:
        k, n = sum(r["flagged"] for r in healthy), sum(r["n"] for r in healthy)
        lines.append(f"\nfalse-flag rate (healthy): {k}/{n} = {k / n:.2f}, 95% interval {rate_interval(k, n)}")
    if losing:  # among the seeds whose unguarded run lost, where that was checked
        k = sum(r.get("detected", r["flagged"]) for r in losing)
        n = sum(r["plain_lost"] if "plain_lost" in r else r["n"] for r in losing)
        which = ("runs that lose to SFT unguarded" if all("plain_lost" in r for r in losing) else
                 "every run of the losing scenarios, not rerun unguarded here: --check-losing")
        lines.append(f"\ndetection rate ({which}): {k}/{n} = {k / max(n, 1):.2f}, 95% interval {rate_interval(k, n)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--name", default="flag", help="the record's name: <out>/<date>-<name>.{md,json}")
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--steps", type=int, default=0, help="the online stage's steps (0: tiny.yaml's)")
    ap.add_argument("--check-losing", action="store_true",
                    help="also run each losing scenario without the guard (keep=last, no early stop)")
    ap.add_argument("--merge", nargs="*", default=[], help="earlier records (JSON) whose runs to fold in; a later "
                    "file's run of the same scenario, seed and guard replaces an earlier one's. The record names "
                    "them (merged) and keeps only its own runs: keep the merged records beside it")
    ap.add_argument("--replay-margins", type=float, nargs="*", default=[],
                    help="also report what each playoff_margin would have kept on these runs' recorded playoffs")
    ap.add_argument("--replay-fall-margins", type=float, nargs="*", default=[],
                    help="also report which confirmed falls would still count at each fall_margin")
    a = parse(ap, argv, "flagcal-")
    results = a.results
    tiny = config.load(TINY)

    def steps_of(name: str, r: dict | None = None) -> int:  # a record without its steps ran tiny.yaml's
        return (r.get("steps") if r else a.steps) or getattr(tiny, SCENARIOS[name][0]).steps
    # each finished run, so that an interrupted calibration resumes where it stopped
    progress = Path(results) / "flag-runs.jsonl"
    recorded = [json.loads(x) for x in progress.read_text().splitlines()] if progress.exists() else []
    # a later record's run of the same scenario, length, seed and guard replaces an earlier one's (a rerun)
    merged = [r for f in a.merge for r in record_runs(f)]
    earlier = {(r["scenario"], steps_of(r["scenario"], r), r["seed"], r["plain"]): r for r in merged + recorded}
    done = {(r["scenario"], steps_of(r["scenario"], r), r["seed"], r["plain"]) for r in recorded}
    for r in earlier.values():  # a record from before the halves, the playoff or below_last_at, its run on this machine
        if "trace" in r and Path(r["trace"]).exists() and not {"halves", "playoff", "fall", "below_last_at"} <= r.keys():
            pts = json.loads(Path(r["trace"]).read_text())["points"]
            summary = json.loads((Path(r["trace"]).parent / "summary.json").read_text())
            r.setdefault("halves", halves(pts))
            r.setdefault("playoff", playoff_of(summary, pts))
            r.setdefault("fall", fall_of(summary["metrics"], pts))
            r.setdefault("below_last_at", playoff_below_last(r["playoff"], pts))
    rows, everything = [], []
    for name in a.scenarios:
        steps = steps_of(name)
        for seed in range(a.first_seed, a.first_seed + a.seeds):
            for plain in (False, True) if a.check_losing and not name.startswith("healthy") else (False,):
                if (name, steps, seed, plain) in done:
                    continue
                r = one(name, seed, results, a.steps, plain)
                earlier[(name, steps, seed, plain)] = r
                with progress.open("a") as f:
                    f.write(json.dumps(r) + "\n")
                print(f"{name} seed {seed}{' without the guard' if plain else ''}: flags {len(r['flags'])}, truth "
                      f"win {r['truth_win']:.3f}", file=sys.stderr, flush=True)
        runs = [r for (n, st, _, p), r in earlier.items() if (n, st, p) == (name, steps, False)]
        plain = [r for (n, st, _, p), r in earlier.items() if (n, st, p) == (name, steps, True)]
        if not runs:  # --seeds 0: a scenario no record ran
            continue
        rows.append({**summarize(name, runs, plain), "steps": steps,
                     **({"replay": replay(runs, a.replay_margins)} if a.replay_margins else {}),
                     **({"refalls": refalls(runs, a.replay_fall_margins)} if a.replay_fall_margins else {})})
        everything += runs + plain
    md = markdown(rows, max(r["n"] for r in rows))
    print(md)
    # the runs of merged records stay in those records, which this one names
    ours = {id(r) for r in merged}
    write(a.out, a.name, md, {"rows": rows, "merged": a.merge, "runs": [r for r in everything if id(r) not in ours]})
    return 0


def record_runs(path: str | Path) -> list[dict]:
    """A record's runs: those of the records it merged (its "merged", each with theirs), then its own."""
    rec = json.loads(Path(path).read_text())
    return [r for f in rec.get("merged", []) for r in record_runs(f)] + rec["runs"]


if __name__ == "__main__":
    raise SystemExit(main())
