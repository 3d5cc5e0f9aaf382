"""What `make gpucheck` computes from a run and checks on the device (rlhf/tools/gpucheck.py drives it): the
online stages' episodes and sampled tokens per second, SFT/RM/DPO's trained tokens per second as the published
anchors count them, PPO's gradients with gradient checkpointing on and off, and sampling through the merged sampler
against the training model itself."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rlhf.runs import records
from rlhf.experiment import stages


def iterations(summary: dict) -> list[dict]:
    """An online run's per-iteration records (metrics.jsonl's lines with `time/step_s` and `tokens_per_s`)."""
    path = Path(summary.get("run_dir", "")) / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return [x for x in lines if "time/step_s" in x and "tokens_per_s" in x]


def online_throughput(stage: str, exp, summary: dict, shipped=None) -> dict:
    """PPO/GRPO/RLOO: episodes (sampled responses) per second and prompt + response tokens of every sampled sequence
    (padding not) per second, both over the whole iteration's wall time, from the run's per-iteration records
    (its `tokens_per_s` is those tokens over the rollout and update seconds of that iteration). With two iterations
    or more, the first (the sampler's compile, the allocator's growth) is apart (`first_iteration_s`) and the figures
    are the later ones'. `shipped` (the stage's section as shipped): also `as_shipped` (composed)."""
    its = iterations(summary)
    st = stages.get(stage)
    rollout = getattr(st.config(exp), st.batch)
    if its:
        later = its[1:] or its
        seconds = sum(x["time/step_s"] for x in later)
        tokens = sum(x["tokens_per_s"] * (x["time/rollout_s"] + x["time/update_s"]) for x in later)
        out = {"episodes_per_s": round(rollout * len(later) / seconds, 3),
               "sampled_tokens_per_s": round(tokens / seconds, 1), "iterations": len(its)}
        if len(its) > 1:
            out.update(first_iteration_s=round(its[0]["time/step_s"], 3), measured_iterations=len(later))
        if shipped is not None:
            out["as_shipped"] = as_shipped(its, rollout, st.config(exp), exp.data.ppo_prompts, shipped)
        return out
    tp = summary["throughput"]  # the run's means (older records)
    return {"episodes_per_s": round(rollout / tp["step_s"], 3),
            "sampled_tokens_per_s": round(tp["tokens_per_s"] * (tp["rollout_s_per_step"] + tp["update_s_per_step"])
                                          / tp["step_s"], 1)}


def as_shipped(its: list[dict], rollout: int, section, prompts: int, shipped) -> dict | None:
    """Episodes per second at the shipped cadence, composed from a short run: each iteration's seconds without the
    judge (`time/step_s` - `time/judge_s`) per episode, over the iterations after the first, times the shipped
    rollout_batch; plus the judge's measurement (`time/judge_s` where it measured: overopt/judge in the line, less
    SFT's reference draw, `time/judge_reference_s`, which the first measurement makes once a run), scaled from the
    run's judge_prompts to the shipped ones, once every shipped judge_every iterations; the reference draw apart,
    scaled alike (`reference_draw_s`, once a run; None in a record made before it was timed). None without an
    iteration after the first or without a judge's measurement."""
    later, judged = its[1:], [x for x in its if "overopt/judge" in x]
    if not later or not judged:
        return None
    per_episode = sum(x["time/step_s"] - x.get("time/judge_s", 0.0) for x in later) / (len(later) * rollout)
    n = min(section.judge_prompts, prompts)
    scale = shipped.judge_prompts / n
    drawn = [x["time/judge_reference_s"] for x in judged if "time/judge_reference_s" in x]
    judge_s = sum(x["time/judge_s"] - x.get("time/judge_reference_s", 0.0) for x in judged) / len(judged) * scale
    step = shipped.rollout_batch * per_episode + judge_s / shipped.judge_every
    return {"episodes_per_s": round(shipped.rollout_batch / step, 3), "step_s": round(step, 3),
            "judge_s": round(judge_s, 3), "judge_share": round(judge_s / shipped.judge_every / step, 4),
            "reference_draw_s": round(sum(drawn) * scale, 3) if drawn else None,
            "rollout_batch": shipped.rollout_batch, "judge_every": shipped.judge_every,
            "judge_prompts": shipped.judge_prompts, "measured_judge_prompts": n,
            "seconds_per_episode": round(per_episode, 4)}


def trained_tokens_per_s(stage: str, exp, row: dict) -> tuple[float | None, str]:
    """(tokens/s, label) of an SFT/RM/DPO row: `trained_tokens_per_s` where the run counted it; for runs recorded
    before that count (their `tokens_per_s` counted the data set's tokens x epochs whatever max_steps stopped at, and
    for DPO the responses alone), recomputed from the settings: gpucheck's rows are exactly data.max_length tokens,
    so a step trains batch_size x grad_accum examples of that many tokens, each its stage's sequences (2, chosen and
    rejected, for RM and DPO)."""
    tp = row.get("throughput") or {}
    if tp.get("trained_tokens_per_s") is not None:
        return tp["trained_tokens_per_s"], "trained tok/s"
    st = stages.get(stage)
    t, steps = st.config(exp), (row.get("metrics") or {}).get("train_steps")
    if not steps or not tp.get("train_time_s"):
        return None, "trained tok/s"
    seqs = steps * getattr(t, st.batch) * t.grad_accum * st.sequences
    return seqs * exp.data.max_length / tp["train_time_s"], "trained tok/s (recounted)"


def _rel(a, b) -> float:
    """||a - b|| / ||b|| (b: the reference)."""
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def ppo_roles(exp):
    """PPO's roles (policy, reference, reward, value) on this experiment's gpucheck SFT and RM runs."""
    from rlhf.inputs import models
    from rlhf.recipes import ppo
    from rlhf.runs.runtime import upstream_sft

    _, sft_summary, tok = upstream_sft(exp, "gpucheck")
    _, rm_summary = records.latest(exp, "rm", "gpucheck")
    return ppo.make_roles(models.loading(exp), exp.ppo, sft_summary, rm_summary, tok, exp.rm.ensemble)


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

    from rlhf.inputs import data
    from rlhf.rl import generation
    from rlhf.recipes import ppo

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for deterministic GEMMs
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    # an op without a deterministic kernel warns (and the off-vs-off floor shows what it costs) rather than failing
    torch.use_deterministic_algorithms(True, warn_only=True)
    grads, outs, diffs = {}, {}, []
    shared = None  # (rollout, stats, advantages, returns) of the first setting, reused by the others
    try:
        for run, ckpt in (("off", False), ("off_again", False), ("on", True)):
            e = dataclasses.replace(exp, model=dataclasses.replace(exp.model, gradient_checkpointing=ckpt))
            roles = ppo_roles(e)
            tok = roles.tok
            if shared is None:
                prompts = [r["prompt"] for r in data.load(e).eval[:4]]
                torch.manual_seed(0)
                r = generation.generate(roles.model, tok, prompts, max_new_tokens=8, temperature=1.0, top_p=1.0,
                                        max_prompt_length=e.data.max_prompt_length, do_sample=False)
                g = torch.Generator().manual_seed(1)
                adv = torch.randn(r.mask.shape, generator=g).to(r.mask.device)
                returns = torch.randn(r.mask.shape, generator=g).to(r.mask.device)
                shared = (r, ppo.rollout_stats(roles, r, e.ppo, e.reward), adv, returns)
            else:  # this setting's own no-grad passes over the shared rollout must equal the first's
                own = ppo.rollout_stats(roles, shared[0], e.ppo, e.reward)
                diffs += [(own.tensors()[k].float() - v.float()).abs().max().item()
                          for k, v in shared[1].tensors().items()]
            r, st, adv, returns = shared
            roles.model.train()
            for prm in roles.trainable:
                prm.grad = None
            outs[run] = ppo.micro_step(roles, e.ppo, r, st, adv, returns, r.mask.float(), 1.0)
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
    """PPO's policy (this experiment's SFT and RM runs) samples `rows` held-out prompts for ppo.response_length through
    the training model itself (its 4-bit layers and LoRA branches) and through the merged sampler (rlhf/rl/sampler.py:
    the whole base, LoRA merged, compiled on a GPU), same seed, after a short warm-up of each (the sampler's
    compiles): the seconds of each, the sampler's bytes and whether it decoded compiled, the peak allocated, whether
    the samples are the same, and each sampler's log-prob gap to the training path (max and mean |log q - log pi|
    over response tokens; in bf16 the merged weight's rounding shows here: docs/algorithms.md)."""
    import torch

    from rlhf.inputs import data
    from rlhf.rl import generation

    roles = ppo_roles(exp)
    model, tok = roles.model, roles.tok
    model.eval()
    prompts = [r["prompt"] for r in data.load(exp).eval[:rows]]
    kw = dict(temperature=1.0, top_p=1.0, max_prompt_length=exp.data.max_prompt_length, batch_size=rows)
    cuda = torch.cuda.is_available()
    out, samples = {"rows": rows, "max_new_tokens": exp.ppo.response_length}, {}
    for name, copy in (("4bit", 0.0), ("merged", float("inf"))):
        generation.generate(model, tok, prompts, max_new_tokens=4, copy_bytes=copy, **kw)  # warm-up
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(exp.seed)
        t0 = time.perf_counter()
        r = samples[name] = generation.generate(model, tok, prompts, max_new_tokens=exp.ppo.response_length,
                                                copy_bytes=copy, **kw)
        if cuda:
            torch.cuda.synchronize()
            out[f"{name}_peak_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 1024**3, 3)
        out[f"{name}_s"] = round(time.perf_counter() - t0, 3)
        with torch.no_grad():
            logp, _, _ = generation.response_logprobs(model, r)
        gap = (r.sample_logp - logp).abs()[r.mask.bool()]
        out.update({f"{name}_logprob_gap_max": gap.max().item(), f"{name}_logprob_gap_mean": gap.mean().item()})
    s = model._rlhf_sampler
    out.update(speedup=round(out["4bit_s"] / out["merged_s"], 3), copy_bytes=s.bytes, compiled=s.compile,
               same_samples=bool(torch.equal(samples["4bit"].response, samples["merged"].response)),
               tokens=int(samples["merged"].mask.sum()))
    del roles, model, s
    if cuda:
        torch.cuda.empty_cache()
    return out
