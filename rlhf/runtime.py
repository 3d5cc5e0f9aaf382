"""What every stage shares: seeding, the run record + tracker + memory probe bundle (with lineage and resume), TRL
training arguments, the callback that streams trainer logs into the record, and stopping cleanly on SIGTERM."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import TrainerCallback

from . import data, dist, lineage, memory, memplan, models, records, stages, tracking
from .config import Experiment, TrainConfig


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python, NumPy and torch (every device); `deterministic` also restricts torch to deterministic
    algorithms (cuBLAS needs CUBLAS_WORKSPACE_CONFIG for that, set here unless the user set it)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = deterministic
    torch.use_deterministic_algorithms(deterministic)


class Interrupted(RuntimeError):
    """A stage stopped on SIGTERM/SIGINT after saving a checkpoint; rerunning the same command resumes it."""


class _Stop:
    """Set by the signal handler; the training loops poll it between steps."""

    requested = False
    signum = 0


def install_stop_handler() -> None:
    """First SIGTERM/SIGINT: ask the running stage to checkpoint and stop. A second one exits at once."""
    def handler(signum, frame):
        if _Stop.requested:
            sys.exit(128 + signum)
        _Stop.requested, _Stop.signum = True, signum
        print(f"\nsignal {signum}: saving a checkpoint, then stopping (rerun the same command to resume)",
              file=sys.stderr, flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def stop_requested() -> bool:
    return _Stop.requested


@dataclass
class Inputs:
    """What a stage's prepare() loaded for its train(): each stage fills the fields it consumes, the rest stay None."""

    splits: data.Splits | None = None
    """The data source's splits (the pool, held-out rows, what was skipped)."""
    tok: object = None
    """The tokenizer of the upstream SFT run (SFT itself builds or loads its own)."""
    sft: dict | None = None
    """The upstream SFT run's summary (its base path and adapter)."""
    rm: dict | None = None
    """The upstream reward model run's summary (None: the stage scores without one)."""
    train_rows: list[dict] | None = None
    """SFT: training examples ({prompt, completion})."""
    eval_rows: list[dict] | None = None
    """SFT: held-out examples."""
    pairs: list[dict] | None = None
    """RM, DPO: training preference pairs."""
    eval_pairs: list[dict] | None = None
    """RM, DPO: held-out preference pairs."""
    prompts: list[dict] | None = None
    """Online RL: training prompt rows (with their columns)."""


@dataclass
class Plan:
    """What a stage will consume, known before any model is loaded: the record's `inputs`, the example ids used,
    the upstream runs, and the resulting lineage (fingerprint). `data` carries what was loaded to the stage."""

    stage: str
    inputs: dict
    lineage: dict
    upstream: dict = field(default_factory=dict)
    data: Inputs = field(default_factory=Inputs)

    @classmethod
    def make(cls, exp: Experiment, stage: str, inputs: dict, data_ids: dict, upstream: dict | None = None,
             **loaded):
        """`loaded`: the fields of Inputs this stage fills."""
        return cls(stage, inputs, lineage.compute(exp, stage, data_ids, upstream), upstream or {}, Inputs(**loaded))


@dataclass
class Session:
    """A stage run in progress: its record directory, tracker and memory probe. `checkpoint` is the checkpoint a
    resumed run continues from (None for a fresh run)."""

    exp: Experiment
    run: records.Run
    tracker: tracking.NoOpTracker
    probe: memory.MemoryProbe
    checkpoint: Path | None = None
    resumed_step: int = 0

    @classmethod
    def start(cls, exp: Experiment, stage: str | Plan, inputs: dict | None = None, resume: bool = True) -> "Session":
        """Seed, then open the run record: the newest unfinished run with the same fingerprint that has a checkpoint
        (resume=True), or a new run directory."""
        plan = stage if isinstance(stage, Plan) else None
        stage = plan.stage if plan else stage
        if stage in stages.training():
            memplan.preflight(exp, stage)  # a stage predicted over budget is refused before anything is loaded
        dist.init(exp)  # data parallel (torchrun / accelerate launch): join the process group first
        seed_everything(exp.seed, exp.deterministic)
        if plan:
            plan.lineage["determinism"].update(device=models.device(exp).type,
                                               torch_deterministic=torch.are_deterministic_algorithms_enabled())
        # data parallel: rank 0 decides which run to resume (every rank then continues the same one)
        found = dist.broadcast_object(lineage.find_resumable(exp, stage, plan.lineage["fingerprint"])
                                      if plan and resume and dist.is_main() else None)
        checkpoint, step, keep = None, 0, 0
        if found:
            run_dir, checkpoint, step = found
            keep = resume_state(checkpoint)["metrics_lines"]
            if dist.is_main():
                print(f"resuming {run_dir} from {checkpoint.name}", file=sys.stderr, flush=True)
        run = records.Run(exp, stage, plan.inputs if plan else inputs, plan.lineage if plan else None,
                          resume=(run_dir, keep) if found else None)
        m = exp.memory
        probe = memory.MemoryProbe(models.device(exp), m.budget_gb, m.enforce, m.cap_to_budget, m.track_tensors)
        tracker = tracking.make(exp, stage, run.dir) if dist.is_main() else tracking.NoOpTracker()
        return cls(exp, run, tracker, probe, checkpoint, step)

    def log(self, step: int, metrics: dict) -> None:
        if step < self.resumed_step:  # already in the record from before the checkpoint (e.g. the "before" eval)
            return
        metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))}
        self.run.log(step, metrics)
        self.tracker.log(metrics, step)

    def train(self, trainer, tokens: float) -> tuple[object, dict]:
        """trainer.train() under the "train" memory phase (from the checkpoint when resuming); returns its result,
        with the training loss averaged over every step of the run, and the throughput. Raises Interrupted after a
        stop request saved a checkpoint."""
        for cb in trainer.callback_handler.callbacks:
            if isinstance(cb, RecordCallback):
                cb.trainer = trainer
        unprepare_after_eval(trainer)
        t0 = time.time()
        with self.probe.phase("train"):
            result = trainer.train(resume_from_checkpoint=str(self.checkpoint) if self.checkpoint else None)
        dt = time.time() - t0
        if self.checkpoint:
            result = result._replace(training_loss=_full_train_loss(trainer, self))
        if stop_requested() and trainer.state.global_step < trainer.state.max_steps:
            raise Interrupted(f"{self.run.stage} stopped at step {trainer.state.global_step} with a checkpoint in "
                              f"{self.run.dir / 'checkpoints'}; rerun the same command to resume")
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
        if self.checkpoint:
            summary["resumed_from"] = {"checkpoint": str(self.checkpoint), "step": self.resumed_step}
        if self.run.lineage and dist.is_main():
            adapter = summary.get("model", {}).get("adapter")
            self.run.lineage["adapter_sha256"] = lineage.adapter_sha256(adapter) if adapter else None
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


def resume_state(checkpoint: Path) -> dict:
    """What a checkpoint records about the run beyond the trainer's own state (metrics lines written, loss sum)."""
    if (checkpoint / "rlhf_state.json").exists():
        return json.loads((checkpoint / "rlhf_state.json").read_text())
    return {"metrics_lines": json.loads((checkpoint / "state.json").read_text())["metrics_lines"]}  # PPO's


def _full_train_loss(trainer, session: Session) -> float:
    """transformers averages the loss over the steps of this train() call only; a resumed run reports the average
    over all its steps, as an uninterrupted one does (loss sum before the checkpoint + sum since, / steps)."""
    prior = resume_state(session.checkpoint)["total_loss"]
    return (prior + trainer._total_loss_scalar) / max(trainer.state.global_step, 1)


class RecordCallback(TrainerCallback):
    """Streams the trainer's logs, with the memory probe's figures, into the run record and tracker; writes the
    resume state next to each checkpoint; asks the trainer to checkpoint and stop once a stop is requested."""

    def __init__(self, session: Session, phase: str = "train"):
        self.session, self.phase = session, phase
        self.trainer = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.session.probe.switch("forward_backward")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.session.probe.switch("optimizer")

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = dict(logs or {})
        if "train_loss" in logs and self.session.checkpoint and self.trainer is not None:
            logs["train_loss"] = _full_train_loss(self.trainer, self.session)
        mem = self.session.probe.read()
        self.session.log(state.global_step, {**logs, **{f"memory/{k}": v for k, v in mem.items()}})

    def on_train_begin(self, args, state, control, **kwargs):
        tokens = resume_state(self.session.checkpoint).get("trl_tokens") if self.session.checkpoint else None
        if tokens is not None and self.trainer is not None:  # TRL's SFT token counter is not in its checkpoint
            self.trainer._total_train_tokens = tokens

    def on_step_end(self, args, state, control, **kwargs):
        self.session.probe.switch(self.phase)  # eval, logging and data loading between steps
        self.session.probe.sample(state.global_step)
        if stop_requested():
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        if not dist.is_main():  # the trainer's checkpoint is rank 0's; so is its resume state
            return
        path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        total = None
        if self.trainer is not None:  # the loss summed over every step so far (logged + not yet logged)
            total = self.trainer._total_loss_scalar + self.trainer._tr_loss.item()
            if self.session.checkpoint:
                total += resume_state(self.session.checkpoint)["total_loss"]
        records.write_json(path / "rlhf_state.json", {
            "step": state.global_step, "total_loss": total, "metrics_lines": self.session.run.lines,
            "trl_tokens": getattr(self.trainer, "_total_train_tokens", None)})


def training_args(cls, exp: Experiment, t: TrainConfig, session: Session, **extra):
    """TRL/transformers training arguments from a stage's TrainConfig."""
    dev = models.device(exp)
    # autocast to bf16 wherever the model computes in it, CPU too (else bf16 layers meet float32 norms and heads)
    bf16 = exp.model.dtype == "bfloat16" or (exp.quantization.load_in_4bit and exp.quantization.compute_dtype == "bfloat16")
    stage = next((k for k in ("sft", "rm", "dpo") if getattr(exp, k) is t), "train")  # the section, for errors
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
        full_determinism=exp.deterministic, bf16=bf16, use_cpu=dev.type == "cpu", gradient_checkpointing=False,
        dataloader_num_workers=0,
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


def preference_plan(exp: Experiment, stage: str) -> Plan:
    """The inputs of a preference stage (RM, DPO): the SFT run it starts from and the pairs it trains and evaluates on."""
    splits = data.load(exp)
    sft_dir, sft, tok = upstream_sft(exp, stage)
    splits.render(tok)  # conversational records -> text with the SFT tokenizer's chat template
    pairs = splits.pairs(exp.data.pref_pairs)
    ids = {"train": [p["id"] for p in pairs], "eval": [p["id"] for p in splits.eval]}
    inputs = {"sft_run": str(sft_dir), "data": splits.source, "train_ids": ids["train"]}
    if splits.skipped:
        inputs["skipped"] = dict(splits.skipped)
    return Plan.make(exp, stage, inputs, ids,
                     {"sft": (sft_dir, sft)}, sft=sft, tok=tok, pairs=pairs, eval_pairs=splits.eval, splits=splits)
