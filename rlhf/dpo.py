"""DPO stage: TRL's DPOTrainer, LoRA continuing from the SFT adapter, beta from the config. The reference is computed
by the same model - no second copy of the base: the frozen SFT adapter (dpo.reference=sft, default) or the base with
adapters disabled (dpo.reference=base).

Per step TRL 1.16 runs the policy's forward (with gradients) and the reference's (without) as two passes over the
same padded batch of chosen + rejected sequences, prompts included, then the policy's backward: no work is repeated
within a step (docs/performance.md has the per-token accounting). Over several epochs the frozen reference's
log-probabilities are recomputed every epoch; dpo.precompute_ref_log_probs computes them once before training
(TRL's option: the same values), and that pass counts in the stage's throughput."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from datasets import Dataset
from trl import DPOConfig, DPOTrainer

from . import checks, dist, models, records
from .config import ConfigError, Experiment
from .runtime import Plan, Session, preference_plan
from .trainers import (RecordCallback, adapter_dtype_as_compute, pair_tokens, run, trainable_snapshot,
                       training_args)

EVAL_KEYS = ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected", "logps/chosen",
             "logps/rejected", "loss")


class TimedDPOTrainer(DPOTrainer):
    """TRL's DPOTrainer, timing its reference precompute of the training set (it runs in __init__, before train():
    trainers.run adds it to the training time)."""

    reference_precompute_s = 0.0

    def _precompute_ref_logps(self, dataset, name, batch_size):
        t0 = time.time()
        try:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        finally:
            if name == "train":
                self.reference_precompute_s += time.time() - t0


def precompute_reference(exp: Experiment) -> bool:
    """dpo.precompute_ref_log_probs, refused with data parallelism (TRL 1.16 shares the precomputed values through
    a cache file that in-memory data sets name at random on each rank)."""
    if exp.dpo.precompute_ref_log_probs and dist.active():
        raise ConfigError(f"{exp.source or 'config'}: dpo.precompute_ref_log_probs does not work with data "
                          f"parallelism under TRL 1.16 (its cache file differs per rank); set it to false")
    return exp.dpo.precompute_ref_log_probs


def build_trainer(exp: Experiment, session: Session, sft: dict, tok, train_rows: list[dict], eval_rows: list[dict]):
    base = models.load_base(exp, sft["model"]["base_path"], "causal", tok)
    adapter = Path(sft["model"]["adapter"])
    if exp.dpo.reference == "sft":  # TRL adds a frozen copy of this adapter, named "ref", as the reference
        model, peft_config = models.load_adapter(base, adapter, "default", trainable=True), None
    else:  # a fresh adapter is wrapped by TRL; the reference is the base with adapters disabled
        model, peft_config = base, models.lora_config(exp, tied=models.tied_embeddings(base))
    cols = ("prompt", "chosen", "rejected")
    loss_type = exp.dpo.loss_type if isinstance(exp.dpo.loss_type, list) else [exp.dpo.loss_type]
    args = training_args(DPOConfig, exp, exp.dpo, session, beta=exp.dpo.beta, loss_type=loss_type,
                         loss_weights=exp.dpo.loss_weights, max_length=exp.data.max_length,
                         precompute_ref_log_probs=precompute_reference(exp))
    snapshot = trainable_snapshot(model)
    with models.copying_tied_adapters():  # TRL's "ref" is a copy of the SFT adapter by its config
        trainer = TimedDPOTrainer(model=model, args=args, processing_class=tok, peft_config=peft_config,
                                  train_dataset=Dataset.from_list([{k: r[k] for k in cols} for r in train_rows]),
                                  eval_dataset=Dataset.from_list([{k: r[k] for k in cols} for r in eval_rows]),
                                  callbacks=[RecordCallback(session)])
    adapter_dtype_as_compute(trainer, exp, snapshot)
    if peft_config is not None:
        models.warm_start(trainer.model, adapter)
    return trainer


def heldout_check(exp: Experiment, model, tok, sft: dict, rows: list[dict]) -> dict:
    """The policy stages' held-out generation check (checks.generation_check) for the DPO adapter ("default")
    against SFT (TRL's frozen "ref" copy, or the SFT adapter loaded now when the reference is the base); its KL is
    to dpo.reference (the base: adapters disabled) at temperature 1."""
    if exp.dpo.reference != "sft" or "ref" not in model.peft_config:
        models.load_adapter(model, sft["model"]["adapter"], "sft_check")
    names = {"policy": "default", "ref": "ref" if exp.dpo.reference == "sft" else "sft_check"}
    prompts = [r["prompt"] for r in rows]

    def use(name):
        model.set_adapter(names[name])

    scorers = {}
    try:  # the reward model and the judge, as adapters on the policy's own base (as in PPO): no second base
        _, rm_summary = records.latest(exp, "rm", "dpo")
    except records.StageInputError:
        rm_summary = None
    for name, adapter in checks.rm_adapters(rm_summary).items():
        head = models.load_scorer(model, adapter, name, models.device(exp))

        def scores(texts, name=name, head=head):
            model.set_adapter(name)
            return checks.reward_scores(model, head, tok, prompts, texts, exp.eval.batch_size)
        scorers[name] = scores

    def reference():  # DPO's own reference: the SFT adapter, or the base with adapters disabled
        if exp.dpo.reference == "base":
            return model.disable_adapter()
        return checks.using(use, "ref")

    out = checks.generation_check(exp, "dpo", model, tok, rows, use, scorers, reference=exp.dpo.reference,
                                    reference_ctx=reference, temperature=1.0)  # DPO's log-probs: temperature 1
    use("policy")
    return out


def prepare(exp: Experiment) -> Plan:
    return preference_plan(exp, "dpo")


def train(exp: Experiment, resume: bool = True) -> dict:
    plan = prepare(exp)
    d = plan.data
    sft, tok, pairs, splits = d.sft, d.tok, d.pairs, d.splits
    session = Session.start(exp, plan, resume=resume)
    with session.probe.phase("load"):
        trainer = build_trainer(exp, session, sft, tok, pairs, splits.eval)
    with session.probe.phase("eval"):
        before = trainer.evaluate()
    result, throughput = run(session, trainer, pair_tokens(trainer.train_dataset, exp.dpo.epochs))
    with session.probe.phase("eval"):
        after = trainer.evaluate()
    model = trainer.model
    adapter = session.save_adapter(model, tok, selected_adapters=["default"])
    metrics = {f"eval_{k.replace('/', '_')}": after.get(f"eval_{k}") for k in EVAL_KEYS}
    metrics["eval_rewards_accuracies_before"] = before.get("eval_rewards/accuracies")
    check = {}
    if checks.can_check(exp):  # the held-out generation check is rank 0's (the ranks hold the same adapter)
        with session.probe.phase("eval"):
            check = heldout_check(exp, model, tok, sft, splits.eval[: exp.eval.prompts])
    flags = checks.collapse_flags("dpo", check, exp.dpo.max_kl_ref, exp.dpo.min_terminated)
    for f in flags:
        print(f"warning: {f}", file=sys.stderr, flush=True)
    metrics.update(check)
    session.log(result.global_step, {f"eval/{k}": v for k, v in metrics.items()})
    return session.finish({
        "metrics": {**metrics, "train_loss": result.training_loss, "train_steps": result.global_step},
        "flags": flags,
        "throughput": throughput,
        "model": {**sft["model"], "adapter": str(adapter), "reference": exp.dpo.reference,
                  **models.trainable_report(model)},
        "data": {"train": len(pairs), "eval": len(splits.eval)},
    })
