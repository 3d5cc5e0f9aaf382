"""An online stage's checkpoints: everything its next iteration depends on (trained adapters and value head, the
optimizer, the prompt order, every RNG, the history), loaded without running code."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from peft.utils import set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from . import faults, models, records
from .roles import Roles


class PromptOrder:
    """Prompts in a seeded shuffled order, reshuffled each time the pool runs out; checkpointed with its RNG."""

    def __init__(self, n: int, seed: int):
        self.n, self.rng, self.order = n, random.Random(seed), []

    def take(self, k: int) -> list[int]:
        if len(self.order) < k:
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


def save_checkpoint(roles: Roles, opt, step: int, ckpt_dir: Path, *, order: PromptOrder, history: list[dict],
                    metrics_lines: int, tensors: dict | None = None, **state) -> None:
    """Everything the next iteration depends on: the trained adapters (and value head), the optimizer, the prompt
    order (position + its RNG), every RNG, the history the summary averages, how many metrics lines were written,
    and the stage's own `state` (PPO: the KL controller's beta) and `tensors` (keep=judge: the measured
    policies the one-SE rule may choose). Tensors go to safetensors (the optimizer's state to
    a tensors-only torch file, loaded with weights_only=True), the rest to JSON: loading a checkpoint never runs
    code. Written into a temp dir, renamed to step-N, then `last` moved to it, so a kill never leaves a half-written
    one that `last` names; a full disk, a read-only directory or no memory raises faults.WriteFault naming step-N
    and the size of the last complete checkpoint, and the temp dir is removed."""
    tmp, final, last = ckpt_dir / f".step-{step}.tmp", ckpt_dir / f"step-{step}", ckpt_dir / "last"
    previous = ckpt_dir / last.read_text().strip() if last.exists() else None
    with faults.writing(final, "checkpoint", needed=faults.tree_bytes(previous), partial=tmp):
        shutil.rmtree(tmp, ignore_errors=True)  # left by a write that was killed: written anew
        tmp.mkdir(parents=True)
        _write(tmp, roles, opt, tensors, {**state, "step": step, **order.state(), "history": history,
                                          "metrics_lines": metrics_lines})
        if final.exists():  # a resumed run passing a step it had checkpointed before it was killed
            shutil.rmtree(final)
        tmp.rename(final)
        records.atomic_write(last, final.name + "\n")


def _write(path: Path, roles: Roles, opt, tensors: dict | None, state: dict) -> None:
    """A checkpoint's files into `path` (save_checkpoint): adapters, value head, RNGs, optimizer, the stage's tensors
    and `state` with the RNGs' JSON part."""
    roles.model.save_pretrained(path, selected_adapters=roles.adapters)
    if roles.value_head is not None:
        save_file({k: v.detach().cpu().contiguous() for k, v in roles.value_head.state_dict().items()},
                  str(path / "value_head.safetensors"))
    rng_tensors, rng_json = rng_states()
    save_file(rng_tensors, str(path / "rng.safetensors"))
    torch.save(opt.state_dict(), path / "optimizer.pt")
    if tensors:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "stage_tensors.safetensors"))
    records.atomic_write(path / "state.json", json.dumps({**state, "rng": rng_json}))


def load_checkpoint(roles: Roles, opt, order: PromptOrder, path: Path) -> dict:
    """Restore what save_checkpoint wrote; returns its state (step, history and the stage's own, its `tensors`
    under "tensors")."""
    for name in roles.adapters:
        sub = path / name if (path / name / "adapter_model.safetensors").exists() else path
        weights = load_file(str(sub / "adapter_model.safetensors"), device=str(models.device(roles.exp)))
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
    set_rng_states(load_file(str(path / "rng.safetensors")), state["rng"])
    roles.use("policy")
    return state
