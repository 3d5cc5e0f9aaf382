"""Does an online stage need the importance-sampling correction for the sampler's gap? (issues 49, 58)

The merged sampler draws from q, not from the policy pi_old whose log-probs the update's ratio uses; on a GPU, in
bf16, the mean |log q - log pi_old| per token was 0.086-0.091 at the 7B shapes (results/gpu/2026-11-26-H200-decode),
0.22 through an int8 copy. On a CPU in float32 the gap is 1e-6, so this study makes one: each decode step's logits
get independent Gaussian noise of standard deviation `sigma` before the sampler draws (and records log q), which
gives a mean gap of about 0.55 sigma. PPO, GRPO and RLOO on the tiny task, as shipped but graded on their last
policy (keep=last, no early stop), over seeds, interleaved: no noise; sigma = 0.13 (about the bf16 gap) and 0.52
(four times it, past the int8 copy's), each with the correction off and on (sampler_is_correction, its shipped mode
and bounds: TRL's truncated importance sampling). Reported: what each learns (the ground truth's gain over SFT on
the held-out prompts, which are sampled without noise), paired by seed against the clean run, the gap each run
logged (rollout/logprob_gap_mean) and the spread of the ratio pi_old / q the correction weighs by
(rollout/sampler_ratio_std), and the KL to SFT.

    OMP_NUM_THREADS=1 .venv/bin/python studies/sampler_gap.py --seeds 4

Writes results/bench/<date>-sampler-gap.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from studies.harness import ROOT, mean_se, parse, run, write  # noqa: E402

import torch  # noqa: E402

from rlhf.experiment import config  # noqa: E402
from rlhf.experiment import stages as registry  # noqa: E402
from rlhf.recipes import grpo, ppo  # noqa: E402
from rlhf.rl import generation, sampler  # noqa: E402

NOISE = {"sigma": 0.0, "on": False}
"""The noise the patched sampler adds (0: none), on during the rollouts' sampling only."""


class Noise:
    """A logits processor adding N(0, sigma^2) to every logit of a decode step (run before the recorder)."""

    def __call__(self, input_ids, scores):
        return scores + NOISE["sigma"] * torch.randn_like(scores)


def noisy(generate):
    """The sampler's generate with Noise first among the processors, while a rollout samples."""
    def wrapper(self, input_ids, attention_mask, **kwargs):
        if NOISE["sigma"] and NOISE["on"]:
            kwargs["logits_processor"] = [Noise(), *kwargs.get("logits_processor", [])]
        return generate(self, input_ids, attention_mask, **kwargs)
    return wrapper


def rollouts_only(generate):
    """generation.generate with the noise on for the rollouts (desc "rollout") alone: the judge's measurements and
    the held-out check sample as shipped."""
    def wrapper(*args, **kwargs):
        NOISE["on"] = kwargs.get("desc") == "rollout"
        try:
            return generate(*args, **kwargs)
        finally:
            NOISE["on"] = False
    return wrapper


STAGES = {"ppo": ppo.train, "grpo": grpo.train, "rloo": grpo.train_rloo}


def one(results: str, stage: str, seed: int, sigma: float, correct: bool, steps: int | None) -> dict:
    overrides = [f"results_dir={results}", f"seed={seed}", f"{stage}.save_steps=0", f"{stage}.keep=last",
                 f"{stage}.overopt_stop=false", f"{stage}.sampler_is_correction={str(correct).lower()}",
                 "tracking.backend=none", *([f"{stage}.steps={steps}"] if steps else [])]
    exp = config.load(ROOT / "experiments" / "tiny.yaml", overrides)
    run(registry.get(stage).needs(exp), overrides)
    NOISE["sigma"] = sigma
    try:
        s = STAGES[stage](exp, resume=False)
    finally:
        NOISE["sigma"] = 0.0
    lines = [json.loads(x) for x in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines() if x.strip()]

    def mean_of(key):
        return statistics.fmean(x[key] for x in lines if key in x)

    m = s["metrics"]
    return {"stage": stage, "seed": seed, "sigma": sigma, "correct": correct,
            "gain": m["eval_score_policy"] - m["eval_score_sft"], "kl": m["eval_kl_ref"],
            "gap_mean": mean_of("rollout/logprob_gap_mean"), "ratio_std": mean_of("rollout/sampler_ratio_std"),
            "gap_max": max(x["rollout/logprob_gap_max"] for x in lines if "rollout/logprob_gap_max" in x)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--stages", default="ppo,grpo,rloo")
    ap.add_argument("--sigmas", default="0.13,0.52", help="the noisy conditions (beside a clean run per seed)")
    ap.add_argument("--steps", type=int, default=None, help="iterations (default: tiny.yaml's: PPO 60, GRPO and "
                    "RLOO 40)")
    a = parse(ap, argv, "sampler-gap-", ROOT / "results" / "bench")
    torch.set_num_threads(1)
    sampler.MergedSampler.generate = noisy(sampler.MergedSampler.generate)
    generation.generate = rollouts_only(generation.generate)
    conditions = [(0.0, False)] + [(float(x), c) for x in a.sigmas.split(",") for c in (False, True)]
    rows = []
    for k in range(a.seeds):  # interleaved, the order rotating with the seed
        for stage in a.stages.split(","):
            for sigma, correct in conditions[k % len(conditions):] + conditions[:k % len(conditions)]:
                rows.append(one(a.results, stage, k, sigma, correct, a.steps))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    md = [f"# The sampler's gap and its correction on the tiny task: {a.seeds} seeds, the shipped iterations "
          "(mean ± se over seeds)", "",
          "| stage | sigma | correction | gap, mean per token | max | ratio pi_old/q, std | ground-truth gain over "
          "SFT | gain - clean, paired | KL to SFT |", "|---|---|---|---|---|---|---|---|---|"]
    for stage in a.stages.split(","):
        clean = {x["seed"]: x["gain"] for x in rows if x["stage"] == stage and x["sigma"] == 0.0}
        for sigma, correct in conditions:
            r = [x for x in rows if x["stage"] == stage and x["sigma"] == sigma and x["correct"] == correct]
            paired_gain = [x["gain"] - clean[x["seed"]] for x in r]
            md.append(f"| {stage} | {sigma} | {'on' if correct else 'off'} | {mean_se([x['gap_mean'] for x in r])} | "
                      f"{max(x['gap_max'] for x in r):.3f} | {mean_se([x['ratio_std'] for x in r])} | "
                      f"{mean_se([x['gain'] for x in r])} | {mean_se(paired_gain) if sigma else '-'} | "
                      f"{mean_se([x['kl'] for x in r])} |")
    write(a.out, "sampler-gap", "\n".join(md) + "\n", {"rows": rows})
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
