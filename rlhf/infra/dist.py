"""Data-parallel runs: who this process is, the global -> per-device batch split, and the few collectives our own
online loops (PPO, GRPO, RLOO) need: global sums (losses.masked_whiten's moments), gradient reduction, weighted
means. Launched by `torchrun` or `accelerate launch` (they set RANK / WORLD_SIZE / LOCAL_RANK); a plain
`python -m rlhf` is one process and every helper here is then a no-op.

The config's batch sizes are global: each of the N ranks takes batch // N rows (a ConfigError names the key when
it does not divide). Only rank 0 writes the run record; the other ranks use the same run directory name (broadcast
from rank 0) so that the trainer's checkpoint folder is one folder."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time

import torch

from rlhf.experiment.config import ConfigError
from rlhf.infra.ranks import LAUNCHER_PID, RANK_LINES, is_main, rank  # noqa: F401 - named dist.* by their callers


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def another_rank_said() -> bool:
    """Whether, under rlhf.launch, another rank has already left its last line: then this rank's failure (a collective
    whose peer went away: gloo's "Connection closed by peer") follows from that one, which the launcher says."""
    folder = os.environ.get(RANK_LINES)
    return bool(folder) and any(name != str(rank()) for name in os.listdir(folder) if name.isdigit())


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""What gloo's TCP transport says when the peer rank's process went away mid-collective."""


def peer_lost(e: BaseException) -> bool:
    """Whether `e` (or an exception it came from) is a collective's failure because another rank's process went away:
    torch's network error, or gloo's transport saying its peer closed or reset the connection. A rank that died of a
    signal (the OOM killer, kill -9) said nothing: the launcher says which one died and how. Anything else, an NCCL
    abort (a peer's death or a hang alike) included, is not taken for it."""
    from rlhf.infra.faults import chain

    return active() and any(isinstance(x, torch.distributed.DistNetworkError) or
                            ("gloo/transport" in str(x) and any(m in str(x) for m in PEER_LOST)) for x in chain(e))


def leave_for_peer(why: str) -> None:
    """This rank leaves (status 1) because a peer's process went away mid-collective (peer_lost), with one line, and
    under rlhf.launch a mark in its folder: the launcher then names the rank that died, not this one, however close
    their ends came (torchrun times each failure to the second)."""
    print(f"rank {rank()}: left, its peer gone ({why})", file=sys.stderr)
    folder = os.environ.get(RANK_LINES)
    if folder:
        try:
            open(os.path.join(folder, f"{rank()}.left"), "w").close()
        except OSError:
            pass  # the launcher's folder is gone: it has already said what ended the launch
    leave(1)


def leave(status: int) -> None:
    """This rank ends now, with `status`, its output flushed: after a peer failed, a normal exit could abort in the
    process group's teardown (a thread still joinable: "terminate called without an active exception", SIGABRT)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def quiet() -> bool:
    """Whether this rank leaves its console lines to rank 0 (under rlhf.launch, rank > 0)."""
    return bool(os.environ.get(RANK_LINES)) and not is_main()


def warn(warning: str | None) -> list[str]:
    """Rank 0 prints `warning` (when there is one) on stderr, once for all ranks; returns it as the run summary's
    `warnings` list."""
    if warning and is_main():
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return [warning] if warning else []


def active() -> bool:
    return world_size() > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


def init(device: torch.device) -> None:
    """Join the process group (gloo on a CPU `device`, nccl on CUDA) through accelerate's PartialState, the same state
    the HF Trainer uses later. Nothing happens in a single process."""
    if world_size() <= 1 or active():
        return
    from accelerate import PartialState

    PartialState(cpu=device.type == "cpu")


def die_with_launcher(poll: float = 1.0) -> None:
    """A rank launched by torchrun or `accelerate launch` (its parent is the launcher's agent; each rank runs in a
    session of its own, so a kill of the launcher's process group does not reach it) is killed (SIGKILL) as soon as
    its launcher goes away: by the kernel's parent-death signal (Linux prctl PR_SET_PDEATHSIG), and by a thread that
    polls the parent's pid every `poll` seconds where there is no prctl; at once where rlhf.launch (ranks.LAUNCHER_PID)
    is gone already (it went while the rank imported: a Ctrl-C at the ranks' start left them waiting for their peers
    for good). SIGKILL: the rank may wait in a collective for a peer that is gone, and the checkpoints are written to
    a temp dir and renamed (checkpoints.save_checkpoint), so what a kill leaves is the last complete checkpoint.
    Nothing happens outside a launcher (no LOCAL_RANK)."""
    if "LOCAL_RANK" not in os.environ:
        return
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher:  # rlhf.launch launched this rank: it may have gone while the rank imported (its parent is init now)
        try:
            os.kill(int(launcher), 0)
        except ProcessLookupError:
            os.kill(os.getpid(), signal.SIGKILL)
        except PermissionError:  # a process of another user: alive
            pass
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass  # no prctl here: the thread below
    if os.getppid() != parent:  # the launcher went away before the signal was set
        os.kill(os.getpid(), signal.SIGKILL)

    def watch():
        while True:
            time.sleep(poll)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-launcher", daemon=True).start()


def seed_apart(seed: int) -> None:
    """Rank r > 0 reseeded (Python, NumPy, torch on every device) with seed + r, once every rank has built the same
    model: the online stages' ranks sample their rollouts with random numbers of their own, not one rank's draws
    repeated (TRL's online trainers seed each process apart alike: set_seed(seed, device_specific=True)). Rank 0,
    and a single process, keep the state the stage's seeding left."""
    if rank() == 0:
        return
    import random

    import numpy as np

    random.seed(seed + rank())
    np.random.seed(seed + rank())
    torch.manual_seed(seed + rank())  # every device's generator too


def per_device(global_size: int, key: str, where: str = "config", n: int | None = None,
               what: str = "a global batch size") -> int:
    """The rows one of `n` ranks (world_size() unless given) takes of a global batch `key`; refuses a size the ranks
    cannot split evenly (the error carries `key`: config.load names the override, or the file's line, that set it)."""
    n = world_size() if n is None else n
    if global_size % n:
        raise ConfigError(f"{where}: {key}={global_size} is {what} and must be divisible by the number of processes "
                          f"({n}); each rank takes {key} / {n} rows", key=key)
    return global_size // n


def check_split(exp, stage: str, n: int | None = None) -> None:
    """Refuses, before anything loads, a global batch of `stage` (stages.Stage.batches; an online stage's judge
    prompts too, when it measures) that `n` ranks (world_size() unless given) cannot split evenly: config.load's
    `check`, so that its error names the override or the file's line; rlhf.launch checks it with the launcher's
    process count before any rank starts."""
    from rlhf.experiment import stages
    from rlhf.experiment.online_sections import guarded

    st, where = stages.REGISTRY.get(stage), exp.source or "config"  # a tool (memplan) is no stage
    for k in st.batches if st and st.trains else ():
        per_device(getattr(st.config(exp), k), f"{st.section}.{k}", where, n)
    section = st.config(exp) if st and st.online else None
    if section and guarded(exp, section):  # the judge measures: each rank samples its share of the prompts
        per_device(section.judge_prompts, f"{st.section}.judge_prompts", where, n,
                   "split over the ranks (each samples its share of every measurement)")
        if section.keep in ("judge", "auto") and section.playoff_alpha > 0:  # 0: four times judge_prompts
            per_device(section.playoff_prompts, f"{st.section}.playoff_prompts", where, n,
                       "split over the ranks (each samples its share of the playoff's prompts)")


def local_rows(rows: list, global_size: int) -> list:
    """This rank's contiguous share of a global batch (rank 0 the first rows, as the Trainer's sharding does)."""
    k = global_size // world_size()
    return rows[rank() * k:(rank() + 1) * k]


def close() -> None:
    """Leave the process group after a finished stage, every rank together: a rank that exits with the group still
    up can be aborted by gloo's threads at interpreter exit ("terminate called without an active exception", seen
    once under load in tests/test_distributed.py's 2-rank GRPO run). The stage's garbage is collected first: a
    finished Trainer kept in a reference cycle holds its DDP wrapper, and that the group, until the interpreter's
    finalization, where the group's threads abort the same way (rank 1 of a 2-rank SFT run, once, with the group
    destroyed). Nothing happens in a single process."""
    if active():
        torch.distributed.barrier()
        gc.collect()
        torch.distributed.destroy_process_group()


def barrier() -> None:
    if active():
        torch.distributed.barrier()


def broadcast_object(obj):
    """Rank 0's `obj` on every rank."""
    if not active():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_main(obj) -> list | None:
    """Every rank's `obj` in rank order on rank 0 (None on the others); [obj] in a single process."""
    if not active():
        return [obj]
    box = [None] * world_size() if is_main() else None
    torch.distributed.gather_object(obj, box, dst=0)
    return box


def _native(t: torch.Tensor) -> torch.Tensor:
    """nccl reduces CUDA tensors only; gloo takes CPU tensors."""
    if torch.distributed.get_backend() == "nccl" and t.device.type != "cuda":
        return t.cuda()
    return t


def all_reduce_(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place sum or mean over ranks."""
    if active():
        x = _native(t)
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.SUM)
        if op == "mean":
            x /= world_size()
        if x is not t:
            t.copy_(x)
    return t


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0, in rank order (equal shapes on every rank)."""
    if not active():
        return t
    x = _native(t.contiguous())
    parts = [torch.empty_like(x) for _ in range(world_size())]
    torch.distributed.all_gather(parts, x)
    return torch.cat(parts).to(t.device)


def all_gather_varlen(t: torch.Tensor, pad: float = -1e9) -> torch.Tensor:
    """Every rank's 1-D tensor concatenated in rank order, whatever each one's length (each padded to the longest with
    `pad`, a value none of them holds, which is dropped after the gather: TRL's pad_across_processes + gather)."""
    if not active():
        return t
    n = torch.tensor([t.numel()], device=t.device)
    longest = int(all_gather_rows(n).max())
    padded = torch.full((longest,), pad, dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    out = all_gather_rows(padded)
    return out[out != pad]


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on any (a decision all ranks must take together)."""
    if not active():
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    return bool(all_reduce_(t).item() > 0)


def mean_scalars(metrics: dict[str, float]) -> dict[str, float]:
    """Each float averaged over ranks (keys in the same order on every rank)."""
    if not active() or not metrics:
        return metrics
    keys = sorted(metrics)
    t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    all_reduce_(t, "mean")
    return dict(zip(keys, t.tolist()))


def average_gradients(params: list[torch.Tensor]) -> None:
    """Sum the trainable parameters' gradients over ranks, in one flat buffer. Each rank's loss is already divided by
    the minibatch's global normalizer, so the sum is the gradient of the global minibatch loss."""
    if not active():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = all_reduce_(torch.cat([g.reshape(-1).float() for g in grads]))
    i = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[i:i + n].view_as(g).to(g.dtype)
        i += n


def global_means(weighted: dict[str, float]) -> dict[str, float]:
    """Micro-batch statistics x their weights (key "_w": the weights' sum), summed over ranks, as weighted means."""
    keys = sorted(weighted)
    tot = dict(zip(keys, all_reduce_(torch.tensor([weighted[k] for k in keys], dtype=torch.float64)).tolist()))
    return {k: tot[k] / max(tot["_w"], 1.0) for k in keys if k != "_w"}
