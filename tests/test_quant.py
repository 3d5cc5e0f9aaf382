"""One 4-bit numeric path on every CPU (docs/cpu.md).

bitsandbytes 0.50 repacks a 4-bit layer for AVX512-BF16 CPUs at its first no-grad forward in eval mode, and the
repacked layer drops the gradient through its base weight in training. The fixture `bnb_as_on_avx512bf16` makes
bitsandbytes decide as on such a CPU whatever CPU runs the suite (its per-layer flag on, the repacking refused); these
tests check that every model the harness loads keeps the plain path. tests/test_repro.py runs every stage under it
(rerun and kill/resume) and compares with the same stages run without it."""

import bitsandbytes as bnb
import pytest
import torch

from rlhf import models

from .conftest import tiny


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    exp = tiny(root, "quantization.load_in_4bit=true", "lora.target_modules=[all-linear]")
    texts = ["Human: a b c d Assistant: a c", "Human: e f g Assistant: g e f h"]
    path = models.build_tiny_base(exp, texts, root / "base")
    return exp, str(path), models.load_tokenizer(str(path))


def test_the_fixture_makes_bitsandbytes_decide_as_on_an_avx512bf16_cpu(bnb_as_on_avx512bf16):
    layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32).to("cpu")
    assert layer.support_avx512bf16_for_cpu is True  # what bitsandbytes reads before repacking (its own flag)
    with torch.no_grad(), pytest.raises(RuntimeError, match="repacked a 4-bit layer"):
        layer.eval()(torch.randn(2, 64))
    assert bnb_as_on_avx512bf16 == ["(32, 64)"]


@pytest.mark.parametrize("kind", ["causal", "reward"])
def test_gradients_reach_every_4bit_layers_input_after_an_eval_forward(base, kind, bnb_as_on_avx512bf16):
    """As a stage runs: the base loaded for training with a LoRA adapter, a no-grad eval-mode pass first (the
    held-out check, a rollout), then a training step. Each 4-bit layer's own input gradient is grad_out @ W for its
    dequantized weight W, as without the flag (the repacked path gives None)."""
    exp, path, tok = base
    model = models.add_adapter(models.load_base(exp, path, kind, tok), exp, "CAUSAL_LM" if kind == "causal" else
                               "SEQ_CLS")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(layers) == 2 * 7 and not any(m.support_avx512bf16_for_cpu for m in layers.values())
    ids = tok(["Human: a b c d Assistant: a c", "Human: e f g Assistant: g e"], return_tensors="pt",
              padding=True)
    model.eval()
    with torch.no_grad():
        model(**ids)
    model.train()
    grads = {}
    for name, m in layers.items():
        m.register_full_backward_hook(lambda mod, gin, gout, name=name: grads.__setitem__(name, (gin[0], gout[0])))
    out = model(**ids).logits
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(0))).sum().backward()
    assert bnb_as_on_avx512bf16 == [] and set(grads) == set(layers)
    for name, m in layers.items():
        assert not getattr(m.weight.quant_state, "packing_format_for_cpu", False), name
        grad_in, grad_out = grads[name]
        assert grad_in is not None, f"{name}: no gradient through the 4-bit weight"
        w = bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state).float()
        torch.testing.assert_close(grad_in, grad_out @ w, rtol=1e-5, atol=1e-6, msg=name)
