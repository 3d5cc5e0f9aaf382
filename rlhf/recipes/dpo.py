"""DPO stage: TRL's DPOTrainer, LoRA continuing from the SFT adapter, beta from the config. The reference is computed
by the same model - no second copy of the base: the frozen SFT adapter (dpo.reference=sft, default) or the base with
adapters disabled (dpo.reference=base).

Per step TRL 1.16 runs the policy's forward (with gradients) and the reference's (without) as two passes over the
same padded batch of chosen + rejected sequences, prompts included, then the policy's backward: no work is repeated
within a step (docs/performance.md has the per-token accounting). Over several epochs the frozen reference's
log-probabilities are recomputed every epoch; dpo.precompute_ref_log_probs computes them once before training
(TRL's option: the same values), and that pass counts in the stage's throughput."""

from __future__ import annotations

import time

from trl import DPOConfig, DPOTrainer

from rlhf.infra import dist
from rlhf.recipes import preference
from rlhf.experiment.config import ConfigError, Experiment
from rlhf.runs.runtime import Plan, preference_plan
from rlhf.experiment.sections import DPOConfig as DPOSection
from rlhf.experiment.trl_names import dpo_option_notes
from rlhf.recipes.trainers import pair_tokens


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


LOSS_FIELDS = ("beta", "loss_weights", "label_smoothing", "use_weighting", "ld_alpha", "discopop_tau",
               "f_divergence_type", "f_alpha_divergence_coef")
"""The `dpo` section's fields that are TRL 1.16's DPOConfig loss fields by name, passed as they are (loss_type too, as
TRL's list)."""


def loss_args(o: DPOSection, where: str) -> dict:
    """The `dpo` section's loss settings as DPOConfig's arguments (loss_type: one, or several mixed by
    loss_weights)."""
    return dict(**{k: getattr(o, k) for k in LOSS_FIELDS},
                loss_type=o.loss_type if isinstance(o.loss_type, list) else [o.loss_type],
                precompute_ref_log_probs=precompute_reference(o, where))


METHOD = preference.Method(
    trainer=TimedDPOTrainer, config=DPOConfig, columns=("prompt", "chosen", "rejected"),
    eval_keys=("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected", "logps/chosen",
               "logps/rejected", "loss"),
    rates=("rewards/accuracies",), before="rewards/accuracies", args=loss_args,
    tokens=lambda trainer, o: pair_tokens(trainer.train_dataset, o.epochs), unit="pairs", notes=dpo_option_notes)


def prepare(exp: Experiment) -> Plan:
    """DPO's inputs (runtime.preference_plan): it trains on the pool's pairs less the judge's, evaluates on the
    held-out pairs."""
    plan = preference_plan(exp, "dpo")
    plan.data.train_rows, plan.data.eval_rows = plan.data.pairs, plan.data.eval_pairs
    return plan


def train(exp: Experiment, resume: bool = True) -> dict:
    return preference.train(METHOD, exp.dpo, prepare(exp), exp, resume)
