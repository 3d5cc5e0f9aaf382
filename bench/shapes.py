"""The model shapes `make bench` compares PPO (and GRPO/RLOO) on: the tiny experiment it was tuned on, and shapes a
new user would bring - wider or deeper, a byte-level BPE vocabulary instead of the word-level one, tied or untied
embeddings, 24-token responses instead of 10, the NF4 base or an unquantized one.

A shape is overrides of experiments/tiny.yaml. The BPE shapes load their base from a local directory, as a user's
own model would (`model.name=<dir>`): a Llama with random weights and a BPE tokenizer trained on the task's text,
built here once per bench session (`build_bpe_base`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# 24-token responses: the task's responses are 12-20 letters (one word-level token each; a BPE token each with its
# space); prompts of up to 16 tokens (a third of them are 13 with the BPE tokenizer: tiny.yaml's 12 cut them, as the
# online stages' warning says, while TRL's GRPOTrainer does not cut prompts)
LONG = ["data.synthetic.response_len_min=12", "data.synthetic.response_len_max=20", "data.max_length=40",
        "data.max_prompt_length=16", "ppo.response_length=24", "grpo.max_completion_length=24", "rloo.max_completion_length=24",
        "eval.max_new_tokens=24"]
# the new-user settings: rollout batch 64, minibatch 32, 4 PPO epochs
BATCH = ["ppo.rollout_batch=64", "ppo.minibatch=32", "ppo.micro_batch=32", "ppo.num_ppo_epochs=4"]
NF4_OFF = ["quantization.load_in_4bit=false"]
RECIPES = {
    "dapo": {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.0, "mask_truncated_completions": True},
    "gspo": {"importance_sampling_level": "sequence", "loss_type": "grpo", "epsilon": 3e-4, "epsilon_high": 4e-4,
             "beta": 0.0},
}
"""TRL 1.16 GRPOConfig keyword sets from current recipes, as TRL's documentation writes them (DAPO: its loss,
clip-higher, truncated responses masked, no KL; GSPO: the sequence-level ratio with GSPO's clip range, no KL): passed
unchanged to TRL's GRPOTrainer and, as the grpo section's keys, to ours (`make bench`; studies/trl_recipes.py)."""


@dataclass
class Shape:
    about: str
    overrides: list[str] = field(default_factory=list)
    bpe: dict | None = None
    """A local base with a BPE tokenizer: {hidden_size, num_layers, num_heads, intermediate_size, vocab, tied}."""


BPE_BASE = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "intermediate_size": 344, "vocab": 600,
            "tied": True}
SHAPES = {
    "tiny": Shape("experiments/tiny.yaml: hidden 64, 2 layers, word-level vocabulary (~30), untied, NF4, 10-token "
                  "responses, rollout 64 / minibatch 16 / 4 epochs"),
    "bpe": Shape("hidden 128, 4 layers, 4 heads, byte-level BPE vocabulary of 600, tied embeddings, NF4, 24-token "
                 "responses, rollout 64 / minibatch 32 / 4 epochs (a local model directory)",
                 [*LONG, *BATCH], BPE_BASE),
    "bpe-dense": Shape("the bpe shape with an unquantized (float32) base", [*LONG, *BATCH, *NF4_OFF], BPE_BASE),
    "wide": Shape("hidden 256, 2 layers, 8 heads, 2 key/value heads (GQA), word-level vocabulary, untied, "
                  "unquantized, 24-token responses, rollout 64 / minibatch 32 / 4 epochs",
                  ["model.hidden_size=256", "model.num_layers=2", "model.num_heads=8", "model.num_kv_heads=2",
                   "model.intermediate_size=688", *LONG, *BATCH, *NF4_OFF]),
}


def build_bpe_base(exp, spec: dict, out: Path) -> Path:
    """A random-weight Llama of `spec`'s shape and a byte-level BPE tokenizer trained on the task's text, saved as a
    model directory (what `model.name` can point at). Built once: an existing directory is reused."""
    if (out / "config.json").exists():
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from rlhf.inputs import data
    from rlhf.inputs.models import SPECIALS

    splits = data.load(exp)
    texts = [r["prompt"] + r["chosen"] for r in splits.train] + [r["rejected"] for r in splits.train]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=spec["vocab"],
                                                       special_tokens=list(SPECIALS.values()),
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = SPECIALS["bos_token"]
    bpe.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, bpe.token_to_id(bos))])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, model_max_length=4096, **SPECIALS)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=spec["hidden_size"], num_hidden_layers=spec["num_layers"],
                      num_attention_heads=spec["num_heads"], intermediate_size=spec["intermediate_size"],
                      max_position_embeddings=128, tie_word_embeddings=spec["tied"], pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(exp.seed)
    out.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out
