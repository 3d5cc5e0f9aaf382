"""`make decodebench`: the policy's sampling at a shipped experiment's real shape on one CUDA device, one decode step
through each sampling path, under the experiment's memory budget (memory.budget_gb as the allocator's cap).

The base is the experiment's architecture with random weights (bases.build_base), loaded as the stages load it
(NF4, LoRA on the experiment's target modules, B matrices drawn so the adapter counts). `--rows` prompts of
data.max_prompt_length random tokens decode `--tokens` more tokens than a short run; a path's decode step is the
difference of the two runs' times over the difference of their steps (the prefill cancels). Paths:

  4bit_lora        the training model itself: every 4-bit layer dequantized and its LoRA branch run at every token
  copy_lora        the earlier default: the 4-bit layers dequantized once (models.dequantized), LoRA branches per token
  merged_eager     the merged sampler (rlhf/rl/sampler.py), eager, dynamic cache
  merged_compiled  the merged sampler with a static cache through transformers' compiled forward (CUDA graphs)
  apart_compiled   the same with the base dequantized but each LoRA branch kept apart (sampler merge=False)
  int8_compiled    the merged weights in int8 per output channel, dequantized inside the compiled step

Beside each: the kernels launched and the GPU's busy time per step (torch.profiler over one run), the bytes a step
must read (the weights it multiplies by, and the KV cache as decoded) and the time that takes at the device's copy
bandwidth measured here: the bound a step can approach. Then the per-token log-prob gap (bf16) between what each
sampler drew from and the training path's log-probs of the same tokens (generation.response_logprobs), the merge's
time, and the peak memory. Writes results/gpu/<date>-<device>-decode.json and .md. `--dry-run`: CPU, shrunk shapes
(CI runs it)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from rlhf.infra.toolchain import locked_stack, stack_line, versions

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ["experiments/llama2-7b-hh-4090.yaml", "experiments/llama31-8b-hh-4090.yaml"]
PATHS = ("4bit_lora", "copy_lora", "merged_eager", "merged_compiled")
REPEATS = 3
"""Runs of each length off a GPU, the best kept: a CPU's timings drift between single runs."""


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(gb: float = 2.0) -> float | None:
    """Bytes per second a device-to-device copy moves, counting bytes read and written (the best of five)."""
    import torch

    if not torch.cuda.is_available():
        return None
    n = int(gb * 1024**3) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(6):
        _sync()
        t0 = time.perf_counter()
        b.copy_(a)
        _sync()
        best = min(best, time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 / best


class Recorder:
    """A logits processor that keeps, per decode step, the log-prob (of logits / temperature) of the token the step
    then drew: what the sampler sampled from. transformers runs custom processors before its warpers."""

    def __init__(self, temperature: float):
        self.t, self.prev, self.out = temperature, None, []

    def __call__(self, input_ids, scores):
        import torch

        if self.prev is not None:
            self.out.append(self.prev.gather(1, input_ids[:, -1:]))
        self.prev = torch.log_softmax(scores.float() / self.t, -1)
        return scores

    def logprobs(self, sequences):
        import torch

        return torch.cat([*self.out, self.prev.gather(1, sequences[:, -1:])], 1)


def weight_bytes(a, itemsize: int) -> int:
    """Bytes of the weights a decode step multiplies by in an architecture `a` (memory.arch.Arch): every decoder
    layer's linear layers and the output head, at `itemsize` bytes per weight."""
    return (sum(i * o for i, o in a.linears().values()) * a.layers + a.vocab * a.hidden) * itemsize


def run_path(name: str, peft, sampler_of, ids, mask, new: int, length: int, **kw):
    """One generate call through path `name` (a merged one with a static cache of `length` tokens, the same for
    every call: its compiled graphs are made once); returns the sequences."""
    from rlhf.inputs import models

    if name in ("4bit_lora", "copy_lora"):
        import contextlib

        ctx = models.dequantized(peft) if name == "copy_lora" else contextlib.nullcontext()
        with ctx, models.autocast(peft):
            return peft.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 disable_compile=True, **kw)
    s = sampler_of(name)
    return s.generate(ids, mask, max_new_tokens=new, min_new_tokens=new, length=length, **kw)


def int8_weights(dense) -> int:
    """Replace the merged copy's linear weights by int8 per output channel (weight-only), dequantized in the forward:
    compiled, inductor may fuse the cast into the product. Returns the bytes they take."""
    import torch
    from torch import nn

    class Int8Linear(nn.Module):
        def __init__(self, lin):
            super().__init__()
            w = lin.weight.float()
            scale = w.abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
            self.register_buffer("q", torch.round(w / scale).to(torch.int8))
            self.register_buffer("scale", scale.squeeze(1).to(lin.weight.dtype))
            self.bias = lin.bias

        def forward(self, x):
            y = torch.nn.functional.linear(x, self.q.to(x.dtype)) * self.scale
            return y if self.bias is None else y + self.bias

    size = 0
    for name, mod in list(dense.named_modules()):
        if isinstance(mod, nn.Linear) and name.startswith("model.layers"):
            new = Int8Linear(mod)
            dense.set_submodule(name, new)
            size += new.q.numel() + 2 * new.scale.numel()
    return size


def bench_experiment(exp_path: str, work: Path, rows: int, tokens: int, small: bool, paths: list[str], log,
                     deadline: float, base: Path | None = None) -> dict:
    """Build the experiment's base (bases.build_base; `base`: one it built already) and measure `paths` on it
    (bench_base)."""
    import torch

    from rlhf.experiment import config
    from rlhf.tools.bases import SMALL, build_base, write_pairs

    extra = [*(SMALL if small else []), *(["device=cpu"] if small and not torch.cuda.is_available() else [])]
    exp = config.load(exp_path, extra)
    if base is None:
        texts = write_pairs(work / "pairs.jsonl", exp, 8, exp.seed)
        t0 = time.time()
        base = build_base(exp, work / "base", texts, small)
        log(f"  base built in {time.time() - t0:.0f} s")
    return bench_base(config.load(exp_path, [*extra, f"model.name={base}"]), exp_path, base, rows, tokens, small,
                      paths, log, deadline)


def bench_base(exp, exp_path: str, base: Path, rows: int, tokens: int, small: bool, paths: list[str], log,
               deadline: float) -> dict:
    """Each of `paths` on the base at `base` (saved by bases.build_base), loaded as `exp` loads it, under
    memory.budget_gb; `rows` prompts of data.max_prompt_length random tokens."""
    import torch

    from rlhf.experiment import config
    from rlhf.rl import generation, sampler
    from rlhf.inputs import models
    from rlhf.memory.arch import arch
    from rlhf.tools.bases import SMALL_ARCH

    t0 = time.time()
    tok = models.load_tokenizer(str(base))
    cuda = torch.cuda.is_available() and exp.device != "cpu"
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, exp.memory.budget_gb * 1024**3 / total), 0)
    peft = models.add_adapter(models.load_base(models.loading(exp), str(base), "causal", tok), exp.lora).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained adapter's size: its update about 1% of the base weight
        for name, prm in peft.named_parameters():
            if "lora_B" in name:
                prm.copy_((0.003 * torch.randn(prm.shape, generator=g)).to(prm.dtype))
    a = arch(exp)
    shape = {**{k: getattr(a, k) for k in ("vocab", "hidden", "layers", "heads", "kv_heads", "intermediate")},
             **(SMALL_ARCH if small else {})}
    log(f"  base loaded in {time.time() - t0:.0f} s")
    P, dev = exp.data.max_prompt_length, next(peft.parameters()).device
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(10, min(shape["vocab"], len(tok)) if small else shape["vocab"], (rows, P), generator=gen)
    ids, mask = ids.to(dev), torch.ones(rows, P, dtype=torch.long, device=dev)
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=tok.pad_token_id,
              eos_token_id=tok.eos_token_id)
    samplers: dict = {}

    def sampler_of(name):
        if name not in samplers:
            t = time.time()
            if name == "int8_compiled":
                s = sampler.MergedSampler(peft, compile=cuda)  # on a CPU (--dry-run) the path, eagerly
                s.sync()
                s.merged.clear()  # each bf16 weight freed as its int8 one replaces it
                samplers["int8_bytes"] = int8_weights(s.dense)
                s._stamp = s._stamp_now(s._adapter())  # merged once: int8 from the merged weights
            else:
                s = sampler.MergedSampler(peft, compile=name in ("merged_compiled", "apart_compiled") and cuda,
                                          merge=not name.startswith("apart"))
            samplers[name] = s
            samplers[f"{name}_build_s"] = time.time() - t
        return samplers[name]

    out = {"experiment": str(exp_path), "model": config.load(exp_path).model.name, "shape": shape, "rows": rows,
           "prompt_tokens": P, "paths": {}}
    bw = copy_bandwidth() if cuda else None
    out["copy_bandwidth_gbps"] = round(bw / 1e9, 1) if bw else None
    short = 4
    L = P + short + max(tokens, 32)
    for name in paths:
        if time.time() > deadline:
            out["paths"][name] = {"skipped": "deadline"}
            continue
        row: dict = {}
        try:
            torch.manual_seed(0)
            t = time.time()
            run_path(name, peft, sampler_of, ids, mask, short, L, **kw)  # warm-up (compiles)
            _sync()
            row["first_call_s"] = round(time.time() - t, 2)
            # each length's best of REPEATS runs, interleaved (one on a GPU: its synchronized times are steady; a
            # CPU's single runs drift by more than the dry run's whole decode, which made the step negative)
            times = {short: float("inf"), short + tokens: float("inf")}
            for _ in range(1 if cuda else REPEATS):
                for n in times:
                    _sync()
                    t = time.perf_counter()
                    run_path(name, peft, sampler_of, ids, mask, n, L, **kw)
                    _sync()
                    times[n] = min(times[n], time.perf_counter() - t)
            row["ms_per_step"] = round(1000 * (times[short + tokens] - times[short]) / tokens, 3)
            row["prefill_s"] = round(times[short] - short * row["ms_per_step"] / 1000, 4)
            if cuda:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    run_path(name, peft, sampler_of, ids, mask, short + 8, L, **kw)
                    _sync()
                kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
                row["kernels_per_step_approx"] = round(len(kernels) / (short + 8), 1)
                row["gpu_busy_ms_per_step_approx"] = round(sum(e.time_range.elapsed_us() for e in kernels) / 1000 / (short + 8), 3)
            if name.startswith(("merged", "int8", "apart")):
                s = samplers[name]
                row["copy_bytes"] = samplers.get("int8_bytes") if name == "int8_compiled" else s.bytes
                row["build_s"] = round(samplers[f"{name}_build_s"], 3)
                s.invalidate()
                _sync()
                t = time.perf_counter()
                if name != "int8_compiled":
                    s.sync()
                _sync()
                row["merge_s"] = round(time.perf_counter() - t, 4)
            # the log-prob gap: what the path sampled from against the training path's log-probs of its tokens
            rec = Recorder(1.0)
            torch.manual_seed(2)
            seq = run_path(name, peft, sampler_of, ids, mask, 32, L, logits_processor=[rec], **kw)
            resp = seq[:, P:]
            r = generation.Rollout(ids, mask, resp, torch.ones_like(resp), torch.ones(rows, dtype=torch.bool,
                                                                                    device=dev))
            with torch.no_grad():
                train_logp, _, _ = generation.response_logprobs(peft, r, 1.0)
            gap = (rec.logprobs(seq) - train_logp).abs()
            row.update(logprob_gap_max=float(gap.max()), logprob_gap_mean=float(gap.mean()),
                       logprob_gap_p99=float(gap.flatten().float().quantile(0.99)))
            if cuda:
                row["peak_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 1024**3, 3)
        except Exception as e:  # reported, never hidden
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        out["paths"][name] = row
        log(f"  {name}: {row}")
        samplers.pop(name, None)
        if cuda:
            torch._dynamo.reset()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    # the bound: the bytes a step reads (weights multiplied, the KV cache), at the copy bandwidth
    if bw and not small:
        w = weight_bytes(a, 2)
        kv = 2 * shape["layers"] * rows * (P + tokens // 2) * a.kv_dim * 2
        out["bound"] = {"weight_bytes": w, "kv_bytes_mid": kv, "weight_read_ms": round(1000 * w / bw, 3),
                        "weight_and_kv_read_ms": round(1000 * (w + kv) / bw, 3)}
        for row in out["paths"].values():
            if "ms_per_step" in row:
                row["x_weight_read"] = round(row["ms_per_step"] / out["bound"]["weight_read_ms"], 2)
    return out


def markdown(report: dict) -> str:
    lines = [f"# decodebench {report['date']} on {report['device']}", "",
             f"{stack_line(report)}; bitsandbytes "
             f"{report.get('bitsandbytes')}, transformers {report.get('transformers')}, peft {report.get('peft')}; "
             f"{report['mode']}", ""]
    for e in report["experiments"]:
        b = e.get("bound") or {}
        lines += [f"## {Path(e['experiment']).stem}: {e['rows']} rows, prompt {e['prompt_tokens']} tokens", "",
                  f"copy bandwidth {e.get('copy_bandwidth_gbps')} GB/s; a step reads {b.get('weight_bytes', 0) / 1e9:.2f}"
                  f" GB of weights ({b.get('weight_read_ms')} ms) and {b.get('kv_bytes_mid', 0) / 1e9:.2f} GB of KV "
                  f"cache mid-run ({b.get('weight_and_kv_read_ms')} ms with it)", "",
                  "| path | ms/step | x weight-read time | kernels/step (approx.) | first call s | "
                  "log-prob gap max / mean | peak GB | copy GB |", "|---|---|---|---|---|---|---|---|"]
        for name, r in e["paths"].items():
            if "ms_per_step" not in r:
                lines.append(f"| {name} | {r.get('error') or r.get('skipped')} | | | | | | |")
                continue
            cb = r.get("copy_bytes")
            lines.append(f"| {name} | {r['ms_per_step']:.2f} | {r.get('x_weight_read', '')} | "
                         f"{r.get('kernels_per_step_approx', '')} | "
                         f"{r['first_call_s']} | {r.get('logprob_gap_max', float('nan')):.3g} / "
                         f"{r.get('logprob_gap_mean', float('nan')):.3g} | {r.get('peak_allocated_gb', '')} | "
                         f"{'' if cb is None else f'{cb / 1024**3:.2f}'} |")
        lines.append("")
    return "\n".join(lines)


def merge(paths: list[str]) -> dict:
    """Several runs' reports as one (each experiment's paths from every run, a later run's over an earlier one's;
    the runs must share a device and versions)."""
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise SystemExit(f"decodebench --table: no such report: {', '.join(missing)} (a shell glob with no match is "
                         f"passed on as written: give each path whole)")
    reports = [json.loads(Path(p).read_text()) for p in paths]
    keys = ("device", "torch", "cuda", "driver", "bitsandbytes", "transformers", "peft")
    differ = [k for k in keys if len({r.get(k) for r in reports}) > 1]
    if differ:
        raise SystemExit(f"decodebench --table: the runs differ in {', '.join(differ)}")
    out = {**{k: reports[0].get(k) for k in (*keys, "mode")}, "date": reports[-1]["date"], "experiments": []}
    by_name: dict[str, dict] = {}
    for r in reports:
        for e in r["experiments"]:
            m = by_name.setdefault(e["experiment"], {**e, "paths": {}})
            m.update({k: v for k, v in e.items() if k != "paths"})
            m["paths"].update({k: v for k, v in e["paths"].items() if "ms_per_step" in v})
    out["experiments"] = list(by_name.values())
    return out


def main(argv=None) -> int:
    from rlhf.infra.toolchain import quiet_handled_warnings

    quiet_handled_warnings()
    ap = argparse.ArgumentParser(prog="python -m rlhf.tools.decodebench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--exp", action="append", help=f"experiment(s) (default: {' '.join(EXPERIMENTS)})")
    ap.add_argument("--rows", type=int, default=16, help="sequences decoded at once (default: %(default)s, the "
                    "shipped forward_batch)")
    ap.add_argument("--tokens", type=int, default=48, help="decode steps timed (default: %(default)s)")
    ap.add_argument("--paths", default=",".join(PATHS), help="the paths measured, in order (default: %(default)s; "
                    "int8_compiled: the merged copy in int8 weight-only)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, shrunk shapes: checks the path (CI runs it)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="per experiment: skip the paths left after this "
                    "many seconds")
    ap.add_argument("--out", default=str(ROOT / "results" / "gpu"))
    ap.add_argument("--work", default=None, help="scratch folder for the bases (default: a temporary one)")
    ap.add_argument("--base", default=None, help="a base bases.build_base saved for this experiment (gpucheck's): "
                    "measured on instead of building one (one --exp)")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="merge earlier runs' reports into one table (the "
                    "measured paths of each; --out names the .md), and exit")
    args = ap.parse_args(argv)
    if args.table:
        text = markdown(merge(args.table))
        if args.out.endswith(".md"):
            Path(args.out).write_text(text)
        print(text)
        return 0
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("error: decodebench needs a CUDA device (use --dry-run to check the path on CPU)", file=sys.stderr)
        return 2
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.dry_run else "cpu"
    report = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "device": dev, **versions(),
              "lock": locked_stack(),
              "mode": "dry run: CPU, shrunk shapes" if args.dry_run else "full shapes", "experiments": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.date.today()}-{'dry-run' if args.dry_run else dev.replace(' ', '-')}-decode"
    with tempfile.TemporaryDirectory(prefix="decodebench-", dir=args.work) as tmp:
        for exp_path in args.exp or EXPERIMENTS:
            print(f"{exp_path}:", flush=True)
            work = Path(tmp) / Path(exp_path).stem
            work.mkdir(parents=True)
            try:
                res = bench_experiment(exp_path, work, args.rows, args.tokens, args.dry_run, args.paths.split(","),
                                       lambda m: print(m, flush=True), time.time() + args.budget_s,
                                       Path(args.base) if args.base else None)
            except Exception as e:  # reported, never hidden
                import traceback

                traceback.print_exc()
                res = {"experiment": exp_path, "error": f"{type(e).__name__}: {e}", "paths": {}}
            report["experiments"].append(res)
            (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
            (out / f"{stem}.md").write_text(markdown(report))
            if torch.cuda.is_available():
                import gc

                gc.collect()
                torch.cuda.empty_cache()
    print(markdown(report))
    return 0 if all("error" not in e for e in report["experiments"]) else 1


if __name__ == "__main__":
    from rlhf.tools import forkserver

    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(forkserver.main_of("rlhf.tools.decodebench", main))
