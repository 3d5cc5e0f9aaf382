"""Data-parallel runs: who this process is, the global -> per-device batch split, and the few collectives our own
online loops (PPO, GRPO, RLOO) need: global whitening, gradient reduction, weighted means. Launched by `torchrun` or
`accelerate launch` (they set RANK / WORLD_SIZE / LOCAL_RANK); a plain `python -m rlhf` is one process and every
helper here is then a no-op.

The config's batch sizes are global: each of the N ranks takes batch // N rows (a ConfigError names the key when
it does not divide). Only rank 0 writes the run record; the other ranks use the same run directory name (broadcast
from rank 0) so that the trainer's checkpoint folder is one folder."""

from __future__ import annotations

import os

import torch

from .config import ConfigError


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def active() -> bool:
    return world_size() > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


def init(device: torch.device) -> None:
    """Join the process group (gloo on a CPU `device`, nccl on CUDA) through accelerate's PartialState, the same state
    the HF Trainer uses later. Nothing happens in a single process."""
    if world_size() <= 1 or active():
        return
    from accelerate import PartialState

    PartialState(cpu=device.type == "cpu")


def per_device(global_size: int, key: str, where: str = "config") -> int:
    """The rows one rank takes of a global batch `key`; refuses a size the ranks cannot split evenly."""
    n = world_size()
    if global_size % n:
        raise ConfigError(f"{where}: {key}={global_size} is a global batch size and must be divisible by the number "
                          f"of processes ({n}); each rank takes {key} / {n} rows")
    return global_size // n


def local_rows(rows: list, global_size: int) -> list:
    """This rank's contiguous share of a global batch (rank 0 the first rows, as the Trainer's sharding does)."""
    k = global_size // world_size()
    return rows[rank() * k:(rank() + 1) * k]


def close() -> None:
    """Leave the process group after a finished stage, every rank together: a rank that exits with the group still
    up can be aborted by gloo's threads at interpreter exit ("terminate called without an active exception", seen
    once under load in tests/test_distributed.py's 2-rank GRPO run). Nothing happens in a single process."""
    if active():
        torch.distributed.barrier()
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


def whiten_global(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """losses.masked_whiten with the mean and variance over every rank's rows (the global rollout batch)."""
    s = all_reduce_(torch.stack([(x * mask).sum(), mask.sum()]).double())
    mean = (s[0] / s[1].clamp(min=1)).to(x.dtype)
    v = all_reduce_(torch.stack([((x - mean) ** 2 * mask).sum(), mask.sum()]).double())
    var = (v[0] / v[1].clamp(min=1)).to(x.dtype)
    if not shift_mean:
        return ((x - mean) * torch.rsqrt(var + 1e-8) + mean) * mask
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


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
