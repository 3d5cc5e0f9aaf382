"""The shape of a model the memory plan needs, before any weight is loaded: vocabulary, width, depth, heads and
key/value heads, head width, MLP width and whether the head is tied. From the tiny model's config fields, a local
config.json, or the built-in table of public bases."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from rlhf.experiment.config import Experiment

# Public architecture facts of the shipped 7B bases (config.json of each hub repository).
BUILTIN = {
    "meta-llama/Llama-2-7b-hf": dict(vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008),
    "meta-llama/Llama-2-13b-hf": dict(vocab=32000, hidden=5120, layers=40, heads=40, kv_heads=40, intermediate=13824),
    "meta-llama/Llama-2-70b-hf": dict(vocab=32000, hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672),
    "mistralai/Mistral-7B-v0.1": dict(vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
    "mistralai/Mistral-7B-Instruct-v0.2": dict(vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=8,
                                               intermediate=14336),
    "meta-llama/Llama-3.1-8B": dict(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
    "meta-llama/Llama-3.1-8B-Instruct": dict(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8,
                                             intermediate=14336),
    "meta-llama/Meta-Llama-3-8B": dict(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
    "Qwen/Qwen2.5-7B": dict(vocab=152064, hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944),
    "Qwen/Qwen2.5-7B-Instruct": dict(vocab=152064, hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944),
    "Qwen/Qwen2.5-0.5B": dict(vocab=151936, hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, tied=True),
    # Gemma-2: head_dim 256 (heads x head_dim = 4096 > hidden), tied head; the memplan models its GeGLU MLP as the
    # gated MLP it is shaped like and ignores the extra post-norms (4 x hidden per token and layer)
    "google/gemma-2-9b": dict(vocab=256000, hidden=3584, layers=42, heads=16, kv_heads=8, intermediate=14336,
                              head_dim=256, tied=True),
}
# Sliding-window attention (Mistral-7B-v0.1, Gemma-2's local layers: 4096 tokens) only bounds the KV cache past 4096
# tokens of context; the shipped experiments stay far below, so the cache is planned over the whole sequence.


class MemoryPlanError(RuntimeError):
    """A stage's predicted peak is over memory.budget_gb."""


class UnknownArchitecture(MemoryPlanError):
    """No config.json and no built-in entry for the model: nothing to predict from."""


@dataclass
class Arch:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int = 0  # 0 = hidden // heads (Gemma-2 sets its own: 256 with hidden 3584 and 16 heads)
    tied: bool = False  # the output head is the input embedding's weight (one copy in memory)

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer (Llama/Mistral/Qwen2/Gemma-2: gated MLP)."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def synthetic_vocab(exp: Experiment) -> int:
    """The tiny word-level tokenizer's size on the synthetic task (built from a sample of the data; no weights)."""
    from rlhf.inputs import data, models

    rows = data.synthetic_pairs(exp.data.synthetic, 200, exp.seed)
    return len(models.build_tokenizer([r["prompt"] + " " + r["chosen"] + " " + r["rejected"] for r in rows]))


_DATA: dict[str, tuple[int | None, int | None]] = {}


def data_shape(exp: Experiment) -> tuple[int | None, int | None]:
    """(the tiny model's word-level vocabulary, the longest tokenized prompt + response + EOS) of the experiment's
    training data: preference pairs (chosen and rejected) and the SFT file's rows (the synthetic task: 1,000 of its
    pairs), rendered with the chat template as the stages render them. The vocabulary is None but for the tiny model
    on files; the length None when the data or the tokenizer is not on this machine before the stage starts (a hub
    dataset or tokenizer). Cached per model and data section."""
    key = json.dumps([exp.model.name, exp.model.revision, exp.seed, dataclasses.asdict(exp.data)], sort_keys=True,
                     default=str)
    if key not in _DATA:
        _DATA[key] = _read_data_shape(exp)
    return _DATA[key]


def _read_data_shape(exp: Experiment) -> tuple[int | None, int | None]:
    from rlhf.inputs import data, models

    d = exp.data
    if d.source == "synthetic":
        rows = data.synthetic_pairs(d.synthetic, 1000, exp.seed)
        rows = [data.as_conversation(r) for r in rows] if d.synthetic.conversational else rows
    elif d.source in ("jsonl", "hh-rlhf") and all(p is None or Path(p).exists()
                                                   for p in (d.path or "-", d.eval_path, d.sft_path)):
        splits = data.load(exp)
        rows = splits.train + splits.eval + (splits.sft_rows or []) + (splits.prompt_rows or [])
    else:
        return None, None
    template = data.chat_template(d.chat_template)
    if exp.model.name == "tiny":  # word-level: a token per word, the vocabulary built from the rendered rows
        tok = models.build_tokenizer([])
        tok.chat_template = template
    elif Path(exp.model.name).is_dir() and models.has_tokenizer(exp.model.name):
        tok = models.load_tokenizer(exp.model.name)
        tok.chat_template = template or tok.chat_template
    else:  # a hub id: nothing loaded before the stage starts
        return None, None
    try:
        rows = data.render([dict(r) for r in rows], tok)
    except data.DataError:  # conversational rows without a template: the stage itself says so
        return None, None
    texts = [r["prompt"] + r[k] for r in rows for k in ("chosen", "rejected", "completion") if k in r]
    vocab = None
    if exp.model.name == "tiny":
        tok = models.build_tokenizer(texts)
        vocab = len(tok) if d.source != "synthetic" else None
    return vocab, max(len(ids) for ids in tok(texts)["input_ids"]) + 1  # + the EOS TRL appends


def arch(exp: Experiment) -> Arch:
    m = exp.model
    if m.name == "tiny":
        vocab = m.vocab_size or (synthetic_vocab(exp) if exp.data.source == "synthetic" else data_shape(exp)[0]
                                 or 32000)
        return Arch(vocab, m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads or m.num_heads,
                    m.intermediate_size, tied=m.tie_embeddings)
    cfg_file = Path(m.name) / "config.json"
    if cfg_file.exists():
        c = json.loads(cfg_file.read_text())
        c = c.get("text_config", c)  # multimodal wrappers keep the language model's config inside
        # tie_word_embeddings: transformers' default differs by family (Llama/Mistral/Qwen2 False, Gemma True)
        tied = c.get("tie_word_embeddings", c.get("model_type", "").startswith("gemma"))
        return Arch(c["vocab_size"], c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
                    c.get("num_key_value_heads") or c["num_attention_heads"], c["intermediate_size"],
                    head_dim=c.get("head_dim") or 0, tied=bool(tied))
    if m.name in BUILTIN:
        return Arch(**BUILTIN[m.name])
    raise UnknownArchitecture(f"memplan: no architecture for model.name={m.name!r}: not a local directory with a "
                          f"config.json, and not one of {sorted(BUILTIN)}. Add it to rlhf/memory/arch.py BUILTIN.")
