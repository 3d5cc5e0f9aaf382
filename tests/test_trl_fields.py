"""A TRL user's GRPOConfig / RLOOConfig (TRL 1.16, the installed trl) and PPOConfig (TRL 0.25.1, the last TRL with
PPO) run here as written: every field of TRL's dataclasses is the section's own, by TRL's name and with TRL's
default (or a default the README and the field's docstring say why it differs), or it is refused in one line
(rlhf/experiment/trl_names.py: TRL_REFUSED). No TRL field is left undecided. The same holds for TRL 1.16's DPOConfig
and KTOConfig and the dpo and kto sections (PREFERENCE_REFUSED, KTO_REFUSED), TRL 1.16's SFTConfig and RewardConfig
and the sft and rm sections (SFT_REFUSED, RM_REFUSED; the TrainingArguments names of the TrainConfig sections' fields:
TRAIN_REFUSED), their defaults stated in docs/algorithms.md where not TRL's."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import pytest

from rlhf.experiment import config
from rlhf.experiment.trl_names import (FORMER_TRL, KTO_REFUSED, PREFERENCE_REFUSED, RM_REFUSED, SFT_REFUSED,
                                       TRAIN_REFUSED, TRL_REFUSED)

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
    undecided = {k: v for k, v in theirs.items() if k not in names and k not in config.REFUSED[section]}
    return accepted, undecided


def _configs():
    import trl

    return [("grpo", _theirs(trl.GRPOConfig)), ("rloo", _theirs(trl.RLOOConfig)), ("ppo", _ppo_fields())]


def test_every_trl_field_is_accepted_with_trls_default_or_refused():
    """Fails when TRL adds a field nobody decided about, when an entry leaves TRL_REFUSED, or when a default drifts
    from TRL's without README.md saying so."""
    for section, theirs in _configs():
        assert len(theirs) > 30, section
        _check_section(section, theirs, SAME, NOT_TRLS, "README.md")
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
    """No stale entries: each refused name is a field of GRPOConfig, RLOOConfig, PPOConfig, DPOConfig, KTOConfig,
    SFTConfig, RewardConfig or TrainingArguments (or, FORMER_TRL, of TRL 0.x's DPOConfig, which 1.16's no longer
    has)."""
    import transformers

    known = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    for _, theirs in _configs() + _preference_configs() + _sft_rm_configs():
        known |= set(theirs)
    assert set(TRL_REFUSED) <= known, sorted(set(TRL_REFUSED) - known)
    refused = set(PREFERENCE_REFUSED) | set(KTO_REFUSED) | set(TRAIN_REFUSED) | set(SFT_REFUSED) | set(RM_REFUSED)
    assert refused - FORMER_TRL <= known, sorted(refused - FORMER_TRL - known)
    assert not FORMER_TRL & {k for _, theirs in _preference_configs() for k in theirs}, "DPOConfig has them again"


def test_dpo_and_kto_each_refuse_their_own_configs_fields():
    """A kto key is refused for what KTOConfig has (or had, FORMER_TRL) and a reason about KTO, never DPOConfig's
    alone with DPOTrainer's reason; the same the other way."""
    import transformers
    import trl

    arguments = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    for table, cls in ((PREFERENCE_REFUSED, trl.DPOConfig), (KTO_REFUSED, trl.KTOConfig)):
        own = {f.name for f in dataclasses.fields(cls)} - arguments
        beyond = set(table) - set(TRAIN_REFUSED)
        assert beyond - own - FORMER_TRL <= arguments, sorted(beyond - own - FORMER_TRL - arguments)
    dpo_only = set(_theirs(trl.DPOConfig)) - set(_theirs(trl.KTOConfig)) - set(TRAIN_REFUSED)
    assert not dpo_only & set(KTO_REFUSED), sorted(dpo_only & set(KTO_REFUSED))
    assert {"padding_free", "truncation_mode", "pad_token"} <= dpo_only & set(PREFERENCE_REFUSED)
    assert "rpo_alpha" not in KTO_REFUSED
    assert not [k for k, (why, what) in KTO_REFUSED.items() if "DPOTrainer" in why or "dpo." in what]
    with pytest.raises(config.ConfigError, match="unknown key"):
        config.load(TINY, ["kto.padding_free=true"])
    with pytest.raises(config.ConfigError, match="not wired for KTO"):
        config.load(TINY, ["kto.precompute_ref_batch_size=8"])


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


PREFERENCE_NOT_TRLS = {(s, k) for s in ("dpo", "kto", "sft", "rm")
                       for k in ("learning_rate", "optim", "save_steps", "eval_steps")}
"""The dpo, kto, sft and rm fields whose default here is not TRL's; docs/algorithms.md (TRL's fields) states each."""
PREFERENCE_SAME = {("dpo", "loss_type"): (["sigmoid"], "sigmoid"), ("rm", "center_rewards_coefficient"): (None, 0.0)}
"""TRL's list of one loss type, written here as the one; TRL's null centring coefficient, no centring, written 0."""


def _preference_configs():
    import trl

    return [("dpo", _theirs(trl.DPOConfig)), ("kto", _theirs(trl.KTOConfig))]


def _check_train_section(section: str, theirs: dict) -> dict:
    return _check_section(section, theirs, PREFERENCE_SAME, PREFERENCE_NOT_TRLS, "docs/algorithms.md")


def _check_section(section: str, theirs: dict, same: dict, not_trls: set, doc: str) -> dict:
    """Each of a TRL config's fields `theirs` is `section`'s own, with TRL's default (`same`: where ours is TRL's
    by another spelling) or one the file `doc` states (`not_trls`), or refused (config.REFUSED); the accepted ones,
    {field: (ours, TRL's default)}."""
    text = (ROOT / doc).read_text()
    accepted, undecided = _decisions(section, theirs)
    assert not undecided, f"{section}: TRL fields neither accepted nor refused: {sorted(undecided)}"
    assert not set(accepted) & set(config.REFUSED[section]), section
    for k, (mine, trls) in accepted.items():
        if (section, k) in same:
            assert (trls, mine) == same[section, k], f"{section}.{k}"
        elif (section, k) in not_trls:
            assert mine != trls, f"{section}.{k} is TRL's now: drop it from the test's list and {doc}"
            stated = re.search(rf"`{section}\.{k}`\s+`([^`]+)`\s+\(TRL's\s+`([^`]+)`", text)
            assert stated, f"{doc} does not say that {section}.{k} is not TRL's default"
            assert [str(v) for v in stated.groups()] == [str(mine), str(trls)] or \
                [float(v) for v in stated.groups()] == [mine, trls], f"{section}.{k}: {stated.groups()}"
        else:
            assert mine == trls, f"{section}.{k}: {mine!r} here, TRL's {trls!r}"
    return accepted


def test_every_dpo_and_kto_field_is_accepted_with_trls_default_or_refused():
    """TRL 1.16's DPOConfig and KTOConfig, field by field (with the TrainingArguments a TRL user commonly sets): the
    section's own, with TRL's default or one docs/algorithms.md states, or refused; the loss fields are all accepted."""
    for section, theirs in _preference_configs():
        _check_train_section(section, theirs)
    dpo = {k for k in _decisions("dpo", _preference_configs()[0][1])[0]}
    assert {"label_smoothing", "use_weighting", "ld_alpha", "discopop_tau", "f_divergence_type",
            "f_alpha_divergence_coef", "loss_type", "loss_weights", "beta"} <= dpo
    kto = {k for k in _decisions("kto", _preference_configs()[1][1])[0]}
    assert {"beta", "desirable_weight", "undesirable_weight", "loss_type"} <= kto


def _sft_rm_configs():
    import trl

    return [("sft", _theirs(trl.SFTConfig)), ("rm", _theirs(trl.RewardConfig))]


def test_every_sft_and_rm_field_is_accepted_with_trls_default_or_refused():
    """TRL 1.16's SFTConfig and RewardConfig, field by field (with the TrainingArguments a TRL user commonly sets): the
    section's own, with TRL's default or one docs/algorithms.md states, or refused (SFT_REFUSED, RM_REFUSED)."""
    (_, sft), (_, rm) = _sft_rm_configs()
    assert len(sft) > 40 and len(rm) > 35
    from rlhf.recipes.sft import TRL_FIELDS

    assert set(TRL_FIELDS) <= set(_check_train_section("sft", sft))
    assert "center_rewards_coefficient" in _check_train_section("rm", rm)
    assert config.REFUSED["sft"] is SFT_REFUSED and config.REFUSED["rm"] is RM_REFUSED


def test_removing_an_sft_or_rm_refusal_leaves_a_field_undecided(monkeypatch):
    (_, sft), (_, rm) = _sft_rm_configs()
    monkeypatch.delitem(SFT_REFUSED, "assistant_only_loss")
    monkeypatch.delitem(RM_REFUSED, "disable_dropout")
    assert _decisions("sft", sft)[1] == {"assistant_only_loss": False}
    assert _decisions("rm", rm)[1] == {"disable_dropout": True}


def _session(tmp_path, stage: str):
    """A stand-in for the stage's Session: what trainers.training_args reads of it."""
    return type("S", (), {"run": type("R", (), {"dir": tmp_path, "stage": stage})})()


def test_the_sft_fields_reach_trls_sft_config(tmp_path):
    """Every SFTConfig field the sft section has reaches TRL's SFTConfig as set, through the args the stage builds
    (rlhf/recipes/sft.py: sft_args); at the defaults they are TRL's."""
    from trl import SFTConfig

    from rlhf.recipes import sft

    def built(exp):
        return sft.sft_args(exp, _session(tmp_path, "sft"))

    set_ = {"packing": True, "packing_strategy": "wrapped", "padding_free": True, "eval_packing": False,
            "shuffle_dataset": True, "completion_only_loss": False, "loss_type": "dft"}
    exp = config.load(TINY, [f"results_dir={tmp_path}"] + [f"sft.{k}={v}" for k, v in set_.items()])
    args = built(exp)
    assert {k: getattr(args, k) for k in set_} == set_ and set(set_) == set(sft.TRL_FIELDS)
    assert args.max_length == exp.data.max_length
    default = built(config.load(TINY, [f"results_dir={tmp_path}"]))
    trls = SFTConfig(output_dir=str(tmp_path), use_cpu=True)
    assert {k: getattr(default, k) for k in set_} == {k: getattr(trls, k) for k in set_}
    assert sft.perplexities(exp.sft.loss_type, 1.0) == {} and sft.perplexities("nll", 0.0) == {
        "perplexity": 1.0}  # dft's eval loss is no NLL


def test_the_rm_fields_reach_trls_reward_config(tmp_path):
    """rm.center_rewards_coefficient reaches TRL's RewardConfig through the args the stage builds (rm.reward_args);
    0, no centring, reaches it as TRL's null."""
    from rlhf.recipes import rm

    exp = config.load(TINY, [f"results_dir={tmp_path}", "rm.center_rewards_coefficient=0.01"])
    args = rm.reward_args(exp, _session(tmp_path, "rm"))
    assert args.center_rewards_coefficient == 0.01 and args.max_length == exp.data.max_length
    assert args.disable_dropout is True  # TRL's default holds (RM_REFUSED)
    assert rm.reward_args(config.load(TINY, [f"results_dir={tmp_path}"]),
                          _session(tmp_path, "rm")).center_rewards_coefficient is None


@pytest.mark.parametrize("override, said", [
    ("sft.packing_strategy=ffd",
     "sft.packing_strategy: 'ffd' is not one of ['bfd', 'bfd-requeue', 'bfd_split', 'wrapped']"),
    ("sft.loss_type=sigmoid", "sft.loss_type: 'sigmoid' is not one of ['chunked_nll', 'dft', 'nll']"),
])
def test_an_sft_choice_trl_does_not_have_fails_in_one_line(override, said):
    with pytest.raises(config.ConfigError, match=re.escape(said)):
        config.load(TINY, [override])


def test_the_loss_fields_reach_trls_dpo_config(tmp_path):
    """Every DPOConfig loss field the section has reaches TRL's DPOConfig as set, through the args the stage builds
    (rlhf/recipes/preference.py: trainer_args, as build_trainer builds them)."""
    from rlhf.recipes import dpo, preference
    from rlhf.recipes.trainers import settings

    set_ = {"loss_type": ["robust", "sft"], "loss_weights": [1.0, 0.5], "label_smoothing": 0.1, "use_weighting": True,
            "ld_alpha": 0.5, "f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3, "beta": 0.2}
    exp = config.load(TINY, [f"results_dir={tmp_path}"] + [f"dpo.{k}={v}" for k, v in set_.items()])
    args = preference.trainer_args(dpo.METHOD, settings(exp), exp.dpo, _session(tmp_path, "dpo"))
    assert args.label_smoothing == 0.1
    assert {k: getattr(args, k) for k in set_} == set_
    assert args.discopop_tau == 0.05 and set(dpo.LOSS_FIELDS) <= {f.name for f in dataclasses.fields(args)}


def _trl_dpo_loss(args, chosen, rejected, ref_chosen, ref_rejected) -> float:
    """TRL 1.16's DPOTrainer._compute_loss on made-up per-token log-probs (two pairs, three completion tokens each),
    its settings read from `args` as DPOTrainer.__init__ reads them, the reference's log-probs precomputed."""
    from collections import defaultdict
    from types import SimpleNamespace

    import torch
    from trl import DPOTrainer

    logps = torch.tensor(chosen + rejected)  # [4 sequences, 3 tokens]: the batch is [chosen, rejected]
    outputs = SimpleNamespace(log_probs=logps, entropy=torch.zeros_like(logps), mean_logits=torch.zeros_like(logps),
                              is_top1=torch.zeros_like(logps, dtype=torch.bool))
    model = lambda **kw: outputs  # noqa: E731
    model.training = True
    ident = lambda x: x  # noqa: E731
    trainer = SimpleNamespace(
        model=model, args=args, beta=args.beta, loss_types=args.loss_type,
        loss_weights=args.loss_weights or [1.0] * len(args.loss_type), ld_alpha=args.ld_alpha,
        f_divergence_type=args.f_divergence_type, f_alpha_divergence_coef=args.f_alpha_divergence_coef,
        label_smoothing=args.label_smoothing, use_weighting=args.use_weighting, precompute_ref_logps=True,
        aux_loss_enabled=False, accelerator=SimpleNamespace(device="cpu", gather_for_metrics=ident, gather=ident),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.ones(4, 4, dtype=torch.long), "attention_mask": torch.ones(4, 4, dtype=torch.long),
              "completion_mask": torch.tensor([[0, 1, 1, 1]] * 4),
              "ref_chosen_logps": torch.tensor(ref_chosen), "ref_rejected_logps": torch.tensor(ref_rejected)}
    return DPOTrainer._compute_loss(trainer, model, inputs, False).item()


def test_robust_with_label_smoothing_is_not_sigmoid(tmp_path):
    """The user's finding: dpo.loss_type robust gave sigmoid's figures, TRL's robust loss at label_smoothing 0 being
    sigmoid's. With dpo.label_smoothing 0.1 TRL's loss differs from sigmoid's, by the Robust DPO formula (at 0 it is
    sigmoid's, and the config says so: test_a_dpo_loss_option_that_changes_nothing_runs_as_under_trl_and_says_so)."""
    import math

    from trl import DPOConfig

    from rlhf.recipes import dpo

    chosen, rejected = [[-1.0, -0.5, -0.2], [-2.0, -1.0, -0.1]], [[-1.5, -1.0, -0.5], [-0.5, -0.5, -0.5]]
    ref_c, ref_r = [-2.0, -3.0], [-3.0, -1.0]
    loss = {}
    for lt, ls in (("sigmoid", 0.0), ("robust", 0.1)):
        o = config.load(TINY, [f"dpo.loss_type={lt}", "dpo.loss_weights=null", f"dpo.label_smoothing={ls}",
                               "dpo.beta=0.5"]).dpo
        args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **dpo.loss_args(o, "test"))
        assert args.label_smoothing == ls and args.loss_type == [lt]
        loss[lt] = _trl_dpo_loss(args, chosen, rejected, ref_c, ref_r)
    deltas = [(sum(c) - rc) - (sum(r) - rr) for c, r, rc, rr in zip(chosen, rejected, ref_c, ref_r)]
    logsig = lambda x: -math.log1p(math.exp(-x))  # noqa: E731
    sigmoid = sum(-logsig(0.5 * d) for d in deltas) / 2
    robust = sum((-(0.9) * logsig(0.5 * d) + 0.1 * logsig(-0.5 * d)) / 0.8 for d in deltas) / 2
    assert loss["sigmoid"] == pytest.approx(sigmoid, rel=1e-6) and loss["robust"] == pytest.approx(robust, rel=1e-6)
    assert abs(loss["robust"] - loss["sigmoid"]) > 0.01, loss


@pytest.mark.parametrize("override, said", [
    ("dpo.max_length=512", "'dpo.max_length' (TRL's max_length) does not apply here: sequence lengths are the data "
                           "section's"),
    ("dpo.max_length=512", "set data.max_length (prompt + completion) and data.max_prompt_length"),
    ("kto.max_length=512", "set data.max_length"),
    ("dpo.truncation_mode=keep_end", "'dpo.truncation_mode' (TRL's truncation_mode) does not apply here"),
    ("dpo.max_prompt_length=128", "set data.max_length (prompt + completion) and data.max_prompt_length"),
    ("dpo.padding_free=true", "TRL 1.16's DPOTrainer has it disabled (it warns and pads); remove the key"),
    ("dpo.precompute_ref_batch_size=64", "takes dpo.batch_size rows, as memplan plans; set dpo.batch_size"),
    ("kto.precompute_ref_log_probs=true", "not wired for KTO here"),
    ("kto.train_sampling_strategy=random", "TRL's sequential order holds"),
    ("dpo.sync_ref_model=true", "TR-DPO's syncing of it is not implemented"),
    ("dpo.rpo_alpha=1.0", "set dpo.loss_type [sigmoid, sft] and dpo.loss_weights [1.0, rpo_alpha]"),
    ("dpo.num_train_epochs=3", "'dpo.num_train_epochs' (TRL's num_train_epochs) does not apply here: the field is "
                               "named otherwise here; set dpo.epochs"),
    ("kto.per_device_train_batch_size=4", "batch sizes are over all processes here: each of N ranks takes batch_size "
                                          "/ N; set kto.batch_size = per-device batch x processes"),
    ("dpo.gradient_accumulation_steps=8", "set dpo.grad_accum"),
    ("sft.lr_scheduler_type=linear", "set sft.lr_scheduler"),
    ("rm.warmup_steps=10", "set rm.warmup_ratio"),
    ("dpo.output_dir=out", "set the top-level results_dir"),
    ("kto.report_to=wandb", "set tracking.backend"),
    ("dpo.seed=3", "set the top-level seed"),
    ("dpo.bf16=true", "set model.dtype / quantization.compute_dtype"),
    ("sft.save_strategy=epoch", "set sft.save_steps"),
    ("sft.max_length=512", "'sft.max_length' (TRL's max_length) does not apply here: sequence lengths are the data "
                           "section's, one for every stage"),
    ("rm.max_length=512", "its RewardTrainer leaves out a pair longer than it); set data.max_length"),
    ("sft.truncation_mode=keep_start", "set data.max_length"),
    ("sft.dataset_text_field=content", "set data.sft_path in one of the formats of docs/data.md, and data.columns "
                                       "{your_column: text}"),
    ("sft.dataset_kwargs={skip_prepare_dataset: true}", "skip_prepare_dataset would train on untokenized text"),
    ("sft.assistant_only_loss=true", "the loss is on the completion: the final assistant turn"),
    ("sft.eos_token=<|im_end|>", "every stage ends a response with the tokenizer's EOS"),
    ("rm.eos_token=</s>", "another end token here would train a stop that no later stage uses; remove the key"),
    ("sft.chat_template_path=t.jinja", "set data.chat_template"),
    ("rm.chat_template_path=t.jinja", "set data.chat_template"),
    ("sft.pad_token=x", "deprecated in TRL 1.16"),
    ("rm.pad_to_multiple_of=8", "sequences are padded to the batch's longest"),
    ("sft.activation_offloading=true", "offloading them is not wired"),
    ("rm.activation_offloading=true", "offloading them is not wired"),
    ("rm.disable_dropout=false", "TRL's default (true) holds: dropout is off in the reward model"),
    ("sft.model_init_kwargs={revision: main}", "set the model section"),
    ("rm.trust_remote_code=true", "the harness loads only models transformers implements"),
    ("sft.router_aux_loss_coef=0.01", "mixture-of-experts routers only"),
    ("sft.dataset_num_proc=4", "the data are tokenized in one process"),
    ("sft.use_liger_kernel=true", "Liger's kernels are not wired here"),
    ("sft.num_train_epochs=3", "set sft.epochs"),
    ("rm.per_device_train_batch_size=8", "set rm.batch_size = per-device batch x processes"),
    ("grpo.use_vllm=true", "'grpo.use_vllm' (TRL's use_vllm) does not apply here: this harness samples through its own "
                           "merged sampler (quantization.dequantized_copy), not vLLM; remove the key"),
    ("rloo.per_device_train_batch_size=4", "'rloo.per_device_train_batch_size' (TRL's per_device_train_batch_size) "
                                           "does not apply here: batch sizes are global here; set rloo.micro_batch"),
    ("ppo.num_mini_batches=2", "set ppo.minibatch = ppo.rollout_batch / num_mini_batches"),
])
def test_a_refused_trl_field_fails_in_one_line(override, said):
    with pytest.raises(config.ConfigError) as e:
        config.load(TINY, [override])
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert "did you mean" not in str(e.value)


@pytest.mark.parametrize("overrides, said", [
    (["dpo.loss_type=[]"], "dpo.loss_type is an empty list; name one TRL loss type (sigmoid) or several"),
    (["dpo.loss_weights=[1.0]"], "must have one weight per dpo.loss_type"),
    (["dpo.loss_type=exo_pair", "dpo.loss_weights=null"], "dpo.loss_type exo_pair needs dpo.label_smoothing above 0"),
    (["dpo.loss_type=robust", "dpo.loss_weights=null", "dpo.label_smoothing=0.5"],
     "dpo.label_smoothing must be in [0, 0.5) for loss_type robust"),
    (["dpo.ld_alpha=1.5"], "dpo.ld_alpha must be in [0, 1]"),
    (["dpo.loss_type=discopop", "dpo.loss_weights=null", "dpo.discopop_tau=0"], "dpo.discopop_tau must be above 0"),
    (["dpo.f_divergence_type=kl"], "dpo.f_divergence_type: 'kl' is not one of"),
    (["dpo.f_divergence_type=forward_kl", "dpo.loss_type=[sigmoid, nca_pair]"],
     "takes only loss types discopop, exo_pair, hinge, ipo, robust, sft, sigmoid, sigmoid_norm (TRL 1.16 refuses "
     "nca_pair)"),
    (["dpo.use_weighting=true", "dpo.loss_type=aot", "dpo.loss_weights=null"], "does not go with loss types aot"),
])
def test_a_dpo_loss_option_no_loss_runs_or_reads_fails_in_one_line(overrides, said):
    with pytest.raises(config.ConfigError) as e:
        config.load(TINY, overrides)
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides, said", [
    (["dpo.loss_type=robust", "dpo.loss_weights=null"], "dpo.loss_type robust at dpo.label_smoothing 0 is TRL's "
                                                        "sigmoid loss; set dpo.label_smoothing (e.g. 0.1"),
    (["dpo.label_smoothing=0.1"], "dpo.label_smoothing=0.1 is read only by loss types robust, exo_pair, aot, "
                                  "aot_unpaired (TRL 1.16's sigmoid ignores it: no conservative DPO)"),
    (["dpo.discopop_tau=0.1"], "dpo.discopop_tau is read only by loss_type discopop"),
    (["dpo.f_alpha_divergence_coef=0.3"], "read only with dpo.f_divergence_type alpha_divergence"),
    (["dpo.loss_type=[sigmoid, sigmoid]", "dpo.loss_weights=[1.0, 1.0]"],
     "dpo.loss_type names 'sigmoid' twice: TRL adds its loss twice"),
    (["dpo.loss_weights=[1.0, -0.5]"], "dpo.loss_weights [1.0, -0.5]: a negative weight maximizes its loss"),
    (["dpo.loss_weights=[0, 0]"], "all 0 trains nothing"),
])
def test_a_dpo_loss_option_that_changes_nothing_runs_as_under_trl_and_says_so(overrides, said, caplog):
    """TRL 1.16 runs these settings, and they change nothing or not what they seem to (no loss named reads the
    option, robust at 0 is sigmoid, a loss named twice, a weight below 0): the config runs as written, with a warning
    that says so."""
    from rlhf.recipes import dpo, kto

    with caplog.at_level(logging.WARNING):
        exp = config.load(TINY, overrides)
    assert not caplog.records  # not as it loads (every stage loads the dpo section): the DPO stage says it
    notes = dpo.METHOD.notes(exp.dpo, "dpo")
    assert len(notes) == 1 and said in notes[0], notes
    assert kto.METHOD.notes(exp.kto, "kto") == []


def test_trls_dpo_loss_recipes_load_as_written():
    """TRL's documented DPO variants, as a TRL user writes them."""
    for overrides in (["dpo.loss_type=robust", "dpo.label_smoothing=0.1"],
                      ["dpo.loss_type=exo_pair", "dpo.label_smoothing=1e-3"],
                      ["dpo.loss_type=aot"],
                      ["dpo.loss_type=discopop", "dpo.discopop_tau=0.1"],
                      ["dpo.loss_type=[sigmoid, bco_pair, sft]", "dpo.loss_weights=[0.8, 0.2, 1.0]"],  # MPO
                      ["dpo.loss_type=sigmoid", "dpo.ld_alpha=0.5", "dpo.use_weighting=true"],
                      ["dpo.loss_type=sigmoid", "dpo.f_divergence_type=alpha_divergence",
                       "dpo.f_alpha_divergence_coef=0.3"]):
        extra = [] if any(o.startswith("dpo.loss_weights") for o in overrides) else ["dpo.loss_weights=null"]
        exp = config.load(TINY, overrides + extra)
        assert exp.dpo.loss_type == config.yaml_value(overrides[0].split("=", 1)[1])
