"""Few-row int8 weight-only matmuls for decoding on an AVX2 CPU (gemv_int8_cpu.cpp): int8 weights in a
blocked layout, widened to fp32 in registers and streamed once for the 1-4 rows of a decode or
drafting step.

Served by int8 `QuantizedLinear` layers (models/inference.py `attach_few_row_kernels`; eager
forwards only) up to the width measured per layer shape where the CPU has AVX2 and FMA and the build
succeeds; anything else keeps PyTorch's `_weight_int8pack_mm`. SPECDECODE_FEW_ROW_KERNELS=0 turns
them off (with the bf16 ones).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from specdecode.kernels import build
from specdecode.kernels.build import optional_extension

SOURCE = Path(__file__).with_name("gemv_int8_cpu.cpp")
BLOCK_K = 8  # the input size must be a multiple of this
REQUIRED_FLAGS = {"avx2", "fma"}


@functools.cache
def _extension():
    """The built module, or None where the CPU lacks AVX2/FMA, the kernels are turned off or the
    build failed (logged once)."""
    return optional_extension("gemv_int8_kernels", SOURCE, "SPECDECODE_FEW_ROW_KERNELS", REQUIRED_FLAGS,
                              "PyTorch's int8 kernel serves instead")


def fits(in_features: int, device) -> bool:
    """Whether an int8 layer of this input size can use the kernel here."""
    return torch.device(device).type == "cpu" and in_features % BLOCK_K == 0 and _extension() is not None


def block_weight(qweight: torch.Tensor) -> torch.Tensor:
    """qweight [N, K] int8 -> [ceil(N/8), K/8, 8, 8], the layout the kernel reads."""
    return build.block_weight(qweight, 8, 8)


def few_rows_linear(x: torch.Tensor, blocked: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                    out_features: int) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) -> (x @ Q^T) * scales + bias [M, N] in x's dtype (scales, bias [N] fp32)."""
    return _extension().gemm_int8(x, blocked, scales, bias, out_features)
