"""Where an SFT or DPO stage's training time goes, per token: runs `python -m rlhf <stage> ...` in this process with
timers around the model's forward passes (with gradients: the policy's; without, inside training: DPO's reference),
the backward pass, the optimizer step and DPO's reference precompute, and counts the tokens of every training batch:
real (attention mask) and padded (the batch's width x rows). Prints one JSON object.

    OMP_NUM_THREADS=1 .venv/bin/python studies/stage_accounting.py sft --exp experiments/tiny.yaml results_dir=/tmp/acct
    OMP_NUM_THREADS=1 .venv/bin/python studies/stage_accounting.py dpo --exp experiments/tiny.yaml results_dir=/tmp/acct

(DPO needs the SFT run of the same results_dir.) The stage's own summary (its `throughput`) is printed beside."""

from __future__ import annotations

import json
import runpy
import sys
import time
from collections import defaultdict

import torch

torch.set_num_threads(1)

seconds: dict[str, float] = defaultdict(float)
counts: dict[str, int] = defaultdict(int)
state = {"training": False}


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        if not state["training"] and name != "reference_precompute":
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - t0
            counts[name] += 1
    return wrapper


def main() -> None:
    import accelerate
    import accelerate.optimizer
    import peft
    import transformers
    from trl.trainer.dpo_trainer import DPOTrainer

    forward = peft.PeftModelForCausalLM.forward

    def policy_or_reference(self, *args, **kwargs):
        if not state["training"]:
            return forward(self, *args, **kwargs)
        name = "policy_forward" if torch.is_grad_enabled() else "reference_forward"
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        if ids is not None and mask is not None:
            counts[f"{name}_tokens_real"] += int(mask.sum())
            counts[f"{name}_tokens_padded"] += ids.numel()
            counts[f"{name}_rows"] += ids.shape[0]
        return timed(name, forward)(self, *args, **kwargs)

    peft.PeftModelForCausalLM.forward = policy_or_reference
    accelerate.Accelerator.backward = timed("backward", accelerate.Accelerator.backward)
    accelerate.optimizer.AcceleratedOptimizer.step = timed("optimizer", accelerate.optimizer.AcceleratedOptimizer.step)
    DPOTrainer._precompute_ref_logps = timed("reference_precompute", DPOTrainer._precompute_ref_logps)
    train = transformers.Trainer.train

    def training(self, *args, **kwargs):
        state["training"] = True
        t0 = time.perf_counter()
        try:
            return train(self, *args, **kwargs)
        finally:
            seconds["train"] += time.perf_counter() - t0
            state["training"] = False

    transformers.Trainer.train = training
    summary = {}
    argv = ["rlhf", *sys.argv[1:]]
    sys.argv = argv
    try:
        runpy.run_module("rlhf", run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        parts = ("policy_forward", "reference_forward", "backward", "optimizer")
        other = seconds["train"] - sum(seconds[p] for p in parts)
        real = counts["policy_forward_tokens_real"]
        summary = {"stage": argv[1], "train_s": round(seconds["train"], 3),
                   "seconds": {**{p: round(seconds[p], 3) for p in parts}, "other": round(other, 3),
                               "reference_precompute_outside_train": round(seconds["reference_precompute"], 3)},
                   "calls": {p: counts[p] for p in parts},
                   "tokens": {k: v for k, v in counts.items() if "tokens" in k or "rows" in k},
                   "trained_tokens_per_s": round(real / seconds["train"], 1) if seconds["train"] else None,
                   "padding_fraction": round(1 - real / counts["policy_forward_tokens_padded"], 4)
                   if counts["policy_forward_tokens_padded"] else None,
                   "us_per_real_token": {p: round(1e6 * seconds[p] / real, 2) for p in (*parts,)} if real else None}
        print(json.dumps(summary, indent=1), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
