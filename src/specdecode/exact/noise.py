"""Position-keyed sampling noise: Exp(1) draws that are a pure function of (seed, position, token).

Plain decoding samples token t as argmax(p_t / E_t) (the exponential race, `sampling.py`).
When E_t depends only on the request's seed, the token's absolute position t and the token
id, and not on how many random numbers were drawn before, every engine path that computes
the same p_t picks the same token: plain decoding, a verify forward, a tree, any batch. The
verifier then accepts a draft token exactly when it equals that token (a deterministic,
lossless rule), and a drafter racing its own q against the same E_t proposes the target's
token whenever the two distributions allow it (Gumbel coupling: P(accept) >= (1 - TV) / (1 + TV)).

The hash is murmur3's 32-bit finaliser f: row = f(f(key) ^ position), h = f(f(row ^
f(token * 0x9E3779B1)) ^ 0x5BD1E995), all mod 2^32; the uniform keeps 24 bits, (h >> 8 + 0.5) / 2^24,
strictly inside (0, 1), and the noise is -log of it. On a CPU one C++ kernel computes it
(kernels/exact_cpu.cpp, a fixed polynomial log, ~100x faster than tensor ops); elsewhere the tensor ops
below do, on int64 tensors holding 32-bit values (no product reaches 2^63).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), split so no product reaches 2^63."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _fmix32_int(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def seed_key(seed: int) -> int:
    """A request seed (any int in [0, 2^64)) -> its 32-bit noise key."""
    return _fmix32_int(_fmix32_int(seed & MASK32) ^ ((seed >> 32) & MASK32) ^ 0x9E3779B9)


def keyed_exponential(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [N] int64 (from `seed_key`), positions [N] int64 -> [N, vocab] float32 Exp(1) noise,
    row i a function of (keys[i], positions[i]) only."""
    if keys.device.type == "cpu":
        from specdecode.kernels.exact_cpu import keyed_exponential_cpu

        return keyed_exponential_cpu(keys, positions, vocab)
    return -torch.log(keyed_uniform(keys, positions, vocab))


def keyed_uniform(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The uniforms behind `keyed_exponential` [N, vocab], by tensor ops (any device; the reference)."""
    device = keys.device
    row = _fmix32((_fmix32(keys.long() & MASK32) ^ (positions.long() & MASK32)) & MASK32)  # [N]
    tokens = torch.arange(vocab, device=device, dtype=torch.long)  # [V]
    h = _fmix32(row[:, None] ^ _fmix32(_mul32(tokens, 0x9E3779B1))[None, :])  # [N, V]
    h = _fmix32(h ^ 0x5BD1E995)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))
