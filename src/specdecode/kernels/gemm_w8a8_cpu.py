"""W8A8 matmuls: int8 weights per output channel times activations quantised to int8 per row and
block of 32 inputs (gemm_w8a8_cpu.cpp, AVX-512 VNNI), and the same numbers from PyTorch ops
(`reference`) where that kernel is not built.

Served by `QuantizedLinear` layers of the `w8a8` scheme (models/quant.py) at every width. The op is
registered with PyTorch's dispatcher (`torch.ops.specdecode_w8a8.w8a8_linear`), so eager forwards,
compiled graphs and the C++ layer stack call the same code. SPECDECODE_W8A8_KERNEL=0 turns it off.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from specdecode.kernels import build

SOURCE = Path(__file__).with_name("gemm_w8a8_cpu.cpp")
BLOCK = 32  # inputs sharing one activation scale
LINE = 16  # outputs per weight line of the layout
REQUIRED_FLAGS = {"avx512f", "avx512bw", "avx512_vnni"}


@functools.cache
def _extension():
    """The built module, or None where the CPU lacks AVX-512 VNNI, it is turned off or the build failed;
    loading it registers `torch.ops.specdecode_w8a8.w8a8_linear` (with a fake kernel for tracing)."""
    module = build.optional_extension("gemm_w8a8_kernels", SOURCE, "SPECDECODE_W8A8_KERNEL", REQUIRED_FLAGS,
                                      "the W8A8 reference (PyTorch ops, slower) serves instead")
    if module is not None:
        build.register_fake_kernels("specdecode_w8a8", ("w8a8_linear",))
    return module


def available(device: torch.device | str = "cpu") -> bool:
    """Whether the kernel serves layers on `device` here."""
    return torch.device(device).type == "cpu" and _extension() is not None


def pack_weight(qweight: torch.Tensor) -> torch.Tensor:
    """qweight [N, K] int8 -> [ceil(N/16), K/4, 16, 4] uint8 holding q + 128 (missing rows: q = 0)."""
    return (build.block_weight(qweight.to(torch.int16), LINE, 4) + 128).to(torch.uint8)


def pad_outputs(values: torch.Tensor) -> torch.Tensor:
    """[N] -> fp32 [ceil(N/16) * 16], zeros after N (the kernel reads whole lines of scales and bias)."""
    N = values.shape[0]
    padded = values.new_zeros(-(-N // LINE) * LINE, dtype=torch.float32)
    padded[:N] = values.float()
    return padded


def w8a8_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                out_features: int) -> torch.Tensor:
    """x [..., K] (fp32 / bf16) -> [..., N] in x's dtype through the kernel (`pack_weight`, `pad_outputs`)."""
    return torch.ops.specdecode_w8a8.w8a8_linear(x, packed, scales, bias, out_features)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (codes [..., K/32, 32] as float32 integers in [-127, 127], scales [..., K/32] fp32):
    x ~ codes * scales, scale = max |x| over the block / 127 (1 for an all-zero block)."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    scales = blocks.abs().amax(dim=-1) / torch.tensor(127.0)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    return torch.round(blocks / scales[..., None]).clamp(-127, 127), scales


def reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's numbers from PyTorch ops: x [..., K] -> [..., N] in x's dtype (qweight [N, K] int8,
    scales [N] fp32). Block products are exact integers; each block's FMA into the fp32 total is formed
    in float64 (the product exact) and rounded once to fp32, as the kernel's FMA rounds it."""
    N, K = qweight.shape
    codes, act_scales = quantize_activations(x)  # [..., B, 32], [..., B]
    weights = qweight.float().view(N, K // BLOCK, BLOCK)
    # [..., B, N]: exact, |P| <= 127 * 127 * 32 < 2^24
    products = torch.einsum("...bk,nbk->...bn", codes, weights)
    total = torch.zeros(*x.shape[:-1], N, dtype=torch.float32, device=x.device)
    for b in range(K // BLOCK):
        total = (products[..., b, :].double() * act_scales[..., b, None].double() + total.double()).float()
    if bias is None:
        out = total * scales.float()
    else:
        out = (total.double() * scales.double() + bias.double()).float()
    return out.to(x.dtype)
