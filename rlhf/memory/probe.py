"""Memory probes: the peak memory of each phase of a stage (load, forward_backward, optimizer, rollout, update, eval),
against a budget, with the same API on CUDA and CPU.

CUDA: torch's peak allocated/reserved, and the process's device memory from NVML (paged 8-bit optimizer state lives
in managed memory that torch's counters do not see). The process can be capped at the budget
(`memory.cap_to_budget`), so a 24 GB card is emulated on a bigger one.
CPU: the peak of live tensor bytes, counted by `TensorTracker` (a dispatch mode that sees every tensor an operator
returns and drops its storage's bytes when the storage is freed); the process's peak RSS is recorded beside it.

A phase whose peak passes the budget raises MemoryBudgetError naming the phase and the figures.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
import warnings
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

log = logging.getLogger(__name__)
GB = 1024**3


class MemoryBudgetError(RuntimeError):
    pass


# ----------------------------------------------------------------------------------------------------- CPU tracking
class TensorTracker(TorchDispatchMode):
    """Live bytes of the tensor storages on one device type, and their peak since the last reset_peak().

    Every operator's outputs pass through __torch_dispatch__; a storage is counted once (views share it) and
    uncounted by a weakref finalizer when it is freed. Tensors alive before start() are found by a gc scan."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        self.cpu = device_type == "cpu"
        self.live: dict[int, int] = {}
        self.current = self.peak = 0
        self.active = False

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def _see(self, t: torch.Tensor) -> None:
        if t.is_cpu is not self.cpu or t.is_meta:
            return
        st = t.untyped_storage()
        key, n = st._cdata, st.nbytes()
        old = self.live.get(key)
        if old == n:
            return
        if old is None:
            weakref.finalize(st, self._free, key)
        self.live[key] = n
        self.current += n - (old or 0)
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):  # the common case first: it runs for every operator
            self._see(out)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    self._see(t)
                elif isinstance(t, (tuple, list)):
                    for u in tree_leaves(t):
                        if isinstance(u, torch.Tensor):
                            self._see(u)
        return out

    def start(self) -> "TensorTracker":
        with warnings.catch_warnings():  # isinstance() on some torch module objects warns of deprecations
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                with contextlib.suppress(Exception):
                    if isinstance(obj, torch.Tensor):
                        self._see(obj)
        self.__enter__()
        self.active = True
        _ACTIVE.append(self)
        return self

    def stop(self) -> None:
        if self.active:
            self.active = False
            self.__exit__(None, None, None)
            _ACTIVE.remove(self)

    def reset_peak(self) -> None:
        self.peak = self.current


_ACTIVE: list[TensorTracker] = []


def stop_all() -> None:
    """Pop trackers a failed stage left pushed (a stage that raised never reached Session.finish)."""
    for t in reversed(list(_ACTIVE)):
        t.stop()


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


# ---------------------------------------------------------------------------------------------------------- probe
class MemoryProbe:
    """Per-phase peaks. `phase(name)` measures a block; `switch(name)` closes the current phase and opens the next
    (for phases that alternate inside a trainer's step); `sample(step)` adds a point to the timeline plot."""

    def __init__(self, device: torch.device, budget_gb: float, enforce: bool = True, cap_to_budget: bool = False,
                 track_tensors: bool = True):
        self.device, self.budget_gb, self.enforce = device, budget_gb, enforce
        self.cuda = device.type == "cuda"
        self.phases: dict[str, dict] = {}
        self.timeline: list[dict] = []
        self.current_phase: str | None = None
        self.t0 = time.time()
        self.tracker = None
        if self.cuda and cap_to_budget:
            index = device.index if device.index is not None else torch.cuda.current_device()  # "cuda" has none
            total = torch.cuda.get_device_properties(index).total_memory
            frac = min(1.0, budget_gb * GB / total)
            torch.cuda.set_per_process_memory_fraction(frac, index)
            log.info("capped this process at %.1f GB (%.3f of the device)", budget_gb, frac)
        if not self.cuda and track_tensors:
            stop_all()
            self.tracker = TensorTracker("cpu").start()
        self.t0 = time.time()

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.stop()

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_rss_peak()
            if self.tracker is not None:
                self.tracker.reset_peak()

    def current_gb(self) -> float:
        if self.cuda:
            return torch.cuda.memory_allocated(self.device) / GB
        return (self.tracker.current if self.tracker is not None else 0) / GB

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
            if self.tracker is not None:
                out["peak_tensors_gb"] = self.tracker.peak / GB
            out["peak_gb"] = out.get("peak_tensors_gb", out["peak_rss_gb"])
        return {k: round(v, 6) for k, v in out.items()}

    @contextlib.contextmanager
    def phase(self, name: str):
        outer = self.current_phase
        self.switch(name)
        try:
            yield
        finally:
            self.switch(outer)

    def switch(self, name: str | None) -> None:
        """Record the phase in progress (if any) and start measuring `name` (None = between phases)."""
        if self.current_phase is not None:
            self.record(self.current_phase)
        self.current_phase = name
        self.phase_t0 = round(time.time() - self.t0, 3)
        self.reset()

    def sample(self, step: int) -> None:
        self.timeline.append({"t": round(time.time() - self.t0, 3), "step": step, "phase": self.current_phase,
                              "current_gb": round(self.current_gb(), 6), "peak_gb": self.read()["peak_gb"]})

    def record(self, name: str) -> dict:
        figures = self.read()
        prev = self.phases.get(name)
        if prev is None or figures["peak_gb"] > prev["peak_gb"]:
            self.phases[name] = figures
        self.timeline.append({"t": round(time.time() - self.t0, 3), "t_start": getattr(self, "phase_t0", 0.0),
                              "step": None, "phase": name, "current_gb": round(self.current_gb(), 6),
                              "peak_gb": figures["peak_gb"]})
        if figures["peak_gb"] > self.budget_gb:
            msg = (f"memory budget exceeded in phase '{name}': peak {figures['peak_gb']:.3f} GB > "
                   f"memory.budget_gb={self.budget_gb} GB ({figures}). Lower the batch size or sequence length, "
                   f"turn on model.gradient_checkpointing, or raise memory.budget_gb.")
            if self.enforce:
                self.close()
                raise MemoryBudgetError(msg)
            log.warning(msg)
        return figures

    def summary(self) -> dict:
        peak = max((p["peak_gb"] for p in self.phases.values()), default=0.0)
        kind = "cuda" if self.cuda else ("cpu_tensors" if self.tracker is not None else "cpu_rss")
        return {"device": "cuda" if self.cuda else "cpu", "measure": kind, "budget_gb": self.budget_gb,
                "peak_gb": peak, "phases": self.phases}

    def plot(self, path, title: str = "") -> None:
        """Memory over time, coloured by phase, with each phase's peak: a PNG for people."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if not self.timeline:
            return
        fig, ax = plt.subplots(figsize=(8, 3.6), dpi=110)
        unit, scale = ("MB", 1024) if self.summary()["peak_gb"] < 1 else ("GB", 1)
        names = list(dict.fromkeys(p["phase"] for p in self.timeline if p["phase"]))
        colors = dict(zip(names, plt.cm.tab10.colors))
        ts = [p["t"] for p in self.timeline]
        ax.plot(ts, [p["current_gb"] * scale for p in self.timeline], color="0.6", lw=1, label="live")
        for name in names:  # each measured phase: a bar at its peak from its start to its end
            pts = [p for p in self.timeline if p["phase"] == name and "t_start" in p]
            ax.hlines([p["peak_gb"] * scale for p in pts], [p["t_start"] for p in pts], [p["t"] for p in pts],
                      color=colors[name], lw=3,
                      label=f"{name} (peak {self.phases.get(name, {}).get('peak_gb', 0) * scale:.3g} {unit})")
        if self.budget_gb * scale < 2 * max(p["peak_gb"] * scale for p in self.timeline):
            ax.axhline(self.budget_gb * scale, color="red", ls="--", lw=1, label=f"budget {self.budget_gb} GB")
        ax.set_xlabel("seconds since stage start")
        ax.set_ylabel(f"memory ({unit}, {self.summary()['measure']})")
        ax.set_title(title or "memory by phase")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
