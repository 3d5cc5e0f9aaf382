"""Memory probes: the peak memory of each phase of a stage (model load, train, rollout, update, ...), with a budget.

CUDA: torch's peak allocated/reserved, and the process's device memory from NVML (paged 8-bit optimizer state lives
in managed memory that torch's counters do not see). CPU: the process's peak resident set (VmHWM, reset per phase via
/proc/self/clear_refs). The same API on both; a phase whose peak passes the budget raises MemoryBudgetError.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

log = logging.getLogger(__name__)
GB = 1024**3


class MemoryBudgetError(RuntimeError):
    pass


def _rss_peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_rss_peak() -> None:
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def _nvml_used(index: int) -> int | None:
    try:
        import pynvml  # optional: nvidia-ml-py

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        pid = os.getpid()
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid:
                return proc.usedGpuMemory
    except Exception:  # no NVML, or no permission to list processes
        return None
    return None


class MemoryProbe:
    def __init__(self, device: torch.device, budget_gb: float, enforce: bool = True):
        self.device, self.budget_gb, self.enforce = device, budget_gb, enforce
        self.cuda = device.type == "cuda"
        self.phases: dict[str, dict] = {}

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_rss_peak()

    def read(self) -> dict:
        """Peak figures (GB) since the last reset."""
        if self.cuda:
            out = {"peak_allocated_gb": torch.cuda.max_memory_allocated(self.device) / GB,
                   "peak_reserved_gb": torch.cuda.max_memory_reserved(self.device) / GB}
            nvml = _nvml_used(self.device.index or 0)
            if nvml is not None:
                out["nvml_used_gb"] = nvml / GB
            out["peak_gb"] = max(out.values())
        else:
            out = {"peak_rss_gb": _rss_peak() / GB}
            out["peak_gb"] = out["peak_rss_gb"]
        return {k: round(v, 4) for k, v in out.items()}

    @contextlib.contextmanager
    def phase(self, name: str):
        self.reset()
        yield
        self.record(name)

    def record(self, name: str) -> dict:
        figures = self.read()
        prev = self.phases.get(name)
        if prev is None or figures["peak_gb"] > prev["peak_gb"]:
            self.phases[name] = figures
        if figures["peak_gb"] > self.budget_gb:
            msg = (f"memory budget exceeded in phase '{name}': peak {figures['peak_gb']:.2f} GB > "
                   f"memory.budget_gb={self.budget_gb} GB ({figures})")
            if self.enforce:
                raise MemoryBudgetError(msg)
            log.warning(msg)
        return figures

    def summary(self) -> dict:
        peak = max((p["peak_gb"] for p in self.phases.values()), default=0.0)
        return {"device": "cuda" if self.cuda else "cpu", "budget_gb": self.budget_gb, "peak_gb": peak,
                "phases": self.phases}
