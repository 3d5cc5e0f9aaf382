"""The CUDA stack the project pins, and the one a host runs: which CUDA torch needs, the NVIDIA driver that CUDA needs,
the host's driver, and the versions a GPU figure was measured with.

torch's CUDA is never written down here: it is read from torch's own metadata, either the installed torch's
(`importlib.metadata`) or as `uv pip compile` recorded it in requirements-gpu.lock (the pins annotated `# via torch`).
The CUDA runtime torch requires (`cuda-toolkit==13.0.3` since torch 2.10, `nvidia-cuda-runtime-cu12==12.8.90` before)
gives the CUDA version, its major and minor. The driver that version needs is NVIDIA's published minimum for CUDA
minor version compatibility (MIN_DRIVER, the one table): pip's torch wheels bring their own CUDA runtime and rely on it.

`python -m rlhf.infra.toolchain` checks the host's driver against the installed torch's CUDA and exits 2 with one line when
it is too old (the image's entry, scripts/entrypoint.sh, runs it before make; `python -m rlhf <stage>` calls
require_driver). A host without `nvidia-smi`, or a torch built without CUDA, has nothing to check.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[2]
CPU_LOCK, GPU_LOCK, FLASH_LOCK = "requirements.lock", "requirements-gpu.lock", "requirements-flash.lock"
DOCS = "docs/docker.md#older-drivers"

# NVIDIA, CUDA Toolkit release notes, "CUDA Toolkit and Minimum Required Driver Version for CUDA Minor Version
# Compatibility" (Linux x86_64; docs.nvidia.com/deploy/cuda-compatibility): every CUDA X.y runs on a driver of at
# least this version. README.md and docs/docker.md quote the line for the pinned CUDA (tests/test_toolchain.py).
MIN_DRIVER = {13: "580", 12: "525.60.13", 11: "450.80.02"}

# the package that carries the CUDA runtime among torch's requirements: NVIDIA's metapackage, or the runtime itself
CUDA_RUNTIME = re.compile(r"cuda-toolkit|nvidia-cuda-runtime(-cu\d+)?")


class DriverTooOld(RuntimeError):
    pass


def cuda_of(requirements: list[Requirement]) -> str | None:
    """'13.0': the major.minor CUDA version of the runtime pinned among torch's requirements; None without one (a CPU
    build of torch)."""
    for req in requirements:
        if CUDA_RUNTIME.fullmatch(canonicalize_name(req.name)) and req.specifier:
            (spec,) = req.specifier
            release = Version(spec.version).release
            return f"{release[0]}.{release[1]}"
    return None


def min_driver(cuda: str) -> str:
    major = int(cuda.split(".")[0])
    if major not in MIN_DRIVER:
        raise KeyError(f"CUDA {cuda}: no minimum driver in rlhf/infra/toolchain.py MIN_DRIVER (NVIDIA's table has it)")
    return MIN_DRIVER[major]


# ---------------------------------------------------------------------------------------------------------------
# the locks


@dataclass(frozen=True)
class Pin:
    name: str  # canonical
    version: str
    hashes: tuple[str, ...]  # "sha256:<hex>", as pip's --hash takes them
    via: tuple[str, ...]  # who requires it, as uv annotates (canonical names; "rlhf" is pyproject.toml)
    line: int  # 1-based line of the pin in its lock
    requirement: Requirement


def read_lock(path: Path) -> dict[str, Pin]:
    """The pins of a lock `uv pip compile` wrote (requirements format): each `name==version [; marker]`, then its
    `--hash` options on continuation lines, then uv's annotation `# via a` or `# via` with `#   a` lines. The
    requirement itself is parsed by packaging; a line that is none of these is an error naming the file and line."""
    pins: dict[str, Pin] = {}
    entry: dict | None = None

    def close():
        if entry is not None:
            req = Requirement(entry["text"])
            specs = list(req.specifier)
            if len(specs) != 1 or specs[0].operator != "==":
                raise ValueError(f"{path.name}:{entry['line']}: {entry['text']}: a lock pins one version (name==x)")
            pins[canonicalize_name(req.name)] = Pin(canonicalize_name(req.name), specs[0].version,
                                                    tuple(entry["hashes"]), tuple(entry["via"]), entry["line"], req)

    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if not raw[0].isspace() and not line.startswith("#"):  # a new pin
            close()
            body, _, comment = line.partition(" #")
            body = body.removesuffix("\\").strip()
            entry = {"text": re.sub(r"\s*--hash=\S+", "", body).strip(), "hashes": re.findall(r"--hash=(\S+)", body),
                     "via": _via(comment) if comment else [], "line": n}
        elif entry is not None and line.startswith("--hash="):
            entry["hashes"] += re.findall(r"--hash=(\S+)", line)
        elif entry is not None and raw[0].isspace() and line.startswith("#"):
            entry["via"] += _via(line)
        elif not line.startswith("#"):
            raise ValueError(f"{path.name}:{n}: not a pin, a --hash or a comment: {line}")
    close()
    return pins


def _via(comment: str) -> list[str]:
    """The names of uv's annotation `# via a, b` or `#   a` ("rlhf (pyproject.toml)" is rlhf, "-r -" is kept)."""
    names = comment.lstrip("#").strip().removeprefix("via").strip()
    return [canonicalize_name(n.split()[0]) if n.split()[0][0].isalnum() else n.strip()
            for n in names.split(",") if n.strip()]


def locked_cuda(pins: dict[str, Pin]) -> tuple[str | None, Pin | None]:
    """The CUDA version torch requires as the lock records it (the CUDA runtime pin annotated `via torch`), and that
    pin; (None, None) when torch requires none (a lock resolved for CPU wheels)."""
    for pin in pins.values():
        if "torch" in pin.via and CUDA_RUNTIME.fullmatch(pin.name):
            return cuda_of([Requirement(f"{pin.name}=={pin.version}")]), pin
    return None, None


def locked_stack(root: Path = ROOT) -> dict:
    """torch's version and CUDA as requirements-gpu.lock pins them, and the driver that CUDA needs."""
    pins = read_lock(root / GPU_LOCK)
    cuda, _ = locked_cuda(pins)
    return {"lock": GPU_LOCK, "torch": pins["torch"].version, "cuda": cuda,
            "min_driver": min_driver(cuda) if cuda else None}


# ---------------------------------------------------------------------------------------------------------------
# the host


def driver_version() -> str | None:
    """The NVIDIA driver's version (nvidia-smi, first GPU); None without nvidia-smi or when it fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return lines[0].strip() if lines else None


def installed_torch() -> tuple[str | None, str | None]:
    """(version, CUDA) of the installed torch from its metadata, without importing it; CUDA None for a CPU build."""
    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return None, None
    reqs = [Requirement(r) for r in dist.requires or []]
    return dist.version, cuda_of([r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})])


def _older(driver: str, minimum: str) -> bool:
    try:
        return Version(driver) < Version(minimum)
    except InvalidVersion:
        return False  # a driver string we cannot read: torch's own error will say more than a guess


def driver_problem(driver: str | None, cuda: str | None, torch: str | None = None) -> str | None:
    """The one line that says the driver is too old for `cuda`, naming both versions and the fix; None when it is
    new enough or when there is nothing to compare."""
    if driver is None or cuda is None:
        return None
    minimum = min_driver(cuda)
    if not _older(driver, minimum):
        return None
    who = f"torch {torch}'s CUDA {cuda}" if torch else f"CUDA {cuda}"
    return (f"NVIDIA driver {driver} is older than {minimum}, the minimum for {who}: upgrade the driver to {minimum} "
            f"or later, or build with the older CUDA pins of {DOCS}")


def require_driver(device: str = "cuda") -> None:
    """Exit 2 with the one line of driver_problem when the host's driver cannot run the installed torch's CUDA
    (skipped for device 'cpu'): before anything loads, instead of torch's error at its first CUDA call."""
    if device == "cpu":
        return
    version, cuda = installed_torch()
    problem = driver_problem(driver_version() if cuda else None, cuda, version)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)


# ---------------------------------------------------------------------------------------------------------------
# what a GPU figure was measured with


def versions() -> dict:
    """torch, its CUDA, the driver and the libraries a GPU figure depends on (gpucheck's and decodebench's reports)."""
    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "driver": driver_version()}
    for pkg in ("bitsandbytes", "transformers", "peft", "trl"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def lock_differences(measured: dict, locked: dict) -> list[str]:
    """How a report's versions differ from the locked stack (locked_stack): torch's release, CUDA, a driver under
    the lock's minimum; one phrase each, empty when the figures are the pinned stack's. A version not recorded (runs
    before versions() existed recorded no CUDA or driver) is said so."""
    out = []
    torch = measured.get("torch")
    if torch is None or Version(Version(torch).public) != Version(locked["torch"]):
        out.append(f"torch {torch or 'not recorded'} (the lock: {locked['torch']})")
    cuda = measured.get("cuda") or _cuda_of_local(torch)
    if cuda != locked["cuda"]:
        out.append(f"CUDA {cuda or 'not recorded'} (the lock: {locked['cuda']})")
    driver = measured.get("driver")
    if driver is None:
        out.append("driver not recorded")
    elif locked.get("min_driver") and _older(driver, locked["min_driver"]):
        out.append(f"driver {driver} (the lock's CUDA needs {locked['min_driver']} or later)")
    return out


def stack(report: dict) -> tuple[str, str, str]:
    """(torch, CUDA, driver) a report recorded; 'not recorded' for what runs before versions() did not record (their
    CUDA is read from torch's local label, +cu130)."""
    cuda = report.get("cuda") or _cuda_of_local(report.get("torch"))
    return (report.get("torch") or "not recorded", cuda or "not recorded", report.get("driver") or "not recorded")


def stack_line(report: dict, root: Path = ROOT) -> str:
    """"torch X, CUDA Y, driver Z" of a report (gpucheck's, decodebench's) and, when they differ, how they differ from
    the locked stack: the one the report recorded (`lock`), else requirements-gpu.lock now. The line the reports'
    markdown puts above their figures."""
    locked = report.get("lock") or locked_stack(root)
    torch, cuda, driver = stack(report)
    line = f"torch {torch}, CUDA {cuda}, driver {driver}"
    differ = lock_differences(report, locked)
    if differ:
        line += (f"; **not the locked stack** ({locked['lock']}: torch {locked['torch']}, CUDA {locked['cuda']}, "
                 f"driver {locked['min_driver']} or later): {', '.join(differ)}")
    return line


def _cuda_of_local(torch: str | None) -> str | None:
    """'13.0' from a local label like 2.11.0+cu130 (what reports recorded before they recorded CUDA)."""
    m = re.fullmatch(r".*\+cu(\d+?)(\d)", torch or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


if __name__ == "__main__":
    require_driver()


# Library warnings this project cannot fix at their cause, each with its source; anything else still prints (the
# test suite's are listed in docs/testing.md).
HANDLED_WARNINGS = (
    # transformers 5.23 renamed gradient checkpointing "activation checkpointing" and warns on the old names. This
    # project calls the new ones (models.load_base, trainers.training_args); peft 0.21.2 reads the old property
    # whenever it wraps a model (PeftModel.__init__), and TRL 1.16's DPOTrainer reads it and calls the old
    # disable/enable around every reference pass (trl.models.utils.disable_gradient_checkpointing)
    (FutureWarning, r"`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated"),
    # bitsandbytes 0.50 on a CPU: a paged optimizer (paged_adamw_8bit) pages CUDA memory only, so it runs unpaged, the
    # same update, and says so each time one is made (experiments/tiny-gpu-flags.yaml runs the GPU settings on a CPU)
    (UserWarning, r"Paged optimizers are not supported on CPU"),
)


def quiet_handled_warnings() -> None:
    import warnings

    for category, message in HANDLED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
