"""PPO's value model, `separate` (the shipped default: a value adapter initialized from the reward model's, trained
beside the policy) against `shared` (a value head on the policy's own trunk), on the tiny task over seeds, interleaved
seed by seed, each run trained to its end and graded on its last policy (keep=last, no early stop): what each learns (the ground truth's gain over SFT on the held-out prompts, the held-out win rate with
its interval, the KL to the reference, the value's explained variance) and what it costs (the iteration's seconds,
the update's), with the update's speed in trained tokens per second beside the SFT stage's on the same shape (issue
49: "the update at SFT's speed").

    OMP_NUM_THREADS=1 .venv/bin/python studies/value_model.py --seeds 5 [--steps 60]

Trained tokens: every prompt + response token of every sequence a forward + backward pass trains (padding not), as
the SFT stage counts its own (`trained_tokens_per_s`): the policy's update trains the rollout's sequences `epochs`
times, a separate value model as many again in passes of its own. Writes results/bench/<date>-value-model.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from studies.harness import ROOT, mean_se, parse, run, write  # noqa: E402

from rlhf.experiment import config  # noqa: E402
from rlhf.runs import records


def one(results: str, seed: int, value: str, steps: int) -> dict:
    overrides = [f"results_dir={results}", f"seed={seed}", f"ppo.steps={steps}", "ppo.save_steps=0", "ppo.keep=last",
                 "ppo.overopt_stop=false", f"ppo.value_model={value}", "tracking.backend=none"]
    run(["sft", "rm", "ppo"], overrides)
    exp = config.load(ROOT / "experiments" / "tiny.yaml", overrides)
    _, s = records.latest(exp, "ppo", "value-model")
    _, sft = records.latest(exp, "sft", "value-model")
    lines = [json.loads(x) for x in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    its = [x for x in lines if "tokens_per_s" in x]  # the iterations' lines
    trained = sum(x["tokens_per_s"] * (x["time/rollout_s"] + x["time/update_s"]) * x["epochs"] for x in its)
    policy_s = sum(x.get("time/update_policy_s", 0.0) for x in its)
    value_s = sum(x.get("time/update_value_s", 0.0) for x in its)
    m, th = s["metrics"], s["throughput"]
    win = m["eval_win_rates"][m["eval_scored_by"]]
    return {"seed": seed, "value_model": value, "gain": m["eval_score_policy"] - m["eval_score_sft"],
            "win_rate": win["win_rate"], "win_ci95": win["ci95"], "kl": m["eval_kl_ref"],
            "explained_variance": statistics.fmean(x["explained_variance"] for x in its[-10:]),
            "step_s": th["step_s"], "update_s": th["update_s_per_step"],
            "policy_update_tokens_per_s": trained / policy_s,
            "update_tokens_per_s": trained * (1 + (value == "separate")) / (policy_s + value_s),
            "sft_trained_tokens_per_s": sft["throughput"]["trained_tokens_per_s"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60, help="PPO iterations (tiny.yaml ships 60)")
    a = parse(ap, argv, "value-model-", ROOT / "results" / "bench")
    rows = []
    for k in range(a.seeds):  # interleaved, the side that goes first alternating
        for value in (("separate", "shared") if k % 2 == 0 else ("shared", "separate")):
            rows.append(one(a.results, k, value, a.steps))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    md = [f"# PPO's value model on the tiny task: {a.seeds} seeds, {a.steps} iterations (mean ± se over seeds)", "",
          "| value_model | ground-truth gain over SFT | held-out win rate | KL to SFT | explained variance (last 10) | "
          "s / iteration | update s / iteration | policy update trained tok/s | whole update trained tok/s | "
          "SFT trained tok/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for value in ("separate", "shared"):
        r = [x for x in rows if x["value_model"] == value]
        md.append(f"| {value} | " + " | ".join(mean_se([x[k] for x in r]) for k in (
            "gain", "win_rate", "kl", "explained_variance", "step_s", "update_s", "policy_update_tokens_per_s",
            "update_tokens_per_s", "sft_trained_tokens_per_s")) + " |")
    diff = [a_["gain"] - b_["gain"] for a_, b_ in zip(
        [x for x in rows if x["value_model"] == "separate"], [x for x in rows if x["value_model"] == "shared"])]
    md += ["", f"Paired difference of the gain, separate - shared: {mean_se(diff)} (n = {len(diff)} seeds)."]
    write(a.out, "value-model", "\n".join(md) + "\n", {"rows": rows})
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
