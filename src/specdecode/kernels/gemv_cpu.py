"""Few-row bf16 matmuls on a CPU (gemv_cpu.cpp): the weights in a blocked layout streamed once for
the 1-16 rows of a decode, drafting or verification step, through AVX-512 BF16.

Served by `PackedLinear` (models/inference.py; eager forwards only) up to the width measured per layer shape
(models/inference.py `attach_few_row_kernels`) where the CPU has AVX-512 BF16 and the build
succeeds; anything else keeps oneDNN. SPECDECODE_FEW_ROW_KERNELS=0 turns them off.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from specdecode.kernels import build

SOURCE = Path(__file__).with_name("gemv_cpu.cpp")
GROUP = 64  # output channels per group of the layout
REQUIRED_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}


@functools.cache
def _extension():
    """The built module, or None where the CPU lacks AVX-512 BF16, the kernels are turned off or
    the build failed (logged once); loading it registers `torch.ops.specdecode_bf16.gemm_bf16`."""
    return build.optional_extension("gemv_kernels", SOURCE, "SPECDECODE_FEW_ROW_KERNELS", REQUIRED_FLAGS,
                                    "oneDNN serves instead")


def fits(in_features: int, dtype: torch.dtype, device) -> bool:
    """Whether a layer of this input size and dtype can use the kernel here."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16 and in_features % 2 == 0
            and _extension() is not None)


def block_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 -> [ceil(N/64), K/2, 64, 2], the layout the kernel reads (a group's 64
    outputs' next input pair contiguous)."""
    return build.block_weight(weight, GROUP, 2)


def few_rows_linear(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None,
                          out_features: int) -> torch.Tensor:
    """x [M, K] bf16 -> [M, N] bf16 (bias [N] bf16 or None)."""
    return torch.ops.specdecode_bf16.gemm_bf16(x, blocked, bias, out_features)
