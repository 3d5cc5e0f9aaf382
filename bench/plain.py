"""The plain equivalents of our SFT, RM and DPO stages, written directly against TRL 1.16 / peft / transformers: the
same base directory, tokenizer, LoRA shape, 4-bit config, rows, batch size, learning rate and sequence length, and
nothing of the harness (no Session, no memory probe, no run record, no callbacks).

Two deliberate matches with the harness, so that the ratio measures the harness and not a precision choice: TRL's
configs default to bf16=True (autocast), also on a CPU, where bfloat16 matmuls are ~50x slower - the matched plain run
sets bf16=False as the harness does on CPU, and `trl_defaults=True` keeps TRL's default for the record. And TRL casts trainable QLoRA parameters to bfloat16; a careful user on a CPU casts
them back to float32 (bfloat16 matmuls are ~50x slower there), so the plain runs do too.
"""

from __future__ import annotations

import time

import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, BitsAndBytesConfig
from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer

from rlhf.inputs import models


def _base(exp, path: str, cls):
    q = exp.quantization
    kwargs = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    if q.load_in_4bit:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=q.quant_type, bnb_4bit_use_double_quant=q.double_quant,
            bnb_4bit_compute_dtype=torch.float32)
        kwargs["device_map"] = {"": "cpu"}
    if cls is AutoModelForSequenceClassification:
        kwargs["num_labels"] = 1
    model = cls.from_pretrained(path, **kwargs)
    if q.load_in_4bit:
        # on a CPU with AVX512-BF16, bitsandbytes would repack each 4-bit layer at its first no-grad forward and drop
        # the gradient through it from then on; a careful user turns that off as the harness does (docs/cpu.md)
        models.plain_4bit(model)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return model


def _lora(exp, task_type: str) -> LoraConfig:
    save = list(exp.lora.modules_to_save)
    if task_type == "SEQ_CLS":
        save = [m for m in save if m != "lm_head"] + ["score"]
    return LoraConfig(r=exp.lora.r, lora_alpha=exp.lora.alpha, lora_dropout=exp.lora.dropout,
                      target_modules="all-linear", modules_to_save=save, task_type=task_type)


def _args(cls, t, out: str, **extra):
    # the stage's own settings; gradient_checkpointing too, which TRL's configs turn on by default (a memory-for-time
    # trade the experiment decides: model.gradient_checkpointing, off in the tiny one)
    return cls(output_dir=out, learning_rate=t.learning_rate, num_train_epochs=t.epochs, max_steps=t.max_steps,
               per_device_train_batch_size=t.batch_size, lr_scheduler_type=t.lr_scheduler, warmup_steps=t.warmup_ratio,
               optim=t.optim, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
               gradient_checkpointing=False, logging_steps=t.logging_steps, save_strategy="no", report_to="none",
               use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0, **{"bf16": False, **extra})


def _precision(trl_defaults: bool) -> dict:
    return {} if not trl_defaults else {"bf16": None}  # None: the config's own default applies


def _float32(trainer):
    for p in trainer.model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return trainer


def _timed(trainer, tokens: float, save: str | None = None) -> dict:
    """trainer.train()'s wall time and trained tokens per second, counted as the harness counts them
    (rlhf.recipes.trainers.trained_tokens: every token of every trained sequence, prompt and response, chosen and rejected)."""
    from rlhf.recipes.trainers import trained_tokens

    t0 = time.time()
    trainer.train()
    dt = time.time() - t0
    if save:  # the adapter and tokenizer, for the next stage of bench/plain_pipeline.py
        trainer.save_model(save)
        trainer.processing_class.save_pretrained(save)
    n, _ = trained_tokens(trainer, 0, tokens)
    return {"train_time_s": round(dt, 3), "trained_tokens_per_s": round(n / dt, 1), "trained_tokens": n}


def sft(exp, base_path: str, rows: list[dict], out: str, trl_defaults: bool = False, save: str | None = None) -> dict:
    tok = AutoTokenizer.from_pretrained(base_path)
    model = get_peft_model(_base(exp, base_path, AutoModelForCausalLM), _lora(exp, "CAUSAL_LM"))
    ds = Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in rows])
    args = _args(SFTConfig, exp.sft, out, max_length=exp.data.max_length, completion_only_loss=True,
                 **_precision(trl_defaults))
    trainer = _float32(SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok))
    tokens = sum(len(ids) for ids in trainer.train_dataset["input_ids"]) * exp.sft.epochs
    return _timed(trainer, tokens, save)


def rm(exp, base_path: str, adapter: str, pairs: list[dict], out: str, trl_defaults: bool = False,
       save: str | None = None) -> dict:
    tok = AutoTokenizer.from_pretrained(adapter)
    model = get_peft_model(_base(exp, base_path, AutoModelForSequenceClassification), _lora(exp, "SEQ_CLS"))
    model.config.pad_token_id = tok.pad_token_id
    ds = Dataset.from_list([{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in pairs])
    args = _args(RewardConfig, exp.rm, out, max_length=exp.data.max_length, **_precision(trl_defaults))
    trainer = _float32(RewardTrainer(model=model, args=args, train_dataset=ds, processing_class=tok))
    d = trainer.train_dataset
    tokens = sum(len(a) + len(b) for a, b in zip(d["chosen_ids"], d["rejected_ids"])) * exp.rm.epochs
    return _timed(trainer, tokens, save)


def dpo(exp, base_path: str, adapter: str, pairs: list[dict], out: str, trl_defaults: bool = False,
        save: str | None = None) -> dict:
    tok = AutoTokenizer.from_pretrained(adapter)
    model = PeftModel.from_pretrained(_base(exp, base_path, AutoModelForCausalLM), adapter, is_trainable=True)
    ds = Dataset.from_list([{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in pairs])
    args = _args(DPOConfig, exp.dpo, out, beta=exp.dpo.beta, max_length=exp.data.max_length,
                 **_precision(trl_defaults))
    trainer = _float32(DPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok))
    d = trainer.train_dataset
    tokens = sum(len(a) + len(b) for a, b in zip(d["chosen_ids"], d["rejected_ids"])) * exp.dpo.epochs
    return _timed(trainer, tokens, save)
