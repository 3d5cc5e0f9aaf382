"""The random-weight bases and exact-length data the GPU tools measure on (gpucheck, decodebench): an experiment's
architecture (memplan's, or shrunk) with random weights and a word-level tokenizer, and preference pairs whose rows
are exactly the experiment's sequence lengths. No hub, no network."""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlhf.experiment import stages as registry
from rlhf.memory.arch import arch

# --shrink: the same experiments with the architecture and sequences shrunk (seconds per stage); --dry-run: on CPU
SMALL_ARCH = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
CPU_VOCAB = 512
"""A shrunk base's vocabulary on a CPU (the dry run): on a GPU the head keeps the experiment's width (its logits are
what a shrunk run's memory is mostly made of); on a CPU, with bf16 compute, a 32k-wide head took 51-63% of a profiled
PPO or GRPO iteration (torch's bf16 matmuls are emulated where the CPU lacks AVX512-BF16), and a CPU measures no
GPU's memory. The word-level tokenizer of write_pairs' data has about 200 words."""
TRAINED = [s for s in registry.REGISTRY.values() if s.trains and not s.online]
"""The stages on TRL's trainers (steps: their section's max_steps)."""
ONLINE = [s for s in registry.REGISTRY.values() if s.online]
"""Our online loops' stages (steps: their section's iterations)."""
SMALL = ["data.max_length=40", "data.max_prompt_length=24", "eval.max_new_tokens=16",  # the judge samples as eval
         *(f"{s.section}.max_steps=1" for s in TRAINED),
         *(f"{s.section}.{k}" for s in ONLINE  # the response length by its TRL name: PPOConfig's, GRPOConfig's
           for k in ("response_length=16" if s.section == "ppo" else "max_completion_length=16", "steps=1",
                     "judge_prompts=16"))]  # one sampling call of the judge (128 took 3/4 of a CPU iteration)


def _family(name: str) -> str:
    return "mistral" if "mistral" in name.lower() else "llama"


def shape_of(exp, small: bool):
    """The experiment's architecture (memplan's, or the saved base's where model.name is its folder), or with `small`
    shrunk to SMALL_ARCH; the head's width is the architecture's (a base build_base saved on a CPU: CPU_VOCAB)."""
    import dataclasses

    a = arch(exp)
    return dataclasses.replace(a, **SMALL_ARCH, head_dim=0) if small else a


def build_base(exp, out: Path, texts: list[str], small: bool) -> Path:
    """The experiment's architecture (memplan's, or a shrunk one) with random weights, built on its device and saved with a
    word-level tokenizer built from `texts`; the vocabulary is padded to the architecture's (a shrunk one's on a CPU
    to CPU_VOCAB)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from rlhf.inputs import models

    a = arch(exp)
    shape = dict(vocab=a.vocab, hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                 intermediate=a.intermediate)
    dev = models.device(exp.device).type
    if small:
        shape.update(SMALL_ARCH, **({"vocab": CPU_VOCAB} if dev == "cpu" else {}))
    tok = models.build_tokenizer(texts)
    if len(tok) > shape["vocab"]:
        raise ValueError(f"the base's tokenizer has {len(tok)} tokens, over its vocabulary of {shape['vocab']}")
    cfg_cls, model_cls = ((MistralConfig, MistralForCausalLM) if _family(exp.model.name) == "mistral"
                          else (LlamaConfig, LlamaForCausalLM))
    cfg = cfg_cls(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                  num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                  num_key_value_heads=shape["kv_heads"], max_position_embeddings=4096,
                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  tie_word_embeddings=a.tied)
    dtype = models.DTYPES[exp.model.dtype]
    torch.manual_seed(exp.seed)
    with torch.device(dev):
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = model_cls(cfg)
        finally:
            torch.set_default_dtype(default)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


def write_pairs(path: Path, exp, n: int, seed: int = 0) -> list[str]:
    """n preference pairs in TRL's explicit-prompt format whose word-level token counts are the experiment's lengths:
    BOS + prompt = data.max_prompt_length, + response + EOS = data.max_length. Returns the texts (for the tokenizer)."""
    d = exp.data
    p_words, r_words = d.max_prompt_length - 1, d.max_length - d.max_prompt_length - 1
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(200)]
    texts = []
    with path.open("w") as f:
        for _ in range(n):
            row = {"prompt": " ".join(rng.choices(vocab, k=p_words)),
                   "chosen": " " + " ".join(rng.choices(vocab, k=r_words)),
                   "rejected": " " + " ".join(rng.choices(vocab, k=r_words))}
            f.write(json.dumps(row) + "\n")
            texts.append(" ".join(row.values()))
    return texts
