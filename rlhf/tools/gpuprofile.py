"""Where an online iteration's time goes (`make gpucheck`): the parts the loop times (metrics.jsonl's time/<part>_s),
and one iteration under torch.profiler, its ops and kernels grouped (bitsandbytes' 4-bit dequantization, matrix
products, attention, the rest)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

from rlhf.experiment import config
from rlhf.experiment import stages as registry
from rlhf.tools.gpumetrics import iterations


UPDATE_PARTS = ("update_policy", "update_value", "optimizer")
"""The loop's timed parts inside the update (time/update_s); the others are inside the rollout (time/rollout_s)."""
INSIDE_PARTS = ("judge_reference",)
"""Times inside a part, not beside it: SFT's reference draw, once a run, is in its measurement's judge time."""


def iteration_parts(summary: dict) -> dict:
    """Seconds per part of an online stage's iteration, from the run's per-iteration records (metrics.jsonl; the
    summary's `throughput` `<part>_s_per_step` means for a run without them): each part the loop times
    (`time/<part>_s`: generate, policy, value, ref, score, judge, reward_fns, update_policy, update_value,
    optimizer; GRPO times the optimizer's steps alone of its update), and what the parts leave of the rollout
    (`rollout_rest`), of the update (`update_rest`: GRPO's forward and backward passes) and of the iteration
    (`bookkeeping`: after the update). With two iterations or more the first (the sampler's compile, the allocator's
    growth) is apart: `first_iteration` holds its parts, and the means are the later iterations'. Returns
    {"iterations", "step_s", "parts_s" (the mean per iteration), "share" (of step_s), "per_iteration"[,
    "first_iteration"]}."""
    its = [{k[len("time/"):-2]: v for k, v in x.items() if k.startswith("time/") and k.endswith("_s")}
           for x in iterations(summary)]
    if not its:  # the run's means
        tp = summary.get("throughput") or {}
        its = [{("step" if k == "step_s" else k[:-len("_s_per_step")]): v for k, v in tp.items()
                if k == "step_s" or k.endswith("_s_per_step")}]
        if "step" not in its[0]:
            return {}

    def split(t: dict) -> dict:
        parts = {k: v for k, v in t.items() if k not in ("step", "rollout", "update", *INSIDE_PARTS)}
        rollout = sum(v for k, v in parts.items() if k not in UPDATE_PARTS)
        update = sum(v for k, v in parts.items() if k in UPDATE_PARTS)
        return {**parts, "rollout_rest": max(t.get("rollout", rollout) - rollout, 0.0),
                "update_rest": max(t.get("update", update) - update, 0.0),
                "bookkeeping": max(t["step"] - t.get("rollout", rollout) - t.get("update", update), 0.0)}

    every = [split(t) for t in its]
    per = every[1:] or every
    later = its[1:] or its
    keys = list(dict.fromkeys(k for p in per for k in p))
    mean = {k: round(sum(p.get(k, 0.0) for p in per) / len(per), 4) for k in keys}
    step = sum(t["step"] for t in later) / len(later)
    rows = [{"step_s": round(t["step"], 4), **{k: round(v, 4) for k, v in p.items()}} for t, p in zip(its, every)]
    return {"iterations": len(its), "step_s": round(step, 4), "parts_s": mean,
            "share": {k: round(v / step, 4) if step else None for k, v in mean.items()},
            "per_iteration": rows, **({"first_iteration": rows[0]} if len(its) > 1 else {})}


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


@functools.lru_cache(maxsize=None)
def profile_group(name: str, parents: tuple = ()) -> str:
    """The group of an op (or kernel) `name` called inside `parents` (innermost first): the first of its own name and
    its enclosing ops' names that PROFILE_GROUPS knows decides, so an op a bitsandbytes or attention op runs inside
    (a copy, an allocation) counts there; "other" when none does. Cached: an iteration's ~10^5 events repeat a few
    thousand (name, parents) pairs."""
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


def profile_events(result) -> tuple[list, list]:
    """(CPU ops, device kernels) of a stopped torch.profiler run's raw events (`prof.profiler.kineto_results`) as
    group_profile's (name, self seconds, enclosing op names) triples: every CPU op's self time; every kernel (and
    memcpy/memset) inside the CPU op that launched it and that op's parents (the device events alone, without
    parents, where none was linked). The ops nest as torch.profiler nests them (its event list, prof.events(), builds
    the same with a heavier object per event: 8.4 s of the CPU dry run's PPO profile pass, 2 x 10^5 events, which went
    from 17 s to 10 s with this; the test holds the two equal): per thread, an op inside another's [start, end) is
    its child, its self time its own less its children's; an op that is the only child of an op of its own name
    (autograd's aten::sum around the kernel's) is folded into that parent; async ops and the profiler's bookkeeping
    left out; a runtime call (cudaLaunchKernel) nests on the thread of the op it serves."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import _filter_name

    name_of = functools.lru_cache(maxsize=None)(_display_name)
    ops, kernels, thread_of = [], [], {}
    for e in result.events():
        if _filter_name(e.name()) or e.is_hidden_event():
            continue
        if e.device_type() != DeviceType.CPU:
            kernels.append((name_of(e.name()), e.start_ns(), e.end_ns(), e.linked_correlation_id()))
            continue
        if e.is_async() or e.start_thread_id() != e.end_thread_id():
            continue
        ops.append(_Op(e.start_thread_id(), e.start_ns(), e.end_ns(), name_of(e.name()), e.correlation_id(),
                       e.linked_correlation_id()))
        if e.linked_correlation_id() == 0:
            thread_of[e.correlation_id()] = e.start_thread_id()
    for op in ops:
        if op.linked > 0:
            op.thread = thread_of.get(op.linked, op.thread)
    ops.sort(key=lambda op: (op.thread, op.start, -op.end))
    stack: list[_Op] = []
    for op in ops:
        while stack and (stack[-1].thread != op.thread or op.start >= stack[-1].end or op.end > stack[-1].end):
            stack.pop()
        if stack:
            op.parent = stack[-1]
            stack[-1].kids.append(op)
            stack[-1].children_ns += op.end - op.start
        stack.append(op)
    frontend = {op.id: op for op in ops if op.linked == 0}
    for op in ops:  # parents first: an only child of its parent's name is folded into it, as the event list does
        p = op.parent
        if p is not None and p.name == op.name and len(p.kids) == 1:
            p.kids, p.children_ns = op.kids, op.children_ns
            for kid in op.kids:
                kid.parent = p
            op.folded = True
            if op.id in frontend:  # its kernels count inside the parent
                frontend[op.id] = p
    cpu = [(op.name, (op.end - op.start - op.children_ns) / 1e9, _chain(op.parent)) for op in ops if not op.folded]
    dev = [(name, (end - start) / 1e9, _chain(frontend[link])) for name, start, end, link in kernels
           if link in frontend]
    if not dev:
        dev = [(name, (end - start) / 1e9) for name, start, end, _ in kernels]
    return cpu, dev


@dataclasses.dataclass(slots=True)
class _Op:
    """A CPU op of a profile (profile_events): its thread, start and end (ns), name, correlation id, the id of the op
    it serves (0: none), the op it runs inside, the ops directly inside it and their time (ns), and whether it was
    folded into its parent."""

    thread: int
    start: int
    end: int
    name: str
    id: int
    linked: int
    parent: _Op | None = None
    kids: list = dataclasses.field(default_factory=list)
    children_ns: int = 0
    folded: bool = False


def _chain(op: _Op | None) -> tuple[str, ...]:
    """The names of `op` and of the ops it runs inside, innermost first."""
    out = []
    while op is not None:
        out.append(op.name)
        op = op.parent
    return tuple(out)


def _display_name(name: str) -> str:
    """An event's name as torch.profiler's event list shows it (demangled, numbered names as a wildcard)."""
    from torch.autograd.profiler_util import _rewrite_name

    return _rewrite_name(name, with_wildcard=True)


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
    costs: kernel selection, allocator growth). The stage's own loop runs unchanged; only its iterations are observed
    (online.OBSERVE_ITERATIONS wraps its bar), and its output goes to a file. Returns {"iteration", "activities", "wall_s" (the profiled
    iteration, profiler on), "parts_s" (its timed parts, iteration_parts' split), "cpu" and "device" (group_profile of
    the CPU ops' and the kernels' self time against wall_s; device None on a CPU)}."""
    import torch
    from torch.profiler import ProfilerActivity

    from rlhf.rl import online

    exp = config.load(exp_path, [*ov, f"{stage}.steps={warmup + 1}"])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    wrapped = []

    def observe(bar):
        wrapped.append(_ProfiledIteration(bar, warmup + 1, activities))
        return wrapped[-1]

    log = Path(work or tempfile.gettempdir()) / f"profile-{stage}-{os.getpid()}.log"
    token = online.OBSERVE_ITERATIONS.set(observe)
    try:
        with _quiet(log):
            summary = registry.get(stage).run(exp, resume=False)
    except BaseException as e:
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-15:]) if log.exists() else ""
        raise RuntimeError(f"{type(e).__name__}: {e}\n{tail}") from e
    finally:
        online.OBSERVE_ITERATIONS.reset(token)
    (it,) = wrapped
    if it.prof is None:
        raise RuntimeError(f"{stage} never ran iteration {warmup + 1}")
    cpu, dev = profile_events(it.prof.profiler.kineto_results)
    parts = iteration_parts(summary)
    last = (parts.get("per_iteration") or [{}])[-1]
    return {"iteration": warmup + 1, "activities": [a.name.lower() for a in activities],
            "wall_s": round(it.wall_s, 4), "parts_s": last, "cpu": group_profile(cpu, it.wall_s, "untraced", top),
            "device": group_profile(dev, it.wall_s, "idle", top) if torch.cuda.is_available() else None}
