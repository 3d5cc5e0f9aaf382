"""`make bench`: shared fixtures, the machine/package record, and the results file written at the end of the session
(results/bench/<date>-cpu.json and .md; BENCH_OUT=dir overrides the directory)."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("RLHF_DISABLE_TRACKING", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
# One compute thread per process (BENCH_THREADS): on a machine shared with other torch jobs, oversubscribed OpenMP
# threads make timings swing several-fold; ours and the peers run under the same setting.
THREADS = os.environ.setdefault("BENCH_THREADS", "1")
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = THREADS

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "experiments" / "tiny.yaml"
PEER_VENV = ROOT / ".bench-venv"
PEER_REQS = ROOT / "bench" / "trl025-requirements.txt"
RESULTS: dict = {"benchmarks": {}}
T_START = time.time()

# ~50M parameters in the decoder layers (10 x (4*640^2 + 3*640*1728)); the synthetic task's vocabulary is ~30 words
SMALL = ["model.hidden_size=640", "model.num_layers=10", "model.num_heads=10", "model.intermediate_size=1728"]


def set_threads() -> None:
    import torch

    torch.set_num_threads(int(THREADS))


def exp_for(root: Path, size: str, *overrides):
    from rlhf.experiment import config

    extra = SMALL if size == "small" else []
    return config.load(TINY, [f"results_dir={root}", *extra, *overrides])


def record(key: str, value: dict) -> None:
    RESULTS["benchmarks"][key] = value


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def versions(names=("torch", "transformers", "trl", "peft", "bitsandbytes", "accelerate", "datasets",
                    "pytest-benchmark")) -> dict:
    out = {}
    for n in names:
        try:
            out[n] = importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            out[n] = None
    return out


def run_measured(cmd: list[str], env: dict | None = None, cwd: Path = ROOT, poll_s: float = 0.01) -> dict:
    """Run `cmd`, sampling its resident set size from /proc every poll_s: the same peak-memory measure for any
    process (ours and the peer alike), unaffected by what the process does to its own counters."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    peak = [0]
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    status = f"/proc/{proc.pid}/status"
    while proc.poll() is None:
        try:
            with open(status) as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        peak[0] = max(peak[0], int(line.split()[1]) * 1024)
                        break
        except OSError:
            pass
        time.sleep(poll_s)
    reader.join(5)
    return {"rc": proc.returncode, "wall_s": time.time() - t0, "peak_rss_bytes": peak[0], "output": "".join(lines)}


def ensure_peer_venv() -> Path:
    """.bench-venv with TRL 0.25.1 and its pinned companions (bench/trl025-requirements.txt); created once."""
    py = PEER_VENV / "bin" / "python"
    stamp = PEER_VENV / ".installed"
    if stamp.exists() and stamp.read_text() == PEER_REQS.read_text():
        return py
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "-r", str(PEER_REQS)], check=True)
    stamp.write_text(PEER_REQS.read_text())
    return py


def pytest_collection_modifyitems(config, items):
    set_threads()
    for item in items:
        item.add_marker(pytest.mark.bench)


def _memory_and_reward(peer: dict, ours: dict) -> str:
    """The cells the online-RL tables share: peak RSS (peer / ours) and each side's held-out ground truth with its
    SFT start."""
    return (f"{peer['peak_rss_mb']:.0f} / {ours['peak_rss_mb']:.0f} | {peer['gt_policy']:.3f} ({peer['gt_sft']:.3f}) | "
            f"{ours['gt_policy']:.3f} ({ours['gt_sft']:.3f})")


def _gain(side: dict) -> str:
    """A side's held-out ground-truth gain over its SFT reading, mean ± standard error over its seeds."""
    from rlhf.maths.guard import paired

    g = side.get("gains") or [side["gt_policy"] - side["gt_sft"]]
    d = paired(g, [0.0] * len(g))
    return f"{d['mean']:+.3f}" + (f" ± {d['se']:.3f}" if len(g) > 1 else "")


def _clip(side: dict) -> str:
    """The mean fraction of response tokens the clipped surrogate clipped (TRL's clip_ratio/region_mean, our
    clipfrac), over the run's updates and the seeds: how far each optimizer step moved the policy."""
    return f"{side['clip_frac']:.3f}" if side.get("clip_frac") is not None else "-"


def _last3(side: dict) -> str:
    """The mean reward of the last three generation batches (before their updates), over the seeds: where
    training got, as each side's own log says."""
    return f"{side['train_reward_last3']:.3f}" if side.get("train_reward_last3") is not None else "-"


def _seeds(side: dict) -> int:
    return len(side.get("gains", [0]))


def _table(res: dict) -> str:
    b = res["benchmarks"]
    lines = [f"# Benchmarks {res['date']} ({res['machine']['cpu_count']} CPUs, {res['machine']['cpu_model']}; "
             f"load average at start {res['machine']['loadavg_start']})"]
    stages = [v for v in b.values() if v.get("kind") == "stage"]
    if stages:
        lines += ["", "Training throughput (tokens/s, best of the rounds; ratio = ours / matched plain TRL, >= 0.95 is "
                      "the target):", "",
                  "| stage | config | plain TRL (matched: fp32) | ours (tracker on) | ratio | ours (track_tensors=false) | "
                  "ratio | plain TRL, its defaults (bf16 autocast) |",
                  "|---|---|---|---|---|---|---|---|"]
    for v in stages:
        lines.append(f"| {v['stage']} | {v['config']} | {v['plain']:.0f} | {v['ours']:.0f} | {v['ratio']:.2f} | "
                     f"{v['ours_untracked']:.0f} | {v['ratio_untracked']:.2f} | "
                     f"{'%.0f' % v['plain_trl_defaults'] if v.get('plain_trl_defaults') else 'not run'} |")
    ppo = [v for v in b.values() if v.get("kind") == "ppo"]
    if ppo:
        v0 = ppo[0]
        lines += ["", f"PPO against TRL 0.25.1's PPOTrainer, {v0['episodes']} episodes ({v0['steps']} iterations x "
                      f"{v0['rollout_batch']}) per run, float32 on both sides; speed-up = TRL's seconds per "
                      "iteration / ours (>= 1.5 is the target); held-out ground truth after training (SFT start):", "",
                  "| shape | TRL s/iter | ours s/iter | speed-up | ours, value_model=shared | speed-up | "
                  "peak RSS MB TRL / ours | ground truth TRL | ground truth ours | seeds | gain over SFT: TRL / ours "
                  "(± se over seeds) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for v in ppo:
            t, o, sh = v["trl025"], v["ours"], v["ours_shared_value"]
            lines.append(f"| {v['shape']} | {t['step_s']:.3f} | {o['step_s']:.3f} | {v['speedup']:.2f}x | "
                         f"{sh['step_s']:.3f} | {v['speedup_shared_value']:.2f}x | {_memory_and_reward(t, o)} | "
                         f"{_seeds(t)} | {_gain(t)} / {_gain(o)} |")
        lines += ["", "Seconds per iteration by part. Ours: generate; no-grad passes for old log-probs (policy), "
                      "value, reference, RM score; the judge's measurements (judge_every, every iteration's "
                      "share); forward + backward of the policy and of the value adapter over every minibatch and "
                      "epoch; optimizer (gradient clipping and step); other. TRL: generate (its "
                      "old log-probs come from the sampling logits); no-grad ref, value, score; the policy+value "
                      "forward of the update; their backward; optimizer; other:", ""]
        for v in ppo:
            for side in ("ours", "trl025"):
                lines.append(f"- {v['shape']}, {'ours' if side == 'ours' else 'TRL'}: " +
                             ", ".join(f"{k} {x:.3f}" for k, x in v[side]["phases"].items()))
        lines += ["", "Shapes:"] + [f"- {v['shape']}: {v['about']}" for v in ppo]
    group = [v for v in b.values() if v.get("kind") == "group"]
    if group:
        v0 = group[0]
        lines += ["", f"GRPO and RLOO against TRL's GRPOTrainer / RLOOTrainer, {v0['episodes']} episodes "
                      f"({v0['steps']} generation batches x {v0['rollout_batch']}, {v0['num_generations']} per "
                      "prompt), the ground truth as the reward function on both sides:", "",
                  "| stage | shape | TRL s/batch | ours s/batch | speed-up | peak RSS MB TRL / ours | "
                  "ground truth TRL | ground truth ours | seeds | gain over SFT: TRL / ours (± se over seeds) | "
                  "clipped fraction TRL / ours | training reward, last 3 batches: TRL / ours |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for v in group:
            t, o = v["trl"], v["ours"]
            label = f"{v['stage']} ({v['recipe']})" if v.get("recipe") else v["stage"]
            lines.append(f"| {label} | {v.get('shape', 'tiny')} | {t['step_s']:.3f} | {o['step_s']:.3f} | "
                         f"{v['speedup']:.2f}x | {_memory_and_reward(t, o)} | {_seeds(t)} | {_gain(t)} / {_gain(o)} | "
                         f"{_clip(t)} / {_clip(o)} | {_last3(t)} / {_last3(o)} |")
        tried = sorted({f"start={v.get('ours_start', 'sft')}, overrides {' '.join(v.get('ours_args') or []) or 'none'}"
                        for v in group if v.get("ours_start", "sft") != "sft" or v.get("ours_args")})
        if tried:  # BENCH_OURS_START / BENCH_OURS_ARGS: not the shipped settings
            lines += ["", f"Ours ran with {'; '.join(tried)} (BENCH_OURS_START / BENCH_OURS_ARGS), not as shipped."]
        lines += ["", "Our step by part (s per generation batch):", ""] + [
            f"- {v['stage']}{' (' + v['recipe'] + ')' if v.get('recipe') else ''}, {v.get('shape', 'tiny')}: " +
            ", ".join(f"{k} {x:.3f}" for k, x in v["ours"]["phases"].items()) for v in group]
    pipe = [v for v in b.values() if v.get("kind") == "pipeline"]
    if pipe:
        lines += ["", f"The pipeline SFT -> RM -> DPO -> PPO ({', '.join(pipe[0]['settings'])}), one process per "
                      "stage, wall seconds from launch to exit; TRL = the stages written directly against TRL 1.16 "
                      "plus the merge and TRL 0.25.1's PPOTrainer:", "",
                  "| shape | side | sft | rm | dpo | merge | ppo | total | speed-up | PPO ground truth (SFT) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for v in pipe:
            for side in ("trl", "ours"):
                st = v[side]
                cells = [f"{st[k]['wall_s']:.0f}" if k in st else "-" for k in ("sft", "rm", "dpo", "merge", "ppo")]
                lines.append(f"| {v['shape']} | {'TRL' if side == 'trl' else 'ours'} | {' | '.join(cells)} | "
                             f"{v['total_wall_s'][side]:.0f} | {v['speedup'] if side == 'ours' else 1.0:.2f}x | "
                             f"{st['ppo']['gt_policy']:.3f} ({st['ppo']['gt_sft']:.3f}) |")
    mp = [v for v in b.values() if v.get("kind") == "memplan"]
    if mp:
        lines += ["", "Memory predictor `rlhf.memory.memplan.plans(exp)`: " +
                  ", ".join(f"{v['config']} {v['mean_ms']:.1f} ms" for v in mp)]
    lines += [""] + [f"Suite wall time: {r['suite_wall_s']:.0f} s. Command: `{r['command']}`"
                     for r in res.get("runs", [res])]
    return "\n".join(lines) + "\n"


def pytest_sessionfinish(session, exitstatus):
    if not RESULTS["benchmarks"]:
        return
    date = datetime.date.today().isoformat()
    keyword = session.config.option.keyword  # make bench ARGS='-k ...' runs a part of the suite
    RESULTS.update({
        "date": date, "suite_wall_s": round(time.time() - T_START, 1),
        "command": "".join(f"{k}={v} " for k, v in sorted(os.environ.items())  # the settings that change results
                           if k.startswith("BENCH_") and k != "BENCH_OUT" and (k, v) != ("BENCH_THREADS", "1"))
                   + "make bench" + (f" ARGS='-k {keyword}'" if keyword else ""),
        "machine": {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform(),
                    "python": platform.python_version(), "loadavg_start": LOAD_START, "torch_threads": int(THREADS),
                    "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
        "packages": versions(),
    })
    out = Path(os.environ.get("BENCH_OUT", ROOT / "results" / "bench"))
    out.mkdir(parents=True, exist_ok=True)
    runs = [{k: RESULTS[k] for k in ("command", "suite_wall_s", "machine")}]
    earlier = out / f"{date}-cpu.json"
    if keyword and earlier.exists():  # a part of the suite: today's other results stay, this run's replace theirs
        old = json.loads(earlier.read_text())
        runs = old.get("runs", [{k: old.get(k) for k in ("command", "suite_wall_s", "machine")}]) + runs
        RESULTS["benchmarks"] = {**old["benchmarks"], **RESULTS["benchmarks"]}
    RESULTS["runs"] = runs
    earlier.write_text(json.dumps(RESULTS, indent=2, default=str) + "\n")
    (out / f"{date}-cpu.md").write_text(_table(RESULTS))


LOAD_START = [round(x, 2) for x in os.getloadavg()]
