"""An online stage's checkpoints: everything its next iteration depends on (trained adapters and value head, the
optimizer, the prompt order, every RNG of every data-parallel rank, the history), loaded without running code; and
the check that a resumed run has as many ranks as the run that wrote its checkpoint (online or the Trainer's)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from peft.utils import set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from rlhf.infra import dist, faults
from rlhf.runs import records
from rlhf.rl.roles import Roles


class PromptOrder:
    """Prompts in a seeded shuffled order, reshuffled each time the pool runs out; checkpointed with its RNG. A pool
    smaller than a batch is gone through as many times as the batch needs (a prompt file of 4 prompts fills a rollout
    of 64)."""

    def __init__(self, n: int, seed: int):
        self.n, self.rng, self.order = n, random.Random(seed), []

    def take(self, k: int) -> list[int]:
        if not self.n and k:
            raise ValueError("no prompts to take from")
        while len(self.order) < k:
            extra = list(range(self.n))
            self.rng.shuffle(extra)
            self.order += extra
        out, self.order = self.order[:k], self.order[k:]
        return out

    def state(self) -> dict:
        return {"order": list(self.order), "prompt_rng": self.rng.getstate()}

    def restore(self, state: dict) -> None:
        version, inner, gauss_next = state["prompt_rng"]
        self.rng.setstate((version, tuple(inner), gauss_next))
        self.order = list(state["order"])


def rng_states() -> tuple[dict, dict]:
    """Every RNG's state as (tensors, JSON): nothing in a checkpoint needs pickle to load."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(keys.astype(np.int64))}
    if torch.cuda.is_available():
        tensors.update({f"cuda{i}": t for i, t in enumerate(torch.cuda.get_rng_state_all())})
    return tensors, {"numpy": [kind, int(pos), int(has_gauss), float(gauss)], "python": random.getstate()}


def set_rng_states(tensors: dict, js: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    kind, pos, has_gauss, gauss = js["numpy"]
    np.random.set_state((kind, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, state, gauss_next = js["python"]
    random.setstate((version, tuple(state), gauss_next))
    if torch.cuda.is_available() and "cuda0" in tensors:
        torch.cuda.set_rng_state_all([tensors[f"cuda{i}"] for i in range(torch.cuda.device_count())])


def rng_file(rank: int) -> str:
    """A rank's RNG tensors in a checkpoint: rng.safetensors (rank 0, and a single process), rng_<rank>.safetensors."""
    return "rng.safetensors" if rank == 0 else f"rng_{rank}.safetensors"


def save_checkpoint(roles: Roles, opt, step: int, ckpt_dir: Path, *, order: PromptOrder, history: list[dict],
                    metrics_lines: int, tensors: dict | None = None, **state) -> None:
    """Everything the next iteration depends on: the trained adapters (and value head), the optimizer, the prompt
    order (position + its RNG), every RNG, the history the summary averages, how many metrics lines were written,
    and the stage's own `state` (PPO: the KL controller's beta) and `tensors` (keep=judge: the measured
    policies the one-SE rule may choose). Tensors go to safetensors (the optimizer's state to
    a tensors-only torch file, loaded with weights_only=True), the rest to JSON: loading a checkpoint never runs
    code. Written into a temp dir, renamed to step-N, then `last` moved to it, so a kill never leaves a half-written
    one that `last` names; a full disk, a read-only directory or no memory raises faults.WriteFault naming step-N
    and the size of the last complete checkpoint, and the temp dir is removed. Data parallel: called on every rank,
    which hands its RNG states to rank 0; rank 0 writes them all (rng_file, state.json's `rng` list) with the rest,
    which the ranks hold alike (the weights, the optimizer, the prompt order: every rank draws the global batch)."""
    rngs = dist.gather_to_main(rng_states())
    if not dist.is_main():
        return
    final, last = ckpt_dir / f"step-{step}", ckpt_dir / "last"
    previous = ckpt_dir / last.read_text().strip() if last.exists() else None
    with faults.writing(final, "checkpoint", needed=faults.tree_bytes(previous)):
        # .step-N.tmp, renamed over step-N (a resumed run passing a step it had checkpointed before it was killed)
        with records.atomic_dir(final) as tmp:
            _write(tmp, roles, opt, tensors, rngs, {**state, "step": step, **order.state(), "history": history,
                                                    "metrics_lines": metrics_lines})
        records.atomic_write(last, final.name + "\n")


def _write(path: Path, roles: Roles, opt, tensors: dict | None, rngs: list[tuple[dict, dict]], state: dict) -> None:
    """A checkpoint's files into `path` (save_checkpoint): adapters, value head, every rank's RNGs (`rngs`, in rank
    order), optimizer, the stage's tensors and `state` with the RNGs' JSON parts and the number of ranks."""
    roles.model.save_pretrained(path, selected_adapters=roles.adapters)
    if roles.value_head is not None:
        save_file({k: v.detach().cpu().contiguous() for k, v in roles.value_head.state_dict().items()},
                  str(path / "value_head.safetensors"))
    for rank, (rng_tensors, _) in enumerate(rngs):
        save_file(rng_tensors, str(path / rng_file(rank)))
    torch.save(opt.state_dict(), path / "optimizer.pt")
    if tensors:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "stage_tensors.safetensors"))
    records.atomic_write(path / "state.json", json.dumps({**state, "world_size": len(rngs),
                                                          "rng": [js for _, js in rngs]}))


def load_checkpoint(roles: Roles, opt, order: PromptOrder, path: Path) -> dict:
    """Restore what save_checkpoint wrote, each rank its own RNG states; returns its state (step, history and the
    stage's own, its `tensors` under "tensors"). The number of ranks was checked when the session found the
    checkpoint (runtime.Session.start: lineage.check_ranks), before anything loaded."""
    for name in roles.adapters:
        sub = path / name if (path / name / "adapter_model.safetensors").exists() else path
        weights = load_file(str(sub / "adapter_model.safetensors"), device=str(roles.device))
        unexpected = set_peft_model_state_dict(roles.model, weights, adapter_name=name).unexpected_keys
        if unexpected:
            raise RuntimeError(f"{path}: unexpected keys in the {name} adapter: {unexpected[:3]}")
    if roles.value_head is not None:
        roles.value_head.load_state_dict(load_file(str(path / "value_head.safetensors")))
    state = json.loads((path / "state.json").read_text())
    if (path / "stage_tensors.safetensors").exists():
        state["tensors"] = load_file(str(path / "stage_tensors.safetensors"))
    opt.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    order.restore(state)
    rng_json = state["rng"] if isinstance(state["rng"], dict) else state["rng"][dist.rank()]  # dict: before ranks
    set_rng_states(load_file(str(path / rng_file(dist.rank()))), rng_json)
    roles.use("policy")
    return state
