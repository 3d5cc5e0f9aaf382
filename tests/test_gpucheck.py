"""`make gpucheck` as a dry run (CPU, the shipped 4090 experiment's architecture shrunk, one step per stage): the
measurement a GPU loan runs cannot rot between loans. The GPU run itself wrote results/gpu/."""

import json
import os
import subprocess

import pytest

from rlhf import stages

from .conftest import ROOT, make


@pytest.mark.slow
def test_gpucheck_dry_run_runs_every_stage_with_the_shipped_settings_and_writes_the_table(tmp_path):
    make("gpucheck", f"ARGS=--dry-run --out {tmp_path} --exp experiments/llama2-7b-hh-4090.yaml", timeout=900)
    (report,) = [json.loads(p.read_text()) for p in tmp_path.glob("*-dry-run.json")]
    assert report["mode"].startswith("dry run") and report["device"] == "cpu"
    (exp,) = report["experiments"]
    # the shipped settings, not the tiny ones: NF4 with bf16 compute, paged 8-bit AdamW, checkpointing, LoRA r=16
    assert not any(o.startswith(("quantization.", "lora.", "model.dtype", "model.gradient")) for o in exp["overrides"])
    assert exp["sequence"] == {"max_length": 40, "max_prompt_length": 24, "max_new_tokens": 16}
    assert list(exp["stages"]) == [s for s in stages.training() if s != "rloo"]  # RLOO: GRPO's plan and loop
    for st, row in exp["stages"].items():
        assert row["measured_gb"] > 0 and row["predicted_gb"] > 0, (st, row)
        assert row["throughput"]["tokens_per_s"] > 0
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
    md = next(tmp_path.glob("*-dry-run.md")).read_text()
    assert "| llama2-7b-hh-4090 | ppo |" in md


def test_gpucheck_script_runs_without_wheels_and_refuses_without_cuda(tmp_path):
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", "GPUCHECK_WHEELS": str(tmp_path)}
    proc = subprocess.run([str(ROOT / "scripts" / "gpucheck.sh")], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr and "--dry-run" in proc.stderr
