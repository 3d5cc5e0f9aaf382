"""The sampler: every sampling pass (rollouts, the judge's measurements, held-out checks, `make eval`, export's
samples) runs through a plain dense copy of the policy's base with the sampling adapter's LoRA merged in,
W + (alpha / r) * B @ A per linear layer, so that a decode step is one matrix product per layer instead of a 4-bit
dequantization and a LoRA branch of several small kernels per layer and token. On a CUDA device the copy decodes
with a static KV cache through transformers' compiled forward (torch.compile, CUDA graphs): a step is then bound by
reading the weights, not by launching kernels (results/gpu/, docs/performance.md).

The copy is made once per model and updated in place when the adapter it merged changes: after an optimizer step
(a hook on the optimizer, `watch`), after any in-place change of the adapter's tensors (their version counters: a
loaded checkpoint, torch's optimizers) or when another adapter samples. In place, so the compiled graphs, which read
the weights where they lie, stay valid. A layer the copy has no room for (`max_bytes`, the memory plan's) is the
training model's own module: it computes through its 4-bit weight and LoRA branch as in training, and the copy
decodes eagerly.

The samples stay the policy's: the old log-probs of PPO's ratio still come from the training path
(generation.response_logprobs), and the copy computes the same function up to rounding (float32 on a CPU: equal
samples, log-prob gap ~1e-6, tests/test_sampler.py). In bf16 the merged weight is rounded once where the training
path rounds the base weight and the LoRA branch apart; `logprob_gap` measures what that does, per run
(rollout/logprob_gap_max, docs/algorithms.md)."""

from __future__ import annotations

import copy as copylib
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


def _is_4bit(module) -> bool:
    return type(module).__name__ == "Linear4bit"


def dense_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The weight a linear layer (a bitsandbytes 4-bit one: dequantized) multiplies by, in `dtype`."""
    if _is_4bit(layer):
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(layer.weight.data, layer.weight.quant_state).to(dtype)
    return layer.weight.detach().to(dtype)


def merge_into(out: torch.Tensor, module: nn.Module, adapter: str | None) -> torch.Tensor:
    """out <- W + scaling * B @ A for a PEFT LoRA layer `module` (its base layer's weight W, dequantized; the LoRA
    delta of `adapter` when the layer has one), summed in float32 and rounded once to out's dtype."""
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    w = dense_weight(base, torch.float32)
    if adapter is not None and adapter in getattr(module, "lora_A", {}):
        if module.use_dora.get(adapter, False):
            raise NotImplementedError("the merged sampler merges plain LoRA; DoRA is not supported")
        a, b = module.lora_A[adapter].weight.float(), module.lora_B[adapter].weight.float()
        delta = b @ a
        w = w + module.scaling[adapter] * (delta.T if getattr(module, "fan_in_fan_out", False) else delta)
    return out.copy_(w)


class DenseLora(nn.Module):
    """A linear layer of the copy that keeps the LoRA branch apart: the dequantized base weight W (owned, made once)
    and the adapter's A and B (owned, copied at each sync), y = x W^T + scaling * (x A^T) B^T: the training path's
    arithmetic, without its per-token dequantization."""

    def __init__(self, weight: torch.Tensor, bias, r: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.lora_a = nn.Parameter(weight.new_zeros(r, weight.shape[1]), requires_grad=False)
        self.lora_b = nn.Parameter(weight.new_zeros(weight.shape[0], r), requires_grad=False)
        self.scaling = 0.0

    def forward(self, x):
        y = nn.functional.linear(x, self.weight, self.bias)
        return y + self.scaling * nn.functional.linear(nn.functional.linear(x, self.lora_a), self.lora_b)


class MergedSampler:
    """A dense copy of `model` (a PEFT causal LM over a 4-bit or dense base) that samples as `model` does with the
    adapter active at each call. `max_bytes`: at most that many bytes of merged linear weights, decoder layers in
    order (the rest compute through the training model's own modules); `compile`: decode with a static cache through
    transformers' compiled forward (None: on CUDA, when every layer is merged)."""

    def __init__(self, model, max_bytes: float = float("inf"), compile: bool | None = None,
                 dtype: torch.dtype | None = None, merge: bool = True):
        from rlhf.inputs import models

        self.model = model
        inner = model.get_base_model()
        self.dtype = dtype or models.compute_dtype(model)
        cfg = copylib.deepcopy(inner.config)
        cfg.tie_word_embeddings = False  # every weight is assigned below, tied ones to the same tensor
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        with torch.device("meta"):
            self.dense = type(inner)._from_config(cfg, dtype=self.dtype)
        self.merged: dict[str, tuple[nn.Module, torch.Tensor]] = {}  # name -> (source module, owned weight)
        self.saved: dict[str, tuple[nn.Module, torch.Tensor]] = {}  # modules_to_save: their adapter's copy
        self.apart: dict[str, tuple[nn.Module, DenseLora]] = {}  # merge=False: W dense, LoRA branch apart
        self.kept: list[str] = []  # linear layers left to the training model's modules (no room)
        self.bytes = 0
        self.whole_bytes = 0  # what every linear layer merged would take
        for name, mod in list(self.dense.named_modules()):
            if not name or next(mod.children(), None) is not None and not isinstance(mod, nn.Linear):
                continue
            src = inner.get_submodule(name)
            if hasattr(src, "modules_to_save"):  # PEFT's ModulesToSaveWrapper: the active adapter's copy
                for pname, prm in src.original_module.named_parameters(recurse=False):
                    own = torch.empty_like(prm, dtype=prm.dtype)
                    mod._parameters[pname] = nn.Parameter(own, requires_grad=False)
                    self.saved[f"{name}.{pname}"] = (src, own)
                continue
            if isinstance(mod, nn.Linear) and (hasattr(src, "lora_A") or _is_4bit(src)):
                size = mod.in_features * mod.out_features * self.dtype.itemsize
                self.whole_bytes += size
                base = src.get_base_layer() if hasattr(src, "get_base_layer") else src
                if self.bytes + size > max_bytes * (1 + 1e-9) or self.kept:
                    self.dense.set_submodule(name, src)  # computes as in training
                    self.kept.append(name)
                    continue
                own = torch.empty(mod.out_features, mod.in_features, dtype=self.dtype,
                                  device=base.weight.device)
                bias = None if mod.bias is None else nn.Parameter(base.bias.detach(), requires_grad=False)
                if not merge and hasattr(src, "lora_A"):
                    r = max(src.r.values())
                    own.copy_(dense_weight(base, self.dtype))
                    self.dense.set_submodule(name, DenseLora(own, bias, r))
                    self.apart[name] = (src, self.dense.get_submodule(name))
                    self.bytes += size
                    continue
                mod._parameters["weight"] = nn.Parameter(own, requires_grad=False)
                if bias is not None:
                    mod._parameters["bias"] = bias
                self.merged[name] = (src, own)
                self.bytes += size
                continue
            if next(mod.parameters(recurse=False), None) is None:  # rotary embedding, activations: the same module
                self.dense.set_submodule(name, src)
                continue
            for pname, prm in list(src.named_parameters(recurse=False)):  # frozen: shared, not copied
                mod._parameters[pname] = nn.Parameter(prm.detach(), requires_grad=False)
            for bname, buf in list(src.named_buffers(recurse=False)):
                mod._buffers[bname] = buf
        left = [n for n, t in [*self.dense.named_parameters(), *self.dense.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"sampler: no source for {left[:5]} in {type(inner).__name__}")
        self.dense.eval().requires_grad_(False)
        from transformers import GenerationConfig

        self.dense.generation_config = GenerationConfig()  # every sampling setting comes with the call
        cuda = next(model.parameters()).device.type == "cuda"
        self.compile = (cuda and not self.kept) if compile is None else compile
        self.eager_reason = None if self.compile else (
            "compile=False" if compile is False else "not a CUDA device" if not cuda else
            f"the copy holds {len(self.merged)} of {len(self.merged) + len(self.kept)} linear layers (the rest compute "
            f"through their 4-bit weights)")
        """Why the copy decodes eagerly (None: compiled); a compile that failed says so here (generate)."""
        self.step_s: list[float] = []
        """Seconds per decode step of each sampling call (record_steps): its first step and prefill left out."""
        self._stamp = None
        self._dirty = 0
        self._caches: dict[tuple[int, int], object] = {}

    # ---------------------------------------------------------------------------------------------- the merge
    def _adapter(self) -> str | None:
        """The adapter the training model's LoRA layers compute with now (None: adapters disabled), read from the
        layers themselves: PeftModel.active_adapter does not follow base_model.set_adapter (roles.use)."""
        for src, _ in [*self.merged.values(), *self.apart.values()]:
            if hasattr(src, "active_adapters"):
                if getattr(src, "disable_adapters", False):
                    return None
                return src.active_adapters[0] if src.active_adapters else None
        return getattr(self.model.base_model, "active_adapter", None)

    def _stamp_now(self, adapter):
        versions = tuple(p._version for n, p in self.model.named_parameters()
                         if adapter is not None and f".{adapter}." in n)
        return adapter, versions, self._dirty

    def invalidate(self, *_args) -> None:
        """The adapter's weights changed where no version counter sees it (bitsandbytes' optimizers write through
        pointers): the next call merges again."""
        self._dirty += 1

    def watch(self, optimizer) -> None:
        """Merge again after each step of `optimizer` (whichever optimizer class: torch calls its step hooks)."""
        optimizer.register_step_post_hook(self.invalidate)

    @torch.no_grad()
    def sync(self) -> bool:
        """Merge the active adapter into the copy if it changed since the last merge; True when it merged."""
        adapter = self._adapter()
        stamp = self._stamp_now(adapter)
        if stamp == self._stamp:
            return False
        for src, own in self.merged.values():
            merge_into(own, src, adapter)
        for src, lin in self.apart.values():
            if adapter in src.lora_A:
                lin.lora_a.copy_(src.lora_A[adapter].weight)
                lin.lora_b.copy_(src.lora_B[adapter].weight)
                lin.scaling = src.scaling[adapter]
            else:
                lin.lora_a.zero_()
        for key, (src, own) in self.saved.items():
            pname = key.rsplit(".", 1)[1]
            chosen = src.modules_to_save[adapter] if adapter in src.modules_to_save else src.original_module
            own.copy_(getattr(chosen, pname))
        self._stamp = self._stamp_now(adapter)
        return True

    # ---------------------------------------------------------------------------------------------- sampling
    def cache(self, rows: int, length: int):
        """A static KV cache for `rows` sequences of at least `length` tokens: the longest made for these rows when it
        is long enough, else a new one. Made once and reused: the compiled graphs read it where it lies, and a
        run's sampling calls share one shape (generation pads them to it)."""
        from transformers import StaticCache

        fits = [k for k in self._caches if k[0] == rows and k[1] >= length]
        key = max(fits, key=lambda k: k[1]) if fits else (rows, length)
        if key not in self._caches:
            self._caches[key] = StaticCache(config=self.dense.config, max_cache_len=length)
        return self._caches[key]

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, length: int | None = None,
                 **kwargs) -> torch.Tensor:
        """transformers' generate on the merged copy (the active adapter merged first). With `compile`, a static
        cache of `length` tokens (prompt width + max_new_tokens when None) for this batch's rows, decoded through
        transformers' compiled forward; should compiling fail on this stack, the sampler says so once and decodes
        eagerly from then on."""
        self.sync()
        if self.compile:
            cache = self.cache(input_ids.shape[0], length or input_ids.shape[1] + kwargs["max_new_tokens"])
            cache.reset()
            try:
                return self.dense.generate(input_ids=input_ids, attention_mask=attention_mask,
                                           past_key_values=cache, **kwargs)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001  (torch.compile's failures have no common type)
                first = (str(e).splitlines() or [""])[0][:200]
                log.warning("sampler: the compiled decode failed (%s: %s); sampling eagerly from now on",
                            type(e).__name__, first)
                self.eager_reason = f"the compiled decode failed: {type(e).__name__}: {first}"
                self.compile = False
                self._caches.clear()
        return self.dense.generate(input_ids=input_ids, attention_mask=attention_mask, disable_compile=True,
                                   **kwargs)


    def record_steps(self, stamps: list[float]) -> None:
        """One sampling call's decode steps, from the times (time.perf_counter) at which each step's logits reached
        the logits processors: the mean interval from the second step on (the first follows the prefill). The host
        waits on the device at every step (generate's stopping check), so the intervals are the device's steps."""
        if len(stamps) > 2:
            self.step_s.append((stamps[-1] - stamps[1]) / (len(stamps) - 2))

    def state(self) -> dict:
        """What the copy decoded with, for the run record: compiled or eager (`eager_reason`: why), the bytes merged
        and their share of the whole base's linear layers, and the decode step's milliseconds (the median over the
        sampling calls, the first call, which compiles, left out when there were others)."""
        steps = sorted(self.step_s[1:] or self.step_s)
        return {"path": "merged_compiled" if self.compile else "merged_eager", "compiled": bool(self.compile),
                "eager_reason": self.eager_reason, "copy_bytes": self.bytes,
                "copy_share": round(self.bytes / self.whole_bytes, 4) if self.whole_bytes else None,
                "layers_kept": len(self.kept),
                "decode_ms_per_step": round(1000 * steps[len(steps) // 2], 3) if steps else None,
                "decode_calls": len(self.step_s)}


def of(model, max_bytes: float = float("inf"), compile: bool | None = None) -> MergedSampler | None:
    """The model's sampler, made on first use (up to `max_bytes` of merged layers) and kept with the model for the
    run; None for a model without LoRA adapters or when `max_bytes` is 0: it samples through itself."""
    if not hasattr(model, "peft_config") or max_bytes <= 0:
        return None
    s = getattr(model, "_rlhf_sampler", None)
    if s is None:
        s = MergedSampler(model, max_bytes, compile)
        model._rlhf_sampler = s
    return s
