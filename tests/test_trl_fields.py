"""A TRL user's GRPOConfig / RLOOConfig (TRL 1.16, the installed trl) and PPOConfig (TRL 0.25.1, the last TRL with
PPO) run here as written: every field of TRL's dataclasses is the section's own, by TRL's name and with TRL's
default (or a default the README and the field's docstring say why it differs), or it is refused in one line
(rlhf/experiment/trl_names.py: TRL_REFUSED). No TRL field is left undecided."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import pytest

from rlhf.experiment import config
from rlhf.experiment.trl_names import TRL_REFUSED

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "experiments" / "tiny.yaml"
PPO_FIELDS = Path(__file__).with_name("trl025_ppo_fields.json")

COMMON_TRAINING_ARGUMENTS = (
    "learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "num_train_epochs", "max_steps",
    "seed", "bf16", "fp16", "logging_steps", "save_steps", "output_dir", "report_to", "run_name", "optim",
    "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "lr_scheduler_type", "warmup_steps",
    "gradient_checkpointing", "push_to_hub", "save_strategy", "eval_strategy", "eval_steps",
    "per_device_eval_batch_size", "deepspeed", "fsdp", "torch_compile")
"""The transformers TrainingArguments a TRL user commonly sets beside GRPOConfig's own fields: each decided too."""

NOT_TRLS = {("grpo", "beta"), ("grpo", "learning_rate"), ("grpo", "loss_type"), ("rloo", "learning_rate"),
            ("rloo", "num_generations"), ("grpo", "max_completion_length"), ("rloo", "max_completion_length"),
            ("ppo", "response_length"), ("ppo", "temperature"), ("grpo", "optim"), ("rloo", "optim"),
            ("grpo", "save_steps"), ("rloo", "save_steps"), ("ppo", "learning_rate"), ("ppo", "adam_epsilon"),
            ("ppo", "optim"), ("ppo", "save_steps")}
"""The accepted TRL fields whose default here is not TRL's; README.md states each with TRL's value."""
SAME = {("ppo", "missing_eos_penalty"): (None, 0.0)}
"""Defaults written differently that mean the same (TRL's None penalty is no penalty)."""


def _theirs(cls) -> dict:
    """A TRL config class's fields beyond transformers' TrainingArguments, plus the common TrainingArguments, with
    their defaults."""
    import transformers

    base = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    out = {}
    for f in dataclasses.fields(cls):
        if f.name not in base or f.name in COMMON_TRAINING_ARGUMENTS:
            out[f.name] = (f.default if f.default is not dataclasses.MISSING
                           else f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
    return out


def _ppo_fields() -> dict:
    """TRL 0.25.1's PPOConfig fields: from the dataclass when that trl is importable (the bench's venv), else the
    checked-in list read from its source (tests/trl025_ppo_fields.json)."""
    read = json.loads(PPO_FIELDS.read_text())
    listed = {k: v for k, v in read.items() if not k.startswith("_")}
    import trl

    if trl.__version__ == "0.25.1":
        real = _theirs(trl.PPOConfig)
        real.pop("exp_name")  # the defining file's name
        assert set(real) - set(COMMON_TRAINING_ARGUMENTS) == set(listed) - {"exp_name"}, "update trl025_ppo_fields"
        assert {k: real[k] for k in COMMON_TRAINING_ARGUMENTS} == read["_training_arguments"], "update trl025_ppo_fields"
        return real
    return {**listed, **read["_training_arguments"]}


def _decisions(section: str, theirs: dict) -> tuple[dict, dict]:
    """(accepted: {field: (ours, TRL's default)}, undecided: {field: TRL's default}) of `section` against a TRL
    config's fields."""
    ours = getattr(config.Experiment(), section)
    names = {f.name for f in dataclasses.fields(ours)}
    accepted = {k: (getattr(ours, k), v) for k, v in theirs.items() if k in names}
    undecided = {k: v for k, v in theirs.items() if k not in names and k not in TRL_REFUSED}
    return accepted, undecided


def _configs():
    import trl

    return [("grpo", _theirs(trl.GRPOConfig)), ("rloo", _theirs(trl.RLOOConfig)), ("ppo", _ppo_fields())]


def test_every_trl_field_is_accepted_with_trls_default_or_refused():
    """Fails when TRL adds a field nobody decided about, when an entry leaves TRL_REFUSED, or when a default drifts
    from TRL's without README.md saying so."""
    readme = (ROOT / "README.md").read_text()
    for section, theirs in _configs():
        assert len(theirs) > 30, section
        accepted, undecided = _decisions(section, theirs)
        assert not undecided, f"{section}: TRL fields neither accepted nor in TRL_REFUSED: {sorted(undecided)}"
        assert not set(accepted) & set(TRL_REFUSED), section
        for k, (mine, trls) in accepted.items():
            if (section, k) in SAME:
                assert (trls, mine) == SAME[section, k], f"{section}.{k}"
            elif (section, k) in NOT_TRLS:
                assert mine != trls, f"{section}.{k} is TRL's now: drop it from NOT_TRLS and the README"
                stated = re.search(rf"`{section}\.{k}`\s+`([^`]+)`\s+\(TRL's\s+`([^`]+)`", readme)
                assert stated, f"README.md does not say that {section}.{k} is not TRL's default"
                assert [str(v) for v in stated.groups()] == [str(mine), str(trls)] or \
                    [float(v) for v in stated.groups()] == [mine, trls], f"{section}.{k}: {stated.groups()}"
            else:
                assert mine == trls, f"{section}.{k}: {mine!r} here, TRL's {trls!r}"
    assert {("ppo", "kl_coef"), ("grpo", "epsilon"), ("rloo", "num_iterations"), ("rloo", "beta")} <= {
        (s, k) for s, t in _configs() for k in _decisions(s, t)[0]}
    tiny = config.load(TINY)
    assert tiny.rloo.beta == tiny.grpo.beta == 0.04  # the shipped experiments' `rloo: *online`, as the README says


def test_removing_a_refusal_leaves_a_field_undecided(monkeypatch):
    """The table is what decides: without one of its entries the check above finds the field undecided."""
    import trl

    theirs = _theirs(trl.GRPOConfig)
    monkeypatch.delitem(TRL_REFUSED, "use_vllm")
    assert _decisions("grpo", theirs)[1] == {"use_vllm": False}


def test_every_refusal_names_a_trl_field():
    """No stale entries: each refused name is a field of GRPOConfig, RLOOConfig, PPOConfig or TrainingArguments."""
    import transformers

    known = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    for _, theirs in _configs():
        known |= set(theirs)
    assert set(TRL_REFUSED) <= known, sorted(set(TRL_REFUSED) - known)


@pytest.mark.parametrize("override, said", [
    ("grpo.use_vllm=true", "'grpo.use_vllm' (TRL's use_vllm) does not apply here: this harness samples through its own "
                           "merged sampler (quantization.dequantized_copy), not vLLM; remove the key"),
    ("rloo.per_device_train_batch_size=4", "'rloo.per_device_train_batch_size' (TRL's per_device_train_batch_size) "
                                           "does not apply here: batch sizes are global here; set micro_batch"),
    ("ppo.num_mini_batches=2", "set minibatch = rollout_batch / num_mini_batches"),
])
def test_a_refused_field_fails_in_one_line(override, said):
    with pytest.raises(config.ConfigError) as e:
        config.load(TINY, [override])
    assert said in str(e.value) and "\n" not in str(e.value)


def test_a_trl_recipe_runs_as_written_and_the_old_names_warn(caplog):
    """TRL's names set the section's fields; the harness's former names still work, with a one-line warning."""
    exp = config.load(TINY, ["grpo.epsilon=0.3", "grpo.num_iterations=3", "grpo.max_completion_length=7",
                             "ppo.cliprange=0.1", "ppo.cliprange_value=0.3", "ppo.num_ppo_epochs=2",
                             "ppo.response_length=9", "ppo.kl_coef=0.1", "ppo.gamma=0.99", "ppo.lam=0.9",
                             "ppo.kl_estimator=k3", "ppo.whiten_rewards=true"])
    g, p = exp.grpo, exp.ppo
    assert (g.epsilon, g.num_iterations, g.max_completion_length) == (0.3, 3, 7)
    assert (g.clip_range, g.epochs, g.max_new_tokens) == (0.3, 3, 7)  # what the shared loop reads
    assert (p.clip_range, p.cliprange_value, p.epochs, p.max_new_tokens) == (0.1, 0.3, 2, 9)
    assert (p.length_key, g.length_key, exp.rloo.length_key) == ("response_length", "max_completion_length",
                                                                 "max_completion_length")  # messages name TRL's key
    assert (p.kl_estimator, p.whiten_rewards) == ("k3", True)
    with caplog.at_level(logging.WARNING, logger="rlhf.experiment.trl_names"):
        old = config.load(TINY, ["rloo.clip_range=0.25", "ppo.epochs=3", "ppo.clip_range_value=0.5"])
    assert (old.rloo.epsilon, old.ppo.num_ppo_epochs, old.ppo.cliprange_value) == (0.25, 3, 0.5)
    warned = [r.getMessage() for r in caplog.records]
    assert any("'rloo.clip_range' is deprecated: it is 'rloo.epsilon' now" in w for w in warned), warned
    with pytest.raises(config.ConfigError, match="both set"):
        config.load(TINY, ["grpo.epochs=2", "grpo.num_iterations=3"])


def test_trls_dapo_and_gspo_recipes_load_as_written():
    """The keyword sets of TRL's DAPO and GSPO recipes, pasted as the grpo section, load unchanged; the checks that
    cannot hold fail in one line."""
    dapo = config.load(TINY, ["grpo.loss_type=dapo", "grpo.epsilon=0.2", "grpo.epsilon_high=0.28", "grpo.beta=0.0",
                              "grpo.mask_truncated_completions=true", "grpo.max_completion_length=8",
                              "grpo.num_iterations=2", "grpo.top_entropy_quantile=0.2", "grpo.entropy_coef=0.01",
                              "grpo.top_k=5", "grpo.min_p=0.1", "grpo.repetition_penalty=1.1",
                              "grpo.off_policy_mask_threshold=0.5"]).grpo
    assert (dapo.epsilon_high, dapo.mask_truncated_completions, dapo.top_entropy_quantile) == (0.28, True, 0.2)
    gspo = config.load(TINY, ["grpo.importance_sampling_level=sequence", "grpo.loss_type=grpo", "grpo.epsilon=3e-4",
                              "grpo.epsilon_high=4e-4", "grpo.delta=2.0", "rloo.normalize_advantages=true",
                              "rloo.reward_clip_range=[-3, 3]", "rloo.sampler_is_correction=true",
                              "rloo.sampler_is_mode=sequence_truncate", "grpo.sampler_is_correction=true"])
    assert gspo.grpo.importance_sampling_level == "sequence" and gspo.rloo.reward_clip_range == [-3.0, 3.0]
    for bad, said in (("rloo.importance_sampling_level=sequence", "does not apply to loss_type rloo"),
                      ("grpo.top_entropy_quantile=0", "top_entropy_quantile must be in (0, 1]"),
                      ("rloo.multi_objective_aggregation=normalize_then_sum", "TRL's RLOOConfig has none"),
                      ("grpo.multi_objective_aggregation=normalize_then_sum grpo.kl_penalty=reward",
                       "takes the KL as a loss term"),
                      ("grpo.multi_objective_aggregation=mean", "is not one of"),
                      ("grpo.reward_weights=[1.0, 2.0]", "set the weights there"),
                      ("rloo.off_policy_mask_threshold=0.5", "loss_type rloo's is per response"),
                      ("grpo.vllm_importance_sampling_correction=true", "set sampler_is_correction"),
                      ("rloo.sampler_is_correction=true rloo.sampler_is_mode=token_mask",
                       "use sequence_truncate or sequence_mask")):
        with pytest.raises(config.ConfigError, match=re.escape(said)):
            config.load(TINY, bad.split())
