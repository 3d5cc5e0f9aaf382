"""The stage registry: one entry per stage, read by the CLI, `make help`'s check, lineage, the memory planner and
gate, evaluation and export. Adding a stage is one entry here plus the stage's own module, its loss in
rlhf/losses.py, its config section (a training stage's: exp.<name>) and its make target; tests/test_stages.py adds a
dummy entry and checks that every reader sees it."""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .config import Experiment


@dataclass(frozen=True)
class Stage:
    name: str
    """The CLI and `make` name; also the run records' folder (results/<experiment>/<name>/)."""
    module: str
    """rlhf.<module> holds the entry point."""
    entry: str = "train"
    """The function called as entry(exp, **kwargs) -> summary."""
    inputs: str = "prepare"
    """The function called as inputs(exp) -> runtime.Plan: what a run would consume, before any model loads."""
    upstream: tuple[str, ...] = ()
    """Stages whose finished runs this one consumes (trained first by `make`, memcheck and sweeps)."""
    sections: tuple[str, ...] = ()
    """Config sections that change what the stage computes (its lineage fingerprint covers them)."""
    consumes: tuple[str, ...] = ()
    """The data.* fields that pick the examples it trains on (another stage's lineage leaves them out)."""
    policy: bool = False
    """A causal-LM policy: `make eval` compares it with SFT, export merges it as a causal LM."""
    exports: bool = False
    """`make export STAGE=<name>` takes its adapter."""
    trains: bool = True
    """Trains an adapter: has a fingerprint to reuse (--reuse), a memory plan and the preflight."""
    memplan: str | None = None
    """The shape of its memory plan (rlhf/memory/memplan.py): one of PLAN_SHAPES; a training stage without one is an
    error (see `register`), never a silent skip of the preflight."""
    rm_optional: bool = False
    """The reward model is upstream only when it takes part (reward.model > 0): critic-free stages."""

    def needs(self, exp) -> tuple[str, ...]:
        """The upstream stages this experiment's run of the stage consumes."""
        if self.rm_optional and not exp.reward.model:
            return tuple(u for u in self.upstream if u != "rm")
        return self.upstream

    def run(self, exp, **kwargs) -> dict:
        # only the stage's own module: PPO's process then never imports TRL's trainers (~110 MB of RSS)
        return getattr(importlib.import_module(f"rlhf.{self.module}"), self.entry)(exp, **kwargs)

    def prepare(self, exp):
        return getattr(importlib.import_module(f"rlhf.{self.module}"), self.inputs)(exp)


PLAN_SHAPES = ("sft", "rm", "dpo", "ppo", "grpo")
REGISTRY: dict[str, Stage] = {}
NAME = re.compile(r"[a-z][a-z-]*")
"""A stage's name: lowercase letters and dashes, as the Makefile's `make help` lists its targets (`^[a-z-]+:.*## `),
not starting with a dash (the CLI would read it as an option)."""


def register(stage: Stage) -> Stage:
    """Add a stage; its name must be one `make help` can list as a make target; a training stage must name a
    memory-plan shape and existing upstream stages, and its name must be its section of the experiment (exp.<name>)."""
    if not NAME.fullmatch(stage.name):
        raise ValueError(f"stage {stage.name!r}: a stage name is lowercase letters and dashes, starting with a letter "
                         f"({NAME.pattern}), as `make help` lists the make targets")
    if stage.trains and stage.memplan not in PLAN_SHAPES:
        raise ValueError(f"stage {stage.name!r} trains but has no memory plan (memplan= one of {PLAN_SHAPES})")
    missing = [u for u in stage.upstream if u not in REGISTRY]
    if missing:
        raise ValueError(f"stage {stage.name!r}: unknown upstream stage(s) {missing}")
    if stage.trains and not dataclasses.is_dataclass(getattr(Experiment(), stage.name, None)):
        raise ValueError(f"stage {stage.name!r} trains but the experiment has no {stage.name!r} section: add one to "
                         f"config.Experiment (its settings, read as exp.{stage.name})")
    REGISTRY[stage.name] = stage
    return stage


PAIRS = ("pref_pairs", "judge_fraction")
"""What picks the preference stages' pairs: how many, and the judge's share held out of them."""
for _s in (
    # SFT from the pool leaves out the judge's pairs: they pick its examples too
    Stage("sft", "sft", sections=("sft",), consumes=("sft_examples", *PAIRS), policy=True, exports=True,
          memplan="sft"),
    Stage("rm", "rm", upstream=("sft",), sections=("rm",), consumes=PAIRS, exports=True, memplan="rm"),
    Stage("dpo", "dpo", upstream=("sft",), sections=("dpo",), consumes=PAIRS, policy=True, exports=True,
          memplan="dpo"),
    Stage("ppo", "ppo", upstream=("sft", "rm"), sections=("ppo", "reward", "eval"), consumes=("ppo_prompts",),
          policy=True, exports=True, memplan="ppo"),
    Stage("grpo", "grpo", upstream=("sft", "rm"), sections=("grpo", "reward", "eval"), consumes=("ppo_prompts",),
          policy=True, exports=True, memplan="grpo", rm_optional=True),
    Stage("rloo", "grpo", entry="train_rloo", inputs="prepare_rloo", upstream=("sft", "rm"),
          sections=("rloo", "reward", "eval"), consumes=("ppo_prompts",), policy=True, exports=True, memplan="grpo",
          rm_optional=True),
    Stage("eval", "evaluate", upstream=("sft",), sections=("eval", "reward"), trains=False),
    Stage("export", "export", entry="export", trains=False),
):
    register(_s)


def command(stage: str, exp_path: str | Path, overrides=(), python: str | None = None) -> list[str]:
    """The command line that runs one stage in its own process (with this interpreter unless `python` is given), as
    `make <stage>` does: the Makefile spells the same line, and tests/test_make.py checks that they agree."""
    return [python or sys.executable, "-m", "rlhf", stage, "--exp", str(exp_path), *overrides]


def get(name: str) -> Stage:
    if name not in REGISTRY:
        raise KeyError(f"unknown stage {name!r}; one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


def training() -> tuple[str, ...]:
    """Stages that train (and so have a memory plan and a fingerprint to reuse)."""
    return tuple(n for n, s in REGISTRY.items() if s.trains)


def policies() -> tuple[str, ...]:
    return tuple(n for n, s in REGISTRY.items() if s.policy)


def exportable() -> tuple[str, ...]:
    return tuple(n for n, s in REGISTRY.items() if s.exports)


def with_upstream(names) -> list[str]:
    """`names` and every stage they need, each after its upstream ones, without repeats."""
    out: list[str] = []

    def visit(n: str) -> None:
        for u in get(n).upstream:
            visit(u)
        if n not in out:
            out.append(n)

    for n in names:
        visit(n)
    return out
