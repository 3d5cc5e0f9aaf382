"""Reward over-optimization against the KL target, on the tiny task (whose ground truth no stage sees): PPO at each
target with a reward model trained on `--pairs` pairs (the judge on the rest of data.pref_pairs=500), one `make ppo`
per target (SFT and the reward model trained once, then reused); prints the markdown table of docs/algorithms.md.

    .venv/bin/python scripts/overopt_kl.py --pairs 150 --targets 2 4 6 10 [--results /tmp/overopt]
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from rlhf import config, records

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=150, help="the reward model's pairs (of 500; the judge gets the rest)")
    ap.add_argument("--targets", type=float, nargs="+", default=[2.0, 4.0, 6.0, 10.0])
    ap.add_argument("--results", default="/tmp/overopt")
    a = ap.parse_args()
    common = ["data.pref_pairs=500", f"data.judge_fraction={1 - a.pairs / 500:g}"]
    rows = []
    for target in a.targets:
        args = [f"results_dir={a.results}", *common, f"ppo.target_kl={target:g}", "'ppo.kl_band=[0, 100]'"]
        subprocess.run(["make", "ppo", f"ARGS={' '.join(args)}"], cwd=ROOT, check=True, capture_output=True)
        exp = config.load(ROOT / "experiments" / "tiny.yaml", [f"results_dir={a.results}", *common])
        rm = records.latest(exp, "rm", "overopt_kl")[1]["metrics"]
        s = records.latest(exp, "ppo", "overopt_kl")[1]
        m, w = s["metrics"], s["metrics"]["eval_win_rates"]
        rows.append(f"| {target:g} | {m['eval_kl_ref']:.1f} | {w['reward_model']['win_rate']:.2f} | "
                    f"{w['judge']['win_rate']:.2f} | {w['ground_truth']['win_rate']:.2f} | "
                    f"{'yes' if s['flags'] else 'no'} |")
    print(f"RM on {a.pairs} pairs (held-out accuracy {rm['eval_accuracy']:.2f}), judge on {500 - a.pairs} "
          f"({rm['eval_judge_accuracy']:.2f}); win rates against SFT on 200 held-out prompts\n")
    print("| target_kl | held-out KL | RM win | judge win | ground-truth win | flagged |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
