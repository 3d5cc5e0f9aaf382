"""`make gpucheck` as a dry run (CPU, the shipped 4090 experiment's architecture shrunk, one step per stage): the
measurement a GPU loan runs cannot rot between loans. The GPU run itself wrote results/gpu/. And the throughput
accounting it reports (issue 29): trained tokens as the published anchors count them, every token of every trained
sequence (prompt and response, chosen and rejected); episodes and sampled tokens for the online stages; DPO's
reference computed once over several epochs with the same losses."""

import collections
import json
import os
import re
import shlex
import subprocess

import pytest

from rlhf.experiment import config, stages
from rlhf.memory.arch import arch
from rlhf.runs import records
from rlhf.tools import memcheck
from rlhf.tools import gpumetrics, gpuprofile, gpureport

from .conftest import ROOT, make


@pytest.mark.slow
def test_gpucheck_dry_run_runs_every_stage_with_the_shipped_settings_and_writes_the_table(tmp_path):
    proc = make("gpucheck", f"ARGS=--dry-run --out {tmp_path} --exp experiments/llama2-7b-hh-4090.yaml", timeout=900)
    out = proc.stdout
    # a quiet console: the checks' own loads and saves draw no transformers bar (the stages log to their own files)
    assert "Loading weights" not in proc.stderr and "Writing model shards" not in proc.stderr, proc.stderr[-2000:]
    (path,) = tmp_path.glob("*-dry-run.json")
    assert f"wrote {path.with_suffix('')}.json, .md and .log" in out  # the last line says where the figures went
    assert "\ndry run: random weights, shrunk, on the CPU: the stages' warnings below" in out
    assert path.with_suffix(".md").is_file() and path.with_suffix(".log").is_file()
    report = json.loads(path.read_text())
    assert report["mode"].startswith("dry run") and report["device"] == "cpu"
    (exp,) = report["experiments"]
    # the shipped settings, not the tiny ones: NF4 with bf16 compute, paged 8-bit AdamW, checkpointing, LoRA r=16
    assert not any(o.startswith(("quantization.", "lora.", "model.dtype", "model.gradient")) for o in exp["overrides"])
    assert exp["sequence"] == {"max_length": 40, "max_prompt_length": 24, "max_new_tokens": 16}
    assert list(exp["stages"]) == [s for s in stages.training() if s != "rloo"]  # RLOO: GRPO's plan and loop
    shipped = config.load(ROOT / "experiments" / "llama2-7b-hh-4090.yaml")
    for st, row in exp["stages"].items():
        assert row["measured_gb"] > 0 and row["predicted_gb"] > 0, (st, row)
        if st in ("ppo", "grpo"):  # prompt + response of every sampled sequence, and episodes, per second
            assert row["online"]["sampled_tokens_per_s"] > 0 and row["online"]["episodes_per_s"] > 0
            continue
        # one step of batch x grad_accum examples, each its sequences (chosen and rejected) of exactly 40 tokens
        t = getattr(shipped, st)
        assert row["throughput"]["trained_tokens"] == t.batch_size * t.grad_accum * stages.get(st).sequences * 40, st
        assert row["throughput"]["trained_tokens_per_s"] > 0 and "tokens_per_s" not in row["throughput"]
    assert exp["stages"]["ppo"]["episodes_per_s"] > 0 and exp["stages"]["grpo"]["episodes_per_s"] > 0
    # data without a ground truth: DPO's held-out check scores with the RM's adapter on the policy's own base
    assert exp["stages"]["dpo"]["metrics"]["eval_scored_by"] == "reward_model"
    grads = exp["checkpointing_gradients"]
    assert grads["policy"]["tensors"] > 0 and grads["value"]["tensors"] > 0
    assert grads["policy"]["rel_norm_diff"] <= 1e-5 and grads["value"]["rel_norm_diff"] <= 1e-5, grads
    # one rollout reused by every setting, its passes equal; the off-vs-off floor beside the on-vs-off difference
    assert grads["deterministic"] and grads["rollout_stats_equal"] and grads["rollout_stats_max_abs_diff"] == 0.0
    assert grads["all"]["tensors"] == grads["policy"]["tensors"] + grads["value"]["tensors"] == grads["tensors"]
    assert grads["all"]["floor_rel_norm_diff"] <= 1e-5 and grads["all"]["rel_norm_diff"] <= 1e-5, grads
    # PPO's policy sampling through the merged sampler (bf16, as shipped) and through the training model: each one's
    # log-prob gap to the training path, at bf16's rounding (the merge rounds W + BA once: docs/algorithms.md)
    sc = exp["sampling_copy"]
    assert "error" not in sc and sc["copy_bytes"] > 0 and sc["tokens"] > 0 and sc["compiled"] is False, sc
    assert 0 < sc["merged_logprob_gap_max"] <= 0.05 and sc["4bit_logprob_gap_max"] <= 0.05, sc
    # a decode step as the plan samples (CPU: the merged copy, eager), against the time its weights take to read
    d = exp["decode"]
    assert d["path"] == "merged_eager" and d["ms_per_step"] > 0 and d["rows"] >= 1, d
    assert exp["decode_ms_per_step"] == d["ms_per_step"]
    md = next(tmp_path.glob("*-dry-run.md")).read_text()
    assert "| llama2-7b-hh-4090 | ppo |" in md and "llama2-7b-hh-4090: PPO's policy sampling 8 prompts" in md
    assert "llama2-7b-hh-4090: a decode step of " in md
    assert " trained tok/s |" in md and " episodes/s, " in md and " sampled tok/s |" in md
    # where PPO's and GRPO's iteration time goes: the loop's timed parts, and one iteration under torch.profiler
    for st, timed in (("ppo", ("generate", "policy", "value", "ref", "update_policy", "update_value", "optimizer")),
                      ("grpo", ("generate", "policy", "ref", "update_rest"))):
        row = exp["stages"][st]
        parts = row["iteration_parts"]
        assert parts["iterations"] == 1 and all(parts["parts_s"][k] > 0 for k in timed), (st, parts)
        assert sum(parts["parts_s"].values()) == pytest.approx(parts["step_s"], abs=1e-3), (st, parts)
        prof = row["profile"]
        assert "error" not in prof, prof
        assert prof["iteration"] == 2 and prof["activities"] == ["cpu"] and prof["device"] is None
        cpu = prof["cpu"]
        assert {"bnb_dequant", "matmul", "attention", "other", "untraced"} == set(cpu["groups"]), cpu["groups"]
        assert all(cpu["groups"][g]["s"] > 0 for g in ("matmul", "attention", "other")), cpu["groups"]
        # the shipped NF4 base with room for a run-long dequantized copy (quantization.dequantized_copy=auto): made
        # once when the run starts; inside the iteration only the sampler's merge dequantizes, once per layer (not at
        # every token): a sliver of the iteration
        assert cpu["groups"]["bnb_dequant"]["share"] <= 0.01, cpu["groups"]
        assert sum(g["share"] for g in cpu["groups"].values()) == pytest.approx(1.0, abs=1e-3)
        assert 0 < cpu["total_s"] <= prof["wall_s"] and len(cpu["top"]) == 10
        assert prof["parts_s"]["generate"] > 0
    assert "## Where an iteration's time goes" in md and "| top CPU ops, self time | group | s | calls | share |" in md
    assert "**llama2-7b-hh-4090 grpo**: " in md and "Profile of iteration 2 (cpu; " in md


def test_decodebench_dry_run_measures_each_sampling_path_and_merges_runs_into_one_table(tmp_path):
    """`make decodebench` as a user types it, on the CPU (--dry-run: shrunk shapes): each path's decode step, the
    log-prob gap of what it sampled to the training path (float rounding for the merged copy kept in float32 is not
    the test here: the shipped bf16 compute rounds), its copy's bytes; --table merges two runs' paths into one."""
    out = tmp_path / "a"
    make("decodebench", f"ARGS=--dry-run --out {out} --exp experiments/llama2-7b-hh-4090.yaml "
                        "--paths 4bit_lora,merged_eager --tokens 16")  # 4 steps: within a CPU's noise
    (first,) = list(out.glob("*-dry-run-decode.json"))
    report = json.loads(first.read_text())
    assert report["device"] == "cpu" and {"torch", "transformers", "peft", "bitsandbytes"} <= set(report)
    paths = report["experiments"][0]["paths"]
    assert set(paths) == {"4bit_lora", "merged_eager"}
    for name, row in paths.items():
        assert "error" not in row and row["ms_per_step"] > 0 and 0 <= row["logprob_gap_max"] <= 0.05, (name, row)
    assert paths["merged_eager"]["copy_bytes"] > 0 and "copy_bytes" not in paths["4bit_lora"]
    second = json.loads(first.read_text())
    second["experiments"][0]["paths"] = {"apart_eager": {**paths["merged_eager"], "ms_per_step": 1.5}}
    other = tmp_path / "b.json"
    other.write_text(json.dumps(second))
    table = tmp_path / "table.md"
    make("decodebench", f"ARGS=--table {first} {other} --out {table}")
    md = table.read_text()
    assert all(f"| {name} |" in md for name in ("4bit_lora", "merged_eager", "apart_eager")), md


def test_the_decode_table_docs_cite_is_their_command_over_the_recorded_runs():
    """docs/performance.md's `--table results/gpu/2026-11-26-H200-decode/run*.json` makes the recorded table.md; a
    path that names no file (a glob the shell left as written) is one line, not a traceback."""
    from rlhf.tools import decodebench

    found = re.search(r'--table (results/gpu/\S+)"', (ROOT / "docs" / "performance.md").read_text())
    runs = sorted(str(p) for p in ROOT.glob(found.group(1)))
    table = (ROOT / found.group(1)).parent / "table.md"
    assert decodebench.markdown(decodebench.merge(runs)).strip() == table.read_text().strip()
    with pytest.raises(SystemExit, match=r"no such report: run3-\*\.json \(a shell glob with no match"):
        decodebench.merge([runs[0], "run3-*.json"])


def test_online_throughput_is_episodes_and_sampled_tokens_over_whole_iterations(tmp_path):
    exp = config.load(ROOT / "experiments" / "tiny.yaml")  # ppo.rollout_batch 64
    its = [{"step": 1, "tokens_per_s": 100.0, "time/rollout_s": 2.0, "time/update_s": 2.0, "time/step_s": 5.0},
           {"step": 2, "tokens_per_s": 300.0, "time/rollout_s": 1.0, "time/update_s": 1.0, "time/step_s": 3.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in its))
    out = gpumetrics.online_throughput("ppo", exp, {"run_dir": str(tmp_path)})
    # the first iteration apart: 600 prompt + response tokens and 64 episodes in 3 s, bookkeeping included
    assert out == {"episodes_per_s": 21.333, "sampled_tokens_per_s": 200.0, "iterations": 2, "first_iteration_s": 5.0,
                   "measured_iterations": 1}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(its[0]) + "\n")  # one iteration: that one
    assert gpumetrics.online_throughput("ppo", exp, {"run_dir": str(tmp_path)}) == {
        "episodes_per_s": 12.8, "sampled_tokens_per_s": 80.0, "iterations": 1}


def test_as_shipped_composes_the_judge_at_the_shipped_cadence_from_a_short_run(tmp_path):
    """Iteration 1 judged 64 prompts in 8 s; iterations 2 and 3 took 6 and 4 s for 32 episodes (no judge). Shipped:
    64-episode rollouts, 128 judge prompts every 5 iterations: 64 x 5 / 32 s + 16 s / 5 = 13.2 s per iteration."""
    exp = config.load(ROOT / "experiments" / "tiny.yaml", ["ppo.rollout_batch=32", "data.ppo_prompts=64"])
    its = [{"tokens_per_s": 1.0, "time/rollout_s": 9.0, "time/update_s": 1.0, "time/step_s": 20.0,
            "time/judge_s": 8.0, "overopt/judge": 0.5},
           {"tokens_per_s": 1.0, "time/rollout_s": 2.0, "time/update_s": 3.0, "time/step_s": 6.0, "time/judge_s": 0.0},
           {"tokens_per_s": 1.0, "time/rollout_s": 1.0, "time/update_s": 2.0, "time/step_s": 4.0, "time/judge_s": 0.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in its))
    shipped = config.load(ROOT / "experiments" / "llama2-7b-hh-4090.yaml").ppo  # 64 episodes, judge 128 every 5
    out = gpumetrics.online_throughput("ppo", exp, {"run_dir": str(tmp_path)}, shipped)
    assert out["episodes_per_s"] == 6.4 and out["first_iteration_s"] == 20.0
    a = out["as_shipped"]
    assert a["step_s"] == 13.2 and a["episodes_per_s"] == round(64 / 13.2, 3) and a["judge_s"] == 16.0
    assert a["judge_share"] == round(3.2 / 13.2, 4) and a["measured_judge_prompts"] == 64
    assert a["reference_draw_s"] is None  # a record from before the reference draw was timed
    # 3 of iteration 1's 8 judge seconds were SFT's reference draw, once a run: 5 s a measurement, 10 s shipped
    its[0]["time/judge_reference_s"] = 3.0
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in its))
    a = gpumetrics.online_throughput("ppo", exp, {"run_dir": str(tmp_path)}, shipped)["as_shipped"]
    assert a["judge_s"] == 10.0 and a["reference_draw_s"] == 6.0 and a["step_s"] == 12.0  # 64 x 5 / 32 + 10 / 5


def test_iteration_parts_split_each_iteration_into_its_timed_parts_and_what_they_leave(tmp_path):
    its = [{"step": 1, "time/step_s": 10.0, "time/rollout_s": 6.0, "time/update_s": 3.0, "time/generate_s": 4.0,
            "time/policy_s": 0.5, "time/ref_s": 0.5, "time/update_policy_s": 1.5, "time/update_value_s": 1.0,
            "time/optimizer_s": 0.25, "tokens_per_s": 1.0, "time/judge_s": 0.5, "time/judge_reference_s": 0.25},
           {"step": 2, "time/step_s": 6.0, "time/rollout_s": 4.0, "time/update_s": 1.5, "time/generate_s": 3.0,
            "time/policy_s": 0.5, "time/ref_s": 0.25, "time/update_policy_s": 0.75, "time/update_value_s": 0.5,
            "time/optimizer_s": 0.25, "tokens_per_s": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in its))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [its[0], its[1], its[1]]))
    out = gpuprofile.iteration_parts({"run_dir": str(tmp_path)})
    # iteration 1 (apart): rollout 6 - (4 + 0.5 + 0.5 + 0.5 judge, SFT's reference draw inside it) = 0.5 untimed,
    # update 3 - 2.75 = 0.25, bookkeeping 10 - 6 - 3 = 1;
    # iterations 2 and 3: 4 - 3.75 = 0.25, 1.5 - 1.5 = 0, 6 - 4 - 1.5 = 0.5
    assert out["iterations"] == 3 and out["step_s"] == 6.0
    assert out["parts_s"] == {"generate": 3.0, "policy": 0.5, "ref": 0.25, "update_policy": 0.75,
                              "update_value": 0.5, "optimizer": 0.25, "rollout_rest": 0.25, "update_rest": 0.0,
                              "bookkeeping": 0.5}
    assert sum(out["parts_s"].values()) == out["step_s"] and out["share"]["generate"] == 0.5
    first = out["first_iteration"]
    assert first == out["per_iteration"][0] and first["step_s"] == 10.0
    assert (first["rollout_rest"], first["update_rest"], first["bookkeeping"]) == (0.5, 0.25, 1.0)
    assert first["judge"] == 0.5 and "judge_reference" not in first
    assert len(out["per_iteration"]) == 3 and out["per_iteration"][1]["update_rest"] == 0.0
    # a run without per-iteration records: the summary's means per step
    tp = {"step_s": 8.0, "rollout_s_per_step": 5.0, "update_s_per_step": 2.25, "generate_s_per_step": 3.5,
          "update_policy_s_per_step": 1.125, "tokens_per_s": 1.0}
    out = gpuprofile.iteration_parts({"run_dir": str(tmp_path / "gone"), "throughput": tp})
    assert out["parts_s"] == {"generate": 3.5, "update_policy": 1.125, "rollout_rest": 1.5, "update_rest": 1.125,
                              "bookkeeping": 0.75}


def test_profile_groups_self_time_into_dequantization_matmul_attention_and_the_rest():
    """Shares computed by hand: CPU ops by name, or by the op they run inside; kernels by their own names."""
    ops = [("bitsandbytes::dequantize_4bit", 3.0), ("aten::mm", 2.0), ("aten::addmm", 1.0),
           ("aten::_scaled_dot_product_flash_attention", 1.5), ("aten::copy_", 0.5),
           ("aten::copy_", 1.0, ("bitsandbytes::dequantize_4bit", "aten::linear")),  # inside the dequantization
           ("aten::empty_like", 0.5, ("aten::_scaled_dot_product_flash_attention_for_cpu",)),
           ("bitsandbytes::optimizer_update_8bit_blockwise", 0.5)]  # the 8-bit optimizer: not dequantization
    # dequant 3 + 1, matmul 2 + 1, attention 1.5 + 0.5, other 0.5 + 0.5: 10 s of ops in a 12.5 s iteration
    out = gpuprofile.group_profile(ops, wall_s=12.5, top=3)
    assert out["total_s"] == 10.0 and out["wall_s"] == 12.5
    assert {g: v["s"] for g, v in out["groups"].items()} == {"bnb_dequant": 4.0, "matmul": 3.0, "attention": 2.0,
                                                             "other": 1.0, "untraced": 2.5}
    assert {g: v["share"] for g, v in out["groups"].items()} == {"bnb_dequant": 0.32, "matmul": 0.24,
                                                                 "attention": 0.16, "other": 0.08, "untraced": 0.2}
    assert [(t["name"], t["group"], t["s"], t["calls"], t["share"]) for t in out["top"]] == [
        ("bitsandbytes::dequantize_4bit", "bnb_dequant", 3.0, 1, 0.24), ("aten::mm", "matmul", 2.0, 1, 0.16),
        ("aten::_scaled_dot_product_flash_attention", "attention", 1.5, 1, 0.12)]
    assert [gpuprofile.profile_group(n) for n in ("AddmmBackward0", "MatMul4BitBackward", "kQuantizeBlockwise",
                                                "Optimizer.step#PagedAdamW8bit.step", "aten::exponential_")] == [
        "matmul", "bnb_dequant", "other", "other", "other"]
    assert gpuprofile.profile_group("kQuantizeBlockwise", ("bitsandbytes::quantize_blockwise",)) == "bnb_dequant"
    alone = gpuprofile.group_profile(ops)  # without the wall time: shares of the ops' own total
    assert {g: v["share"] for g, v in alone["groups"].items()} == {"bnb_dequant": 0.4, "matmul": 0.3,
                                                                   "attention": 0.2, "other": 0.1}
    kernels = [
        ("void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>(float*, unsigned char*, float*, __nv_bfloat16*, "
         "int, int)", 2.5),
        ("void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>(float*, unsigned char*, float*, __nv_bfloat16*, "
         "int, int)", 1.5),
        ("void kgemm_4bit_inference_naive<__nv_bfloat16, 128, 16>(int, int, int, __nv_bfloat16*, unsigned char*, "
         "float*, float const*, __nv_bfloat16*, int, int, int, int)", 1.0),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_"
         "kernel__5x_cublas", 6.0, ("aten::mm", "aten::matmul", "bitsandbytes::gemm_4bit")),  # its own name decides
        ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn", 2.0),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
         "cutlass::bfloat16_t> >(pytorch_flash::Flash_fwd_params)", 3.0),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16> >(int, "
         "at::native::CUDAFunctor_add<c10::BFloat16>)", 3.0, ("aten::add",)),
        ("void kOptimizerStatic8bit2StateBlockwise<__nv_bfloat16, 2, 256, 1>(...)", 1.0,
         ("bitsandbytes::optimizer_update_8bit_blockwise",))]
    # dequant 2.5 + 1.5 + 1, matmul 6 + 2, attention 3, other 3 + 1: 20 s of kernels in 25 s, 5 s idle
    out = gpuprofile.group_profile(kernels, wall_s=25.0, rest="idle", top=2)
    assert {g: (v["s"], v["share"]) for g, v in out["groups"].items()} == {
        "bnb_dequant": (5.0, 0.2), "matmul": (8.0, 0.32), "attention": (3.0, 0.12), "other": (4.0, 0.16),
        "idle": (5.0, 0.2)}
    assert [(t["group"], t["s"], t["calls"]) for t in out["top"]] == [("matmul", 6.0, 1), ("bnb_dequant", 4.0, 2)]
    assert out["top"][1]["name"].startswith("void kDequantizeBlockwise<") and len(out["top"][0]["name"]) <= 160


def test_profiled_iteration_records_that_iteration_alone_and_groups_a_real_profile():
    """gpucheck's wrapper around an online loop's iterations profiles the one asked for, from the loop taking it to
    the loop asking for the next; profile_events reads torch.profiler's raw events with the ops they run inside,
    nested as torch.profiler's own event list nests them (the same ops, parents and self times)."""
    import bitsandbytes.functional as bnbf
    import torch
    from torch.profiler import ProfilerActivity

    class Bar(list):
        def set_postfix(self, **kw):
            self.postfix = kw

    w = torch.randn(64, 64)
    q, state = bnbf.quantize_4bit(w, quant_type="nf4")
    x = torch.randn(1, 2, 8, 16)
    bar = gpuprofile._ProfiledIteration(Bar([1, 2, 3]), 2, [ProfilerActivity.CPU])
    for step in bar:
        if step == 2:  # dequantize, multiply, attend, then something else, and a sum under autograd
            y = bnbf.dequantize_4bit(q, state) @ w
            torch.nn.functional.scaled_dot_product_attention(x, x, x)
            y.add_(1.0)
            torch.ones(4, requires_grad=True).sum()
        else:
            torch.ones(3).cumsum(0)
        bar.set_postfix(step=step)
    assert bar.bar.postfix == {"step": 3} and bar.wall_s > 0
    cpu, dev = gpuprofile.profile_events(bar.prof.profiler.kineto_results)

    def chain(e):
        return (e.name, *chain(e.cpu_parent)) if e is not None else ()

    ref = [(e.name, e.self_cpu_time_total / 1e6, chain(e.cpu_parent)) for e in bar.prof.events()
           if e.device_type.name == "CPU" and not e.is_async]
    assert len(cpu) == len(ref) > 10 and any(len(e[2]) >= 2 for e in cpu)
    raw = [e.name() for e in bar.prof.profiler.kineto_results.events()]  # autograd's aten::sum around the kernel's,
    assert raw.count("aten::sum") == 2 * sum(e[0] == "aten::sum" for e in cpu) == 2  # folded as the event list does
    ns = collections.Counter  # each op once: its name, its parents and its self time in whole nanoseconds
    assert ns((n, p, round(t * 1e9)) for n, t, p in cpu) == ns((n, p, round(t * 1e9)) for n, t, p in ref)
    names = {e[0] for e in cpu}
    assert "aten::cumsum" not in names and "aten::add_" in names and dev == []  # iteration 2 alone
    out = gpuprofile.group_profile(cpu, bar.wall_s)
    assert all(out["groups"][g]["s"] > 0 for g in ("bnb_dequant", "matmul", "attention", "other"))
    assert out["total_s"] <= bar.wall_s and sum(g["share"] for g in out["groups"].values()) == pytest.approx(1, 1e-3)


def test_kernels_count_inside_the_op_that_launched_them():
    """On a GPU a kernel is linked (its linked correlation id) to the op that launched it, as torch.profiler links
    it: it groups inside that op and the op's parents; the launch call, recorded on the driver's thread, nests inside
    the op on the op's thread. Raw events stand in for a GPU profile here."""
    from torch.autograd import DeviceType

    class Ev:
        def __init__(self, name, start, end, corr=0, linked=0, thread=1, device=DeviceType.CPU):
            self.v = dict(name=name, start_ns=start, end_ns=end, correlation_id=corr, linked_correlation_id=linked,
                          start_thread_id=thread, end_thread_id=thread, device_type=device, is_async=False,
                          is_hidden_event=False)

        def __getattr__(self, k):
            return lambda: self.v[k]

    class Result:
        def events(self):
            return [Ev("bitsandbytes::gemm_4bit", 0, 100, corr=4), Ev("aten::mm", 10, 60, corr=5),
                    Ev("cudaLaunchKernel", 20, 30, corr=9, linked=5, thread=7),
                    Ev("sm90_xmma_gemm_bf16", 1000, 1400, linked=5, device=DeviceType.CUDA),
                    Ev("ampere_copy", 2000, 2100, linked=77, device=DeviceType.CUDA)]  # launched by nothing seen

    cpu, dev = gpuprofile.profile_events(Result())
    assert sorted(cpu) == [("aten::mm", 40e-9, ("bitsandbytes::gemm_4bit",)),
                           ("bitsandbytes::gemm_4bit", 50e-9, ()),
                           ("cudaLaunchKernel", 10e-9, ("aten::mm", "bitsandbytes::gemm_4bit"))]
    assert dev == [("sm90_xmma_gemm_bf16", 400e-9, ("aten::mm", "bitsandbytes::gemm_4bit"))]


def test_runs_recorded_before_the_trained_token_count_are_recounted_from_their_settings():
    """The H100 run of 2026-11-23 counted the data set's 64 rows whatever 3 steps of 32 trained, and DPO's responses
    alone (128 of 512 tokens): its DPO read 0.20x SFT; counted as trained, 0.78x."""
    report = json.loads((ROOT / "results" / "gpu" / "2026-11-23-H100-llama2-7b-hh-4090.json").read_text())
    (r,) = report["experiments"]
    exp = config.load(ROOT / r["experiment"], gpureport._settings(r))
    sft, _ = gpumetrics.trained_tokens_per_s("sft", exp, r["stages"]["sft"])
    dpo, label = gpumetrics.trained_tokens_per_s("dpo", exp, r["stages"]["dpo"])
    assert sft == pytest.approx(3 * 32 * 512 / 14.85) and dpo == pytest.approx(3 * 32 * 2 * 512 / 37.85)
    assert dpo / sft == pytest.approx(0.785, abs=0.005) and label == "trained tok/s (recounted)"
    assert r["stages"]["dpo"]["throughput"]["tokens_per_s"] / r["stages"]["sft"]["throughput"]["tokens_per_s"] < 0.2
    assert gpureport._speed("ppo", exp, r["stages"]["ppo"]) == "0.55 episodes/s, 280 sampled tok/s"


def test_a_shrunk_base_on_a_cpu_has_a_narrow_head(tmp_path):
    """bases.build_base: the dry run's base (CPU) is SMALL_ARCH with a CPU_VOCAB-wide vocabulary (a 32k-wide bf16 head
    was most of a CPU iteration; on a GPU a shrunk base keeps the experiment's), the decode figures read it
    (shape_of on the saved base), and a tokenizer wider than the vocabulary is refused."""
    from rlhf.tools import bases

    exp = config.load(ROOT / "experiments" / "llama2-7b-hh-4090.yaml", ["device=cpu", *bases.SMALL])
    texts = bases.write_pairs(tmp_path / "pairs.jsonl", exp, 8)
    built = json.loads((bases.build_base(exp, tmp_path / "base", texts, small=True) / "config.json").read_text())
    assert built["vocab_size"] == bases.CPU_VOCAB < arch(exp).vocab == 32000
    assert {k: built[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size")} == {
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}
    assert bases.shape_of(config.load(ROOT / "experiments" / "llama2-7b-hh-4090.yaml", [
        f"model.name={tmp_path / 'base'}"]), small=True).vocab == bases.CPU_VOCAB  # what the decode figures read
    words = [" ".join(f"x{i}" for i in range(bases.CPU_VOCAB))]
    with pytest.raises(ValueError, match=f"tokens, over its vocabulary of {bases.CPU_VOCAB}"):
        bases.build_base(exp, tmp_path / "wide", words, small=True)


@pytest.mark.slow
def test_stages_count_every_trained_token_and_dpo_computes_its_reference_once_with_the_same_losses(tmp_path):
    """memcheck.yaml's rows are all 62 tokens: two steps of SFT train 2 x 8 x 62 tokens, of DPO 2 x 8 pairs x 2 x 62
    (prompts included). With dpo.precompute_ref_log_probs, over two epochs DPO's reference log-probabilities are
    computed once, before training, and the losses are those of computing them every step."""
    ov = [f"results_dir={tmp_path}"]
    env = {**os.environ, "RLHF_DISABLE_TRACKING": "1"}

    def stage(name, *extra):
        cmd = stages.command(name, memcheck.GATED, [*ov, *extra])
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return records.latest(config.load(memcheck.GATED, ov), name, "test")[1]

    sft = stage("sft")["throughput"]
    assert (sft["trained_tokens"], sft["trained_tokens_counted_by"]) == (2 * 8 * 62, "trainer")
    once = stage("dpo")["throughput"]
    assert once["trained_tokens"] == 2 * 8 * 2 * 62 and "reference_precompute_s" not in once  # one epoch
    two = ["dpo.max_steps=-1", "dpo.epochs=2", "data.pref_pairs=24"]  # 24 pairs: 3 steps an epoch
    stage("sft", "data.pref_pairs=24")  # another pool split: DPO refuses an SFT run that trained on its held-out rows
    precomputed, every = stage("dpo", *two, "dpo.precompute_ref_log_probs=true"), stage("dpo", *two)
    assert precomputed["throughput"]["reference_precompute_s"] > 0
    assert "reference_precompute_s" not in every["throughput"]
    assert precomputed["throughput"]["trained_tokens"] == every["throughput"]["trained_tokens"]
    for k in ("train_loss", "eval_loss", "eval_rewards_margins", "eval_logps_chosen", "eval_logps_rejected"):
        assert precomputed["metrics"][k] == pytest.approx(every["metrics"][k], rel=1e-6, abs=1e-7), k


def loan_recipe() -> dict:
    """docs/performance.md's one device call: {"command", "carry", "timeout_s"}."""
    text = (ROOT / "docs" / "performance.md").read_text()
    block = text.split("### The GPU loan: one call", 1)[1].split("```", 2)[1]
    out = dict(line.split(":", 1) for line in block.strip().splitlines())
    return {"command": out["command"].strip(), "carry": json.loads(out["carry"]), "timeout_s": int(out["timeout_s"])}


NET_GUARD = """
import os, socket
_log = os.environ["NET_GUARD_LOG"]
with open(_log + ".env", "a") as f:  # every Python process the call starts, and whether the hub is offline in it
    f.write(f"{os.getpid()} HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE')}\\n")

def _refuse(what):
    with open(_log, "a") as f:
        f.write(f"{os.getpid()} {what!r}\\n")
    raise OSError("the rehearsal's guard: no network")

_connect, _connect_ex = socket.socket.connect, socket.socket.connect_ex
def connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        _refuse(address)
    return _connect(self, address)
def connect_ex(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        _refuse(address)
    return _connect_ex(self, address)
socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
socket.getaddrinfo = lambda *a, **k: _refuse(a)
"""


def fake_wheel(folder):
    """A valid, empty wheel: what pip installs as the carried wheels would be."""
    import zipfile

    folder.mkdir()
    with zipfile.ZipFile(folder / "gpucheck_fake-0.0.0-py3-none-any.whl", "w") as z:
        z.writestr("gpucheck_fake.py", "")
        info = "gpucheck_fake-0.0.0.dist-info"
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: gpucheck-fake\nVersion: 0.0.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"gpucheck_fake.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")


@pytest.mark.slow
def test_the_loan_call_rehearsed_on_cpu_writes_every_figure_offline_and_refuses_a_plan_over_its_budget(tmp_path):
    """docs/performance.md's one device call, as written, on the CPU (--dry-run: the architecture shrunk): without
    the carried wheels it stops at once with one line; with them (a fake wheel) it installs them, checks its imports
    in one line, plans, and writes every figure LOAN_FIELDS names under the out folder, within what a device call
    brings back; nothing reads the network (a socket guard in every process, the hub offline in each); a budget under
    its estimate is refused before anything is built."""
    from rlhf.tools import gpucheck

    recipe = loan_recipe()
    assert recipe["carry"] == [".whl"] and recipe["timeout_s"] <= 600
    cmd = shlex.split(recipe["command"])
    assert cmd[0] == "scripts/gpucheck.sh" and "--loan" in cmd and "--budget-s" in cmd
    out, guard = tmp_path / "OUT", tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(NET_GUARD)
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": str(guard),
           "NET_GUARD_LOG": str(tmp_path / "net.log"), "GPUCHECK_SITE": str(tmp_path / "site"),
           "OMP_NUM_THREADS": "1"}
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "GPUCHECK_T0"):
        env.pop(k, None)

    def call(*extra, wheels):
        args = [a.replace('"$OUT"', str(out)).replace("$OUT", str(out)) for a in cmd]
        return subprocess.run([*args, "--dry-run", *extra], cwd=ROOT, capture_output=True, text=True, timeout=900,
                              env={**env, "GPUCHECK_WHEELS": str(wheels)})

    def tree():  # what the call could write into the tree (git's view, ignored files included)
        out = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=ROOT, capture_output=True, text=True)
        return [line for line in out.stdout.splitlines() if "__pycache__" not in line]

    before = tree()
    proc = call(wheels=tmp_path / "absent")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "no wheels in" in proc.stderr and "carry" in proc.stderr and not out.exists()
    fake_wheel(tmp_path / "whl")
    proc = call("--budget-s", "60", wheels=tmp_path / "whl")  # the last --budget-s counts
    assert proc.returncode == 2 and "is over --budget-s 60" in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout.startswith("preflight: torch ") and " import; CPU" in proc.stdout.splitlines()[0]
    assert not list(out.glob("*.json"))
    # the docs' expected total is the plan's own estimate (COST_S)
    docs = re.search(r"^\| total \|[^\n]*?\| ~(\d+) s \|", (ROOT / "docs" / "performance.md").read_text(), re.M)
    assert f"  total ~{docs.group(1)} s of the 60 s budget" in proc.stdout, proc.stdout
    proc = call(wheels=tmp_path / "whl")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "gpucheck_fake.py").exists()  # the carried wheels were installed
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(p.stat().st_size <= 16 * 1024**2 for p in files), files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", p.name) and len(p.relative_to(out).parts) <= 3 for p in files)
    (path,) = out.glob("*-loan.json")
    report = json.loads(path.read_text())
    assert gpucheck.missing(report) == []
    # a loan asked for other online stages (--stages rloo) asks their figures, with SFT's and RM's, and not PPO's
    fields = gpucheck.loan_fields(["rloo"])
    assert gpucheck.loan_fields(["ppo", "grpo"]) == gpucheck.LOAN_FIELDS
    assert "experiments.0.stages.rloo.online.as_shipped.reference_draw_s" in fields
    assert "experiments.0.stages.rm.wall_s" in fields and not any(".ppo." in f or ".grpo." in f for f in fields)
    assert "experiments.0.stages.sft.measured_gb" in gpucheck.loan_fields(["sft"])  # a trainer alone: its own figures
    assert path.with_suffix(".md").exists() and "preflight" not in path.with_suffix(".log").read_text()
    (e,) = report["experiments"]
    assert list(e["stages"]) == ["sft", "rm", "ppo", "grpo"]
    for st in ("ppo", "grpo"):
        row = e["stages"][st]
        on, smp = row["online"], row["sampler"]
        assert on["iterations"] == 3 and on["measured_iterations"] == 2 and on["first_iteration_s"] > 0, on
        shipped = config.load(ROOT / e["experiment"])
        a, section = on["as_shipped"], getattr(shipped, st)
        assert (a["rollout_batch"], a["judge_every"], a["judge_prompts"]) == (
            section.rollout_batch, section.judge_every, section.judge_prompts) == (64, {"ppo": 5, "grpo": 15}[st], 128)
        assert a["measured_judge_prompts"] == 32 and 0 < a["judge_share"] < 1 and a["episodes_per_s"] > 0
        assert a["reference_draw_s"] > 0  # SFT's reference draw, timed apart from the measurement it is made in
        # on a CPU the merged copy decodes eagerly by design: not a fall-back
        assert smp["compiled"] is False and smp["eager_reason"] == "not a CUDA device" and not smp["fell_back"]
        assert smp["copy_share"] == 1.0 and row["decode"]["ms_per_step"] > 0 and row["decode"]["x_weight_read"] is None
        assert "first_iteration" in row["iteration_parts"] and "failed" not in row
    assert report["loan"]["dpo_reused"]["note"].startswith("DPO's earlier Llama-2 figure, reused")
    assert report["loan"]["int8"]["ms_per_step"] > 0, report["loan"]["int8"]
    assert not (tmp_path / "net.log").exists(), (tmp_path / "net.log").read_text()
    assert tree() == before  # everything went under the out folder and the temporary work folder
    seen = (tmp_path / "net.log.env").read_text().splitlines()
    assert len(seen) >= 6 and all(line.endswith("HF_HUB_OFFLINE=1") for line in seen), seen


def test_the_tree_and_the_wheels_it_carries_stay_under_62_mib():
    """A device call carries 64 MiB at most: the tracked tree plus .whl/ (the wheels the script installs, at the lock's
    pins; their sizes from .whl/ where it was downloaded, else scripts/gpucheck-wheels.txt's record) under 62, 2 MiB
    left for the untracked files that travel too (the bound was 60 until the tree reached 3.6 MiB beside 56.4 MiB of
    wheels, 43 of them bitsandbytes')."""
    script = (ROOT / "scripts" / "gpucheck.sh").read_text()
    names = re.search(r"^WHEELS=\((.*)\)$", script, re.M).group(1).split()
    lock = dict(line.lower().split("==") for line in (ROOT / "requirements.lock").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    table = dict(line.split() for line in (ROOT / "scripts" / "gpucheck-wheels.txt").read_text().splitlines()
                 if line.strip() and not line.startswith("#"))
    recorded = {}
    for name in names:  # the record is of the lock's pins, one wheel each
        (f,) = [f for f in table if f.lower().startswith(f"{name.replace('-', '_')}-{lock[name].strip()}-")]
        recorded[f] = int(table[f])
    assert len(recorded) == len(table)
    here = list((ROOT / ".whl").glob("*.whl"))
    wheels = sum(p.stat().st_size for p in here) if here else sum(recorded.values())
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    tree = sum((ROOT / p).stat().st_size for p in tracked.split("\0") if p and (ROOT / p).is_file())
    assert tree + wheels < 62 * 1024**2, (tree / 1024**2, wheels / 1024**2)


def test_a_stage_whose_sampler_fell_back_fails_the_check():
    """gpucheck's exit status counts a stage that finished but sampled eagerly where the plan compiled."""
    from rlhf.tools import gpucheck

    ok = {"measured_gb": 20.0, "sampler": {"compiled": True, "fell_back": False}}
    eager = {"compiled": False, "fell_back": True, "eager_reason": "the compiled decode failed: RuntimeError: x"}
    assert gpucheck.fell_back(ok["sampler"]) is None and gpucheck.fell_back(None) is None
    assert gpucheck.fell_back(eager) == ("the sampler fell back to eager decoding: the compiled decode failed: "
                                         "RuntimeError: x")
    report = {"experiments": [{"experiment": "experiments/llama2-7b-hh-4090.yaml", "stages": {
        "sft": {"measured_gb": 6.0}, "ppo": ok, "grpo": {**ok, "sampler": eager, "failed": gpucheck.fell_back(eager)},
        "rm": {"error": "exit 1"}}}]}
    assert gpucheck.failures(report) == [("llama2-7b-hh-4090", "grpo"), ("llama2-7b-hh-4090", "rm")]
