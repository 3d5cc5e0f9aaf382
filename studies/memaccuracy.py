"""The memory predictor against the CPU tensor probe on the shapes of its accuracy test (tests/test_memory.py SHAPES,
the +/-15% test): each stage run for two steps in its own process, as the test does, and a line per stage with the
measured peak, the predicted one, the error and the predicted components.

    OMP_NUM_THREADS=1 .venv/bin/python studies/memaccuracy.py                          # every shape, its stages
    OMP_NUM_THREADS=1 .venv/bin/python studies/memaccuracy.py vocab613-tied-padded --stages sft,dpo

`--head` measures TRL's fused LM head alone (forward and backward of trl.kernels.ChunkedLogProbFunction on CPU,
the SFT trainer's outputs) at several positions x vocabularies: its temporaries beyond the 32,768-wide buffer, in
tiles of the vocabulary's width (sizes.CPU_TILE_TEMPS is the backward's).

The test asserts the same figures (`pytest -k test_predictor_within_15_percent_of_probe -s` prints them); this prints
the components beside them, for working on the predictor."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlhf.experiment import config  # noqa: E402
from rlhf.tools import memcheck  # noqa: E402
from rlhf.memory import memplan, sizes
from tests.test_memory import SHAPES, STAGES_BY_SHAPE  # noqa: E402

MB = 1024**2


def head() -> None:
    import torch
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    from rlhf.memory.probe import TensorTracker

    torch.set_num_threads(1)
    for n, h, v in [(300, 64, 40), (960, 128, 613), (1000, 128, 3000), (488, 64, 32000), (488, 64, 128256)]:
        hidden = torch.randn(n, h, requires_grad=True)
        weight = torch.randn(v, h, requires_grad=True)
        targets = torch.randint(0, v, (n,))
        tr = TensorTracker().start()
        try:
            before = tr.current
            tr.reset_peak()
            lp, *_ = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, sizes.TILE_VOCAB, None, 1.0,
                                                  ("log_probs", "entropy", "is_top1"))
            fwd = tr.peak - before
            before = tr.current
            tr.reset_peak()
            (-lp.sum()).backward()
            bwd = tr.peak - before
        finally:
            tr.stop()
        rows = min(n, sizes.TILE_TOKENS)
        buf, tile = rows * sizes.TILE_VOCAB * 4, rows * min(v, sizes.TILE_VOCAB) * 4
        print(f"positions {n:5d} vocabulary {v:6d}: buffer {buf / MB:6.1f} MB; temporaries beyond it: forward "
              f"{(fwd - buf) / tile:.2f} tiles, backward {(bwd - buf - n * h * 4 - v * h * 4) / tile:.2f} tiles "
              f"(beside the float32 gradients of the hidden states and the head)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="*", help=f"shapes (default: all): {', '.join(SHAPES)}")
    ap.add_argument("--stages", default="", help="comma-separated stages (default: the test's for each shape)")
    ap.add_argument("--head", action="store_true", help="measure the fused LM head's temporaries alone, and exit")
    args = ap.parse_args()
    if args.head:
        return head()
    for shape in args.shapes or list(SHAPES):
        stages = [s for s in args.stages.split(",") if s] or STAGES_BY_SHAPE[shape]
        stages = [s for s in stages if s in STAGES_BY_SHAPE[shape]] or stages
        with tempfile.TemporaryDirectory(prefix="memaccuracy-") as tmp:
            overrides = [f"results_dir={tmp}", *SHAPES[shape]]
            measured = memcheck.measure(memcheck.GATED, overrides, stages)
            exp = config.load(memcheck.GATED, overrides)
        for st, m in measured.items():
            p = memplan.plan(exp, st)
            err = p.peak_gb / m["peak_gb"] - 1
            parts = ", ".join(f"{k} {v / MB:.1f}" for k, v in p.components.items() if v)
            phases = ", ".join(f"{k} {v['peak_gb'] * 1024:.1f}" for k, v in m["phases"].items())
            print(f"{shape:<28} {st:<5} measured {m['peak_gb'] * 1024:8.1f} MB  predicted {p.peak_gb * 1024:8.1f} MB "
                  f"{err:+7.1%}  (predicted, {p.peak_phase}: {parts}; measured by phase: {phases})", flush=True)


if __name__ == "__main__":
    main()
