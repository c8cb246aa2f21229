"""Logits -> processed probabilities -> tokens, batched, sync-free, per-request seeded.

`SamplingBatch` carries the per-row parameters of a batch as tensors. `process_logits`
applies temperature, top-k and top-p exactly once, and the speculative verifier calls the
same function on the target and the drafter, so both sides see the distribution that
non-speculative sampling would use. Greedy rows (temperature 0) are an exact argmax.

Random rows use the exponential race (`argmax(p / E)`, E ~ Exp(1)), which samples from p
without a host sync. A row with a seed draws its noise from its own torch.Generator, so its
tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdecode.config import SamplingParams


@dataclasses.dataclass(slots=True)
class SamplingBatch:
    temperature: torch.Tensor  # [N] float32; 0 marks a greedy row
    top_k: torch.Tensor  # [N] int64; 0 = off (SamplingParams bounds it below 2^31; above V it keeps all)
    top_p: torch.Tensor  # [N] float32; 1 = off
    generators: list[torch.Generator | None]  # [N] per-row generator (None = shared)
    all_greedy: bool
    needs_filter: bool  # some row uses top-k or top-p (decided on the host, no sync)

    @classmethod
    def build(cls, params: "list[SamplingParams]", generators: list[torch.Generator | None], device) -> "SamplingBatch":
        return cls(
            temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32,
                                     device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            generators=list(generators),
            all_greedy=all(p.greedy for p in params),
            needs_filter=any((p.top_k > 0 or p.top_p < 1.0) and not p.greedy for p in params),
        )

    def repeat_rows(self, counts: list[int]) -> "SamplingBatch":
        """Row i repeated counts[i] times (one row per verified position of a sequence)."""
        index = torch.repeat_interleave(torch.arange(len(counts), device=self.temperature.device),
                                        torch.tensor(counts, device=self.temperature.device))
        gens = [g for g, c in zip(self.generators, counts) for _ in range(c)]
        return SamplingBatch(self.temperature[index], self.top_k[index], self.top_p[index], gens,
                             self.all_greedy, self.needs_filter)


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [N, V] float32 -> probs [N, V] after temperature, top-k, top-p.

    Greedy rows get temperature 1 here (their probs are only used by the verifier's greedy
    path through argmax, which temperature does not change).
    """
    temperature = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
    logits = logits / temperature[:, None]
    if batch.needs_filter:
        logits = _apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    return torch.softmax(logits, dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf every token outside the top-k, then outside the smallest top-p nucleus."""
    V = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [N, V]
    ranks = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))
    drop = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = drop | (mass_before >= top_p[:, None])  # the top token always stays (mass_before = 0)
    drop = drop & (ranks > 0)
    mask = torch.zeros_like(drop).scatter(-1, sorted_idx, drop)
    return logits.masked_fill(mask, float("-inf"))


def exponential_noise(shape_rows: int, vocab: int, generators: list[torch.Generator | None], device) -> torch.Tensor:
    """[N, V] Exp(1) noise; rows with a generator draw from it, the rest from the shared RNG."""
    noise = torch.empty(shape_rows, vocab, device=device).exponential_()
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    return noise


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [N, V] float32 -> token ids [N]."""
    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_tokens
    probs = process_logits(logits, batch)
    noise = exponential_noise(probs.shape[0], probs.shape[1], batch.generators, probs.device)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(batch.temperature > 0, sampled, greedy_tokens)
