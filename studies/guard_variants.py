"""The shipped online-RL defaults on ground-truth task variants they were not tuned on: for each variant, SFT and the
reward model as tiny.yaml ships them, then PPO, GRPO and RLOO with tiny.yaml's sections and no extra flags (the guard
on: keep=auto, overopt_stop), each as `python -m rlhf <stage>` types it. Prints, per run, the saved policy's
ground-truth win rate against SFT on the 200 held-out prompts with its 95% interval, the kept iteration, KL, flags.

Variants: a user's own local base with a byte-level BPE tokenizer and tied embeddings, 24-token responses (the
bench's bpe shape); tiny with tied embeddings; a reward model of about 70% held-out accuracy (100 pairs); less data.

Each online run is traced (studies/guard_trace.py): every policy the judge measured is graded on the held-out prompts
by the ground truth, so each run also reports its last policy's win rate (the policy after the last update) and the
kept policy's paired difference from it; with --seeds, the means over seeds with their standard errors (what the
guard's choice costs or saves against keeping the last policy).

    OMP_NUM_THREADS=1 .venv/bin/python studies/guard_variants.py [--variants tied rm70] [--stages ppo]
    OMP_NUM_THREADS=1 .venv/bin/python studies/guard_variants.py --variants bpe --stages ppo --seeds 10 --steps 128

Writes results/calibration/<date>-variants.{md,json}; each finished run is also appended to
<results>/variant-runs.jsonl, and a rerun with the same --results skips those.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.shapes import BPE_BASE, LONG, build_bpe_base  # noqa: E402
from rlhf.experiment import config  # noqa: E402
from rlhf.maths import guard
from rlhf.runs import records
from studies.harness import TINY, parse, run, traced, truth_win, write  # noqa: E402

VARIANTS = {
    "bpe": ("a local base: byte-level BPE vocabulary of 600, tied embeddings, hidden 128 x 4 layers; 24-token "
            "responses", LONG),
    "tied": ("tiny with tied input and output embeddings", ["model.tie_embeddings=true"]),
    "rm70": ("a reward model on 100 pairs (the judge on 400)", ["data.pref_pairs=500", "data.judge_fraction=0.8"]),
    "small": ("a quarter of the data: 500 SFT examples, 500 pairs, 500 prompts",
              ["data.sft_examples=500", "data.pref_pairs=500", "data.ppo_prompts=500"]),
}


def graded(v: str, stage: str, seed: int, steps: int, args: list[str], path: Path) -> dict:
    """One traced run's figures: the saved policy's held-out ground-truth win against SFT (the stage's own check),
    the last policy's, and the paired per-prompt difference of their ground-truth scores."""
    rm = records.latest(config.load(TINY, args), "rm", "variants")[1]["metrics"]
    s = json.loads((path.parent / "summary.json").read_text())
    pts = json.loads(path.read_text())["points"]
    m = s["metrics"]
    gt = m["eval_win_rates"]["ground_truth"]
    kept = (s["model"].get("kept") or {}).get("iteration")
    saved, last = (next(p for p in pts if p["iteration"] == kept) if kept else pts[-1]), pts[-1]
    d = guard.paired(saved["truth_heldout"], last["truth_heldout"])
    return {"variant": v, "stage": stage, "seed": seed, "steps": steps, "rm_accuracy": rm["eval_accuracy"],
            "judge_accuracy": rm.get("eval_judge_accuracy"), "truth_win": gt["win_rate"], "truth_ci95": gt["ci95"],
            "kept": kept, "rule": (s["model"].get("kept") or {}).get("rule"), "last_iteration": last["iteration"],
            "last_truth_win": truth_win(last, pts[0]), "kept_minus_last": d["mean"], "kept_minus_last_se": d["se"],
            "eval_kl_ref": m["eval_kl_ref"], "stopped_early": m.get("stopped_early"), "flags": s["flags"]}


def line(r: dict) -> str:
    return (f"| {r['variant']} | {r['stage']} | {r['seed']} | {r['rm_accuracy']:.2f} | {r['truth_win']:.3f} "
            f"[{r['truth_ci95'][0]:.3f}, {r['truth_ci95'][1]:.3f}] | {r['kept'] or 'last'} | {r['last_truth_win']:.3f} "
            f"| {r['kept_minus_last']:+.4f} ± {r['kept_minus_last_se']:.4f} | {r['eval_kl_ref']:.2f} | "
            f"{'yes' if r['flags'] else 'no'} |")


def means(rows: list[dict]) -> list[dict]:
    """Per variant and stage, over seeds: the saved and the last policy's mean ground-truth win, and the mean of the
    saved-minus-last differences (win rates; per-prompt scores) with their standard errors over seeds."""
    out = []
    for key in dict.fromkeys((r["variant"], r["stage"]) for r in rows):
        rs = [r for r in rows if (r["variant"], r["stage"]) == key]
        n, zeros = len(rs), [0.0] * len(rs)
        win = guard.paired([r["truth_win"] for r in rs], [r["last_truth_win"] for r in rs])
        score = guard.paired([r["kept_minus_last"] for r in rs], zeros)
        out.append({"variant": key[0], "stage": key[1], "seeds": n,
                    "truth_win": sum(r["truth_win"] for r in rs) / n,
                    "last_truth_win": sum(r["last_truth_win"] for r in rs) / n,
                    "win_minus_last": win["mean"], "win_minus_last_se": win["se"],
                    "score_minus_last": score["mean"], "score_minus_last_se": score["se"],
                    "kept_last": sum(r["kept"] == r["last_iteration"] for r in rs)})
    return out


def markdown(rows: list[dict], a) -> str:
    text = ("The shipped tiny.yaml sections, no extra flags, on task variants (studies/guard_variants.py"
            + (f" --seeds {a.seeds}" if a.seeds > 1 else "") + (f" --steps {a.steps}" if a.steps else "")
            + "); the saved policy's ground-truth win rate against SFT on 200 held-out prompts, the last policy's "
              "(after the last update), and the paired difference of their ground-truth scores per prompt\n\n"
            + "\n".join(f"- {k}: {VARIANTS[k][0]}" for k in a.variants)
            + "\n\n| variant | stage | seed | RM accuracy | truth win [95%] | kept iteration | last policy's truth win "
              "| saved minus last (score) | held-out KL | flagged |\n|---|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(line(r) for r in rows) + "\n")
    ms = means(rows)
    if any(m["seeds"] > 1 for m in ms):
        text += ("\nMeans over seeds (± standard error over seeds): the saved policy's ground-truth win against the "
                 "last one's, and their difference\n\n| variant | stage | seeds | saved: truth win | last: truth win | "
                 "saved minus last: win rate | saved minus last: score | kept the last |\n"
                 "|---|---|---|---|---|---|---|---|\n"
                 + "\n".join(f"| {m['variant']} | {m['stage']} | {m['seeds']} | {m['truth_win']:.3f} | "
                             f"{m['last_truth_win']:.3f} | "
                             f"{m['win_minus_last']:+.4f} ± {m['win_minus_last_se']:.4f} | "
                             f"{m['score_minus_last']:+.4f} ± {m['score_minus_last_se']:.4f} | "
                             f"{m['kept_last']}/{m['seeds']} |" for m in ms) + "\n")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--stages", nargs="+", default=["ppo", "grpo", "rloo"], choices=["ppo", "grpo", "rloo"])
    ap.add_argument("--seeds", type=int, default=1, help="seeds 1..N of every run (SFT, RM and the stage)")
    ap.add_argument("--steps", type=int, default=0, help="the online stages' steps (0: tiny.yaml's)")
    a = parse(ap, argv, "variants-")
    results = Path(a.results)
    progress = results / "variant-runs.jsonl"  # each finished run: an interrupted study resumes after it
    rows = [json.loads(x) for x in progress.read_text().splitlines()] if progress.exists() else []
    for v in a.variants:
        what, ov = VARIANTS[v]
        ov = [f"results_dir={results / v}", *ov]
        if v == "bpe":
            base = build_bpe_base(config.load(TINY, ov), BPE_BASE, results / "bpe-base")
            ov.append(f"model.name={base}")
        for stage in a.stages:
            for seed in range(1, a.seeds + 1):
                if any((r["variant"], r["stage"], r["seed"], r["steps"]) == (v, stage, seed, a.steps) for r in rows):
                    continue
                args = [*ov, f"seed={seed}", *([f"{stage}.steps={a.steps}"] if a.steps else [])]
                run(("sft", "rm"), args)
                path = traced(stage, args)
                rows.append(graded(v, stage, seed, a.steps, args, path))
                with progress.open("a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
                print(line(rows[-1]), file=sys.stderr, flush=True)
    done = [r for r in rows if r["variant"] in a.variants and r["stage"] in a.stages and r["steps"] == a.steps]
    text = markdown(done, a)
    print(text)
    write(a.out, "variants", text, {"rows": done, "means": means(done)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
