"""The sampling levers of issue 38, measured on the bench's shapes (bench/shapes.py) with PPO's own policy (the
shape's SFT and RM runs, as `make ppo` loads them) sampling `--rows` held-out prompts through the run-long
dequantized copy, as the online stages sample:

- `dynamic`: what the stages run (transformers' generate(), its dynamic KV cache);
- `static`: generate() with a static KV cache (`cache_implementation="static"`);
- `static+compile`: the same with the decode step compiled (torch.compile through transformers' CompileConfig, on
  every device), when the stack compiles it;
- `lean`: a decode loop with no logits processors or stopping criteria (the fewest Python operations per step),
  sampling from softmax(logits / T) as generate() does.

Each variant is timed over `--repeats` calls after a warm-up (the median counts) with the same seed, and checked for
the same samples as `dynamic`. Then the other lever, old log-probs from the sampling logits: the gap between the
log-probs of the sampled tokens under the logits generate() sampled from (KV cache, one token at a time) and under
a fresh pass over prompt + response (what the stages compute), in float32 and under bf16 autocast.

    OMP_NUM_THREADS=1 .venv/bin/python studies/decode_levers.py --shapes tiny bpe wide

Writes results/bench/<date>-decode.{md,json} (--out to choose another directory).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.shapes import SHAPES, build_bpe_base  # noqa: E402
from rlhf.experiment import config  # noqa: E402
from rlhf.inputs import data, models
from rlhf.rl import generation
from rlhf.maths import losses
from rlhf.tools.gpumetrics import ppo_roles  # noqa: E402
from studies.harness import OUT, TINY, parse, run, write  # noqa: E402

VARIANTS = ("dynamic", "static", "static+compile", "lean")


@torch.no_grad()
def lean_generate(model, tok, prompts, *, max_new_tokens, temperature, top_p, max_prompt_length, batch_size,
                  do_sample=True, copy_bytes=0.0):
    """generation.generate's sampling without generate(): prefill, then one forward per token on the KV cache, a
    token drawn by torch.multinomial from softmax(logits / T) (the draw generate() makes with top_p = 1, top_k = 0)."""
    assert top_p == 1.0 and do_sample
    q, qm = generation.encode_prompts(tok, prompts, max_prompt_length, next(model.parameters()).device)
    am, ids, past, out = qm, q, None, []
    done = torch.zeros(q.shape[0], dtype=torch.bool)
    with models.autocast(model):
        for _ in range(max_new_tokens):
            o = model(input_ids=ids, attention_mask=am, position_ids=generation.position_ids(am)[:, -ids.shape[1]:],
                      past_key_values=past, use_cache=True)
            past = o.past_key_values
            logits = o.logits[:, -1].float()
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1).squeeze(1)
            nxt = nxt.masked_fill(done, tok.pad_token_id)
            out.append(nxt)
            done |= nxt == tok.eos_token_id
            if bool(done.all()):
                break
            ids, am = nxt[:, None], torch.cat([am, am.new_ones((am.shape[0], 1))], 1)
    resp = torch.stack(out, 1)
    if resp.shape[1] < max_new_tokens:
        resp = torch.cat([resp, resp.new_full((resp.shape[0], max_new_tokens - resp.shape[1]), tok.pad_token_id)], 1)
    mask = generation.response_mask(resp, tok.eos_token_id)
    return generation.Rollout(q, qm, resp.masked_fill(mask == 0, tok.pad_token_id), mask,
                              (resp == tok.eos_token_id).any(1))


def sampler(model, variant: str):
    """generation.generate with the variant's generate() settings (the model's generate wrapped for the call)."""
    if variant == "lean":
        return lean_generate
    if variant == "dynamic":
        return generation.generate
    from transformers import CompileConfig

    extra = {"cache_implementation": "static"}
    if variant == "static+compile":
        cc = CompileConfig(mode="default", dynamic=False)
        cc._compile_all_devices = True  # transformers' switch for compiling off CUDA (a class attribute, not a field)
        extra["compile_config"] = cc
    else:
        extra["disable_compile"] = True
    inner = model.generate

    def generate(*a, **kw):
        model.generate = functools.partial(inner, **extra)
        try:
            return generation.generate(*a, **kw)
        finally:
            model.generate = inner
    return generate


def time_variant(model, tok, prompts, kw, variant, repeats, seed):
    fn = sampler(model, variant)
    try:
        fn(model, tok, prompts, **kw)  # warm-up (a compile happens here)
    except Exception as e:  # noqa: BLE001 - a lever the stack cannot run is reported as such
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}, None
    times, first = [], None
    for _ in range(repeats):
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        r = fn(model, tok, prompts, **kw)
        times.append(time.perf_counter() - t0)
        first = first or r
    return {"median_s": round(statistics.median(times), 4), "times_s": [round(t, 4) for t in times]}, first


@torch.no_grad()
def sampling_logits_gap(model, tok, prompts, kw, seed, bf16: bool) -> dict:
    """|log-prob of each sampled token under generate()'s sampling logits - under a fresh pass| over the response
    tokens (max, mean), in float32 or under bf16 autocast."""
    torch.manual_seed(seed)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
    q, qm = generation.encode_prompts(tok, prompts, kw["max_prompt_length"], next(model.parameters()).device)
    with ctx, generation.plain_generation_config(model):
        out = model.generate(input_ids=q, attention_mask=qm, max_new_tokens=kw["max_new_tokens"], do_sample=True,
                             top_k=0, top_p=1.0, temperature=kw["temperature"], eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, output_logits=True, return_dict_in_generate=True)
        resp = out.sequences[:, q.shape[1]:]
        sampled = torch.stack(out.logits, 1).float() / kw["temperature"]
        mask = generation.response_mask(resp, tok.eos_token_id)
        r = generation.Rollout(q, qm, resp.masked_fill(mask == 0, tok.pad_token_id), mask, resp[:, -1] >= 0)
        fresh, _, _ = generation.response_logprobs(model, r, kw["temperature"])
    cached = losses.logprobs_from_logits(sampled, r.response)
    gap = (cached - fresh).abs()[mask.bool()]
    return {"max": gap.max().item(), "mean": gap.mean().item(), "tokens": int(mask.sum())}


def shape_exp(name: str, results: str):
    s = SHAPES[name]
    ov = [f"results_dir={results}/{name}", *s.overrides]
    if s.bpe:
        base = build_bpe_base(config.load(TINY, ov), s.bpe, Path(results) / "bpe-base")
        ov.append(f"model.name={base}")
    return ov


def one_shape(name: str, results: str, rows: int, repeats: int) -> dict:
    ov = shape_exp(name, results)
    run(("sft", "rm"), ov)
    exp = config.load(TINY, ov)
    roles = ppo_roles(exp)
    model, tok = roles.model, roles.tok
    model.eval()
    prompts = [r["prompt"] for r in data.load(exp).eval[:rows]]
    kw = dict(max_new_tokens=exp.ppo.max_new_tokens, temperature=exp.ppo.temperature, top_p=1.0,
              max_prompt_length=exp.data.max_prompt_length, batch_size=rows)
    out = {"shape": name, "rows": rows, "max_new_tokens": kw["max_new_tokens"], "variants": {}}
    with models.dequantized(model, float("inf")):  # as the online stages sample on a CPU (memplan: the copy fits)
        base = None
        for v in VARIANTS:
            res, r = time_variant(model, tok, prompts, kw, v, repeats, exp.seed)
            if r is not None:
                base = base or r
                res["same_samples"] = bool(torch.equal(r.response, base.response))
                res["response_tokens"] = int(r.mask.sum())
            if v == "static+compile":  # transformers compiles no model whose quantizer says it cannot (4-bit bnb)
                q = getattr(model.get_base_model(), "hf_quantizer", None)
                res["compiled"] = q is None or bool(q.is_compileable)
            out["variants"][v] = res
            print(f"{name} {v}: {res}", file=sys.stderr, flush=True)
        out["sampling_logits_gap"] = {"float32": sampling_logits_gap(model, tok, prompts, kw, exp.seed, False),
                                      "bf16": sampling_logits_gap(model, tok, prompts, kw, exp.seed, True)}
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["Sampling levers (issue 38) on the CPU, PPO's policy through the dequantized copy, one thread "
             "(studies/decode_levers.py); median seconds per generate call, speed-up against `dynamic` (what the "
             "stages run), and whether the samples equal its samples (same seed).", "",
             "| shape | rows x tokens | " + " | ".join(VARIANTS) + " | sampling-logits log-prob gap, float32 (max / "
             "mean) | bf16 autocast (max / mean) |", "|---|---|" + "---|" * len(VARIANTS) + "---|---|"]
    for r in rows:
        base = r["variants"]["dynamic"]["median_s"]
        cells = []
        for v in VARIANTS:
            x = r["variants"][v]
            if "error" in x or not x.get("compiled", True):
                cells.append(f"failed: {x['error']}" if "error" in x else "not compiled (transformers: a 4-bit "
                             "bitsandbytes model is not compileable)")
                continue
            same = ", same" if x["same_samples"] else ", differ"
            cells.append(f"{x['median_s']:.3f} s ({base / x['median_s']:.2f}x{same})")
        g = r["sampling_logits_gap"]
        lines.append(f"| {r['shape']} | {r['rows']} x {r['max_new_tokens']} | " + " | ".join(cells)
                     + f" | {g['float32']['max']:.1e} / {g['float32']['mean']:.1e} | {g['bf16']['max']:.1e} / "
                       f"{g['bf16']['mean']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["tiny", "bpe", "wide"], choices=list(SHAPES))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    a = parse(ap, argv, "decode-", OUT.parent / "bench")
    torch.set_num_threads(1)
    rows = [one_shape(s, a.results, a.rows, a.repeats) for s in a.shapes]
    md = markdown(rows)
    print(md)
    write(a.out, "decode", md, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
