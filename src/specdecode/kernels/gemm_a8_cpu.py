"""Matmuls with int8 activations: activations quantised to int8 per row and block of 32 inputs times
int8 weights per output channel (`w8a8`) or int4 weights in groups of 32 (`w4a8`), by the kernels of
gemm_a8_cpu.cpp (AVX-512 VNNI), and the same numbers from PyTorch ops (`reference_w8a8`,
`reference_w4a8`) where those are not built.

Served by `QuantizedLinear` layers of the `w8a8` / `w4a8` schemes (models/quant.py) at every width. The
ops are registered with PyTorch's dispatcher (`torch.ops.specdecode_a8.*`), so eager forwards, compiled
graphs and the C++ layer stack call the same code. SPECDECODE_A8_KERNELS=0 turns them off.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from specdecode.kernels import build

SOURCE = Path(__file__).with_name("gemm_a8_cpu.cpp")
BLOCK = 32  # inputs sharing one activation scale
LINE = 16  # outputs per weight line of the layout
REQUIRED_FLAGS = {"avx512f", "avx512bw", "avx512_vnni"}


@functools.cache
def _extension():
    """The built module, or None where the CPU lacks AVX-512 VNNI, it is turned off or the build failed;
    loading it registers `torch.ops.specdecode_a8.w8a8_linear` / `w4a8_linear` (with fake kernels for
    tracing)."""
    module = build.optional_extension("gemm_a8_kernels", SOURCE, "SPECDECODE_A8_KERNELS", REQUIRED_FLAGS,
                                      "the w8a8 / w4a8 references (PyTorch ops, slower) serve instead")
    if module is not None:
        build.register_fake_kernels("specdecode_a8", ("w8a8_linear", "w4a8_linear"))
    return module


def available(device: torch.device | str = "cpu") -> bool:
    """Whether the kernels serve layers on `device` here."""
    return torch.device(device).type == "cpu" and _extension() is not None


def pack_w8(qweight: torch.Tensor) -> torch.Tensor:
    """qweight [N, K] int8 -> [ceil(N/16), K/4, 16, 4] uint8 holding q + 128 (missing rows: q = 0)."""
    return (build.block_weight(qweight.to(torch.int16), LINE, 4) + 128).to(torch.uint8)


def pack_w4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] in [0, 15], scales / zeros [N, K/32] -> (the nibbles [ceil(N/16), K/8, 16, 4] uint8, low
    nibbles inputs 8t .. 8t+3, high 8t+4 .. 8t+7; bf16 scales and zeros [ceil(N/16), K/32, 2, 16])."""
    lines = build.block_weight(q.to(torch.uint8), LINE, 4)  # [L, K/4, 16, 4]
    L, quads = lines.shape[:2]
    pairs = lines.view(L, quads // 2, 2, LINE, 4)
    packed = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).contiguous()
    N, blocks = scales.shape
    padded = torch.zeros(2, L * LINE, blocks)
    padded[0, :N], padded[1, :N] = scales, zeros
    scale_zeros = padded.view(2, L, LINE, blocks).permute(1, 3, 0, 2).contiguous().bfloat16()  # [L, B, 2, 16]
    return packed, scale_zeros


def pad_outputs(values: torch.Tensor) -> torch.Tensor:
    """[N] -> fp32 [ceil(N/16) * 16], zeros after N (the kernel reads whole lines of scales and bias)."""
    N = values.shape[0]
    padded = values.new_zeros(-(-N // LINE) * LINE, dtype=torch.float32)
    padded[:N] = values.float()
    return padded


def w8a8_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                out_features: int) -> torch.Tensor:
    """x [..., K] (fp32 / bf16) -> [..., N] in x's dtype through the kernel (`pack_w8`, `pad_outputs`)."""
    return torch.ops.specdecode_a8.w8a8_linear(x, packed, scales, bias, out_features)


def w4a8_linear(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor, bias: torch.Tensor | None,
                out_features: int) -> torch.Tensor:
    """x [..., K] (fp32 / bf16) -> [..., N] in x's dtype through the kernel (`pack_w4`, `pad_outputs`)."""
    return torch.ops.specdecode_a8.w4a8_linear(x, packed, scale_zeros, bias, out_features)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (codes [..., K/32, 32] as float32 integers in [-127, 127], scales [..., K/32] fp32):
    x ~ codes * scales, scale = max |x| over the block / 127 (1 for an all-zero block)."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    scales = blocks.abs().amax(dim=-1) / torch.tensor(127.0)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    return torch.round(blocks / scales[..., None]).clamp(-127, 127), scales


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once, as the kernels' FMA: formed in float64, where these products (at most
    24 + 24 significant bits) are exact, then rounded to fp32 (a second rounding that could differ from
    the FMA's only on an exact float64 tie, vanishingly rare)."""
    return (a.double() * b.double() + c.double()).float()


def reference_w8a8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The w8a8 kernel's numbers from PyTorch ops: x [..., K] -> [..., N] in x's dtype (qweight [N, K] int8,
    scales [N] fp32). Block products are exact integers; each block's FMA into the fp32 total is formed
    in float64 (the product exact) and rounded once to fp32, as the kernel's FMA rounds it."""
    N, K = qweight.shape
    codes, act_scales = quantize_activations(x)  # [..., B, 32], [..., B]
    weights = qweight.float().view(N, K // BLOCK, BLOCK)
    # [..., B, N]: exact, |P| <= 127 * 127 * 32 < 2^24
    products = torch.einsum("...bk,nbk->...bn", codes, weights)
    total = torch.zeros(*x.shape[:-1], N, dtype=torch.float32, device=x.device)
    for b in range(K // BLOCK):
        total = _fma(products[..., b, :], act_scales[..., b, None], total)
    out = total * scales.float() if bias is None else _fma(total, scales.float(), bias.float())
    return out.to(x.dtype)


def reference_w4a8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """The w4a8 kernel's numbers from PyTorch ops: x [..., K] -> [..., N] in x's dtype (q [N, K] in [0, 15],
    scales / zeros [N, K/32] fp32 holding bf16 values): per block (P - 8 X) * s + z * X, then times s_x
    into the total."""
    N, K = q.shape
    codes, act_scales = quantize_activations(x)  # [..., B, 32], [..., B]
    code_sums = codes.sum(dim=-1)  # [..., B], exact
    products = torch.einsum("...bk,nbk->...bn", codes, q.float().view(N, K // BLOCK, BLOCK))  # exact
    blocks = _fma(products - 8 * code_sums[..., None], scales.float().T, zeros.float().T * code_sums[..., None])
    total = torch.zeros(*x.shape[:-1], N, dtype=torch.float32, device=x.device)
    for b in range(K // BLOCK):
        total = _fma(blocks[..., b, :], act_scales[..., b, None], total)
    return (total if bias is None else total + bias.float()).to(x.dtype)
