"""What an online stage (PPO, GRPO, RLOO) samples and trains through, and how many rows a sampling pass decodes:
the merged sampler's copy of the base (rlhf/sampler.py), on a 4-bit base the training path's dequantized copy
(models.dequantized), and the static cache's rows, each chosen so the stage's plan (memplan._plan) keeps COPY_MARGIN
of memory.budget_gb free (quantization.dequantized_copy; docs/memory.md#the-samplers-copy). `make eval` and export
sample through the whole copy where it fits."""

from __future__ import annotations

from .. import stages as registry
from ..config import Experiment
from . import memplan
from .arch import Arch, UnknownArchitecture, arch
from .memplan import COPY_MARGIN, GB, Plan, _local
from .sizes import _trainable, _weights, generation_bytes, sampling_copy_bytes


def choose(exp: Experiment, name: str, full: float, mode: str) -> Plan:
    """An online stage's plan (memplan.plan) with the copies and sampling rows quantization.dequantized_copy asks
    for: `full` the bytes of a whole copy of the decoder's linear layers, `mode` the setting (see memplan.plan)."""
    a = arch(exp)
    low, high = _rows_range(exp, name)
    if mode == "never":
        return memplan._plan(exp, name, rows=low)

    def room(p: Plan) -> bool:
        return p.peak_gb <= (1 - COPY_MARGIN) * p.budget_gb

    train = full if exp.quantization.load_in_4bit else 0.0
    order = {"run": [train], "sampling": [0.0], "auto": [train, 0.0] if train else [0.0]}[mode]
    p = None
    for t in order:
        for rows in _rows_down(high, 1 if exp.device == "cuda" else low):
            p = memplan._plan(exp, name, full, t, rows)
            if room(p):
                return _with_info(p, full)
        if mode != "auto":
            return _with_info(p, full)
    lo, hi = 0, a.layers - 1  # auto: the most decoder layers whose sampler copy has room (the plan grows with it)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if room(memplan._plan(exp, name, full * mid / a.layers, 0.0, low)) else (lo, mid - 1)
    return _with_info(memplan._plan(exp, name, full * lo / a.layers, 0.0, low), full)


def _rows_range(exp: Experiment, name: str) -> tuple[int, int]:
    """(rows, most rows) of an online stage's sampling passes: its forward_batch (else its local rollout batch),
    and on a CUDA device up to its largest sampling call (the local rollout batch, the judge's prompts, the held-out
    check's). On a CUDA device the whole compiled copy decodes any rows at one step's cost (the weights' read):
    the plan takes the most that fit, down to one, before it gives up layers of the copy; on a CPU batching buys no
    speed, and the passes keep forward_batch."""
    st = registry.get(name)
    pp = st.config(exp)
    local = _local(getattr(pp, st.batch), exp)
    low = min(pp.forward_batch, local) if pp.forward_batch else local
    if exp.device != "cuda":
        return low, low
    judge = pp.judge_prompts if getattr(pp, "judge_every", 0) else 0
    return low, max(low, local, judge, exp.eval.prompts)


def _rows_down(high: int, low: int) -> list[int]:
    """high, then the powers of two below it down to low, then low."""
    out, r = [high], 1 << (high.bit_length() - 1)
    while r > low:
        if r < high:
            out.append(r)
        r //= 2
    return [*out, low] if out[-1] != low else out


def _with_info(p: Plan, full: float) -> Plan:
    if full:
        where = {"run": "and a dequantized copy for training", "sampling": "", "": "not made"}[p.copy_scope]
        part = f" ({p.copy / full:.0%} of the layers; all: {full / GB:.2f} GB)" if 0 < p.copy < full else ""
        p.info[f"merged sampler's copy, held for the run {where}{part}".replace("  ", " ").strip()] = p.copy
    return p


def compiled(exp: Experiment, copy: float, a: Arch) -> bool:
    """The sampler decodes through a compiled static cache: on a CUDA device, with every layer merged."""
    return exp.device == "cuda" and copy > 0 and copy >= sampling_copy_bytes(a, exp) * (1 - 1e-9)


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
            rows = _rows_range(exp, stage)[0]
        return 0.0, float("inf") if mode not in ("auto", "never") else 0.0, rows
    if mode == "never":
        return 0.0, 0.0, rows
    full = sampling_copy_bytes(a, exp)
    n = min(rows, exp.eval.prompts)
    need = (sum(_weights(a, exp, True).values()) + 3 * _trainable(a, exp, head=True)[0] + full
            + generation_bytes(a, exp, n, exp.data.max_prompt_length + exp.eval.max_new_tokens))
    return 0.0, full if mode != "auto" or need / GB <= (1 - COPY_MARGIN) * exp.memory.budget_gb else 0.0, rows


def scoring_rows(section, rows: int, local_rollout: int) -> int:
    """Rows per no-grad scoring pass of an online stage: its forward_batch (else its local rollout batch), at most
    `rows`, the plan's sampling rows (beside a held copy, the plan may have lowered both)."""
    return min(section.forward_batch or local_rollout, local_rollout, rows)


def sampling(exp: Experiment, stage: str) -> tuple[float, int]:
    """(bytes of the merged sampler's copy, rows per pass) `stage` samples with (copies())."""
    _, copy, rows = copies(exp, stage)
    return copy, rows


