"""bitsandbytes deciding as it does on a CPU with AVX512-BF16 (most recent cloud CPUs), on any CPU.

bitsandbytes 0.50 sets each Linear4bit's `support_avx512bf16_for_cpu` from the CPU when the layer is built; with it
on, the layer's first forward in eval mode without gradients repacks its weight for the CPU (models.plain_4bit says
what that breaks). `force` turns that flag on for every layer built afterwards, and replaces the repacking with a
refusal, since its kernels need the instructions that other CPUs lack: a run that ends proves the harness kept every
layer on the plain path, whichever CPU ran it.

In-process, tests/conftest.py's `bnb_as_on_avx512bf16` applies it; a process started with this folder on its
PYTHONPATH (conftest's AVX512BF16_ENV) imports this module at start-up as `sitecustomize` and applies it too.
"""

REFUSAL = "bitsandbytes repacked a 4-bit layer for the CPU (it would on an AVX512-BF16 CPU): models.plain_4bit missed it"


def force(setattr_=setattr) -> list[str]:
    """Apply the patch through `setattr_` (pytest's monkeypatch.setattr undoes it); return the list of refused
    repackings (each also raises)."""
    import bitsandbytes.nn.modules as modules

    refused: list[str] = []

    def refuse(qweight, quant_state, *args, **kwargs):
        refused.append(str(tuple(quant_state.shape)))
        raise RuntimeError(f"{REFUSAL} (a layer of shape {tuple(quant_state.shape)})")

    setattr_(modules, "has_avx512bf16", lambda: True)
    setattr_(modules, "_convert_weight_packed_for_cpu", refuse)
    return refused


if __name__ == "sitecustomize":
    force()
