"""Exact mode's CPU kernels (exact_cpu.cpp): attention whose every query row is computed the same
way in any batch, at any width and with any number of key columns, and position-keyed noise.

It is compiled on first use with PyTorch's extension builder (a C++ compiler is needed, as for
`torch.compile` on a CPU; about 30 s once, then cached under $SPECDECODE_CACHE/extensions).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from specdecode.errors import ConfigError
from specdecode.kernels.build import load_extension

SOURCE = Path(__file__).with_name("exact_cpu.cpp")


@functools.cache
def _extension():
    try:
        return load_extension("exact_kernels", SOURCE)
    except Exception as error:  # no compiler, no ninja, a failed build: say what exact mode needs
        raise ConfigError(f"exact mode needs its CPU kernels, which failed to build ({type(error).__name__}: "
                          f"{error}); it needs a C++ compiler and ninja (pip install ninja)") from None


def build() -> None:
    """Compile (or load the cached build of) the kernel now, so a failure shows at startup."""
    _extension()


def exact_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slot_ids: torch.Tensor,
                    mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, T, H, D]; cache_k/v [slots, C, KVH, D]; slot_ids [B]; mask [B, T, S] bool -> [B, T, H, D]."""
    return _extension().exact_attention(q, cache_k, cache_v, slot_ids, mask, scale)


def keyed_exponential_cpu(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [N], positions [N] int64 -> [N, vocab] float32 Exp(1) noise (noise.py defines the hash)."""
    return _extension().keyed_exponential(keys, positions, vocab)
