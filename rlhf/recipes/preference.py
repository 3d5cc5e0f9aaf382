"""The one skeleton of the stages on TRL's preference trainers (DPO, KTO): the plan's rows into the trainer, a
held-out evaluation before and after training, the adapter saved, the held-out generation check against SFT and its
collapse flags, the summary. What differs per stage is a Method: TRL's trainer and config classes, the columns of
its rows, the section's loss settings as TRL's arguments and what it reports. A third preference stage on a TRL
trainer (ORPO, SimPO through CPO) is then its section, a Method (its loss choice) and a registry entry
(docs/architecture.md, "Adding a stage")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from datasets import Dataset

from rlhf.infra import dist
from rlhf.maths import guard
from rlhf.rl import checks
from rlhf.inputs import data, models
from rlhf.experiment.config import Experiment
from rlhf.runs.runtime import Plan, Session
from rlhf.recipes import trainers
from rlhf.recipes.trainers import RecordCallback, Settings, continuing_sft, run, training_args


@dataclass(frozen=True)
class Method:
    """What one preference stage puts into the skeleton."""

    trainer: type
    """TRL's trainer class (or a subclass of it)."""
    config: type
    """TRL's config class of that trainer."""
    columns: tuple[str, ...]
    """The columns of the trainer's rows (TRL's data format for it)."""
    eval_keys: tuple[str, ...]
    """What the trainer's evaluation reports, kept as the summary's eval_<key> (a / in a key becomes _)."""
    before: str
    """The one of them also kept from the evaluation before training (eval_<key>_before)."""
    args: Callable[[object, str], dict]
    """The section's own settings as TRL config arguments, from (section, where: the config's name for errors)."""
    rates: tuple[str, ...] = ()
    """Those of eval_keys that are rates of the held-out rows: each with its interval, eval_<key>_ci95 (TRL averages
    the batches' rates: guard.batch_mean_wilson)."""
    tokens: Callable[[object, object], float | None] = lambda trainer, o: None
    """The trained tokens counted from the data set (trainer, section) where the trainer keeps no count."""
    counts: Callable[[list[dict]], dict] = lambda rows: {}
    """The summary's data counts beside train and eval (KTO: desirable and undesirable rows)."""
    unit: str = "rows"
    """What one of its rows is, in messages (DPO: pairs)."""
    notes: Callable[[object, str], list[str]] = lambda o, name: []
    """What the section (its name) sets that TRL runs but that changes nothing: the stage's warnings, said as it
    starts (DPO: trl_names.dpo_option_notes)."""


def trainer_args(method: Method, ts: Settings, o, session: Session):
    """The method's TRL config for its section `o`: the TRL glue's settings `ts`, the section's own and its loss
    settings (method.args)."""
    return training_args(method.config, ts, o, session, **method.args(o, ts.where), max_length=ts.max_length)


def build_trainer(method: Method, ts: Settings, o, session: Session, sft: dict, tok, train_rows: list[dict],
                  eval_rows: list[dict]):
    """The method's TRL trainer on the SFT adapter (trainers.continuing_sft) with its section `o`'s settings and the
    TRL glue's `ts`."""
    def rows(rs: list[dict]) -> Dataset:
        return Dataset.from_list([{k: r[k] for k in method.columns} for r in rs])

    def make(model, peft_config):
        args = trainer_args(method, ts, o, session)
        return method.trainer(model=model, args=args, processing_class=tok, peft_config=peft_config,
                              train_dataset=rows(train_rows), eval_dataset=rows(eval_rows),
                              callbacks=[RecordCallback(session)])
    return continuing_sft(make, ts, sft, tok, o.reference)


def train(method: Method, o, plan: Plan, exp: Experiment, resume: bool = True) -> dict:
    """Run the stage `plan` prepared with the settings of its section `o` (reference, max_kl_ref, min_terminated and
    the training settings); its summary. What it reads of the experiment `exp` beyond its section is resolved first,
    before anything loads: the TRL glue's settings, the held-out check's (with the latest reward model run, whose
    adapters score too) and the session."""
    d = plan.data
    ts, check_plan = trainers.settings(exp), checks.plan(exp, plan.stage, d.splits.eval[: exp.eval.prompts])
    _, rm, rm_warning = checks.latest_rm(exp, plan.stage, *plan.upstream["sft"], d.tok)
    if rm is None and not rm_warning and d.judge_pairs:  # held out for a judge no RM run has trained yet
        rm_warning = (f"{plan.stage}: {len(d.judge_pairs)} of the pool's pairs (data.judge_fraction = "
                      f"{exp.data.judge_fraction}) are held out for the RM stage's judge and not trained on, and there "
                      f"is no reward model run yet; set data.judge_fraction=0 if you will not run `make rm`")
    skipped = data.skipped_said(plan.stage, plan.inputs, plan.inputs.get("data"),
                                method.counts(d.train_rows), other=("sft", "prompts"))
    notes = [w for note in method.notes(o, plan.stage) for w in dist.warn(f"{plan.stage}: {note}")]
    warnings = (notes + dist.warn(rm_warning) + dist.warn(skipped)
                + checks.said(check_plan, d.splits.eval[: exp.eval.prompts], d.tok))
    session = Session.start(exp, plan, resume=resume)
    with session.probe.phase("load"):
        trainer = build_trainer(method, ts, o, session, d.sft, d.tok, d.train_rows, d.eval_rows)
    said, repeats = trainers.ready(trainer, plan.stage, method.unit, (ts.max_length, d.train_rows, d.eval_rows))
    warnings += said
    with session.probe.phase("eval"):
        before = trainer.evaluate()
    result, throughput = run(session, trainer, method.tokens(trainer, o))
    with session.probe.phase("eval"):
        after = trainer.evaluate()
    model = trainer.model
    adapter = session.save_adapter(model, d.tok, selected_adapters=["default"])
    metrics = {f"eval_{k.replace('/', '_')}": after.get(f"eval_{k}") for k in method.eval_keys}
    metrics[f"eval_{method.before.replace('/', '_')}_before"] = before.get(f"eval_{method.before}")
    rows, ranks = len(trainer.eval_dataset), dist.world_size()
    for k in method.rates:
        if (rate := after.get(f"eval_{k}")) is not None:
            batch = trainer.args.per_device_eval_batch_size * ranks
            metrics[f"eval_{k.replace('/', '_')}_ci95"] = guard.batch_mean_wilson(rate, rows, batch, ranks)
            metrics[f"eval_{k.replace('/', '_')}_n"] = rows  # held-out pairs
            metrics[f"eval_{k.replace('/', '_')}_n_effective"] = round(guard.batch_mean_n(rows, batch, ranks), 1)
    check = {}
    if checks.can_check(check_plan):  # the held-out generation check is rank 0's (the ranks hold the same adapter)
        with session.probe.phase("eval"):
            check = checks.preference_check(check_plan, o.reference, model, d.tok, d.sft,
                                            d.splits.eval[: check_plan.eval.prompts], rm)
    flags = checks.collapse_flags(plan.stage, check, o.max_kl_ref, o.min_terminated)
    for f in flags:
        dist.warn(f)
    metrics.update(check)
    session.log(result.global_step, {f"eval/{k}": v for k, v in metrics.items()})
    return session.finish({
        "metrics": {**metrics, "train_loss": result.training_loss, "train_steps": result.global_step},
        "flags": flags,
        "warnings": warnings,
        "throughput": throughput,
        "model": {**d.sft["model"], "adapter": str(adapter), "reference": o.reference,
                  **models.trainable_report(model)},
        "data": {"train": len(d.train_rows), "trained": len(trainer.train_dataset), **repeats,
                 **method.counts(d.train_rows), "eval": len(d.eval_rows)},
    })
