"""What the judge's share of the preference pairs costs the reward model, on the tiny task: for each seed, SFT and the
reward model with data.judge_fraction at each share (0: no judge, every pair trains the RM), each as
`python -m rlhf <stage>` types it; prints the RM's and the judge's held-out accuracy (200 pairs) per share, their
means over seeds and the mean paired difference from share 0 with its standard error.

    OMP_NUM_THREADS=1 .venv/bin/python studies/judge_share.py --seeds 5 --shares 0 0.2
    OMP_NUM_THREADS=1 .venv/bin/python studies/judge_share.py --pairs 500 --shares 0 0.2 0.5

Writes results/calibration/<date>-judge-share.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlhf.experiment import config  # noqa: E402
from rlhf.runs import records
from studies.harness import TINY, paired, parse, run, write  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.2])
    ap.add_argument("--pairs", type=int, default=0, help="data.pref_pairs (0: tiny.yaml's)")
    a = parse(ap, argv, "judge-share-")
    results = a.results
    acc: dict[float, list[float]] = {s: [] for s in a.shares}
    judge: dict[float, list[float]] = {s: [] for s in a.shares}
    for seed in range(1, a.seeds + 1):
        for share in a.shares:
            ov = [f"results_dir={results}", f"seed={seed}", f"data.judge_fraction={share:g}",
                  *([f"data.pref_pairs={a.pairs}"] if a.pairs else [])]
            run(("sft", "rm"), ov)
            m = records.latest(config.load(TINY, ov), "rm", "judge_share")[1]["metrics"]
            acc[share].append(m["eval_accuracy"])
            judge[share].append(m.get("eval_judge_accuracy"))
            print(f"seed {seed} share {share:g}: RM {m['eval_accuracy']:.3f} judge {m.get('eval_judge_accuracy')}",
                  file=sys.stderr, flush=True)
    base = a.shares[0]
    lines = [f"Reward model held-out accuracy (200 pairs) by the judge's share of data.pref_pairs"
             f"{f'={a.pairs}' if a.pairs else ''}, {a.seeds} seeds (studies/judge_share.py)", "",
             "| judge share | RM accuracy (mean) | judge accuracy (mean) | RM accuracy minus share "
             f"{base:g}'s, paired by seed (mean +/- se) |", "|---|---|---|---|"]
    rows = []
    for share in a.shares:
        d = paired(acc[share], acc[base])
        js = [j for j in judge[share] if j is not None]
        rows.append({"share": share, "rm_accuracy": acc[share], "judge_accuracy": judge[share], "vs_base": d})
        lines.append(f"| {share:g} | {sum(acc[share]) / len(acc[share]):.3f} | "
                     f"{f'{sum(js) / len(js):.3f}' if js else '-'} | {d['mean']:+.3f} +/- {d['se']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    write(a.out, "judge-share", text, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
