"""How the ground truth moves with the KL spent, for reward models of different accuracy, on the tiny task (whose
ground truth no stage sees; Gao et al.'s curves): PPO with fixed betas and with the adaptive controller's targets,
unguarded (keep=last, no early stop, a KL band wide enough never to bind) so each run shows where its setting leads.
One `python -m rlhf` per stage; SFT is trained once, each reward model once, then reused. Prints the markdown table of
docs/algorithms.md and writes it with the runs' figures to results/calibration/<date>-kl.{md,json}.

    OMP_NUM_THREADS=1 .venv/bin/python studies/overopt_kl.py                               # 3 RMs x 6 settings
    OMP_NUM_THREADS=1 .venv/bin/python studies/overopt_kl.py --rms 150 --betas 0.05 --targets
    OMP_NUM_THREADS=1 .venv/bin/python studies/overopt_kl.py --seeds 3 --betas 0.2 0.05 0.02 --targets 4 --shipped
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlhf.experiment import config  # noqa: E402
from rlhf.runs import records
from studies.harness import TINY, mean_and_se, parse, run, write  # noqa: E402

RMS = {60: ["data.pref_pairs=500", "data.judge_fraction=0.88"], 150: ["data.pref_pairs=500", "data.judge_fraction=0.7"],
       1600: []}
"""The reward model's training pairs: the overrides that give it that many (the judge takes the rest)."""


def summarize(rows: list[dict]) -> str:
    """The markdown table: per RM and setting, the mean over seeds of each figure, the ground truth's with its
    standard error over seeds (one seed: its own interval over the 200 prompts)."""
    md = []
    for key in dict.fromkeys((r["rm_pairs"], r["setting"]) for r in rows):
        rs = [r for r in rows if (r["rm_pairs"], r["setting"]) == key]
        n = len(rs)

        def mean(k):
            return sum(r[k] for r in rs) / n
        truth = [r["truth_win"] for r in rs]
        if n > 1:  # the mean and its standard error over seeds
            spread = f"± {mean_and_se(truth)[1]:.2f} ({', '.join(f'{t:.2f}' for t in truth)})"
        else:
            spread = f"[{rs[0]['truth_ci95'][0]:.2f}, {rs[0]['truth_ci95'][1]:.2f}]"
        md.append(f"| {key[0]} ({mean('rm_accuracy'):.2f}) | {key[1]} | {n} | {mean('eval_kl_ref'):.1f} | "
                  f"{mean('rm_win'):.2f} | {mean('judge_win'):.2f} | {mean('truth_win'):.2f} {spread} |")
    return ("PPO on tiny.yaml, 60 iterations; unguarded settings train to the end and keep the last policy, `shipped` "
            "is tiny.yaml's PPO as it ships (beta 0.05, the judge's guard: keep=auto, early stop, KL budget 6); win "
            "rates against SFT on 200 held-out prompts, means over seeds, the ground truth's ± its standard error "
            "over seeds with each seed's value (one seed: its 95% interval over the prompts) "
            "(studies/overopt_kl.py)\n\n| RM pairs (held-out accuracy) | KL setting | seeds | held-out KL | RM win | "
            "judge win | ground-truth win |\n|---|---|---|---|---|---|---|\n" + "\n".join(md) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rms", type=int, nargs="+", default=list(RMS), choices=list(RMS))
    ap.add_argument("--betas", type=float, nargs="*", default=[0.2, 0.05, 0.02, 0.005])
    ap.add_argument("--targets", type=float, nargs="*", default=[2.0, 4.0],
                    help="adaptive controller targets (kl_coef 0.05, kl_horizon 1000)")
    ap.add_argument("--shipped", action="store_true", help="also tiny.yaml's PPO as shipped (guarded)")
    ap.add_argument("--seeds", type=int, default=1, help="seeds 1..N of every run (SFT, RM and PPO)")
    a = parse(ap, argv, "overopt-kl-")
    results = a.results
    unguarded = ["ppo.keep=last", "ppo.overopt_stop=false", "ppo.kl_band=[0, 1000]"]
    settings = [(f"beta {b:g}", [*unguarded, f"ppo.kl_coef={b:g}"]) for b in a.betas] + [
        (f"adaptive, target {t:g}", [*unguarded, "ppo.adaptive_kl=true", f"ppo.target_kl={t:g}",
                                     "ppo.kl_horizon=1000"]) for t in a.targets] + (
        [("shipped (beta 0.05, guarded)", [])] if a.shipped else [])
    rows = []
    for pairs in a.rms:
        for name, ov in settings:
            for seed in range(1, a.seeds + 1):
                args = [f"results_dir={results}", f"seed={seed}", *RMS[pairs], *ov]
                run(("sft", "rm", "ppo"), args)
                exp = config.load(TINY, args)
                rm = records.latest(exp, "rm", "overopt_kl")[1]["metrics"]
                m = records.latest(exp, "ppo", "overopt_kl")[1]["metrics"]
                w = m["eval_win_rates"]
                gt = w["ground_truth"]
                rows.append({"rm_pairs": pairs, "seed": seed, "rm_accuracy": rm["eval_accuracy"], "judge_accuracy":
                             rm.get("eval_judge_accuracy"), "setting": name, "eval_kl_ref": m["eval_kl_ref"],
                             "rm_win": w["reward_model"]["win_rate"], "judge_win": w["judge"]["win_rate"],
                             "truth_win": gt["win_rate"], "truth_ci95": gt["ci95"]})
                print(f"{pairs} {name} seed {seed}: KL {m['eval_kl_ref']:.1f}, truth {gt['win_rate']:.3f}",
                      file=sys.stderr, flush=True)
    text = summarize(rows)
    print(text)
    write(a.out, "kl", text, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
