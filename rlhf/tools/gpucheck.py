"""`make gpucheck`: the shipped GPU experiments at their real shapes on one CUDA device, measured.

For each experiment: build its base model from the architecture `make memplan` uses (random weights, no hub), a
word-level tokenizer and preference data whose rows are exactly the experiment's sequence lengths (prompt
`data.max_prompt_length`, whole sequence `data.max_length`; PPO generates `ppo.max_new_tokens` from the full prompt),
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

Writes results/gpu/<date>-<device>.json and .md. `--dry-run` runs the same code on CPU with the architectures shrunk
and one step each (CI runs it, so this does not rot between GPU loans).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import config, records, toolchain
from .. import stages as registry
from ..memory import memplan
from ..memory.arch import arch
from .gpumetrics import checkpointing_gradients, online_throughput, sampling_copy_check
from .gpuprofile import iteration_parts, profile_iteration
from .gpureport import markdown, replan

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ["experiments/llama2-7b-hh-4090.yaml", "experiments/llama31-8b-hh-4090.yaml"]
# --shrink: the same experiments with the architecture and sequences shrunk (seconds per stage); --dry-run: on CPU
SMALL_ARCH = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
TRAINED = [s for s in registry.REGISTRY.values() if s.trains and not s.online]
"""The stages on TRL's trainers (steps: their section's max_steps)."""
ONLINE = [s for s in registry.REGISTRY.values() if s.online]
"""Our online loops' stages (steps: their section's iterations)."""
SMALL = ["data.max_length=40", "data.max_prompt_length=24", *(f"{s.section}.max_steps=1" for s in TRAINED),
         *(f"{s.section}.{k}" for s in ONLINE for k in ("max_new_tokens=16", "steps=1"))]


def _family(name: str) -> str:
    return "mistral" if "mistral" in name.lower() else "llama"


def build_base(exp, out: Path, texts: list[str], small: bool) -> Path:
    """The experiment's architecture (memplan's, or a shrunk one) with random weights, built on its device and saved with a
    word-level tokenizer built from `texts`; the vocabulary is padded to the architecture's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from .. import models

    a = arch(exp)
    shape = dict(vocab=a.vocab, hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                 intermediate=a.intermediate)
    if small:
        shape.update(SMALL_ARCH)
    tok = models.build_tokenizer(texts)
    cfg_cls, model_cls = ((MistralConfig, MistralForCausalLM) if _family(exp.model.name) == "mistral"
                          else (LlamaConfig, LlamaForCausalLM))
    cfg = cfg_cls(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                  num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                  num_key_value_heads=shape["kv_heads"], max_position_embeddings=4096,
                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  tie_word_embeddings=a.tied)
    dtype = models.DTYPES[exp.model.dtype]
    dev = models.device(exp).type
    torch.manual_seed(exp.seed)
    with torch.device(dev):
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = model_cls(cfg)
        finally:
            torch.set_default_dtype(default)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


def write_pairs(path: Path, exp, n: int, seed: int = 0) -> list[str]:
    """n preference pairs in TRL's explicit-prompt format whose word-level token counts are the experiment's lengths:
    BOS + prompt = data.max_prompt_length, + response + EOS = data.max_length. Returns the texts (for the tokenizer)."""
    d = exp.data
    p_words, r_words = d.max_prompt_length - 1, d.max_length - d.max_prompt_length - 1
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(200)]
    texts = []
    with path.open("w") as f:
        for _ in range(n):
            row = {"prompt": " ".join(rng.choices(vocab, k=p_words)),
                   "chosen": " " + " ".join(rng.choices(vocab, k=r_words)),
                   "rejected": " " + " ".join(rng.choices(vocab, k=r_words))}
            f.write(json.dumps(row) + "\n")
            texts.append(" ".join(row.values()))
    return texts


def overrides(exp, base: Path, pairs: Path, results: Path, steps: int, extra: list[str]) -> list[str]:
    """The experiment as shipped, but on the random base and the exact-length data, a few steps per stage."""
    p = exp.ppo
    ppo_rollout = 2 * p.minibatch  # two optimizer steps per PPO iteration at the shipped micro/forward batches
    ov = [f"model.name={base}", "data.source=jsonl", f"data.path={pairs}", "data.sft_examples=64",
          "data.pref_pairs=64", "data.ppo_prompts=64", "data.eval_examples=8", "eval.prompts=4",
          f"results_dir={results}", "tracking.backend=none", "memory.cap_to_budget=true",
          f"ppo.rollout_batch={ppo_rollout}", f"ppo.steps={steps}", "ppo.save_steps=0"]
    for st in config.GROUP:  # at most two optimizer steps per iteration, whole groups
        g = getattr(exp, st)
        rollout = min(g.rollout_batch, 2 * g.minibatch)
        ov += [f"{st}.rollout_batch={rollout}", f"{st}.steps={steps}", f"{st}.save_steps=0"]
    for st in TRAINED:
        ov += [f"{st.section}.{k}" for k in (f"max_steps={steps}", "eval_steps=0", "save_steps=0", "logging_steps=1")]
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
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            log(tail)
            yield st, {"error": f"exit {proc.returncode}", "stderr_tail": tail}, wall
            return
        yield st, records.latest(exp, st, "gpucheck")[1], wall


def measure(exp_path: str, work: Path, steps: int, small: bool, extra: list[str], log=print,
            save=lambda result: None, stages=None, profile: int | None = 1, grad_check: bool = True) -> dict:
    """Build, run every training stage, compare with the plan; `extra` overrides come last (--shrink adds SMALL).
    PPO and GRPO: their seconds per part of an iteration, and (unless `profile` is None) one iteration under
    torch.profiler after `profile` warm-up iterations (profile_iteration)."""
    extra = [*(SMALL if small else []), *extra]
    exp0 = config.load(exp_path)
    pairs = work / "pairs.jsonl"
    shaped = config.load(exp_path, extra)
    texts = write_pairs(pairs, shaped, 96, exp0.seed)
    t0 = time.time()
    base = build_base(shaped, work / "base", texts, small)
    log(f"  base built and saved in {time.time() - t0:.0f} s")
    ov = overrides(exp0, base, pairs, work / "results", steps, extra)
    exp = config.load(exp_path, ov)
    predicted = {p.stage: p for p in memplan.plans(exp)}
    result = {"experiment": exp_path, "model": exp0.model.name, "overrides": [o for o in ov if "=/" not in o],
              "sequence": {"max_length": exp.data.max_length, "max_prompt_length": exp.data.max_prompt_length,
                           "max_new_tokens": exp.ppo.max_new_tokens}, "stages": {}}
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
            row["online"] = online_throughput(st, exp, s)
            row["episodes_per_s"] = row["online"]["episodes_per_s"]
            row["iteration_parts"] = iteration_parts(s)
        rows[st] = row
        save(result)
    if all("error" not in r for r in rows.values()) and "ppo" in rows:
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
    if "measured_gb" in rows.get("ppo", {}):
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
    from ..memory import memplan as plans
    from ..memory.memplan import compiled
    from .decodebench import bench_base

    p = plans.plan(exp, "ppo")
    path = "merged_compiled" if compiled(exp, p.copy, arch(exp)) else "merged_eager" if p.copy else "4bit_lora"
    try:
        d = bench_base(exp, exp_path, base, p.sampling_rows, 8 if small else 48, small, [path], log, float("inf"))
    except Exception as e:  # reported, never hidden
        return {"error": f"{type(e).__name__}: {e}"}
    row = d["paths"][path]
    return {"path": path, "rows": p.sampling_rows, **row, "copy_bandwidth_gbps": d.get("copy_bandwidth_gbps"),
            **{k: v for k, v in (d.get("bound") or {}).items() if k.endswith("_ms")}}


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "cpu"


def main(argv=None) -> int:
    from ..cli import quiet_handled_warnings

    quiet_handled_warnings()
    ap = argparse.ArgumentParser(prog="python -m rlhf.tools.gpucheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--exp", action="append", help=f"experiment(s) to measure (default: {' '.join(EXPERIMENTS)})")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per stage (PPO: iterations)")
    ap.add_argument("--dry-run", action="store_true", help="--shrink on CPU: checks the path (CI runs it)")
    ap.add_argument("--shrink", action="store_true", help="shrunk architectures and sequences, one step each")
    ap.add_argument("--stages", default=",".join(distinct(registry.training())),
                    help="training stages to measure, with what they need (default: %(default)s: one stage of each "
                         "module and memory plan; RLOO has GRPO's)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for every stage")
    ap.add_argument("--out", default=str(ROOT / "results" / "gpu"), help="where the .json and .md go")
    ap.add_argument("--work", default=None, help="scratch folder for bases and runs (default: a temporary one)")
    ap.add_argument("--profile-warmup", type=int, default=None, metavar="N",
                    help="PPO and GRPO: iterations run before the one torch.profiler records (default: 1; 0 on "
                         "--dry-run)")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled PPO and GRPO iterations")
    ap.add_argument("--no-grad-check", action="store_true", help="skip the gradient-checkpointing on/off check")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print earlier runs' measured peaks beside the "
                    "memory plan's prediction now, and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(replan(args.table))
        return 0
    if not args.dry_run:
        toolchain.require_driver()  # a driver too old for torch's CUDA: one line naming the fix, not "no CUDA device"
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: the gradient check's
    # deterministic GEMMs need it
    if not args.dry_run and not torch.cuda.is_available():
        print("error: gpucheck needs a CUDA device (use --dry-run to check the path on CPU)", file=sys.stderr)
        return 2
    report = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "device": device_name(),
              "mode": ("dry run: CPU, shrunk shapes" if args.dry_run else "shrunk shapes" if args.shrink
                       else "full shapes") + (f", {' '.join(args.set)}" if args.set else ""),
              **toolchain.versions(), "lock": toolchain.locked_stack(), "experiments": []}
    # torch, CUDA and driver beside every figure, and whether they are the lock's (the .md's first line says how not)
    report["differs_from_lock"] = toolchain.lock_differences(report, report["lock"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.date.today()}-{'dry-run' if args.dry_run else device_name().replace(' ', '-')}"
    if args.shrink and not args.dry_run:
        stem += "-shrunk"
    with tempfile.TemporaryDirectory(prefix="gpucheck-", dir=args.work) as tmp:
        for exp_path in args.exp or EXPERIMENTS:
            print(f"{exp_path}:", flush=True)
            work = Path(tmp) / Path(exp_path).stem
            work.mkdir(parents=True)
            done = list(report["experiments"])

            def save(result):  # after every stage: a run killed at its time limit keeps what it measured
                report["experiments"] = [*done, result]
                records.write_json(out / f"{stem}.json", report)
                (out / f"{stem}.md").write_text(markdown(report))

            measure(exp_path, work, args.steps, args.dry_run or args.shrink,
                    (["device=cpu"] if args.dry_run else []) + args.set, log=lambda m: print(m, flush=True), save=save,
                    stages=args.stages.split(","), profile=None if args.no_profile else
                    args.profile_warmup if args.profile_warmup is not None else int(not args.dry_run),
                    grad_check=not args.no_grad_check)
    print(markdown(report, tops=False))
    failed = [(Path(r["experiment"]).stem, st) for r in report["experiments"] for st, row in r["stages"].items()
              if "measured_gb" not in row]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
