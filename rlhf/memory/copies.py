"""What a stage samples and trains through, read from the memory plan (memplan.py chooses, this module only reads;
imports go one way): an online stage's (PPO, GRPO, RLOO) merged sampler's copy of the base (rlhf/rl/sampler.py), on a
4-bit base the training path's dequantized copy (models.dequantized), and the static cache's rows, as its plan chose
them (memplan.choose; docs/memory.md#the-samplers-copy); `make eval` and export sample through the whole copy where
it fits."""

from __future__ import annotations

from rlhf.experiment import stages as registry
from rlhf.experiment.config import Experiment
from rlhf.memory import memplan
from rlhf.memory.arch import UnknownArchitecture, arch
from rlhf.memory.memplan import COPY_MARGIN, GB
from rlhf.memory.sizes import _trainable, _weights, generation_bytes, sampling_copy_bytes


def copies(exp: Experiment, stage: str) -> tuple[float, float, int]:
    """(bytes of the training path's dequantized copy, bytes of the merged sampler's copy, rows per sampling pass)
    for `stage`: the plan's for an online stage. `make eval` and export (one base, its adapters and a sampling
    batch) sample through the sampler's whole copy when it fits the budget with COPY_MARGIN free under auto (with run
    or sampling: always), eval.batch_size rows at a time. SFT's and DPO's held-out checks (a few prompts, once): none;
    nor, under auto, a model with no architecture to plan from."""
    mode = exp.quantization.dequantized_copy
    rows = exp.eval.batch_size
    if registry.get(stage).memplan in registry.TRAINER_SHAPES:
        return 0.0, 0.0, rows
    online = registry.get(stage).online
    try:
        a = arch(exp)
        if online:
            p = memplan.plan(exp, stage)
            return p.train_copy, p.copy, p.sampling_rows
    except UnknownArchitecture:
        if online:
            rows = memplan.rows_range(exp, stage)[0]
        return 0.0, float("inf") if mode not in ("auto", "never") else 0.0, rows
    if mode == "never":
        return 0.0, 0.0, rows
    full = sampling_copy_bytes(a, exp)
    n = min(rows, exp.eval.prompts)
    need = (sum(_weights(a, exp, True).values()) + 3 * _trainable(a, exp, head=True)[0] + full
            + generation_bytes(a, exp, n, exp.data.max_prompt_length + exp.eval.max_new_tokens))
    return 0.0, full if mode != "auto" or need / GB <= (1 - COPY_MARGIN) * exp.memory.budget_gb else 0.0, rows


def sampling(exp: Experiment, stage: str) -> tuple[float, int]:
    """(bytes of the merged sampler's copy, rows per pass) `stage` samples with (copies())."""
    _, copy, rows = copies(exp, stage)
    return copy, rows


