"""Sweeps (rlhf.sweeps): validation of sweep files, the memory preflight, the W&B translation, and on the tiny
experiment a study that survives a SIGKILL and resumes, two workers sharing a PostgreSQL study with a killed worker's
trial retried by the other, and a W&B offline trial."""

import contextlib
import datetime
import glob
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from rlhf.maths import guard
from rlhf.runs import lineage
from rlhf.sweeps import sweep
from rlhf.sweeps import trial as trial_mod

from .conftest import ROOT, TINY, make, real_process_env

# a short SFT (a few seconds of training; most of a trial is the stage process importing torch and TRL)
SFT_TRIAL = ["sft.max_steps=4", "sft.eval_steps=2", "sft.logging_steps=2", "sft.batch_size=16",
             "data.sft_examples=64", "data.eval_examples=16", "memory.track_tensors=false"]


QUICK = {"interval": 1, "grace": 2, "max_retry": 1}  # for a test whose trials take no time: nothing beats late


def write_sweep(tmp_path: Path, name: str = "s", **fields) -> Path:
    data = {"experiment": str(TINY), "stage": "sft",
            "objective": {"metric": "metrics.eval_loss", "direction": "minimize", "intermediate": "eval_loss"},
            "space": {"sft.learning_rate": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True},
                      "lora.r": {"type": "categorical", "choices": [4, 8]}},
            "overrides": SFT_TRIAL, "n_trials": 2, "results_dir": str(tmp_path / "results"),
            # grace: a running trial's heartbeat reached 2.2-2.4 s of age (its 1 s interval included) beside busy
            # processes on two cores (studies/heartbeat_lag.py); a live trial failed as stale leaves its worker
            # going on, but breaks the killed-sweep test's trial count
            "heartbeat": {"interval": 1, "grace": 4, "max_retry": 1}, **fields}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in data.items() if v is not None}, sort_keys=False))
    return path


def load_study(sw):
    return optuna.load_study(study_name=sw.name, storage=sweep.storage(sw))  # waits on a busy SQLite file


def run_records(sw) -> list[dict]:
    return [json.loads(Path(p).read_text()) for p in glob.glob(str(sw.dir / "trials" / "*" / "*" / "*" / "*" /
                                                                   "summary.json"))]


# ------------------------------------------------------------------------------------------------------ validation
def test_shipped_sweep_files_load():
    files = sorted((ROOT / "sweeps").glob("*.yaml"))
    names = {f.stem for f in files}
    assert {"dpo-beta-lr", "lora-rank", "llama2-7b-dpo-beta-lr", "llama2-7b-lora-rank"} <= names
    for f in files:
        sw = sweep.load(f)
        assert sw.storage == f"sqlite:///results/sweeps/{f.stem}.db"
        assert sw.metric == "metrics.eval_rewards_accuracies" and sw.stages[-1] == "dpo"
    assert sweep.load(ROOT / "sweeps" / "lora-rank.yaml").stages == ["sft", "dpo"]  # the rank is set by SFT


@pytest.mark.parametrize("fields, key, message", [
    ({"space": {"lora.rank": {"type": "categorical", "choices": [4, 8]}}}, "space.lora.rank",
     "unknown key 'lora.rank' (valid: r, alpha"),
    ({"space": {"dpo.betta": {"type": "float", "low": 0.05, "high": 0.5}}}, "space.dpo.betta",
     "space.dpo.betta: unknown key 'dpo.betta' (did you mean 'dpo.beta'?). Use a config key (documented in "
     "rlhf/experiment/sections.py)"),  # not "override dpo.betta=0.05" (no override was written)
    ({"space": {"dpo.beta": {"type": "float", "low": 0.5, "high": 0.05}}}, "space.dpo.beta", "must be below high"),
    ({"space": {"dpo.beta": {"type": "float", "low": 0, "high": 0.5, "log": True}}}, "space.dpo.beta.low",
     "log range needs low > 0"),
    ({"space": {"dpo.beta": {"type": "normal", "low": 0, "high": 1}}}, "space.dpo.beta.type", "unknown type"),
    ({"space": {"lora.r": {"type": "categorical", "choices": ["four"]}}}, "space.lora.r", "expected int"),
    ({"space": {"sft.learning_rate": {"type": "float", "low": -1e-3, "high": 1e-2}}}, "space.sft.learning_rate",
     "space.sft.learning_rate: its value -0.001: sft.learning_rate must be above 0, got -0.001. The space's values "
     "must be ones the config accepts"),
    ({"space": {"sft.max_steps": {"type": "int", "low": 2, "high": 4}}}, "space.sft.max_steps",
     "also in overrides, where every trial's value would be the space's draw"),
    ({"objective": {"direction": "maximize"}}, "objective.metric", "dotted path"),
    ({"objective": {"metric": "metrics.eval_loss", "direction": "down"}}, "objective.direction", "not maximize"),
    ({"pruner": {"type": "median"}, "objective": {"metric": "metrics.eval_loss"}}, "objective.intermediate",
     "needs an intermediate metric"),
    ({"pruner": {"type": "asha"}}, "pruner.type", "unknown pruner"),
    ({"pruner": {"type": "median", "n_startup": 2}}, "pruner", "did you mean 'n_startup_trials'? median's options: "
                                                              "n_startup_trials, n_warmup_steps"),
    ({"stage": None, "stages": ["dpo", "sft"]}, "stages", "sft must come before dpo"),
    ({"n_trails": 3}, "n_trails", "did you mean 'n_trials'"),
    ({"heartbeat": {"interval": 5, "grace": 5}}, "heartbeat", "grace > interval"),
])
def test_a_bad_sweep_file_fails_before_any_trial_naming_file_and_key(tmp_path, fields, key, message):
    path = write_sweep(tmp_path, **fields)
    with pytest.raises(sweep.SweepError) as e:
        sweep.load(path)
    # the file, with the line that sets the key where it sets one (a misspelt key's, a bad value's)
    assert re.match(rf"{re.escape(str(path))}(:\d+)?: ", str(e.value)) and f"{key}" in str(e.value), e.value
    assert message in str(e.value), e.value
    assert not (tmp_path / "results").exists()  # no study, no trial


def test_the_cli_prints_one_error_line(tmp_path):
    path = write_sweep(tmp_path, space={"sft.lr": {"type": "float", "low": 1e-4, "high": 1e-3}})
    out = subprocess.run([sys.executable, "-m", "rlhf.sweeps", "run", str(path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith(f"error: {path}: space.sft.lr: "), out.stderr
    assert "unknown key 'sft.lr'" in out.stderr and "Traceback" not in out.stderr


def test_args_set_the_sweep_files_keys_from_make_to_every_worker(tmp_path):
    """`make sweep ARGS='n_trials=2'` reaches the sweep (it was dropped without a word): ARGS sets the sweep file's
    keys, for the report too; an experiment key there fails in one line saying where it goes."""
    path = write_sweep(tmp_path, n_trials=5)
    sw = sweep.load(path, args=["n_trials=2", "sampler.seed=7", "pruner.type=none"])
    assert (sw.n_trials, sw.sampler.seed, sw.sampler.type, sw.args) == (2, 7, "tpe", ["n_trials=2", "sampler.seed=7",
                                                                                      "pruner.type=none"])
    assert make("-n", "sweep", f"SWEEP={path}", "ARGS=n_trials=2 sampler.seed=7", "WORKERS=2").stdout.strip() \
        .splitlines()[-1].endswith(f"-m rlhf.sweeps run {path} n_trials=2 sampler.seed=7 --workers 2")
    assert make("-n", "sweep-report", f"SWEEP={path}", "ARGS=n_trials=2").stdout.strip().splitlines()[-1] \
        .endswith(f"-m rlhf.sweeps report {path} n_trials=2")
    out = subprocess.run([sys.executable, "-m", "rlhf.sweeps", "report", str(path), "dpo.epochs=1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("error: ARGS 'dpo.epochs=1': not a key=value of the sweep "
                                                         f"file {path}'s keys"), out.stderr
    assert "goes under the file's overrides:" in out.stderr and "Traceback" not in out.stderr
    with pytest.raises(sweep.SweepError, match=r"ARGS 'n_trails=2'.*did you mean 'n_trials'"):
        sweep.load(path, args=["n_trails=2"])
    with pytest.raises(sweep.SweepError, match=r"^ARGS 'n_trials=two': n_trials: expected int"):  # not the file's
        sweep.load(path, args=["n_trials=two"])
    from rlhf.experiment import config

    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace("n_trials: 5", "n_trials: five"))
    with pytest.raises(config.ConfigError, match=rf"^{bad}:\d+: n_trials: expected int"):  # the file's line
        sweep.load(bad)
    calls = []  # a second worker process is started with the same keys

    class Proc:
        def __init__(self, cmd, env):
            calls.append(cmd)

        def wait(self):
            return 0

    import unittest.mock

    with unittest.mock.patch.object(sweep.subprocess, "Popen", Proc), \
            unittest.mock.patch.object(sweep, "_none_completed", lambda sw, study: 0):
        assert sweep.run(sw, workers=2) == 0
    assert all(c[3:8] == ["worker", str(path), *sw.args] for c in calls) and len(calls) == 2, calls


def test_an_unswept_upstream_stage_must_exist(tmp_path):
    path = write_sweep(tmp_path, stage="dpo", upstream=str(tmp_path / "nothing"),
                       objective={"metric": "metrics.eval_rewards_accuracies"},
                       space={"dpo.beta": {"type": "float", "low": 0.05, "high": 0.5, "log": True}})
    with pytest.raises(sweep.SweepError, match=r"dpo needs a finished sft run .*`make sft EXP="):
        sweep.run(sweep.load(path))
    assert not (tmp_path / "results" / "sweeps").exists()


def fake_sft_run(upstream: Path) -> Path:
    """A finished SFT run record of the tiny experiment under `upstream`, at its default data settings: the rows it
    trained on (inputs.train_ids) as `make sft` records them."""
    from rlhf.experiment import config
    from rlhf.inputs import data

    train, _, _ = data.load_sft(config.load(str(TINY), []))
    run = upstream / "tiny" / "sft" / "run1"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"inputs": {"train_ids": [r["id"] for r in train]}}))
    (run.parent / "latest").write_text("run1\n")
    return run


def test_a_held_out_split_the_linked_sft_run_trained_on_is_refused(tmp_path):
    """Other data settings than the SFT run's (the old dpo-beta-lr.yaml's data.eval_examples=100, pref_pairs=1000)
    reshuffle the pool: most of DPO's held-out pairs, which grade the trial, are rows SFT trained on. The sweep refuses
    to start, the stage itself refuses too (a data.* key in the space, or `make dpo ARGS=...`), and the shipped file
    passes."""
    from rlhf.experiment import config
    from rlhf.runs import records, runtime

    upstream = tmp_path / "up"
    sft_run = fake_sft_run(upstream)
    space = {"dpo.beta": {"type": "float", "low": 0.05, "high": 0.5, "log": True}}
    leaky = ["dpo.epochs=1", "data.pref_pairs=1000", "data.eval_examples=100"]
    path = write_sweep(tmp_path, stage="dpo", upstream=str(upstream), overrides=leaky, space=space,
                       objective={"metric": "metrics.eval_rewards_accuracies"})
    with pytest.raises(sweep.SweepError, match=rf"^{path}: overrides: dpo: [1-9]\d* of its 100 held-out rows are rows "
                                               rf"the SFT run {sft_run} trained on .*stages: \[sft, dpo\]"):
        sweep.run(sweep.load(path))
    assert not (tmp_path / "results" / "sweeps").exists()  # no study, no trial
    exp = config.load(str(TINY), leaky + [f"results_dir={upstream}"])
    with pytest.raises(records.StageInputError, match=r"^dpo: [1-9]\d* of its 100 held-out rows are rows the SFT run"):
        runtime.preference_plan(exp, "dpo")  # before any adapter or tokenizer is read
    shipped = sweep.load(ROOT / "sweeps" / "dpo-beta-lr.yaml")
    shipped.upstream = str(upstream)
    sweep.check_held_out(shipped)  # the SFT run's own split: nothing to refuse


def test_a_trial_from_the_sft_run_links_the_reward_model_run_its_check_reads(tmp_path):
    """A DPO trial's held-out check scores with the latest RM run, as `make dpo` does: linked beside the SFT run
    (it said "there is no reward model run yet" with results/tiny/rm there); not when the trial trains its own SFT
    (that RM came from another adapter), nor when there is none."""
    upstream = tmp_path / "up"
    fake_sft_run(upstream)
    space = {"dpo.beta": {"type": "float", "low": 0.05, "high": 0.5, "log": True}}
    objective = {"metric": "metrics.eval_rewards_accuracies"}
    sw = sweep.load(write_sweep(tmp_path, stage="dpo", upstream=str(upstream), space=space, overrides=[],
                                objective=objective))
    trial_mod._link_upstream(sw, tmp_path / "t0")
    assert [p.name for p in (tmp_path / "t0" / "tiny").iterdir()] == ["sft"]  # no RM run to link
    (upstream / "tiny" / "rm" / "run1").mkdir(parents=True)
    (upstream / "tiny" / "rm" / "latest").write_text("run1\n")
    trial_mod._link_upstream(sw, tmp_path / "t1")
    assert (tmp_path / "t1" / "tiny" / "rm").resolve() == (upstream / "tiny" / "rm").resolve()
    both = sweep.load(write_sweep(tmp_path, stage=None, stages=["sft", "dpo"], upstream=str(upstream), space=space,
                                  overrides=[], objective=objective))
    trial_mod._link_upstream(both, tmp_path / "t2")
    assert not (tmp_path / "t2" / "tiny").exists()


def test_grpo_and_rloo_sweep_over_their_keys_and_need_the_rm_only_when_it_scores(tmp_path):
    """The sweep file reads the stage registry: GRPO's keys load, its RM is upstream only with reward.model > 0."""
    space = {"grpo.beta": {"type": "float", "low": 0.01, "high": 0.1, "log": True},
             "grpo.num_generations": {"type": "categorical", "choices": [4, 8]}}
    objective = {"metric": "metrics.eval_win_rate_vs_sft", "direction": "maximize"}
    sw = sweep.load(write_sweep(tmp_path, stage="grpo", space=space, objective=objective, overrides=[]))
    assert sw.stages == ["grpo"] and sw.needs == {"grpo": ["sft", "rm"]}
    fn = ["reward.model=0", "reward.functions={rlhf.inputs.data:letters_reward: 1}"]
    sw = sweep.load(write_sweep(tmp_path, stage="rloo", overrides=fn, objective=objective, upstream=str(tmp_path / "x"),
                                space={"rloo.learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3}}))
    assert sw.needs == {"rloo": ["sft"]}
    with pytest.raises(sweep.SweepError, match=r"rloo needs a finished sft run"):
        sweep.run(sw)
    with pytest.raises(sweep.SweepError, match="did you mean 'grpo.beta'"):
        sweep.load(write_sweep(tmp_path, stage="grpo", objective=objective,
                               space={"grpo.betta": {"type": "float", "low": 0.01, "high": 0.1}}))


def test_kto_sweeps_over_its_keys_from_the_sft_run(tmp_path):
    """KTO's keys load as a sweep's space (as DPO's do), its intermediate metric is the trainer's held-out margin,
    and it needs the SFT run alone, refused by name when there is none."""
    space = {"kto.beta": {"type": "float", "low": 0.05, "high": 0.5, "log": True},
             "kto.undesirable_weight": {"type": "float", "low": 0.5, "high": 1.5}}
    objective = {"metric": "metrics.eval_win_rate_vs_sft", "direction": "maximize",
                 "intermediate": "eval_rewards/margins"}
    sw = sweep.load(write_sweep(tmp_path, stage="kto", space=space, objective=objective, overrides=["kto.eval_steps=20"],
                                upstream=str(tmp_path / "x")))
    assert sw.stages == ["kto"] and sw.needs == {"kto": ["sft"]} and sw.intermediate == "eval_rewards/margins"
    with pytest.raises(sweep.SweepError, match=r"kto needs a finished sft run"):
        sweep.run(sw)
    with pytest.raises(sweep.SweepError, match="did you mean 'kto.beta'"):
        sweep.load(write_sweep(tmp_path, stage="kto", objective=objective,
                               space={"kto.betta": {"type": "float", "low": 0.01, "high": 0.1}}))


# -------------------------------------------------------------------------------------------------------- memory
def test_a_trial_over_the_memory_budget_is_pruned_without_loading_a_model(tmp_path, monkeypatch):
    path = write_sweep(tmp_path, n_trials=2, space={
        "memory.budget_gb": {"type": "categorical", "choices": [0.0001]},  # any tiny stage is predicted over it
        "model.hidden_size": {"type": "categorical", "choices": [64, 128]}})
    sw = sweep.load(path)

    def no_process(*args, **kwargs):
        raise AssertionError(f"a stage process was started: {args}")

    monkeypatch.setattr(sweep.subprocess, "Popen", no_process)
    sweep.run(sw)
    trials = load_study(sw).trials
    assert [t.state for t in trials] == [TrialState.PRUNED, TrialState.PRUNED]
    for t in trials:
        reason = t.user_attrs["reason"]
        assert reason.startswith("memory preflight: sft: predicted peak") and "memory.budget_gb=0.0001" in reason
    assert not (sw.dir / "trials").exists()  # no run directory: nothing was launched or loaded
    report = sweep.report(sw)
    assert "best trial: none" in report and "| 0 | PRUNED |" in report and "memory preflight" in report


def test_the_report_grades_each_trial_with_n_and_interval_and_list_choices_work(tmp_path, monkeypatch):
    """Three trials complete on 64 held-out pairs, the fourth is stopped by Ctrl-C. The report gives each value its n
    and its run's own 95% interval (not one recomputed from value x n: here TRL's mean of two batches, 60 and 4 pairs,
    is much wider than Wilson's of k in 64), says the best one's figure selected it (optimistic) and how to grade it
    afresh, shows the queued retry with the parameters it will run, and counts the trials the importances come from. A list-valued
    categorical (dpo.loss_weights) draws without Optuna's warning, ranks, plots, and its reproduce line is one shell
    word that loads."""
    from rlhf.experiment import config

    upstream = tmp_path / "up"
    fake_sft_run(upstream)
    choices = [[1.0, 0.5], [1.0, 1.0]]
    space = {"dpo.beta": {"type": "float", "low": 0.05, "high": 0.5, "log": True},
             "dpo.loss_weights": {"type": "categorical", "choices": choices}}
    sw = sweep.load(write_sweep(tmp_path, name="graded", stage="dpo", upstream=str(upstream), space=space,
                                overrides=["dpo.epochs=1"], n_trials=5,
                                objective={"metric": "metrics.eval_rewards_accuracies", "direction": "maximize"}))
    values, drawn = [0.765625, 0.8125, 0.78125], []

    def fake_trial(sw_, params, tag, trial=None, proven=False, folder=None):
        drawn.append(params)
        if len(drawn) > len(values):
            raise KeyboardInterrupt
        run_dir, value = tmp_path / "runs" / str(tag), values[len(drawn) - 1]
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({  # TRL's mean of 2 batches, of 60 and 4 rows
            "metrics": {"eval_rewards_accuracies_ci95": guard.batch_mean_wilson(value, 64, 60),
                        "eval_rewards_accuracies_n_effective": guard.batch_mean_n(64, 60)},
            "lineage": {"data_sizes": {"train": 2000, "eval": 64}}}))
        return value, run_dir

    monkeypatch.setattr(sweep, "run_trial", fake_trial)
    with warnings_recorded() as caught:
        assert sweep.run(sw) == 130
    assert not [w for w in caught if "Choices for a categorical" in str(w.message)]
    assert all(p["dpo.loss_weights"] in choices for p in drawn)  # the stages get the lists, not their JSON text
    text = sweep.report(sw)
    lo, hi = guard.batch_mean_wilson(0.8125, 64, 60)  # the run's own interval, not Wilson's of 52 in 64, and the
    # effective n it is at beside the rows' n (its width read as a bug at n=64)
    assert guard.batch_mean_n(64, 60) == 15
    assert f"best trial: #1 metrics.eval_rewards_accuracies=0.8125 (n=64, effective 15, 95% {lo:.2f}-{hi:.2f})" in text
    assert "optimistic: this figure is the one that selected it, the best of 3 complete trials" in text
    for t, v in zip(range(3), values):
        lo, hi = guard.batch_mean_wilson(v, 64, 60)
        assert f" | {v:.6g} (n=64, effective 15, 95% {lo:.2f}-{hi:.2f}) |" in text.split(f"\n| {t} | COMPLETE |", 1)[1].split("\n")[0]
    fresh = next(line for line in text.splitlines() if line.startswith("  grade it on rows the selection never read"))
    assert f" -m rlhf sft --exp {TINY} " in fresh and f"seed=1 results_dir={sw.dir / 'regrade'} && " in fresh
    # with a held-out file, another seed reads the same rows: the report asks for another file instead
    held = sweep.load(write_sweep(tmp_path, name="held", stage="dpo", upstream=str(upstream), space=space,
                                  overrides=["data.eval_path=mine/eval.jsonl"]))
    assert sweep.fresh_rows(held) == (
        ["data.eval_path=OTHER_EVAL.jsonl", f"results_dir={held.dir / 'regrade'}"],
        "the held-out rows are data.eval_path's (mine/eval.jsonl) whatever the seed: replace OTHER_EVAL.jsonl with "
        "another held-out file; its stages are retrained")
    reproduce = next(line for line in text.splitlines() if line.startswith("  reproduce: "))
    words = shlex.split(reproduce.split(": ", 1)[1])
    assert os.path.samefile(words[0], sys.executable) and words[1:5] == ["-m", "rlhf", "dpo", "--exp"]  # the venv's
    # .venv/bin/python, as make runs it (a bare `python` may lack the libraries); absolute for a venv elsewhere
    assert not os.path.isabs(words[0]) or os.path.relpath(sys.executable).startswith("..")
    assert config.load(words[5], words[6:]).dpo.loss_weights == drawn[1]["dpo.loss_weights"]
    queued = next(line for line in text.splitlines() if line.startswith("| 4 | WAITING |"))
    weights = json.dumps(drawn[3]["dpo.loss_weights"])
    assert f"| {weights} |" in queued and "queued again: trial 3's parameters" in queued
    assert "parameter importances (from 3 complete trials; in brackets, the 95% range over 50 bootstrap resamples of " \
           "them): dpo." in text and "unhashable" not in text
    # one parameter swept: its importance is 1 whatever the trials say (it read as a certain 1.00 [1.00-1.00])
    one = sweep.load(write_sweep(tmp_path, name="one", stage="dpo", upstream=str(upstream),
                                 space={"dpo.beta": space["dpo.beta"]}, objective={"metric": "metrics.eval_loss"}))
    study = sweep.open_study(one)
    for value in (0.5, 0.4, 0.45):
        t = study.ask()
        t.suggest_float("dpo.beta", 0.05, 0.5, log=True)
        study.tell(t, value)
    said = sweep.report(one)
    assert "parameter importances: none to rank (dpo.beta is the one parameter swept;" in said
    assert "1.00 [1.00-1.00]" not in said
    assert f"plot, parallel coordinates: {sw.dir / 'parallel.png'}" in text


def test_importances_carry_their_range_over_resampled_trials():
    """x decides the objective and y barely moves it (100:1): over 100 trials x ranks first with a range wholly above
    y's; over 10 the evaluator (PED-ANOVA here: no scikit-learn) may rank them either way, and the ranges overlap, so
    the report shows nothing ranked. One complete trial ranks nothing."""
    import optuna

    from rlhf.sweeps import sweep

    def study(n: int):
        s = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
        s.optimize(lambda t: 10 * t.suggest_float("x", 0, 1) + 0.1 * t.suggest_float("y", 0, 1), n_trials=n)
        return s

    many, few = sweep.importances(study(100)), sweep.importances(study(10))
    assert list(many) == ["x", "y"] and many["x"][0] > 0.9 and many["x"][1] > many["y"][2], many
    assert few["x"][1] < few["y"][2] and few["y"][1] < few["x"][2], few
    assert all(lo <= hi for _, lo, hi in [*many.values(), *few.values()])
    assert sweep.importances(study(100)) == many  # fixed seeds: the same report twice
    assert sweep.importances(study(1)) == "needs at least 2 complete trials"


@contextlib.contextmanager
def warnings_recorded():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


@pytest.mark.slow
def test_ctrl_c_stops_the_sweep_in_one_line_and_the_rerun_resumes_the_interrupted_trial(tmp_path, monkeypatch, capsys):
    """Ctrl-C during a trial's second stage (SFT, then DPO), as a terminal sends it (to the command's process group):
    the stage saves a checkpoint and stops, the worker waits for it, and the command exits 130 with one line; the
    trial failed but uncounted, its parameters queued. The rerun runs them first, in the interrupted trial's folder,
    where the finished SFT is taken (--reuse) and DPO resumes from its checkpoint (it ran from scratch in a new folder,
    leaving the old one), and the study ends at n_trials."""
    dpo = ["data.pref_pairs=120", "eval.prompts=8", "dpo.max_steps=40", "dpo.save_steps=4", "dpo.batch_size=8",
           "dpo.eval_steps=20"]  # long enough for a Ctrl-C to land between checkpoints
    sw = sweep.load(write_sweep(tmp_path, name="ctrlc", n_trials=1, stage=None, stages=["sft", "dpo"],
                                space={"dpo.beta": {"type": "float", "low": 0.05, "high": 0.5, "log": True}},
                                objective={"metric": "metrics.eval_rewards_accuracies", "direction": "maximize",
                                           "intermediate": "eval_rewards/accuracies"},
                                overrides=[*SFT_TRIAL, *dpo]))
    proc = subprocess.Popen([sys.executable, "-m", "rlhf.sweeps", "run", sw.path], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stage_root = sw.trial_dir(0) / sw.exp_name / "dpo"
    deadline = time.time() + 240
    while (time.time() < deadline and proc.poll() is None
           and not list(stage_root.glob("*/checkpoints/checkpoint-*/rlhf_state.json"))):  # a first checkpoint
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "[ctrlc] interrupted: rerun the same command to resume" in err, out + err
    assert "[ctrlc] trial 0: waiting for its dpo stage to save a checkpoint" in err and "Traceback" not in err, err
    for stage in ("sft", "dpo"):  # each stage said as it starts, with the log to follow (hours of silence at 7B)
        assert f"[ctrlc] trial 0: {stage} running (its log: {sw.trial_dir(0) / f'{stage}.log'})\n" in out, out
    first, queued = load_study(sw).trials
    assert first.state == TrialState.FAIL and first.user_attrs["interrupted"] and queued.state == TrialState.WAITING
    assert queued.system_attrs["fixed_params"] == first.params and sweep.counts(load_study(sw))["done"] == 0
    (run_dir,) = [d for d in stage_root.iterdir() if d.is_dir()]
    _, step = lineage.latest_checkpoint(run_dir)  # the stage's own, on the signal: the worker waited for it
    assert 4 <= step < 40 and not (run_dir / "summary.json").exists(), step
    assert f"stopped: dpo stopped at step {step} with a checkpoint in " in (sw.trial_dir(0) / "dpo.log").read_text()
    # a stage that stopped on the signal itself (exit 130 or 143, its checkpoint saved) interrupts the trial the same way
    for status in (130, 143):
        monkeypatch.setattr(trial_mod.stages, "command", lambda *a, s=status: [sys.executable, "-c", f"exit({s})"])
        with pytest.raises(KeyboardInterrupt):
            trial_mod.run_stage(sw, "sft", [], tmp_path, 0)
    monkeypatch.undo()
    assert sweep.run(sw) == 0
    trials = load_study(sw).trials
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.COMPLETE] and trials[1].params == first.params
    assert "reusing " in (sw.trial_dir(0) / "sft.log").read_text()  # the rerun took the finished SFT
    assert len([d for d in (sw.trial_dir(0) / sw.exp_name / "sft").iterdir() if d.is_dir()]) == 1
    summary = json.loads((Path(trials[1].user_attrs["run_dir"]) / "summary.json").read_text())
    assert summary["run_dir"] == str(run_dir) and summary["resumed_from"]["step"] == step
    assert summary["sweep"]["trial"] == 1 and summary["metrics"]["train_steps"] == 40
    assert trials[1].user_attrs["trial_dir"] == str(sw.trial_dir(0)) and not sw.trial_dir(1).exists()
    # the report says where the interrupted trial went (it said "queued to run again" after its rerun had run)
    rows = {line.split(" | ")[0]: line for line in sweep.report(sw).splitlines() if line.startswith("| ")}
    assert "interrupted (Ctrl-C); rerun as trial 1 |" in rows["| 0"]
    assert "rerun of interrupted trial 0 in its folder, trials/0 |" in rows["| 1"]
    capsys.readouterr()
    assert sweep.run(sw) == 0  # nothing left: said, with what to change
    assert "nothing left to run: 1 trials done of n_trials=1; raise n_trials" in capsys.readouterr().out


@pytest.mark.parametrize("twice", [False, True])
def test_ctrl_c_to_a_sweep_of_several_workers_ends_after_they_do(tmp_path, monkeypatch, capsys, twice):
    """WORKERS=2 and Ctrl-C: the command waits for its workers (the signal reached them too: each waits for its
    stage's checkpoint, queues its trial again and ends) before it returns 130, so a rerun typed at once cannot race
    their writes; a worker still there after STOP_WAIT_S is killed. A second Ctrl-C (the workers then stop their
    stages at once) leaves them QUEUE_WAIT_S to queue their trials (it killed them at once: their trials were lost to
    the heartbeat's retry, from scratch). (The workers outlived the command by about 2 s.)"""
    sw = sweep.load(write_sweep(tmp_path, name="two"))
    seen = []

    class Worker:
        def __init__(self, cmd, env):
            self.index, self.code, self.presses = cmd[-1], None, 0

        def poll(self):
            return self.code

        def wait(self, timeout=None):
            if self.code is not None:
                return self.code
            if timeout is None:
                raise KeyboardInterrupt  # the Ctrl-C, as the command waits on its first worker
            seen.append((self.index, round(timeout)))
            if self.index == "0":
                self.code = 130
                return 130
            if twice and not self.presses:
                self.presses += 1
                raise KeyboardInterrupt  # the second Ctrl-C
            raise subprocess.TimeoutExpired("worker", timeout)

        def kill(self):
            seen.append((self.index, "killed"))
            self.code = -9

    monkeypatch.setattr(sweep.subprocess, "Popen", Worker)
    assert sweep.run(sw, workers=2) == 130
    last = [("1", sweep.QUEUE_WAIT_S)] if twice else []
    assert seen == [("0", sweep.STOP_WAIT_S), ("1", sweep.STOP_WAIT_S), *last, ("1", "killed")]
    assert sweep.STOP_WAIT_S > trial_mod.STAGE_STOP_S + 30  # the workers' own wait for their stages fits in it
    assert "[two] interrupted: rerun the same command to resume" in capsys.readouterr().err


def test_an_interrupted_trial_whose_stage_never_stops_is_killed_after_stage_stop_s(tmp_path, monkeypatch, capsys):
    """Ctrl-C in a worker whose stage did not get it (or cannot stop): the worker says it waits, waits STAGE_STOP_S
    for the stage's checkpoint, then kills it, and the trial is interrupted (KeyboardInterrupt)."""
    sw = sweep.load(write_sweep(tmp_path, name="stuck"))
    stuck = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('started', flush=True); " \
            "time.sleep(120)"
    monkeypatch.setattr(trial_mod.stages, "command", lambda *a: [sys.executable, "-c", stuck])
    monkeypatch.setattr(trial_mod, "STAGE_STOP_S", 1)

    def ctrl_c(_seconds):  # the Ctrl-C lands while the worker polls its stage
        raise KeyboardInterrupt

    monkeypatch.setattr(trial_mod, "time", type("T", (), {"time": time.time, "sleep": ctrl_c}))
    t0 = time.time()
    with pytest.raises(KeyboardInterrupt):
        trial_mod.run_stage(sw, "sft", [], tmp_path, 3)
    assert 1 <= time.time() - t0 < 30
    assert "[stuck] trial 3: waiting for its sft stage to save a checkpoint and stop (up to 1 s" in \
        capsys.readouterr().err


def test_a_rerun_in_an_interrupted_folder_reads_only_its_own_attempt(tmp_path):
    """A stage rerun in an interrupted trial's folder: its failure is said from this attempt's lines of the stage's
    log (the log is appended to: an earlier attempt's error was named), and the pruner does not read a run of it
    stopped before its first checkpoint (its steps, read first, hid the new run's)."""
    import types

    sw = sweep.load(write_sweep(tmp_path, name="again"))
    trial_dir = sw.trial_dir(0)
    old = trial_dir / sw.exp_name / "sft" / "20260101-000000-000000"
    old.mkdir(parents=True)
    (old / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval_loss": 9.5}) + "\n")  # no checkpoint
    (trial_dir / "sft.log").write_text("error: the first attempt's failure\n")
    new = trial_dir / sw.exp_name / "sft" / "20260102-000000-000000"
    writes = (f"import os, json; os.makedirs({str(new)!r}); "
              f"open({str(new / 'metrics.jsonl')!r}, 'w').write(json.dumps({{'step': 0, 'eval_loss': 1.5}}) + '\\n')")
    reports = []
    trial = types.SimpleNamespace(report=lambda v, step: reports.append((v, step)), should_prune=lambda: False)
    stage = [sys.executable, "-c", writes + "; raise SystemExit(3)"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trial_mod.stages, "command", lambda *a: stage)
        with pytest.raises(trial_mod.TrialStopped) as e:
            trial_mod.run_stage(sw, "sft", [], trial_dir, 1, trial, rerun=True)
    assert reports == [(1.5, 0)]
    assert e.value.reason == "sft: exit 3: no output"  # not the first attempt's error


def test_a_failed_stages_reason_carries_the_lines_its_error_lists(tmp_path):
    """A data file's bad records are listed under the stage's error line: a trial's reason carries the first three
    (it kept the header alone, '...; mend each and rerun:'), up to the first line that is not one of them; the
    report's cell cuts a long reason with an ellipsis."""
    from rlhf.runs.compare import cut

    log = tmp_path / "dpo.log"
    log.write_text("bars\nerror: d.jsonl: 5 bad records; mend each and rerun:\n  d.jsonl:3: malformed JSON\n"
                   "  d.jsonl:4 and 2 more like it (5, 6): field 'chosen' is empty\nafter\n  not listed\n")
    assert trial_mod._error_line(log) == ("d.jsonl: 5 bad records; mend each and rerun: d.jsonl:3: malformed JSON "
                                          "d.jsonl:4 and 2 more like it (5, 6): field 'chosen' is empty")
    assert cut("x" * 400, 300) == "x" * 299 + "\u2026" and cut("short", 300) == "short"


def test_a_trial_that_kept_no_interval_is_graded_from_its_run(tmp_path):
    """A trial completed before trials kept their run's interval is graded from its run's summary."""
    import types

    sw = sweep.load(write_sweep(tmp_path, name="old", objective={"metric": "metrics.eval_rewards_accuracies",
                                                                 "direction": "maximize"}))
    ci = guard.batch_mean_wilson(0.75, 200, 32)
    (tmp_path / "summary.json").write_text(json.dumps({"metrics": {"eval_rewards_accuracies_ci95": ci},
                                                       "lineage": {"data_sizes": {"eval": 200}}}))
    old = types.SimpleNamespace(value=0.75, user_attrs={"n": 200, "run_dir": str(tmp_path)})
    assert sweep.graded(sw, old) == f"0.75 (n=200, 95% {ci[0]:.2f}-{ci[1]:.2f})"
    kept = types.SimpleNamespace(value=0.75, user_attrs={"n": 200, "ci95": None, "run_dir": str(tmp_path)})
    assert sweep.graded(sw, kept) == "0.75 (n=200; no eval_rewards_accuracies_ci95 in its run's summary)"


def test_a_report_of_a_sweep_never_run_says_so_and_makes_no_database(tmp_path):
    sw = sweep.load(write_sweep(tmp_path, name="never"))
    with pytest.raises(sweep.SweepError, match=r"no study 'never' in sqlite:///.*Run `make sweep SWEEP="):
        sweep.report(sw)
    assert not (tmp_path / "results").exists()


def test_a_study_another_sweep_made_under_the_same_name_is_refused(tmp_path):
    """Two sweep files with one name and storage: the second's trials would join a study of another objective or space
    (its report then picks a best trial by the wrong metric); it is refused, naming what differs."""
    first = sweep.load(write_sweep(tmp_path, name="s"))
    study = sweep.open_study(first)
    study.tell(study.ask(), state=TrialState.FAIL)  # a trial that counts (one the file's objective failed would not)
    assert sweep.open_study(sweep.load(write_sweep(tmp_path, name="s"))).user_attrs["sweep"]["metric"] == \
        "metrics.eval_loss"  # the same file again: reopened
    other = write_sweep(tmp_path, name="s", objective={"metric": "metrics.eval_mean_token_accuracy",
                                                        "direction": "maximize"})
    with pytest.raises(sweep.SweepError, match=r"study 's' in .* was made by another sweep \(its metric "
                                               r"metrics.eval_loss, here metrics.eval_mean_token_accuracy; direction "
                                               r"minimize, here maximize\)"):
        sweep.open_study(sweep.load(other))
    with pytest.raises(sweep.SweepError, match="was made by another sweep"):  # nor reported as this one's
        sweep.report(sweep.load(other))


def test_a_study_whose_experiment_or_upstream_run_changed_since_its_first_trial_is_refused(tmp_path):
    """A DPO sweep's trials start from the SFT run `latest` names: a `make sft` between two sweep commands moved it,
    and the next trials trained from another SFT run, their gain credited to dpo.beta in the report (a new user's
    study); an edit to the experiment file did the same silently. Both are refused, naming what changed; the same
    inputs again are taken, and the report still reads the study."""
    upstream = tmp_path / "up"
    run1 = fake_sft_run(upstream)
    experiment = tmp_path / "mine.yaml"
    experiment.write_text(TINY.read_text())
    space = {"dpo.beta": {"type": "float", "low": 0.05, "high": 0.5, "log": True}}
    sw = sweep.load(write_sweep(tmp_path, stage="dpo", experiment=str(experiment), upstream=str(upstream),
                                space=space, overrides=[], objective={"metric": "metrics.eval_rewards_accuracies"}))
    study = sweep.open_study(sw)
    assert study.user_attrs["inputs"]["upstream_runs"] == {"sft": {"run": str(run1.resolve()), "fingerprint": None}}
    study.tell(study.ask(), state=TrialState.FAIL)  # a trial that counts
    sweep.open_study(sw)  # nothing changed: reopened
    (run1.parent / "run2").mkdir()
    (run1.parent / "latest").write_text("run2\n")  # `make sft` with other settings
    latest = upstream / "tiny" / "sft" / "latest"
    with pytest.raises(sweep.SweepError, match=rf"trials started from other upstream runs than `latest` names now "
                                               rf"\(sft: {run1.resolve()} -> {run1.parent.resolve()}/run2\): its next "
                                               rf"trials would start from another. Point `latest` back at the run it "
                                               rf"began from \(echo run1 > {latest}\)"):
        sweep.open_study(sw)
    with pytest.raises(sweep.SweepError, match="other upstream runs"):  # checked as each trial starts, too
        sweep.objective(sw)(study.ask())
    assert "# Sweep s" in sweep.report(sw)  # what the study holds is still reported
    latest.write_text("run1\n")  # what the error says: the run it began from again
    sweep.open_study(sw)
    rm = upstream / "tiny" / "rm" / "run1"  # an RM run made since: the trials' checks would score with it
    rm.mkdir(parents=True)
    (rm.parent / "latest").write_text("run1\n")
    with pytest.raises(sweep.SweepError, match=rf"\(rm: none -> {rm.resolve()}\): .* Give this sweep its own"):
        sweep.open_study(sw)
    shutil.rmtree(rm.parent)
    # runs that record a fingerprint are the same run by it (another host's run of the same settings)
    assert sweep.same_run({"run": "/a/run1", "fingerprint": "f1"}, {"run": "/b/run7", "fingerprint": "f1"})
    assert not sweep.same_run({"run": "/a/run1", "fingerprint": "f1"}, {"run": "/a/run1", "fingerprint": "f2"})
    sweep.open_study(sw)
    experiment.write_text(TINY.read_text().replace("learning_rate: 1.0e-3", "learning_rate: 3.0e-4", 1))
    with pytest.raises(sweep.SweepError, match=r"mine.yaml changed since study 's'.s first trial \(dpo.learning_rate: "
                                               r"0.001 -> 0.0003\)"):
        sweep.open_study(sw)
    experiment.write_text(TINY.read_text().replace("budget_gb: 4", "budget_gb: 8"))
    sweep.open_study(sw)  # what no stage's fingerprint holds (memory.budget_gb) may change


def test_a_stage_over_budget_or_crashing_ends_its_trial_with_the_reason_and_the_study_goes_on(tmp_path):
    sw = sweep.load(write_sweep(tmp_path, name="bad", n_trials=2, overrides=SFT_TRIAL + ["memory.preflight=false"],
                                space={"memory.budget_gb": {"type": "categorical", "choices": [0.0001, 4.0]},
                                       "sft.adam_beta2": {"type": "categorical", "choices": [0.999, 1.5]}}))
    study = sweep.open_study(sw)
    study.enqueue_trial({"memory.budget_gb": 0.0001, "sft.adam_beta2": 0.999})  # measured over the budget
    study.enqueue_trial({"memory.budget_gb": 4.0, "sft.adam_beta2": 1.5})  # a crash: torch's AdamW refuses it
    assert sweep.run(sw) == 1  # the study went on to its n_trials, and none completed: the sweep failed
    assert "best trial: none (no trial completed)" in sweep.report(sw)
    with pytest.raises(sweep.SweepError, match="WORKERS=0: a sweep runs on at least 1 worker"):
        sweep.run(sw, 0)
    over, crash = load_study(sw).trials
    assert over.state == TrialState.PRUNED
    assert over.user_attrs["reason"].startswith("sft: exit 2: memory budget exceeded in phase")
    assert crash.state == TrialState.FAIL
    assert crash.user_attrs["reason"].startswith("sft: exit 1: ValueError: Invalid beta parameter at index 1: 1.5")
    assert run_records(sw) == []  # neither stage finished


def test_an_objective_the_file_names_wrong_stops_the_sweep_at_its_first_trial_uncounted(tmp_path, capsys):
    """`make sweep` with a metric path the summary lacks, then an intermediate key metrics.jsonl lacks: each stops the
    sweep after its first trial with one line naming the file, the key and the keys there are (every trial would
    fail alike, on a 7B an hour each); the failed trials do not count, so the mended file runs n_trials. Where the
    stage has a finished run under `upstream` (a `make sft` before the sweep), a warning says it before the first
    trial starts, with the nearest name."""
    up = tmp_path / "up" / "tiny" / "sft"
    (up / "20260101-000000-000000").mkdir(parents=True)
    (up / "20260101-000000-000000" / "summary.json").write_text(json.dumps({"metrics": {"eval_loss": 1.5}}))
    (up / "20260101-000000-000000" / "metrics.jsonl").write_text('{"step": 2, "loss": 2.0}\n'
                                                                 '{"step": 2, "eval_loss": 1.5}\n')
    (up / "latest").write_text("20260101-000000-000000")
    path = write_sweep(tmp_path, name="typo", n_trials=1, upstream=str(tmp_path / "up"),
                       objective={"metric": "metrics.eval_los", "direction": "minimize", "intermediate": "eval_loss"})
    sw = sweep.load(path)
    out = subprocess.run(["make", "sweep", f"SWEEP={path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    (warned,) = [x for x in out.stderr.splitlines() if x.startswith("warning: ")]
    assert warned == (f"warning: {path}: the latest sft run of 'tiny' ({up / '20260101-000000-000000'}): "
                      "objective.metric 'metrics.eval_los': sft's summary has no 'metrics.eval_los' (did you mean "
                      "'metrics.eval_loss'?) (metrics has: eval_loss). If the sweep's runs write the same names, its "
                      "first trial will stop the sweep on this at its end: Ctrl-C now and mend the file"), warned
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("error: ")]
    assert line.startswith(f"error: {path}: objective.metric 'metrics.eval_los': sft's summary has no "
                           "'metrics.eval_los' (did you mean 'metrics.eval_loss'?) (metrics has: ") and (
        " eval_loss, " in line), line
    (first,) = load_study(sw).trials
    assert first.state == TrialState.FAIL and first.user_attrs["sweep_file_error"]
    assert sweep.counts(load_study(sw))["done"] == 0
    assert f"its run: {first.user_attrs['trial_dir']}/tiny/sft/2" in line  # the trial's run is kept

    spec = yaml.safe_load(path.read_text())
    spec["objective"] = {"metric": "metrics.eval_loss", "direction": "minimize", "intermediate": "eval_los"}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    capsys.readouterr()
    with pytest.raises(sweep.SweepError, match=f"^{path}: objective.intermediate 'eval_los' is in none of sft's "
                                               r"metrics.jsonl lines, .* eval_loss, "):
        sweep.run(sweep.load(path))
    assert ("objective.intermediate 'eval_los' is in none of its metrics.jsonl lines (did you mean 'eval_loss'?). "
            "If the sweep's") in capsys.readouterr().err
    spec["objective"]["intermediate"] = "eval_loss"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    assert sweep.run(sweep.load(path)) == 0
    assert "warning: " not in capsys.readouterr().err  # the upstream run has both names
    study = load_study(sw)
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.FAIL, TrialState.COMPLETE]
    assert sweep.counts(study)["done"] == 1 and sorted(study.trials[2].intermediate_values) == [0, 2, 4]


def test_the_warning_before_a_first_trial_names_a_path_to_no_number_and_passes_a_diverged_one(tmp_path):
    """unseen_objective on the stage's latest run: a metric path naming a mapping is warned of, as objective_value
    would stop the sweep on it; a diverged value ("nan") is a run's, not the file's: no warning."""
    from rlhf.sweeps.trial import unseen_objective

    run = tmp_path / "up" / "tiny" / "sft" / "1"
    run.mkdir(parents=True)
    (run.parent / "latest").write_text("1")
    sw = sweep.load(write_sweep(tmp_path, upstream=str(tmp_path / "up"), objective={
        "metric": "metrics.eval", "direction": "minimize", "intermediate": "eval_loss"}))
    (run / "metrics.jsonl").write_text('{"step": 1, "eval_loss": 1.0}\n')
    (run / "summary.json").write_text(json.dumps({"metrics": {"eval": {"loss": 1.0}}}))
    assert "objective.metric 'metrics.eval' is dict (loss) in it, not a number. If" in unseen_objective(sw)
    (run / "summary.json").write_text(json.dumps({"metrics": {"eval": "nan"}}))
    assert unseen_objective(sw) is None


def test_once_a_trial_completed_an_objective_a_trial_lacks_fails_that_trial_and_a_diverged_one_always_does(tmp_path):
    """The objective's path is the file's error only while no trial has completed; after one has, a trial without it
    (its own parameters, e.g. data.judge_fraction=0 for a judge's metric) fails alone. A diverged value, written to
    summary.json as "nan" or "inf" (records), fails its trial, never the sweep."""
    from rlhf.sweeps.trial import TrialStopped, objective_value

    sw = sweep.load(write_sweep(tmp_path))  # objective: metrics.eval_loss
    assert objective_value(sw, {"metrics": {"eval_loss": 0.5}}, tmp_path) == 0.5
    for proven in (False, True):
        for value in ("nan", "inf", "-inf", None):
            with pytest.raises(TrialStopped, match="not a finite number"):
                objective_value(sw, {"metrics": {"eval_loss": value}}, tmp_path, proven)
    with pytest.raises(sweep.SweepError, match=r"sft's summary has no 'metrics.eval_loss' \(metrics has: other\)"):
        objective_value(sw, {"metrics": {"other": 1.0}}, tmp_path)
    with pytest.raises(TrialStopped, match=r"sft's summary has no 'metrics.eval_loss'") as stopped:
        objective_value(sw, {"metrics": {"other": 1.0}}, tmp_path, proven=True)
    assert stopped.value.state == "failed"
    with pytest.raises(sweep.SweepError, match=r"is not a number in sft's summary but dict \(a, b\)"):
        objective_value(sw, {"metrics": {"eval_loss": {"a": 1, "b": 2}}}, tmp_path)


# ------------------------------------------------------------------------------------------------------------- W&B
def test_the_wandb_config_has_the_same_space_and_metric():
    sw = sweep.load(ROOT / "sweeps" / "dpo-beta-lr.yaml")
    sw.space["lora.r"] = {"type": "categorical", "choices": [4, 8, 16]}
    sw.space["sft.max_steps"] = {"type": "int", "low": 10, "high": 100, "log": False}
    sw.space["sft.warmup_ratio"] = {"type": "float", "low": 0.0, "high": 0.1, "log": False, "step": 0.02}
    cfg = sweep.wandb_config(sw)
    assert cfg["method"] == "bayes"
    assert cfg["metric"] == {"name": "metrics.eval_rewards_accuracies", "goal": "maximize"}
    p = cfg["parameters"]
    assert p["dpo.beta"] == {"distribution": "log_uniform_values", "min": 0.05, "max": 0.5}
    assert p["dpo.learning_rate"] == {"distribution": "log_uniform_values", "min": 1e-4, "max": 3e-3}
    assert p["lora.r"] == {"values": [4, 8, 16]}
    assert p["sft.max_steps"] == {"distribution": "int_uniform", "min": 10, "max": 100}
    assert p["sft.warmup_ratio"] == {"distribution": "q_uniform", "min": 0.0, "max": 0.1, "q": 0.02}
    assert cfg["command"][2:5] == ["-m", "rlhf.sweeps", "wandb-agent"] and cfg["command"][-1] == "${args_no_hyphens}"
    draws = sweep.offline_draws(sw, 200)  # offline, Optuna draws the trials from the same space
    assert all(0.05 <= d["dpo.beta"] <= 0.5 and d["lora.r"] in (4, 8, 16) for d in draws)
    assert all(isinstance(d["sft.max_steps"], int) and 10 <= d["sft.max_steps"] <= 100 for d in draws)
    betas = sorted(d["dpo.beta"] for d in draws)
    assert betas[100] < 0.2  # log-uniform: the median is near sqrt(0.05 * 0.5) = 0.16, not the midpoint 0.275
    assert yaml.safe_load(yaml.safe_dump(cfg)) == cfg
    # ARGS (make wandb-sweep ARGS=...) reach each agent's trial: its command sets them as the sweep was loaded
    argued = sweep.load(ROOT / "sweeps" / "dpo-beta-lr.yaml", args=["n_trials=2", "sampler.seed=3"])
    command = sweep.wandb_config(argued)["command"]
    assert command[5:8] == [argued.path, "--set=n_trials=2", "--set=sampler.seed=3"]
    ap_args = [a for a in command[5:-1]]
    agent = sweep.load(ap_args[0], args=[a.removeprefix("--set=") for a in ap_args[1:]])
    assert (agent.n_trials, agent.args) == (2, ["n_trials=2", "sampler.seed=3"])


@pytest.mark.slow
def test_wandb_offline_runs_a_trial_from_the_translated_space(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    sw = sweep.load(write_sweep(tmp_path, name="wb"))
    done = make("wandb-sweep", f"SWEEP={sw.path}", "COUNT=1", timeout=300)  # offline: no account here
    out = done.stdout
    assert "wandb:" not in out + done.stderr  # W&B is silent; the sweep's last line names the offline runs' folder
    assert f"offline runs under {sw.dir / 'wandb'} (upload later with `wandb sync`)" in out
    cfg_path = sw.dir / "wandb-sweep.yaml"
    assert str(cfg_path) in out and yaml.safe_load(cfg_path.read_text()) == sweep.wandb_config(sw)
    (record,) = run_records(sw)
    config = yaml.safe_load((Path(record["run_dir"]) / "config.yaml").read_text())
    params = {"sft.learning_rate": config["sft"]["learning_rate"], "lora.r": config["lora"]["r"]}
    assert record["sweep"] == {"study": "wb", "trial": "wandb-0", "params": params}
    assert record["metrics"]["eval_loss"] > 0
    assert config["lora"]["r"] in (4, 8) and 1e-3 <= config["sft"]["learning_rate"] <= 1e-2
    runs = list((sw.dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    logged = runs[0].read_bytes()  # the offline run's log holds the config and the objective, by name
    assert b"metrics.eval_loss" in logged and b"sft.learning_rate" in logged and b"lora.r" in logged
    # its name says the experiment, stage, trial and swept values; its tags the experiment, stage and sweep
    name = f"tiny sft wb trial wandb-0 sft.learning_rate={params['sft.learning_rate']:.4g} lora.r={params['lora.r']}"
    assert name.encode() in logged
    assert all(tag in logged for tag in (b"experiment:tiny", b"stage:sft", b"sweep:wb", b"commit:"))
    with pytest.raises(sweep.SweepError, match=r"COUNT=0: a W&B sweep runs at least 1 trial"):  # it ran wandb.count
        sweep.wandb_sweep(sw, 0)


# --------------------------------------------------------------------------------------------- kill and resume
def test_a_trial_its_worker_never_beat_for_is_failed_and_retried(tmp_path):
    """A worker killed between creating a trial and its first heartbeat leaves it RUNNING with no heartbeat: Optuna's
    stale-trial check skips it, and a resumed sweep waited on it forever (once in make test, before the objective
    began; once in CI, after it had set its `worker` attribute, which races the heartbeat thread). After the grace
    period, timed on this worker's clock, each is failed and a copy queued, whatever the local time its own host
    wrote as its start (a host 5 hours ahead or behind, on a shared PostgreSQL study); a trial with a heartbeat is
    left to Optuna's check."""
    import sqlalchemy

    sw = sweep.load(write_sweep(tmp_path, name="unstarted", n_trials=5, heartbeat=QUICK))
    study = sweep.open_study(sw)
    # RUNNING, as optimize() leaves them before the objective runs; asked outside optimize(), as no worker does,
    # which Optuna notes for a storage with heartbeats
    with pytest.warns(UserWarning, match="Heartbeat of storage is supposed to be used with Study.optimize"):
        orphan, begun, ahead, behind, beating = (study.ask() for _ in range(5))
    begun.set_user_attr("worker", "host:1")  # the objective's first write landed, the heartbeat's never did
    study._storage.record_heartbeat(beating._trial_id)
    with sqlalchemy.create_engine(sw.storage).begin() as conn:  # started by hosts in other time zones
        for t, hours in ((ahead, 5), (behind, -5)):
            conn.execute(sqlalchemy.text("UPDATE trials SET datetime_start = datetime(datetime_start, :h) "
                                         "WHERE trial_id = :id"), {"h": f"{hours:+d} hours", "id": t._trial_id})
    assert {t.number: t.datetime_start for t in load_study(sw).trials}[behind.number] < \
        datetime.datetime.now() - datetime.timedelta(hours=4)
    seen = {}
    assert sweep.fail_unstarted_trials(study, sw.heartbeat.grace, seen) == []  # within the grace period
    time.sleep(sw.heartbeat.grace + 0.5)
    assert sweep.fail_unstarted_trials(study, sw.heartbeat.grace, seen) == [t.number for t in (orphan, begun, ahead,
                                                                                               behind)]
    states = {t.number: t.state for t in load_study(sw).trials}
    assert all(states[t.number] == TrialState.FAIL for t in (orphan, begun, ahead, behind))
    assert states[beating.number] == TrialState.RUNNING  # stale now, but that is fail_stale_trials' to decide
    assert list(states.values()).count(TrialState.WAITING) == 4  # their retries
    assert sweep.fail_unstarted_trials(study, sw.heartbeat.grace, seen) == []


def test_a_worker_fails_and_retries_an_orphan_it_keeps_seeing_then_finishes(tmp_path, monkeypatch):
    """worker() itself, not only fail_unstarted_trials: an orphan (RUNNING, no heartbeat: its worker died as it
    began) is failed and retried once the grace period has passed since this worker first saw it, which needs the
    first sighting kept between the loop's passes; the worker then returns with n_trials done."""
    sw = sweep.load(write_sweep(tmp_path, name="orphan", n_trials=2, heartbeat=QUICK))
    study = sweep.open_study(sw)
    with pytest.warns(UserWarning, match="Heartbeat of storage is supposed to be used with Study.optimize"):
        orphan = study.ask()
    monkeypatch.setattr(sweep, "objective", lambda _: lambda trial: float(trial.number))
    t0 = time.time()
    loop = threading.Thread(target=sweep.worker, args=(sw,), daemon=True)  # a worker that waits forever fails here
    loop.start()
    loop.join(timeout=60)
    assert not loop.is_alive(), "the worker still waits on the orphan"
    assert time.time() - t0 >= sw.heartbeat.grace  # not failed before its grace period
    trials = load_study(sw).trials
    assert trials[orphan.number].state == TrialState.FAIL
    (retry,) = [t for t in trials if sweep.retried_number(t) == orphan.number]
    assert retry.state == TrialState.COMPLETE
    assert sweep.counts(load_study(sw)) == {"done": 2, "running": 0, "waiting": 0, "all": 3}


@pytest.mark.parametrize("then", ["returns", "reports"])
def test_a_worker_whose_live_trial_another_failed_as_stale_goes_on(tmp_path, monkeypatch, capsys, then):
    """On a loaded host a live trial's heartbeat can lag past the grace period; another worker then fails it and
    queues its retry, and Optuna's tell of the finished trial raised "Cannot tell a FAIL trial", ending this worker
    (exit 1). The worker goes on instead: the retry runs and counts, and the study ends with n_trials done. Both
    ways the objective can end: it returns its value (Optuna 5 raises an AssertionError over the ValueError), or its
    next report to the pruner finds the trial finished and raises (a sweep's trial reports while its stage runs:
    Optuna raises the ValueError itself)."""
    sw = sweep.load(write_sweep(tmp_path, name="falsestale", n_trials=3))
    other = sweep.open_study(sw)  # another worker's view of the same study

    def objective(_):
        def fn(trial):
            if trial.number == 0:  # while it runs, the other worker's stale check fails it
                other._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
                other._storage.get_heartbeat_stale_trial_callback()(other, other._storage.get_trial(trial._trial_id))
                if then == "reports":
                    trial.report(1.0, 0)
            return float(trial.number)
        return fn

    monkeypatch.setattr(sweep, "objective", objective)
    sweep.worker(sw)
    study = load_study(sw)
    assert sweep.counts(study) == {"done": 3, "running": 0, "waiting": 0, "all": 4}
    states = [t.state for t in study.trials]
    assert states == [TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE, TrialState.COMPLETE]
    assert sweep.retried_number(study.trials[1]) == 0
    assert "failed as stale by another" in capsys.readouterr().out


def test_two_workers_on_sqlite_never_take_the_same_waiting_trial(tmp_path, monkeypatch):
    """A waiting trial (a dead worker's retry) taken by two SQLite workers at once: Optuna reads it under SELECT ...
    FOR UPDATE, which SQLite ignores, and sets it RUNNING; both workers read it waiting and both ran it, and the
    second to finish failed with "Cannot tell a COMPLETE trial" (a killed sweep's rerun on 2 workers, once in make
    test). Here two storages (two workers' connections) read it at the same moment, held at a barrier after the read:
    exactly one takes it; without the sweep's lock both did (checked with Optuna's RDBStorage)."""
    from optuna.storages import RDBStorage
    from optuna.storages._rdb import models as rdb

    sw = sweep.load(write_sweep(tmp_path, name="race"))
    study = sweep.open_study(sw)
    study.enqueue_trial({"sft.learning_rate": 2e-3, "lora.r": 4})
    (waiting,) = study.get_trials(states=(TrialState.WAITING,))
    barrier, found = threading.Barrier(2, timeout=3), rdb.TrialModel.find_or_raise_by_id

    def read_then_wait(trial_id, session, for_update=False):
        row = found(trial_id, session, for_update)
        if for_update:  # both workers have read the trial before either writes (or, under the lock, one waits)
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait()
        return row

    monkeypatch.setattr(rdb.TrialModel, "find_or_raise_by_id", read_then_wait)

    def race(make, trial_id: int) -> list[bool]:
        stores, taken = [make() for _ in range(2)], []
        threads = [threading.Thread(target=lambda st=st: taken.append(
            st.set_trial_state_values(trial_id, TrialState.RUNNING))) for st in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return taken

    assert sorted(race(lambda: sweep.storage(sw), waiting._trial_id)) == [False, True]
    # the same race through Optuna's own storage: both take it (the bug the lock closes)
    barrier.reset()
    study.enqueue_trial({"sft.learning_rate": 3e-3, "lora.r": 8})
    (waiting,) = study.get_trials(states=(TrialState.WAITING,))
    assert race(lambda: RDBStorage(sw.storage, engine_kwargs={"connect_args": {"timeout": 60}}),
                waiting._trial_id) == [True, True]


@pytest.mark.slow
def test_a_killed_sweep_resumes_with_only_the_remaining_trials(tmp_path):
    """Two worker processes (WORKERS=2) on SQLite; the whole sweep is SIGKILLed after 2 trials, then rerun."""
    sw = sweep.load(write_sweep(tmp_path, name="resume", n_trials=6,
                                pruner={"type": "median", "n_startup_trials": 6}))
    sweep.open_study(sw)  # the tables exist before the test polls them
    cmd = [sys.executable, "-m", "rlhf.sweeps", "run", sw.path, "--workers", "2"]
    first = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and first.poll() is None:
        time.sleep(0.5)
        if len(load_study(sw).get_trials(states=(TrialState.COMPLETE,))) >= 2:
            break
    # the sweep, its workers and the stage process of each running trial (served by the suite's fork server: its
    # child dies with it, as a user's process would)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    before = {t.number: t.state for t in load_study(sw).trials}
    assert sum(s == TrialState.COMPLETE for s in before.values()) >= 2
    assert sum(s == TrialState.COMPLETE for s in before.values()) < 6, "killed too late to test a resume"

    t0 = time.time()
    rerun = make("sweep", f"SWEEP={sw.path}", "WORKERS=2", timeout=300)  # the rerun, as a user types it
    assert f"{sum(s == TrialState.COMPLETE for s in before.values())}/6 done" in rerun.stdout
    study = load_study(sw)
    trials = study.trials
    assert sweep.counts(study) == {"done": 6, "running": 0, "waiting": 0, "all": len(trials)}
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == 6
    for number, state in before.items():  # finished trials are kept, not run again
        if state == TrialState.COMPLETE:
            assert trials[number].state == TrialState.COMPLETE
    killed = [n for n, s in before.items() if s == TrialState.RUNNING]
    for n in killed:  # the trial the kill interrupted: failed by its stale heartbeat and retried under a new number
        assert trials[n].state == TrialState.FAIL
        (retry,) = [t for t in trials if sweep.retried_number(t) == n and not t.user_attrs.get("surplus")]
        assert retry.number > n and retry.state == TrialState.COMPLETE
        # the parameters the killed trial had suggested, kept; those it had not reached yet (the kill came between
        # its creation and a suggestion: CI saw none suggested, this session one of two), sampled by the retry
        assert trials[n].params.items() <= retry.params.items() and retry.params.keys() == {"sft.learning_rate",
                                                                                             "lora.r"}
    surplus = [t.number for t in trials if t.user_attrs.get("surplus")]  # a race for the last slot, never run
    assert len(trials) == 6 + len(killed) + len(surplus)
    # one run record per trial that finished, tagged with the study and its trial number; none ran twice
    tags = [r["sweep"]["trial"] for r in run_records(sw)]
    assert sorted(tags) == sorted(t.number for t in finished), tags
    for t in finished:  # the pruner saw the eval loss before, during and after training
        assert sorted(t.intermediate_values) == [0, 2, 4]

    report = make("sweep-report", f"SWEEP={sw.path}", timeout=120)
    best = study.best_trial
    assert f"best trial: #{best.number} metrics.eval_loss={best.value:.6g}" in report.stdout
    assert best.value == min(t.value for t in trials if t.state == TrialState.COMPLETE)
    assert f"| {best.number} | COMPLETE |" in report.stdout and "parameter importances (from " in report.stdout
    for png in ("history.png", "parallel.png", "slice.png"):
        assert (sw.dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(sw.dir / png) in report.stdout
    print(f"resumed part: {time.time() - t0:.1f}s; best trial {best.number}: {best.value:.4f} {best.params}")


# ------------------------------------------------------------------------------------------------- PostgreSQL
def postgres_bin() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3]))
    return Path(versions[-1]).parent if versions else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def postgres_server(password: str | None = None):
    """A throwaway PostgreSQL server on 127.0.0.1 (a free port, a temp data dir), run as a non-root user; yields its
    host:port. User `sweeps` logs in with `password` (scram-sha-256), or with none (trust)."""
    bindir = postgres_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL binaries (pg_ctl) on PATH or under /usr/lib/postgresql/*/bin; "
                    ".ci/run installs the distro's postgresql package")
    root = Path(tempfile.mkdtemp(prefix="rlhf-pg-"))
    auth = ["--auth=trust"]
    if password:
        (root / "pwfile").write_text(password + "\n")
        auth = ["--auth=scram-sha-256", f"--pwfile={root / 'pwfile'}"]
    as_user = []
    if os.geteuid() == 0:  # postgres refuses to run as root
        user = pwd.getpwnam("nobody")
        for path in (root, *root.iterdir()):
            os.chown(path, user.pw_uid, user.pw_gid)
        as_user = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
    data, port = root / "data", free_port()
    env = {**os.environ, "HOME": str(root), "LC_ALL": "C"}
    subprocess.run(as_user + [str(bindir / "initdb"), "-D", str(data), "-U", "sweeps", *auth, "-E", "UTF8"],
                   check=True, capture_output=True, env=env, timeout=120)
    ctl = as_user + [str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log")]
    subprocess.run(ctl + ["-w", "-o", f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={root}",
                          "start"], check=True, capture_output=True, env=env, timeout=120)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run(ctl + ["-m", "immediate", "-w", "stop"], capture_output=True, env=env, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres():
    """The storage URL of a throwaway PostgreSQL server (postgres_server) that trusts user `sweeps`."""
    with postgres_server() as host:
        yield f"postgresql+psycopg2://sweeps@{host}/postgres"


@pytest.mark.slow
def test_two_workers_share_a_postgres_study_and_a_dead_workers_trial_is_retried(tmp_path, postgres):
    sw = sweep.load(write_sweep(tmp_path, name="pg", n_trials=2, storage=postgres))
    sweep.open_study(sw)  # created once, as `make sweep` does before its workers start
    cmd = [sys.executable, "-m", "rlhf.sweeps", "run", sw.path]  # what each host runs: one worker each
    a = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=real_process_env())
    b = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=real_process_env())
    try:
        victim = None
        deadline = time.time() + 120
        while victim is None and time.time() < deadline:
            time.sleep(0.5)
            for t in load_study(sw).get_trials(states=(TrialState.RUNNING,)):
                if t.user_attrs.get("worker", "").endswith(f":{a.pid}"):
                    victim = t.number
        assert victim is not None, "worker A never started a trial"
        time.sleep(2)  # mid-trial: its stage process is running
        a.send_signal(signal.SIGKILL)
        a.wait()
        out, _ = b.communicate(timeout=300)
        assert b.returncode == 0, out
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
    study = load_study(sw)
    trials = study.trials
    assert trials[victim].state == TrialState.FAIL  # its heartbeat stopped
    (retry,) = [t for t in trials if sweep.retried_number(t) == victim]
    assert retry.state == TrialState.COMPLETE and retry.params == trials[victim].params
    assert retry.user_attrs["worker"].endswith(f":{b.pid}")  # taken over by the live worker
    assert sweep.counts(study)["done"] == 2
    workers = {t.number: t.user_attrs["worker"] for t in trials}
    assert len(set(workers.values())) == 2  # both workers took trials from the one study
    # the dead worker's stage process died with it (no summary); every other trial ran exactly once
    tags = [r["sweep"]["trial"] for r in run_records(sw)]
    assert sorted(tags) == sorted(t.number for t in trials if t.state == TrialState.COMPLETE)
    assert victim not in tags


# ------------------------------------------------------------------------------------------------------ secrets
PASSWORD = "pw-4d1c-never-shown"


def cmdlines(match: str, skip: int) -> dict[int, str]:
    """Every process's command line (/proc/<pid>/cmdline, readable by any local user) that mentions `match`, but
    process `skip`'s."""
    found = {}
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # ended meanwhile
        if match in line and int(path.parent.name) != skip:
            found[int(path.parent.name)] = line
    return found


def sweeps_cli(*args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf.sweeps", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


@pytest.mark.slow
def test_a_database_password_is_never_printed_written_or_on_a_command_line(tmp_path):
    """A real two-worker sweep on PostgreSQL with a password, as the docs show it (`make sweep STORAGE=url`); then
    the report with the password in the URL, from PGPASSWORD and from a .pgpass file, and an unreachable database.
    The password appears in no output, no file under results/, the report, or any command line of the sweep's
    processes (workers and stages; make's own is what the user typed)."""
    with postgres_server(PASSWORD) as host:
        url = f"postgresql://sweeps:{PASSWORD}@{host}/postgres"  # bare postgresql://: the psycopg2 the extra installs
        path = write_sweep(tmp_path, name="pgpw", n_trials=2)
        typed = ["make", "sweep", f"SWEEP={path}", "WORKERS=2", f"STORAGE={url}"]
        proc = subprocess.Popen(typed, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = {}
        while proc.poll() is None:
            seen.update(cmdlines(str(tmp_path), skip=proc.pid))
            time.sleep(0.1)
        # make's children show make's own command line (what the user typed) between their fork and their exec
        seen = {pid: c for pid, c in seen.items() if c != " ".join(typed) + " "}
        out, err = proc.communicate()
        assert proc.returncode == 0, err[-3000:]
        assert len([c for c in seen.values() if " rlhf.sweeps worker " in c]) == 2, seen
        assert any(" rlhf sft " in c for c in seen.values()), seen  # the trials' stage processes
        assert not [c for c in seen.values() if PASSWORD in c]
        assert f"study in postgresql://sweeps:<redacted>@{host}/postgres: 0/2 done" in out
        outputs = [out, err]

        report = make("sweep-report", f"SWEEP={path}", f"STORAGE={url}", timeout=120)
        assert f"study pgpw in postgresql://sweeps:<redacted>@{host}/postgres; 2/2 done" in report.stdout
        outputs += [report.stdout, report.stderr]
        # the password kept out of the URL: PostgreSQL's PGPASSWORD, or a password file (PGPASSFILE: ~/.pgpass)
        no_password = {"RLHF_SWEEP_STORAGE": f"postgresql://sweeps@{host}/postgres"}
        by_env = sweeps_cli("report", str(path), **no_password, PGPASSWORD=PASSWORD)
        pgpass = tmp_path / "pgpass"
        pgpass.write_text(f"{host}:postgres:sweeps:{PASSWORD}\n")
        pgpass.chmod(0o600)
        by_file = sweeps_cli("report", str(path), **no_password, PGPASSFILE=str(pgpass))
        for done in (by_env, by_file):
            assert done.returncode == 0 and "2/2 done" in done.stdout, done.stderr[-2000:]
            outputs += [done.stdout, done.stderr]
        wrong = sweeps_cli("report", str(path), **no_password)  # no password anywhere: refused, in one line
        assert wrong.returncode == 2 and "no password supplied" in wrong.stderr, wrong.stderr
    unreachable = sweeps_cli("report", str(path), "--storage", f"postgresql://sweeps:{PASSWORD}@127.0.0.1:1/db")
    assert unreachable.returncode == 2 and unreachable.stderr.count("\n") == 1, unreachable.stderr
    assert unreachable.stderr.startswith(f"error: {path}: storage 'postgresql://sweeps:<redacted>@127.0.0.1:1/db': ")
    assert "Connection refused" in unreachable.stderr
    for text in outputs + [wrong.stderr, unreachable.stderr]:
        assert PASSWORD not in text
    written = [f for f in (tmp_path / "results").rglob("*") if f.is_file()]
    assert (tmp_path / "results" / "sweeps" / "pgpw" / "report.md") in written and len(written) > 20
    for f in written:
        assert PASSWORD.encode() not in f.read_bytes(), f


def test_a_trial_is_graded_on_the_rows_and_with_the_interval_of_its_run(tmp_path):
    """A trial graded by a win rate is of the eval.prompts rows the held-out check sampled (the summary's
    eval_prompts), not of every held-out pair (data_sizes.eval): its interval would read three times too narrow. The
    interval is the run's own (`<name>_ci95`, or a grader's `ci95`): a win rate's counts its ties, TRL's DPO accuracy
    is a mean of batch means; the report no longer recomputes one from value x n."""
    from rlhf.sweeps.trial import held_out

    win, grader, acc = [0.58, 0.66], [0.55, 0.7], guard.batch_mean_wilson(0.8, 200, 32)
    (tmp_path / "summary.json").write_text(json.dumps({
        "metrics": {"eval_prompts": 24, "eval_win_rate_vs_sft": 0.62, "eval_win_rate_vs_sft_ci95": win,
                    "eval_win_rates": {"judge": {"win_rate": 0.6, "ci95": grader}}, "eval_rewards_accuracies": 0.8,
                    "eval_rewards_accuracies_ci95": acc, "eval_loss": 0.4},
        "lineage": {"data_sizes": {"eval": 200}}}))
    assert held_out(tmp_path, "metrics.eval_win_rate_vs_sft") == (24, win)
    assert held_out(tmp_path, "metrics.eval_win_rates.judge.win_rate") == (24, grader)
    assert held_out(tmp_path, "metrics.eval_rewards_accuracies") == (200, acc)
    assert held_out(tmp_path, "metrics.eval_loss") == (200, None)
    assert held_out(tmp_path / "absent", "metrics.eval_win_rate_vs_sft") == (None, None)
