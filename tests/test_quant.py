"""One 4-bit numeric path on every CPU (docs/cpu.md).

bitsandbytes 0.50 repacks a 4-bit layer for AVX512-BF16 CPUs at its first no-grad forward in eval mode, and the
repacked layer drops the gradient through its base weight in training. The fixture `bnb_as_on_avx512bf16` makes
bitsandbytes decide as on such a CPU whatever CPU runs the suite (its per-layer flag on, the repacking refused); these
tests check that every model the harness loads keeps the plain path. tests/test_repro.py runs every stage under it
(rerun and kill/resume) and compares with the same stages run without it."""

import bitsandbytes as bnb
import pytest
import torch

from rlhf.rl import generation
from rlhf.inputs import models

from .conftest import tiny


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    exp = tiny(root, "quantization.load_in_4bit=true", "lora.target_modules=[all-linear]")
    texts = ["Human: a b c d Assistant: a c", "Human: e f g Assistant: g e f h"]
    path = models.build_tiny_base(exp.model, exp.seed, texts, root / "base")
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
    model = models.add_adapter(models.load_base(models.loading(exp), path, kind, tok), exp.lora, "CAUSAL_LM" if kind == "causal" else
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


# ---- training through a dequantized copy of the base (models.dequantized, issue 38; sampling: tests/test_sampler.py)
PROMPTS = ["Human: a b c d Assistant:", "Human: e f g Assistant:", "Human: a Assistant:"]


@pytest.fixture(scope="module")
def policy(base):
    """The 4-bit base with a LoRA adapter whose B matrices are nonzero (a trained policy's, so the adapter counts)."""
    exp, path, tok = base
    model = models.add_adapter(models.load_base(models.loading(exp), path, "causal", tok), exp.lora)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "lora_B" in name:
                prm.copy_(0.05 * torch.randn(prm.shape, generator=g))
    return model.eval(), tok


def sample(model, tok, copy_bytes):
    torch.manual_seed(3)
    return generation.generate(model, tok, PROMPTS, max_new_tokens=6, temperature=1.0, top_p=1.0,
                               max_prompt_length=16, copy_bytes=copy_bytes)


def test_a_partial_copy_takes_whole_decoder_layers_in_order(policy):
    """memplan sizes a partial copy by decoder layers: the copy takes the first 4-bit layers up to the byte budget,
    in the model's order (the first decoder layer's 7 linears for one layer's bytes), and leaves the rest 4-bit."""
    model, tok = policy
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    one = sum(m.in_features * m.out_features * 4 for m in layers[:7])
    with models.dequantized(model, one) as size:
        copied = ["forward" in m.__dict__ for m in layers]
    assert size == one and copied == [True] * 7 + [False] * 7
    with models.dequantized(model, 0) as size:
        assert size == 0 and not any("forward" in m.__dict__ for m in layers)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_through_a_run_long_copy_gives_the_4bit_gradients(base, checkpointing):
    """dequantized_copy=run holds the copy through the update: the LoRA gradients of a policy loss through it equal
    the 4-bit path's (gradient checkpointing recomputes inside the block), and the base's 4-bit weights stay frozen."""
    exp, path, tok = base
    model = models.add_adapter(models.load_base(models.loading(exp), path, "causal", tok), exp.lora)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "lora_B" in name:
                prm.copy_(0.05 * torch.randn(prm.shape, generator=g))
    r = sample(model.eval(), tok, 0.0)
    model.train()
    grads = []
    for copy in (0.0, float("inf")):
        model.zero_grad(set_to_none=True)
        with models.dequantized(model, copy):
            logp, _, _ = generation.response_logprobs(model, r)
            (logp * r.mask).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}  # LoRA and the saved embeddings
    assert set(grads[0]) == set(grads[1]) == trainable and any("lora_A" in n for n in trainable)
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind", ["causal", "reward"])
def test_a_bf16_base_is_frozen_in_bf16_without_a_float32_copy_of_its_unquantized_weights(base, kind, dtype,
                                                                                         monkeypatch):
    """With bf16 compute (the shipped GPU experiments), the base made ready for training holds what peft's
    prepare_model_for_kbit_training and a cast back to bf16 leave, bit for bit (every weight frozen, the unquantized
    ones bf16), and never a float32 copy: under the tensor probe, on a base loaded in bf16 (`model.dtype`, as
    shipped), peft's way raises the peak by at least the unquantized weights' bf16 bytes (their float32 copies less
    the bf16 they replace: 1.96 GB for Llama-3.1-8B's embedding and head), ours by nothing; loaded in float32, both
    cast weight by weight. The loader takes this path, not peft's."""
    from dataclasses import replace

    from peft import prepare_model_for_kbit_training

    from rlhf.memory.probe import TensorTracker

    exp, path, tok = base
    ld = models.loading(exp)
    ld = replace(ld, model=replace(ld.model, dtype=dtype),
                 quantization=replace(ld.quantization, compute_dtype="bfloat16"))

    def peak_rise(prepare):
        torch.manual_seed(0)  # the reward model's new head: the same draw each load
        model = models.load_base(ld, path, kind, tok, train=False)
        sizes = [p.numel() for p in model.parameters() if type(p).__name__ != "Params4bit"]
        tracker = TensorTracker("cpu").start()
        before = tracker.current
        try:
            model = prepare(model)
        finally:
            tracker.stop()
        return model, tracker.peak - before, sizes

    def peft_and_back(model):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        for p in model.parameters():
            if p.dtype == torch.float32 and type(p).__name__ != "Params4bit":
                p.data = p.data.to(torch.bfloat16)
        return model

    ours, rise, sizes = peak_rise(lambda m: models.frozen_for_kbit_training(m, torch.bfloat16))
    theirs, peft_rise, _ = peak_rise(peft_and_back)
    if dtype == "bfloat16":
        assert peft_rise >= 2 * sum(sizes) and rise == 0, (peft_rise, rise, sizes)
    else:  # each float32 weight's bf16 copy, then the float32 freed: at most the largest one's bf16 bytes
        assert 0 < rise <= 2 * max(sizes) and rise <= peft_rise, (peft_rise, rise, sizes)
    mine, ref = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert mine.keys() == ref.keys() and not any(p.requires_grad for p in mine.values())
    for name, p in mine.items():
        assert p.dtype == ref[name].dtype and torch.equal(p.data, ref[name].data), name
        assert type(p).__name__ == "Params4bit" or p.dtype == torch.bfloat16, name

    def refused(*args, **kwargs):
        raise AssertionError("load_base took peft's float32 upcast with bf16 compute")

    monkeypatch.setattr(models, "prepare_model_for_kbit_training", refused)
    torch.manual_seed(0)
    loaded = models.load_base(ld, path, kind, tok)  # the loader's own path (train=True) is ours
    assert all(torch.equal(p.data, mine[k].data) and p.dtype == mine[k].dtype for k, p in loaded.named_parameters())
