"""SFT stage: LoRA (on a 4-bit base where the experiment says so) trained with TRL's SFTTrainer on the chosen
responses, loss on the completion tokens only (TRL's default: sft.completion_only_loss). Reports eval loss and
perplexity before and after training (the loss alone with sft.loss_type dft)."""

from __future__ import annotations

from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from rlhf.rl import checks
from rlhf.inputs import data, models
from rlhf.infra import dist
from rlhf.experiment.config import Experiment
from rlhf.runs.runtime import Plan, Session
from rlhf.recipes.trainers import (RecordCallback, adapter_dtype_as_compute, perplexity, ready, run, settings,
                                   trainable_snapshot, training_args)


TRL_FIELDS = ("packing", "packing_strategy", "padding_free", "eval_packing", "shuffle_dataset", "completion_only_loss",
              "loss_type")
"""The sft section's fields that are TRL 1.16's SFTConfig's, by its names and defaults (passed to it as set)."""


def trl_args(o) -> dict:
    """The sft section `o`'s TRL fields as SFTConfig's arguments."""
    return {k: getattr(o, k) for k in TRL_FIELDS}


def sft_args(exp: Experiment, session: Session) -> SFTConfig:
    """TRL's SFTConfig of this run: the TRL glue's settings, the sft section's own and its TRL fields (trl_args)."""
    return training_args(SFTConfig, settings(exp), exp.sft, session, max_length=exp.data.max_length,
                         **trl_args(exp.sft))


def perplexities(loss_type: str, loss: float) -> dict:
    """{"perplexity": exp(loss)} for the NLL; nothing for loss_type dft, whose eval loss is no NLL."""
    return {} if loss_type == "dft" else {"perplexity": perplexity(loss)}


Groups = list[tuple[list[dict], tuple[str, ...]]]
"""Rows and the fields of each whose text a tokenizer built from the data must know."""


def vocabulary(train_rows: list[dict], eval_rows: list[dict], splits: data.Splits) -> tuple[Groups, Groups]:
    """The texts the tiny tokenizer is built from, (first, more): every word any stage reads, so that none becomes
    <unk> on one side of a pair only (a label the reward model, DPO and the judge could read). First, the words as the
    vocabulary always had them (SFT's rows, the pool's rejected responses, a prompt file's prompts); then the pool's
    prompts and chosen responses that SFT does not train on, their new words appended (models.build_tokenizer), so a
    task whose SFT rows hold every word keeps its ids."""
    pool = splits.train + splits.eval
    first: Groups = [(train_rows + eval_rows, ("prompt", "completion")), (pool, ("rejected",))]
    if splits.sft_rows is not None:
        first.append((pool, ("prompt", "chosen")))
    if splits.prompt_rows is not None:
        first.append((splits.prompt_rows, ("prompt",)))
    return first, ([] if splits.sft_rows is not None else [(pool, ("prompt", "chosen"))])


def prepare_base(exp: Experiment, session: Session, groups: Groups, more: Groups = ()) -> tuple[str, object]:
    """The base's path and tokenizer: a hub id / local dir, or the tiny model built now into the run record (its
    word-level vocabulary from the `fields` of each group's rows, then `more`'s, as the chat template renders
    them: models.build_tokenizer).
    data.chat_template, when set, becomes the tokenizer's chat template (saved with every adapter, so every later
    stage renders the same way)."""
    template = data.chat_template(exp.data.chat_template)
    if exp.model.name == "tiny":
        path = session.run.dir / "base"
        if dist.is_main():  # one copy, written by rank 0; the other ranks load it
            renderer = models.build_tokenizer([])  # the template's text does not depend on the vocabulary
            renderer.chat_template = template
            texts = [["".join(r[f] for f in fields) for rows, fields in g
                      for r in data.render([dict(r) for r in rows], renderer)] for g in (groups, more)]
            models.build_tiny_base(exp.model, exp.seed, texts[0], path, template, more=texts[1])
        dist.barrier()
        return str(path), models.load_tokenizer(str(path))
    tok = models.load_tokenizer(exp.model.name, exp.model.revision)
    models.check_vocabulary(tok, exp.model.name, exp.model.revision)
    if template:
        tok.chat_template = template
    return exp.model.name, tok


def prepare(exp: Experiment) -> Plan:
    """The data this SFT run uses and its lineage; bad input fails here, before any model is loaded."""
    models.check_tokenizer_folder(exp.model.name)  # before the run folder is made
    train_rows, eval_rows, splits = data.load_sft(exp)
    conversational = any(isinstance(r["prompt"], list)
                         for r in train_rows + eval_rows + splits.train + (splits.prompt_rows or []))
    if exp.model.name == "tiny" and not exp.data.chat_template and conversational:
        raise data.DataError("the data is conversational and the tiny model has no chat template: set "
                             "data.chat_template (a Jinja string or file)")
    if exp.data.chat_template and not conversational and not exp.kto.path:  # it would ship with the tokenizer,
        # never trained in (kto.path's records, read by KTO alone, may be messages)
        raise data.DataError(f"data.chat_template is set, but the records of {splits.source} are plain text, not "
                             "messages: the template renders none of them, yet every adapter's and export's tokenizer "
                             "would carry it as the format the model was trained in. Remove data.chat_template, or "
                             "give the records as messages (docs/data.md)")
    ids = {"train": [r["id"] for r in train_rows], "eval": [r["id"] for r in eval_rows]}
    if any(isinstance(r["prompt"], list) for r in train_rows + eval_rows):  # rendered by the chat template
        ids["rendering"] = [data.RENDERING]
    if exp.model.name == "tiny":  # the tiny model's tokenizer is built from the whole pool
        ids["pool"] = [r["id"] for r in splits.train + splits.eval]
        if splits.sft_rows is None and exp.data.source != "synthetic":  # words SFT's rows lack are in it since
            # 2026-11-28 (another base than before), one id each since 2026-11-29 (they took every other id, past
            # the embedding's rows: a run from between is not reused)
            ids["vocabulary"] = ["the pool's prompts and chosen responses, one id each"]
        if splits.prompt_rows is not None:
            ids["prompts"] = [r["id"] for r in splits.prompt_rows]
    return Plan.make(exp, "sft", {"data": splits.source, **({"sft_path": exp.data.sft_path} if exp.data.sft_path else {}),
                                  **data.skipped_record(splits.skipped), "train_ids": ids["train"]},
                     ids, train_rows=train_rows, eval_rows=eval_rows, splits=splits)


def train(exp: Experiment, resume: bool = True) -> dict:
    plan = prepare(exp)
    train_rows, eval_rows, splits = plan.data.train_rows, plan.data.eval_rows, plan.data.splits
    # the held-out check's settings and graders (its functions checked against the rows they score), before anything
    # loads
    check_plan = checks.plan(exp, "sft", eval_rows[: exp.eval.prompts])
    warnings = dist.warn(data.skipped_said("sft", plan.inputs, splits.source, other=("prompts",)))
    for said in splits.repeats:
        warnings += dist.warn(said)
    session = Session.start(exp, plan, resume=resume)
    with session.probe.phase("load"):
        base_path, tok = prepare_base(exp, session, *vocabulary(train_rows, eval_rows, splits))
        data.render(train_rows, tok)
        data.render(eval_rows, tok)
        model = models.add_adapter(models.load_base(models.loading(exp), base_path, "causal", tok), exp.lora)
    warnings += checks.said(check_plan, eval_rows[: exp.eval.prompts], tok)
    cols = ("prompt", "completion")
    train_ds = Dataset.from_list([{k: r[k] for k in cols} for r in train_rows])
    eval_ds = Dataset.from_list([{k: r[k] for k in cols} for r in eval_rows])
    args = sft_args(exp, session)
    snapshot = trainable_snapshot(model)
    trainer = adapter_dtype_as_compute(SFTTrainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                         processing_class=tok, callbacks=[RecordCallback(session)]), exp.quantization, snapshot)
    checked = None if exp.sft.packing else (exp.data.max_length, train_rows, eval_rows)  # packs: TRL leaves none out
    said, repeats = ready(trainer, "sft", "rows", checked)
    warnings += said
    with session.probe.phase("eval"):
        before = trainer.evaluate()["eval_loss"]
    ppl_before = perplexities(exp.sft.loss_type, before)
    session.log(0, {"eval/loss": before, **{f"eval/{k}": v for k, v in ppl_before.items()}})
    tokens = sum(len(ids) for ids in trainer.train_dataset["input_ids"]) * exp.sft.epochs
    result, throughput = run(session, trainer, tokens)
    with session.probe.phase("eval"):
        metrics = trainer.evaluate()
    after = metrics["eval_loss"]
    adapter = session.save_adapter(trainer.model, tok)
    check = {}
    if checks.can_check(check_plan):  # held-out generations (rank 0; the ranks hold the same adapter)
        with session.probe.phase("eval"):
            check = checks.sft_check(check_plan, trainer.model, tok, eval_rows[: exp.eval.prompts])
    ppl_after = perplexities(exp.sft.loss_type, after)
    summary = {
        "metrics": {"eval_loss_before": before, **{f"eval_{k}_before": v for k, v in ppl_before.items()},
                    "eval_loss": after, **{f"eval_{k}": v for k, v in ppl_after.items()},
                    "eval_mean_token_accuracy": metrics.get("eval_mean_token_accuracy"),
                    "train_loss": result.training_loss, "train_steps": result.global_step, **check},
        "throughput": throughput,
        "model": {"base_model": exp.model.name, "base_path": base_path, "adapter": str(adapter),
                  "tokenizer_hash": models.tokenizer_hash(tok), **models.trainable_report(model)},
        "data": {"train": len(train_rows), "trained": len(trainer.train_dataset), **repeats, "eval": len(eval_rows)},
        "warnings": warnings,
    }
    session.log(result.global_step, {"eval/loss": after, **{f"eval/{k}": v for k, v in ppl_after.items()}})
    return session.finish(summary)
