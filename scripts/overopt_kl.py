"""How the ground truth moves with the KL spent, for reward models of different accuracy, on the tiny task (whose
ground truth no stage sees; Gao et al.'s curves): PPO with fixed betas and with the adaptive controller's targets,
unguarded (keep=last, no early stop, a KL band wide enough never to bind) so each run shows where its setting leads.
One `python -m rlhf` per stage; SFT is trained once, each reward model once, then reused. Prints the markdown table of
docs/algorithms.md and writes it with the runs' figures to results/calibration/<date>-kl.{md,json}.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/overopt_kl.py                               # 3 RMs x 6 settings
    OMP_NUM_THREADS=1 .venv/bin/python scripts/overopt_kl.py --rms 150 --betas 0.05 --targets
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlhf import config, records  # noqa: E402
from scripts.studies import OUT, TINY, run, write  # noqa: E402

RMS = {60: ["data.pref_pairs=500", "data.judge_fraction=0.88"], 150: ["data.pref_pairs=500", "data.judge_fraction=0.7"],
       1600: []}
"""The reward model's training pairs: the overrides that give it that many (the judge takes the rest)."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rms", type=int, nargs="+", default=list(RMS), choices=list(RMS))
    ap.add_argument("--betas", type=float, nargs="*", default=[0.2, 0.05, 0.02, 0.005])
    ap.add_argument("--targets", type=float, nargs="*", default=[2.0, 4.0],
                    help="adaptive controller targets (kl_coef 0.05, kl_horizon 1000)")
    ap.add_argument("--results", default=None)
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory(prefix="overopt-kl-") if a.results is None else None
    results = a.results or tmp.name
    unguarded = ["ppo.keep=last", "ppo.overopt_stop=false", "ppo.kl_band=[0, 1000]"]
    settings = [(f"beta {b:g}", [f"ppo.kl_coef={b:g}"]) for b in a.betas] + [
        (f"adaptive, target {t:g}", ["ppo.adaptive_kl=true", f"ppo.target_kl={t:g}", "ppo.kl_horizon=1000"])
        for t in a.targets]
    rows, md = [], []
    for pairs in a.rms:
        for name, ov in settings:
            args = [f"results_dir={results}", *RMS[pairs], *unguarded, *ov]
            run(("sft", "rm", "ppo"), args)
            exp = config.load(TINY, args)
            rm = records.latest(exp, "rm", "overopt_kl")[1]["metrics"]
            m = records.latest(exp, "ppo", "overopt_kl")[1]["metrics"]
            w = m["eval_win_rates"]
            gt = w["ground_truth"]
            rows.append({"rm_pairs": pairs, "rm_accuracy": rm["eval_accuracy"], "judge_accuracy":
                         rm.get("eval_judge_accuracy"), "setting": name, "eval_kl_ref": m["eval_kl_ref"],
                         "rm_win": w["reward_model"]["win_rate"], "judge_win": w["judge"]["win_rate"],
                         "truth_win": gt["win_rate"], "truth_ci95": gt["ci95"]})
            r = rows[-1]
            md.append(f"| {pairs} ({r['rm_accuracy']:.2f}) | {name} | {r['eval_kl_ref']:.1f} | {r['rm_win']:.2f} | "
                      f"{r['judge_win']:.2f} | {r['truth_win']:.2f} [{gt['ci95'][0]:.2f}, {gt['ci95'][1]:.2f}] |")
            print(md[-1], file=sys.stderr, flush=True)
    text = ("PPO on tiny.yaml, 60 iterations, unguarded (keep=last); win rates against SFT on 200 held-out prompts "
            "(scripts/overopt_kl.py)\n\n| RM pairs (held-out accuracy) | KL setting | held-out KL | RM win | judge win | "
            "ground-truth win [95%] |\n|---|---|---|---|---|---|\n" + "\n".join(md) + "\n")
    print(text)
    write(a.out, "kl", text, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
