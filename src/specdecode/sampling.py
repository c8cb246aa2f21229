"""Logits -> processed probabilities -> tokens, batched, sync-free, per-request seeded.

`SamplingBatch` carries the per-row parameters of a batch as tensors. `adjust_logits` applies
the context-dependent adjustments (penalties, logit_bias, bad words, grammar masks: see
logit_adjust.py) and `process_logits` temperature, min_p, top-k and top-p, exactly once each;
plain sampling, the drafters' chains and the speculative verifier all call these two, so every
side sees the distribution that non-speculative sampling would use. Greedy rows (temperature
0) are an exact argmax of the adjusted logits.

Random rows draw by inverse CDF (`inverse_cdf`): one float64 uniform a row, against the
cumulative sum of p, the first token whose cumulative mass exceeds it. It measured 17 us for one
8,192-token row on a 2-core EPYC, where the exponential race (`argmax(p / E)`, E ~ Exp(1), a
uniform per token) took 85. A row with a seed draws its uniforms from its own torch.Generator, so
its tokens do not depend on the rest of the batch. In exact mode a seeded row is *keyed* instead
and keeps the race: its noise for the token at absolute position t is a pure function of (seed, t,
token id) (`exact/noise.py`), so every path that computes the same p_t samples the same token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import torch

from specdecode.logit_adjust import LogitAdjust, apply_grammar_mask

if TYPE_CHECKING:
    from specdecode.config import SamplingParams


def bitmask_words(vocab_size: int) -> int:
    """int32 words of a grammar bitmask over the vocabulary."""
    return (vocab_size + 31) // 32


@dataclasses.dataclass(slots=True)
class RowMasks:
    """Grammar bitmasks for some rows of a batch: rows[g] may produce token t where bit t % 32 of
    bitmask[g, t // 32] is set."""

    rows: list[int]  # host
    bitmask: torch.Tensor  # [G, ceil(V / 32)] int32 (CPU: the grammar engine writes it)

    def select(self, rows: list[int]) -> "RowMasks | None":
        """The masks of the given rows of the batch, renumbered as `SamplingBatch.select` does."""
        where = {r: g for g, r in enumerate(self.rows)}
        picked = [(j, where[r]) for j, r in enumerate(rows) if r in where]
        if not picked:
            return None
        return RowMasks([j for j, _ in picked], self.bitmask[torch.tensor([g for _, g in picked])])


@functools.lru_cache(maxsize=64)
def _greedy_parameters(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An all-greedy batch's temperature (0), top_k (0) and top_p (1) for n rows, made once: three
    `torch.tensor` calls cost ~13 us a step on a 2-core EPYC, where a decode step takes ~0.7 ms.
    Shared between batches: nothing writes them in place."""
    return (torch.zeros(n, dtype=torch.float32, device=device), torch.zeros(n, dtype=torch.int64, device=device),
            torch.ones(n, dtype=torch.float32, device=device))


@dataclasses.dataclass(slots=True)
class SamplingBatch:
    temperature: torch.Tensor  # [N] float32; 0 marks a greedy row
    top_k: torch.Tensor  # [N] int64; 0 = off (SamplingParams bounds it below 2^31; above V it keeps all)
    top_p: torch.Tensor  # [N] float32; 1 = off
    generators: list[torch.Generator | None]  # [N] per-row generator (None = shared)
    all_greedy: bool
    needs_filter: bool  # some row uses top-k or top-p (decided on the host, no sync)
    # Keyed rows (exact mode, seeded, temperature > 0): noise from (key, position, token) alone.
    keyed_rows: list[int] = dataclasses.field(default_factory=list)  # host: which rows are keyed
    noise_keys: torch.Tensor | None = None  # [N] int64 32-bit keys (`exact.noise.seed_key`), -1 = not keyed
    positions: torch.Tensor | None = None  # [N] int64 absolute position of the token each row samples next
    greedy: list[bool] = dataclasses.field(default_factory=list)  # host: [N] temperature 0
    min_p: torch.Tensor | None = None  # [N] float32; None = no row uses min_p
    # Context-dependent adjustments (logit_adjust.py): per-sequence data, each row's sequence
    # (host) and the draft tokens on its path beyond the committed ones ([N, D], -1 padded).
    adjust: LogitAdjust | None = None
    base_rows: list[int] = dataclasses.field(default_factory=list)
    extra_tokens: torch.Tensor | None = None
    grammar: RowMasks | None = None  # grammar masks of the constrained rows (None: no row is constrained)
    grammars: list = dataclasses.field(default_factory=list)  # host [N]: each row's committed GrammarState or None

    @classmethod
    def build(cls, params: "list[SamplingParams]", generators: list[torch.Generator | None], device,
              noise_keys: list[int | None] | None = None, positions: list[int] | None = None,
              adjust: LogitAdjust | None = None, grammars: list | None = None,
              grammar: RowMasks | None = None) -> "SamplingBatch":
        """noise_keys (exact mode): a key per row, None for rows that are not keyed; positions: the
        absolute position each row samples next (needed with keys). Greedy rows ignore top-k,
        top-p and min_p (as vLLM), so their logprobs are those of the adjusted logits."""
        keyed = [] if noise_keys is None else [i for i, (key, p) in enumerate(zip(noise_keys, params))
                                               if key is not None and not p.greedy]
        keyed_set = set(keyed)
        all_greedy = all(p.greedy for p in params)
        if all_greedy:
            temperature, top_k, top_p = _greedy_parameters(len(params), torch.device(device))
        else:
            temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32,
                                       device=device)
            top_k = torch.tensor([0 if p.greedy else p.top_k for p in params], dtype=torch.int64, device=device)
            top_p = torch.tensor([1.0 if p.greedy else p.top_p for p in params], dtype=torch.float32, device=device)
        return cls(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generators=list(generators),
            all_greedy=all_greedy,
            needs_filter=any((p.top_k > 0 or p.top_p < 1.0) and not p.greedy for p in params),
            keyed_rows=keyed,
            noise_keys=None if not keyed else torch.tensor(
                [-1 if i not in keyed_set else noise_keys[i] for i in range(len(params))], device=device),
            positions=None if not keyed else torch.tensor(positions, dtype=torch.int64, device=device),
            greedy=[p.greedy for p in params],
            min_p=None if not any(p.min_p > 0 and not p.greedy for p in params) else torch.tensor(
                [0.0 if p.greedy else p.min_p for p in params], dtype=torch.float32, device=device),
            adjust=adjust,
            base_rows=list(range(len(params))),
            grammar=grammar,
            grammars=list(grammars) if grammars is not None else [None] * len(params),
        )

    @property
    def all_deterministic(self) -> bool:
        """Every row is greedy or keyed: verification is an equality test, no rejection sampling."""
        return self.all_greedy or len(self.keyed_rows) + sum(self.greedy) == len(self.generators)

    @property
    def adjusts(self) -> bool:
        """Some row's logits are adjusted (penalties, bias, bad words or a grammar)."""
        return self.adjust is not None or self.grammar is not None

    @property
    def raw_argmax(self) -> bool:
        """Every row's token is the raw logits' argmax (all greedy, nothing adjusted): the forward may take
        it (`Runner.forward(argmax=True)`)."""
        return self.all_greedy and not self.adjusts

    @property
    def constrained(self) -> bool:
        """Some row follows a grammar."""
        return any(g is not None for g in self.grammars)

    def select(self, rows: list[int]) -> "SamplingBatch":
        """The batch of the given rows only, in that order."""
        index = torch.tensor(rows, device=self.temperature.device, dtype=torch.long)
        keyed_set = set(self.keyed_rows)
        keyed = [j for j, r in enumerate(rows) if r in keyed_set]
        return SamplingBatch(self.temperature[index], self.top_k[index], self.top_p[index],
                             [self.generators[r] for r in rows], self.all_greedy, self.needs_filter, keyed,
                             None if not keyed else self.noise_keys[index],
                             None if not keyed else self.positions[index], [self.greedy[r] for r in rows],
                             None if self.min_p is None else self.min_p[index], self.adjust,
                             [self.base_rows[r] for r in rows],
                             None if self.extra_tokens is None else self.extra_tokens[index],
                             None if self.grammar is None else self.grammar.select(rows),
                             [self.grammars[r] for r in rows])

    def with_context(self, extra_tokens: torch.Tensor | None, grammar: RowMasks | None) -> "SamplingBatch":
        """The same rows, each after `extra_tokens` [N, D] on its path (-1 padded; kept only where
        an adjustment reads them) and under these grammar masks."""
        return dataclasses.replace(self, extra_tokens=extra_tokens if self.adjust is not None else None,
                                   grammar=grammar)

    def repeat_rows(self, counts: list[int]) -> "SamplingBatch":
        """Row i repeated counts[i] times, one row per verified position of a sequence: the j-th
        repeat samples the token j positions later (keyed rows' noise follows it). The repeats
        carry no draft context or grammar masks: `with_context` adds them."""
        device = self.temperature.device
        # (from a host list: torch.repeat_interleave with a tensor of counts took ~20 us a call here)
        index = torch.tensor([i for i, c in enumerate(counts) for _ in range(c)], dtype=torch.long, device=device)
        gens = [g for g, c in zip(self.generators, counts) for _ in range(c)]
        keyed, noise_keys, positions = [], None, None
        if self.keyed_rows:
            starts = [sum(counts[:i]) for i in range(len(counts))]
            keyed = [starts[i] + j for i in self.keyed_rows for j in range(counts[i])]
            offsets = torch.cat([torch.arange(c, device=device) for c in counts])
            noise_keys, positions = self.noise_keys[index], self.positions[index] + offsets
        greedy = [g for g, c in zip(self.greedy, counts) for _ in range(c)]
        return SamplingBatch(self.temperature[index], self.top_k[index], self.top_p[index], gens,
                             self.all_greedy, self.needs_filter, sorted(keyed), noise_keys, positions, greedy,
                             None if self.min_p is None else self.min_p[index], self.adjust,
                             [b for b, c in zip(self.base_rows, counts) for _ in range(c)], None, None,
                             [g for g, c in zip(self.grammars, counts) for _ in range(c)])


def adjust_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [N, V] -> logits after the context-dependent adjustments (logit_adjust.py): what greedy
    rows take the argmax of and what `process_logits` starts from. The same tensor when no row adjusts."""
    if batch.adjust is not None:
        logits = batch.adjust.apply(logits, batch.base_rows, batch.extra_tokens)
    if batch.grammar is not None:
        logits = apply_grammar_mask(logits, batch.grammar.rows, batch.grammar.bitmask)
    return logits


def processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Adjusted logits [N, V] -> the logits of the distribution each row samples from: after
    temperature, min_p, top-k, top-p (masked tokens at -inf).

    Greedy rows get temperature 1 here (their probs are only used by the verifier's greedy
    path through argmax, which temperature does not change, and by logprobs)."""
    temperature = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
    logits = logits / temperature[:, None]
    if batch.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        drop = probs < batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(drop, float("-inf"))
    if batch.needs_filter:
        logits = _apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    return logits


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Adjusted logits [N, V] float32 -> probs [N, V] after temperature, min_p, top-k, top-p."""
    return torch.softmax(processed_logits(logits, batch), dim=-1)


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
    """[N, V] Exp(1) noise; rows with a generator draw from it, the rest from the shared RNG.

    Drawn as -log(1 - U), U uniform: PyTorch's CPU `exponential_` took 155 us for 8,192 values here
    (2 threads), uniform_ plus the transform 40 us, a quarter of a sampled token's cost at T=1.
    Clamped to the smallest normal float: a zero would make a masked token's 0 / 0 a NaN, which
    argmax takes as the largest."""
    noise = torch.empty(shape_rows, vocab, device=device)
    shared = [row for row, gen in enumerate(generators) if gen is None]
    if len(shared) == shape_rows:
        noise.uniform_()
    elif shared:
        noise[shared] = torch.empty(len(shared), vocab, device=device).uniform_()
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].uniform_(generator=gen)
    return noise.neg_().log1p_().neg_().clamp_min_(torch.finfo(noise.dtype).tiny)


def race_noise(batch: SamplingBatch, vocab: int, offset: int = 0) -> torch.Tensor:
    """[N, V] Exp(1) noise for the exponential race: keyed rows at their position + offset,
    the others from their generator or the shared RNG (`exponential_noise`)."""
    N, device = len(batch.generators), batch.temperature.device
    if not batch.keyed_rows:
        return exponential_noise(N, vocab, batch.generators, device)
    from specdecode.exact.noise import keyed_exponential

    keyed = torch.tensor(batch.keyed_rows, device=device)
    noise = torch.empty(N, vocab, device=device)
    noise[keyed] = keyed_exponential(batch.noise_keys[keyed], batch.positions[keyed] + offset, vocab).to(device)
    keyed_set = set(batch.keyed_rows)
    others = [i for i in range(N) if i not in keyed_set]
    if others:
        noise[torch.tensor(others, device=device)] = exponential_noise(
            len(others), vocab, [batch.generators[i] for i in others], device)
    return noise


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1), the same indices (the first of equal maxima; NaN counts as the largest). A
    CPU float32 tensor goes through numpy, whose vectorised reduction measured 1.7 us a row of 8,192
    logits here where PyTorch's took 8.6 (3 rows 2.8 against 22, 9 rows 5.9 against 37): a greedy
    step takes one or more of these."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad and x.shape[-1] > 0:
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def argmax_host(x: torch.Tensor) -> list:
    """`argmax(x).tolist()`, read straight from numpy's result for a CPU float32 tensor: the torch
    wrapper and its `tolist` were ~5 us of a step's host work, paid cold after a forward (the
    dispatcher's code out of the caches; measured at W4A8 batch 1: 9.9 -> 5.2 us at one row,
    13.7 -> 8.5 at four)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad and x.shape[-1] > 0:
        return x.numpy().argmax(axis=-1).tolist()
    return argmax(x).tolist()


def uniform_draws(rows: int, cols: int, generators: list[torch.Generator | None], device,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[rows, cols] uniforms in [0, 1); a seeded row draws its own `cols` from its generator."""
    if rows and all(gen is not None for gen in generators):  # every row seeded: no shared draw to overwrite (~5 us an op)
        draws = [torch.rand(cols, device=device, dtype=dtype, generator=gen) for gen in generators]
        return draws[0].view(1, cols) if rows == 1 else torch.stack(draws)
    u = torch.rand(rows, cols, device=device, dtype=dtype)
    for row, gen in enumerate(generators):
        if gen is not None:
            u[row] = torch.rand(cols, device=device, dtype=dtype, generator=gen)
    return u


@functools.cache
def native_sampling():
    """The C++ stack's extension (kernels/decode_stack_cpu.cpp), whose `inverse_cdf` and
    `verify_sampled_row` serve sampling on a CPU, or None where it is not built."""
    from specdecode.kernels import decode_stack_cpu

    return decode_stack_cpu.extension()


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [N, V] (unnormalised mass >= 0, a positive sum), u [N] float64 in [0, 1) -> token ids
    [N]: the first token whose float64 cumulative mass exceeds u * total, a draw from probs / total.

    Never a token of zero mass (the cumulative sum does not rise there): the threshold is kept
    below the total, which u * total may round up to. The C++ drafting chain (`DraftStep` in
    kernels/decode_stack_cpu.cpp) draws with the same sequential float64 sums, so the same q and
    u give the same token on both paths; on a CPU its `inverse_cdf` serves float32 probs with the
    same sums (these tensor ops cost ~55 us a sampled token after a forward)."""
    native = native_sampling()
    if native is not None and probs.device.type == "cpu" and probs.dtype == torch.float32 and u.dtype == torch.float64:
        return native.inverse_cdf(probs.contiguous(), u.contiguous())
    return _tensor_inverse_cdf(probs, u)


def _tensor_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`inverse_cdf` in tensor ops (any device and dtype)."""
    cdf = probs.double().cumsum(dim=-1)  # [N, V]
    total = cdf[:, -1]
    threshold = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    # (clamped: an all-zero row, which no caller passes, would find no token)
    return torch.searchsorted(cdf, threshold[:, None], right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def sample_host(logits: torch.Tensor, batch: SamplingBatch, choices: list[int] | None = None) -> list[int]:
    """`sample(logits, batch).tolist()`; an all-greedy batch's argmaxes go straight to the host
    (`argmax_host`). `choices`: the rows' argmaxes where the forward took them (`ForwardResult.argmax`),
    the tokens of an all-greedy batch without adjustments. logits [N, V], or a forward's [N, T, V]
    sampled at position 0: sliced only where read (after a forward the slice was the step's first
    torch op, ~6 us on the caches the forward had evicted, and such a greedy batch reads no logits)."""
    if batch.all_greedy and choices is not None and batch.raw_argmax:
        return choices
    if logits.dim() == 3:
        logits = logits[:, 0]
    if batch.all_greedy:
        return argmax_host(adjust_logits(logits, batch))
    return sample(logits, batch).tolist()


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Raw logits [N, V] float32 -> token ids [N] (adjustments, then the processed distribution).
    A sampled row draws one float64 uniform (inverse CDF); keyed rows race their keyed noise."""
    logits = adjust_logits(logits, batch)
    if batch.all_greedy:
        return argmax(logits)
    probs = process_logits(logits, batch)
    sampled = inverse_cdf(probs, uniform_draws(len(batch.generators), 1, batch.generators, probs.device,
                                               torch.float64)[:, 0])
    if batch.keyed_rows:
        keyed = torch.tensor(batch.keyed_rows, device=probs.device)
        race = probs[keyed] / race_noise(batch.select(batch.keyed_rows), probs.shape[1])
        sampled = sampled.index_copy(0, keyed, race.argmax(dim=-1))
    if not any(batch.greedy):  # no argmax to merge (~20 us a token at T=1)
        return sampled
    return torch.where(batch.temperature > 0, sampled, argmax(logits))
