"""TRL 0.25.1's PPOTrainer on our tiny model: the PPO peer of `make bench`, run by bench/test_bench.py in its own
virtual environment (.bench-venv, bench/trl025-requirements.txt) as `python bench/trl025_ppo.py SPEC.json`.

SPEC names the dense policy / reward directories (bench/peer_models.py), the training and eval prompts and the PPO
settings of our run. The setup is TRL's usual one: the policy gets a fresh LoRA adapter (the shape of ours) on the
merged SFT weights and the reference is that model with adapters disabled (= the SFT policy, as ours); the reward
model is our RM merged; the value model starts as our RM too and is trained whole, as PPOTrainer does. Writes the
train time, per-update step time, responses for the eval prompts (the parent scores them with the ground truth) and
the process's peak RSS to SPEC's "out".

Only public APIs of the pinned packages are used; nothing of this repository is imported (it needs transformers 5)."""

from __future__ import annotations

import json
import sys
import time

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
from trl import PPOConfig, PPOTrainer


class Parts:
    """Seconds per part of TRL's PPO step, by wrapping the functions its train loop calls (module attributes of
    trl.trainer.ppo_trainer, the accelerator's backward and the optimizer's step): generate (sampling; TRL takes the
    old log-probs from the sampling logits, no separate policy pass), ref, value, score (no-grad passes), update
    (the policy+value forward of each minibatch), backward, optimizer."""

    def __init__(self):
        self.s: dict[str, float] = {}

    def wrap(self, fn, name):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = name(args) if callable(name) else name
                self.s[key] = self.s.get(key, 0.0) + time.perf_counter() - t0
        return timed


class StepTimes(TrainerCallback):
    def __init__(self):
        self.t = [time.perf_counter()]

    def on_step_end(self, args, state, control, **kwargs):
        self.t.append(time.perf_counter())


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def tie_saved_copies(model) -> None:
    """On a tied base (the bench's BPE shapes), the adapter's saved embedding and head trained as one matrix, as ours
    trains them (rlhf/inputs/models.py: peft's ensure_weight_tying, which peft 0.17 lacks): the head's copy becomes the
    embedding's. Untied bases are left as they are."""
    if not model.config.tie_word_embeddings:
        return
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if hasattr(emb, "modules_to_save") and hasattr(head, "modules_to_save"):
        head.modules_to_save["default"].weight = emb.modules_to_save["default"].weight


def main(spec_path: str) -> None:
    spec = json.load(open(spec_path))
    p = spec["ppo"]
    torch.manual_seed(spec["seed"])
    tok = AutoTokenizer.from_pretrained(spec["policy"], padding_side="left")
    tok.truncation_side = "left"

    def encode(prompts):
        return Dataset.from_dict({"input_ids": [tok(q, truncation=True, max_length=spec["max_prompt_length"])
                                                ["input_ids"] for q in prompts]})

    policy = AutoModelForCausalLM.from_pretrained(spec["policy"], dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(spec["reward"], dtype=torch.float32, num_labels=1)
    value = AutoModelForSequenceClassification.from_pretrained(spec["reward"], dtype=torch.float32, num_labels=1)
    lora = LoraConfig(r=spec["lora"]["r"], lora_alpha=spec["lora"]["alpha"], lora_dropout=0.0,
                      target_modules="all-linear", modules_to_save=spec["lora"]["modules_to_save"],
                      task_type="CAUSAL_LM")
    args = PPOConfig(
        output_dir=spec["output_dir"], seed=spec["seed"], use_cpu=True, report_to="none", save_strategy="no",
        learning_rate=p["learning_rate"], total_episodes=p["steps"] * p["rollout_batch"],
        # rollout_batch = per_device_train_batch_size * gradient_accumulation_steps; it is split into
        # num_mini_batches minibatches with one optimizer step each (TRL accumulates over gradient_accumulation_steps
        # micro-batches *across* minibatches, so that must stay 1 to get ours' optimizer steps)
        per_device_train_batch_size=p["rollout_batch"], gradient_accumulation_steps=1,
        num_mini_batches=p["rollout_batch"] // p["minibatch"], local_rollout_forward_batch_size=p["rollout_batch"],
        num_ppo_epochs=p["epochs"], response_length=p["max_new_tokens"], temperature=p["temperature"],
        stop_token="eos", missing_eos_penalty=p["missing_eos_penalty"], kl_coef=p["kl_coef"],
        cliprange=p["clip_range"], cliprange_value=p["clip_range_value"], vf_coef=p["vf_coef"], gamma=p["gamma"],
        lam=p["lam"], whiten_rewards=False, num_sample_generations=0, logging_steps=1000, disable_tqdm=True,
        dataloader_num_workers=0, lr_scheduler_type="constant",  # ours: constant learning rate
        bf16=False,  # float32 as ours (the config defaults to bf16 autocast, also on a CPU: several times slower)
    )
    times, parts = StepTimes(), Parts()
    import trl.trainer.ppo_trainer as ppo_module

    ppo_module.batch_generation = parts.wrap(ppo_module.batch_generation, "generate")
    ppo_module.forward = parts.wrap(
        ppo_module.forward, lambda a: "update" if isinstance(a[0], ppo_module.PolicyAndValueWrapper) else "ref")
    trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=None, reward_model=reward,
                         value_model=value, train_dataset=encode(spec["prompts"]),
                         eval_dataset=encode(spec["eval_prompts"][:8]), peft_config=lora, callbacks=[times])
    tie_saved_copies(trainer.model.policy)
    ppo_module.get_reward = parts.wrap(ppo_module.get_reward,
                                       lambda a: "score" if a[0] is trainer.reward_model else "value")
    trainer.accelerator.backward = parts.wrap(trainer.accelerator.backward, "backward")
    trainer.optimizer.step = parts.wrap(trainer.optimizer.step, "optimizer")
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    steps = [b - a for a, b in zip(times.t, times.t[1:])]

    # responses for the held-out prompts: the trained policy and the reference (adapters disabled = SFT)
    model = trainer.model.policy
    model.eval()
    enc = tok(spec["eval_prompts"], return_tensors="pt", padding=True, truncation=True,
              max_length=spec["max_prompt_length"])
    out = {}
    for name in ("policy", "sft"):
        torch.manual_seed(spec["seed"])
        with torch.no_grad(), (model.disable_adapter() if name == "sft" else _null()):
            gen = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                 max_new_tokens=spec["eval_max_new_tokens"], do_sample=True,
                                 temperature=spec["eval_temperature"], top_k=0, top_p=1.0,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        out[name] = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    import peft
    import transformers
    import trl

    json.dump({"train_s": train_s, "step_s": steps, "updates": len(steps), "episodes": args.total_episodes,
               "responses": out, "peak_rss_bytes": peak_rss(), "parts_s": parts.s,
               "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                            "peft": peft.__version__, "torch": torch.__version__}},
              open(spec["out"], "w"))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


if __name__ == "__main__":
    main(sys.argv[1])
