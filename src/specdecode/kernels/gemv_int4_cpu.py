"""Few-row int4 weight-only matmuls for decoding on an AVX2 CPU (gemv_int4_cpu.cpp): int4 weights (groups
of g inputs, w = (q - 8) * s + z) in a layout of 64-output groups, widened to fp32 in registers, for the
1-16 rows of a decode, drafting or verification step. Three layouts: `pack` (AVX2), `pack_lanes` (float
activations on an AVX-512 CPU) and `pack_pairs` (bf16 activations on an AVX-512 BF16 CPU); `packer` picks
one.

Served by int4 `QuantizedLinear` layers (models/inference.py `attach_few_row_kernels`) up to the width
measured per layer shape where the CPU has AVX2 and FMA and the build succeeds; anything else keeps
the dense dequantised copy (float32 activations) or PyTorch's `_weight_int4pack_mm_for_cpu` (bf16).
The ops are registered with PyTorch's dispatcher (`torch.ops.specdecode_int4`), so eager and compiled
forwards and the C++ layer stack call the same code. SPECDECODE_FEW_ROW_KERNELS=0 turns them off.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from specdecode.kernels import build

SOURCE = Path(__file__).with_name("gemv_int4_cpu.cpp")
GROUP = 64  # output channels per group of the layout


@functools.cache
def _extension():
    """The built module (`build.few_row_ops`), or None where it is not available here; loading it
    registers the ops `torch.ops.specdecode_int4.*`."""
    return build.few_row_ops("gemv_int4_kernels", SOURCE, "specdecode_int4", ('gemm_int4', 'int4_linear'), "int4 layers keep their dense copy or PyTorch's int4 kernel")


def fits(in_features: int, group_size: int, device) -> bool:
    """Whether an int4 layer of this input size can use the kernel here."""
    return (torch.device(device).type == "cpu" and in_features > 0 and in_features % group_size == 0
            and _extension() is not None)


def pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] values in [0, 15], scales and zeros [N, K / g] -> (packed [ceil(N/64), K, 32] uint8: for
    each input, 32-bit word j holds outputs 8j .. 8j + 7 at bits 4i; scale_offsets [ceil(N/64), K/g, 2, 64]
    fp32: each group's scales s, then its offsets z - 8 s), the layout the kernel reads."""
    N, K = q.shape
    groups = -(-N // GROUP)
    padded = q.new_zeros(groups * GROUP, K)
    padded[:N] = q
    lines = padded.view(groups, GROUP, K).transpose(1, 2).to(torch.uint8)  # [G, K, 64]
    packed = (lines[..., 0::2] | (lines[..., 1::2] << 4)).contiguous()  # [G, K, 32], the even output low
    return packed, _scale_offsets(scales, zeros)


def _scale_offsets(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """scales, zeros [N, K/g] -> [ceil(N/64), K/g, 2, 64] fp32: each group's scales s, then offsets z - 8 s."""
    return _by_layout_group(scales, zeros.float() - 8 * scales.float())


def _by_layout_group(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Two [N, K/g] per-group tensors -> [ceil(N/64), K/g, 2, 64] fp32 (zero-padded outputs)."""
    N = first.shape[0]
    groups = -(-N // GROUP)
    both = torch.zeros(groups * GROUP, 2, first.shape[1])
    both[:N, 0], both[:N, 1] = first.float(), second.float()
    return both.view(groups, GROUP, 2, -1).permute(0, 3, 2, 1).contiguous()


def pair_kernel() -> bool:
    """Whether the built kernel has its bf16 path (AVX-512 BF16 and VBMI): the pair layout (`pack_pairs`)."""
    extension = _extension()
    return extension is not None and extension.pair_kernel()


def pack_pairs(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout of the bf16 path: q [N, K] values in [0, 15] (K even), scales and zeros [N, K / g]
    (bf16 values) -> (packed [ceil(N/64), K/2, 64] uint8: the line of input pair p holds each output's
    q[2p] in the low nibble and q[2p + 1] in the high one, output 16 j + 2 m + i at byte 8 m + 2 j + i;
    scale_zeros [ceil(N/64), K/g, 2, 64] bf16: each group's scales, then its zeros)."""
    N, K = q.shape
    groups = -(-N // GROUP)
    padded = q.new_zeros(groups * GROUP, K)
    padded[:N] = q
    pairs = padded.view(groups, GROUP, K // 2, 2).permute(0, 2, 1, 3).to(torch.uint8)  # [G, K/2, 64, 2]
    by_output = pairs[..., 0] | (pairs[..., 1] << 4)  # [G, K/2, 64], byte n: output n
    position = torch.arange(GROUP)
    output_at = 16 * ((position % 8) // 2) + 2 * (position // 8) + position % 2  # the output byte `position` holds
    return by_output[..., output_at].contiguous(), _by_layout_group(scales, zeros).bfloat16()


def lane_kernel() -> bool:
    """Whether the built kernel has its AVX-512 float path: the lane layout (`pack_lanes`)."""
    extension = _extension()
    return extension is not None and extension.lane_kernel()


def pack_lanes(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout of the AVX-512 float path: q [N, K] values in [0, 15] (K even), scales and zeros [N, K / g]
    (bf16 values) -> (packed [ceil(N/64), K/2, 16] int32: the line of input pair p, whose word l holds at
    bits 4i .. 4i + 3 output 16 (i // 2) + l's q at input 2p + i % 2; scale_zeros as `pack_pairs`')."""
    N, K = q.shape
    groups = -(-N // GROUP)
    padded = q.new_zeros(groups * GROUP, K)
    padded[:N] = q
    # [G, vector v, lane l, pair p, input u] -> [G, p, l, nibble i = 2v + u]
    nibbles = padded.view(groups, 4, 16, K // 2, 2).permute(0, 3, 2, 1, 4).reshape(groups, K // 2, 16, 8)
    nibbles = nibbles.to(torch.uint8)
    words = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)  # [G, K/2, 16, 4]: byte b holds nibbles 2b, 2b + 1
    return words.contiguous().view(torch.int32).view(groups, K // 2, 16), _by_layout_group(scales, zeros).bfloat16()


def packer(dtype: torch.dtype, group_size: int, bf16_values: bool):
    """The pack function of the layout this build serves activations of `dtype` from. Where the scales and
    zeros are bf16 values (`bf16_values`, as quantize_weight makes them): the pair layout for bf16 ones on a
    CPU with AVX-512 BF16, else the lane layout on an AVX-512 CPU; otherwise the AVX2 one."""
    if bf16_values and group_size % 2 == 0:
        if dtype == torch.bfloat16 and pair_kernel():
            return pack_pairs
        if lane_kernel():
            return pack_lanes
    return pack


def few_rows_linear(x: torch.Tensor, packed: torch.Tensor, scale_offsets: torch.Tensor, bias: torch.Tensor | None,
                    out_features: int, group_size: int) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) -> x @ W^T + bias [M, N] in x's dtype (bias [N] fp32)."""
    return torch.ops.specdecode_int4.gemm_int4(x, packed, scale_offsets, bias, out_features, group_size)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale_offsets: torch.Tensor, few_bias: torch.Tensor | None,
                out_features: int, group_size: int, few_upto: int, dense: torch.Tensor | None,
                qweight: torch.Tensor | None, qscales: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """An int4 layer's matmul, x [..., K] -> [..., N] in x's dtype: the kernel up to `few_upto` rows,
    wider ones `dense` (the dequantised weight, float32 activations) or PyTorch's int4 kernel
    (`qweight`, `qscales`: its layout), with `bias` in x's dtype. One C++ op."""
    return torch.ops.specdecode_int4.int4_linear(x, packed, scale_offsets, few_bias, out_features, group_size,
                                                 few_upto, dense, qweight, qscales, bias)
