"""Dense float32 copies of our tiny SFT policy and reward model, for TRL 0.25.1's PPOTrainer (which takes a policy,
a reward model and a value model as separate `transformers` models).

The NF4 base weights are dequantized (exactly the values our 4-bit layers compute with), the LoRA adapter is merged
into them, and the result is saved with the tokenizer. The reward model's score head is divided by the RM's reward
std, the scale our PPO normalizes rewards to, so both trainers see rewards of the same scale (our PPO also subtracts
the mean; a constant offset does not change PPO's whitened advantages much and TRL has no option for it).
`check_policy` verifies that the dense policy gives the same log-probs as ours (4-bit base + SFT adapter)."""

from __future__ import annotations

import json
from pathlib import Path

import bitsandbytes as bnb
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf.inputs import models


def _dequantized(exp, base_path: str, tok) -> dict[str, torch.Tensor]:
    """name -> float32 weight of every 4-bit linear layer of the base, as the 4-bit layers compute with it."""
    q = models.load_base(models.loading(exp), base_path, "causal", tok, train=False)
    out = {}
    for name, m in q.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            out[name.removeprefix("model.") + ".weight"] = bnb.functional.dequantize_4bit(
                m.weight.data, m.weight.quant_state).float()
    del q
    return out


def _dense(cls, base_path: str, weights: dict, **kwargs):
    model = cls.from_pretrained(base_path, dtype=torch.float32, **kwargs)
    inner = model.model  # LlamaModel under both heads
    sd = {k: v for k, v in weights.items() if not k.startswith("lm_head")}
    missing = [k for k in sd if k not in inner.state_dict()]
    assert not missing, missing[:3]
    inner.load_state_dict(sd, strict=False)
    return model


def export(exp, sft: dict, rm: dict, tok, out: Path) -> dict:
    base_path = sft["model"]["base_path"]
    weights = _dequantized(exp, base_path, tok)
    policy = _dense(AutoModelForCausalLM, base_path, weights)
    policy = PeftModel.from_pretrained(policy, sft["model"]["adapter"]).merge_and_unload()
    policy.config.pad_token_id = tok.pad_token_id
    policy.save_pretrained(out / "policy")
    tok.save_pretrained(out / "policy")
    reward = _dense(AutoModelForSequenceClassification, base_path, weights, num_labels=1)
    reward = PeftModel.from_pretrained(reward, rm["model"]["adapter"]).merge_and_unload()
    reward.score.weight.data /= rm["reward_stats"]["std"]
    reward.config.pad_token_id = tok.pad_token_id
    reward.save_pretrained(out / "reward")
    tok.save_pretrained(out / "reward")
    for d in ("policy", "reward"):  # transformers 4.57 has no "TokenizersBackend"; the tokenizer.json is the same
        cfg_path = out / d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return {"policy": str(out / "policy"), "reward": str(out / "reward"), "dequantized_linears": len(weights)}


@torch.no_grad()
def check_policy(exp, sft: dict, tok, dense_dir: str, prompts: list[str]) -> float:
    """Max |log-prob difference| between ours (4-bit + SFT adapter) and the dense merged copy on `prompts`."""
    ours = models.load_adapter(models.load_base(models.loading(exp), sft["model"]["base_path"], "causal", tok, train=False),
                               sft["model"]["adapter"])
    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    enc = tok(prompts, return_tensors="pt", padding=True)
    a = torch.log_softmax(ours(**enc).logits.float(), -1)
    b = torch.log_softmax(dense(**enc).logits.float(), -1)
    m = enc.attention_mask.bool()
    return float((a - b).abs()[m].max())
