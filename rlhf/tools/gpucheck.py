"""`make gpucheck`: the shipped GPU experiments at their real shapes on one CUDA device, measured.

For each experiment: build its base model from the architecture `make memplan` uses (random weights, no hub), a
word-level tokenizer and preference data whose rows are exactly the experiment's sequence lengths (prompt
`data.max_prompt_length`, whole sequence `data.max_length`; PPO generates `ppo.response_length` from the full prompt),
then run every training stage as `python -m rlhf <stage>` does, with the experiment's own settings (quantization,
LoRA, optimizer, checkpointing, batch sizes) for a few optimizer steps, under `memory.cap_to_budget`. Records, per
stage: the probe's peaks (NVML process, torch allocated/reserved) by phase, throughput, and the memory plan's
prediction beside each measured peak with the error. Throughput counts tokens as the published single-GPU anchors do
(torchtune, Unsloth: every trained token): SFT, RM and DPO `trained_tokens_per_s`, every token of every sequence
trained, prompt and response, chosen and rejected (for DPO the reference's forward pass over the same sequences is
part of the time, not of the count); PPO, GRPO and RLOO `episodes_per_s` and `sampled_tokens_per_s`, prompt +
response tokens of every sampled sequence per second of the whole iteration (rollout, update, bookkeeping), with
the per-part seconds. Also checks once
that PPO's gradients are the same with gradient checkpointing on and off on this device (deterministic algorithms,
one shared rollout), beside the off-vs-off floor. And, for PPO and GRPO, where an iteration's time goes: the
seconds of each part the loop times (from the run's metrics.jsonl), and one more iteration, in this process, under
torch.profiler (CPU ops, and CUDA kernels on a GPU): self time in bitsandbytes' 4-bit dequantization, matrix
products, attention and the rest, and the top ops and kernels (profile_iteration; `--no-profile` skips it).

Writes results/gpu/<date>-<device>.json, .md and .log (`--out`: elsewhere) after every stage. `--dry-run` runs the same
code on CPU with the architectures shrunk and one step each (CI runs it, so this does not rot between GPU loans), into
results/gpu-dry-run/ (results/gpu holds measured records only).
`--loan` is the GPU loan's one device call (docs/performance.md; LOAN, LOAN_FIELDS): PPO and GRPO at Llama-2-7B as
shipped, their first iteration apart, the judge composed at the shipped cadence, their sampler's state and decode
step; `--budget-s` prints the plan with its estimate (COST_S) and refuses one over the budget before building.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlhf.experiment import config
from rlhf.runs import records
from rlhf.infra import toolchain
from rlhf.experiment import stages as registry
from rlhf.memory import memplan
from rlhf.memory.arch import arch
from rlhf.tools.bases import ONLINE, SMALL, TRAINED, build_base, write_pairs
from rlhf.tools.gpumetrics import checkpointing_gradients, online_throughput, sampling_copy_check
from rlhf.tools.gpuprofile import iteration_parts, profile_iteration
from rlhf.tools.gpureport import markdown, replan

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ["experiments/llama2-7b-hh-4090.yaml", "experiments/llama31-8b-hh-4090.yaml"]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "WANDB_MODE": "disabled", "RLHF_DISABLE_TRACKING": "1"}
"""Set for every run (scripts/gpucheck.sh sets them before Python starts): nothing reads the network."""

# ---- the loan: one device call (docs/performance.md, "The GPU loan: one call")
LOAN = dict(exp="experiments/llama2-7b-hh-4090.yaml", stages="ppo,grpo", steps=3, trained_steps=1, minibatches=1,
            judge_prompts=32)
"""What `--loan` measures: Llama-2-7B NF4 at 512-token rows under its 24 GB cap; PPO and GRPO (G=8) with the merged
sampler as the plan ships it (its copy and rows), three iterations each of one minibatch (the first, the sampler's
compile and the judge's measurement, apart; two after it); SFT and RM on the way, one optimizer step each. The judge
measures 32 prompts (whole sampling calls of the plan's 4 or 8 rows), scaled to the shipped 128 (as_shipped): its
time is its sampling calls'."""
LOAN_DPO = ("results/gpu/2026-11-25-H100-llama2-7b-hh-4090-sft-rm-dpo.json", "dpo")
"""DPO's Llama-2 figure the loan reuses (not measured again): the run and stage it comes from."""
COST_S = {"setup": 30, "base": 40, "sft": (45, 5), "rm": (40, 4), "dpo": (95, 18), "kto": (95, 18),
          "ppo": (100, 20), "grpo": (90, 10), "rloo": (90, 10), "int8": 105}
"""The plan's estimate, seconds at Llama-2-7B NF4, 512-token rows, on an H100, from the earlier loans' recorded walls
(results/gpu/2026-11-23..26; docs/performance.md; the 2026-11-26 H200 loan took setup ~26 s, base 23, SFT 48, RM 32,
PPO 141, GRPO 111, int8 102: its int8 estimate, 70 s, was short and is its wall now; the 2026-11-27 one, in two
calls, base 17-21, SFT 49-67, RM 34-44, PPO 147, GRPO 105, RLOO 80-110, int8 80): setup (the wheels installed,
imports and driver checked: scripts/gpucheck.sh) and the base built (29-41 s); per stage (its process, load and held-out check; per optimizer
step of a trainer, per iteration-minibatch of an online loop: PPO's update is ~12 s a minibatch, GRPO's ~6, a
compiled sampling call of 128 tokens ~1.2 s, 4 calls of PPO's 4 rows or 2 of GRPO's 8 for 16 episodes; the online
figures include the process and its load, ~46 s, the merged copy and its compile, ~25 s, and the judge's two
measurements, of LOAN's 32 prompts: PPO ~10 s each, GRPO ~5); int8: decodebench's int8 weight-only decode step, in
its own process, on the base already built."""
def loan_fields(stages: list[str]) -> tuple[str, ...]:
    """Every figure a loan measuring `stages` (and the stages they need) must report (dotted paths into its .json; a
    value may be None where the device has none, on a CPU: NVML, the copy bandwidth)."""
    return (
        "device", "torch", "cuda", "driver", "bitsandbytes", "transformers", "peft", "trl", "differs_from_lock",
        "loan.plan", "loan.estimate_s", "loan.budget_s", "loan.wall_s", "loan.copy_bandwidth_gbps", "loan.dpo_reused",
        "loan.int8",
        *(f"experiments.0.stages.{st}.{k}" for st in registry.with_upstream(stages)
          if not registry.get(st).online for k in ("wall_s", "measured_gb", "predicted_gb")),  # SFT and RM on the way
        *(f"experiments.0.stages.{st}.{k}" for st in stages if registry.get(st).online for k in (
            "wall_s", "episodes_per_s", "online.first_iteration_s", "online.measured_iterations",
            "online.as_shipped.episodes_per_s", "online.as_shipped.judge_s", "online.as_shipped.judge_share",
            "online.as_shipped.reference_draw_s", "measured_gb", "predicted_gb", "prediction_error", "nvml_used_gb",
            "peak_allocated_gb", "peak_reserved_gb", "sampler.compiled", "sampler.eager_reason", "sampler.fell_back",
            "sampler.copy_share", "sampler.rows", "decode.ms_per_step", "decode.weight_read_ms",
            "decode.x_weight_read", "iteration_parts.first_iteration")),
    )


LOAN_FIELDS = loan_fields(LOAN["stages"].split(","))
"""Every figure the loan as documented must report. The CPU rehearsal (tests/test_gpucheck.py) checks the same list."""


def missing(report: dict, fields=LOAN_FIELDS) -> list[str]:
    """The `fields` (dotted paths; a number indexes a list) that `report` lacks."""
    out = []
    for path in fields:
        node = report
        for key in path.split("."):
            if isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            elif isinstance(node, dict) and key in node:
                node = node[key]
            else:
                out.append(path)
                break
    return out


def estimate(stages: list[str], steps: int, trained_steps: int, minibatches: int) -> list[tuple[str, str, float]]:
    """(part, what, seconds) of a run, by COST_S: the setup, the base, each stage with its upstream ones."""
    rows = [("setup", "wheels installed, imports and driver checked", COST_S["setup"]),
            ("base", "random-weight base built and saved", COST_S["base"])]
    for st in registry.with_upstream(stages):
        fixed, per = COST_S[st]
        if registry.get(st).online:
            rows.append((st, f"{steps} iterations of {minibatches} minibatch(es)", fixed + per * steps * minibatches))
        else:
            rows.append((st, f"{trained_steps} optimizer step(s)", fixed + per * trained_steps))
    return rows


def preflight(device: str) -> str:
    """One line: bitsandbytes, trl, peft and transformers import, and (on `device` cuda) the driver suits torch's CUDA;
    else exit 2 with one line, before anything is built."""
    from importlib import metadata

    got, bad = {}, []
    for pkg in ("torch", "bitsandbytes", "trl", "peft", "transformers"):
        try:
            importlib.import_module(pkg)
            got[pkg] = metadata.version(pkg)
        except Exception as e:  # noqa: BLE001  (whatever a broken install raises: named in the one line)
            bad.append(f"{pkg} ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]})")
    if bad:
        print(f"error: preflight: {'; '.join(bad)} does not import: install the locked wheels (scripts/gpucheck.sh "
              f"installs .whl/, which the device call must carry)", file=sys.stderr)
        raise SystemExit(2)
    toolchain.require_driver(device)
    driver = toolchain.driver_version() if device != "cpu" else None
    return ("preflight: " + ", ".join(f"{k} {v}" for k, v in got.items()) + " import"
            + (f"; driver {driver} suits torch's CUDA {toolchain.installed_torch()[1]}" if device != "cpu" else
               "; CPU (no driver checked)"))


def dpo_reused() -> dict:
    """DPO's earlier Llama-2 figure (LOAN_DPO), named as reused."""
    path, st = LOAN_DPO
    r = json.loads((ROOT / path).read_text())
    row = r["experiments"][0]["stages"][st]
    return {"reused_from": path, "note": "DPO's earlier Llama-2 figure, reused: not measured in this call",
            "date": r["date"], "device": r["device"], "torch": r.get("torch"),
            "trained_tokens_per_s": (row.get("throughput") or {}).get("trained_tokens_per_s"),
            **{k: row.get(k) for k in ("measured_gb", "predicted_gb", "nvml_used_gb", "peak_allocated_gb", "wall_s")}}


def int8_decode(exp_path: str, base: Path, out: Path, small: bool, seconds: float, log) -> dict:
    """The int8 weight-only copy's decode step (decodebench's int8_compiled) in a process of its own, on the base
    gpucheck built, within `seconds`."""
    cmd = [sys.executable, "-m", "rlhf.tools.decodebench", "--exp", exp_path, "--paths", "int8_compiled",
           "--base", str(base), "--out", str(out), *(["--dry-run", "--tokens", "4"] if small else [])]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=seconds)
    except subprocess.TimeoutExpired:
        return {"skipped": f"not finished within the {seconds:.0f} s left"}
    log(f"  int8 decode: exit {proc.returncode} in {time.time() - t0:.0f} s")
    found = sorted(out.glob("*-decode.json"))
    if proc.returncode != 0 or not found:
        return {"error": f"exit {proc.returncode}", "stderr_tail": "\n".join(proc.stderr.strip().splitlines()[-8:])}
    e = json.loads(found[-1].read_text())["experiments"][0]
    return {**e["paths"].get("int8_compiled", {}), "rows": e.get("rows"), "report": found[-1].name}
def prompt_rows(exp) -> int:
    """The online stages' prompts: 64, or the judge's shipped judge_prompts where more (it measures that many)."""
    return max([64, *(getattr(exp, s.section).judge_prompts for s in ONLINE)])


def overrides(exp, base: Path, pairs: Path, results: Path, steps: int, extra: list[str], trained_steps: int | None = None,
              minibatches: int = 2) -> list[str]:
    """The experiment as shipped, but on the random base and the exact-length data, a few steps per stage (a trainer
    `trained_steps`, default `steps`), `minibatches` minibatches per online rollout (an optimizer step each per
    epoch), and prompts enough for the judge's shipped judge_prompts."""
    p = exp.ppo
    ppo_rollout = minibatches * p.minibatch  # optimizer steps per PPO iteration at the shipped micro/forward batches
    prompts = prompt_rows(exp)
    ov = [f"model.name={base}", "data.source=jsonl", f"data.path={pairs}", "data.sft_examples=64",
          "data.pref_pairs=64", f"data.ppo_prompts={prompts}", "data.eval_examples=8", "eval.prompts=4",
          f"results_dir={results}", "tracking.backend=none", "memory.cap_to_budget=true",
          f"ppo.rollout_batch={ppo_rollout}", f"ppo.steps={steps}", "ppo.save_steps=0"]
    for st in config.GROUP:  # at most `minibatches` optimizer steps per iteration and epoch, whole groups
        g = getattr(exp, st)
        rollout = min(g.rollout_batch, max(minibatches * g.minibatch, g.num_generations))
        ov += [f"{st}.rollout_batch={rollout}", f"{st}.steps={steps}", f"{st}.save_steps=0"]
    for st in TRAINED:
        ov += [f"{st.section}.{k}" for k in (f"max_steps={trained_steps or steps}", "eval_steps=0", "save_steps=0",
                                             "logging_steps=1")]
    return ov + extra


def run_stages(exp_path: str, ov: list[str], log, stages=None):
    """Each training stage in its own process, as `make` runs it; yields (stage, summary or error, wall seconds)."""
    env = {**os.environ, "RLHF_DISABLE_TRACKING": "1", "PYTHONUNBUFFERED": "1"}
    exp = config.load(exp_path, ov)
    for st in registry.with_upstream(stages or registry.training()):
        t0 = time.time()
        proc = subprocess.run(registry.command(st, exp_path, ov), capture_output=True, text=True, env=env, cwd=ROOT)
        wall = round(time.time() - t0, 1)
        log(f"  {st}: exit {proc.returncode} in {wall:.0f} s")
        for line in [x for x in proc.stderr.splitlines() if x.startswith(("WARNING", "warning:"))][:5]:
            log(f"    {line[:300]}")  # a finished stage's warnings (a sampler that fell back) are not discarded
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            log(tail)
            yield st, {"error": f"exit {proc.returncode}", "stderr_tail": tail}, wall
            return
        yield st, records.latest(exp, st, "gpucheck")[1], wall


def measure(exp_path: str, work: Path, steps: int, small: bool, extra: list[str], log=print,
            save=lambda result: None, stages=None, profile: int | None = 1, grad_check: bool = True,
            trained_steps: int | None = None, minibatches: int = 2, checks: bool = True,
            bandwidth: float | None = None) -> dict:
    """Build, run every training stage, compare with the plan; `extra` overrides come last (--shrink adds SMALL
    before them). PPO and GRPO: their throughput per iteration (the first apart) and composed as shipped, what their
    sampler decoded with and its decode step (against the weights' read time at `bandwidth`, bytes/s), their seconds
    per part of an iteration, and (unless `profile` is None) one iteration under torch.profiler after `profile`
    warm-up iterations (profile_iteration). `checks`: the sampling check and the separate decode step after PPO."""
    extra = [*(SMALL if small else []), *extra]
    exp0 = config.load(exp_path)
    pairs = work / "pairs.jsonl"
    shaped = config.load(exp_path, extra)
    texts = write_pairs(pairs, shaped, 8 + prompt_rows(exp0) + 24, exp0.seed)  # eval, the prompts, spare
    t0 = time.time()
    base = build_base(shaped, work / "base", texts, small)
    log(f"  base built and saved in {time.time() - t0:.0f} s")
    ov = overrides(exp0, base, pairs, work / "results", steps, extra, trained_steps, minibatches)
    exp = config.load(exp_path, ov)
    predicted = {p.stage: p for p in memplan.plans(exp)}
    result = {"experiment": exp_path, "model": exp0.model.name, "overrides": [o for o in ov if "=/" not in o],
              "sequence": {"max_length": exp.data.max_length, "max_prompt_length": exp.data.max_prompt_length,
                           "max_new_tokens": exp.ppo.response_length}, "base": str(base), "stages": {}}
    rows = result["stages"]
    for st, s, wall in run_stages(exp_path, ov, log, stages):
        row = {"wall_s": wall, "predicted_gb": round(predicted[st].peak_gb, 3),
               "predicted_peak_phase": predicted[st].peak_phase}
        if "error" in s:
            rows[st] = {**row, **s}
            save(result)
            continue
        mem = s["memory"]
        peak_phase = max(mem["phases"], key=lambda k: mem["phases"][k]["peak_gb"])
        top = mem["phases"][peak_phase]
        row.update(measured_gb=round(mem["peak_gb"], 3), measured_peak_phase=peak_phase,
                   peak_allocated_gb=top.get("peak_allocated_gb"), peak_reserved_gb=top.get("peak_reserved_gb"),
                   nvml_used_gb=top.get("nvml_used_gb"), peak_rss_gb=top.get("peak_rss_gb"),
                   prediction_error=round(mem["peak_gb"] / predicted[st].peak_gb - 1, 4), phases=mem["phases"],
                   throughput=s.get("throughput"), metrics=s.get("metrics"))
        if registry.get(st).online:
            row["online"] = online_throughput(st, exp, s, registry.get(st).config(exp0))
            row["episodes_per_s"] = row["online"]["episodes_per_s"]
            row["iteration_parts"] = iteration_parts(s)
            row["sampler"] = s.get("sampler")
            row["decode"] = stage_decode(exp, row["sampler"] or {}, bandwidth, small)
            if fell_back(row["sampler"]):
                row["failed"] = fell_back(row["sampler"])
                log(f"  {st}: FAILED: {row['failed']}")
        rows[st] = row
        save(result)
    if checks and all("error" not in r for r in rows.values()) and "ppo" in rows:
        t0 = time.time()
        if grad_check:
            try:
                result["checkpointing_gradients"] = checkpointing_gradients(exp)
            except Exception as e:  # reported, never hidden: the table says it failed and why
                result["checkpointing_gradients"] = {"error": f"{type(e).__name__}: {e}"}
            log(f"  checkpointing gradients: {result['checkpointing_gradients']} ({time.time() - t0:.0f} s)")
            save(result)
        if exp.quantization.load_in_4bit:
            t0 = time.time()
            try:
                result["sampling_copy"] = sampling_copy_check(exp)
            except Exception as e:  # reported, never hidden
                result["sampling_copy"] = {"error": f"{type(e).__name__}: {e}"}
            log(f"  sampling copy: {result['sampling_copy']} ({time.time() - t0:.0f} s)")
            save(result)
    if checks and "measured_gb" in rows.get("ppo", {}):
        t0 = time.time()
        result["decode"] = decode_step(exp, exp_path, base, small, log)
        result["decode_ms_per_step"] = result["decode"].get("ms_per_step")
        log(f"  decode step: {result['decode']} ({time.time() - t0:.0f} s)")
        save(result)
    for st in loops(rows):
        if profile is None or "measured_gb" not in rows.get(st, {}):
            continue
        t0 = time.time()
        try:
            rows[st]["profile"] = profile_iteration(exp_path, ov, st, profile, work)
            log(f"  {st} profile: iteration {profile + 1}, {rows[st]['profile']['wall_s']:.1f} s under the profiler "
                f"({time.time() - t0:.0f} s)")
        except Exception as e:  # reported, never hidden
            rows[st]["profile"] = {"error": f"{type(e).__name__}: {e}"}
            log(f"  {st} profile: FAILED {rows[st]['profile']['error']}")
        save(result)
    return result


def distinct(names) -> list[str]:
    """`names` less each stage whose module and memory plan an earlier one has (RLOO: GRPO's loop and plan)."""
    seen: set = set()
    out = []
    for n in names:
        key = (registry.get(n).module, registry.get(n).memplan)
        if key not in seen:
            seen.add(key)
            out.append(n)
    return out


def loops(names) -> list[str]:
    """The online stages of `names` whose iteration is profiled: one per loop (distinct)."""
    return distinct([n for n in names if registry.get(n).online])


def decode_step(exp, exp_path: str, base: Path, small: bool, log) -> dict:
    """One decode step of PPO's sampling as the plan runs it (the merged sampler, compiled where the plan holds the
    whole copy on a GPU; the plan's rows), timed on the experiment's base (decodebench.bench_base): ms per step
    and its ratio to the time reading the weights takes at the measured copy bandwidth."""
    from rlhf.memory import memplan as plans
    from rlhf.memory.memplan import compiled
    from rlhf.tools.decodebench import bench_base

    p = plans.plan(exp, "ppo")
    path = "merged_compiled" if compiled(exp, p.copy, arch(exp)) else "merged_eager" if p.copy else "4bit_lora"
    try:
        d = bench_base(exp, exp_path, base, p.sampling_rows, 8 if small else 48, small, [path], log, float("inf"))
    except Exception as e:  # reported, never hidden
        return {"error": f"{type(e).__name__}: {e}"}
    row = d["paths"][path]
    return {"path": path, "rows": p.sampling_rows, **row, "copy_bandwidth_gbps": d.get("copy_bandwidth_gbps"),
            **{k: v for k, v in (d.get("bound") or {}).items() if k.endswith("_ms")}}


def fell_back(sampler: dict | None) -> str | None:
    """Why a stage failed as measured when its sampler fell back from the plan's compiled decode (not as shipped: a
    figure of the eager path would pass for the product's); None when it did not."""
    if sampler and sampler.get("fell_back"):
        return f"the sampler fell back to eager decoding: {sampler.get('eager_reason')}"
    return None


def failures(report: dict) -> list[tuple[str, str]]:
    """(experiment, stage) of every stage that did not finish, or whose sampler fell back."""
    return [(Path(r["experiment"]).stem, st) for r in report["experiments"] for st, row in r["stages"].items()
            if "measured_gb" not in row or "failed" in row]


def stage_decode(exp, sampler: dict, bandwidth: float | None, small: bool) -> dict:
    """The decode step the stage's own sampler timed (ms, the median sampling call's) against the time reading the
    weights a step multiplies by takes at the measured copy `bandwidth` (bytes/s; None on a CPU): the decoder's
    linear layers in the compute dtype and the output head (decodebench.weight_bytes)."""
    from rlhf.inputs.models import DTYPES
    from rlhf.tools.bases import shape_of
    from rlhf.tools.decodebench import weight_bytes

    q = exp.quantization
    b = weight_bytes(shape_of(exp, small), DTYPES[q.compute_dtype if q.load_in_4bit else exp.model.dtype].itemsize)
    read_ms = round(1000 * b / bandwidth, 3) if bandwidth else None
    ms = sampler.get("decode_ms_per_step")
    return {"path": sampler.get("path"), "rows": sampler.get("rows"), "ms_per_step": ms, "weight_bytes": b,
            "weight_read_ms": read_ms, "x_weight_read": round(ms / read_ms, 2) if ms and read_ms else None}


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "cpu"


def main(argv=None) -> int:
    from rlhf.infra.toolchain import quiet_handled_warnings

    t_start = float(os.environ.get("GPUCHECK_T0") or time.time())  # the script's start: the wheels' install counts
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    quiet_handled_warnings()
    ap = argparse.ArgumentParser(prog="python -m rlhf.tools.gpucheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--exp", action="append", help=f"experiment(s) to measure (default: {' '.join(EXPERIMENTS)})")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"optimizer steps per stage (PPO: iterations; default: 3, --loan {LOAN['steps']})")
    ap.add_argument("--trained-steps", type=int, default=None, metavar="N",
                    help="optimizer steps of SFT, RM, DPO, KTO (default: --steps)")
    ap.add_argument("--dry-run", action="store_true", help="--shrink on CPU: checks the path (CI runs it)")
    ap.add_argument("--shrink", action="store_true",
                    help="shrunk architectures and sequences, one step each, the judge on 16 prompts (SMALL)")
    ap.add_argument("--stages", default=None,
                    help="training stages to measure, with what they need (default: "
                         f"{','.join(distinct(registry.training()))}: one stage of each module and memory plan; RLOO "
                         "has GRPO's)")
    ap.add_argument("--loan", action="store_true",
                    help=f"the GPU loan's one call (docs/performance.md): {LOAN['exp']}, stages {LOAN['stages']} "
                         f"({LOAN['steps']} iterations of one minibatch; SFT and RM {LOAN['trained_steps']} step on "
                         "the way), no gradient check, sampling check or profile; the decode step from the stages' own "
                         "sampler; DPO's earlier figure reused; then, if time remains, the int8 copy's decode step")
    ap.add_argument("--budget-s", type=float, default=None, metavar="S",
                    help="print the plan and its estimate (COST_S) and refuse it when over S seconds; the optional "
                         "int8 decode step runs only if its estimate fits what is left")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for every stage")
    ap.add_argument("--out", default=None, help="where the .json, .md (and .log) go (default: results/gpu, a dry run's "
                                                "results/gpu-dry-run: results/gpu holds the measured records, tracked)")
    ap.add_argument("--work", default=None, help="scratch folder for bases and runs (default: a temporary one)")
    ap.add_argument("--profile-warmup", type=int, default=1, metavar="N",
                    help="PPO and GRPO: iterations run before the one torch.profiler records (default: 1: the first "
                         "pays one-off costs and takes the judge's first measurement)")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled PPO and GRPO iterations")
    ap.add_argument("--no-grad-check", action="store_true", help="skip the gradient-checkpointing on/off check")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print earlier runs' measured peaks beside the "
                    "memory plan's prediction now, and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(replan(args.table))
        return 0
    if args.loan:
        args.exp = args.exp or [LOAN["exp"]]
        args.stages = args.stages or LOAN["stages"]
        args.trained_steps = args.trained_steps or LOAN["trained_steps"]
        args.no_profile = args.no_grad_check = True
    stages = (args.stages or ",".join(distinct(registry.training()))).split(",")
    steps = args.steps or (LOAN["steps"] if args.loan else 3)
    minibatches = LOAN["minibatches"] if args.loan else 2
    trained = args.trained_steps or steps
    device = "cpu" if args.dry_run else "cuda"
    print(preflight(device), flush=True)  # one line, before anything is built
    if args.dry_run:
        print("dry run: random weights, shrunk, on the CPU: the stages' warnings below (a reward model at chance, no "
              "EOS) are about those weights; the run checks the path", flush=True)
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the checks' own loads and saves (the stages run in processes of their own)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: the gradient check's
    # deterministic GEMMs need it
    if not args.dry_run and not torch.cuda.is_available():
        print("error: gpucheck needs a CUDA device (use --dry-run to check the path on CPU)", file=sys.stderr)
        return 2
    exps = args.exp or EXPERIMENTS
    parts = [row for _ in exps for row in estimate(stages, steps, trained, minibatches)]
    parts = [parts[0], *(r for r in parts[1:] if r[0] != "setup")]
    total = sum(r[2] for r in parts)
    print(f"plan ({len(exps)} experiment(s); estimate at Llama-2-7B NF4, 512-token rows, on an H100: COST_S):",
          flush=True)
    for name, what, sec in parts:
        print(f"  {name:<6} {what:<48} ~{sec:.0f} s", flush=True)
    int8 = args.loan
    print(f"  total ~{total:.0f} s" + (f" of the {args.budget_s:.0f} s budget" if args.budget_s else "")
          + (f"; then the int8 decode step (~{COST_S['int8']} s) if it fits what is left" if int8 else ""), flush=True)
    if args.budget_s is not None and total > args.budget_s:
        print(f"error: the plan's estimate, {total:.0f} s, is over --budget-s {args.budget_s:.0f}: measure fewer stages "
              f"or steps (--stages, --steps), or give it more time", file=sys.stderr)
        return 2
    deadline = t_start + (args.budget_s if args.budget_s is not None else float("inf"))
    report = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "device": device_name(),
              "mode": ("dry run: CPU, shrunk shapes" if args.dry_run else "shrunk shapes" if args.shrink
                       else "full shapes") + (", the loan" if args.loan else "")
                      + (f", {' '.join(args.set)}" if args.set else ""),
              **toolchain.versions(), "lock": toolchain.locked_stack(), "experiments": []}
    # torch, CUDA and driver beside every figure, and whether they are the lock's (the .md's first line says how not)
    report["differs_from_lock"] = toolchain.lock_differences(report, report["lock"])
    out = Path(args.out or ROOT / "results" / ("gpu-dry-run" if args.dry_run else "gpu"))
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.date.today()}-{'dry-run' if args.dry_run else device_name().replace(' ', '-')}"
    if args.shrink and not args.dry_run:
        stem += "-shrunk"
    if args.loan:
        stem += "-loan"
    bw = None
    if torch.cuda.is_available() and not args.dry_run:
        from rlhf.tools.decodebench import copy_bandwidth

        bw = copy_bandwidth()
    report["loan"] = {"plan": [{"part": n, "what": w, "estimate_s": s} for n, w, s in parts], "estimate_s": total,
                      "budget_s": args.budget_s, "wall_s": None,
                      "copy_bandwidth_gbps": round(bw / 1e9, 1) if bw else None,
                      **({"dpo_reused": dpo_reused(), "int8": {"skipped": "not reached"}} if args.loan else {})}
    logfile = out / f"{stem}.log"
    logfile.write_text("")

    def log(m):  # the console and the .log beside the .json: what a killed call printed comes back
        print(m, flush=True)
        with logfile.open("a") as f:
            f.write(m + "\n")

    with tempfile.TemporaryDirectory(prefix="gpucheck-", dir=args.work) as tmp:
        for exp_path in exps:
            log(f"{exp_path}:")
            work = Path(tmp) / Path(exp_path).stem
            work.mkdir(parents=True)
            done = list(report["experiments"])

            def save(result):  # after every stage: a run killed at its time limit keeps what it measured
                report["experiments"] = [*done, result]
                report["loan"]["wall_s"] = round(time.time() - t_start, 1)
                records.write_json(out / f"{stem}.json", report)
                (out / f"{stem}.md").write_text(markdown(report))

            result = measure(exp_path, work, steps, args.dry_run or args.shrink,
                             (["device=cpu"] if args.dry_run else []) + (
                                 [f"{s.section}.{k}" for s in ONLINE
                                  for k in (f"steps={steps}", f"judge_prompts={LOAN['judge_prompts']}")]
                                 + [f"{s.section}.max_steps={trained}" for s in TRAINED] if args.loan else [])
                             + args.set, log=log, save=save, stages=stages,
                             profile=None if args.no_profile else args.profile_warmup,
                             grad_check=not args.no_grad_check, trained_steps=trained, minibatches=minibatches,
                             checks=not args.loan, bandwidth=bw)
            if int8 and exp_path == exps[0]:
                left = deadline - time.time()
                if left >= COST_S["int8"] or args.dry_run:  # the dry run checks the path whatever the clock
                    report["loan"]["int8"] = int8_decode(exp_path, Path(result["base"]), out,
                                                         args.dry_run or args.shrink, 600 if args.dry_run else left, log)
                else:
                    report["loan"]["int8"] = {"skipped": f"{left:.0f} s left, under its ~{COST_S['int8']} s"}
                log(f"  int8 decode step: {report['loan']['int8']}")
                save(result)
    print(markdown(report, tops=False))
    print(f"wrote {out / stem}.json, .md and .log", flush=True)
    failed = failures(report)
    lacking = missing(report, loan_fields(stages)) if args.loan else []
    if lacking:
        log(f"the loan's figures missing from the report: {', '.join(lacking)}")
    return 1 if failed or lacking else 0


if __name__ == "__main__":
    from rlhf.tools import forkserver

    sys.exit(forkserver.main_of("rlhf.tools.gpucheck", main))
