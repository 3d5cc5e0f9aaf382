"""One sweep trial: the memory preflight, then each stage of the sweep in a process of its own (sweep.py runs it).

The parameters become `key=value` overrides; the memory predictor (rlhf.memory.memplan) checks every stage first and
prunes the trial, without loading anything, when one is over memory.budget_gb; then each stage runs as
`python -m rlhf <stage>` with results_dir set to results/sweeps/<name>/trials/<number>/, and RLHF_SWEEP tags the
run record's summary with the study, trial and swept values. The objective stage's metrics.jsonl is tailed and its
`objective.intermediate` metric reported to the pruner; a pruned trial's process is killed. A stage that fails ends
the trial with the reason (over its memory budget: pruned). A trial Ctrl-C interrupted waits for its stage's
checkpoint; its rerun (a new trial number) runs in the interrupted trial's folder, where --reuse takes the stages that
finished and the interrupted one resumes from its checkpoint.
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rlhf.experiment import config, stages
from rlhf.runs import lineage, records
from rlhf.sweeps.spec import STORAGE_ENV, Sweep, SweepError

POLL_S = 0.5
STAGE_STOP_S = 300
"""How long an interrupted trial waits for its stage to save its checkpoint and stop (the Ctrl-C reached it too; the
stage stops at the end of its step or iteration: a 7B PPO iteration took 59-91 s on an H100, results/gpu/2026-11-23-*
and 2026-11-25-*-ppo.json; a 4090's is not measured), then kills it (the rerun then resumes from the last periodic
checkpoint); a second Ctrl-C kills it at once. Under the sweep command's own wait for its workers
(sweep.STOP_WAIT_S)."""


class TrialStopped(Exception):
    """A trial ends without a value: state "pruned" or "failed", with the reason."""

    def __init__(self, state: str, reason: str):
        super().__init__(reason)
        self.state, self.reason = state, reason


def param_overrides(params: dict) -> list[str]:
    return [f"{k}={json.dumps(v)}" for k, v in params.items()]


def check_upstream(sw: Sweep) -> None:
    """Stages the sweep does not train come from `upstream`: refuse to start when one has no finished run."""
    for s in sw.stages:
        for u in sw.needs[s]:
            if u not in sw.stages and not (Path(sw.upstream) / sw.exp_name / u / "latest").exists():
                raise SweepError(f"{sw.path}: stages: {s} needs a finished {u} run of '{sw.exp_name}' under "
                                 f"{sw.upstream}/ (key 'upstream'). Run `make {u} EXP={sw.experiment}` first, "
                                 f"or sweep it too: stages: [{u}, {s}]")
    check_held_out(sw)


def check_held_out(sw: Sweep) -> None:
    """A swept stage that starts from the SFT run under `upstream` is graded on the held-out rows the sweep's fixed
    overrides draw: refuse to start when that run trained on any of them (other data.* settings draw another split;
    the stage would refuse each trial the same way: runtime.upstream_sft). A data.* key in the space is checked per
    trial, by the stage."""
    from rlhf.inputs import data
    from rlhf.runs import lineage, records

    need = [s for s in sw.stages if "sft" in sw.needs[s] and "sft" not in sw.stages]
    if not need:
        return
    exp = config.load(sw.experiment, sw.overrides + [f"results_dir={sw.upstream}"])
    sft_dir, sft = records.latest(exp, "sft", need[0])
    if why := lineage.held_out_overlap(sft, sft_dir, data.load(exp).eval, need[0]):
        raise SweepError(f"{sw.path}: overrides: {why} (drop the data.* overrides, or sweep it too: stages: "
                         f"[sft, {need[0]}])")


def _upstream_stages(sw: Sweep) -> list[str]:
    """The stages the trials take from `upstream` (not swept): those the swept stages need, and the reward model run
    when there is one and they start from SFT (a stage from SFT reads it as `make <stage>` does: its held-out check
    scores with it; rl.checks.latest_rm)."""
    wanted = {u for s in sw.stages for u in sw.needs[s] if u not in sw.stages}
    if "sft" in wanted and "rm" not in sw.stages and (Path(sw.upstream) / sw.exp_name / "rm" / "latest").exists():
        wanted.add("rm")
    return sorted(wanted)


def upstream_runs(sw: Sweep) -> dict[str, dict]:
    """The run each upstream stage's `latest` names now, what every trial starts from: {stage: {run: its directory,
    fingerprint: its lineage's, None where it records none}}."""
    out = {}
    for u in _upstream_stages(sw):
        run = records.latest_run(Path(sw.upstream) / sw.exp_name / u)
        if run is not None:
            try:
                fingerprint = json.loads((run / "lineage.json").read_text()).get("fingerprint")
            except (OSError, ValueError):
                fingerprint = None
            out[u] = {"run": str(run.resolve()), "fingerprint": fingerprint}
    return out


def _link_upstream(sw: Sweep, trial_dir: Path) -> None:
    """The upstream runs the trial's stages consume (_upstream_stages), linked from `upstream`; a stage says there is
    none when it is not there."""
    for u in _upstream_stages(sw):
        link = trial_dir / sw.exp_name / u
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to((Path(sw.upstream) / sw.exp_name / u).resolve(), target_is_directory=True)


def _with_parent(cmd: list[str]) -> list[str]:
    """The stage process gets SIGKILL when the worker that started it dies (Linux: util-linux's setpriv sets the
    parent-death signal, which survives the exec), so a dead worker leaves no orphan holding device memory."""
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    return [setpriv, "--pdeathsig", "KILL", "--", *cmd] if setpriv else cmd


def _walk(metric: str, summary: dict, stage: str) -> tuple[object, str | None]:
    """The node of the dotted path `metric` in a `stage` run's summary, or None and what the summary lacks (the
    nearest name there, and every name at that level)."""
    node, where = summary, []
    for part in metric.split("."):
        if not isinstance(node, dict) or part not in node:
            have = ", ".join(sorted(node)) if isinstance(node, dict) else f"a {type(node).__name__}"
            near = difflib.get_close_matches(part, list(node), n=1, cutoff=0.6) if isinstance(node, dict) else []
            return None, (f"objective.metric {metric!r}: {stage}'s summary has no {'.'.join([*where, part])!r}"
                          + (f" (did you mean {'.'.join([*where, near[0]])!r}?)" if near else "")
                          + f" ({'.'.join(where) or 'the summary'} has: {have})")
        node, where = node[part], [*where, part]
    return node, None


def _diverged(node) -> bool:
    """A summary's value of a diverged run: None, or not finite (records writes those as "nan" or "inf")."""
    return node is None or node in ("nan", "inf", "-inf") or (isinstance(node, float) and not math.isfinite(node))


def _non_number(node) -> str | None:
    """What a summary's value that is no number is (its type, and its keys or its text), or None for a number."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return None
    return f"{type(node).__name__} ({', '.join(sorted(node)) if isinstance(node, dict) else repr(node)[:200]})"


def objective_value(sw: Sweep, summary: dict, run_dir: Path, proven: bool = False) -> float:
    """The objective (`objective.metric`, a dotted path) in the last stage's summary. While no trial of the study has
    completed (`proven` False), a path the summary lacks, or that names no number, is the sweep file's error, the same
    for every trial: SweepError, which stops the sweep (its run stays in `run_dir`); once one has, the path is right
    and this trial lacks it (its own parameters): it fails, as does a value that is not finite (a diverged run,
    recorded as "nan" or "inf")."""
    node, missing = _walk(sw.metric, summary, sw.stages[-1])
    if missing:
        if proven:
            raise TrialStopped("failed", missing)
        raise SweepError(f"{sw.path}: {missing}; name one of them and rerun (its run: {run_dir})")
    if _diverged(node):
        raise TrialStopped("failed", f"objective {sw.metric} is {node!r}, not a finite number")
    what = _non_number(node)
    if what:
        if proven:
            raise TrialStopped("failed", f"objective {sw.metric} is {what}, not a number")
        raise SweepError(f"{sw.path}: objective.metric {sw.metric!r} is not a number in {sw.stages[-1]}'s summary "
                         f"but {what}: name a number in it (its run: {run_dir})")
    return float(node)


def unseen_objective(sw: Sweep) -> str | None:
    """Before a study's first trial: when the last stage has a finished run of the experiment under `upstream` (its
    `latest`, the run `make` consumes: a `make dpo` before the sweep), a warning for each name of the objective that
    run lacks: the metric path in its summary (or naming no number there), the intermediate key in its metrics.jsonl,
    with the nearest. The first trial would stop the sweep on them only at its end (hours, on a 7B). A warning, not a
    refusal: that run's settings may differ from the sweep's. None when there is no such run, or it has both."""
    run_dir = records.latest_run(Path(sw.upstream) / sw.exp_name / sw.stages[-1])
    if run_dir is None:
        return None
    missing = []
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = None
    if isinstance(summary, dict):
        node, lacks = _walk(sw.metric, summary, sw.stages[-1])
        if lacks is None and not _diverged(node) and _non_number(node):
            lacks = f"objective.metric {sw.metric!r} is {_non_number(node)} in it, not a number"
        missing += [lacks] if lacks else []
    keys = set()
    try:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            keys |= set(rec) - {"step"} if isinstance(rec, dict) else set()
    except OSError:
        pass
    if sw.intermediate and keys and sw.intermediate not in keys:
        near = difflib.get_close_matches(sw.intermediate, list(keys), n=1, cutoff=0.6)
        missing.append(f"objective.intermediate {sw.intermediate!r} is in none of its metrics.jsonl lines"
                       + (f" (did you mean {near[0]!r}?)" if near else f" (their keys: {', '.join(sorted(keys))})"))
    if not missing:
        return None
    return (f"warning: {sw.path}: the latest {sw.stages[-1]} run of '{sw.exp_name}' ({run_dir}): {'; '.join(missing)}. "
            f"If the sweep's runs write the same names, its first trial will stop the sweep on this at its end: "
            f"Ctrl-C now and mend the file")


def _error_line(log: Path, start: int = 0) -> str:
    """Why the stage whose output went to `log` from byte `start` on failed: its error (with the first three lines
    listed under it), else the last line of a traceback, else its last lines."""
    with open(log, "rb") as f:
        f.seek(start)
        lines = f.read().decode(errors="replace").splitlines()
    said = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    if said:  # an expected failure: the CLI's line, and the first lines it lists under it (a data file's bad records)
        listed = list(itertools.takewhile(lambda line: line.startswith("  "), lines[said[-1] + 1:]))[:3]
        listed = [line.strip() for line in listed]
        return " ".join([lines[said[-1]][len("error: "):], *listed])
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", line)]
    if raised:  # a traceback: its last line
        return raised[-1][:500]
    tail = [line for line in lines if line.strip()][-3:]
    return " | ".join(tail)[-500:] or "no output"


def _report_intermediate(trial, stage_root: Path, key: str, seen: dict, reported: set, keys: set) -> None:
    """Report each new complete line's `key` of the stage's metrics.jsonl to the trial's pruner (`seen`: how far each
    file was read, None for a file not to read; `reported`: the steps reported; `keys`: every key read, for the check
    that `key` is one)."""
    for f in sorted(stage_root.glob("*/metrics.jsonl")):
        if f in seen and seen[f] is None:
            continue
        text = f.read_text(errors="replace")
        complete = text[: text.rfind("\n") + 1]
        for line in complete[seen.get(f, 0):].splitlines():
            rec = json.loads(line)
            keys.update(rec)
            value = rec.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value) and rec.get("step") not in reported:
                reported.add(rec["step"])
                trial.report(float(value), int(rec["step"]))
                if trial.should_prune():
                    raise TrialStopped("pruned", f"pruned at step {rec['step']}: {key}={value:.4g}")
        seen[f] = len(complete)


def run_stage(sw: Sweep, stage: str, overrides: list[str], trial_dir: Path, tag, trial=None,
              params: dict | None = None, proven: bool = False, rerun: bool = False) -> None:
    """One stage in its own process; reports intermediate values to `trial`'s pruner while it runs. RLHF_SWEEP tells
    the stage its study, trial and swept `params` (its summary's `sweep`; its W&B run's name and tags). `proven`: a
    trial of the study has completed (objective_value's). `rerun`: in an interrupted trial's folder, where the stage
    is taken if it finished (--reuse) and resumed from its checkpoint if it has one; a run of it with neither is not
    read for the pruner."""
    cmd = stages.command(stage, sw.experiment, ["--reuse", *overrides] if rerun else overrides)
    env = {k: v for k, v in os.environ.items() if k != STORAGE_ENV}  # a stage needs no database password
    env["RLHF_SWEEP"] = json.dumps({"study": sw.name, "trial": tag, "params": params or {}})
    log, stage_root = trial_dir / f"{stage}.log", trial_dir / sw.exp_name / stage
    t0, reported, keys = time.time(), set(), set()
    seen = {d / "metrics.jsonl": None for d in (stage_root.iterdir() if rerun and stage_root.is_dir() else ())
            if d.is_dir() and lineage.latest_checkpoint(d) is None}  # interrupted before its first checkpoint
    watch = trial is not None and sw.intermediate and stage == sw.stages[-1]
    print(f"[{sw.name}] trial {tag}: {stage} running (its log: {log})", flush=True)  # a 7B stage runs for hours
    with open(log, "a") as out:  # a rerun in an interrupted trial's folder adds to its log
        start = out.tell()
        proc = subprocess.Popen(_with_parent(cmd), stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            while proc.poll() is None:
                time.sleep(POLL_S)
                if watch:
                    _report_intermediate(trial, stage_root, sw.intermediate, seen, reported, keys)
                if sw.trial_timeout_s and time.time() - t0 > sw.trial_timeout_s:
                    raise TrialStopped("failed", f"{stage}: killed after trial_timeout_s={sw.trial_timeout_s}")
            if watch:
                _report_intermediate(trial, stage_root, sw.intermediate, seen, reported, keys)
        except KeyboardInterrupt:  # the stage got the Ctrl-C too: it saves a checkpoint, then stops, for the rerun
            print(f"[{sw.name}] trial {tag}: waiting for its {stage} stage to save a checkpoint and stop (up to "
                  f"{STAGE_STOP_S} s; Ctrl-C again stops it at once)", file=sys.stderr, flush=True)
            try:
                proc.wait(timeout=STAGE_STOP_S)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):  # a stage that never stops, or a second Ctrl-C
                pass
            raise
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode in (130, 143):  # the stage stopped on Ctrl-C or SIGTERM (checkpointed): the sweep stops too
        raise KeyboardInterrupt
    if proc.returncode != 0:
        reason = sw.redact(f"{stage}: exit {proc.returncode}: {_error_line(log, start)}")
        raise TrialStopped("pruned" if "memory budget exceeded" in reason else "failed", reason)
    if watch and not proven and keys and sw.intermediate not in keys:  # the pruner was never fed: the file's error
        raise SweepError(f"{sw.path}: objective.intermediate {sw.intermediate!r} is in none of {stage}'s metrics.jsonl "
                         f"lines, so the pruner saw nothing (their keys: {', '.join(sorted(keys - {'step'}))}); name "
                         f"one of them and rerun")


def run_trial(sw: Sweep, params: dict, tag, trial=None, proven: bool = False, folder=None) -> tuple[float, Path]:
    """Train the sweep's stages with `params` in trial `folder`'s directory (an interrupted trial's, for its rerun;
    else `tag`'s); returns the objective and the last stage's run directory. Raises TrialStopped (pruned: over the
    memory budget, predicted or measured, or by the pruner; failed: a crash), or SweepError for an objective the
    sweep file names wrong while no trial has completed (`proven` False)."""
    from rlhf.memory import memplan
    from rlhf.memory.arch import MemoryPlanError

    trial_dir, rerun = sw.trial_dir(tag if folder is None else folder), folder is not None and folder != tag
    overrides = sw.overrides + param_overrides(params) + [f"results_dir={trial_dir}"]
    try:  # a combination can break a cross-field rule that each value alone passes
        exp = config.load(sw.experiment, overrides)
    except config.ConfigError as e:
        raise TrialStopped("failed", f"config: {e}") from None
    for stage in sw.stages:  # before anything is started or loaded
        try:
            memplan.preflight(exp, stage)
        except MemoryPlanError as e:
            raise TrialStopped("pruned", f"memory preflight: {e}") from None
    trial_dir.mkdir(parents=True, exist_ok=True)
    _link_upstream(sw, trial_dir)
    for stage in sw.stages:
        run_stage(sw, stage, overrides, trial_dir, tag, trial, params, proven, rerun)
    root = trial_dir / sw.exp_name / sw.stages[-1]
    run_dir = root / (root / "latest").read_text().strip()
    return objective_value(sw, json.loads((run_dir / "summary.json").read_text()), run_dir, proven), run_dir


def optuna_choices(choices: list) -> list:
    """A categorical's choices as Optuna takes them (None, bool, int, float or str): a list or mapping as its JSON
    text, which Optuna stores, plots and ranks like any string (decoded by `decoded`)."""
    return [json.dumps(c) if isinstance(c, (list, dict)) else c for c in choices]


def decoded(space: dict, params: dict) -> dict:
    """Optuna's `params` of a trial as the config's values: a list or mapping choice from its JSON text."""
    out = dict(params)
    for key, v in params.items():
        s = space.get(key, {})
        if s.get("type") == "categorical" and isinstance(v, str) and v not in s["choices"]:
            out[key] = dict(zip(optuna_choices(s["choices"]), s["choices"])).get(v, v)
    return out


def _metric_node(run_dir: Path, metric: str) -> tuple[dict, dict, str] | None:
    """(the run's summary, the dict that holds `metric`'s last part, that part) for a dotted path into the summary;
    None where the summary is unreadable or the path does not lead to a dict."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    *parents, name = metric.split(".")
    node = summary
    for part in parents:
        node = node.get(part, {}) if isinstance(node, dict) else {}
    return (summary, node, name) if isinstance(node, dict) else None


def held_out(run_dir: Path, metric: str) -> tuple[int | None, list[float] | None]:
    """How many held-out rows the run of `run_dir` was graded on for `metric` (a dotted path into its summary): a win
    rate's held-out prompts (the check samples eval.prompts of them: its summary's eval_prompts), else its lineage's
    data_sizes.eval (a grader's win rate: the `n` beside it); and the run's own 95% interval of it, the summary's
    `<name>_ci95` beside it (or the `ci95` beside a grader's `win_rate`). None for what the summary lacks."""
    found = _metric_node(run_dir, metric)
    if found is None:
        return None, None
    summary, node, name = found
    ci95 = node.get(f"{name}_ci95", node.get("ci95") if name == "win_rate" else None)
    if isinstance(node.get("n"), int):  # a grader's win rate, make eval's: its own n
        return node["n"], ci95
    if isinstance(node.get(f"{name}_n"), int):  # a rate that records its n (DPO's rewards/accuracies)
        return node[f"{name}_n"], ci95
    try:
        n = summary["metrics"]["eval_prompts"] if "win_rate" in metric else summary["lineage"]["data_sizes"]["eval"]
    except (KeyError, TypeError):
        n = None
    return n, ci95


def effective_n(run_dir: Path, metric: str) -> float | None:
    """The effective n the run's interval of `metric` is at, where its summary records one (`<name>_n_effective`:
    DPO's rewards/accuracies, TRL's mean of batch means, guard.batch_mean_n); None otherwise."""
    found = _metric_node(run_dir, metric)
    value = found[1].get(f"{found[2]}_n_effective") if found else None
    return value if isinstance(value, (int, float)) else None


def suggest(trial, space: dict) -> dict:
    """The trial's draw as config values (a list or mapping choice decoded; trial.params holds Optuna's)."""
    params = {}
    for key, s in space.items():
        if s["type"] == "categorical":
            params[key] = decoded(space, {key: trial.suggest_categorical(key, optuna_choices(s["choices"]))})[key]
        elif s["type"] == "float":
            params[key] = trial.suggest_float(key, s["low"], s["high"], log=s.get("log", False), step=s.get("step"))
        else:
            params[key] = trial.suggest_int(key, s["low"], s["high"], log=s.get("log", False), step=s.get("step") or 1)
    return params

