"""The sweep file (`sweeps/*.yaml`), loaded by the typed loader experiments use (rlhf/experiment/config.py): every key below is
declared and documented here; unknown keys and wrong types fail naming the file and the key."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from rlhf.experiment import config
from rlhf.experiment import stages as registry
from rlhf.runs.records import scrub, secret_values, url_secrets

SweepError = config.ConfigError  # a bad sweep file fails as a bad experiment file does
STORAGE_ENV = "RLHF_SWEEP_STORAGE"  # the storage URL from the environment: out of command lines and files
PRUNERS = {"none": "NopPruner", "median": "MedianPruner", "hyperband": "HyperbandPruner"}  # Optuna's classes


def make_pruner(options: dict):
    """The Optuna pruner a sweep file's `pruner: {type, ...options}` names."""
    import optuna

    kwargs = {k: v for k, v in options.items() if k != "type"}
    return getattr(optuna.pruners, PRUNERS[options.get("type", "none")])(**kwargs)


@dataclass
class Objective:
    """`metric`: a dotted path into the last stage's summary.json, e.g. metrics.eval_rewards_accuracies; `direction`:
    maximize | minimize; `intermediate`: a key of the stage's metrics.jsonl reported to the pruner as the trial runs."""

    metric: str = ""
    direction: str = "maximize"
    intermediate: str | None = None


@dataclass
class Param:
    """One dimension of the space: `type` categorical (its `choices`; a choice may be a list or mapping, given to
    Optuna as its JSON text: trial.optuna_choices), float or int (`low` to `high`, on a `log` scale or in steps of
    `step`)."""

    type: str = ""
    choices: list | None = None
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None


@dataclass
class Sampler:
    """Optuna's sampler, `type` tpe | random, seeded (each worker adds its own offset to `seed`)."""

    type: str = "tpe"
    seed: int | None = 0
    n_startup_trials: int = 10


@dataclass
class Heartbeat:
    """A running trial's heartbeat every `interval` seconds; one older than `grace` seconds (its worker died) is
    failed and queued again, at most `max_retry` times."""

    interval: int = 10
    grace: int = 60
    max_retry: int = 1


@dataclass
class SweepFile:
    """The keys of a sweep file:

    experiment       the base experiment YAML, e.g. experiments/tiny.yaml
    name             the study name (default: the file name without .yaml)
    stage            the one stage each trial trains: sft | rm | dpo | ppo
    stages           or several, trained in order per trial, e.g. [sft, dpo]; the objective is read from the last
    objective        {metric, direction, intermediate} (Objective)
    space            {config.key: {type: categorical | float | int, ...}} (Param)
    overrides        key=value overrides fixed for every trial (a list of strings or a mapping)
    sampler          {type: tpe | random, seed, n_startup_trials} (Sampler)
    pruner           {type: none | median | hyperband, and the options of Optuna's MedianPruner or HyperbandPruner}
    n_trials         trials in the study: COMPLETE + PRUNED + FAIL, a retried trial once
    storage          Optuna storage URL (default sqlite:///<results_dir>/sweeps/<name>.db); --storage or
                     $RLHF_SWEEP_STORAGE replace it. A PostgreSQL URL may leave its password to PGPASSWORD or
                     ~/.pgpass (libpq reads them)
    results_dir      root of the run records (default: the experiment's results_dir)
    upstream         results_dir of the upstream runs of stages not swept (default: the experiment's results_dir)
    heartbeat        {interval, grace, max_retry} (Heartbeat)
    trial_timeout_s  kill a stage process running longer than this (default: no limit)
    wandb            {project: rlhf-harness, count: 8}: the W&B project and the trials `make wandb-sweep` runs
    """

    experiment: str = ""
    name: str | None = None
    stage: str | None = None
    stages: list[str] | None = None
    objective: Objective = field(default_factory=Objective)
    space: dict = field(default_factory=dict)
    overrides: dict | list[str] = field(default_factory=list)
    sampler: Sampler = field(default_factory=Sampler)
    pruner: dict = field(default_factory=lambda: {"type": "none"})
    n_trials: int = 10
    storage: str | None = None
    results_dir: str | None = None
    upstream: str | None = None
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    trial_timeout_s: float | None = None
    wandb: dict = field(default_factory=lambda: {"project": "rlhf-harness", "count": 8})


@dataclass
class Sweep(SweepFile):
    """A loaded sweep: the file's settings with every default resolved."""

    path: str = ""
    args: list[str] = field(default_factory=list)
    """The sweep file's keys set on the command line (`make sweep ARGS='n_trials=2'`): the workers get them too."""
    exp_name: str = ""
    needs: dict = field(default_factory=dict)
    """Each swept stage's upstream stages under the base experiment (registry: Stage.needs)."""

    @property
    def metric(self) -> str:
        return self.objective.metric

    @property
    def direction(self) -> str:
        return self.objective.direction

    @property
    def intermediate(self) -> str | None:
        return self.objective.intermediate

    @property
    def dir(self) -> Path:
        return Path(self.results_dir) / "sweeps" / self.name

    @property
    def shown_storage(self) -> str:
        """The storage URL as it is printed, written and raised: its password redacted."""
        return self.redact(self.storage)

    def redact(self, text: str) -> str:
        """`text` with the storage URL's credentials and the environment's secrets redacted (records.scrub), also
        where a message quotes the password apart from its URL."""
        return scrub(text, [*secret_values(), *url_secrets(self.storage)])

    def trial_dir(self, tag) -> Path:
        return self.dir / "trials" / str(tag)


def _fail(path, key: str, what: str, fix: str = "") -> SweepError:
    return SweepError(f"{path}: {key}: {what}" + (f". {fix}" if fix else ""))


def _check_param(path, key: str, spec) -> dict:
    where = f"space.{key}"
    if not isinstance(spec, dict):
        raise _fail(path, where, f"expected a mapping with 'type' (categorical | float | int), got {spec!r}")
    p = config.build(Param, spec, str(path), prefix=f"{where}.")
    if p.type not in ("categorical", "float", "int"):
        raise _fail(path, f"{where}.type", f"unknown type {p.type!r}", "use one of categorical, float, int")
    if p.type == "categorical":
        if not p.choices:
            raise _fail(path, f"{where}.choices", "a categorical needs a non-empty list of choices")
        return {"type": p.type, "choices": p.choices}
    if p.low is None or p.high is None:
        raise _fail(path, where, f"a {p.type} range needs low and high")
    if p.low >= p.high:
        raise _fail(path, where, f"low ({p.low}) must be below high ({p.high})")
    if p.log and p.low <= 0:
        raise _fail(path, f"{where}.low", "a log range needs low > 0")
    if p.log and p.step is not None:
        raise _fail(path, where, "step and log cannot be combined (Optuna refuses it)")
    if p.type == "int":
        if not all(float(v).is_integer() for v in (p.low, p.high, p.step or 1)):
            raise _fail(path, where, "an int range needs whole numbers")
        p.low, p.high, p.step = int(p.low), int(p.high), None if p.step is None else int(p.step)
    return {"type": p.type, "low": p.low, "high": p.high, "log": p.log, "step": p.step}


def _check(path, f: SweepFile) -> list[str]:
    """The cross-field rules the types cannot say; returns the stages."""
    if not f.experiment:
        raise _fail(path, "experiment", "missing", "name the base experiment, e.g. experiment: experiments/tiny.yaml")
    if (f.stage is None) == (f.stages is None):
        raise _fail(path, "stage", "give exactly one of 'stage' (one stage) or 'stages' (a list, e.g. [sft, dpo])")
    stages = [f.stage] if f.stage else f.stages
    trainable = registry.training()
    if not stages or any(s not in trainable for s in stages) or len(set(stages)) != len(stages):
        raise _fail(path, "stages", f"expected distinct stages from {list(trainable)}, got {stages!r}")
    for i, s in enumerate(stages):  # a stage's upstream must come before it when both are swept
        for u in registry.get(s).upstream:
            if u in stages[i:]:
                raise _fail(path, "stages", f"{u} must come before {s}", f"e.g. stages: [{u}, {s}]")
    if not f.objective.metric:
        raise _fail(path, "objective.metric", "missing",
                    "give a dotted path into the last stage's summary.json, e.g. metrics.eval_rewards_accuracies")
    if f.objective.direction not in ("maximize", "minimize"):
        raise _fail(path, "objective.direction", f"{f.objective.direction!r} is not maximize or minimize")
    if f.sampler.type not in ("tpe", "random"):
        raise _fail(path, "sampler.type", f"unknown sampler {f.sampler.type!r}", "use one of random, tpe")
    pruner = f.pruner.get("type", "none")
    if pruner not in PRUNERS:
        raise _fail(path, "pruner.type", f"unknown pruner {pruner!r}", f"use one of {', '.join(PRUNERS)}")
    if pruner != "none" and not f.objective.intermediate:
        raise _fail(path, "objective.intermediate", f"the {pruner} pruner needs an intermediate metric",
                    "name a key of the stage's metrics.jsonl, e.g. intermediate: eval_rewards/accuracies")
    try:  # Optuna checks the options
        make_pruner(f.pruner)
    except (TypeError, ValueError) as e:
        import optuna

        valid = [k for k in inspect.signature(getattr(optuna.pruners, PRUNERS[pruner])).parameters if k != "self"]
        near = [difflib.get_close_matches(str(k), valid, n=1) for k in f.pruner if k != "type" and k not in valid]
        hint = "; ".join(f"did you mean {m[0]!r}?" for m in near if m)
        raise _fail(path, "pruner", str(e), f"{hint + ' ' if hint else ''}{pruner}'s options: {', '.join(valid)}"
                    ) from None
    hb = f.heartbeat
    if f.n_trials < 1 or hb.max_retry < 0 or hb.interval < 1 or hb.grace <= hb.interval:
        raise _fail(path, "heartbeat" if f.n_trials >= 1 else "n_trials",
                    "need n_trials >= 1, heartbeat.interval >= 1, grace > interval (seconds) and max_retry >= 0")
    if not f.space:
        raise _fail(path, "space", "expected a non-empty mapping of config keys to distributions",
                    "e.g. space: {dpo.beta: {type: float, low: 0.05, high: 0.5, log: true}}")
    return stages


def with_args(path: Path, raw: dict, args: list[str]) -> dict:
    """The sweep file's mapping with `args` (key=value, e.g. n_trials=2, sampler.seed=1: `make sweep ARGS=...`) set
    on it. Only the sweep file's keys: an experiment key (dpo.epochs=1) belongs in the file's `overrides:`."""
    keys = [f.name for f in dataclasses.fields(SweepFile)]
    for item in config.join_split(list(args)):
        key = item.split("=", 1)[0].strip()
        if "=" not in item or key.split(".")[0] not in keys:
            near = difflib.get_close_matches(key.split(".")[0], keys, n=1)
            raise SweepError(f"ARGS {item!r}: not a key=value of the sweep file {path}'s keys"
                             + (f" (did you mean {near[0]!r}?)" if near else "")
                             + "; ARGS sets those, e.g. n_trials=2 or sampler.seed=1 (rlhf/sweeps/spec.py); an "
                             "experiment key such as dpo.epochs goes under the file's overrides:")
    return config.overlay(raw, config.parse_overrides(args), SweepFile)


def load(path: str | Path, storage: str | None = None, results_dir: str | None = None, args: list[str] = ()) -> Sweep:
    """Read and validate a sweep file, with `args` (its keys as key=value) set on it; every space key is checked
    against the experiment's config before any trial. The storage: `storage` (--storage), else
    $RLHF_SWEEP_STORAGE, else the file's, else SQLite under results_dir."""
    path = Path(path)
    try:
        f = config.build(SweepFile, with_args(path, config.read_yaml(path, "sweep"), args), str(path))
    except config.ConfigError as e:  # named by where the value came from: an ARGS item, else the file's line
        raise config.origin(e, path, list(args), named="ARGS {!r}") from None
    stages = _check(path, f)
    space = {str(k): _check_param(path, str(k), spec) for k, spec in f.space.items()}
    overrides = f.overrides
    if isinstance(overrides, dict):
        overrides = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    if not all("=" in o for o in overrides):
        raise _fail(path, "overrides", f"expected key=value strings (or a mapping), got {overrides!r}")
    # every key of the space, at its bounds and every choice, must load: unknown keys fail here, before any trial
    try:
        base = config.load(f.experiment, overrides)
    except config.ConfigError as e:
        raise SweepError(f"{path}: experiment/overrides: {e}") from None
    fixed = {o.split("=", 1)[0].strip() for o in overrides}
    for key, spec in space.items():
        if key in fixed:
            raise SweepError(f"{path}: space.{key}: also in overrides, where every trial's value would be the space's "
                             f"draw; keep it in one of them")
        for v in spec.get("choices") or [spec["low"], spec["high"]]:
            try:
                config.load(f.experiment, overrides + [f"{key}={json.dumps(v)}"])
            except config.ConfigError as e:
                said = str(e).removeprefix(f"override {key}={json.dumps(v)}: ")  # the file's key, not an override
                if "unknown key" in said:
                    raise SweepError(f"{path}: space.{key}: {said}. Use a config key (documented in "
                                     f"rlhf/experiment/sections.py), e.g. dpo.beta or lora.r") from None
                raise SweepError(f"{path}: space.{key}: its value {v!r}: {said}. The space's values must be ones "
                                 f"the config accepts") from None
    name = f.name or path.stem
    results = results_dir or f.results_dir or base.results_dir
    storage = storage or os.environ.get(STORAGE_ENV) or f.storage or f"sqlite:///{Path(results) / 'sweeps' / name}.db"
    wandb = {"project": "rlhf-harness", "count": 8, **f.wandb}
    return Sweep(**{**vars(f), "name": name, "stage": None, "stages": stages, "space": space, "overrides": overrides,
                    "storage": storage, "results_dir": str(results), "upstream": f.upstream or base.results_dir,
                    "wandb": wandb},
                 path=str(path), args=list(args), exp_name=base.name,
                 needs={s: list(registry.get(s).needs(base)) for s in stages})
