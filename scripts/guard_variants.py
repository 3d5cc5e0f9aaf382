"""The shipped online-RL defaults on ground-truth task variants they were not tuned on: for each variant, SFT and the
reward model as tiny.yaml ships them, then PPO, GRPO and RLOO with tiny.yaml's sections and no extra flags (the guard
on: keep=auto, overopt_stop), each as `python -m rlhf <stage>` types it. Prints, per run, the saved policy's
ground-truth win rate against SFT on the 200 held-out prompts with its 95% interval, the kept iteration, KL, flags.

Variants: a user's own local base with a byte-level BPE tokenizer and tied embeddings, 24-token responses (the
bench's bpe shape); tiny with tied embeddings; a reward model of about 70% held-out accuracy (100 pairs); less data.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/guard_variants.py [--variants tied rm70] [--stages ppo]

Writes results/calibration/<date>-variants.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.shapes import BPE_BASE, LONG, build_bpe_base  # noqa: E402
from rlhf import config, records  # noqa: E402
from scripts.studies import TINY, parse, run, write  # noqa: E402

VARIANTS = {
    "bpe": ("a local base: byte-level BPE vocabulary of 600, tied embeddings, hidden 128 x 4 layers; 24-token "
            "responses", LONG),
    "tied": ("tiny with tied input and output embeddings", ["model.tie_embeddings=true"]),
    "rm70": ("a reward model on 100 pairs (the judge on 400)", ["data.pref_pairs=500", "data.judge_fraction=0.8"]),
    "small": ("a quarter of the data: 500 SFT examples, 500 pairs, 500 prompts",
              ["data.sft_examples=500", "data.pref_pairs=500", "data.ppo_prompts=500"]),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--stages", nargs="+", default=["ppo", "grpo", "rloo"], choices=["ppo", "grpo", "rloo"])
    a = parse(ap, argv, "variants-")
    results = Path(a.results)
    rows, md = [], []
    for v in a.variants:
        what, ov = VARIANTS[v]
        ov = [f"results_dir={results / v}", *ov]
        if v == "bpe":
            base = build_bpe_base(config.load(TINY, ov), BPE_BASE, results / "bpe-base")
            ov.append(f"model.name={base}")
        for stage in a.stages:
            run(("sft", "rm", stage), ov)
            exp = config.load(TINY, ov)
            rm = records.latest(exp, "rm", "variants")[1]["metrics"]
            s = records.latest(exp, stage, "variants")[1]
            m = s["metrics"]
            gt = m["eval_win_rates"]["ground_truth"]
            kept = (s["model"].get("kept") or {}).get("iteration")
            rows.append({"variant": v, "stage": stage, "rm_accuracy": rm["eval_accuracy"],
                         "judge_accuracy": rm.get("eval_judge_accuracy"), "truth_win": gt["win_rate"],
                         "truth_ci95": gt["ci95"], "kept": kept, "eval_kl_ref": m["eval_kl_ref"],
                         "stopped_early": m.get("stopped_early"), "flags": s["flags"]})
            md.append(f"| {v} | {stage} | {rm['eval_accuracy']:.2f} | {gt['win_rate']:.3f} [{gt['ci95'][0]:.3f}, "
                      f"{gt['ci95'][1]:.3f}] | {kept or 'last'} | {m['eval_kl_ref']:.2f} | "
                      f"{'yes' if s['flags'] else 'no'} |")
            print(md[-1], file=sys.stderr, flush=True)
    text = ("The shipped tiny.yaml sections, no extra flags, on task variants (scripts/guard_variants.py); the saved "
            "policy's ground-truth win rate against SFT on 200 held-out prompts\n\n"
            + "\n".join(f"- {k}: {VARIANTS[k][0]}" for k in a.variants)
            + "\n\n| variant | stage | RM accuracy | truth win [95%] | kept iteration | held-out KL | flagged |\n"
              "|---|---|---|---|---|---|---|\n" + "\n".join(md) + "\n")
    print(text)
    write(a.out, "variants", text, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
