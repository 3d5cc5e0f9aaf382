"""The stage registry: one entry per stage, and the one place a stage is named. The CLI, lineage, the memory
planner and gate, the trainers' glue, gpucheck, sweeps, evaluation, export and the Makefile's stage targets
(stages.mk, written from here) read what an entry declares: its module, upstream stages, config section, batch-size
field, memory-plan shape, the data it consumes. Adding a stage is its module, its config section, one entry here
and `python -m rlhf.experiment.stages > stages.mk` (docs/architecture.md, "Adding a stage"); tests/test_stages.py adds a dummy
entry and checks that every reader sees it, and fails on a list of stage names anywhere else in rlhf/."""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from rlhf.experiment.config import Experiment


TRAINER_SHAPES = ("lm", "reward", "preference")
"""Memory-plan shapes of the stages on TRL's trainers (rlhf/recipes/trainers.py), each step a batch of examples:
    lm          a causal LM trained on completions (SFTTrainer): LoRA dropout live, the held-out check samples
    reward      a one-label sequence classifier on pairs (RewardTrainer): no LM head
    preference  a causal-LM policy against a frozen reference adapter on the same base (DPOTrainer, KTOTrainer):
                dropout off, the held-out check also scores with the reward model's and the judge's adapters"""
ONLINE_SHAPES = ("actor-critic", "critic-free")
"""Memory-plan shapes of our online loops (rlhf/rl/online.py): rollouts with a KV cache, then updates over
micro-batches; actor-critic (PPO) trains a value model beside the policy and always holds a reference and the reward
model, critic-free (GRPO, RLOO) a reference only when its section's beta > 0 and the reward model only when
reward.model > 0."""
PLAN_SHAPES = TRAINER_SHAPES + ONLINE_SHAPES


@dataclass(frozen=True)
class Stage:
    name: str
    """The CLI and `make` name; also the run records' folder (results/<experiment>/<name>/)."""
    module: str
    """rlhf.recipes.<module> holds the entry point (`path`)."""
    entry: str = "train"
    """The function called as entry(exp, **kwargs) -> summary."""
    inputs: str = "prepare"
    """The function called as inputs(exp) -> runtime.Plan: what a run would consume, before any model loads."""
    upstream: tuple[str, ...] = ()
    """Stages whose finished runs this one consumes (trained first by `make`, memcheck and sweeps)."""
    section: str | None = ""
    """The experiment's section holding its settings (exp.<section>): its name unless given; None: it has none."""
    batch: str = "batch_size"
    """The field of its section that holds its global batch size (examples per step; an online stage's responses per
    iteration: rollout_batch): the memory plan's rows, the per-device split's error message."""
    batches: tuple[str, ...] = ()
    """Every field of its section that is a global batch size, split over the data-parallel ranks (dist.check_split);
    `batch` alone unless given."""
    sequences: int = 1
    """Sequences one example of that batch puts through the trained forward pass: 2 for a pair's chosen and
    rejected (RM, DPO)."""
    reads: tuple[str, ...] = ()
    """The shared sections it reads besides its own (reward, eval): they change what it computes, so its lineage
    fingerprint covers them too."""
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
    help: str = ""
    """What `make help` says of its target (stages.mk)."""
    make_args: str = ""
    """Make variables its target adds to the command line (export's STAGE and MERGE)."""

    @property
    def path(self) -> str:
        """The module that holds the entry point."""
        return f"rlhf.recipes.{self.module}"

    def __post_init__(self):
        if self.section == "":
            object.__setattr__(self, "section", self.name)
        if not self.batches:
            object.__setattr__(self, "batches", (self.batch,))

    @property
    def sections(self) -> tuple[str, ...]:
        """Its own section and those it reads: what its lineage fingerprint covers."""
        return tuple(s for s in (self.section, *self.reads) if s)

    @property
    def online(self) -> bool:
        """Trained by our own online loop (rollouts, then updates), not by a TRL trainer."""
        return self.memplan in ONLINE_SHAPES

    def config(self, exp):
        """Its settings: the experiment's section of it."""
        return getattr(exp, self.section)

    def optional(self) -> tuple[str, ...]:
        """Upstream stages it needs only under some experiments (`make` asks them with --for <stage>)."""
        return ("rm",) if self.rm_optional else ()

    def needs(self, exp) -> tuple[str, ...]:
        """The upstream stages this experiment's run of the stage consumes."""
        if self.rm_optional and not exp.reward.model:
            return tuple(u for u in self.upstream if u != "rm")
        return self.upstream

    def run(self, exp, **kwargs) -> dict:
        # only the stage's own module: PPO's process then never imports TRL's trainers (~110 MB of RSS)
        return getattr(importlib.import_module(self.path), self.entry)(exp, **kwargs)

    def prepare(self, exp):
        return getattr(importlib.import_module(self.path), self.inputs)(exp)


REGISTRY: dict[str, Stage] = {}
NAME = re.compile(r"[a-z][a-z-]*")
"""A stage's name: lowercase letters and dashes, as the Makefile's `make help` lists its targets (`^[a-z-]+:.*## `),
not starting with a dash (the CLI would read it as an option)."""


def register(stage: Stage) -> Stage:
    """Add a stage; its name must be one `make help` can list as a make target; a training stage must name a
    memory-plan shape, existing upstream stages and a section of the experiment that holds its batch-size field."""
    if not NAME.fullmatch(stage.name):
        raise ValueError(f"stage {stage.name!r}: a stage name is lowercase letters and dashes, starting with a letter "
                         f"({NAME.pattern}), as `make help` lists the make targets")
    if stage.trains and stage.memplan not in PLAN_SHAPES:
        raise ValueError(f"stage {stage.name!r} trains but has no memory plan (memplan= one of {PLAN_SHAPES})")
    missing = [u for u in stage.upstream if u not in REGISTRY]
    if missing:
        raise ValueError(f"stage {stage.name!r}: unknown upstream stage(s) {missing}")
    section = getattr(Experiment(), stage.section or "", None)
    if stage.trains and not dataclasses.is_dataclass(section):
        raise ValueError(f"stage {stage.name!r} trains but the experiment has no {stage.section!r} section: add one "
                         f"to config.Experiment (its settings, read as exp.{stage.section})")
    absent = [k for k in stage.batches if not hasattr(section, k)]
    if stage.trains and absent:
        raise ValueError(f"stage {stage.name!r}: its section {stage.section!r} has no batch-size field "
                         f"{absent[0]!r}")
    REGISTRY[stage.name] = stage
    return stage


PAIRS = ("pref_pairs", "judge_fraction")
"""What picks the preference stages' pairs: how many, and the judge's share held out of them."""
ONLINE = dict(batch="rollout_batch", batches=("rollout_batch", "minibatch", "micro_batch"), reads=("reward", "eval"),
              consumes=("ppo_prompts",), policy=True, exports=True)
"""What every online stage declares alike."""
for _s in (
    # SFT from the pool leaves out the judge's pairs: they pick its examples too
    Stage("sft", "sft", consumes=("sft_examples", *PAIRS), policy=True, exports=True, memplan="lm",
          help="supervised fine-tuning on the chosen responses (always trains; resumes a killed run)"),
    Stage("rm", "rm", upstream=("sft",), sequences=2, consumes=PAIRS, exports=True, memplan="reward",
          help="reward model (reuses the SFT run if its config and data are unchanged, else trains SFT first)"),
    Stage("dpo", "dpo", upstream=("sft",), sequences=2, consumes=PAIRS, policy=True, exports=True,
          memplan="preference", help="DPO from the SFT adapter (reuses an unchanged SFT run)"),
    Stage("kto", "kto", upstream=("sft",), consumes=PAIRS, policy=True, exports=True, memplan="preference",
          help="KTO from the SFT adapter on unpaired feedback (kto.path, else the pairs unpaired; reuses SFT)"),
    Stage("ppo", "ppo", upstream=("sft", "rm"), memplan="actor-critic", **ONLINE,
          help="PPO with the reward model (reuses unchanged SFT and RM runs)"),
    Stage("grpo", "grpo", upstream=("sft", "rm"), memplan="critic-free", rm_optional=True, **ONLINE,
          help="GRPO: G responses per prompt, group-relative advantages, no critic (reuses SFT; RM if "
               "reward.model>0)"),
    Stage("rloo", "grpo", entry="train_rloo", inputs="prepare_rloo", upstream=("sft", "rm"), memplan="critic-free",
          rm_optional=True, **ONLINE,
          help="RLOO: GRPO's loop with the leave-one-out baseline (reuses SFT; RM if reward.model>0)"),
    Stage("eval", "evaluate", upstream=("sft",), reads=("reward",), trains=False,
          help="compare every finished policy with SFT on the same held-out prompts, by every grader"),
    Stage("export", "export", entry="export", section=None, trains=False, make_args="--from-stage $(STAGE) $(if $(MERGE),--merge)",
          help="export STAGE's adapter; MERGE=1 merges it into the base as safetensors"),
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


MAKEFILE = "stages.mk"
"""The Makefile's stage targets, written by `python -m rlhf.experiment.stages > stages.mk` from this registry (the Makefile
includes it; tests/test_stages.py fails when it is not what makefile() writes)."""
PIPELINE_LAST = "eval"
"""What `make pipeline` runs after every training stage: the comparison of the policies."""


def _recipe(name: str, reuse: bool, stage: str = "") -> str:
    """The recipe line that runs stage `name` as `make` does: $(RLHF) (data parallel with NPROC) for a training stage,
    $(RLHF1) (one process) otherwise; `reuse`: an upstream run of `stage`, reused when unchanged (--for `stage`
    where it needs it only under some experiments)."""
    s = get(name)
    line = f"\t$({'RLHF' if s.trains else 'RLHF1'}) {name} --exp $(EXP)"
    if reuse:
        line += " --reuse" + (f" --for {stage}" if name in get(stage).optional() else "")
    return line + "".join(f" {a}" for a in (s.make_args, "$(ARGS)") if a)


def makefile() -> str:
    """stages.mk: a target per stage (each training stage's after its upstream chain, with --reuse), and
    `make pipeline`: every training stage on one SFT run, then eval."""
    pipeline = [*training(), PIPELINE_LAST]
    out = [f"# The stage targets, written from the stage registry (rlhf/experiment/stages.py) by `python -m rlhf.experiment.stages > "
           f"{MAKEFILE}`:", "# do not edit; tests/test_stages.py fails when this file is not what the registry writes.",
           f"STAGES := {' '.join(REGISTRY)}", ".PHONY: $(STAGES) pipeline"]
    for name, s in REGISTRY.items():
        chain = with_upstream([name])[:-1] if s.trains else []
        out += ["", f"{name}: install  ## {s.help}", *(_recipe(u, True, name) for u in chain), _recipe(name, False)]
        if name == pipeline[-1]:
            out += ["", f"pipeline: install  ## every training stage on one SFT run ({', '.join(training())}), then "
                        f"{PIPELINE_LAST}", *(_recipe(n, False) for n in pipeline)]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(makefile(), end="")
