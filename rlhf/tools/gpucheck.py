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
import contextlib
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from .. import config, records
from .. import stages as registry
from ..memory import memplan

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ["experiments/llama2-7b-hh-4090.yaml", "experiments/mistral-7b-h100.yaml"]
# --shrink: the same experiments with the architecture and sequences shrunk (seconds per stage); --dry-run: on CPU
SMALL_ARCH = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
SMALL = ["data.max_length=40", "data.max_prompt_length=24", "sft.max_steps=1", "rm.max_steps=1", "dpo.max_steps=1",
         *(f"{st}.{k}" for st in config.ONLINE for k in ("max_new_tokens=16", "steps=1"))]


def _family(name: str) -> str:
    return "mistral" if "mistral" in name.lower() else "llama"


def build_base(exp, out: Path, texts: list[str], small: bool) -> Path:
    """The experiment's architecture (memplan's, or a shrunk one) with random weights, built on its device and saved with a
    word-level tokenizer built from `texts`; the vocabulary is padded to the architecture's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from .. import models

    a = memplan.arch(exp)
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
    for st in ("sft", "rm", "dpo"):
        ov += [f"{st}.max_steps={steps}", f"{st}.eval_steps=0", f"{st}.save_steps=0", f"{st}.logging_steps=1"]
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


def online_throughput(stage: str, exp, summary: dict) -> dict:
    """PPO/GRPO/RLOO: episodes (sampled responses) per second and prompt + response tokens of every sampled sequence
    (padding not) per second, both over the whole iteration's wall time, from the run's per-iteration records
    (its `tokens_per_s` is those tokens over the rollout and update seconds of that iteration)."""
    lines = []
    path = Path(summary.get("run_dir", "")) / "metrics.jsonl"
    if path.exists():
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    its = [x for x in lines if "time/step_s" in x and "tokens_per_s" in x]
    rollout = getattr(exp, stage).rollout_batch
    if its:
        seconds = sum(x["time/step_s"] for x in its)
        tokens = sum(x["tokens_per_s"] * (x["time/rollout_s"] + x["time/update_s"]) for x in its)
        return {"episodes_per_s": round(rollout * len(its) / seconds, 3),
                "sampled_tokens_per_s": round(tokens / seconds, 1), "iterations": len(its)}
    tp = summary["throughput"]  # the run's means (older records)
    return {"episodes_per_s": round(rollout / tp["step_s"], 3),
            "sampled_tokens_per_s": round(tp["tokens_per_s"] * (tp["rollout_s_per_step"] + tp["update_s_per_step"])
                                          / tp["step_s"], 1)}


def trained_tokens_per_s(stage: str, exp, row: dict) -> tuple[float | None, str]:
    """(tokens/s, label) of an SFT/RM/DPO row: `trained_tokens_per_s` where the run counted it; for runs recorded
    before that count (their `tokens_per_s` counted the data set's tokens x epochs whatever max_steps stopped at, and
    for DPO the responses alone), recomputed from the settings: gpucheck's rows are exactly data.max_length tokens,
    so a step trains batch_size x grad_accum sequences (x 2, chosen and rejected, for RM and DPO) of that many."""
    tp = row.get("throughput") or {}
    if tp.get("trained_tokens_per_s") is not None:
        return tp["trained_tokens_per_s"], "trained tok/s"
    t, steps = getattr(exp, stage), (row.get("metrics") or {}).get("train_steps")
    if not steps or not tp.get("train_time_s"):
        return None, "trained tok/s"
    seqs = steps * t.batch_size * t.grad_accum * (1 if stage == "sft" else 2)
    return seqs * exp.data.max_length / tp["train_time_s"], "trained tok/s (recounted)"


def _speed(stage: str, exp, row: dict) -> str:
    """The throughput cell of the tables: what each figure counts, in its name."""
    if stage in config.ONLINE:
        on = row.get("online") or {}
        if "sampled_tokens_per_s" not in on:
            on = online_throughput(stage, exp, {"throughput": row.get("throughput") or {}})
        return f"{on['episodes_per_s']:.2f} episodes/s, {on['sampled_tokens_per_s']:,.0f} sampled tok/s"
    rate, label = trained_tokens_per_s(stage, exp, row)
    return f"{rate:,.0f} {label}" if rate is not None else "-"


def _rel(a, b) -> float:
    """||a - b|| / ||b|| (b: the reference)."""
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def checkpointing_gradients(exp) -> dict:
    """One PPO micro-batch with gradient checkpointing off, off again and on (reusing this experiment's SFT and RM
    runs), under deterministic algorithms (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG): one rollout
    (greedy, generated once) and its no-grad passes (old log-probs, values, reference, score) are reused by every
    setting, and each setting's own recomputation of those passes is checked equal to them. Reports, over all
    policy and value gradients together ("all") and by group, ||on - off|| / ||off|| (`rel_norm_diff`) beside the
    same between the two runs with it off (`floor_rel_norm_diff`: what the device's nondeterminism alone gives),
    and the worst tensor's relative max difference. Returns {"all", "policy", "value", "tensors", "rollout_stats_equal",
    "rollout_stats_max_abs_diff", "deterministic", "first_ratio_approx_kl"}."""
    import dataclasses

    import torch

    from .. import data, generation, ppo
    from ..runtime import upstream_sft

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for deterministic GEMMs
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    # an op without a deterministic kernel warns (and the off-vs-off floor shows what it costs) rather than failing
    torch.use_deterministic_algorithms(True, warn_only=True)
    grads, outs, diffs = {}, {}, []
    shared = None  # (rollout, stats, advantages, returns) of the first setting, reused by the others
    try:
        for run, ckpt in (("off", False), ("off_again", False), ("on", True)):
            e = dataclasses.replace(exp, model=dataclasses.replace(exp.model, gradient_checkpointing=ckpt))
            _, sft_summary, tok = upstream_sft(e, "gpucheck")
            _, rm_summary = records.latest(e, "rm", "gpucheck")
            roles = ppo.make_roles(e, sft_summary, rm_summary, tok)
            if shared is None:
                prompts = [r["prompt"] for r in data.load(e).eval[:4]]
                torch.manual_seed(0)
                r = generation.generate(roles.model, tok, prompts, max_new_tokens=8, temperature=1.0, top_p=1.0,
                                        max_prompt_length=e.data.max_prompt_length, do_sample=False)
                g = torch.Generator().manual_seed(1)
                adv = torch.randn(r.mask.shape, generator=g).to(r.mask.device)
                returns = torch.randn(r.mask.shape, generator=g).to(r.mask.device)
                shared = (r, ppo.rollout_stats(roles, r, 1.0), adv, returns)
            else:  # this setting's own no-grad passes over the shared rollout must equal the first's
                own = ppo.rollout_stats(roles, shared[0], 1.0)
                diffs += [(own.tensors()[k].float() - v.float()).abs().max().item()
                          for k, v in shared[1].tensors().items()]
            r, st, adv, returns = shared
            roles.model.train()
            for prm in roles.trainable:
                prm.grad = None
            outs[run] = ppo.micro_step(roles, r, st, adv, returns, r.mask.float(), 1.0)
            names = {id(p): n for n, p in roles.model.named_parameters()}
            grads[run] = {names.get(id(p), f"value_head.{i}"): p.grad.detach().float().cpu()
                          for i, p in enumerate(roles.trainable) if p.grad is not None}
            del roles
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
    assert set(grads["on"]) == set(grads["off"]) == set(grads["off_again"]), \
        "different tensors got gradients with checkpointing on and off"
    out = {"tensors": len(grads["off"]), "first_ratio_approx_kl": outs["off"]["approx_kl"], "deterministic": True,
           "rollout_stats_equal": max(diffs, default=0.0) == 0.0, "rollout_stats_max_abs_diff": max(diffs, default=0.0)}
    groups = {"all": lambda k: True, "policy": lambda k: ".policy." in k,
              "value": lambda k: ".value." in k or k.startswith("value_head")}
    for name, member in groups.items():  # ||x - off|| / ||off|| over the group's gradients, and the worst tensor
        keys = [k for k in grads["off"] if member(k)]
        if not keys:
            continue
        flat = {run: torch.cat([grads[run][k].reshape(-1) for k in keys]) for run in grads}
        out[name] = {"tensors": len(keys), "rel_norm_diff": _rel(flat["on"], flat["off"]),
                     "floor_rel_norm_diff": _rel(flat["off_again"], flat["off"]),
                     "worst_tensor_rel_max_diff": max(
                         ((grads["on"][k] - grads["off"][k]).abs().max()
                          / grads["off"][k].abs().max().clamp_min(1e-30)).item() for k in keys)}
    return out


def sampling_copy_check(exp, rows: int = 8) -> dict:
    """PPO's policy (this experiment's SFT and RM runs) samples `rows` held-out prompts for ppo.max_new_tokens through
    its 4-bit layers and through a dequantized copy of the whole base (models.dequantized), same seed, after a short
    warm-up of each: the seconds of each, the copy's bytes and the peak allocated while sampling through it, whether
    the samples are the same, and the log-prob gap of those samples between the copy and the 4-bit layers (max and
    mean |difference| over response tokens): float rounding is the bar (issue 38)."""
    import torch

    from .. import data, generation, models, ppo
    from ..runtime import upstream_sft

    _, sft_summary, tok = upstream_sft(exp, "gpucheck")
    _, rm_summary = records.latest(exp, "rm", "gpucheck")
    roles = ppo.make_roles(exp, sft_summary, rm_summary, tok)
    model = roles.model
    model.eval()
    prompts = [r["prompt"] for r in data.load(exp).eval[:rows]]
    kw = dict(temperature=1.0, top_p=1.0, max_prompt_length=exp.data.max_prompt_length, batch_size=rows)
    cuda = torch.cuda.is_available()
    out, samples = {"rows": rows, "max_new_tokens": exp.ppo.max_new_tokens}, {}
    for name, copy in (("4bit", 0.0), ("copy", float("inf"))):
        generation.generate(model, tok, prompts, max_new_tokens=4, copy_bytes=copy, **kw)  # warm-up
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(exp.seed)
        t0 = time.perf_counter()
        samples[name] = generation.generate(model, tok, prompts, max_new_tokens=exp.ppo.max_new_tokens,
                                            copy_bytes=copy, **kw)
        if cuda:
            torch.cuda.synchronize()
            out[f"{name}_peak_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 1024**3, 3)
        out[f"{name}_s"] = round(time.perf_counter() - t0, 3)
    out["speedup"] = round(out["4bit_s"] / out["copy_s"], 3)
    out["same_samples"] = bool(torch.equal(samples["4bit"].response, samples["copy"].response))
    r = samples["4bit"]
    with torch.no_grad():
        lp4, _, _ = generation.response_logprobs(model, r)
        with models.dequantized(model) as size:
            lpc, _, _ = generation.response_logprobs(model, r)
    gap = (lpc - lp4).abs()[r.mask.bool()]
    out.update(copy_bytes=size, logprob_gap_max=gap.max().item(), logprob_gap_mean=gap.mean().item(),
               tokens=int(r.mask.sum()))
    del roles, model
    if cuda:
        torch.cuda.empty_cache()
    return out


# ---- where an online iteration's time goes (issue 29): the parts the loop times, and torch.profiler's view of one
UPDATE_PARTS = ("update_policy", "update_value", "optimizer")
"""The loop's timed parts inside the update (time/update_s); the others are inside the rollout (time/rollout_s)."""


def iteration_parts(summary: dict) -> dict:
    """Seconds per part of an online stage's iteration, from the run's per-iteration records (metrics.jsonl; the
    summary's `throughput` `<part>_s_per_step` means for a run without them): each part the loop times
    (`time/<part>_s`: generate, policy, value, ref, score, judge, reward_fns, update_policy, update_value,
    optimizer; GRPO times no part of its update), and what the parts leave of the rollout (`rollout_rest`), of the
    update (`update_rest`: all of GRPO's) and of the iteration (`bookkeeping`: after the update). Returns
    {"iterations", "step_s", "parts_s" (the mean per iteration), "share" (of step_s), "per_iteration"}."""
    lines = []
    path = Path(summary.get("run_dir", "")) / "metrics.jsonl"
    if path.exists():
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    its = [{k[len("time/"):-2]: v for k, v in x.items() if k.startswith("time/") and k.endswith("_s")}
           for x in lines if "time/step_s" in x]
    if not its:  # the run's means
        tp = summary.get("throughput") or {}
        its = [{("step" if k == "step_s" else k[:-len("_s_per_step")]): v for k, v in tp.items()
                if k == "step_s" or k.endswith("_s_per_step")}]
        if "step" not in its[0]:
            return {}

    def split(t: dict) -> dict:
        parts = {k: v for k, v in t.items() if k not in ("step", "rollout", "update")}
        rollout = sum(v for k, v in parts.items() if k not in UPDATE_PARTS)
        update = sum(v for k, v in parts.items() if k in UPDATE_PARTS)
        return {**parts, "rollout_rest": max(t.get("rollout", rollout) - rollout, 0.0),
                "update_rest": max(t.get("update", update) - update, 0.0),
                "bookkeeping": max(t["step"] - t.get("rollout", rollout) - t.get("update", update), 0.0)}

    per = [split(t) for t in its]
    keys = list(dict.fromkeys(k for p in per for k in p))
    mean = {k: round(sum(p.get(k, 0.0) for p in per) / len(per), 4) for k in keys}
    step = sum(t["step"] for t in its) / len(its)
    return {"iterations": len(its), "step_s": round(step, 4), "parts_s": mean,
            "share": {k: round(v / step, 4) if step else None for k, v in mean.items()},
            "per_iteration": [{"step_s": round(t["step"], 4), **{k: round(v, 4) for k, v in p.items()}}
                              for t, p in zip(its, per)]}


PROFILE_GROUPS = (  # (group, substrings of the lower-cased op or kernel name): the first group that matches
    ("other", ("optimizer",)),  # bitsandbytes' 8-bit optimizer (its ops and kernels) is not the weights' dequantization
    ("bnb_dequant", ("bitsandbytes", "bnb", "dequantize", "4bit")),  # dequantize_4bit, gemv_4bit, kDequantizeBlockwise,
    # kgemm_4bit_inference*, MatMul4BitBackward
    ("attention", ("scaled_dot_product", "attention", "flash", "fmha", "sdpa")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
                "aten::_addmm_activation", "mmbackward", "linearbackward", "gemm", "gemv", "xmma", "cublas",
                "cutlass", "splitkreduce")),  # MmBackward0, AddmmBackward0, BmmBackward0: the autograd nodes
)
GROUP_ORDER = ("bnb_dequant", "matmul", "attention", "other")


def profile_group(name: str, parents=()) -> str:
    """The group of an op (or kernel) `name` called inside `parents` (innermost first): the first of its own name and
    its enclosing ops' names that PROFILE_GROUPS knows decides, so an op a bitsandbytes or attention op runs inside
    (a copy, an allocation) counts there; "other" when none does."""
    for n in (name, *parents):
        low = n.lower()
        for group, keys in PROFILE_GROUPS:
            if any(k in low for k in keys):
                return group
    return "other"


def group_profile(events, wall_s: float | None = None, rest: str = "untraced", top: int = 10) -> dict:
    """Self time by group of a profile's events: each event is (name, self seconds) or (name, self seconds,
    enclosing op names innermost first). Returns {"total_s": the events' self time, "groups": {group: {"s",
    "share"}}, "top": the `top` (name, group) pairs by self time, with "s", "calls", "share"}. With `wall_s` (the
    iteration's wall time) the time no event covers, wall_s - total_s, is one more group, `rest` ("untraced" for CPU
    ops: Python and whatever runs outside an op; "idle" for device kernels), and every share is of wall_s;
    without it, of total_s."""
    groups = dict.fromkeys(GROUP_ORDER, 0.0)
    by_name: dict[tuple[str, str], list] = {}
    for ev in events:
        name, s, parents = ev[0], float(ev[1]), (tuple(ev[2]) if len(ev) > 2 else ())
        g = profile_group(name, parents)
        groups[g] += s
        row = by_name.setdefault((name, g), [0.0, 0])
        row[0] += s
        row[1] += 1
    total = sum(groups.values())
    out = {"total_s": round(total, 6)}
    if wall_s is not None:
        groups[rest] = max(wall_s - total, 0.0)
        out["wall_s"] = round(wall_s, 6)
    base = wall_s if wall_s is not None and wall_s > total else total
    out["groups"] = {g: {"s": round(s, 6), "share": round(s / base, 4) if base else 0.0} for g, s in groups.items()}
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    out["top"] = [{"name": n if len(n) <= 160 else n[:157] + "...", "group": g, "s": round(s, 6), "calls": c,
                   "share": round(s / base, 4) if base else 0.0} for (n, g), (s, c) in ranked]
    return out


def profile_events(events) -> tuple[list, list]:
    """(CPU ops, device kernels) of a torch.profiler event list as group_profile's (name, self seconds, enclosing op
    names) triples: every CPU op's self time; every kernel (and memcpy/memset) the profiler attached to the CPU op that
    launched it, inside that op and its parents (the device events alone, without parents, where it attached none)."""
    from torch.autograd import DeviceType

    def chain(e):
        out = []
        while e is not None:
            out.append(e.name)
            e = e.cpu_parent
        return tuple(out)

    cpu, dev = [], []
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue
        if not e.is_async:
            cpu.append((e.name, e.self_cpu_time_total / 1e6, chain(e.cpu_parent)))
        if e.kernels:
            parents = chain(e)
            dev += [(k.name, k.duration / 1e6, parents) for k in e.kernels]
    if not dev:
        dev = [(e.name, (e.time_range.end - e.time_range.start) / 1e6) for e in events
               if e.device_type != DeviceType.CPU]
    return cpu, dev


@contextlib.contextmanager
def _quiet(into: Path):
    """Everything written to this process's stdout and stderr, by Python and by C (tqdm's bar, warnings, the profiler's
    own lines), goes to `into` instead, the console staying quiet."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with into.open("wb") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


class _ProfiledIteration:
    """An online loop's iterations (setup()'s `bar`) with torch.profiler on for one of them, iteration `step`: it starts
    when the loop takes that step and stops when the loop asks for the next (the whole iteration: rollout, update,
    bookkeeping); the rest of the bar (set_postfix) passes through."""

    def __init__(self, bar, step: int, activities):
        self.bar, self.step, self.activities = bar, step, activities
        self.prof, self.wall_s = None, None

    def __getattr__(self, name):
        return getattr(self.bar, name)

    def __iter__(self):
        import torch
        from torch.profiler import profile

        def sync():
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        for step in self.bar:
            if step != self.step:
                yield step
                continue
            sync()
            self.prof = profile(activities=self.activities)
            self.prof.start()
            t0 = time.perf_counter()
            try:
                yield step
            finally:
                sync()
                self.wall_s = time.perf_counter() - t0
                self.prof.stop()


def profile_iteration(exp_path: str, ov: list[str], stage: str, warmup: int = 1, work: Path | None = None,
                      top: int = 10) -> dict:
    """One iteration of an online stage under torch.profiler (CPU ops, and CUDA kernels where there is a device), in
    this process: the stage as gpucheck ran it, `warmup` + 1 iterations, the last profiled (the first pays one-off
    costs: kernel selection, allocator growth). The stage's own loop runs unchanged; only its iterations (online.setup's
    bar) are wrapped, and its output goes to a file. Returns {"iteration", "activities", "wall_s" (the profiled
    iteration, profiler on), "parts_s" (its timed parts, iteration_parts' split), "cpu" and "device" (group_profile of
    the CPU ops' and the kernels' self time against wall_s; device None on a CPU)}."""
    import torch
    from torch.profiler import ProfilerActivity

    from .. import online

    exp = config.load(exp_path, [*ov, f"{stage}.steps={warmup + 1}"])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    real, wrapped = online.setup, []

    def setup(*args, **kwargs):
        s = real(*args, **kwargs)
        s.bar = _ProfiledIteration(s.bar, warmup + 1, activities)
        wrapped.append(s.bar)
        return s

    log = Path(work or tempfile.gettempdir()) / f"profile-{stage}-{os.getpid()}.log"
    online.setup = setup
    try:
        with _quiet(log):
            summary = registry.get(stage).run(exp, resume=False)
    except BaseException as e:
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-15:]) if log.exists() else ""
        raise RuntimeError(f"{type(e).__name__}: {e}\n{tail}") from e
    finally:
        online.setup = real
    (it,) = wrapped
    if it.prof is None:
        raise RuntimeError(f"{stage} never ran iteration {warmup + 1}")
    cpu, dev = profile_events(it.prof.events())
    parts = iteration_parts(summary)
    last = (parts.get("per_iteration") or [{}])[-1]
    return {"iteration": warmup + 1, "activities": [a.name.lower() for a in activities],
            "wall_s": round(it.wall_s, 4), "parts_s": last, "cpu": group_profile(cpu, it.wall_s, "untraced", top),
            "device": group_profile(dev, it.wall_s, "idle", top) if torch.cuda.is_available() else None}


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
        if st in config.ONLINE:
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
    for st in ("ppo", "grpo"):
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


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "cpu"


def markdown(report: dict, tops: bool = True) -> str:
    """The .md beside the .json; `tops=False` (the console's copy) leaves out the profiles' top-op tables."""
    lines = [f"# gpucheck {report['date']} on {report['device']}", "",
             f"torch {report['torch']}, bitsandbytes {report.get('bitsandbytes')}, transformers "
             f"{report.get('transformers')}; {report['mode']}", "",
             "Throughput: trained tok/s = every token of every trained sequence (prompt and response; chosen and "
             "rejected) per second of training; sampled tok/s = prompt + response tokens of every sampled sequence "
             "per second of the whole iteration.", "",
             "| experiment | stage | predicted GB | measured GB (probe) | error | torch allocated | torch reserved | "
             "NVML process | peak phase | throughput |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["experiments"]:
        name = Path(r["experiment"]).stem
        exp = config.load(ROOT / r["experiment"], _settings(r))
        for st, row in r["stages"].items():
            if "measured_gb" not in row:
                lines.append(f"| {name} | {st} | {row['predicted_gb']:.2f} | FAILED: {row.get('error')} | | | | | | |")
                continue
            speed = _speed(st, exp, row)

            def gb(k):
                return f"{row[k]:.2f}" if row.get(k) is not None else "-"
            lines.append(f"| {name} | {st} | {row['predicted_gb']:.2f} | {row['measured_gb']:.2f} | "
                         f"{row['prediction_error']:+.1%} | {gb('peak_allocated_gb')} | {gb('peak_reserved_gb')} | "
                         f"{gb('nvml_used_gb')} | {row['measured_peak_phase']} | {speed} |")
        cg = r.get("checkpointing_gradients")
        if cg and "all" in cg:
            lines.append(f"\n{name}: PPO gradients (all {cg['all']['tensors']} policy and value tensors), checkpointing "
                         f"on vs off: relative norm difference {cg['all']['rel_norm_diff']:.3g}; off vs off (the "
                         f"floor): {cg['all']['floor_rel_norm_diff']:.3g}; deterministic algorithms, one rollout "
                         f"(its passes equal in every setting: {cg['rollout_stats_equal']}). {cg}\n")
        elif cg:
            lines.append(f"\n{name}: PPO gradients with checkpointing on vs off: {cg}\n")
        sc = r.get("sampling_copy")
        if sc and "error" not in sc:
            lines.append(f"\n{name}: PPO's policy sampling {sc['rows']} prompts x {sc['max_new_tokens']} new tokens: "
                         f"4-bit layers {sc['4bit_s']:.2f} s, dequantized copy ({sc['copy_bytes'] / 1024**3:.2f} GB) "
                         f"{sc['copy_s']:.2f} s ({sc['speedup']:.2f}x); same samples: {sc['same_samples']}; "
                         f"log-prob gap over {sc['tokens']} tokens: max {sc['logprob_gap_max']:.2e}, mean "
                         f"{sc['logprob_gap_mean']:.2e}. {sc}\n")
        elif sc:
            lines.append(f"\n{name}: sampling copy check: {sc}\n")
    timing = [line for r in report["experiments"] for st, row in r["stages"].items()
              for line in time_markdown(Path(r["experiment"]).stem, st, row, tops)]
    if timing:
        lines += ["", "## Where an iteration's time goes", "",
                  "Seconds per part of an iteration (the loop's `time/<part>_s`; rollout_rest, update_rest: what "
                  "the timed parts leave of the rollout and of the update; bookkeeping: after the update), then one "
                  "iteration under torch.profiler: self time by group (bnb_dequant: bitsandbytes' 4-bit ops and "
                  "kernels; matmul; attention; other ops; untraced: CPU time outside any op, Python; idle: no kernel "
                  "running), as a share of that iteration's wall time (profiler on), and the top ops and kernels. "
                  "docs/performance.md says how to read it.", *timing]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


def time_markdown(name: str, stage: str, row: dict, tops: bool = True) -> list[str]:
    """The markdown lines of an online stage's time per part and its profiled iteration (none for other stages)."""
    parts, prof = row.get("iteration_parts"), row.get("profile")
    if not parts and not prof:
        return []
    out = [""]
    if parts:
        out.append(f"**{name} {stage}**: {parts['step_s']:.3g} s per iteration (mean of {parts['iterations']}): " +
                   ", ".join(f"{k} {v:.3g} s ({parts['share'][k]:.0%})" for k, v in parts["parts_s"].items()
                             if parts["share"].get(k) is not None) + ".")
    if prof and "error" in prof:
        out.append(f"\n{name} {stage} profile: FAILED {prof['error']}")
    elif prof:
        def groups(g: dict) -> str:
            return ", ".join(f"{k} {v['s']:.3g} s ({v['share']:.0%})" for k, v in g["groups"].items())

        out.append(f"\nProfile of iteration {prof['iteration']} ({', '.join(prof['activities'])}; {prof['wall_s']:.3g} "
                   f"s with the profiler on):" + (f" device kernels: {groups(prof['device'])};" if prof.get("device")
                                                  else "") + f" CPU ops: {groups(prof['cpu'])}.")
        for kind, g in (("device kernels", prof.get("device")), ("CPU ops", prof["cpu"])):
            if tops and g and g["top"]:
                out += ["", f"| top {kind}, self time | group | s | calls | share |", "|---|---|---|---|---|"]
                out += [f"| {_cell(t['name'])} | {t['group']} | {t['s']:.4g} | {t['calls']} | {t['share']:.1%} |"
                        for t in g["top"]]
    return out


def _settings(r: dict) -> list[str]:
    """A recorded experiment's overrides, less the data and base paths (a scratch folder, gone)."""
    return [o for o in r["overrides"] if not o.startswith(("data.source", "data.path"))]


def replan(paths: list[str]) -> str:
    """Measured peaks of earlier gpucheck runs beside what the memory plan predicts for the same settings now (the
    README's table): `python -m rlhf.tools.gpucheck --table results/gpu/*.json`."""
    lines = ["| experiment | stage | measured GB (NVML) | torch peak allocated | peak phase | predicted now | error now | "
             "training phases: measured / predicted / error | throughput |", "|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        report = json.loads(Path(path).read_text())
        for r in report["experiments"]:
            exp = config.load(ROOT / r["experiment"], _settings(r))
            for st, row in r["stages"].items():
                if "measured_gb" not in row:
                    continue
                p = memplan.plans(exp, [st])[0] if exp.device == "cuda" else memplan.plan(exp, st)
                speed = _speed(st, exp, row)
                # without the held-out check after training (the phase the plan calls eval)
                trained = max(ph["peak_gb"] for k, ph in row["phases"].items() if k != "eval")
                planned = p.peak_gb - p.components.get("held_out_check", 0.0) / 1024**3
                lines.append(f"| {Path(r['experiment']).stem} | {st} | {row['measured_gb']:.2f} | "
                             f"{max(ph['peak_allocated_gb'] for ph in row['phases'].values()):.2f} | "
                             f"{row['measured_peak_phase']} | {p.peak_gb:.2f} ({p.peak_phase}) | "
                             f"{p.peak_gb / row['measured_gb'] - 1:+.1%} | {trained:.2f} / {planned:.2f} / "
                             f"{planned / trained - 1:+.1%} | {speed} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from ..cli import quiet_handled_warnings

    quiet_handled_warnings()
    ap = argparse.ArgumentParser(prog="python -m rlhf.tools.gpucheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--exp", action="append", help=f"experiment(s) to measure (default: {' '.join(EXPERIMENTS)})")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per stage (PPO: iterations)")
    ap.add_argument("--dry-run", action="store_true", help="--shrink on CPU: checks the path (CI runs it)")
    ap.add_argument("--shrink", action="store_true", help="shrunk architectures and sequences, one step each")
    ap.add_argument("--stages", default=",".join(s for s in registry.training() if s != "rloo"),
                    help="training stages to measure, with what they need (default: %(default)s; RLOO has GRPO's "
                         "memory plan and loop)")
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
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: the gradient check's
    # deterministic GEMMs need it
    if not args.dry_run and not torch.cuda.is_available():
        print("error: gpucheck needs a CUDA device (use --dry-run to check the path on CPU)", file=sys.stderr)
        return 2
    report = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "device": device_name(),
              "mode": ("dry run: CPU, shrunk shapes" if args.dry_run else "shrunk shapes" if args.shrink
                       else "full shapes") + (f", {' '.join(args.set)}" if args.set else ""), "torch": torch.__version__, "experiments": []}
    for pkg in ("bitsandbytes", "transformers", "peft", "trl"):
        try:
            report[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            report[pkg] = None
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
