"""Memory: the CPU tensor probe counts exactly, budgets bite naming the phase, the predictor is within +/-15% of the
probe on several shapes, preflight refuses before loading, and the memcheck gate fails on a regression."""

import subprocess
import sys

import pytest
import torch

from rlhf import config, memcheck, memory, memplan

from .conftest import ROOT

MB = 1024**2


def test_tracker_counts_storages_exactly_and_views_once():
    tr = memory.TensorTracker().start()
    try:
        base = tr.current
        a = torch.zeros(1024, 256)  # 1 MiB
        assert tr.current - base == MB
        v = a.view(-1)[:10]  # a view shares the storage
        assert tr.current - base == MB
        b = a * 2
        assert tr.current - base == 2 * MB and tr.peak - base >= 2 * MB
        del a, b
        assert tr.current - base == MB  # the view keeps a's storage alive
        del v
        assert tr.current == base
        tr.reset_peak()
        c = torch.ones(512, 512)  # 1 MiB
        del c
        assert tr.peak - base == MB and tr.current == base
    finally:
        tr.stop()
    assert not memory._ACTIVE


def test_budget_error_names_the_phase_and_figures():
    probe = memory.MemoryProbe(torch.device("cpu"), budget_gb=1 / 1024)  # 1 MiB
    try:
        with pytest.raises(memory.MemoryBudgetError, match=r"phase 'update'.*memory.budget_gb=0.0009"):
            with probe.phase("update"):
                x = torch.zeros(1024, 1024)  # 4 MiB
                del x
    finally:
        probe.close()
    assert probe.phases["update"]["peak_tensors_gb"] == pytest.approx(4 / 1024, abs=1e-5)


def test_probe_phases_are_separate():
    probe = memory.MemoryProbe(torch.device("cpu"), budget_gb=1.0)
    with probe.phase("small"):
        x = torch.zeros(256, 1024)  # 1 MiB
        del x
    with probe.phase("big"):
        y = torch.zeros(1024, 1024)  # 4 MiB
        del y
    probe.close()
    s = probe.summary()
    assert s["measure"] == "cpu_tensors"
    assert abs(s["phases"]["small"]["peak_tensors_gb"] * 1024 - 1) < 0.01
    assert abs(s["phases"]["big"]["peak_tensors_gb"] * 1024 - 4) < 0.01
    assert s["peak_gb"] == s["phases"]["big"]["peak_gb"]


def test_preflight_refuses_before_loading(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlhf", "sft", "--exp", str(memcheck.GATED), f"results_dir={tmp_path}",
                          "memory.budget_gb=0.01"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2
    assert "predicted peak" in out.stderr and "memory.budget_gb=0.01" in out.stderr
    assert "Traceback" not in out.stderr
    assert not list(tmp_path.rglob("*.safetensors")) and not list(tmp_path.rglob("summary.json"))
    over = subprocess.run([sys.executable, "-m", "rlhf", "memplan", "--exp", str(memcheck.GATED),
                           "memory.budget_gb=0.01"], capture_output=True, text=True, cwd=ROOT)
    fits = next(line for line in over.stdout.splitlines() if line.startswith("fits budget"))
    assert over.returncode == 0 and fits.split()[2:] == ["NO"] * 4


def test_shipped_7b_plans_fit_their_budgets():
    llama = config.load(ROOT / "experiments" / "llama2-7b-hh-4090.yaml")
    plans = memplan.plans(llama)
    assert [p.stage for p in plans] == ["sft", "rm", "dpo", "ppo"]
    for p in plans:
        assert p.fits and p.peak_gb < 24, (p.stage, p.peak_gb)
        assert p.components["weights_4bit"] / memplan.GB == pytest.approx(3.11, abs=0.05)  # 6.5B linear params
    # the rollout KV cache is what forward_batch bounds: the whole rollout batch at once would not fit
    whole = memplan.plans(config.load(ROOT / "experiments" / "llama2-7b-hh-4090.yaml", ["ppo.forward_batch=0"]))
    assert whole[3].components["kv_cache"] == 4 * plans[3].components["kv_cache"]
    for path in memcheck.shipped_7b():
        assert all(p.fits for p in memplan.plans(config.load(path))), path


# ---- predictor vs probe on CPU, several shapes (each stage runs in its own process, two steps)
SHAPES = {
    "gated-ckpt": [],
    "no-ckpt": ["model.gradient_checkpointing=false"],
    "wide-deep": ["model.gradient_checkpointing=false", "model.hidden_size=384", "model.intermediate_size=768",
                  "model.num_layers=4", "sft.batch_size=12", "dpo.batch_size=6"],
    "narrow-long": ["model.hidden_size=128", "model.num_heads=8", "model.num_layers=6", "data.max_length=94",
                    "data.synthetic.response_len_min=84", "data.synthetic.response_len_max=84", "sft.batch_size=4",
                    "dpo.batch_size=2", "rm.batch_size=4"],
}
STAGES_BY_SHAPE = {"gated-ckpt": ["sft", "rm", "dpo", "ppo"], "no-ckpt": ["sft", "rm", "ppo"],
                   "wide-deep": ["sft", "dpo"], "narrow-long": ["sft", "rm", "dpo"]}


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(SHAPES))
def test_predictor_within_15_percent_of_probe(shape, tmp_path):
    overrides = [f"results_dir={tmp_path}", *SHAPES[shape]]
    measured = memcheck.measure(memcheck.GATED, overrides, STAGES_BY_SHAPE[shape])
    exp = config.load(memcheck.GATED, overrides)
    errors = {}
    for st, m in measured.items():
        predicted = memplan.plan(exp, st).peak_gb
        errors[st] = predicted / m["peak_gb"] - 1
    print(shape, {k: f"{v:+.1%}" for k, v in errors.items()})
    assert all(abs(e) <= 0.15 for e in errors.values()), errors


@pytest.mark.slow
def test_memcheck_gate_bites_and_passes():
    bad_ok, bad = memcheck.check(["model.gradient_checkpointing=false"], ["sft"])
    assert not bad_ok
    row = next(line for line in bad.splitlines() if line.startswith("sft"))
    assert "FAIL" in row and "baseline" in bad and bad.rstrip().endswith("FAILED")
    good_ok, good = memcheck.check([], ["sft"])
    assert good_ok, good
    assert "llama2-7b-hh-4090.yaml" in good and good.rstrip().endswith("passed")


def test_memcheck_update_rewrites_only_the_given_file(tmp_path, monkeypatch):
    fake = {"sft": {"peak_gb": 0.1, "phases": {"forward_backward": {"peak_gb": 0.1}}}}
    monkeypatch.setattr(memcheck, "measure", lambda *a, **k: fake)
    path = tmp_path / "baseline.json"
    ok, _ = memcheck.check([], ["sft"], update=True, baseline_path=path)
    assert ok and '"peak_mb": 102.4' in path.read_text()
    fake["sft"]["peak_gb"] = 0.2  # doubled: the gate fails against the rewritten baseline
    ok, report = memcheck.check([], ["sft"], baseline_path=path)
    assert not ok and "+100.0%" in report
