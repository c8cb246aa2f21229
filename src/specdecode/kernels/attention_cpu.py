"""Attention over a KV cache for decode, drafting and verification widths on a CPU (attention_cpu.cpp):
one C++ op, `torch.ops.specdecode_attn.cached_attention`, in place of PyTorch's flash kernel, whose
fixed cost dominates at a few query rows (37-47 us a layer for one token of the default model).

Served to eager inference forwards on a CPU with AVX2 and FMA (no autograd, not under
`torch.compile`) where the build succeeds; the C++ layer stack calls the same op, so the two paths
stay bit-identical. Prefill widths fall through to PyTorch's kernel inside the op.
SPECDECODE_ATTENTION_KERNEL=0 turns it off.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from specdecode.kernels.build import load_extension, optional_extension

SOURCE = Path(__file__).with_name("attention_cpu.cpp")
REQUIRED_FLAGS = {"avx2", "fma"}


@functools.cache
def available() -> bool:
    """Whether the op is built here (once per process; a failed build is logged and PyTorch's serves)."""
    return optional_extension("attention_cpu", SOURCE, "SPECDECODE_ATTENTION_KERNEL", REQUIRED_FLAGS,
                              "PyTorch's attention serves instead") is not None


def max_rows() -> int | None:
    """The most query rows per KV head (group x tokens) the op computes itself, or None without it.
    Past them (prefill widths), PyTorch's flash kernel serves, and it rounds a row by the padded key
    count beside it: a prompt prefilled beside a longer one would then decode otherwise than alone."""
    return load_extension("attention_cpu", SOURCE).max_rows if available() else None


def serves(q: torch.Tensor) -> bool:
    """Whether this forward's cached attention takes the op (checked per call: cheap reads first)."""
    return (q.device.type == "cpu" and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and q.requires_grad) and available())


def cached_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                     group: int) -> torch.Tensor:
    """q [B, KVH, group * T, D] (row g * T + t: token t), keys / values [B, S, KVH, D] (cache views),
    mask [B, 1, T, S] bool or None (all visible) -> [B, KVH, group * T, D]."""
    return torch.ops.specdecode_attn.cached_attention(q, keys, values, mask, group)


def serves_int8() -> bool:
    """Whether the op attends over an int8 cache itself (built with AVX-512); elsewhere it dequantises the
    cache for PyTorch's kernel."""
    return available() and bool(load_extension("attention_cpu", SOURCE).serves_int8)


def quantize_records(x: torch.Tensor) -> torch.Tensor:
    """The C++ stack's quantiser (x [.., D] float32 / bf16 -> int8 records [.., D + 4]): tests hold it to
    models/layers.py quantize_kv."""
    return load_extension("attention_cpu", SOURCE).quantize_records(x)
