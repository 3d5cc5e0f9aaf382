"""The glue between a stage's config and TRL's trainers (SFT, RM, DPO): training arguments from a TrainConfig, the
callback that streams the trainer's logs into the run record and stops on SIGTERM, and the workarounds each naming
the library version it targets. Our own online RL loops (ppo.py, grpo.py) do not use it."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback, TrainerState
from transformers.trainer_utils import TrainOutput

from rlhf.infra import dist, faults
from rlhf.runs import lineage, records
from rlhf.inputs import models
from rlhf.experiment import stages
from rlhf.experiment.config import Experiment
from rlhf.experiment.sections import LoraConfig, QuantizationConfig, TrainConfig
from rlhf.runs.records import StageInputError
from rlhf.runs.runtime import Interrupted, Session, resume_state, stop_requested


def unprepare_after_eval(trainer) -> None:
    """transformers 5 / accelerate 1.x: an evaluate() before train() marks the model prepared (evaluation mode, not
    wrapped); accelerate then skips
    the DDP wrap at train time and each rank would train on its own shard without averaging gradients. Clear the
    mark so train() wraps the model (data parallel only)."""
    if dist.active() and trainer.model_wrapped is trainer.model:
        trainer.model._is_accelerate_prepared = False
        trainer.accelerator._models[:] = [m for m in trainer.accelerator._models if m is not trainer.model]


def restore_tokens(trainer, saved: dict) -> None:
    """TRL 1.16's count of the tokens trained (its `num_tokens` metric), as it was at the checkpoint whose resume state
    is `saved`: its trainers do not keep it in their checkpoints (RecordCallback does, in the resume state)."""
    tokens = saved.get("trl_tokens")
    if tokens is not None:
        trainer._total_train_tokens = tokens


def _prior_loss(saved: dict) -> float:
    """The loss summed over the steps before the checkpoint (its resume state `saved`) that this sitting's trainer
    does not count again: all of them, less those since the last log before it, which restore_unlogged hands back to
    the trainer to log."""
    losses = (saved.get("unlogged") or {}).get("loss") or [0.0]
    return saved["total_loss"] - sum(losses) / len(losses)


def _full_train_loss(trainer, saved: dict) -> float:
    """transformers averages the loss over the steps of this train() call only; a resumed run (its checkpoint's
    resume state `saved`) reports the average over all its steps, as an uninterrupted one does (loss sum before the
    checkpoint + sum since, / steps)."""
    return (_prior_loss(saved) + trainer._total_loss_scalar) / max(trainer.state.global_step, 1)


def restore_unlogged(trainer, saved: dict) -> None:
    """What the trainer had gathered since its last log when the checkpoint (its resume state `saved`) was written
    (a stop requested between logging steps): its loss sum (this rank's), the steps it spans, and TRL's per-step
    metrics, handed back, so the first log after the resume averages the same steps, with the same figures, as the
    uninterrupted run's."""
    unlogged = saved.get("unlogged")
    if not unlogged or not unlogged["steps"]:
        return
    if hasattr(trainer, "_tr_loss"):  # inside train() (ended_at's run takes no step: no loss to log)
        trainer._tr_loss += unlogged["loss"][dist.rank()]
        trainer._globalstep_last_logged = trainer.state.global_step - unlogged["steps"]
    if hasattr(trainer, "_metrics"):
        trainer._metrics["train"].update({k: list(v) for k, v in unlogged["metrics"].items()})


def _unlogged(trainer, state) -> dict:
    """What restore_unlogged hands back: every rank's loss since the last log (a collective: every rank calls it)."""
    losses = dist.gather_to_main(trainer._tr_loss.item())
    metrics = getattr(trainer, "_metrics", {}).get("train", {})
    return {"steps": state.global_step - trainer._globalstep_last_logged, "loss": losses,
            "metrics": {k: list(v) for k, v in metrics.items()}}


class RecordCallback(TrainerCallback):
    """Streams the trainer's logs, with the memory probe's figures, into the run record and tracker; writes the
    resume state next to each checkpoint; asks the trainer to checkpoint and stop once a stop is requested."""

    def __init__(self, session: Session, phase: str = "train", member: str = ""):
        """`member`: a second model trained from scratch in the same run (the RM stage's judge or an ensemble
        member): its logs are prefixed `<member>/` and it does not resume from the session's checkpoint."""
        self.session, self.phase, self.member = session, phase, member
        self.trainer = None
        self.resumed = session.checkpoint is not None and not member
        self.saved = resume_state(session.checkpoint) if self.resumed else {}  # the checkpoint's resume state

    def on_step_begin(self, args, state, control, **kwargs):
        self.session.probe.switch("forward_backward")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.session.probe.switch("optimizer")

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = dict(logs or {})
        if "train_loss" in logs and self.resumed and self.trainer is not None:
            logs["train_loss"] = _full_train_loss(self.trainer, self.saved)
        if self.member:
            self.session.log(state.global_step, {f"{self.member}/{k}": v for k, v in logs.items()},
                             member=self.member)
            return
        mem = self.session.probe.read()
        self.session.log(state.global_step, {**logs, **{f"memory/{k}": v for k, v in mem.items()}})

    def on_train_begin(self, args, state, control, **kwargs):
        if self.resumed and self.trainer is not None:
            restore_tokens(self.trainer, self.saved)
            restore_unlogged(self.trainer, self.saved)

    def on_step_end(self, args, state, control, **kwargs):
        self.session.probe.switch(self.phase)  # eval, logging and data loading between steps
        self.session.probe.sample(state.global_step)
        if stop_requested():
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        unlogged = _unlogged(self.trainer, state) if self.trainer is not None else None  # every rank's part
        if not dist.is_main():  # the trainer's checkpoint is rank 0's; so is its resume state
            return
        path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        total = None
        if self.trainer is not None:  # the loss summed over every step so far (logged + not yet logged, the ranks'
            total = self.trainer._total_loss_scalar + sum(unlogged["loss"]) / len(unlogged["loss"])  # mean, as logged)
            if self.resumed:
                total += _prior_loss(self.saved)
        records.write_json(path / "rlhf_state.json", {
            "step": state.global_step, "total_loss": total, "metrics_lines": self.session.run.lines,
            "trl_tokens": getattr(self.trainer, "_total_train_tokens", None), "unlogged": unlogged})


def guard_checkpoints(trainer, session: Session) -> None:
    """transformers 5.23: Trainer._save_checkpoint writes checkpoint-N (weights, optimizer, scheduler, RNG, trainer
    state); RecordCallback.on_save then adds our resume state, which marks it complete. A full disk, a read-only
    directory or no memory during that write raises faults.WriteFault naming checkpoint-N and the size of the last
    complete one; the half-written checkpoint-N (no resume state: never resumed from) is removed."""
    save = trainer._save_checkpoint

    def guarded(model, trial):
        path = Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}"
        done = lineage.latest_checkpoint(session.run.dir)
        with faults.writing(path, "checkpoint", needed=faults.tree_bytes(done[0]) if done else None, partial=path):
            save(model, trial)

    trainer._save_checkpoint = guarded


@dataclass(frozen=True)
class Settings:
    """What the TRL-backed stages (SFT, RM, DPO, KTO) read from the experiment beyond their own section, resolved once
    (settings): how the base loads, the adapter's LoRA section, the seed and determinism, where the config came from
    (for errors) and the longest sequence."""

    loading: models.Loading
    lora: LoraConfig
    seed: int
    deterministic: bool
    where: str
    """The config's name in errors (its file, or "config")."""
    max_length: int
    """data.max_length."""


def settings(exp: Experiment) -> Settings:
    return Settings(models.loading(exp), exp.lora, exp.seed, exp.deterministic, exp.source or "config",
                    exp.data.max_length)


def training_args(cls, ts: Settings, t: TrainConfig, session: Session, **extra):
    """TRL/transformers training arguments from the session's stage's TrainConfig `t` and the settings `ts`; `extra`
    adds to or replaces them."""
    m, q, dev = ts.loading.model, ts.loading.quantization, ts.loading.device
    # autocast to bf16 wherever the model computes in it, CPU too (else bf16 layers meet float32 norms and heads)
    bf16 = m.dtype == "bfloat16" or (q.load_in_4bit and q.compute_dtype == "bfloat16")
    st = stages.get(session.run.stage)  # the batch-size field's name, for errors
    per_device = dist.per_device(getattr(t, st.batch), f"{st.section}.{st.batch}", ts.where)
    kwargs = dict(
        output_dir=str(session.run.dir / "checkpoints"),
        learning_rate=t.learning_rate, num_train_epochs=t.epochs, max_steps=t.max_steps,
        per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
        gradient_accumulation_steps=t.grad_accum, optim=t.optim, lr_scheduler_type=t.lr_scheduler,
        warmup_steps=t.warmup_ratio, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_epsilon=t.adam_epsilon,  # to every optim alike
        logging_steps=t.logging_steps, eval_strategy="steps" if t.eval_steps else "no",
        eval_steps=t.eval_steps or None, save_strategy="steps" if t.save_steps else "no",
        save_steps=t.save_steps or 500, save_only_model=False, report_to="none", seed=ts.seed, data_seed=ts.seed,
        # checkpointing is the model's own (models.load_base); by transformers 5.23's name, as TRL's configs default
        # the deprecated gradient_checkpointing to True
        full_determinism=ts.deterministic, bf16=bf16, use_cpu=dev.type == "cpu", activation_checkpointing=False,
        dataloader_num_workers=0,
        disable_tqdm=False,
        # data parallel: every trainable parameter (LoRA, a reward head) takes part in each forward pass; what
        # transformers chooses with gradient checkpointing (the GPU experiments), so tiny runs DDP as they do
        ddp_find_unused_parameters=False,
    )
    return cls(**{**kwargs, **extra})


def continuing_sft(make, ts: Settings, sft: dict, tok, reference: str):
    """A TRL preference trainer (DPOTrainer, KTOTrainer) whose policy continues the SFT run's adapter on one base,
    `make(model, peft_config)` building it: with `reference` sft the SFT adapter trains and the trainer adds a frozen
    copy of it ("ref") as the reference; with base a fresh adapter, warm-started from the SFT one, trains against the
    base with adapters disabled. Its trainable parameters stay in the compute dtype (adapter_dtype_as_compute)."""
    base = models.load_base(ts.loading, sft["model"]["base_path"], "causal", tok)
    adapter = Path(sft["model"]["adapter"])
    if reference == "sft":  # TRL adds a frozen copy of this adapter, named "ref", as the reference
        model, peft_config = models.load_adapter(base, adapter, "default", trainable=True), None
    else:  # a fresh adapter is wrapped by TRL; the reference is the base with adapters disabled
        model, peft_config = base, models.lora_config(ts.lora, tied=models.tied_embeddings(base))
    snapshot = trainable_snapshot(model)
    with models.copying_tied_adapters():  # TRL's "ref" is a copy of the SFT adapter by its config
        trainer = make(model, peft_config)
    adapter_dtype_as_compute(trainer, ts.loading.quantization, snapshot)
    if peft_config is not None:
        models.warm_start(trainer.model, adapter)
    return trainer


def pair_tokens(dataset, epochs: float) -> float:
    """Tokens of a preference data set's sequences, every epoch: chosen + rejected, each with its prompt (TRL 1.16's
    DPO data keeps the prompt apart, in prompt_ids, and trains it once in each sequence; the reward model's
    chosen_ids and rejected_ids are whole sequences)."""
    prompts = dataset["prompt_ids"] if "prompt_ids" in dataset.column_names else [[]] * len(dataset)
    return sum(2 * len(p) + len(a) + len(b)
               for p, a, b in zip(prompts, dataset["chosen_ids"], dataset["rejected_ids"])) * epochs


def left_out(who: str, left: int, total: int, rows: str, why: str) -> str | None:
    """What a TRL trainer's filter left out of `total` `rows` (`left` of them, for the reason `why`), said as a
    warning; None when it left none out. The stage stops on it (StageInputError) when it left out all."""
    if not left:
        return None
    return (f"{who}: {'all' if left == total else f'{left} of'} {total} {rows} {why}; raise data.max_length to "
            f"keep them")


def kept(stage: str, unit: str, max_length: int, train: tuple[list, object], held_out: tuple[list, object],
         eos: int | None = None) -> list:
    """What TRL's trainers left out of the (rows, data set) of `train` and `held_out`, said: rows whose prompt alone
    fills max_length (SFT's, DPO's and KTO's: TRL 1.16 keeps a sequence's start, so none of their response would be
    left to train on); with none left of rows there were, a StageInputError. Then the training rows it keeps whose end
    it cuts (cut_at_max_length), said apart: their responses lose their end and `eos`, what teaches a policy to stop."""
    why = (f"have a prompt of data.max_length = {max_length} tokens or more, and TRL's trainer leaves them out (it "
           f"keeps a sequence's start, so none of their response would be left)")
    warnings = []
    for what, (rows, dataset) in (("training", train), ("held-out", held_out)):
        said = left_out(stage, len(rows) - len(dataset), len(rows), f"{what} {unit}", why)
        if rows and not len(dataset):
            raise StageInputError(said)
        warnings += dist.warn(said)
    cut = cut_at_max_length(train[1], max_length, eos)
    if cut:
        what = ("their responses are trained on without their ending (and EOS), which teaches the policy not to stop"
                if stage == "sft" else "the preference is learned from responses without their ending (and EOS)")
        warnings += dist.warn(
            f"{stage}: {cut} of the {len(train[1])} training {unit} it keeps are longer than data.max_length = "
            f"{max_length} tokens, and TRL's trainer cuts their end: {what}; raise data.max_length to keep them whole")
    return warnings


def cut_at_max_length(dataset, max_length: int, eos: int | None) -> int:
    """How many rows of a TRL 1.16 data set keep only their start: SFT's sequences, truncated to max_length already
    (they end there without `eos`); DPO's pairs whose chosen or rejected sequence (prompt and response) is longer
    than it, KTO's completions (the collator cuts them as it batches). 0 for another data set (the RM's: its trainer
    leaves such pairs out)."""
    cols = dataset.column_names
    if "input_ids" in cols:
        return sum(len(ids) == max_length and ids[-1] != eos for ids in dataset["input_ids"])
    if {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(cols):
        return sum(len(p) + max(len(c), len(r)) > max_length
                   for p, c, r in zip(dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"]))
    if {"prompt_ids", "completion_ids"} <= set(cols):
        return sum(len(p) + len(c) > max_length for p, c in zip(dataset["prompt_ids"], dataset["completion_ids"]))
    return 0


def repeated(stage: str, unit: str, trainer) -> tuple[list[str], dict]:
    """The training `unit`s the ranks' data loaders take twice in each epoch, said as a warning, and the summary's
    count of them ({} when none): under N ranks each takes whole per-rank batches (accelerate's even_batches), so a
    last global batch short of the stage's batch size is filled with rows from the epoch's start (one process takes
    it short), ceil(rows / batch) x batch - rows of them."""
    rows, ranks = len(trainer.train_dataset), dist.world_size()
    batch = trainer.args.per_device_train_batch_size * ranks
    twice = -rows % batch if ranks > 1 else 0
    if not twice:
        return [], {}
    st = stages.get(stage)
    key = f"{st.section}.{st.batch}"
    fits = next((b for b in range(batch - ranks, 0, -ranks) if rows % b == 0), None)
    return dist.warn(f"{stage}: {twice} of the {rows} training {unit} are trained twice in each epoch: {ranks} ranks "
                     f"take whole batches of {key} / {ranks} = {batch // ranks} rows, and the last batch holds "
                     f"{rows % batch}, filled with {unit} from the epoch's start (one process trains each once); "
                     f"a {key} that divides {rows}{f' ({key}={fits})' if fits else ''} trains each once"
                     ), {"repeated_per_epoch": twice}


def ready(trainer, stage: str, unit: str, rows: tuple[int, list, list] | None) -> tuple[list[str], dict]:
    """A built TRL trainer readied for `stage` before its first evaluation: what it left out of `rows` ((max_length,
    the training rows, the held-out rows): kept; None: nothing to check), what the ranks train twice in each epoch
    (repeated) and its progress bars named (named_bars). Returns (the warnings, the summary's count of repeats)."""
    warnings = kept(stage, unit, rows[0], (rows[1], trainer.train_dataset), (rows[2], trainer.eval_dataset),
                    trainer.processing_class.eos_token_id) if rows else []
    twice, repeats = repeated(stage, unit, trainer)
    named_bars(trainer, stage)
    return warnings + twice, repeats


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def trainable_snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def adapter_dtype_as_compute(trainer, q: QuantizationConfig, snapshot: dict | None = None):
    """TRL (1.16: its trainers' peft preparation) casts trainable QLoRA parameters to bf16 whatever the compute
    dtype; keep them in the quantization section `q`'s compute_dtype instead (float32 on CPU, where bf16 matmuls are
    ~50x slower), restoring the exact values from `snapshot` (taken before the trainer was built) so nothing is
    rounded on the way."""
    if q.load_in_4bit:
        dtype = models.DTYPES[q.compute_dtype]
        snapshot = snapshot or {}
        for n, p in trainer.model.named_parameters():
            if p.requires_grad:
                p.data = snapshot[n].to(dtype) if n in snapshot else p.data.to(dtype)
    return trainer


class BarOnly(ProgressCallback):
    """transformers' progress bars, each named (`<stage> train`, `<stage> held-out eval`), without its printout of
    every log dict (they are in the run's metrics.jsonl and, with tracking, W&B): what a user's console shows is the
    bars and the stage summary."""

    def __init__(self, stage: str):
        super().__init__()
        self.stage = stage

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if self.training_bar is not None:
            self.training_bar.set_description(f"{self.stage} train")

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        new = self.prediction_bar is None
        super().on_prediction_step(args, state, control, eval_dataloader=eval_dataloader, **kwargs)
        if new and self.prediction_bar is not None:
            self.prediction_bar.set_description(f"{self.stage} held-out eval")

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


def named_bars(trainer, stage: str) -> None:
    """The trainer's progress bars named for `stage` and without a printed dict per logging step (BarOnly), from
    the held-out evaluation before training on; none where transformers shows none (disable_tqdm)."""
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(BarOnly(stage))


def trained_tokens(trainer, start: float, fallback: float | None) -> tuple[float, str]:
    """(tokens, how counted) of one trainer.train() call: every token of every sequence it trained on, prompt and
    response, chosen and rejected, padding not (TRL 1.16's SFT, reward and DPO trainers add up each training batch's
    attention mask, over every rank, in `_total_train_tokens`, which starts this call at `start`); `fallback` (the
    data set's tokens x epochs) for a trainer without that count."""
    if hasattr(trainer, "_total_train_tokens"):
        return trainer._total_train_tokens - start, "trainer"
    return fallback or 0.0, "dataset x epochs"


def ended_at(trainer, checkpoint: Path, saved: dict) -> TrainOutput | None:
    """The train() result of a run whose `checkpoint` is at its last step (the run's max_steps), its weights and
    state loaded into `trainer`: transformers resumed there would train one step past it (it looks for the end only
    after a step), a step an uninterrupted run never took (`saved`: the checkpoint's resume state). None: training
    goes on from it."""
    state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
    if not 0 < state.max_steps <= state.global_step:  # the run's steps, max_steps or its epochs' (a fraction too)
        return None
    trainer._load_from_checkpoint(str(checkpoint))
    # no step since the checkpoint: the loss it had not logged is all this sitting adds (_full_train_loss)
    trainer.state, trainer._total_loss_scalar = state, saved["total_loss"] - _prior_loss(saved)
    restore_tokens(trainer, saved)
    restore_unlogged(trainer, saved)  # TRL's step metrics since the last log: its last line has them
    loss = saved["total_loss"] / max(state.global_step, 1)
    # the line train() logs as it ends, as the uninterrupted run's record has it (no time spent, no step run here),
    # in training mode, where TRL adds its training metrics
    training = trainer.model.training
    trainer.model.train()
    trainer.log({"train_runtime": 0.0, "train_samples_per_second": 0.0, "train_steps_per_second": 0.0,
                 "total_flos": state.total_flos, "train_loss": loss})
    trainer.model.train(training)
    return TrainOutput(state.global_step, loss, {})


def run(session: Session, trainer, tokens: float | None = None, resume: bool = True) -> tuple[object, dict]:
    """trainer.train() under the "train" memory phase (from the session's checkpoint when resuming, unless not
    `resume`: a second model trained in the same run); returns its result, with the training loss averaged over
    every step of the run, and the throughput: `trained_tokens_per_s`, every token of every sequence trained in this
    call (prompt and response; chosen and rejected) over its wall time, as published single-GPU anchors count
    (`trained_tokens`; `tokens`, the data set's count, only where the trainer keeps none), the wall time including
    work the trainer did for training before train() (DPO's reference precompute: `reference_precompute_s`). Raises
    Interrupted after a stop request saved a checkpoint."""
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, RecordCallback):
            cb.trainer = trainer
    guard_checkpoints(trainer, session)
    unprepare_after_eval(trainer)
    t0 = time.time()
    checkpoint = session.checkpoint if resume else None
    saved = resume_state(checkpoint) if checkpoint else {}
    start = saved.get("trl_tokens") or 0  # RecordCallback restores it
    ended = checkpoint and ended_at(trainer, checkpoint, saved)
    with session.probe.phase("train"):
        result = ended or trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    dt = time.time() - t0
    if checkpoint and not ended:
        result = result._replace(training_loss=_full_train_loss(trainer, saved))
    if stop_requested() and trainer.state.global_step < trainer.state.max_steps:
        raise Interrupted(f"{session.run.stage} stopped at step {trainer.state.global_step} with a checkpoint in "
                          f"{session.run.dir / 'checkpoints'}; rerun the same command to resume")
    n, counted = (0, "none: resumed at its last step") if ended else trained_tokens(trainer, start, tokens)
    before = getattr(trainer, "reference_precompute_s", 0.0)
    out = {"train_time_s": round(dt, 2), "trained_tokens": int(n), "trained_tokens_per_s": round(n / (dt + before), 1),
           "trained_tokens_counted_by": counted}
    if before:
        out["reference_precompute_s"] = round(before, 2)
    return result, out
