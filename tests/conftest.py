import os
from pathlib import Path

import pytest

# `make test` runs pytest under make: tests that call `make -n` must not inherit the outer make's level and flags
# (make[1]: Entering directory ... lines would be mixed into their output)
for _var in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES"):
    os.environ.pop(_var, None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("RLHF_DISABLE_TRACKING", "1")

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "experiments" / "tiny.yaml"
HH_FILE = ROOT.parent / "shared" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"


def tiny(results_dir, *overrides):
    from rlhf import config

    return config.load(TINY, [f"results_dir={results_dir}", *overrides])


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def tiny_llama(tok, **fields):
    """A 2-layer, 32-wide random Llama over `tok`'s vocabulary (seeded), for generation and masking tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      **fields)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def make(target: str, *args: str, timeout: int = 1200):
    """Run `make TARGET ARGS...` in the repository as a user types it; fail the test with make's output tail."""
    import subprocess

    proc = subprocess.run(["make", target, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"make {target} {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc
