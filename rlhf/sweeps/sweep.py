"""Hyperparameter sweeps: an Optuna study (or a W&B sweep) over any config key, one subprocess per trial.

A sweep file (`sweeps/*.yaml`, schema in spec.py) names a base experiment, the stage(s) each trial trains,
the objective (a dotted path into the last stage's summary.json), the search space, the sampler and pruner, the trial
count and the storage. How one trial runs: trial.py.

  python -m rlhf.sweeps run sweeps/x.yaml [key=value ...] [--workers N] [--storage URL]  # make sweep SWEEP=... ARGS=...
  python -m rlhf.sweeps report sweeps/x.yaml [key=value ...]                             # make sweep-report SWEEP=...
  python -m rlhf.sweeps wandb sweeps/x.yaml [key=value ...] [--count N]                  # make wandb-sweep SWEEP=...
(key=value: the sweep file's keys, e.g. n_trials=2, as ARGS gives them; the report wants the same ones)

Resuming and several workers: the study lives in an RDB storage (SQLite under results/sweeps/<name>.db by default,
or one PostgreSQL URL shared by workers on several hosts). A rerun loads the same study and runs only what is left:
COMPLETE, PRUNED and FAIL trials count toward n_trials. Workers send heartbeats; a trial whose worker died is failed
once its heartbeat is older than the grace period (or, with no heartbeat at all, once the grace period has passed
since a worker first saw it: fail_unstarted_trials), and Optuna's RetryHeartbeatStaleTrialCallback queues a copy with
the same parameters, which a live worker runs and which counts in its place; a worker whose live trial another failed
that way goes on. MaxTrialsCallback stops a worker once n_trials are done or under way; a trial two workers started
at once for the last slot gives way (`surplus`). An objective the sweep file names wrong (a path the last stage's
summary lacks, or an intermediate key its metrics.jsonl never has) stops the sweep at its first trial, with one line
naming the keys there are, while no trial has completed (after one has, a trial that lacks it fails alone); that
trial fails without counting, so a rerun with the file mended runs n_trials.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

from rlhf.experiment import config, stages
from rlhf.infra import faults
from rlhf.runs.compare import cut
from rlhf.runs import lineage, records
from rlhf.runs.records import scrub
from rlhf.sweeps.spec import STORAGE_ENV, Sweep, SweepError, load, make_pruner
from rlhf.sweeps.trial import (TrialStopped, check_held_out, check_upstream, decoded, held_out, param_overrides,
                               effective_n, run_trial, suggest, unseen_objective, upstream_runs)
from rlhf.sweeps.wandb_sweep import offline_draws, wandb_config, wandb_sweep, wandb_trial

__all__ = ["Sweep", "SweepError", "load", "run", "report", "check_held_out", "wandb_config", "wandb_sweep",
           "offline_draws"]


# ----------------------------------------------------------------------------------------------------------- optuna
def _optuna():
    import optuna

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # trials print their own line
    return optuna


def storage_url(url: str) -> str:
    """The URL Optuna connects with: a bare postgresql:// names psycopg2, the driver the sweep extra installs
    (SQLAlchemy 2.1 would pick psycopg 3); any other URL as given."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return url  # RDBStorage reports it
    if parsed.drivername != "postgresql":
        return url
    return parsed.set(drivername="postgresql+psycopg2").render_as_string(hide_password=False)


def _one_line(sw: Sweep, e: Exception) -> str:
    """A storage error as one line without credentials (SQLAlchemy's spans lines and ends with a link)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip() and not line.startswith("(Background")]
    return sw.redact(" ".join(lines))


def sqlite_file(url: str) -> Path | None:
    """The database file of an SQLite storage URL (sqlite:///<path>); None for another database."""
    return Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None


@functools.cache
def _sqlite_storage():
    """RDBStorage on one SQLite file whose workers take a waiting trial one at a time. Optuna takes a waiting trial
    (a dead worker's retry, queued) by reading it under SELECT ... FOR UPDATE and setting it RUNNING; SQLite has no
    row lock and Python's driver opens the transaction only at the write, so two workers could both read it waiting
    and both run it: the second to finish failed with "Cannot tell a COMPLETE trial" and its worker exited (a killed
    sweep's rerun on 2 workers, 2026-11-27). Here the read and the write are one step under an exclusive lock on a
    file beside the database (SQLite's workers share a host); PostgreSQL locks the row itself. The class is made once,
    on first use: Optuna is imported only by the sweeps."""
    import fcntl

    from optuna.storages import RDBStorage
    from optuna.trial import TrialState

    class LockedSQLiteStorage(RDBStorage):
        def __init__(self, url: str, **kwargs):
            super().__init__(url, **kwargs)
            self.lock_path = f"{sqlite_file(url)}.lock"

        def set_trial_state_values(self, trial_id, state, values=None) -> bool:
            if state != TrialState.RUNNING:
                return super().set_trial_state_values(trial_id, state, values)
            with open(self.lock_path, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, after the commit
                return super().set_trial_state_values(trial_id, state, values)

    return LockedSQLiteStorage


def storage(sw: Sweep):
    optuna = _optuna()
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
    from sqlalchemy.exc import SQLAlchemyError

    kwargs, cls = {}, RDBStorage
    if db := sqlite_file(sw.storage):
        db.parent.mkdir(parents=True, exist_ok=True)
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
        cls = _sqlite_storage()
    hb = sw.heartbeat
    try:
        return cls(storage_url(sw.storage), heartbeat_interval=hb.interval, grace_period=hb.grace,
                   heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=hb.max_retry), **kwargs)
    except (optuna.exceptions.StorageInternalError, ImportError, ValueError, SQLAlchemyError) as e:
        raise SweepError(f"{sw.path}: storage {sw.shown_storage!r}: {_one_line(sw, e)}") from None


def make_sampler(sw: Sweep, offset: int = 0):
    optuna = _optuna()
    s = sw.sampler
    seed = None if s.seed is None else s.seed + offset
    if s.type == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=s.n_startup_trials)


def open_study(sw: Sweep, offset: int = 0):
    """The sweep's study, made or reopened; one that another sweep made under the same name and storage (another
    experiment, stages, objective, space or fixed overrides: its trials measure something else) is refused."""
    optuna = _optuna()
    study = optuna.create_study(study_name=sw.name, storage=storage(sw), direction=sw.direction,
                                sampler=make_sampler(sw, offset), pruner=make_pruner(sw.pruner), load_if_exists=True)
    return same_inputs(sw, same_sweep(sw, study, record=True))


def same_inputs(sw: Sweep, study):
    """`study`, when its next trial starts from what its first ones did: the swept stages' settings as the experiment
    file and fixed overrides resolve them (lineage.stage_config, what --reuse fingerprints: not paths, memory or
    tracking) and the upstream runs under `upstream` (trial.upstream_runs: by fingerprint where they record one; a
    `make sft` since moves the SFT run's `latest`), recorded by the first sweep that ran it and checked as each trial
    starts; else a SweepError naming what changed (the trials would differ by more than their parameters, and the
    report would credit the parameters). A study made before they were recorded records them now, and says so."""
    exp = config.load(sw.experiment, sw.overrides)
    settings: dict = {}
    for stage in sw.stages:
        for k, v in lineage.stage_config(exp, stage).items():
            settings[k] = {**settings.get(k, {}), **v} if isinstance(v, dict) else v
    now = json.loads(json.dumps({"config": settings, "upstream_runs": upstream_runs(sw)}, default=str))
    first = study.user_attrs.get("inputs")
    trials = study.get_trials(deepcopy=False)
    if first is None or all(_uncounted(t) for t in trials):
        if first is None and any(not _uncounted(t) for t in trials):
            print(f"[{sw.name}] the study began before its experiment and upstream runs were recorded: they are "
                  f"recorded now, and its next trials are checked against them", file=sys.stderr, flush=True)
        study.set_user_attr("inputs", now)
        return study
    changed = records.config_changes(first["config"], now["config"])
    if changed:
        raise SweepError(f"{sw.path}: {sw.experiment} changed since study {sw.name!r}'s first trial "
                         f"({'; '.join(changed)}): its next trials would differ from the first by more than their "
                         f"parameters. Undo the change, or give this sweep its own `name:`")
    was, runs = first["upstream_runs"], now["upstream_runs"]
    moved = [u for u in sorted(set(was) | set(runs)) if not same_run(was.get(u), runs.get(u))]
    if moved:
        said = "; ".join(f"{u}: {(was.get(u) or {}).get('run', 'none')} -> {(runs.get(u) or {}).get('run', 'none')}"
                         for u in moved)
        back = [f"echo {Path(was[u]['run']).name} > {Path(sw.upstream) / sw.exp_name / u / 'latest'}"
                for u in moved if was.get(u)]
        raise SweepError(f"{sw.path}: study {sw.name!r}'s trials started from other upstream runs than `latest` names "
                         f"now ({said}): its next trials would start from another. "
                         + (f"Point `latest` back at the run it began from ({' && '.join(back)}), or give"
                            if back else "Give")
                         + " this sweep its own `name:`")
    return study


def same_run(a: dict | None, b: dict | None) -> bool:
    """Whether two upstream runs (trial.upstream_runs' records) are the same: by fingerprint where both have one (the
    same settings and data: another host's run of them counts), else by path; none and none are the same."""
    if a is None or b is None:
        return a is b
    if a.get("fingerprint") and b.get("fingerprint"):
        return a["fingerprint"] == b["fingerprint"]
    return a.get("run") == b.get("run")


def same_sweep(sw: Sweep, study, record: bool = False):
    """`study`, when this sweep made it (its experiment, stages, objective, space and fixed overrides, recorded by
    the first sweep that opened it: `record`); another sweep's is a SweepError naming what differs. A study whose
    trials all went uncounted (the sweep file's objective failed them: mend the file and rerun) takes the mended
    file's."""
    made = json.loads(json.dumps({"experiment": sw.experiment, "stages": sw.stages, "metric": sw.objective.metric,
                                  "direction": sw.direction, "space": sw.space, "overrides": sw.overrides},
                                 default=str))
    first = study.user_attrs.get("sweep")
    mended = first is not None and all(_uncounted(t) for t in study.get_trials(deepcopy=False))
    if (first is None or mended) and record:
        study.set_user_attr("sweep", made)
    elif first is not None and first != made and not mended:
        other = [k for k in made if first.get(k) != made[k]]
        raise SweepError(f"{sw.path}: study {sw.name!r} in {sw.shown_storage} was made by another sweep (its "
                         + "; ".join(f"{k} {first.get(k)}, here {made[k]}" for k in other)
                         + "): its trials measure something else. Give this sweep its own `name:`, or rerun that one")
    return study


def retried_number(trial) -> int | None:
    """The number of the trial this one retries (after its worker died), or None."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return RetryHeartbeatStaleTrialCallback.retried_trial_number(trial)


def _retry_history(trial) -> list[int]:
    """The trials this one retries, the first one first (empty: not a retry)."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return RetryHeartbeatStaleTrialCallback.retry_history(trial)


def _uncounted(t) -> bool:
    """A surplus trial (never ran), one failed by the sweep file's objective (no value any trial could give), or one
    Ctrl-C interrupted (queued again)."""
    return bool(t.user_attrs.get("surplus") or t.user_attrs.get("sweep_file_error") or t.user_attrs.get("interrupted"))


def _stand_ins(trials) -> int:
    """Trials that do not count toward n_trials: a retry stands in for the trial it retries; _uncounted ones."""
    return sum(retried_number(t) is not None or _uncounted(t) for t in trials)


def counts(study) -> dict:
    """Trials by what they mean for n_trials: done (COMPLETE, PRUNED, FAIL), running, waiting; and all of them. A trial
    whose worker died counts through its retry; a surplus trial, or one the sweep file's objective failed, not at
    all."""
    trials = study.get_trials(deepcopy=False)
    retried = {n for t in trials for n in _retry_history(t)}
    states = Counter(t.state.name for t in trials if t.number not in retried and not _uncounted(t))
    return {"done": states["COMPLETE"] + states["PRUNED"] + states["FAIL"], "running": states["RUNNING"],
            "waiting": states["WAITING"], "all": len(trials)}


def objective(sw: Sweep):
    optuna = _optuna()

    def fn(trial) -> float:
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        params = suggest(trial, sw.space)
        trials = trial.study.get_trials(deepcopy=False)  # numbered 0, 1, ...: this one is trials[trial.number]
        earlier, history = trials[: trial.number], _retry_history(trials[trial.number])
        surplus = None  # two workers raced: the higher number gives way, never run and not counted
        if not history and trial.number - _stand_ins(earlier) >= sw.n_trials:
            surplus = "n_trials was reached by other workers"  # both took the last slot
        elif history and any(_retry_history(t) == history for t in earlier):
            surplus = f"trial {history[-1]} is already retried"  # both failed the same stale trial (SQLite)
        if surplus:
            trial.set_user_attr("surplus", True)
            trial.set_user_attr("reason", f"surplus: {surplus}; not run")
            raise TrialStopped("failed", "surplus")
        # an interrupted trial's rerun runs in its folder (resuming it); a dead worker's retry does not (the trial it
        # retries may live on: a heartbeat found stale on a loaded host)
        t0, folder = time.time(), trial.number if history else trial.user_attrs.get("folder", trial.number)
        proven = any(t.state == optuna.trial.TrialState.COMPLETE for t in earlier)  # the objective's names hold
        try:
            same_inputs(sw, trial.study)  # a `make sft` while the sweep runs moves `latest` under its trials
            value, run_dir = run_trial(sw, params, trial.number, trial, proven, folder)
        except TrialStopped as e:
            trial.set_user_attr("reason", e.reason)
            print(f"[{sw.name}] trial {trial.number} {e.state}: {e.reason}", flush=True)
            if e.state == "pruned":
                raise optuna.TrialPruned(e.reason) from None
            raise
        except KeyboardInterrupt:  # Ctrl-C: this trial fails uncounted, and its rerun resumes it (its params, in
            trial.set_user_attr("interrupted", True)  # its folder: run_trial)
            trial.set_user_attr("reason", "interrupted (Ctrl-C); queued to run again when the sweep is rerun")
            trial.study.enqueue_trial(trial.params, user_attrs={"requeue_of": trial.number, "folder": folder})
            raise
        except SweepError as e:  # the sweep file's objective, wrong for every trial: this one fails uncounted, and
            trial.set_user_attr("reason", f"the sweep file: {e}")  # the sweep stops
            trial.set_user_attr("sweep_file_error", True)
            raise SweepError(f"{e} (trial {trial.number} failed and does not count toward n_trials)") from None
        finally:
            trial.set_user_attr("trial_dir", str(sw.trial_dir(folder)))
            trial.set_user_attr("wall_time_s", round(time.time() - t0, 2))
        trial.set_user_attr("run_dir", str(run_dir))
        n, ci95 = held_out(run_dir, sw.metric)  # the held-out rows the objective was read on, its run's interval
        trial.set_user_attr("n", n)
        trial.set_user_attr("ci95", ci95)
        print(f"[{sw.name}] trial {trial.number} {params} -> {sw.metric}={value:.4g}", flush=True)
        return value

    return fn


def _beating(study) -> set[int]:
    """The ids of the study's trials that have a heartbeat row (Optuna keeps at most one per trial, its latest)."""
    import sqlalchemy
    from optuna.storages._rdb.models import TrialHeartbeatModel, TrialModel

    backend = getattr(study._storage, "_backend", study._storage)  # RDBStorage, under Optuna's cache
    query = sqlalchemy.select(TrialHeartbeatModel.trial_id).join(TrialModel) \
        .where(TrialModel.study_id == study._study_id)
    with backend.engine.connect() as conn:
        return set(conn.scalars(query))


def fail_unstarted_trials(study, grace: float, seen: dict[int, float]) -> list[int]:
    """FAIL the trials a dead worker created but never beat for: RUNNING, with no heartbeat row for more than `grace`
    seconds since this worker first saw them (`seen`: trial id -> time.monotonic(), kept between calls). Optuna's
    fail_stale_trials skips a trial without a heartbeat, so the other workers would wait on it forever. The worker's
    first heartbeat comes from a thread that races the objective's first writes: a kill just after a trial began (the
    test kills as a trial completes, when its worker asks the next) left one RUNNING with its `worker` attribute set
    and no heartbeat, and the rerun waited on it until make test's timeout (CI, 2026-11-27). The wait is timed on this
    host's clock: a trial's datetime_start is its own host's local time, hours off on a host in another time zone
    (a shared PostgreSQL study), which would fail a starting trial at once or an orphan never. A copy is queued by the
    storage's retry callback, as for a stale trial. Returns the trial numbers failed."""
    from optuna.trial import TrialState

    storage, failed, now = study._storage, [], time.monotonic()
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    beating = _beating(study) if running else set()
    for t in running:
        if t._trial_id in beating or now - seen.setdefault(t._trial_id, now) <= grace:
            continue
        try:
            if not storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                continue
        except RuntimeError:  # another worker finished it first (UpdateFinishedTrialError)
            continue
        retry = storage.get_heartbeat_stale_trial_callback()
        if retry is not None:
            retry(study, storage.get_trial(t._trial_id))
        failed.append(t.number)
    return failed


def _failed_elsewhere(e: BaseException | None) -> bool:
    """Optuna's tell of a trial another worker has failed: ValueError "Cannot tell a FAIL trial.", which Optuna 5's
    post-processing turns into an AssertionError ("Should not reach.") raised with the ValueError as its context."""
    while e is not None:
        if isinstance(e, ValueError) and "Cannot tell a FAIL trial" in str(e):
            return True
        e = e.__context__
    return False


def worker(sw: Sweep, index: int = 0) -> None:
    """Run trials until the study has n_trials done; wait for other workers' running trials (and take over their
    retries if they die) before leaving."""
    from optuna.storages import fail_stale_trials
    from optuna.study import MaxTrialsCallback

    probe = open_study(sw)
    study = open_study(sw, offset=1000 * index + len(probe.trials))  # a resumed or parallel worker draws anew
    fn, unbeaten = objective(sw), {}
    while True:
        fail_stale_trials(study)  # a dead worker's trial: FAIL, and a copy queued by the storage's retry callback
        fail_unstarted_trials(study, sw.heartbeat.grace, unbeaten)  # one it died before its first heartbeat: the same
        c = counts(study)
        counted = c["done"] + c["running"] + c["waiting"]
        if c["waiting"] or counted < sw.n_trials:  # queued retries first, then new trials
            stand_ins = c["all"] - counted
            stop = MaxTrialsCallback(sw.n_trials + stand_ins, states=None)  # every trial counts, stand-ins aside
            try:
                study.optimize(fn, catch=(TrialStopped,), callbacks=[stop])
            except (ValueError, AssertionError) as e:
                if not _failed_elsewhere(e):
                    raise
                # another worker found this trial's heartbeat stale (a loaded host) and failed it; its retry runs
                print(f"[{sw.name}] a trial of this worker was failed as stale by another; its retry counts instead",
                      flush=True)
        elif c["running"]:
            time.sleep(sw.heartbeat.interval)
        else:
            return


STOP_WAIT_S = 360
"""How long an interrupted sweep waits for its workers to queue their trials again and end (then kills them): longer
than a worker waits for its stage's checkpoint (trial.STAGE_STOP_S)."""
QUEUE_WAIT_S = 15
"""After a second Ctrl-C, how long it waits for them to queue their trials (their stages are stopped at once)."""


def run(sw: Sweep, workers: int = 1) -> int:
    """Run the study to n_trials on `workers` processes: 0 when any trial completed, 1 when none did (every one failed
    or was pruned: nothing to report as best) or a worker failed, 2 when a worker stopped on the sweep file or host."""
    if workers < 1:
        raise SweepError(f"{sw.path}: WORKERS={workers}: a sweep runs on at least 1 worker")
    check_upstream(sw)
    study = open_study(sw)  # create it once, before the workers race to
    done = counts(study)["done"]
    print(f"[{sw.name}] study in {sw.shown_storage}: {done}/{sw.n_trials} done; {workers} "
          f"worker(s) on {socket.gethostname()}", flush=True)
    if done >= sw.n_trials:
        print(f"[{sw.name}] nothing left to run: {done} trials done of n_trials={sw.n_trials}; raise n_trials (the "
              f"sweep file's, or ARGS=n_trials=N) to run more", flush=True)
    if done < sw.n_trials and not study.get_trials(deepcopy=False, states=(_optuna().trial.TrialState.COMPLETE,)):
        said = unseen_objective(sw)  # a name the latest run of the stage lacks, said before hours of a first trial
        if said:
            print(scrub(said), file=sys.stderr, flush=True)
    procs = []
    try:  # Ctrl-C: each worker's trial fails uncounted and is queued again (objective)
        if workers == 1:
            worker(sw, 0)
            return _none_completed(sw, study)
        cmd = [sys.executable, "-m", "rlhf.sweeps", "worker", sw.path, *sw.args, "--results-dir", sw.results_dir]
        env = {**os.environ, STORAGE_ENV: sw.storage}  # through the environment: a command line is public (ps, /proc)
        procs = [subprocess.Popen(cmd + ["--index", str(i)], env=env) for i in range(workers)]
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        # the Ctrl-C reached the workers too (the terminal's group): each waits for its stage's checkpoint, queues its
        # trial again and ends; the command ends after them, so that a rerun cannot race their writes
        deadline = time.time() + STOP_WAIT_S
        for p in procs:
            while p.poll() is None:
                try:
                    p.wait(timeout=max(0.0, deadline - time.time()))
                except subprocess.TimeoutExpired:  # a worker that never stops
                    p.kill()
                    p.wait()
                except KeyboardInterrupt:  # a second Ctrl-C: the workers stop their stages at once, then queue
                    deadline = min(deadline, time.time() + QUEUE_WAIT_S)
        print(f"\n[{sw.name}] interrupted: rerun the same command to resume (the interrupted trials run again)",
              file=sys.stderr)
        return 130
    if 2 in codes:  # a worker's one-line error (above): the sweep file or the host, to mend before a rerun
        print(f"[{sw.name}] worker exit codes {codes}: mend what the error above says, then rerun the same command "
              "to resume", file=sys.stderr)
    elif any(codes):
        print(f"[{sw.name}] worker exit codes {codes}; rerun the same command to resume", file=sys.stderr)
    return 2 if 2 in codes else 1 if any(codes) else _none_completed(sw, study)


def _none_completed(sw: Sweep, study) -> int:
    """1, said, when the study has done its n_trials and none completed; else 0."""
    from optuna.trial import TrialState

    if counts(study)["done"] < sw.n_trials or study.get_trials(states=(TrialState.COMPLETE,)):
        return 0
    print(f"[{sw.name}] no trial completed: each failed or was pruned (why: make sweep-report SWEEP={sw.path})",
          file=sys.stderr)
    return 1


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


RESAMPLES = 50
"""How many bootstrap resamples of the complete trials give each importance its range (report)."""


def importances(study, resamples: int = RESAMPLES) -> dict[str, tuple[float, float, float]] | str:
    """Each parameter's importance over the study's complete trials (Optuna's fANOVA, with a fixed seed; PED-ANOVA
    where fANOVA cannot run: it needs scikit-learn) and its 2.5-97.5% range over `resamples` bootstrap resamples of
    those trials (the same evaluator on each; a resample whose trials all share one value of a parameter gives it 0):
    {name: (importance, low, high)}, most important first; or why there are none. A few trials rank nothing, and the
    range shows it."""
    import random

    optuna = _optuna()
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(complete) < 2:
        return "needs at least 2 complete trials"

    def of(trials, evaluator) -> dict[str, float]:
        s = optuna.create_study(direction=study.direction)
        s.add_trials(trials)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return optuna.importance.get_param_importances(s, evaluator=evaluator)

    errors = []
    for make in (lambda: optuna.importance.FanovaImportanceEvaluator(seed=0),
                 optuna.importance.PedAnovaImportanceEvaluator):
        try:
            evaluator = make()
            whole = of(complete, evaluator)
        except Exception as e:  # noqa: BLE001 - fANOVA needs scikit-learn; fall back, then give up with the reason
            errors.append(f"{type(e).__name__}: {e}")
            continue
        rng, drawn = random.Random(0), {k: [] for k in whole}
        for _ in range(resamples):
            try:
                one = of([rng.choice(complete) for _ in complete], evaluator)
            except Exception:  # noqa: BLE001 - a resample the evaluator cannot rank (one distinct trial)
                one = {}
            for k in whole:
                drawn[k].append(one.get(k, 0.0))
        ranges = {k: sorted(v) for k, v in drawn.items()}
        at = [round(q * (resamples - 1)) for q in (0.025, 0.975)]  # the 2.5% and 97.5% points of the resamples
        return {k: (v, ranges[k][at[0]], ranges[k][at[1]]) for k, v in whole.items()}
    return "not computed (" + "; ".join(errors) + ")"


def graded(sw: Sweep, t) -> str:
    """A complete trial's objective with the n held-out rows it was read on and its run's own 95% interval (trial's
    held_out, kept with the trial; read from its run for a trial that kept none): `0.8125 (n=100, 95% 0.72-0.88)`."""
    n, ci95, value = t.user_attrs.get("n"), t.user_attrs.get("ci95"), t.value
    if "ci95" not in t.user_attrs and t.user_attrs.get("run_dir"):
        n, ci95 = held_out(Path(t.user_attrs["run_dir"]), sw.metric)
    if not n:
        return f"{value:.6g} (n unknown)"
    if not ci95:
        return f"{value:.6g} (n={n}; no {sw.metric.rsplit('.', 1)[-1]}_ci95 in its run's summary)"
    eff = t.user_attrs.get("run_dir") and effective_n(Path(t.user_attrs["run_dir"]), sw.metric)
    at = f", effective {eff:.0f}" if eff and eff < n - 0.5 else ""  # the interval's n (a mean of batch means)
    return f"{value:.6g} (n={n}{at}, 95% {ci95[0]:.2f}-{ci95[1]:.2f})"


def fresh_rows(sw: Sweep) -> tuple[list[str], str]:
    """The overrides that grade the best trial's parameters on held-out rows the selection never read, and why they
    do: another seed draws a fresh split of the pool; a held-out file (data.eval_path) is the same rows whatever the
    seed, so it takes another file."""
    base, into = config.load(sw.experiment, sw.overrides), f"results_dir={sw.dir / 'regrade'}"
    if base.data.eval_path:
        return (["data.eval_path=OTHER_EVAL.jsonl", into],
                f"the held-out rows are data.eval_path's ({base.data.eval_path}) whatever the seed: replace "
                f"OTHER_EVAL.jsonl with another held-out file; its stages are retrained")
    return [f"seed={base.seed + 1}", into], "another seed draws a fresh held-out split; its stages are retrained on it"


def report(sw: Sweep) -> str:
    optuna = _optuna()
    from optuna.trial import TrialState
    from optuna.visualization import matplotlib as vis

    missing = SweepError(f"{sw.path}: no study '{sw.name}' in {sw.shown_storage}. Run `make sweep SWEEP={sw.path}` "
                         f"first.")
    if (db := sqlite_file(sw.storage)) and not db.exists():
        raise missing  # not made by opening it (SQLite would make an empty database file)
    try:
        study = same_sweep(sw, optuna.load_study(study_name=sw.name, storage=storage(sw)))
    except KeyError:
        raise missing from None
    trials = study.trials
    c = counts(study)
    lines = [f"# Sweep {sw.name}", "", f"study {sw.name} in {sw.shown_storage}; {c['done']}/{sw.n_trials} done; "
             f"objective {sw.metric} ({sw.direction}); stages {', '.join(sw.stages)} of {sw.experiment}", ""]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete:
        best = study.best_trial
        args = sw.overrides + param_overrides(decoded(sw.space, best.params))
        regrade = [*dict.fromkeys(u for s in sw.stages for u in sw.needs[s] if u not in sw.stages), *sw.stages]
        fresh, why = fresh_rows(sw)
        python = os.path.relpath(sys.executable)  # this interpreter, the venv's (make's .venv/bin/python)
        python = sys.executable if python.startswith("..") else python

        def command(stage: str, overrides: list[str]) -> str:
            return shlex.join(stages.command(stage, sw.experiment, overrides, python))

        lines += [f"best trial: #{best.number} {sw.metric}={graded(sw, best)} params {decoded(sw.space, best.params)}",
                  f"  optimistic: this figure is the one that selected it, the best of {len(complete)} complete trials "
                  f"on the same held-out rows (the pruner read them too); an interval that overlaps another trial's "
                  f"does not tell the two apart",
                  f"  grade it on rows the selection never read ({why}): "
                  + " && ".join(command(s, args + fresh) for s in regrade),
                  f"  run record: {best.user_attrs.get('run_dir')}",
                  f"  config: {Path(best.user_attrs.get('run_dir', '.')) / 'config.yaml'}",
                  "  reproduce: " + " && ".join(command(s, args) for s in sw.stages), ""]
    else:
        spent = c["done"] >= sw.n_trials
        lines += [f"best trial: none (no trial completed{'' if spent else ' yet'})", ""]
    keys = list(sw.space)
    lines += ["| trial | state | " + " | ".join(keys) + " | value (n, 95% interval) | reason |",
              "|---|---|" + "---|" * len(keys) + "---|---|"]
    rerun_as = {t.user_attrs["requeue_of"]: t.number for t in trials
                if "requeue_of" in t.user_attrs and t.state != TrialState.WAITING}  # interrupted -> its rerun
    for t in trials:
        value = "" if t.value is None else graded(sw, t)
        reason = t.user_attrs.get("reason", "")
        if t.user_attrs.get("interrupted") and t.number in rerun_as:
            reason = f"interrupted (Ctrl-C); rerun as trial {rerun_as[t.number]}"
        if "requeue_of" in t.user_attrs and t.state != TrialState.WAITING:
            folder = t.user_attrs.get("folder")  # a dead worker's retry ran in its own (objective)
            reason = (reason + "; " if reason else "") + f"rerun of interrupted trial {t.user_attrs['requeue_of']}" + (
                f" in its folder, trials/{folder}" if folder is not None and retried_number(t) is None else "")
        retry = retried_number(t)
        if retry is not None:
            reason = (reason + "; " if reason else "") + f"retry of trial {retry}"
        if t.state == TrialState.FAIL and not reason:
            reason = "worker stopped sending heartbeats (died?)"
        params = t.params or t.system_attrs.get("fixed_params", {})  # a queued trial's are fixed, not yet drawn
        if t.state == TrialState.WAITING and "requeue_of" in t.user_attrs:
            reason = f"queued again: trial {t.user_attrs['requeue_of']}'s parameters, run first when the sweep is rerun"
        cells = [f"{params[k]:.4g}" if isinstance(params.get(k), float) else str(params.get(k, "")) for k in keys]
        lines.append(f"| {t.number} | {t.state.name} | " + " | ".join(cells) +
                     f" | {value} | {cut(reason.replace('|', '/'), 300)} |")
    if len(keys) == 1:  # a share of the objective's variance: one parameter has it all, whatever the trials say
        lines += ["", f"parameter importances: none to rank ({keys[0]} is the one parameter swept; the table and the "
                      f"slice plot show how the objective moves with it)", ""]
    else:
        imp = importances(study)
        lines += ["", f"parameter importances (from {len(complete)} complete trials; in brackets, the 95% range over "
                      f"{RESAMPLES} bootstrap resamples of them): "
                  + (", ".join(f"{k} {v:.2f} [{lo:.2f}-{hi:.2f}]" for k, (v, lo, hi) in imp.items())
                     if isinstance(imp, dict) else imp), ""]
    sw.dir.mkdir(parents=True, exist_ok=True)
    if complete:
        n = len(keys)
        plots = {"optimization history": _plot(vis.plot_optimization_history, study, sw.dir / "history.png", (9, 5)),
                 "parallel coordinates": _plot(vis.plot_parallel_coordinate, study, sw.dir / "parallel.png",
                                               (3 * n + 5, 5)),
                 "slice": _plot(vis.plot_slice, study, sw.dir / "slice.png", (5 * n + 2, 5))}
        lines += [f"plot, {k}: {v}" for k, v in plots.items()]
    text = sw.redact("\n".join(lines) + "\n")  # trial reasons quote the stages' output
    (sw.dir / "report.md").write_text(text)
    return text


# -------------------------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlhf.sweeps",
                                 description="Optuna / W&B sweeps over an experiment's config")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("run", "run (or resume) the Optuna study"), ("worker", "one worker process (used by run)"),
                        ("report", "best trial, all trials, importances and plots"),
                        ("wandb", "W&B sweep from the same file (offline without an account)"),
                        ("wandb-agent", "the program a W&B agent runs: one trial with key=value parameters")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("sweep")
        if name != "wandb-agent":
            p.add_argument("args", nargs="*", metavar="key=value",
                           help="the sweep file's keys, e.g. n_trials=2 sampler.seed=1 (make ... ARGS='...')")
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
            p.add_argument("--set", dest="args", action="append", default=[], metavar="key=value",
                           help="a sweep file's key as `make wandb-sweep ARGS=...` set it (the agent's command)")
    args = ap.parse_args(argv)
    try:
        sw = load(args.sweep, storage=args.storage or None, results_dir=args.results_dir,
                  args=getattr(args, "args", []))
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
            flat = config.flatten(given)
            unknown = set(flat) - set(sw.space)
            if unknown:
                raise SweepError(f"{sw.path}: wandb-agent: parameters {sorted(unknown)} are not in the space")
            check_upstream(sw)
            return 0 if wandb_trial(sw, flat or None) is not None else 1
    except config.ConfigError as e:  # a SweepError too
        print(f"error: {scrub(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a worker process on Ctrl-C (run(), its parent, says so) or Ctrl-C before the study
        return 130
    except Exception as e:  # noqa: BLE001 - a full disk or a read-only results directory is one line too
        fault = faults.fault_of(e)
        if fault is None:
            raise
        print(f"error: {scrub(str(fault))}. {fault.remedy()} and rerun the same command", file=sys.stderr)
        return 2
    return 0

