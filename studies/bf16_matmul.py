"""How much slower torch's bf16 matmuls are than float32's on this CPU, one thread: the cost of bf16 compute on a CPU
without AVX512-BF16 (or AMX), where torch emulates it. Why the tiny experiments compute in float32 (tests/test_make.py,
GPU_ONLY) and why the GPU measurement's CPU dry run builds a narrow head (rlhf/tools/bases.py, CPU_VOCAB).

    .venv/bin/python studies/bf16_matmul.py      # a line per shape: float32 and bf16 milliseconds and their ratio
Only torch is imported."""

import time

import torch

SHAPES = [(64, 256, 256), (512, 512, 512), (640, 64, 32000)]
"""(m, k, n): a small LoRA-sized product, a square one, and a shrunk base's 32k-wide head over 640 tokens."""


def ms(a: torch.Tensor, b: torch.Tensor, seconds: float = 0.5) -> float:
    a @ b  # warm-up
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    flags = torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, CPU kernels for {flags}, one thread")
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        f32, bf16 = ms(a, b), ms(a.bfloat16(), b.bfloat16())
        print(f"{m} x {k} @ {k} x {n}: float32 {f32:.3f} ms, bf16 {bf16:.3f} ms, bf16 / float32 {bf16 / f32:.1f}x")


if __name__ == "__main__":
    main()
