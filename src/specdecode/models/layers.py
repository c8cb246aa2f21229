"""The building blocks every model variant shares: RMSNorm, RoPE (default, linear, Llama-3,
YaRN; rotate-half and interleaved), the ragged batch's attention description and cache
writes, and the SwiGLU MLP. `llama.py` (the one model definition) and its DeepSeek variant
blocks (`mla.py`, `moe.py`, `dsa.py`) import them from here."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.kernels import rms_norm_cpu
from specdecode.models.config import ModelConfig

if TYPE_CHECKING:
    from specdecode.models.llama import FusedLinear

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if rms_norm_cpu.serves(x, self.weight):  # eager CPU inference: the same steps in one call
            return rms_norm_cpu.rms_norm(x, self.weight, self.eps)
        # Normalise in float32 like HF (bf16 variance is too coarse), cast back, then scale.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, scaling: dict,
                   max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as HF computes it: interpolate low frequencies by `factor`, keep
    high ones, blend linearly between the beta_fast / beta_slow rotation counts; cos and sin are
    scaled by the attention factor (DeepSeek: mscale / mscale_all_dim)."""
    old_len = scaling.get("original_max_position_embeddings") or max_position_embeddings
    factor = scaling.get("factor") or max_position_embeddings / old_len
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1 = keep the original frequency
    inv = inv_freq.float()
    return inv / factor * (1 - extrapolation) + inv * extrapolation, float(attention_factor)


def rope_parameters(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim / 2] and the factor cos/sin are scaled by (1 but for YaRN)."""
    dim = config.head_dim
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "yarn":  # HF computes YaRN's base frequencies in float32
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        return _yarn_inv_freq(inv_freq, dim, config.rope_theta, scaling, config.max_position_embeddings)
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, smooth in between.
        factor = scaling["factor"]
        low_freq_factor = scaling.get("low_freq_factor", 1.0)
        high_freq_factor = scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq.float(), 1.0


def yarn_softmax_scale(config: ModelConfig, head_dim: int) -> float:
    """DeepSeek's attention scale: head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = head_dim ** -0.5
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default" and scaling.get("mscale_all_dim"):
        scale *= _yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        inv_freq, self.attention_factor = rope_parameters(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, 1, head_dim] (broadcast over heads)."""
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        if self.attention_factor != 1.0:
            return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; rotate-half convention (HF / Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] whose rotary pairs are (x0, x1), (x2, x3), ... (DeepSeek's layout). The
    result is de-interleaved (evens' rotation, then odds'), as HF returns it: q and k get the
    same permutation, so their dot products are those of the interleaved rotation."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@dataclasses.dataclass(slots=True)
class AttentionBatch:
    """How the new tokens of one forward meet the KV cache. Built by the runner.

    With `slot_ids` None there is no cache: attention runs over the new tokens alone,
    causal unless `attn_mask` is given (training, drafters' block masks).
    """

    attn_mask: torch.Tensor | None  # [B, 1, T, S] bool, True = query may see key
    slot_ids: torch.Tensor | None = None  # [B] cache row of each sequence
    write_indices: torch.Tensor | None = None  # [B, T] cache column each new token's K/V goes to
    num_keys: int = 0  # S: cache columns [0, S) are read
    slot_range: tuple[int, int] | None = None  # slots are the contiguous rows [a, b): slice, no gather
    # Every entry writes columns [write_start, write_start + T) of the rows slot_range: a slice
    # assignment instead of two scatters per layer (decode and chain verify at batch 1, ...).
    write_start: int | None = None
    # Exact mode: attention by the width- and batch-invariant kernel (`kernels/exact_cpu.cpp`).
    exact: bool = False
    # Every query sees every column [0, num_keys) (decode steps of equal-length sequences): the
    # attention kernel runs without the mask (measured: 13-33 us less per layer, same results).
    sees_all: bool = False


# An int8 KV cache (kv_cache_dtype "int8") stores each (token, KV head) as one record: its head_dim int8
# values, then their float32 scale as 4 bytes (kernels/cached_attention.h reads the same layout).
KV_SCALE_BYTES = 4


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """x [.., D] -> int8 records [.., D + 4]: round(x / scale) with scale = max |x| / 127 (half to even;
    an all-zero head stays zero), then the scale's bytes. kernels/cached_attention.h quantize_record
    computes the same numbers (the C++ stack's cache writes)."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127  # [.., 1]
    values = torch.round(xf / torch.where(scale > 0, scale, 1.0)).clamp_(-127, 127).to(torch.int8)
    return torch.cat((values, scale.view(torch.int8)), dim=-1)


def dequantize_kv(records: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 records [.., D + 4] -> values x scale [.., D] in `dtype` (what PyTorch's attention reads where
    the cached attention op does not serve: prefill widths, GPUs, compiled forwards)."""
    D = records.shape[-1] - KV_SCALE_BYTES
    scale = records[..., D:].contiguous().view(torch.float32)  # [.., 1]
    return (records[..., :D].float() * scale).to(dtype)


def write_columns(cache: torch.Tensor, batch: AttentionBatch, values: torch.Tensor) -> None:
    """Store values [B, T, heads, width] at each sequence's slot and write columns (an int8 cache's as
    records, `quantize_kv`)."""
    if cache.dtype == torch.int8 and values.dtype != torch.int8:
        values = quantize_kv(values)
    if batch.write_start is not None and batch.slot_range is not None:
        (a, b), start, T = batch.slot_range, batch.write_start, values.shape[1]
        cache[a:b, start:start + T] = values
        return
    cache[batch.slot_ids[:, None], batch.write_indices] = values.to(cache.dtype)  # no-op cast when dtypes match


def read_columns(cache: torch.Tensor, batch: AttentionBatch, num_keys: int) -> torch.Tensor:
    """Cache columns [0, num_keys) of each sequence's slot: [B, S, heads, width] (a view, no
    gather, when the slots are contiguous rows)."""
    if batch.slot_range is not None:
        a, b = batch.slot_range
        return cache[a:b, :num_keys]
    return cache[batch.slot_ids, :num_keys]


def write_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, batch: AttentionBatch, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v [B, T, kv_heads, head_dim] at each sequence's slot and write columns."""
    write_columns(cache_k, batch, k)
    write_columns(cache_v, batch, v)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        d, f = config.hidden_size, intermediate_size or config.intermediate_size  # MoE experts are narrower
        self.gate_proj = nn.Linear(d, f, bias=config.mlp_bias)
        self.up_proj = nn.Linear(d, f, bias=config.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=config.mlp_bias)

        self.gate_up: FusedLinear | None = None  # set by `fuse_projections` (inference)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)
