"""The CUDA stack (rlhf/infra/toolchain.py, issue 50): torch's CUDA read from torch's metadata (installed, or as the GPU lock
records it), NVIDIA's minimum driver kept in one table and quoted by the README and docs/docker.md, the driver
checked first by the image's entry and by a stage on a CUDA host (a faked driver: an `nvidia-smi` on PATH that prints
a version, beside a torch whose metadata requires the locked CUDA runtime), and the versions gpucheck and
decodebench record beside their figures, compared with the lock."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from rlhf.infra import toolchain
from rlhf.tools import decodebench, gpucheck, gpureport

from .conftest import ROOT

GPU = toolchain.read_lock(ROOT / toolchain.GPU_LOCK)
CUDA, RUNTIME = toolchain.locked_cuda(GPU)
MINIMUM = toolchain.min_driver(CUDA)
OLD, NEW = "550.54.15", "580.159.04"  # a 4090 host's driver for CUDA 12.4; the H200 loan's driver


@pytest.mark.parametrize("requires, cuda", [
    (['filelock', 'cuda-toolkit[cublas,cudart,nvrtc]==13.0.3; platform_system == "Linux"', "triton==3.7.1"], "13.0"),
    (['nvidia-cuda-runtime-cu12==12.8.90; platform_system == "Linux" and platform_machine == "x86_64"'], "12.8"),
    (["filelock", "sympy>=1.13.3", "networkx"], None),  # a CPU build
], ids=["torch-2.13-cu130", "torch-2.9-cu128", "cpu"])
def test_torchs_cuda_is_the_runtime_its_metadata_requires(requires, cuda):
    assert toolchain.cuda_of([Requirement(r) for r in requires]) == cuda


def test_the_gpu_lock_records_torchs_cuda_and_the_minimum_driver_is_nvidias():
    assert "torch" in RUNTIME.via and (CUDA, MINIMUM) == ("13.0", "580")
    assert toolchain.locked_stack() == {"lock": toolchain.GPU_LOCK, "torch": GPU["torch"].version, "cuda": CUDA,
                                        "min_driver": MINIMUM}
    # one table: no other module of the package writes a driver version
    for path in (ROOT / "rlhf").rglob("*.py"):
        if path.name != "toolchain.py":
            assert not re.search(r"\b(580|525\.60\.13|450\.80\.02)\b", path.read_text()), path


def test_the_readme_and_docs_state_the_minimum_driver_of_the_pinned_cuda():
    readme = (ROOT / "README.md").read_text()
    assert len([line for line in readme.splitlines() if f"driver {MINIMUM} or later" in line]) == 1
    assert f"CUDA {CUDA}" in next(line for line in readme.splitlines() if f"driver {MINIMUM} or later" in line)
    docs = (ROOT / "docs" / "docker.md").read_text()
    assert f"driver {MINIMUM} or later" in docs and "## Older drivers" in docs
    assert "make docker-build && make docker-run TARGET=gpucheck" in docs


def test_an_old_driver_is_one_line_naming_both_versions_and_the_fix():
    line = toolchain.driver_problem(OLD, CUDA, "2.13.0")
    assert "\n" not in line and OLD in line and f"older than {MINIMUM}" in line and f"CUDA {CUDA}" in line
    assert "upgrade the driver" in line and "docs/docker.md#older-drivers" in line
    for fine in (NEW, MINIMUM, "581.0"):
        assert toolchain.driver_problem(fine, CUDA) is None, fine
    assert toolchain.driver_problem(None, CUDA) is None and toolchain.driver_problem(OLD, None) is None


def fake_cuda_host(tmp_path: Path, driver: str | None) -> dict[str, str]:
    """The environment of a CUDA host: `nvidia-smi` on PATH printing `driver` (none when None), and a torch whose
    metadata requires the GPU lock's CUDA runtime (a dist-info ahead of the real, CPU, torch on PYTHONPATH)."""
    bin_dir, site = tmp_path / "bin", tmp_path / "site"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.unlink(missing_ok=True)
    if driver is not None:
        smi.write_text(f'#!/bin/sh\necho "{driver}"\n')
        smi.chmod(0o755)
    info = site / f"torch-{GPU['torch'].version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {GPU['torch'].version}\n"
                                   f'Requires-Dist: {RUNTIME.name}=={RUNTIME.version}; platform_system == "Linux"\n')
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": f"{site}:{ROOT}",
            "MAKEFLAGS": ""}


def test_the_installed_torchs_cuda_is_read_from_its_metadata(tmp_path):
    env = fake_cuda_host(tmp_path, OLD)
    out = subprocess.run([sys.executable, "-c", "from rlhf.infra import toolchain; print(toolchain.installed_torch(), "
                          "toolchain.driver_version())"], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == f"('{GPU['torch'].version}', '{CUDA}') {OLD}", out.stderr


def venv_of_this_python(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".installed").touch()
    return venv


@pytest.mark.parametrize("driver", [OLD, NEW, None], ids=["old-driver", "new-driver", "no-gpu"])
def test_the_image_entry_checks_the_driver_before_make(tmp_path, driver):
    """scripts/entrypoint.sh (the Dockerfile's ENTRYPOINT) as `docker run IMAGE help` runs it: an old driver stops it
    with one line and exit 2 before make runs; a driver new enough, or no GPU at all, goes on to `make help`."""
    env = {**fake_cuda_host(tmp_path, driver), "VENV": str(venv_of_this_python(tmp_path))}
    proc = subprocess.run([str(ROOT / "scripts" / "entrypoint.sh"), "help"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    if driver == OLD:
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
        (line,) = proc.stderr.splitlines()
        assert line.startswith(f"error: NVIDIA driver {OLD} is older than {MINIMUM}, the minimum for torch "
                               f"{GPU['torch'].version}'s CUDA {CUDA}: upgrade the driver"), line
    else:
        assert proc.returncode == 0 and proc.stdout.startswith("usage: make <target>"), proc.stdout + proc.stderr


def test_a_stage_on_a_cuda_host_with_an_old_driver_stops_first(tmp_path):
    """`make sft` on a CUDA host whose driver is too old: the one line and exit 2, before any model or data loads
    (no run directory); a CPU experiment is not stopped by the GPU's driver."""
    env = fake_cuda_host(tmp_path, OLD)
    venv = venv_of_this_python(tmp_path)
    results = tmp_path / "results"
    proc = subprocess.run(["make", "sft", f"VENV={venv}", f"ARGS=device=cuda results_dir={results}"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"NVIDIA driver {OLD} is older than {MINIMUM}" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and not results.exists()
    check = subprocess.run([sys.executable, "-c", "from rlhf.infra import toolchain; toolchain.require_driver('cpu'); "
                            "toolchain.require_driver('cuda')"], env=env, capture_output=True, text=True, timeout=60)
    assert check.returncode == 2 and check.stderr.count("\n") == 1


# ---------------------------------------------------------------------------------------------------------------
# the versions beside the figures


def test_gpucheck_and_decodebench_record_versions_with_one_helper():
    assert decodebench.versions is toolchain.versions
    defined = [p for p in (ROOT / "rlhf").rglob("*.py") if re.search(r"^def versions\(", p.read_text(), re.M)]
    assert defined == [ROOT / "rlhf" / "infra" / "toolchain.py"]
    source = (ROOT / "rlhf" / "tools" / "gpucheck.py").read_text()
    assert "**toolchain.versions()" in source and '"lock": toolchain.locked_stack()' in source
    assert "toolchain.require_driver(device)" in source and gpucheck.toolchain is toolchain
    v = toolchain.versions()
    assert {"torch", "cuda", "driver", "bitsandbytes", "transformers", "peft", "trl"} <= set(v)


def test_the_committed_figures_say_they_were_not_measured_on_the_locked_stack():
    """The H100 runs measured torch 2.11.0+cu130 (no driver recorded then), the H200 decode runs the same torch under
    driver 580.159.04: every table says so beside its figures; a run on the locked stack says nothing more."""
    h100 = json.loads((ROOT / "results" / "gpu" / "2026-11-25-H100-llama2-7b-hh-4090-ppo.json").read_text())
    first = gpureport.markdown(h100).splitlines()[2]
    assert first.startswith("torch 2.11.0+cu130, CUDA 13.0, driver not recorded; **not the locked stack**")
    assert f"torch 2.11.0+cu130 (the lock: {GPU['torch'].version})" in first
    h200 = json.loads((ROOT / "results" / "gpu" / "2026-11-26-H200-decode" / "run1-llama2.json").read_text())
    assert "driver 580.159.04; **not the locked stack**" in decodebench.markdown(h200)
    table = gpureport.replan([str(ROOT / "results" / "gpu" / "2026-11-25-H100-llama2-7b-hh-4090-ppo.json")])
    assert table.splitlines()[0].endswith("| torch / CUDA / driver |")
    assert table.splitlines()[2].endswith("| 2.11.0+cu130 / 13.0 / not recorded |")
    assert "2026-11-25-H100-llama2-7b-hh-4090-ppo.json: torch 2.11.0+cu130" in table
    pinned = {**h200, "torch": f"{GPU['torch'].version}+cu{CUDA.replace('.', '')}", "lock": toolchain.locked_stack()}
    assert toolchain.lock_differences(pinned, pinned["lock"]) == []
    assert "not the locked stack" not in toolchain.stack_line(pinned)
    assert toolchain.lock_differences({**pinned, "driver": OLD}, pinned["lock"]) == [
        f"driver {OLD} (the lock's CUDA needs {MINIMUM} or later)"]
