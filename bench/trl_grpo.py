"""TRL 1.16's GRPOTrainer / RLOOTrainer on our tiny model: the critic-free peers of `make bench`, run by
bench/test_bench.py as `python bench/trl_grpo.py SPEC.json` (the project's own venv: TRL 1.16 is what it pins).

SPEC names the dense SFT policy (bench/peer_models.py), the training prompts with their columns, the held-out prompts,
the reward function (an import path with TRL's signature, the same one our run uses), our run's settings (by TRL's
names) and a recipe's GRPOConfig keywords, if any (bench/shapes.py: RECIPES). TRL's
usual setup: the policy gets a fresh LoRA adapter of our shape on the merged SFT weights, and the reference is that
model with adapters disabled (= the SFT policy, as ours). Batch sizes map one to one: a generation batch of
`rollout_batch` completions (`num_generations` per prompt), `minibatch` completions per optimizer step, `num_iterations`
passes over each generation. Writes the train time, the number of generation batches and held-out
responses sampled before and after training, the mean fraction of clipped tokens (TRL's clip_ratio/region_mean) and
each generation batch's mean reward (both logged once per generation batch) to SPEC's "out" (the parent samples the
process's peak RSS)."""

from __future__ import annotations

import importlib
import json
import sys
import time
from statistics import mean

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer


@torch.no_grad()
def sample(model, tok, prompts: list[str], max_new_tokens: int, temperature: float, seed: int) -> list[str]:
    torch.manual_seed(seed)
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_k=0,
                         top_p=1.0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    g, kind = spec["settings"], spec["kind"]
    torch.manual_seed(spec["seed"])
    module, _, name = spec["reward_function"].partition(":")
    reward_fn = getattr(importlib.import_module(module), name)
    tok = AutoTokenizer.from_pretrained(spec["policy"])
    model = AutoModelForCausalLM.from_pretrained(spec["policy"], dtype=torch.float32)
    evals = spec["eval_prompts"]
    before = sample(model, tok, evals, spec["eval_max_new_tokens"], spec["eval_temperature"], spec["seed"])
    common = dict(
        output_dir=spec["output_dir"], per_device_train_batch_size=g["minibatch"], gradient_accumulation_steps=1,
        generation_batch_size=g["rollout_batch"], num_generations=g["num_generations"],
        num_iterations=g["num_iterations"],
        max_steps=g["steps"] * (g["rollout_batch"] // g["minibatch"]) * g["num_iterations"],
        learning_rate=g["learning_rate"], lr_scheduler_type="constant", beta=g["beta"], epsilon=g["epsilon"],
        max_completion_length=g["max_completion_length"],
        temperature=g["temperature"], top_p=1.0, top_k=0, report_to="none",
        logging_steps=(g["rollout_batch"] // g["minibatch"]) * g["num_iterations"],  # once per generation batch
        save_strategy="no",
        use_cpu=True, seed=spec["seed"], disable_dropout=True, max_grad_norm=g["max_grad_norm"], bf16=False,
    )
    if kind == "grpo":
        # a recipe's keywords (bench/shapes.py: RECIPES) as a TRL user writes them, over our run's settings
        args = GRPOConfig(**{**common, "loss_type": g.get("loss_type", "grpo"), "scale_rewards": g["scale_rewards"],
                             **spec.get("recipe", {})})
        trainer_cls = GRPOTrainer
    else:
        args = RLOOConfig(**common, normalize_advantages=g["scale_rewards"] not in ("none", False))
        trainer_cls = RLOOTrainer
    lora = spec["lora"]
    tie = bool(model.config.tie_word_embeddings) and {"embed_tokens", "lm_head"} <= set(lora["modules_to_save"])
    peft_config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules="all-linear",
                             modules_to_save=lora["modules_to_save"], task_type="CAUSAL_LM",
                             ensure_weight_tying=tie)  # a tied base's embedding and head: one matrix, as ours
    trainer = trainer_cls(model=model, reward_funcs=reward_fn, args=args, train_dataset=Dataset.from_list(spec["rows"]),
                          processing_class=tok, peft_config=peft_config)
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    trained = trainer.model.eval()
    after = sample(trained, tok, evals, spec["eval_max_new_tokens"], spec["eval_temperature"], spec["seed"])
    json.dump({"train_s": train_s, "generations": g["steps"], "responses": {"sft": before, "policy": after},
               "optimizer_steps": trainer.state.global_step,
               "clip_frac": mean([e["clip_ratio/region_mean"] for e in trainer.state.log_history
                                  if "clip_ratio/region_mean" in e] or [float("nan")]),
               "train_reward": [e["reward"] for e in trainer.state.log_history if "reward" in e]},
              open(spec["out"], "w"))


if __name__ == "__main__":
    main(sys.argv[1])
