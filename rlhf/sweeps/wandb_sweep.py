"""The sweep file as a W&B sweep (`make wandb-sweep`): the same space and metric in W&B's sweep configuration. With an
account, W&B's controller samples and `wandb agent` runs `python -m rlhf.sweeps wandb-agent` per trial; offline, the
trials are drawn from the same space by Optuna and logged as offline W&B runs (`wandb sync` uploads them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from rlhf.runs.tracking import run_name, run_tags, wandb_defaults
from rlhf.sweeps.spec import Sweep, SweepError
from rlhf.sweeps.trial import TrialStopped, check_upstream, run_trial, suggest


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
        elif (s.get("step") or 1) != 1:
            params[key] = {"distribution": "q_uniform", "min": s["low"], "max": s["high"], "q": s["step"]}
        else:
            params[key] = {"distribution": "int_uniform", "min": s["low"], "max": s["high"]}
    return {"name": sw.name, "method": "bayes", "metric": {"name": sw.metric, "goal": sw.direction},
            "parameters": params,
            "command": ["${env}", "${interpreter}", "-m", "rlhf.sweeps", "wandb-agent", sw.path,
                        *(f"--set={a}" for a in sw.args), "${args_no_hyphens}"]}



def _typed(spec: dict, value):
    if spec["type"] == "int":
        return int(round(float(value)))
    if spec["type"] == "float":
        return float(value)
    return value


def wandb_trial(sw: Sweep, params: dict | None = None, tag=None) -> float | None:
    """One W&B run: train with `params` (None: the agent's config), log the objective, finish."""
    wandb_defaults()
    import wandb

    stage = "+".join(sw.stages)
    run = wandb.init(project=sw.wandb["project"], group=sw.name, job_type="sweep-trial", config=params,
                     dir=str(sw.dir), tags=run_tags(sw.exp_name, stage, {"study": sw.name}))
    params = {k: _typed(sw.space[k], run.config[k]) for k in sw.space}
    tag = tag if tag is not None else f"wandb-{run.id}"
    run.name = run_name(sw.exp_name, stage, "", {"study": sw.name, "trial": tag, "params": params})
    try:
        value, run_dir = run_trial(sw, params, tag)
    except TrialStopped as e:
        run.summary.update({"state": e.state, "reason": e.reason})
        run.finish(exit_code=1 if e.state == "failed" else 0)
        print(f"[{sw.name}] {tag} {e.state}: {e.reason}", flush=True)
        return None
    except SweepError as e:  # the sweep file's objective: this run ends failed, the agent stops with the error
        run.summary.update({"state": "failed", "reason": f"the sweep file: {e}"})
        run.finish(exit_code=1)
        raise
    run.log({sw.metric: value})
    run.summary.update({"state": "complete", "run_dir": str(run_dir)})
    page = f" (W&B: {run.url})" if run.url else ""  # offline there is none: the last line names the folder
    run.finish()
    print(f"[{sw.name}] {tag} {params} -> {sw.metric}={value:.4g}{page}", flush=True)
    return value



def offline_draws(sw: Sweep, count: int) -> list[dict]:
    """Offline there is no W&B sweep controller to sample: the same space, drawn by Optuna's RandomSampler."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=sw.sampler.seed))
    return [suggest(study.ask(), sw.space) for _ in range(count)]


def wandb_sweep(sw: Sweep, count: int | None = None) -> Path:
    """Write the W&B sweep config; with an account, create the sweep and run `wandb agent` (it runs
    `python -m rlhf.sweeps wandb-agent`); offline, run the same trials for `count` random draws from that config."""
    if count is not None and count < 1:
        raise SweepError(f"{sw.path}: COUNT={count}: a W&B sweep runs at least 1 trial (without COUNT, the sweep "
                         f"file's wandb.count, {sw.wandb['count']})")
    check_upstream(sw)
    count = count if count is not None else sw.wandb["count"]
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
    for i, params in enumerate(offline_draws(sw, count)):
        wandb_trial(sw, params, tag=f"wandb-{i}")
    print(f"[{sw.name}] offline runs under {sw.dir / 'wandb'} (upload later with `wandb sync`)", flush=True)
    return path
