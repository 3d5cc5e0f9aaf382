import dataclasses
import json
import re
import subprocess
import sys

import pytest

from rlhf.experiment import config, online_sections, sections
from rlhf.experiment.config import ConfigError

from .conftest import ROOT, TINY

SECTION_MODULES = (sections, online_sections)
"""Where the experiment's sections are declared."""

EXPERIMENTS = sorted((ROOT / "experiments").glob("*.yaml"))


def test_ships_the_three_experiments():
    names = {p.name for p in EXPERIMENTS}
    assert {"tiny.yaml", "llama2-7b-hh-4090.yaml", "mistral-7b-h100.yaml"} <= names


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.name)
def test_every_experiment_builds_every_stage_config(path):
    exp = config.load(path)
    for section in ("model", "quantization", "lora", "data", "sft", "rm", "dpo", "ppo", "eval", "memory",
                    "tracking"):
        assert dataclasses.is_dataclass(getattr(exp, section)), section
    assert exp.name == path.stem  # a missing name would write into results/tiny


def test_7b_experiments_say_what_the_issue_asks():
    llama = config.load(ROOT / "experiments" / "llama2-7b-hh-4090.yaml")
    assert llama.model.name == "meta-llama/Llama-2-7b-hf" and llama.quantization.load_in_4bit
    assert llama.quantization.quant_type == "nf4" and llama.quantization.double_quant
    assert llama.lora.r == 16 and llama.sft.optim == "paged_adamw_8bit" and llama.model.gradient_checkpointing
    assert (llama.data.sft_examples, llama.data.pref_pairs, llama.data.ppo_prompts) == (20000, 50000, 20000)
    assert llama.data.max_length == 512 and llama.memory.budget_gb == 24
    mistral = config.load(ROOT / "experiments" / "mistral-7b-h100.yaml")
    assert mistral.lora.r == 32 and mistral.lora.alpha == 64 and mistral.lora.target_modules == ["q_proj", "v_proj"]
    assert mistral.model.dtype == "bfloat16"
    for exp in (llama, mistral):  # the judge on a fifth of the pairs; the online stages keep its choice
        assert exp.data.judge_fraction == 0.2 and exp.ppo.keep == "judge" and exp.ppo.judge_every == 5
        # a fixed beta (TRL's 0.05), no controller, and a KL budget for the kept policy
        assert exp.ppo.kl_coef == 0.05 and not exp.ppo.adaptive_kl and exp.ppo.kl_band[1] > 0
    assert llama.grpo.keep == llama.rloo.keep == "judge"


def test_every_field_is_documented():
    """Each field of each section is followed by its docstring, in the class that declares it (rlhf/experiment/sections.py,
    rlhf/experiment/online_sections.py)."""
    import dataclasses
    import inspect

    classes = [c for m in SECTION_MODULES for _, c in inspect.getmembers(m, inspect.isclass)
               if dataclasses.is_dataclass(c) and c.__module__ == m.__name__]
    assert {config.PPOConfig, config.GRPOConfig, config.RewardConfig, config.OnlineConfig} <= set(classes)
    for cls in classes:
        src = inspect.getsource(cls).splitlines()
        for name in cls.__annotations__:
            (i,) = [k for k, line in enumerate(src) if line.startswith(f"    {name}:")]
            assert src[i + 1].strip().startswith('"""'), f"{cls.__name__}.{name} has no docstring"


def _sections(cls, prefix=""):
    """(dotted name, declared type) of every dataclass-typed field under `cls`, nested ones (data.synthetic) too."""
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield prefix + f.name, hints[f.name]
            yield from _sections(hints[f.name], f"{prefix}{f.name}.")


def test_every_default_is_declared_on_its_section(tmp_path):
    """The default a section's class declares (and documents) is the effective one, for every field of every section:
    in Experiment() and in an experiment file that leaves the section out. No factory elsewhere changes it."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    built, loaded = config.Experiment(), config.load(empty)
    sections = list(_sections(config.Experiment))
    assert {"dpo", "grpo", "rloo", "data.synthetic"} <= {name for name, _ in sections}
    for name, cls in sections:
        declared = cls()
        for exp in (built, loaded):
            section = exp
            for part in name.split("."):
                section = getattr(section, part)
            assert type(section) is cls, name
            for f in dataclasses.fields(cls):
                assert getattr(section, f.name) == getattr(declared, f.name), f"{name}.{f.name}"


def test_a_default_stated_in_a_docstring_is_the_declared_one():
    """The section modules' convention: a docstring that states its field's default writes it as default `value`; every
    field a section redeclares (GRPO's minibatch, DPO's learning_rate...) states it. Each stated value is the real
    one."""
    import ast
    import inspect

    import yaml

    stated, classes = {}, {}  # (class, field) -> the value its docstring states; name -> class
    for module in SECTION_MODULES:
        classes.update((c.__name__, c) for c in vars(module).values() if dataclasses.is_dataclass(c))
        for node in ast.parse(inspect.getsource(module)).body:
            for field, doc in zip(node.body, node.body[1:]) if isinstance(node, ast.ClassDef) else ():
                if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
                    found = re.findall(r"default `([^`]+)`", doc.value.value)
                    if found:
                        stated[node.name, field.target.id] = found[0]
    for (cls_name, name), text in stated.items():  # the stated value read as an experiment file's would be
        cls = classes[cls_name]
        as_read = config.build(cls, {name: yaml.safe_load(text)}, f"{cls_name}.{name}'s docstring")
        assert getattr(as_read, name) == getattr(cls(), name), f"{cls_name}.{name}: the docstring says {text}"
    redeclared = {(c.__name__, n) for c in classes.values()
                  for n in c.__annotations__ for base in c.__mro__[1:] if n in getattr(base, "__annotations__", {})}
    assert ("GRPOConfig", "minibatch") in redeclared and ("DPOConfig", "learning_rate") in redeclared
    assert redeclared <= set(stated), f"redeclared without default `value` in the docstring: {redeclared - set(stated)}"


def test_overrides_are_typed_and_applied():
    exp = config.load(TINY, ["sft.learning_rate=1e-4", "ppo.steps=3", "lora.target_modules=[q_proj]"])
    assert exp.sft.learning_rate == 1e-4 and exp.ppo.steps == 3 and exp.lora.target_modules == ["q_proj"]
    assert exp.dpo.learning_rate == 1e-3  # untouched sections keep the file's values


def test_unknown_key_names_the_key_and_the_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"^override sft.learning_rat=1: unknown key 'sft.learning_rat' \(did you "
                                          r"mean 'sft.learning_rate'\?\)"):  # the override is named, not the file
        config.load(TINY, ["sft.learning_rat=1"])
    with pytest.raises(ConfigError, match=r"^override sftt.epochs=1: unknown key 'sftt' \(did you mean 'sft'\?\)"):
        config.load(TINY, ["sftt.epochs=1"])  # an unknown section: the override that named a key under it
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nlora:\n  rank: 8\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:3: unknown key 'lora.rank'"):  # the file's line that sets it
        config.load(bad)
    # an error about two keys together names the override that set either, else the file's line of the first
    with pytest.raises(ConfigError, match=r"^override data.max_length=8: data.max_prompt_length \(12\) must be "
                                          r"below data.max_length \(8\), .* lower the one or raise the other$"):
        config.load(TINY, ["data.max_length=8"])
    with pytest.raises(ConfigError, match=r"^override dpo.loss_weights=\[1.0\]: dpo.loss_weights"):
        config.load(TINY, ["dpo.loss_type=[sigmoid, sft]", "dpo.loss_weights=[1.0]"])
    short = tmp_path / "short.yaml"
    short.write_text(TINY.read_text().replace("  max_length: 32\n", "  max_length: 10\n"))
    line = short.read_text().splitlines().index("  max_prompt_length: 12") + 1
    with pytest.raises(ConfigError, match=rf"short.yaml:{line}: data.max_prompt_length \(12\) must be below "):
        config.load(short)
    bad.write_text("name: x\nseed: 1\n\ndpo:\n  beta: -2\nppo:\n  steps: many\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:7: ppo.steps: expected int, got str 'many'$"):
        config.load(bad)
    with pytest.raises(ConfigError, match=r"bad.yaml:5: dpo.beta must be above 0, got -2.0$"):  # checked after
        config.load(bad, ["ppo.steps=3"])
    with pytest.raises(ConfigError, match=r"^override dpo.beta=0: dpo.beta must be above 0, got 0.0$"):
        config.load(bad, ["ppo.steps=3", "dpo.beta=0"])  # the override's value, not the file's line


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"^override ppo.steps=many: ppo.steps: expected int, got str 'many'"):
        config.load(TINY, ["ppo.steps=many"])
    with pytest.raises(ConfigError, match=r"^override lora=\{r: x\}: lora.r: expected int"):  # a key under it
        config.load(TINY, ["lora={r: x}"])
    with pytest.raises(ConfigError, match=r"data.source: 'web' is not one of"):
        config.load(TINY, ["data.source=web"])


def test_the_judges_settings_are_checked():
    with pytest.raises(ConfigError, match=r"ppo.keep: 'judge_best' is not one of \['auto', 'judge', 'last'\]"):
        config.load(TINY, ["ppo.keep=judge_best"])
    with pytest.raises(ConfigError, match=r"'ppo.overopt_confirm' was replaced by 'ppo.overopt_z'"):
        config.load(TINY, ["ppo.overopt_confirm=0.25"])
    with pytest.raises(ConfigError, match=r"grpo.overopt_z must be >= 0 and grpo.overopt_alpha in \(0, 1\)"):
        config.load(TINY, ["grpo.overopt_z=-1"])
    with pytest.raises(ConfigError, match=r"ppo.overopt_z must be >= 0 and ppo.overopt_alpha in \(0, 1\)"):
        config.load(TINY, ["ppo.overopt_alpha=0"])
    assert config.load(TINY, ["ppo.overopt_z=0"]).ppo.overopt_z == 0  # 0: the threshold from overopt_alpha
    with pytest.raises(ConfigError, match=r"ppo.playoff_alpha must be in \[0, 1\) \(0: no playoff\), and "
                                          r"ppo.playoff_margin and ppo.fall_margin in \[0, 1\) .* got 0.05, 1.5 and "
                                          r"0.1"):
        config.load(TINY, ["ppo.playoff_margin=1.5"])
    with pytest.raises(ConfigError, match=r"grpo.fall_margin in \[0, 1\) .* got 0.05, 0.2 and -0.1"):
        config.load(TINY, ["grpo.fall_margin=-0.1"])
    assert config.load(TINY, ["ppo.fall_margin=0"]).ppo.fall_margin == 0  # 0: any significant drop
    with pytest.raises(ConfigError, match=r"rloo.playoff_alpha must be in \[0, 1\)"):
        config.load(TINY, ["rloo.playoff_alpha=-0.1"])
    assert config.load(TINY, ["ppo.playoff_margin=0"]).ppo.playoff_margin == 0  # 0: any significant gain
    with pytest.raises(ConfigError, match=r"rm.ensemble=3 with rloo.normalize_reward=false would mix the members' "
                                          r"raw scores"):
        config.load(TINY, ["rm.ensemble=3", "rloo.normalize_reward=false"])
    from rlhf.rl import online_plan

    # checked when the stage runs: here GRPO lacks the judge, and PPO's keep=judge does not stop it
    exp = config.load(TINY, ["grpo.keep=judge", "ppo.keep=judge", "data.judge_fraction=0", "reward.model=0",
                             "reward.functions={rlhf.inputs.data:letters_reward: 1}"])
    with pytest.raises(ConfigError, match=r"grpo.keep=judge needs the judge: data.judge_fraction > 0, "
                                          r"reward.judge_functions or reward.judge_model; or set grpo.keep=last"):
        online_plan.check_keep(exp, "grpo", exp.grpo)
    # the user's own judge: reward functions the stage does not optimize
    own = config.load(TINY, ["grpo.keep=judge", "data.judge_fraction=0", "reward.model=0",
                             "reward.functions={rlhf.inputs.data:letters_reward: 1}",
                             "reward.judge_functions={tests.rewardfns:length_reward: 1}"])
    online_plan.check_keep(own, "grpo", own.grpo)
    with pytest.raises(ConfigError, match=r"reward.judge_functions: rlhf.inputs.data:letters_reward also in "
                                          r"reward.functions: a judge the stage optimizes is not independent"):
        config.load(TINY, ["reward.functions={rlhf.inputs.data:letters_reward: 1}",
                           "reward.judge_functions={rlhf.inputs.data:letters_reward: 1}"])
    with pytest.raises(ConfigError, match=r"reward.judge_functions: 'nope' is not an import path"):
        config.load(TINY, ["reward.judge_functions={nope: 1}"])
    online_plan.check_keep(exp, "rloo", exp.rloo)  # keep=auto: the judge's choice when there is one, else the last
    assert exp.rloo.keep == "auto"
    with pytest.raises(ConfigError, match=r"data.judge_fraction must be in \[0, 1\), got 1.0"):
        config.load(TINY, ["data.judge_fraction=1.0"])
    with pytest.raises(ConfigError, match=r"rm.ensemble must be >= 1"):
        config.load(TINY, ["rm.ensemble=0"])
    assert config.load(TINY, ["rloo.keep=judge"]).rloo.keep == "judge"


def test_an_adaptive_kl_controller_that_cannot_reach_its_target_is_refused():
    """target_kl > 0, inside kl_band, and a horizon short enough for beta to move by a factor of 2 in the run."""
    on = ["ppo.adaptive_kl=true", "ppo.target_kl=4", "ppo.kl_band=[2, 6]", "ppo.kl_horizon=1000"]
    assert config.load(TINY, on).ppo.adaptive_kl  # 60 x 0.2 x 64 / 1000 = 0.77 >= ln 2
    with pytest.raises(ConfigError, match=r"ppo.target_kl must be > 0 with ppo.adaptive_kl, got 0.0"):
        config.load(TINY, [*on, "ppo.target_kl=0"])
    with pytest.raises(ConfigError, match=r"^override ppo.target_kl=6.5: ppo.target_kl \(6.5\) is outside "
                                          r"ppo.kl_band \[2.0, 6.0\]"):
        config.load(TINY, [*on, "ppo.target_kl=6.5"])
    # the 7B experiments' former setting: 300 steps x 64 episodes, horizon 10000 -> beta moves by 1.47x at most
    with pytest.raises(ConfigError, match=r"^override ppo.kl_horizon=10000: .*factor of 1.47 at most.*set "
                                          r"ppo.kl_horizon <= 5539, or ppo.adaptive_kl=false"):
        config.load(TINY, [*on, "ppo.steps=300", "ppo.kl_horizon=10000"])
    assert not config.load(TINY, ["ppo.target_kl=0"]).ppo.adaptive_kl  # a fixed beta ignores the target


def test_an_override_replaces_a_mapping_value_whole_and_a_section_key_by_key(tmp_path):
    """`reward.functions={...}` on the command line is the functions the run uses (the file's are not kept: there
    would be no way to drop one); `lora={r: 4}` sets r and keeps the file's other lora keys."""
    exp = tmp_path / "exp.yaml"
    exp.write_text(TINY.read_text() + "\nreward:\n  functions: {tests.rewardfns:allowed_letters: 0.5}\n")
    assert config.load(exp).reward.functions == {"tests.rewardfns:allowed_letters": 0.5}
    only = config.load(exp, ['reward.functions={"rlhf.inputs.data:letters_reward": 1.0}'])
    assert only.reward.functions == {"rlhf.inputs.data:letters_reward": 1.0}
    assert config.load(exp, ["reward.functions={}"]).reward.functions == {}
    lora = config.load(exp, ["lora={r: 4}"]).lora
    assert lora.r == 4 and lora.modules_to_save == config.load(exp).lora.modules_to_save != []
    # a dotted key below a mapping sets that entry (the file's others kept); a mapping typed whole replaces it
    exp.write_text("name: x\ndata:\n  columns: {q: prompt, a: chosen}\n")
    assert config.load(exp, ["data.columns.b=rejected"]).data.columns == {"q": "prompt", "a": "chosen",
                                                                          "b": "rejected"}
    assert config.load(exp, ["data.columns={b: rejected}"]).data.columns == {"b": "rejected"}
    added = config.load(TINY, ["data.columns.b=rejected"])  # a file without the mapping: made, and dumped as YAML
    assert added.data.columns == {"b": "rejected"} and "  columns:\n    b: rejected\n" in config.dump(added)


def test_an_error_names_the_override_that_set_the_key_else_the_files_line(tmp_path):
    """The most specific override that set the key is named; a section override names only the keys it set (the
    file's others keep their line); a caller's dict override is named by its key; a former name (ppo.epochs) is
    checked as the field it now is."""
    exp = tmp_path / "exp.yaml"
    exp.write_text("name: x\nlora:\n  dropout: 2\n")
    with pytest.raises(ConfigError, match=r"^override lora.dropout=1: lora.dropout must be in \[0, 1\), got 1.0$"):
        config.load(exp, ["lora={r: 4}", "lora.dropout=1"])
    with pytest.raises(ConfigError, match=rf"^{exp}:3: lora.dropout must be in \[0, 1\), got 2.0$"):
        config.load(exp, ["lora={r: 4}"])
    with pytest.raises(ConfigError, match=r"^override dpo.beta: dpo.beta must be above 0, got 0.0$"):
        config.load(TINY, {"dpo": {"beta": 0}})
    exp.write_text("name: x\nppo:\n  steps: 3\n  clip_range: 0\n")  # a former name's line, under the new name
    with pytest.raises(ConfigError, match=rf"^{exp}:4: ppo.cliprange must be above 0, got 0.0$"):
        config.load(exp)
    for override in ("ppo.num_ppo_epochs=0", "ppo.epochs=0"):
        with pytest.raises(ConfigError, match=rf"^override {override}: ppo.num_ppo_epochs must be above 0, got 0$"):
            config.load(TINY, [override])


def test_inconsistent_batch_sizes_fail_instead_of_being_fixed():
    with pytest.raises(ConfigError, match="ppo.rollout_batch"):
        config.load(TINY, ["ppo.rollout_batch=60", "ppo.minibatch=16"])


@pytest.mark.parametrize("override, says", [
    ("grpo.num_generations=3", "grpo.rollout_batch (64) must be a multiple of grpo.num_generations (3)"),
    ("grpo.minibatch=7", "grpo.rollout_batch (64) must be a multiple of grpo.minibatch (7)"),
    ("dpo.loss_type=robust", "one weight per dpo.loss_type (robust); set dpo.loss_weights=null to weigh each type 1"),
    ("grpo.mini_batch_size=4", "set grpo.minibatch (responses per optimizer step, global)"),
    ("ppo.total_episodes=3", "set ppo.steps"),
    ("data.max_length=384", "data.max_length (384) is over model.max_position_embeddings (64), the tiny model's "
                            "context"),
    ("eval.max_new_tokens=60", "data.max_prompt_length + eval.max_new_tokens (72) is over "
                               "model.max_position_embeddings"),
    ("ppo.response_length=60", "data.max_prompt_length + ppo.response_length (72) is over"),
])
def test_a_value_that_conflicts_with_the_files_names_the_override_and_the_key_to_set(override, says):
    """The override is named (not the file whose value it conflicts with), and what to set, with its section."""
    with pytest.raises(ConfigError, match=rf"^override {re.escape(override)}: .*{re.escape(says)}"):
        config.load(TINY, [override])


@pytest.mark.parametrize("override, says", [
    ("sft.learning_rate=-1", "sft.learning_rate must be above 0, got -1.0"),
    ("dpo.batch_size=0", "dpo.batch_size must be above 0, got 0"),
    ("kto.grad_accum=0", "kto.grad_accum must be above 0"),
    ("grpo.micro_batch=0", "grpo.micro_batch must be above 0"),
    ("eval.batch_size=0", "eval.batch_size must be above 0"),
    ("lora.r=0", "lora.r must be >= 1 and lora.alpha above 0, got 0 and 32"),
    ("lora.alpha=-5", "lora.r must be >= 1 and lora.alpha above 0, got 16 and -5"),
    ("grpo.temperature=0", "grpo.temperature must be above 0"),
    ("dpo.beta=-0.5", "dpo.beta must be above 0, got -0.5"),  # TRL trains against the preferences
    ("kto.undesirable_weight=0", "kto.undesirable_weight must be above 0"),
    ("grpo.beta=-0.1", "grpo.beta must be 0 or above"),
    ("ppo.cliprange=0", "ppo.cliprange must be above 0"),
    ("ppo.gamma=1.5", "ppo.gamma must be in [0, 1], got 1.5"),
    ("sft.warmup_ratio=1", "sft.warmup_ratio must be in [0, 1), got 1.0"),  # transformers: 1 warmup step
    ("dpo.loss_type=[exo_pair, sft]", "dpo.loss_type exo_pair needs dpo.label_smoothing above 0"),
    ("eval.top_p=0", "eval.top_p must be in (0, 1]"),
    ("dpo.loss_type=[sigmoid,bogus]", "dpo.loss_type: 'bogus' is not one of ['aot', "),  # TRL's traceback, once
    ("dpo.loss_type=sigmoid,sft", "'sigmoid,sft' is not one of ['aot', "),  # training had started
    ("dpo.loss_type=sigmoid,sft", "; a list of them is written [a, b]"),
    ("ppo.optim=adamw_8bit", "ppo.optim='adamw_8bit': the online stages train with adamw_torch or "
                             "adamw_torch_fused or paged_adamw_8bit"),
])
def test_a_value_no_stage_can_run_with_fails_when_the_config_loads(override, says):
    """Values that once passed --print-config and failed after the model loaded (a trainer's traceback, a run
    directory left behind), or, for an online stage's optimizer, were read as AdamW without a word."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        config.load(TINY, [override])


def test_an_online_stage_takes_trls_default_optimizer_as_written():
    """GRPOConfig's default optim, adamw_torch_fused, runs here as torch's AdamW (the same update)."""
    assert config.load(TINY, ["grpo.optim=adamw_torch_fused"]).grpo.optim == "adamw_torch_fused"


def test_a_trl_stage_with_an_optimizer_or_schedule_transformers_lacks_stops_before_its_run_starts(tmp_path):
    """sft.optim / lr_scheduler are transformers' names: a typo is one line naming the closest ones, before a run
    directory or a model exists (Session.start; rlhf/runs/runtime.py)."""
    from rlhf.runs import runtime

    for override, says in (("sft.optim=adamw_8bitt", "sft.optim='adamw_8bitt' is not a transformers name; did you "
                                                     "mean 'adamw_8bit'"),
                           ("dpo.lr_scheduler=cosinee", "dpo.lr_scheduler='cosinee' is not a transformers name; did "
                                                        "you mean 'cosine'?")):
        exp = config.load(TINY, [f"results_dir={tmp_path}", override])
        with pytest.raises(ConfigError, match=re.escape(says)):
            runtime.Session.start(exp, override.split(".")[0])
    assert not list(tmp_path.rglob("*"))
    runtime.check_trainer_names(config.load(TINY, ["sft.optim=paged_adamw_8bit", "sft.lr_scheduler=linear"]), "sft")


def test_a_run_on_fewer_processes_than_its_experiment_plans_for_is_refused_before_it_starts(tmp_path):
    """llama2-13b-2gpu.yaml plans each of 2 ranks' memory (distributed.num_processes); a `make ppo` without NPROC=2
    would run one rank holding twice its plan. Refused, naming the launch; more ranks than planned hold less each."""
    from rlhf.runs import runtime

    exp = config.load(TINY, [f"results_dir={tmp_path}", "distributed.num_processes=2"])
    with pytest.raises(ConfigError, match=re.escape("distributed.num_processes = 2, but this run has 1 process(es): "
                                                    "its memory plan is per rank of 2; launch them with `make sft "
                                                    "NPROC=2`")):
        runtime.Session.start(exp, "sft")
    assert not list(tmp_path.rglob("*"))


def test_an_experiment_file_a_user_got_wrong_is_one_line_naming_it(tmp_path):
    """A YAML error names the file, line and column where the parser stopped; a key given twice (PyYAML keeps the
    last silently: a second `sft:` replaced the first), an empty file (it ran on the built-in defaults as 'tiny') and
    a directory are refused; a value given twice in an override too."""
    cases = {"indent.yaml": ("name: x\nsft:\n  max_steps: 3\n   learning_rate: 1\n",
                             ":4:17: not valid YAML: mapping values are not allowed here"),
             "twice.yaml": ("name: x\nsft:\n  max_steps: 3\nsft:\n  learning_rate: 1.0\n",
                            ":4:1: not valid YAML: found duplicate key 'sft'"),
             "nested.yaml": ("name: x\nsft:\n  max_steps: 3\n  max_steps: 4\n",
                             ":4:3: not valid YAML: found duplicate key 'max_steps'"),
             "empty.yaml": ("\n# nothing\n", ": empty")}
    for name, (text, says) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError) as e:
            config.load(tmp_path / name)
        assert str(e.value) == f"{tmp_path / name}{says}" + (" (see experiments/ for the shipped ones)"
                                                             if name == "empty.yaml" else ""), e
    with pytest.raises(ConfigError, match="a directory; give the experiment's YAML file"):
        config.load(tmp_path)
    with pytest.raises(ConfigError, match=r"not valid YAML \(found duplicate key 'a.b:f'\)$"):
        config.load(TINY, ["reward.functions={a.b:f: 1, a.b:f: 2}"])
    assert config.load(TINY).rloo.num_generations == config.load(TINY).grpo.num_generations  # an alias still reads
    (tmp_path / "merged.yaml").write_text(  # a merge key, and an explicit key over a merged one, are no duplicates
        "name: merged\ngrpo: &online\n  steps: 7\n  beta: 0.1\nrloo:\n  <<: *online\n  beta: 0.2\n")
    merged = config.load(tmp_path / "merged.yaml")
    assert (merged.grpo.steps, merged.rloo.steps, merged.grpo.beta, merged.rloo.beta) == (7, 7, 0.1, 0.2)
    with pytest.raises(ConfigError, match=f"model.name='{tmp_path}/llama': no such directory"):  # not a hub id error
        config.load(TINY, [f"model.name={tmp_path}/llama"])
    with pytest.raises(ConfigError, match=re.escape("reward.functions: 'my.rw:good:1' has no value; YAML needs a "
                                                    "space after the colon: {my.rw:good: 1}")):
        config.load(TINY, ["reward.functions={my.rw:good:1}"])
    with pytest.raises(ConfigError, match="results_dir=.* is a file; name a folder"):
        config.load(TINY, [f"results_dir={tmp_path / 'empty.yaml'}"])


def test_cli_unknown_key_is_one_line_without_traceback():
    out = subprocess.run([sys.executable, "-m", "rlhf", "sft", "--exp", str(TINY), "sft.lr=1"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert "unknown key 'sft.lr'" in out.stderr


def test_resolved_config_round_trips(tmp_path):
    exp = config.load(TINY, ["ppo.steps=7"])
    p = tmp_path / "resolved.yaml"
    p.write_text(config.dump(exp))
    again = config.load(p)
    again.source = exp.source
    assert config.to_dict(again) == config.to_dict(exp)


def test_print_config_prints_the_resolved_experiment_and_runs_nothing(tmp_path):
    """`python -m rlhf <stage> --exp ... key=value ... --print-config`, as a user types it: the config with the
    overrides applied (a dict one the shell split at its spaces included), which loads back to the same experiment;
    no stage runs (no run record)."""
    overrides = [f"results_dir={tmp_path / 'results'}", "ppo.steps=3", "grpo.beta=0.0",
                 "reward.functions={tests.rewardfns:length_reward:", "0.5}"]
    out = subprocess.run([sys.executable, "-m", "rlhf", "ppo", "--exp", str(TINY), *overrides, "--print-config"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    printed = tmp_path / "printed.yaml"
    printed.write_text(out.stdout)
    again, expected = config.load(printed), config.load(TINY, config.join_split(overrides))
    assert out.stdout.startswith(f"# source: {TINY}\n") and again.source == str(printed)
    again.source = expected.source
    assert config.to_dict(again) == config.to_dict(expected)
    assert (again.ppo.steps, again.grpo.beta, again.reward.functions) == (3, 0.0, {"tests.rewardfns:length_reward": 0.5})
    assert not (tmp_path / "results").exists()


def test_group_loss_settings_follow_trl_and_the_old_key_names_its_replacement(tmp_path):
    exp = config.load(ROOT / "experiments" / "tiny.yaml")
    assert (exp.grpo.loss_type, exp.grpo.scale_rewards, exp.grpo.kl_penalty) == ("grpo", "group", "loss")
    # RLOO's defaults are TRL 1.16's RLOOTrainer's (tiny.yaml's rloo shares grpo's other keys)
    assert (exp.rloo.loss_type, exp.rloo.scale_rewards, exp.rloo.kl_penalty) == ("rloo", "none", "reward")
    assert (config.Experiment().rloo.loss_type, config.Experiment().rloo.scale_rewards) == ("rloo", "none")
    # the KL term's ratio weighting: TRL 1.16's field, with its default (read from TRL, not restated)
    import trl

    trl_default = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}["use_bias_correction_kl"]
    assert exp.grpo.use_bias_correction_kl is config.Experiment().grpo.use_bias_correction_kl is trl_default is True
    assert config.load(ROOT / "experiments" / "tiny.yaml",
                       ["grpo.use_bias_correction_kl=false"]).grpo.use_bias_correction_kl is False
    # TRL's scale_rewards: a string, with true / false read as group / none
    both = config.load(ROOT / "experiments" / "tiny.yaml", ["grpo.scale_rewards=false", "rloo.scale_rewards=true",
                                                            "grpo.loss_type=dr_grpo"])
    assert (both.grpo.scale_rewards, both.rloo.scale_rewards, both.grpo.loss_type) == ("none", "group", "dr_grpo")
    with pytest.raises(config.ConfigError, match="grpo.loss_type: 'sequence' is not one of"):
        config.load(ROOT / "experiments" / "tiny.yaml", ["grpo.loss_type=sequence"])
    with pytest.raises(config.ConfigError, match="rloo.scale_rewards: 'std' is not one of"):
        config.load(ROOT / "experiments" / "tiny.yaml", ["rloo.scale_rewards=std"])
    for old, new in (("rloo.loss_norm=token", "'rloo.loss_norm' was replaced by 'rloo.loss_type'"),
                     ("grpo.loss_norm=sequence", "'grpo.loss_norm' was replaced by 'grpo.loss_type'"),
                     ("dpo.max_kl_to_sft=4", "'dpo.max_kl_to_sft' was replaced by 'dpo.max_kl_ref'")):
        with pytest.raises(config.ConfigError, match=new):
            config.load(ROOT / "experiments" / "tiny.yaml", [old])


def test_kto_defaults_are_trls():
    """kto's beta, desirable_weight, undesirable_weight and loss_type are the installed TRL KTOConfig's defaults, and
    its loss types TRL's (its learning rate is DPO's here: the field says why)."""
    import trl

    fields = {f.name: f for f in dataclasses.fields(trl.KTOConfig)}
    ours = config.Experiment().kto
    names = ("beta", "desirable_weight", "undesirable_weight", "loss_type")
    assert {k: getattr(ours, k) for k in names} == {k: fields[k].default for k in names}
    assert config.CHOICES["kto.loss_type"] == set(fields["loss_type"].metadata["choices"])
    dpo_help = next(f for f in dataclasses.fields(trl.DPOConfig) if f.name == "loss_type").metadata["help"]
    assert config.CHOICES["dpo.loss_type"] == set(re.findall(r"`'(\w+)'`", dpo_help.split("If multiple")[0]))
    assert ours.learning_rate == config.Experiment().dpo.learning_rate != fields["learning_rate"].default


def test_optimizer_settings_are_explicit_on_every_training_section():
    exp = config.Experiment()
    for name in ("sft", "rm", "dpo", "kto"):  # transformers' TrainingArguments defaults, for every optim
        t = getattr(exp, name)
        assert (t.weight_decay, t.adam_beta1, t.adam_beta2, t.adam_epsilon) == (0.0, 0.9, 0.999, 1e-8)
    for name in config.ONLINE:  # PPO: cleanrl's eps; GRPO and RLOO: TRL's (TrainingArguments'), for either optim
        o = getattr(exp, name)
        eps = 1e-5 if name == "ppo" else 1e-8
        assert (o.weight_decay, o.adam_beta1, o.adam_beta2, o.adam_epsilon) == (0.0, 0.9, 0.999, eps), name


def test_an_adapter_records_its_local_base_by_its_absolute_path(tmp_path, monkeypatch):
    """model.name as a folder relative to where make runs: the run records keep it as given (results/ can move), and
    the loaded base carries its absolute path, which peft writes into every adapter (base_model_name_or_path), so an
    adapter loads from any folder (peft read the relative one against the loader's folder and went to the hub)."""
    from rlhf.inputs import models
    from rlhf.recipes import sft

    exp = config.load(TINY)
    models.build_tiny_base(exp.model, 0, ["a b c"], tmp_path / "mine" / "base")
    monkeypatch.chdir(tmp_path)
    local = config.load(TINY, ["model.name=mine/base", "quantization.load_in_4bit=false"])
    path, tok = sft.prepare_base(local, None, [])
    assert path == "mine/base" and tok.eos_token == "</s>"
    model = models.add_adapter(models.load_base(models.loading(local), path, "causal", tok), local.lora)
    model.save_pretrained(tmp_path / "adapter")
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == str(tmp_path / "mine" / "base")


def test_a_field_added_to_a_section_is_marked_added_or_every_fingerprint_changes_on_purpose():
    """A field added to a section changes the hashed config, and so the fingerprint, of every run recorded before it:
    an upgrade would retrain them (--reuse) and never resume them. A new field is marked ADDED (sections.ADDED: left
    out of the hash at its default), or, to change those fingerprints on purpose, written into
    tests/fingerprinted_fields.json, the fields each section's runs are hashed with; a field removed changes them
    too."""
    import dataclasses
    import json

    recorded = json.loads((ROOT / "tests" / "fingerprinted_fields.json").read_text())
    exp = config.Experiment()
    hashed = {f.name: sorted(x.name for x in dataclasses.fields(getattr(exp, f.name)) if not x.metadata.get("added"))
              for f in dataclasses.fields(config.Experiment) if dataclasses.is_dataclass(getattr(exp, f.name))}
    for section in sorted(set(hashed) | set(recorded)):
        new = sorted(set(hashed.get(section, [])) - set(recorded.get(section, [])))
        gone = sorted(set(recorded.get(section, [])) - set(hashed.get(section, [])))
        assert not new, (f"{section}: {new} would change the fingerprint of every run recorded before: give each "
                         f"field(default=..., metadata=ADDED), or add it to tests/fingerprinted_fields.json to change "
                         f"them on purpose")
        assert not gone, f"{section}: {gone} removed: every fingerprint hashed with it changes"
