"""The merged sampler (rlhf/rl/sampler.py): every sampling pass runs through a dense copy of the base with the sampling
adapter's LoRA merged in. On the CPU, in float32, it draws the training model's own samples and their log-probs
differ by float rounding; it is merged again whenever the adapter changes (an optimizer step, a loaded state,
another adapter), and a test here fails when the merge is skipped or stale."""

import bitsandbytes as bnb
import pytest
import torch

from rlhf.rl import generation, sampler
from rlhf.inputs import models

from .conftest import tiny

PROMPTS = ["Human: a b c d Assistant:", "Human: e f g Assistant:", "Human: a Assistant:", "Human: g f Assistant:"]
TEXTS = ["Human: a b c d Assistant: a c", "Human: e f g Assistant: g e f h", "Human: b h Assistant: a a b"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny NF4 base (float32 compute on the CPU) with the shipped tiny LoRA: every linear layer, the embeddings and
    head saved in full (modules_to_save), tied embeddings."""
    root = tmp_path_factory.mktemp("sampler")
    exp = tiny(root, "quantization.load_in_4bit=true", "quantization.compute_dtype=float32",
               "lora.target_modules=[all-linear]")
    path = models.build_tiny_base(exp.model, exp.seed, TEXTS, root / "base")
    return exp, str(path), models.load_tokenizer(str(path))


def trained_like(model, seed: int, adapter: str = "default"):
    """Nonzero LoRA B matrices and perturbed saved embeddings for `adapter` (a trained adapter's, so it counts)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if f".{adapter}." in name and ("lora_B" in name or "modules_to_save" in name):
                prm.add_((0.05 if "lora_B" in name else 0.02) * torch.randn(prm.shape, generator=g))
    return model


@pytest.fixture()
def policy(base):
    exp, path, tok = base
    model = models.add_adapter(models.load_base(models.loading(exp), path, "causal", tok), exp.lora)
    return trained_like(model, 0).eval(), tok


def draw(model, tok, copy_bytes, do_sample=True, seed=3, new=8):
    torch.manual_seed(seed)
    return generation.generate(model, tok, PROMPTS, max_new_tokens=new, temperature=1.0, top_p=1.0,
                               max_prompt_length=16, copy_bytes=copy_bytes, do_sample=do_sample, batch_size=2)


def training_logprobs(model, r):
    with torch.no_grad():
        return generation.response_logprobs(model, r)[0]


def assert_the_policys_own(model, tok, r_sampler, r_plain, tol=2e-5):
    """The sampler drew the training model's own tokens, and what it recorded sampling them is the training path's
    log-prob of each, up to float rounding."""
    assert torch.equal(r_sampler.response, r_plain.response) and torch.equal(r_sampler.mask, r_plain.mask)
    assert r_sampler.mask.sum() >= 12  # enough tokens for the comparisons to mean something
    gap = ((r_sampler.sample_logp - training_logprobs(model, r_sampler)) * r_sampler.mask).abs().max().item()
    assert gap <= tol, f"log-prob gap {gap:.2e} between the sampler and the training path"


def test_the_merged_copy_draws_the_policys_samples_and_log_probs(policy, monkeypatch):
    """Through the sampler no 4-bit layer runs and no LoRA branch: each 4-bit weight is dequantized once, when the
    adapter is merged (W + alpha/r * B @ A), not at every token; the samples are the training model's, their recorded
    log-probs the training path's up to rounding (what rollout/logprob_gap_* reports per run), and a second call
    merges nothing again."""
    model, tok = policy
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    calls = {"forward": 0, "dequantize": 0}
    forward, dequantize = bnb.nn.Linear4bit.forward, bnb.functional.dequantize_4bit

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper

    plain = draw(model, tok, 0.0)
    assert torch.equal(plain.sample_logp != 0, plain.mask.bool())  # recorded on the plain path too
    monkeypatch.setattr(bnb.nn.Linear4bit, "forward", counted("forward", forward))
    monkeypatch.setattr(bnb.functional, "dequantize_4bit", counted("dequantize", dequantize))
    merged = draw(model, tok, float("inf"))
    assert calls == {"forward": 0, "dequantize": len(layers)}
    s = model._rlhf_sampler
    assert len(s.merged) == len(layers) and not s.kept and s.bytes == sum(m.in_features * m.out_features * 4
                                                                          for m in layers)
    monkeypatch.undo()
    assert_the_policys_own(model, tok, merged, plain)
    assert s.sync() is False  # nothing changed: no merge
    # each merged weight is exactly W + scaling * B @ A
    src, own = next(iter(s.merged.values()))
    w = bnb.functional.dequantize_4bit(src.base_layer.weight.data, src.base_layer.weight.quant_state)
    expect = w + src.scaling["default"] * src.lora_B["default"].weight @ src.lora_A["default"].weight
    torch.testing.assert_close(own, expect, rtol=1e-6, atol=1e-7)


def test_the_copy_follows_the_adapter_after_an_update_and_fails_when_stale(policy):
    """After an optimizer step the next sampling call merges again (torch's AdamW writes in place: the version
    counters say so), and after a write that bumps no version counter (bitsandbytes' 8-bit optimizers write through
    pointers) the optimizer's step hook does (watch). Without the re-merge the samples are the old policy's: the
    comparison fails, so it can."""
    model, tok = policy
    s = generation.sampler_for(model, float("inf"), 2, 24)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    opt = torch.optim.AdamW(lora, lr=0.5)
    s.watch(opt)
    draw(model, tok, float("inf"))  # merged for the adapter as it was
    for p in lora:
        p.grad = torch.randn_like(p)
    opt.step()
    assert_the_policys_own(model, tok, draw(model, tok, float("inf")), draw(model, tok, 0.0))

    class PointerWrites(torch.optim.Optimizer):  # an in-place update torch's version counters do not see
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.add_(0.3 * torch.randn_like(p))

    quiet = PointerWrites(lora, {})
    before = [p._version for p in lora]
    quiet.step()
    assert [p._version for p in lora] == before  # the counters missed it
    stale = draw(model, tok, float("inf"))
    plain = draw(model, tok, 0.0)
    assert not torch.equal(stale.response, plain.response)  # a stale copy samples another policy
    s.watch(quiet)
    quiet.step()
    assert_the_policys_own(model, tok, draw(model, tok, float("inf")), draw(model, tok, 0.0))


def test_each_adapter_samples_as_its_own_and_a_partial_copy_too(base):
    """A second adapter (the held-out check's "ref", the judge's measurements) is merged when it samples, and the
    policy's again after; with room for one decoder layer (a partial copy, memplan's choice on a small card) the rest
    compute through the training model's own 4-bit and LoRA modules, with the same samples."""
    exp, path, tok = base
    model = trained_like(models.add_adapter(models.load_base(models.loading(exp), path, "causal", tok), exp.lora), 0)
    model.add_adapter("ref", models.lora_config(exp.lora))
    trained_like(model, 1, "ref").eval()
    for name in ("ref", "default", "ref"):
        model.base_model.set_adapter(name)  # as roles.use switches (PeftModel.active_adapter does not follow)
        assert_the_policys_own(model, tok, draw(model, tok, float("inf")), draw(model, tok, 0.0))
    with model.disable_adapter():  # the reference "base": no LoRA at all
        assert_the_policys_own(model, tok, draw(model, tok, float("inf")), draw(model, tok, 0.0))
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    one = sum(m.in_features * m.out_features * 4 for m in layers[:7])
    partial = sampler.MergedSampler(model, one)
    assert len(partial.merged) == 7 and len(partial.kept) == 7 and partial.compile is False
    model._rlhf_sampler = partial
    for name in ("default", "ref"):
        model.base_model.set_adapter(name)
        assert_the_policys_own(model, tok, draw(model, tok, float("inf")), draw(model, tok, 0.0))


def test_a_static_cache_pass_pads_rows_and_prompts_and_gives_the_same_tokens(policy):
    """The compiled path's shapes, on the CPU (transformers compiles only on a GPU; the static cache and the padding
    are the same): every batch is the sampler's rows of max_prompt_length tokens (a short batch repeats its last
    prompt), the padding columns and rows are dropped after, and the greedy tokens are the training model's."""
    model, tok = policy
    s = generation.sampler_for(model, float("inf"), 2, 24)
    s.compile = True
    static = draw(model, tok, float("inf"), do_sample=False, new=6)
    assert list(s._caches) == [(2, 16 + 6)]  # one cache: every batch padded to the same shape
    plain = draw(model, tok, 0.0, do_sample=False, new=6)
    assert static.query.shape == plain.query.shape and torch.equal(static.query_mask, plain.query_mask)
    assert_the_policys_own(model, tok, static, plain)
    torch.manual_seed(0)
    three = generation.generate(model, tok, PROMPTS[:3], max_new_tokens=6, temperature=1.0, top_p=1.0,
                                max_prompt_length=16, copy_bytes=float("inf"), do_sample=False, batch_size=2)
    assert three.response.shape[0] == 3 and torch.equal(three.response, plain.response[:3])
    assert list(s._caches) == [(2, 22)]


def test_a_sampling_pass_shows_its_progress_bar(policy, monkeypatch, capsys):
    """On a terminal a sampling pass longer than BAR_DELAY shows one progress bar, named by the pass."""
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    model, tok = policy
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(generation, "BAR_DELAY", 0.0)
    torch.manual_seed(0)
    generation.generate(model, tok, PROMPTS, max_new_tokens=4, temperature=1.0, top_p=1.0, max_prompt_length=16,
                        copy_bytes=float("inf"), batch_size=2, desc="judge")
    out = term.getvalue()
    assert "judge:" in out and "/4 [" in out and "seq/s" in out  # the bar: its name, its total, its unit
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no bar
    generation.generate(model, tok, PROMPTS, max_new_tokens=4, temperature=1.0, top_p=1.0, max_prompt_length=16,
                        batch_size=2, desc="judge")
    assert sys.stderr.getvalue() == ""


def test_a_failed_compile_is_said_once_recorded_and_a_fall_back_from_the_plan(policy, monkeypatch, caplog):
    """A compiled decode that fails: one warning line, eager sampling from then on with the same samples, the reason
    in the sampler's state; where the plan wanted the whole copy compiled (on CUDA), the run record calls it a
    fall-back (gpucheck fails such a stage). Each call's decode step is timed (MergedSampler.record_steps)."""
    model, tok = policy
    s = sampler.of(model, compile=True)
    assert s.eager_reason is None and s.state()["compiled"] is True
    eager = s.dense.generate
    failed = []

    def generate(**kw):
        if "past_key_values" in kw:  # the compiled path: fails as torch.compile can on a stack it does not support
            failed.append(1)
            raise RuntimeError("inductor: no C++ compiler\nmore lines")
        return eager(**kw)

    monkeypatch.setattr(s.dense, "generate", generate)
    with caplog.at_level("WARNING", logger="rlhf.rl.sampler"):
        r = draw(model, tok, float("inf"))
    said = [r.getMessage() for r in caplog.records if r.name == "rlhf.rl.sampler"]
    assert failed == [1] and len(said) == 1 and "sampling eagerly from now on" in said[0], said
    state = s.state()
    assert state["compiled"] is False and state["path"] == "merged_eager"
    assert state["eager_reason"] == "the compiled decode failed: RuntimeError: inductor: no C++ compiler"
    assert state["decode_calls"] == 2 and state["decode_ms_per_step"] > 0 and state["copy_share"] == 1.0
    assert torch.equal(r.response, draw(model, tok, float("inf")).response)  # eager from now on: the same samples
    assert not generation.sampler_state(model, float("inf"), 2)["fell_back"]  # a CPU: the plan is eager anyway
    got = generation.sampler_state(model, float("inf"), 2, cuda=True)  # on CUDA, the whole copy planned: fell back
    assert got["fell_back"] and got["planned_copy_bytes"] == "whole" and got["rows"] == 2
    assert not generation.sampler_state(model, s.bytes / 2, 2, cuda=True)["fell_back"]  # a partial copy: eager
