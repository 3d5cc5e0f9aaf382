"""TRL 1.16 GRPO recipes written as the grpo section, on the tiny task over seeds: each seed trains SFT and the reward
model (experiments/tiny.yaml as shipped), then GRPO once per recipe, each with its TRL keyword set as overrides
(DAPO: loss_type dapo, clip-higher, truncated responses masked, no KL; GSPO: the sequence-level ratio with GSPO's
clip range, no KL). Reported per seed and over seeds: each run's ground-truth win rate against SFT on the held-out
prompts with its 95% interval (the stage's own held-out check), its exact KL to SFT and its EOS fraction.

    OMP_NUM_THREADS=1 .venv/bin/python studies/trl_recipes.py --seeds 0 1

Writes results/calibration/<date>-trl-recipes.{md,json}."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.shapes import RECIPES as TRL_RECIPES  # noqa: E402
from studies.harness import mean_se, parse, run, write  # noqa: E402

RECIPES = {name: [f"grpo.{k}={json.dumps(v)}" for k, v in keys.items()] for name, keys in TRL_RECIPES.items()}
"""Each recipe's GRPOConfig keywords (bench/shapes.py, the ones make bench gives TRL's GRPOTrainer) as overrides."""


def latest(results: Path, stage: str) -> dict:
    root = results / "tiny" / stage
    return json.loads((root / (root / "latest").read_text().strip() / "summary.json").read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    a = parse(ap, argv, "trl-recipes-")
    rows = []
    for seed in a.seeds:
        results = Path(a.results) / f"seed-{seed}"
        common = [f"seed={seed}", f"results_dir={results}"]
        run(("sft", "rm"), common)
        row = {"seed": seed}
        for name, keys in RECIPES.items():
            run(("grpo",), [*common, *keys])
            m = latest(results, "grpo")["metrics"]
            row[name] = {"win_rate": m["eval_win_rate_vs_sft"], "ci95": m["eval_win_rate_vs_sft_ci95"],
                         "n": m["eval_prompts"], "kl_ref": m["eval_kl_ref"], "terminated": m["eval_terminated"]}
            print(seed, name, row[name], file=sys.stderr, flush=True)
        rows.append(row)
    lines = ["| seed | " + " | ".join(f"{n}: win vs SFT [95%] / KL / ended" for n in RECIPES) + " |",
             "|---|" + "---|" * len(RECIPES)]
    for row in rows:
        cells = [f"{r['win_rate']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] / {r['kl_ref']:.2f} / "
                 f"{r['terminated']:.3f}" for r in (row[n] for n in RECIPES)]
        lines.append(f"| {row['seed']} | " + " | ".join(cells) + " |")
    lines.append("| mean ± se | " + " | ".join(mean_se([row[n]["win_rate"] for row in rows]) for n in RECIPES) + " |")
    md = "\n".join(lines) + "\n"
    print(md)
    write(a.out, "trl-recipes", md, {"recipes": RECIPES, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
