"""Hyperparameter sweeps: an Optuna study (or a W&B sweep) over any config key, one subprocess per trial.

A sweep file (`sweeps/*.yaml`) names a base experiment, the stage(s) each trial trains, the objective (a dotted path
into the last stage's summary.json), the search space, the sampler and pruner, the trial count and the storage.

  python -m rlhf.sweep run sweeps/x.yaml [--workers N] [--storage URL]   # make sweep SWEEP=... WORKERS=... STORAGE=...
  python -m rlhf.sweep report sweeps/x.yaml                              # make sweep-report SWEEP=...
  python -m rlhf.sweep wandb sweeps/x.yaml [--count N]                   # make wandb-sweep SWEEP=...

How a trial runs: the parameters become `key=value` overrides; the memory predictor (rlhf.memplan) checks every stage
first and prunes the trial, without loading anything, when one is over memory.budget_gb; then each stage runs as
`python -m rlhf <stage>` in its own process (device memory is freed between trials) with results_dir set to
results/sweeps/<name>/trials/<number>/, and the environment variable RLHF_SWEEP tags the run record's summary with
the study and trial. The worker tails the objective stage's metrics.jsonl and reports the `objective.intermediate`
metric to the pruner; a pruned trial's process is killed. A stage that fails is a FAIL trial (over its memory budget:
PRUNED) with the reason in the user attribute `reason`; the study goes on.

Resuming and several workers: the study lives in an RDB storage (SQLite under results/sweeps/<name>.db by default,
or one PostgreSQL URL shared by workers on several hosts). A rerun loads the same study and runs only what is left:
COMPLETE, PRUNED and FAIL trials count toward n_trials, except a FAIL trial that was retried (its retry counts
instead). Workers send heartbeats; a trial whose worker died is marked FAIL once its heartbeat is older than the
grace period, and a copy with the same parameters is queued and run by a live worker.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import config

STAGES = ("sft", "rm", "dpo", "ppo")
UPSTREAM = {"sft": [], "rm": ["sft"], "dpo": ["sft"], "ppo": ["sft", "rm"]}
SPACE_TYPES = {"categorical": {"choices"}, "float": {"low", "high", "log", "step"}, "int": {"low", "high", "log", "step"}}
PRUNERS = {"none", "median", "hyperband"}
SAMPLERS = {"tpe", "random"}
TOP_KEYS = {
    "name": "study name (default: the file name without .yaml)",
    "experiment": "base experiment YAML, e.g. experiments/tiny.yaml",
    "stage": "the one stage each trial trains (sft | rm | dpo | ppo)",
    "stages": "several stages trained in order per trial, e.g. [sft, dpo]; the objective is read from the last",
    "objective": "{metric: dotted path into summary.json, direction: maximize|minimize, intermediate: metrics.jsonl key}",
    "space": "{config.key: {type: categorical|float|int, ...}}",
    "overrides": "fixed key=value overrides applied to every trial",
    "sampler": "{type: tpe|random, seed: 0}",
    "pruner": "{type: none|median|hyperband, ...options}",
    "n_trials": "trials in the study (COMPLETE + PRUNED + FAIL)",
    "storage": "Optuna storage URL (default sqlite:///<results_dir>/sweeps/<name>.db)",
    "results_dir": "root of the run records (default: the experiment's results_dir)",
    "upstream": "results_dir holding the upstream runs of stages not swept (default: the experiment's results_dir)",
    "heartbeat": "{interval: 10, grace: 60, max_retry: 1} seconds; retry of trials whose worker died",
    "trial_timeout_s": "kill a stage process running longer than this (default: no limit)",
    "wandb": "{project: rlhf-harness, count: 8}",
}
POLL_S = 0.5


class SweepError(ValueError):
    """A sweep file is invalid; the message names the file, the key and what to do."""


class TrialStopped(Exception):
    """A trial ends without a value: state "pruned" or "failed", with the reason."""

    def __init__(self, state: str, reason: str):
        super().__init__(reason)
        self.state, self.reason = state, reason


@dataclass
class Sweep:
    path: str
    name: str
    experiment: str
    stages: list[str]
    metric: str
    direction: str
    intermediate: str | None
    space: dict[str, dict]
    overrides: list[str] = field(default_factory=list)
    sampler: dict = field(default_factory=lambda: {"type": "tpe", "seed": 0})
    pruner: dict = field(default_factory=lambda: {"type": "none"})
    n_trials: int = 10
    storage: str = ""
    results_dir: str = "results"
    upstream: str = "results"
    heartbeat: dict = field(default_factory=lambda: {"interval": 10, "grace": 60, "max_retry": 1})
    trial_timeout_s: float | None = None
    wandb: dict = field(default_factory=lambda: {"project": "rlhf-harness", "count": 8})
    exp_name: str = ""

    @property
    def dir(self) -> Path:
        return Path(self.results_dir) / "sweeps" / self.name

    def trial_dir(self, tag) -> Path:
        return self.dir / "trials" / str(tag)


# ---------------------------------------------------------------------------------------------------------- loading
def _fail(path, key: str, what: str, fix: str = "") -> SweepError:
    return SweepError(f"{path}: {key}: {what}" + (f". {fix}" if fix else ""))


def _num(path, key, value, kind=float):
    if isinstance(value, str) and kind is float:
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise _fail(path, key, f"expected {'a number' if kind is float else 'an integer'}, got {value!r}")
    return value


def _check_space(path, space) -> dict[str, dict]:
    if not isinstance(space, dict) or not space:
        raise _fail(path, "space", "expected a non-empty mapping of config keys to distributions",
                    "e.g. space: {dpo.beta: {type: float, low: 0.05, high: 0.5, log: true}}")
    out = {}
    for key, spec in space.items():
        where = f"space.{key}"
        if not isinstance(spec, dict) or "type" not in spec:
            raise _fail(path, where, f"expected a mapping with 'type' ({' | '.join(SPACE_TYPES)}), got {spec!r}")
        kind = spec["type"]
        if kind not in SPACE_TYPES:
            raise _fail(path, f"{where}.type", f"unknown type {kind!r}", f"use one of {', '.join(SPACE_TYPES)}")
        extra = set(spec) - SPACE_TYPES[kind] - {"type"}
        if extra:
            raise _fail(path, where, f"unknown field(s) {sorted(extra)} for type {kind}",
                        f"allowed: {sorted(SPACE_TYPES[kind])}")
        spec = dict(spec)
        if kind == "categorical":
            if not isinstance(spec.get("choices"), list) or not spec["choices"]:
                raise _fail(path, f"{where}.choices", "a categorical needs a non-empty list of choices",
                            "e.g. choices: [4, 8, 16]")
        else:
            num = float if kind == "float" else int
            for b in ("low", "high"):
                if b not in spec:
                    raise _fail(path, f"{where}.{b}", f"missing: a {kind} range needs low and high")
                spec[b] = _num(path, f"{where}.{b}", spec[b], num)
            if spec["low"] >= spec["high"]:
                raise _fail(path, where, f"low ({spec['low']}) must be below high ({spec['high']})")
            spec["log"] = bool(spec.get("log", False))
            if spec["log"] and spec["low"] <= 0:
                raise _fail(path, f"{where}.low", "a log range needs low > 0")
            if spec.get("step") is not None:
                spec["step"] = _num(path, f"{where}.step", spec["step"], num)
                if spec["log"]:
                    raise _fail(path, where, "step and log cannot be combined (Optuna refuses it)")
        out[str(key)] = spec
    return out


def load(path: str | Path, storage: str | None = None, results_dir: str | None = None) -> Sweep:
    """Read and validate a sweep file; every space key is checked against the experiment's config before any trial."""
    path = Path(path)
    if not path.exists():
        raise SweepError(f"{path}: no such sweep file (see sweeps/ for the shipped ones)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise SweepError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise SweepError(f"{path}: expected a mapping of sweep settings, got {type(data).__name__}")
    for key in data:
        if key not in TOP_KEYS:
            near = difflib.get_close_matches(str(key), TOP_KEYS, n=1)
            raise _fail(path, str(key), "unknown key",
                        f"did you mean '{near[0]}'?" if near else f"valid keys: {', '.join(TOP_KEYS)}")
    if "experiment" not in data:
        raise _fail(path, "experiment", "missing", "name the base experiment, e.g. experiment: experiments/tiny.yaml")
    if ("stage" in data) == ("stages" in data):
        raise _fail(path, "stage", "give exactly one of 'stage' (one stage) or 'stages' (a list, e.g. [sft, dpo])")
    stages = [data["stage"]] if "stage" in data else data["stages"]
    if not isinstance(stages, list) or not stages or any(s not in STAGES for s in stages):
        raise _fail(path, "stages", f"expected stages from {list(STAGES)}, got {stages!r}")
    if len(set(stages)) != len(stages):
        raise _fail(path, "stages", f"a stage is listed twice: {stages}")
    for i, s in enumerate(stages):  # a stage's upstream must come before it when both are swept
        for u in UPSTREAM[s]:
            if u in stages[i:]:
                raise _fail(path, "stages", f"{u} must come before {s}", f"e.g. stages: [{u}, {s}]")

    obj = data.get("objective")
    if not isinstance(obj, dict) or not isinstance(obj.get("metric"), str) or not obj["metric"]:
        raise _fail(path, "objective.metric", "missing",
                    "give a dotted path into the last stage's summary.json, e.g. metrics.eval_rewards_accuracies")
    extra = set(obj) - {"metric", "direction", "intermediate"}
    if extra:
        raise _fail(path, "objective", f"unknown field(s) {sorted(extra)}", "allowed: metric, direction, intermediate")
    direction = obj.get("direction", "maximize")
    if direction not in ("maximize", "minimize"):
        raise _fail(path, "objective.direction", f"{direction!r} is not maximize or minimize")

    overrides = data.get("overrides") or []
    if isinstance(overrides, dict):
        overrides = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
        raise _fail(path, "overrides", f"expected a list of key=value strings (or a mapping), got {overrides!r}")

    space = _check_space(path, data.get("space"))
    sampler = {"type": "tpe", "seed": 0, **(data.get("sampler") or {})}
    if sampler["type"] not in SAMPLERS:
        raise _fail(path, "sampler.type", f"unknown sampler {sampler['type']!r}", f"use one of {sorted(SAMPLERS)}")
    if set(sampler) - {"type", "seed", "n_startup_trials"}:
        raise _fail(path, "sampler", f"unknown field(s) {sorted(set(sampler) - {'type', 'seed', 'n_startup_trials'})}")
    pruner = {"type": "none", **(data.get("pruner") or {})}
    if pruner["type"] not in PRUNERS:
        raise _fail(path, "pruner.type", f"unknown pruner {pruner['type']!r}", f"use one of {sorted(PRUNERS)}")
    if pruner["type"] != "none" and not obj.get("intermediate"):
        raise _fail(path, "objective.intermediate", f"the {pruner['type']} pruner needs an intermediate metric",
                    "name a key of the stage's metrics.jsonl, e.g. intermediate: eval_rewards/accuracies")
    n_trials = data.get("n_trials", 10)
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise _fail(path, "n_trials", f"expected a positive integer, got {n_trials!r}")
    heartbeat = {"interval": 10, "grace": 60, "max_retry": 1, **(data.get("heartbeat") or {})}
    for k in ("interval", "grace", "max_retry"):
        if isinstance(heartbeat.get(k), bool) or not isinstance(heartbeat.get(k), int) or heartbeat[k] < 0:
            raise _fail(path, f"heartbeat.{k}", f"expected a non-negative integer, got {heartbeat.get(k)!r}")
    if heartbeat["interval"] < 1 or heartbeat["grace"] <= heartbeat["interval"]:
        raise _fail(path, "heartbeat", "need interval >= 1 and grace > interval (seconds)")

    # every key of the space, at its bounds and every choice, must load: unknown keys fail here, before any trial
    try:
        base = config.load(data["experiment"], overrides)
    except config.ConfigError as e:
        raise SweepError(f"{path}: experiment/overrides: {e}") from None
    for key, spec in space.items():
        values = spec["choices"] if spec["type"] == "categorical" else [spec["low"], spec["high"]]
        for v in values:
            try:
                config.load(data["experiment"], overrides + [f"{key}={json.dumps(v)}"])
            except config.ConfigError as e:
                raise SweepError(f"{path}: space.{key}: {e}. Use a config key (see rlhf/config.py), "
                                 f"e.g. dpo.beta or lora.r") from None

    name = str(data.get("name") or path.stem)
    results = results_dir or data.get("results_dir") or base.results_dir
    wb = {"project": "rlhf-harness", "count": 8, **(data.get("wandb") or {})}
    timeout = data.get("trial_timeout_s")
    if timeout is not None:
        timeout = _num(path, "trial_timeout_s", timeout)
    return Sweep(path=str(path), name=name, experiment=str(data["experiment"]), stages=list(stages),
                 metric=obj["metric"], direction=direction, intermediate=obj.get("intermediate"), space=space,
                 overrides=overrides, sampler=sampler, pruner=pruner, n_trials=n_trials,
                 storage=storage or data.get("storage") or f"sqlite:///{Path(results) / 'sweeps' / name}.db",
                 results_dir=str(results), upstream=str(data.get("upstream") or base.results_dir),
                 heartbeat=heartbeat, trial_timeout_s=timeout, wandb=wb, exp_name=base.name)


# ------------------------------------------------------------------------------------------------------------ trial
def param_overrides(params: dict) -> list[str]:
    return [f"{k}={json.dumps(v)}" for k, v in params.items()]


def check_upstream(sw: Sweep) -> None:
    """Stages the sweep does not train come from `upstream`: refuse to start when one has no finished run."""
    for s in sw.stages:
        for u in UPSTREAM[s]:
            if u not in sw.stages and not (Path(sw.upstream) / sw.exp_name / u / "latest").exists():
                raise SweepError(f"{sw.path}: stages: {s} needs a finished {u} run of '{sw.exp_name}' under "
                                 f"{sw.upstream}/ (key 'upstream'). Run `make {u} EXP={sw.experiment}` first, "
                                 f"or sweep it too: stages: [{u}, {s}]")


def _link_upstream(sw: Sweep, trial_dir: Path) -> None:
    for s in sw.stages:
        for u in UPSTREAM[s]:
            link = trial_dir / sw.exp_name / u
            if u not in sw.stages and not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to((Path(sw.upstream) / sw.exp_name / u).resolve(), target_is_directory=True)


def _with_parent(cmd: list[str]) -> list[str]:
    """The stage process gets SIGKILL when the worker that started it dies (Linux: util-linux's setpriv sets the
    parent-death signal, which survives the exec), so a dead worker leaves no orphan holding device memory."""
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    return [setpriv, "--pdeathsig", "KILL", "--", *cmd] if setpriv else cmd


def dig(summary: dict, dotted: str):
    node = summary
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            have = sorted(node) if isinstance(node, dict) else type(node).__name__
            raise TrialStopped("failed", f"objective {dotted!r}: no '{part}' in the summary (has: {have})")
        node = node[part]
    return node


def _error_line(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    errors = [line for line in lines if line.startswith("error: ")]
    if errors:  # an expected failure: the CLI's one line
        return errors[-1][len("error: "):]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", line)]
    if raised:  # a traceback: its last line
        return raised[-1][:500]
    tail = [line for line in lines if line.strip()][-3:]
    return " | ".join(tail)[-500:] or "no output"


def _report_intermediate(trial, stage_root: Path, key: str, seen: dict, reported: set) -> None:
    for f in sorted(stage_root.glob("*/metrics.jsonl")):
        text = f.read_text(errors="replace")
        complete = text[: text.rfind("\n") + 1]
        for line in complete[seen.get(f, 0):].splitlines():
            rec = json.loads(line)
            value = rec.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value) and rec.get("step") not in reported:
                reported.add(rec["step"])
                trial.report(float(value), int(rec["step"]))
                if trial.should_prune():
                    raise TrialStopped("pruned", f"pruned at step {rec['step']}: {key}={value:.4g}")
        seen[f] = len(complete)


def run_stage(sw: Sweep, stage: str, overrides: list[str], trial_dir: Path, tag, trial=None) -> None:
    """One stage in its own process; reports intermediate values to `trial`'s pruner while it runs."""
    cmd = [sys.executable, "-m", "rlhf", stage, "--exp", sw.experiment, *overrides]
    env = {**os.environ, "RLHF_SWEEP": json.dumps({"study": sw.name, "trial": tag})}
    log = trial_dir / f"{stage}.log"
    t0, seen, reported = time.time(), {}, set()
    watch = trial is not None and sw.intermediate and stage == sw.stages[-1]
    with open(log, "w") as out:
        proc = subprocess.Popen(_with_parent(cmd), stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            while proc.poll() is None:
                time.sleep(POLL_S)
                if watch:
                    _report_intermediate(trial, trial_dir / sw.exp_name / stage, sw.intermediate, seen, reported)
                if sw.trial_timeout_s and time.time() - t0 > sw.trial_timeout_s:
                    raise TrialStopped("failed", f"{stage}: killed after trial_timeout_s={sw.trial_timeout_s}")
            if watch:
                _report_intermediate(trial, trial_dir / sw.exp_name / stage, sw.intermediate, seen, reported)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        reason = f"{stage}: exit {proc.returncode}: {_error_line(log)}"
        raise TrialStopped("pruned" if "memory budget exceeded" in reason else "failed", reason)


def run_trial(sw: Sweep, params: dict, tag, trial=None) -> tuple[float, Path]:
    """Train the sweep's stages with `params`; returns the objective and the last stage's run directory.
    Raises TrialStopped (pruned: over the memory budget, predicted or measured, or by the pruner; failed: a crash)."""
    from . import memplan

    trial_dir = sw.trial_dir(tag)
    overrides = sw.overrides + param_overrides(params) + [f"results_dir={trial_dir}"]
    try:  # a combination can break a cross-field rule that each value alone passes
        exp = config.load(sw.experiment, overrides)
    except config.ConfigError as e:
        raise TrialStopped("failed", f"config: {e}") from None
    for stage in sw.stages:  # before anything is started or loaded
        try:
            memplan.preflight(exp, stage)
        except memplan.MemoryPlanError as e:
            raise TrialStopped("pruned", f"memory preflight: {e}") from None
    trial_dir.mkdir(parents=True, exist_ok=True)
    _link_upstream(sw, trial_dir)
    for stage in sw.stages:
        run_stage(sw, stage, overrides, trial_dir, tag, trial)
    root = trial_dir / sw.exp_name / sw.stages[-1]
    run_dir = root / (root / "latest").read_text().strip()
    value = dig(json.loads((run_dir / "summary.json").read_text()), sw.metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TrialStopped("failed", f"objective {sw.metric} is {value!r}, not a finite number")
    return float(value), run_dir


def suggest(trial, space: dict) -> dict:
    params = {}
    for key, s in space.items():
        if s["type"] == "categorical":
            params[key] = trial.suggest_categorical(key, s["choices"])
        elif s["type"] == "float":
            params[key] = trial.suggest_float(key, s["low"], s["high"], log=s["log"], step=s.get("step"))
        else:
            params[key] = trial.suggest_int(key, s["low"], s["high"], log=s["log"], step=s.get("step") or 1)
    return params


# ----------------------------------------------------------------------------------------------------------- optuna
def _optuna():
    import optuna

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # trials print their own line
    return optuna


def storage(sw: Sweep):
    optuna = _optuna()
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    kwargs = {}
    if sw.storage.startswith("sqlite:///"):
        Path(sw.storage[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    hb = sw.heartbeat
    try:
        return RDBStorage(sw.storage, heartbeat_interval=hb["interval"], grace_period=hb["grace"],
                          heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=hb["max_retry"]),
                          **kwargs)
    except (optuna.exceptions.StorageInternalError, ImportError, ValueError) as e:
        raise SweepError(f"{sw.path}: storage {sw.storage!r}: {e}") from None


def make_sampler(sw: Sweep, offset: int = 0):
    optuna = _optuna()
    s = sw.sampler
    seed = None if s.get("seed") is None else int(s["seed"]) + offset
    if s["type"] == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=s.get("n_startup_trials", 10))


def make_pruner(sw: Sweep):
    optuna = _optuna()
    p = {k: v for k, v in sw.pruner.items() if k != "type"}
    if sw.pruner["type"] == "median":
        return optuna.pruners.MedianPruner(**p)
    if sw.pruner["type"] == "hyperband":
        return optuna.pruners.HyperbandPruner(**p)
    return optuna.pruners.NopPruner()


def open_study(sw: Sweep, offset: int = 0):
    optuna = _optuna()
    return optuna.create_study(study_name=sw.name, storage=storage(sw), direction=sw.direction,
                               sampler=make_sampler(sw, offset), pruner=make_pruner(sw), load_if_exists=True)


def retried_number(trial) -> int | None:
    """The number of the trial this one retries (after its worker died), or None."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return RetryHeartbeatStaleTrialCallback.retried_trial_number(trial)


def counts(study, before: int | None = None) -> dict:
    """Trials by what they mean for n_trials: done (COMPLETE, PRUNED, FAIL neither retried nor surplus), running,
    waiting; `before`: only trials numbered below it."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    retried = {retried_number(t) for t in trials} - {None}
    trials = [t for t in trials if before is None or t.number < before]
    done = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) or (
        t.state == TrialState.FAIL and t.number not in retried and not t.user_attrs.get("surplus")) for t in trials)
    return {"done": done, "running": sum(t.state == TrialState.RUNNING for t in trials),
            "waiting": sum(t.state == TrialState.WAITING for t in trials), "all": len(trials)}


def objective(sw: Sweep):
    optuna = _optuna()

    def fn(trial) -> float:
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        params = suggest(trial, sw.space)
        everyone = trial.study.get_trials(deepcopy=False)
        retry_of = retried_number(next(t for t in everyone if t.number == trial.number))
        c = counts(trial.study, before=trial.number)
        surplus = None
        if retry_of is None and c["done"] + c["running"] + c["waiting"] >= sw.n_trials:
            surplus = "n_trials was reached by other workers"  # two workers took the last slot at once
        elif retry_of is not None and any(retried_number(t) == retry_of for t in everyone if t.number < trial.number):
            surplus = f"trial {retry_of} is already retried"  # two workers failed the same stale trial at once
        if surplus:  # the higher number gives way: never run, not counted
            trial.set_user_attr("surplus", True)
            trial.set_user_attr("reason", f"surplus: {surplus}; not run")
            raise TrialStopped("failed", "surplus")
        t0 = time.time()
        try:
            value, run_dir = run_trial(sw, params, trial.number, trial)
        except TrialStopped as e:
            trial.set_user_attr("reason", e.reason)
            print(f"[{sw.name}] trial {trial.number} {e.state}: {e.reason}", flush=True)
            if e.state == "pruned":
                raise optuna.TrialPruned(e.reason) from None
            raise
        finally:
            trial.set_user_attr("trial_dir", str(sw.trial_dir(trial.number)))
            trial.set_user_attr("wall_time_s", round(time.time() - t0, 2))
        trial.set_user_attr("run_dir", str(run_dir))
        print(f"[{sw.name}] trial {trial.number} {params} -> {sw.metric}={value:.4g}", flush=True)
        return value

    return fn


def worker(sw: Sweep, index: int = 0) -> None:
    """Run trials until the study has n_trials done; wait for other workers' running trials (and take over their
    retries if they die) before leaving."""
    from optuna.storages import fail_stale_trials

    probe = open_study(sw)
    study = open_study(sw, offset=1000 * index + len(probe.trials))  # a resumed or parallel worker draws anew
    fn = objective(sw)
    while True:
        fail_stale_trials(study)
        c = counts(study)
        if c["waiting"] or c["done"] + c["running"] < sw.n_trials:
            study.optimize(fn, n_trials=1, catch=(TrialStopped,))
        elif c["running"]:
            time.sleep(sw.heartbeat["interval"])
        else:
            return


def run(sw: Sweep, workers: int = 1) -> int:
    check_upstream(sw)
    study = open_study(sw)  # create it once, before the workers race to
    c = counts(study)
    print(f"[{sw.name}] study in {sw.storage}: {c['done']}/{sw.n_trials} done; {workers} worker(s) on "
          f"{socket.gethostname()}", flush=True)
    if workers <= 1:
        worker(sw, 0)
        return 0
    cmd = [sys.executable, "-m", "rlhf.sweep", "worker", sw.path, "--storage", sw.storage,
           "--results-dir", sw.results_dir]
    procs = [subprocess.Popen(cmd + ["--index", str(i)]) for i in range(workers)]
    codes = [p.wait() for p in procs]
    if any(codes):
        print(f"[{sw.name}] worker exit codes {codes}; rerun the same command to resume", file=sys.stderr)
    return 1 if any(codes) else 0


# ----------------------------------------------------------------------------------------------------------- report
def _plot(fig_fn, study, path: Path, size: tuple[float, float]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ax = fig_fn(study)
            fig = (ax.flat[0] if hasattr(ax, "flat") else ax).get_figure()
            fig.set_size_inches(*size)
            fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        return str(path)
    except Exception as e:  # noqa: BLE001 - a plot that cannot be drawn must not stop the report
        plt.close("all")
        return f"not drawn ({type(e).__name__}: {e})"


def importances(study) -> dict | str:
    optuna = _optuna()
    from optuna.trial import TrialState

    if len(study.get_trials(states=(TrialState.COMPLETE,))) < 2:
        return "needs at least 2 complete trials"
    errors = []
    for evaluator in (None, optuna.importance.PedAnovaImportanceEvaluator()):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return optuna.importance.get_param_importances(study, evaluator=evaluator)
        except Exception as e:  # noqa: BLE001 - fANOVA needs scikit-learn; fall back, then give up with the reason
            errors.append(f"{type(e).__name__}: {e}")
    return "not computed (" + "; ".join(errors) + ")"


def report(sw: Sweep) -> str:
    optuna = _optuna()
    from optuna.trial import TrialState
    from optuna.visualization import matplotlib as vis

    try:
        study = optuna.load_study(study_name=sw.name, storage=storage(sw))
    except KeyError:
        raise SweepError(f"{sw.path}: no study '{sw.name}' in {sw.storage}. Run `make sweep SWEEP={sw.path}` "
                         f"first.") from None
    trials = study.trials
    c = counts(study)
    lines = [f"# Sweep {sw.name}", "", f"study {sw.name} in {sw.storage}; {c['done']}/{sw.n_trials} done; "
             f"objective {sw.metric} ({sw.direction}); stages {', '.join(sw.stages)} of {sw.experiment}", ""]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete:
        best = study.best_trial
        args = " ".join(sw.overrides + param_overrides(best.params))
        lines += [f"best trial: #{best.number} {sw.metric}={best.value:.6g} params {best.params}",
                  f"  run record: {best.user_attrs.get('run_dir')}",
                  f"  config: {Path(best.user_attrs.get('run_dir', '.')) / 'config.yaml'}",
                  "  reproduce: " + " && ".join(f"python -m rlhf {s} --exp {sw.experiment} {args}"
                                                 for s in sw.stages), ""]
    else:
        lines += ["best trial: none (no complete trial yet)", ""]
    keys = list(sw.space)
    lines += ["| trial | state | " + " | ".join(keys) + " | value | reason |",
              "|---|---|" + "---|" * len(keys) + "---|---|"]
    for t in trials:
        value = "" if t.value is None else f"{t.value:.6g}"
        reason = t.user_attrs.get("reason", "")
        retry = retried_number(t)
        if retry is not None:
            reason = (reason + "; " if reason else "") + f"retry of trial {retry}"
        if t.state == TrialState.FAIL and not reason:
            reason = "worker stopped sending heartbeats (died?)"
        cells = [f"{t.params[k]:.4g}" if isinstance(t.params.get(k), float) else str(t.params.get(k, ""))
                 for k in keys]
        lines.append(f"| {t.number} | {t.state.name} | " + " | ".join(cells) +
                     f" | {value} | {reason.replace('|', '/')[:160]} |")
    imp = importances(study)
    lines += ["", "parameter importances: " + (", ".join(f"{k} {v:.3f}" for k, v in imp.items())
                                                if isinstance(imp, dict) else imp), ""]
    sw.dir.mkdir(parents=True, exist_ok=True)
    if complete:
        n = len(keys)
        plots = {"optimization history": _plot(vis.plot_optimization_history, study, sw.dir / "history.png", (9, 5)),
                 "parallel coordinates": _plot(vis.plot_parallel_coordinate, study, sw.dir / "parallel.png",
                                               (3 * n + 5, 5)),
                 "slice": _plot(vis.plot_slice, study, sw.dir / "slice.png", (5 * n + 2, 5))}
        lines += [f"plot, {k}: {v}" for k, v in plots.items()]
    text = "\n".join(lines) + "\n"
    (sw.dir / "report.md").write_text(text)
    return text


# ------------------------------------------------------------------------------------------------------------ W&B
def wandb_config(sw: Sweep) -> dict:
    """The same space and metric as a W&B sweep configuration (method bayes)."""
    params = {}
    for key, s in sw.space.items():
        if s["type"] == "categorical":
            params[key] = {"values": list(s["choices"])}
        elif s["type"] == "float":
            if s["log"]:
                params[key] = {"distribution": "log_uniform_values", "min": s["low"], "max": s["high"]}
            elif s.get("step"):
                params[key] = {"distribution": "q_uniform", "min": s["low"], "max": s["high"], "q": s["step"]}
            else:
                params[key] = {"distribution": "uniform", "min": s["low"], "max": s["high"]}
        elif s["log"]:
            params[key] = {"distribution": "q_log_uniform_values", "min": s["low"], "max": s["high"], "q": 1}
        elif s.get("step", 1) != 1:
            params[key] = {"distribution": "q_uniform", "min": s["low"], "max": s["high"], "q": s["step"]}
        else:
            params[key] = {"distribution": "int_uniform", "min": s["low"], "max": s["high"]}
    return {"name": sw.name, "method": "bayes", "metric": {"name": sw.metric, "goal": sw.direction},
            "parameters": params,
            "command": ["${env}", "${interpreter}", "-m", "rlhf.sweep", "wandb-agent", sw.path, "${args_no_hyphens}"]}


def wandb_sample(parameters: dict, space: dict, rng: random.Random) -> dict:
    """One random draw from a W&B parameters block, typed as the sweep file's space says."""
    out = {}
    for key, p in parameters.items():
        if "values" in p:
            v = rng.choice(p["values"])
        elif p["distribution"] in ("log_uniform_values", "q_log_uniform_values"):
            v = math.exp(rng.uniform(math.log(p["min"]), math.log(p["max"])))
        elif p["distribution"] == "int_uniform":
            v = rng.randint(p["min"], p["max"])
        else:
            v = rng.uniform(p["min"], p["max"])
        if "q" in p:
            v = min(max(round(v / p["q"]) * p["q"], p["min"]), p["max"])
        out[key] = _typed(space[key], v)
    return out


def _typed(spec: dict, value):
    if spec["type"] == "int":
        return int(round(float(value)))
    if spec["type"] == "float":
        return float(value)
    return value


def wandb_trial(sw: Sweep, params: dict | None = None, tag=None) -> float | None:
    """One W&B run: train with `params` (None: the agent's config), log the objective, finish."""
    import wandb

    run = wandb.init(project=sw.wandb["project"], group=sw.name, job_type="sweep-trial", config=params,
                     dir=str(sw.dir), name=None if tag is None else f"{sw.name}-{tag}")
    params = {k: _typed(sw.space[k], run.config[k]) for k in sw.space}
    tag = tag if tag is not None else f"wandb-{run.id}"
    try:
        value, run_dir = run_trial(sw, params, tag)
    except TrialStopped as e:
        run.summary.update({"state": e.state, "reason": e.reason})
        run.finish(exit_code=1 if e.state == "failed" else 0)
        print(f"[{sw.name}] {tag} {e.state}: {e.reason}", flush=True)
        return None
    run.log({sw.metric: value})
    run.summary.update({"state": "complete", "run_dir": str(run_dir)})
    run.finish()
    print(f"[{sw.name}] {tag} {params} -> {sw.metric}={value:.4g}", flush=True)
    return value


def wandb_sweep(sw: Sweep, count: int | None = None) -> Path:
    """Write the W&B sweep config; with an account, create the sweep and run `wandb agent` (it runs
    `python -m rlhf.sweep wandb-agent`); offline, run the same trials for `count` random draws from that config."""
    check_upstream(sw)
    count = count or sw.wandb["count"]
    cfg = wandb_config(sw)
    sw.dir.mkdir(parents=True, exist_ok=True)
    path = sw.dir / "wandb-sweep.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    print(f"[{sw.name}] W&B sweep config: {path}", flush=True)
    mode = os.environ.get("WANDB_MODE", "online" if os.environ.get("WANDB_API_KEY") else "offline")
    if mode == "online":
        import wandb

        sweep_id = wandb.sweep(cfg, project=sw.wandb["project"])
        subprocess.run([sys.executable, "-m", "wandb", "agent", "--count", str(count),
                        f"{wandb.Api().default_entity}/{sw.wandb['project']}/{sweep_id}"], check=True)
        return path
    os.environ["WANDB_MODE"] = "offline" if mode != "disabled" else mode
    rng = random.Random(sw.sampler.get("seed"))
    for i in range(count):
        wandb_trial(sw, wandb_sample(cfg["parameters"], sw.space, rng), tag=f"wandb-{i}")
    print(f"[{sw.name}] offline runs under {sw.dir / 'wandb'} (upload later with `wandb sync`)", flush=True)
    return path


# -------------------------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rlhf.sweep", description="Optuna / W&B sweeps over an experiment's config")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("run", "run (or resume) the Optuna study"), ("worker", "one worker process (used by run)"),
                        ("report", "best trial, all trials, importances and plots"),
                        ("wandb", "W&B sweep from the same file (offline without an account)"),
                        ("wandb-agent", "the program a W&B agent runs: one trial with key=value parameters")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("sweep")
        p.add_argument("--storage", default=None, help="Optuna storage URL (default: the sweep file's)")
        p.add_argument("--results-dir", default=None)
        if name == "run":
            p.add_argument("--workers", type=int, default=1)
        if name == "worker":
            p.add_argument("--index", type=int, default=0)
        if name == "wandb":
            p.add_argument("--count", type=int, default=None)
        if name == "wandb-agent":
            p.add_argument("params", nargs="*")
    args = ap.parse_args(argv)
    try:
        sw = load(args.sweep, storage=args.storage or None, results_dir=args.results_dir)
        if args.cmd == "run":
            return run(sw, args.workers)
        if args.cmd == "worker":
            worker(sw, args.index)
        elif args.cmd == "report":
            print(report(sw), end="")
        elif args.cmd == "wandb":
            wandb_sweep(sw, args.count)
        else:
            given = config.parse_overrides(args.params)
            flat = {k: v for k, v in _flatten(given).items()}
            unknown = set(flat) - set(sw.space)
            if unknown:
                raise SweepError(f"{sw.path}: wandb-agent: parameters {sorted(unknown)} are not in the space")
            check_upstream(sw)
            return 0 if wandb_trial(sw, flat or None) is not None else 1
    except (SweepError, config.ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


if __name__ == "__main__":
    sys.exit(main())
