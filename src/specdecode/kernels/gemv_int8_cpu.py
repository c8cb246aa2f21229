"""Few-row int8 weight-only matmuls for decoding on an AVX2 or AVX-512 CPU (gemv_int8_cpu.cpp): int8
weights in a layout of 64-output groups, widened to fp32 in registers and streamed once per tile of up to
6 rows, for the 1-16 rows of a decode, drafting or verification step.

Served by int8 `QuantizedLinear` layers (models/inference.py `attach_few_row_kernels`) up to the
width measured per layer shape where the CPU has AVX2 and FMA and the build succeeds; anything else
keeps PyTorch's `_weight_int8pack_mm`. The ops are registered with PyTorch's dispatcher
(`torch.ops.specdecode_int8`), so eager and compiled forwards call the same C++ code, a compiled
graph without Python in between. SPECDECODE_FEW_ROW_KERNELS=0 turns them off (with the bf16 ones).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from specdecode.kernels import build

SOURCE = Path(__file__).with_name("gemv_int8_cpu.cpp")
GROUP = 64  # output channels per group of the layout


@functools.cache
def _extension():
    """The built module (`build.few_row_ops`), or None where it is not available here; loading it
    registers the ops `torch.ops.specdecode_int8.*`."""
    return build.few_row_ops("gemv_int8_kernels", SOURCE, "specdecode_int8",
                             ("gemm_int8", "gemm_int8_avx2", "int8_linear"), "PyTorch's int8 kernel serves instead")


def fits(in_features: int, device) -> bool:
    """Whether an int8 layer of this input size can use the kernel here."""
    return torch.device(device).type == "cpu" and in_features > 0 and _extension() is not None


def block_weight(qweight: torch.Tensor) -> torch.Tensor:
    """qweight [N, K] int8 -> [ceil(N/64), K, 64], the layout the kernel reads (input k of a group's
    64 outputs contiguous)."""
    return build.block_weight(qweight, GROUP, 1).squeeze(-1)


def few_rows_linear(x: torch.Tensor, blocked: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                    out_features: int, avx2: bool = False) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) -> (x @ Q^T) * scales + bias [M, N] in x's dtype (scales, bias [N] fp32);
    `avx2`: the kernel's AVX2 form (what an AVX2-only CPU computes, the same numbers) on an AVX-512 one."""
    op = torch.ops.specdecode_int8.gemm_int8_avx2 if avx2 else torch.ops.specdecode_int8.gemm_int8
    return op(x, blocked, scales, bias, out_features)


def int8_linear(x: torch.Tensor, blocked: torch.Tensor, few_scales: torch.Tensor, few_bias: torch.Tensor | None,
                out_features: int, few_upto: int, dense: torch.Tensor | None, qweight: torch.Tensor | None,
                qscales: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """An int8 layer's matmul, x [..., K] -> [..., N] in x's dtype: the kernel up to `few_upto` rows
    (`blocked`, fp32 `few_scales` / `few_bias`), wider ones `dense` (the dequantised weight, float32
    activations) or `_weight_int8pack_mm(qweight, qscales)` (bf16/fp16), with `bias` in x's dtype.
    One C++ op: a compiled graph calls it without Python, and its width choice is no shape guard."""
    return torch.ops.specdecode_int8.int8_linear(x, blocked, few_scales, few_bias, out_features, few_upto, dense,
                                                 qweight, qscales, bias)
