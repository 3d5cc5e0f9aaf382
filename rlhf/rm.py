"""Reward-model stage: a one-label sequence-classification head on the base, warm-started from the SFT adapter,
trained with TRL's RewardTrainer (Bradley-Terry loss). Reports pairwise accuracy, mean chosen/rejected scores and
margin on held-out pairs, and saves the reward mean/std so PPO can normalize scores."""

from __future__ import annotations

from pathlib import Path

import torch
from datasets import Dataset
from peft import get_peft_model
from trl import RewardConfig, RewardTrainer

from . import losses, models
from .generation import eos_terminated
from .config import Experiment
from .runtime import Plan, Session, preference_plan
from .trainers import (RecordCallback, adapter_dtype_as_compute, pair_tokens, run, trainable_snapshot,
                       training_args)


@torch.no_grad()
def score(model, tok, prompts: list[str], responses: list[str], batch_size: int = 64) -> torch.Tensor:
    """Reward of each prompt + response (EOS-terminated, as the RM was trained), with the model's active adapter."""
    model.eval()
    out = []
    for i in range(0, len(prompts), batch_size):
        texts = [p + eos_terminated(r, tok) for p, r in zip(prompts[i:i + batch_size], responses[i:i + batch_size])]
        enc = tok(texts, return_tensors="pt", padding=True).to(next(model.parameters()).device)
        with models.autocast(model):
            out.append(model(**enc).logits.squeeze(-1).float().cpu())
    return torch.cat(out)


def pair_metrics(model, tok, pairs: list[dict], batch_size: int) -> dict:
    prompts = [p["prompt"] for p in pairs]
    rc = score(model, tok, prompts, [p["chosen"] for p in pairs], batch_size)
    rr = score(model, tok, prompts, [p["rejected"] for p in pairs], batch_size)
    both = torch.cat([rc, rr])
    return {"accuracy": (rc > rr).float().mean().item(), "loss": losses.bradley_terry(rc, rr).item(),
            "chosen_mean": rc.mean().item(), "rejected_mean": rr.mean().item(), "margin": (rc - rr).mean().item(),
            "reward_mean": both.mean().item(), "reward_std": both.std().item()}


def prepare(exp: Experiment) -> Plan:
    return preference_plan(exp, "rm")


def train(exp: Experiment, resume: bool = True) -> dict:
    plan = prepare(exp)
    d = plan.data
    sft, tok, pairs, eval_pairs = d.sft, d.tok, d.pairs, d.eval_pairs
    session = Session.start(exp, plan, resume=resume)
    with session.probe.phase("load"):
        model = models.load_base(exp, sft["model"]["base_path"], "reward", tok)
        model = get_peft_model(model, models.lora_config(exp, "SEQ_CLS"))
        warm = models.warm_start(model, Path(sft["model"]["adapter"]))
    cols = ["prompt", "chosen", "rejected"] + (["margin"] if exp.rm.margin else [])
    train_ds = Dataset.from_list([{k: p[k] for k in cols} for p in pairs])
    args = training_args(RewardConfig, exp, exp.rm, session, max_length=exp.data.max_length,
                         center_rewards_coefficient=exp.rm.center_rewards_coefficient or None)
    snapshot = trainable_snapshot(model)
    trainer = adapter_dtype_as_compute(RewardTrainer(model=model, args=args, train_dataset=train_ds, processing_class=tok,
                            callbacks=[RecordCallback(session)]), exp, snapshot)
    with session.probe.phase("eval"):
        before = pair_metrics(model, tok, eval_pairs, exp.rm.batch_size)
    result, throughput = run(session, trainer, pair_tokens(trainer.train_dataset, exp.rm.epochs))
    with session.probe.phase("eval"):
        after = pair_metrics(trainer.model, tok, eval_pairs, exp.rm.batch_size)
    session.log(result.global_step, {f"eval/{k}": v for k, v in after.items()})
    adapter = session.save_adapter(trainer.model, tok)
    return session.finish({
        "metrics": {"eval_accuracy_before": before["accuracy"], **{f"eval_{k}": v for k, v in after.items()},
                    "train_loss": result.training_loss, "train_steps": result.global_step},
        "reward_stats": {"mean": after["reward_mean"], "std": after["reward_std"]},
        "throughput": throughput,
        "model": {**sft["model"], "adapter": str(adapter), "warm_start": warm, **models.trainable_report(model)},
        "data": {"train": len(pairs), "eval": len(eval_pairs)},
    })
