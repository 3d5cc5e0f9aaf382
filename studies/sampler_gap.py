"""Does PPO need an importance-sampling correction for the sampler's gap? (issue 49)

The merged sampler draws from q, not from the policy pi_old whose log-probs PPO's ratio uses; on a GPU, in bf16,
the mean |log q - log pi_old| per token was 0.086-0.091 at the 7B shapes (results/gpu/2026-11-26-H200-decode). On
a CPU in float32 the gap is 1e-6, so this study makes one: each decode step's logits get independent Gaussian noise
of standard deviation `sigma` before the sampler draws (and records log q), which gives a mean gap of about
0.7 sigma. PPO on the tiny task, as shipped but graded on its last policy (keep=last, no early stop), over seeds,
interleaved: no noise, sigma = 0.13 (about the measured gap) and 0.26 (twice it); what each learns (the ground
truth's gain over SFT on the held-out prompts, which are sampled without noise) and the gap each run reported
(rollout/logprob_gap_mean). If the noisy runs learn as the clean ones do, TRL's truncated importance-sampling
correction (`vllm_importance_sampling_correction`) buys nothing at that gap.

    OMP_NUM_THREADS=1 .venv/bin/python studies/sampler_gap.py --seeds 5

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
from rlhf.rl import generation, sampler
from rlhf.recipes import ppo

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


def one(results: str, seed: int, sigma: float, steps: int) -> dict:
    overrides = [f"results_dir={results}", f"seed={seed}", f"ppo.steps={steps}", "ppo.save_steps=0", "ppo.keep=last",
                 "ppo.overopt_stop=false", "tracking.backend=none"]
    run(["sft", "rm"], overrides)
    exp = config.load(ROOT / "experiments" / "tiny.yaml", overrides)
    NOISE["sigma"] = sigma
    try:
        s = ppo.train(exp, resume=False)
    finally:
        NOISE["sigma"] = 0.0
    lines = [json.loads(x) for x in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    gaps = [x["rollout/logprob_gap_mean"] for x in lines if "rollout/logprob_gap_mean" in x]
    m = s["metrics"]
    return {"seed": seed, "sigma": sigma, "gain": m["eval_score_policy"] - m["eval_score_sft"],
            "kl": m["eval_kl_ref"], "gap_mean": statistics.fmean(gaps), "gap_max": max(
                x["rollout/logprob_gap_max"] for x in lines if "rollout/logprob_gap_max" in x)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--sigmas", default="0,0.13,0.26")
    ap.add_argument("--steps", type=int, default=60, help="PPO iterations (tiny.yaml ships 60)")
    a = parse(ap, argv, "sampler-gap-", ROOT / "results" / "bench")
    torch.set_num_threads(1)
    sampler.MergedSampler.generate = noisy(sampler.MergedSampler.generate)
    generation.generate = rollouts_only(generation.generate)
    sigmas = [float(x) for x in a.sigmas.split(",")]
    rows = []
    for k in range(a.seeds):  # interleaved, the order rotating with the seed
        for sigma in sigmas[k % len(sigmas):] + sigmas[:k % len(sigmas)]:
            rows.append(one(a.results, k, sigma, a.steps))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    md = [f"# PPO on the tiny task with a noisy sampler: {a.seeds} seeds, {a.steps} iterations (mean ± se over "
          "seeds)", "",
          "| sigma | sampler's gap, mean per token | max | ground-truth gain over SFT | gain - clean, paired | "
          "KL to SFT |", "|---|---|---|---|---|---|"]
    clean = {x["seed"]: x["gain"] for x in rows if x["sigma"] == 0.0}
    for sigma in sigmas:
        r = [x for x in rows if x["sigma"] == sigma]
        paired = [x["gain"] - clean[x["seed"]] for x in r] if clean else []
        md.append(f"| {sigma} | {mean_se([x['gap_mean'] for x in r])} | {max(x['gap_max'] for x in r):.3f} | "
                  f"{mean_se([x['gain'] for x in r])} | {mean_se(paired) if sigma and paired else '-'} | "
                  f"{mean_se([x['kl'] for x in r])} |")
    write(a.out, "sampler-gap", "\n".join(md) + "\n", {"rows": rows})
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
