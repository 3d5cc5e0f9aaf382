"""The over-optimization guard's rules measured on recorded tiny runs: which fall test and which selection rule, by
what each costs. `--collect` runs scenarios of studies/flag_calibration.py (each seed its own SFT, reward model and
judge) with the online stage traced (studies/guard_trace.py: every measured policy graded on the held-out prompts by
the ground truth, kept or discarded), appending each run to <results>/index.jsonl (a rerun skips the runs there);
`--analyze` replays the guard's decisions on those traces with rlhf/maths/guard.py's own Guard and compares the rules.

    OMP_NUM_THREADS=1 .venv/bin/python studies/guard_study.py --collect --results /tmp/guard-study \\
        --scenarios healthy --seeds 20 --steps 300 --unguarded
    OMP_NUM_THREADS=1 .venv/bin/python studies/guard_study.py --analyze --results /tmp/guard-study

Unguarded (--unguarded: overopt_stop=false) runs train to the end whatever the guard says, so that every rule's
stop and choice can be replayed on the same run; the guard's decisions up to its stop are the same as a guarded
run's (the judge forks the training RNG streams), and the policy after the stop's update is measured only in a
guarded run. Writes results/calibration/<date>-guard-study.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlhf.rl import checks  # noqa: E402
from rlhf.maths import guard
from rlhf.maths.guard import Guard  # noqa: E402
from studies.flag_calibration import SCENARIOS  # noqa: E402
from studies.harness import below, mean_and_se, parse, run, traced, truth_win, write  # noqa: E402


def collect(a) -> None:
    index = Path(a.results) / "index.jsonl"
    index.parent.mkdir(parents=True, exist_ok=True)
    lines = index.read_text().splitlines() if index.exists() else []
    done = {(r["scenario"], r["seed"], r["steps"], r["guarded"]) for r in map(json.loads, lines)}
    for name in a.scenarios:
        stage, extra, _ = SCENARIOS[name]
        for seed in range(a.first_seed, a.first_seed + a.seeds):
            key = (name, seed, a.steps, not a.unguarded)
            if key in done:
                continue
            ov = [f"results_dir={a.results}", f"seed={seed}", *extra, *a.set,
                  *([f"{stage}.steps={a.steps}"] if a.steps else [])]
            run(("sft", "rm"), ov)
            path = traced(stage, ov + ([f"{stage}.overopt_stop=false"] if a.unguarded else []))
            with index.open("a") as f:
                f.write(json.dumps({"scenario": name, "seed": seed, "steps": a.steps, "guarded": not a.unguarded,
                                    "set": a.set, "trace": str(path)}) + "\n")
            print(f"{name} seed {seed}: {path}", file=sys.stderr, flush=True)


def replay(trace: dict, z: float | None = None, stop: bool = True) -> Guard:
    """The guard's decisions on a recorded run, by rlhf/maths/guard.py's Guard: its measurements and each iteration's KL
    fed in the run's order, up to the first stop (a fall or a budget exit; none with stop=False); then the final
    policy when the run measured it (a run that trained to the end, or a guarded run that stopped there). `z`: the
    fall test's threshold (default: the run's own). The replay has no fresh prompts to confirm a fall on: every fall
    it sees counts, as the guard's did before its confirmation (2026-11-27); the shipped guard counts fewer."""
    j = Guard(trace["every"], trace["budget"], trace["z"] if z is None else z, keep=True, stop=stop)
    j.reference = trace.get("reference")  # SFT's reference draw (None in traces recorded before it: the first point)
    j.stopped = None
    points = {p["iteration"]: p for p in trace["points"]}
    for step, kl in enumerate(trace["kl_ref"], 1):
        if step in points and not points[step].get("final"):
            j.add(dict(points[step]))
        j.read_kl(step, kl)
        if j.should_stop:
            j.stopped = step
            break
    end = points[max(points)]
    if end.get("final") and (j.stopped is None or end["iteration"] == j.stopped + 1):
        j.add(dict(end))
        j.prune()
    return j


def one_se_rule(j: Guard) -> dict:
    return guard.one_se(j.eligible())


def best_rule(j: Guard) -> dict:
    return max(j.eligible(), key=lambda p: p["gain"])


def last_rule(j: Guard) -> dict:
    return j.eligible()[-1]


def smoothed_rule(j: Guard) -> dict:
    """The middle of the three consecutive eligible measurements with the best mean gain."""
    e = j.eligible()
    if len(e) < 3:
        return best_rule(j)
    i = max(range(1, len(e) - 1), key=lambda k: sum(p["gain"] for p in e[k - 1: k + 2]))
    return e[i]


def remeasured_rule(j: Guard) -> dict:
    """The one-SE rule's candidates (every eligible measurement within one standard error of the best gain)
    measured again on fresh prompts and samples (the trace's judge_fresh): the best of them there."""
    e = j.eligible()
    best = max(e, key=lambda p: p["gain"])
    sft = e[0]["judge_fresh"]
    cands = [p for p in e if p["gain"] >= best["gain"] - best["gain_se"]]
    return max(cands, key=lambda p: sum(p["judge_fresh"]) - sum(sft))


RULES = {"shipped": Guard.select, "one-SE (before)": one_se_rule, "best measured": best_rule, "last": last_rule,
         "smoothed best": smoothed_rule, "re-measured": remeasured_rule}
"""The selection rules compared: name: rule(judge) -> the kept point."""


def judged_below_sft(point: dict, sft: dict) -> bool:
    """The held-out flag: the kept policy's judge win against SFT on the held-out prompts, its interval below 0.5."""
    return checks.win_rate(point["judge_heldout"], sft["judge_heldout"])["ci_high"] < 0.5


def analyze_run(trace: dict) -> dict:
    """One run's figures: per fall test, whether the guard flagged or stopped it; per selection rule (with the
    shipped fall test), the kept policy's held-out ground truth against the last policy's and the best measured."""
    pts, n = trace["points"], len(trace["points"][0]["scores"])
    sft, end = pts[0], pts[-1]
    planned = guard.planned_measurements(trace["steps"], trace["every"])
    out = {"measurements": len(pts), "last_truth_win": truth_win(end, sft), "last_iteration": end["iteration"],
           "falls": {}, "rules": {}}
    for test, z in (("z = 3", 3.0), ("shipped", guard.fall_z(planned, 0.05, n))):
        j = replay(trace, z)
        kept = j.select()  # the flag's held-out check is the saved policy's: the shipped rule's choice
        out["falls"][test] = {"z": z, "fell": bool(j.fell), "left": bool(j.left), "stopped": j.stopped,
                              "flagged": bool(j.fell or j.left or judged_below_sft(kept, sft))}
    j = replay(trace, guard.fall_z(planned, 0.05, n))
    oracle = max(j.eligible(), key=lambda p: truth_win(p, sft))
    for name, rule in RULES.items():
        k = rule(j)
        out["rules"][name] = {"iteration": k["iteration"], "truth_win": truth_win(k, sft),
                              "minus_last": truth_win(k, sft) - truth_win(end, sft),
                              "below_last": below(k, end), "below_best": below(k, oracle),
                              "below_sft": checks.win_rate(k["truth_heldout"], sft["truth_heldout"])["ci_high"] < 0.5,
                              "flag_heldout": judged_below_sft(k, sft)}
    out["best_truth_win"] = truth_win(oracle, sft)
    return out


RUNS = {True: "guarded", False: "unguarded"}
"""How the recorded runs ran: as shipped (a guarded run ends at its stop: the last policy is the one after it), or
with overopt_stop=false (the last policy is the one after all steps)."""


def analyze(a) -> dict:
    sources = [Path(a.results) / "index.jsonl", *map(Path, a.runs)]
    index = [json.loads(x) for f in sources if f.exists() for x in f.read_text().splitlines()]
    if not index:
        raise SystemExit(f"guard_study --analyze: no traced runs in {', '.join(map(str, sources))}; name the --results "
                         f"folder a --collect wrote (or --runs, e.g. flag_calibration.py's <results>/flag-runs.jsonl)")
    runs = []
    for r in index:
        trace = json.loads(Path(r["trace"]).read_text())
        runs.append({"scenario": r["scenario"], "seed": r["seed"], "steps": trace["steps"],
                     "guarded": r.get("guarded", not r.get("plain")), **analyze_run(trace)})
    groups = {}
    for r in runs:
        groups.setdefault((r["scenario"], r["steps"], r["guarded"]), []).append(r)
    md = ["Fall tests replayed on recorded runs (studies/guard_study.py --analyze): runs flagged (a fall, a budget "
          "exit, or the saved policy's held-out judge win below 0.5) and stopped, with Wilson's 95% interval; for "
          "the losing scenarios run unguarded, among the seeds whose last policy lost to SFT by the ground truth.", "",
          "| scenario | steps | runs | measurements | n | last lost to SFT | flagged, z = 3 | flagged, shipped | "
          "stopped, shipped |", "|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for (name, steps, guarded), rs in groups.items():
        healthy = name.startswith("healthy")
        lost = [r for r in rs if r["last_truth_win"] < 0.5]
        base = lost if not (healthy or guarded) else rs  # an unguarded run shows whether its scenario lost
        row = {"scenario": name, "steps": steps, "guarded": guarded, "n": len(rs), "lost": len(lost)}
        for test in ("z = 3", "shipped"):
            k = sum(r["falls"][test]["flagged"] for r in base)
            row[f"flagged {test}"] = {"k": k, "n": len(base), "ci95": guard.wilson(k, len(base))}
        k = sum(r["falls"]["shipped"]["stopped"] is not None for r in base)
        row["stopped shipped"] = {"k": k, "n": len(base), "ci95": guard.wilson(k, len(base))}
        rows.append(row)

        def fmt(x):
            return f"{x['k']}/{x['n']} [{x['ci95'][0]:.2f}, {x['ci95'][1]:.2f}]"
        md.append(f"| {name} | {steps} | {RUNS[guarded]} | {rs[0]['measurements']} | {len(rs)} | {len(lost)} | "
                  f"{fmt(row['flagged z = 3'])} | {fmt(row['flagged shipped'])} | {fmt(row['stopped shipped'])} |")
    md += ["", "Selection rules (the shipped fall test), graded by the held-out ground truth: the kept policy's win "
           "rate against SFT (mean over runs), its difference from the last policy's (mean ± standard error over "
           "runs), and the runs whose kept policy is significantly below the last one / the best measured one (by "
           "the ground truth on the same held-out samples, so the latter is optimistic) / SFT.", "",
           "| scenario | steps | runs | n | rule | truth win | minus last | below last | below best | below SFT |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for (name, steps, guarded), rs in groups.items():
        for rule in RULES:
            xs = [r["rules"][rule] for r in rs]
            m, se = mean_and_se([x["minus_last"] for x in xs], 0.0)
            md.append(f"| {name} | {steps} | {RUNS[guarded]} | {len(rs)} | {rule} | "
                      f"{mean_and_se([x['truth_win'] for x in xs])[0]:.3f} "
                      f"| {m:+.3f} ± {se:.3f} | {sum(x['below_last'] for x in xs)} | "
                      f"{sum(x['below_best'] for x in xs)} | {sum(x['below_sft'] for x in xs)} |")
    text = "\n".join(md) + "\n"
    print(text)
    write(a.out, "guard-study", text, {"rows": rows, "runs": runs})
    return {"rows": rows, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--collect", action="store_true")
    ap.add_argument("--analyze", action="store_true")
    ap.add_argument("--scenarios", nargs="+", default=["healthy"], choices=list(SCENARIOS))
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=0, help="the online stage's steps (0: tiny.yaml's)")
    ap.add_argument("--unguarded", action="store_true", help="overopt_stop=false: every run trains to the end")
    ap.add_argument("--set", nargs="*", default=[], help="more overrides for every stage")
    ap.add_argument("--runs", nargs="*", default=[], help="--analyze: more traced runs, e.g. flag_calibration.py's "
                    "<results>/flag-runs.jsonl")
    a = parse(ap, argv, "guard-study-")
    if a.collect:
        collect(a)
    if a.analyze:
        analyze(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
