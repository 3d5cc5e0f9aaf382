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

from datasets import Dataset
from trl import DPOConfig, DPOTrainer

from . import checks, dist, models
from .config import ConfigError, Experiment
from .runtime import Plan, Session, preference_plan
from .sections import DPOConfig as DPOSection
from .trainers import RecordCallback, continuing_sft, pair_tokens, run, training_args

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


def precompute_reference(o: DPOSection, where: str) -> bool:
    """dpo.precompute_ref_log_probs, refused with data parallelism (TRL 1.16 shares the precomputed values through
    a cache file that in-memory data sets name at random on each rank)."""
    if o.precompute_ref_log_probs and dist.active():
        raise ConfigError(f"{where}: dpo.precompute_ref_log_probs does not work with data parallelism under TRL "
                          f"1.16 (its cache file differs per rank); set it to false")
    return o.precompute_ref_log_probs


def build_trainer(exp: Experiment, o: DPOSection, session: Session, sft: dict, tok, train_rows: list[dict],
                  eval_rows: list[dict]):
    """TRL's DPOTrainer on the SFT adapter (trainers.continuing_sft) with the `dpo` section's settings."""
    cols = ("prompt", "chosen", "rejected")
    loss_type = o.loss_type if isinstance(o.loss_type, list) else [o.loss_type]

    def make(model, peft_config):
        args = training_args(DPOConfig, exp, o, session, beta=o.beta, loss_type=loss_type,
                             loss_weights=o.loss_weights, max_length=exp.data.max_length,
                             precompute_ref_log_probs=precompute_reference(o, exp.source or "config"))
        return TimedDPOTrainer(model=model, args=args, processing_class=tok, peft_config=peft_config,
                               train_dataset=Dataset.from_list([{k: r[k] for k in cols} for r in train_rows]),
                               eval_dataset=Dataset.from_list([{k: r[k] for k in cols} for r in eval_rows]),
                               callbacks=[RecordCallback(session)])
    return continuing_sft(make, exp, sft, tok, o.reference)


def prepare(exp: Experiment) -> Plan:
    return preference_plan(exp, "dpo")


def train(exp: Experiment, resume: bool = True) -> dict:
    o = exp.dpo
    plan = prepare(exp)
    d = plan.data
    sft, tok, pairs, splits = d.sft, d.tok, d.pairs, d.splits
    session = Session.start(exp, plan, resume=resume)
    with session.probe.phase("load"):
        trainer = build_trainer(exp, o, session, sft, tok, pairs, splits.eval)
    with session.probe.phase("eval"):
        before = trainer.evaluate()
    result, throughput = run(session, trainer, pair_tokens(trainer.train_dataset, o.epochs))
    with session.probe.phase("eval"):
        after = trainer.evaluate()
    model = trainer.model
    adapter = session.save_adapter(model, tok, selected_adapters=["default"])
    metrics = {f"eval_{k.replace('/', '_')}": after.get(f"eval_{k}") for k in EVAL_KEYS}
    metrics["eval_rewards_accuracies_before"] = before.get("eval_rewards/accuracies")
    check = {}
    if checks.can_check(exp):  # the held-out generation check is rank 0's (the ranks hold the same adapter)
        with session.probe.phase("eval"):
            check = checks.preference_check(exp, "dpo", o.reference, model, tok, sft, splits.eval[: exp.eval.prompts])
    flags = checks.collapse_flags("dpo", check, o.max_kl_ref, o.min_terminated)
    for f in flags:
        print(f"warning: {f}", file=sys.stderr, flush=True)
    metrics.update(check)
    session.log(result.global_step, {f"eval/{k}": v for k, v in metrics.items()})
    return session.finish({
        "metrics": {**metrics, "train_loss": result.training_loss, "train_steps": result.global_step},
        "flags": flags,
        "throughput": throughput,
        "model": {**sft["model"], "adapter": str(adapter), "reference": o.reference,
                  **models.trainable_report(model)},
        "data": {"train": len(pairs), "eval": len(splits.eval)},
    })
