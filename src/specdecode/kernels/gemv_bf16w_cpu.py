"""bf16 weights with float32 activations on a CPU (gemv_bf16w_cpu.cpp): the float32 model of a bf16
checkpoint, reading its weights as bf16, for CPUs without bf16 arithmetic (there `dtype="auto"` serves
float32).

Served by `Bf16WeightLinear` (models/inference.py) at every width where the CPU has AVX-512F (or AVX2
and FMA: the kernel's 8-lane form, the same numbers) and the build succeeds; anything else keeps
PyTorch's float32 matmul. SPECDECODE_BF16_WEIGHTS=0 turns it off.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from specdecode.kernels import build

SOURCE = Path(__file__).with_name("gemv_bf16w_cpu.cpp")
GROUP = 64  # output channels per group of the layout (the few-row bf16 kernel's)
REQUIRED_FLAGS = {"avx2", "fma"}  # AVX-512F where the CPU has it


@functools.cache
def _extension():
    """The built module, or None where the CPU lacks AVX2 / FMA, the kernel is turned off or the build
    failed (logged once); loading it registers `torch.ops.specdecode_bf16w.gemm_bf16w` (and
    `gemm_bf16w_avx2`)."""
    module = build.optional_extension("gemv_bf16w", SOURCE, "SPECDECODE_BF16_WEIGHTS", REQUIRED_FLAGS,
                                      "float32 weights serve instead")
    if module is not None:  # its output's shape for torch.compile's tracing (the op runs in C++ only)
        for op in ("gemm_bf16w", "gemm_bf16w_avx2"):
            torch.library.register_fake(f"specdecode_bf16w::{op}")(
                lambda x, blocked, bias, out_features: x.new_empty(x.shape[0], out_features))
    return module


def available(device) -> bool:
    """Whether float32 layers can keep bf16 weights on `device` here."""
    return torch.device(device).type == "cpu" and _extension() is not None


def block_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (bf16 values) -> [ceil(N/64), K/2, 64, 2] bf16, the layout the kernel reads."""
    return build.block_weight(weight.to(torch.bfloat16), GROUP, 2)


def linear(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None, out_features: int,
           avx2: bool = False) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32 (bias [N] float32 or None); `avx2`: the kernel's AVX2 form
    whatever the CPU has (what an AVX2-only CPU computes, bit for bit the same; tests and benchmarks)."""
    op = torch.ops.specdecode_bf16w.gemm_bf16w_avx2 if avx2 else torch.ops.specdecode_bf16w.gemm_bf16w
    return op(x, blocked, bias, out_features)
