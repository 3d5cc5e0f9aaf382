"""What every stage shares: seeding, the run record + tracker + memory probe bundle, TRL training arguments, and the
callback that streams trainer logs into the record."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import TrainerCallback

from . import dist, memory, memplan, models, records, tracking
from .config import Experiment, TrainConfig


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


@dataclass
class Session:
    """A stage run in progress: its record directory, tracker and memory probe."""

    exp: Experiment
    run: records.Run
    tracker: tracking.NoOpTracker
    probe: memory.MemoryProbe

    @classmethod
    def start(cls, exp: Experiment, stage: str, inputs: dict | None = None) -> "Session":
        if stage in memplan.STAGES:
            memplan.preflight(exp, stage)  # a stage predicted over budget is refused before anything is loaded
        dist.init(exp)  # data parallel (torchrun / accelerate launch): join the process group first
        seed_everything(exp.seed)
        run = records.Run(exp, stage, inputs)
        m = exp.memory
        probe = memory.MemoryProbe(models.device(exp), m.budget_gb, m.enforce, m.cap_to_budget, m.track_tensors)
        tracker = tracking.make(exp, stage, run.dir) if dist.is_main() else tracking.NoOpTracker()
        return cls(exp, run, tracker, probe)

    def log(self, step: int, metrics: dict) -> None:
        metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))}
        self.run.log(step, metrics)
        self.tracker.log(metrics, step)

    def train(self, trainer, tokens: float) -> tuple[object, dict]:
        """trainer.train() under the "train" memory phase; returns its result and the throughput."""
        unprepare_after_eval(trainer)
        t0 = time.time()
        with self.probe.phase("train"):
            result = trainer.train()
        dt = time.time() - t0
        return result, {"train_time_s": round(dt, 2), "tokens_per_s": round(tokens / dt, 1)}

    def save_adapter(self, model, tok, **kwargs) -> Path:
        adapter = self.run.dir / "adapter"
        if dist.is_main():  # the ranks hold the same weights: one copy
            model.save_pretrained(adapter, **kwargs)
            tok.save_pretrained(adapter)
        return adapter

    def finish(self, summary: dict) -> dict:
        self.probe.close()
        summary["memory"] = self.probe.summary()
        summary["world_size"] = dist.world_size()  # data-parallel ranks (the record is rank 0's)
        if dist.is_main():
            self.probe.plot(self.run.dir / "memory.png", f"{self.exp.name} / {self.run.stage} / {self.run.dir.name}")
        summary = self.run.finish(summary)
        self.tracker.summary(summary)
        self.tracker.finish()
        return summary


def unprepare_after_eval(trainer) -> None:
    """An evaluate() before train() marks the model prepared (evaluation mode, not wrapped); accelerate then skips
    the DDP wrap at train time and each rank would train on its own shard without averaging gradients. Clear the
    mark so train() wraps the model (data parallel only)."""
    if dist.active() and trainer.model_wrapped is trainer.model:
        trainer.model._is_accelerate_prepared = False
        trainer.accelerator._models[:] = [m for m in trainer.accelerator._models if m is not trainer.model]


class RecordCallback(TrainerCallback):
    """Streams the trainer's logs, with the memory probe's figures, into the run record and tracker."""

    def __init__(self, session: Session, phase: str = "train"):
        self.session, self.phase = session, phase

    def on_step_begin(self, args, state, control, **kwargs):
        self.session.probe.switch("forward_backward")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.session.probe.switch("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        self.session.probe.switch(self.phase)  # eval, logging and data loading between steps
        self.session.probe.sample(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        mem = self.session.probe.read()
        self.session.log(state.global_step, {**(logs or {}), **{f"memory/{k}": v for k, v in mem.items()}})


def training_args(cls, exp: Experiment, t: TrainConfig, session: Session, **extra):
    """TRL/transformers training arguments from a stage's TrainConfig."""
    dev = models.device(exp)
    bf16 = dev.type == "cuda" and (exp.model.dtype == "bfloat16" or exp.quantization.compute_dtype == "bfloat16")
    stage = session.run.stage
    per_device = dist.per_device(t.batch_size, f"{stage}.batch_size", exp.source or "config")
    return cls(
        output_dir=str(session.run.dir / "checkpoints"),
        learning_rate=t.learning_rate, num_train_epochs=t.epochs, max_steps=t.max_steps,
        per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
        gradient_accumulation_steps=t.grad_accum, optim=t.optim, lr_scheduler_type=t.lr_scheduler,
        warmup_steps=t.warmup_ratio, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
        logging_steps=t.logging_steps, eval_strategy="steps" if t.eval_steps else "no",
        eval_steps=t.eval_steps or None, save_strategy="steps" if t.save_steps else "no",
        save_steps=t.save_steps or 500, save_only_model=False, report_to="none", seed=exp.seed, data_seed=exp.seed,
        bf16=bf16, use_cpu=dev.type == "cpu", gradient_checkpointing=False, dataloader_num_workers=0,
        disable_tqdm=False, **extra,
    )


def pair_tokens(dataset, epochs: float) -> float:
    """Tokens a preference trainer processes: chosen + rejected, every epoch."""
    return sum(len(a) + len(b) for a, b in zip(dataset["chosen_ids"], dataset["rejected_ids"])) * epochs


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def trainable_snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def adapter_dtype_as_compute(trainer, exp: Experiment, snapshot: dict | None = None):
    """TRL casts trainable QLoRA parameters to bf16 whatever the compute dtype; keep them in the experiment's
    quantization.compute_dtype instead (float32 on CPU, where bf16 matmuls are ~50x slower), restoring the exact
    values from `snapshot` (taken before the trainer was built) so nothing is rounded on the way."""
    if exp.quantization.load_in_4bit:
        dtype = models.DTYPES[exp.quantization.compute_dtype]
        snapshot = snapshot or {}
        for n, p in trainer.model.named_parameters():
            if p.requires_grad:
                p.data = snapshot[n].to(dtype) if n in snapshot else p.data.to(dtype)
    return trainer


def upstream_sft(exp: Experiment, needed_by: str) -> tuple[Path, dict, object]:
    """The SFT run this stage starts from, its summary and tokenizer; refuses a missing or mismatched one."""
    sft_dir, sft = records.latest(exp, "sft", needed_by)
    adapter = Path(sft["model"]["adapter"])
    if not (adapter / "adapter_config.json").exists():
        raise records.StageInputError(f"{needed_by}: the SFT adapter {adapter} is missing (its run record is there, "
                                      f"the weights are not). Rerun `make sft`.")
    tok = models.load_tokenizer(str(adapter))
    records.check_same_base(exp, sft, "sft", needed_by, models.tokenizer_hash(tok))
    return sft_dir, sft, tok
