"""A minimal reproduction, for bitsandbytes' issue tracker, of the CPU packed 4-bit layout dropping gradients.

bitsandbytes 0.50 on a CPU with AVX512-BF16: after a Linear4bit runs once in eval mode without gradients, its weight
is repacked for the CPU, and its train-mode forward goes through `bitsandbytes::gemv_4bit`, which has no autograd
kernel: the input's gradient is None (torch warns that no autograd kernel was registered). Without that CPU flag,
or with the layer's `support_avx512bf16_for_cpu` set to False (what rlhf-harness does), the gradient is there and
equals grad_out @ W for the dequantized weight W.

    python studies/bnb_packed_repro.py           # prints the CPU flag and, for both settings, the input gradient
Only torch and bitsandbytes are imported; nothing of the harness.
"""

import warnings

import bitsandbytes as bnb
import torch


def run(packing_allowed: bool) -> str:
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(256, 128, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(128, 256) / 16, requires_grad=False, quant_type="nf4")
    layer = layer.to("cpu")  # quantizes
    layer.support_avx512bf16_for_cpu = layer.support_avx512bf16_for_cpu and packing_allowed
    weight = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    x = torch.randn(4, 256)
    layer.eval()
    with torch.no_grad():
        layer(x)  # what generation and evaluation do first
    packed = bool(getattr(layer.weight.quant_state, "packing_format_for_cpu", False))
    layer.train()
    xg = x.clone().requires_grad_(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(xg).sum().backward()
    want = torch.ones(4, 128) @ weight  # the gradient of sum(x @ W.T) with respect to x
    grad = "None" if xg.grad is None else f"max |grad - grad_out @ W| = {(xg.grad - want).abs().max():.2e}"
    warned = any("autograd kernel was not registered" in str(w.message) for w in caught)
    return f"packed={packed}: input grad {grad}; torch's no-autograd-kernel warning: {warned}"


if __name__ == "__main__":
    print(f"bitsandbytes {bnb.__version__}, torch {torch.__version__}, CPU has AVX512-BF16 "
          f"(bitsandbytes.functional.has_avx512bf16): {bnb.functional.has_avx512bf16()}")
    print("bitsandbytes' default:   ", run(packing_allowed=True))
    print("packing turned off:      ", run(packing_allowed=False))
