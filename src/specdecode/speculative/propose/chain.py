"""Building an autoregressive chain draft one step at a time (draft_model, eagle, eagle3, mtp)."""

from __future__ import annotations

import struct

import torch

from specdecode.sampling import (RowMasks, SamplingBatch, adjust_logits, argmax, bitmask_words, inverse_cdf,
                                 process_logits, race_noise)
from specdecode.speculative.propose.proposer import Draft


def float32(value: float) -> float:
    """`value` rounded to float32 (to nearest, as a float32 tensor holds it), by struct: the tensor
    this replaced was a torch op on every proposal (~5-15 us of host work at batch 1, paid cold
    after the verify forward)."""
    return struct.unpack("f", struct.pack("f", value))[0]


class ChainDraft:
    """Buffers of a chain draft for a batch of B sequences, k steps at most.

    Each step samples (or takes the argmax of) the drafter's processed distribution q for the
    still-active rows and records q, since rejection sampling needs the exact q the token
    was drawn from (an all-greedy, unadjusted batch records none: it is verified by token
    equality, so its drafts go out one-hot). A sampled row draws by inverse CDF with the uniform
    of its position among max_tokens[b] float64 uniforms drawn once a proposal (from its
    generator if seeded: a count that does not depend on the batch or on where the chain stops,
    so the C++ chain, which is handed them all, and these steps consume the same); a keyed row
    races q against the target's keyed noise instead. Confidence = the drafter's top probability at that
    position: it depends on the prefix only, never on the token drawn, which keeps D-Cut pruning
    lossless.
    p_min (llama.cpp): a row stops at the first position whose top probability is below
    p_min, and that token is dropped.
    stop (D-Cut's drafting half, `DepthController.keep_drafting`): after each step, given every
    row's confidences so far, which still-drafting rows are worth another drafter step.

    The drafter's logits get the target's adjustments (`adjust_logits`): penalties and bad words
    count the tokens drafted so far, and a constrained row drafts under its grammar's mask,
    walked on a fork of its committed state, so drafts stay inside the grammar and acceptance
    does not collapse.
    """

    def __init__(self, max_tokens: list[int], vocab_size: int, device, p_min: float = 0.0, stop=None):
        batch_size, k = len(max_tokens), max(max_tokens, default=0)
        self.max_tokens = max_tokens
        self._uniforms: dict[int, list[float]] = {}  # row -> its max_tokens[row] uniforms (sampled rows)
        # Tokens and confidences are kept on the host (what the speculator reads) and handed over as
        # they are (`result`): [B][k], -1 / 0.0 where a row drafted nothing.
        self.tokens = [[-1] * k for _ in range(batch_size)]
        self.confidences = [[0.0] * k for _ in range(batch_size)]
        # [B, k, V], made by the first step that needs it: an all-greedy batch verifies by token
        # equality alone, so its drafts go out one-hot (None) and q is never stored.
        self.probs: torch.Tensor | None = None
        self.shape = (batch_size, k, vocab_size)
        self.num = [0] * batch_size
        self.device = device
        self.p_min = float32(p_min)  # compared with float32 probabilities
        self.stop = stop
        self.tops: list[list[float]] = [[] for _ in range(batch_size)]  # confidences of kept drafts (stop rule)
        self.forks: dict = {}  # row -> GrammarState after its drafted tokens (constrained rows)

    @staticmethod
    def one_hot(sampling: SamplingBatch) -> bool:
        """An all-greedy, unadjusted batch: drafts are argmaxes of the raw logits, verified by token
        equality (no q stored)."""
        return sampling.all_greedy and not sampling.adjusts and not sampling.constrained

    def _grammar_masks(self, active: list[int], sampling: SamplingBatch, vocab: int) -> RowMasks | None:
        """Masks of the next draft token of the active constrained rows, from their forks."""
        rows = [j for j, b in enumerate(active) if sampling.grammars[b] is not None]
        if not rows:
            return None
        bitmask = torch.empty(len(rows), bitmask_words(vocab), dtype=torch.int32)
        for g, j in enumerate(rows):
            b = active[j]
            if b not in self.forks:
                self.forks[b] = sampling.grammars[b].fork()
            self.forks[b].fill_mask(bitmask[g])
        return RowMasks(rows, bitmask)

    def uniforms(self, row: int, generator: torch.Generator | None) -> list[float]:
        """The proposal's max_tokens[row] float64 uniforms of a sampled row, drawn at first use."""
        if row not in self._uniforms:
            self._uniforms[row] = torch.rand(self.max_tokens[row], dtype=torch.float64, device=self.device,
                                             generator=generator).tolist()
        return self._uniforms[row]

    def probs_buffer(self) -> torch.Tensor:
        """q's buffer [B, k, V], zeros until written (made at first use; a C++ chain writes a row's)."""
        if self.probs is None:
            self.probs = torch.zeros(self.shape, device=self.device)
        return self.probs

    def add_step(self, active: list[int], step: int, logits: torch.Tensor, sampling: SamplingBatch) -> list[int]:
        """logits [A, V] of the active rows -> the drafted token of each active row (-1 = stopped by p_min)."""
        # An all-greedy, unadjusted batch: q is the softmax of the logits (temperature 1, no filter),
        # read for its top probability only, and not stored (verification compares tokens).
        sub = None if self.one_hot(sampling) else sampling.select(active)
        if sub is not None and (sub.adjusts or sampling.constrained):
            drafted = torch.tensor([self.tokens[b][:step] for b in active], dtype=torch.long, device=self.device)
            sub = sub.with_context(drafted, self._grammar_masks(active, sampling, logits.shape[-1]))
            logits = adjust_logits(logits, sub)
        q = torch.softmax(logits, dim=-1) if sub is None else process_logits(logits, sub)  # [A, V]
        chosen = argmax(logits)
        if sub is not None and not sub.all_greedy:
            keyed = set(sub.keyed_rows)
            drawn = [j for j in range(len(active)) if not sub.greedy[j] and j not in keyed]
            if drawn:
                u = [self.uniforms(active[j], sub.generators[j])[step] for j in drawn]
                index = torch.tensor(drawn, device=self.device)
                tokens = inverse_cdf(q[index], torch.tensor(u, dtype=torch.float64, device=self.device))
                chosen = chosen.index_copy(0, index, tokens)
            if keyed:
                # Keyed rows race q against the noise the target will race p against at this position
                # (Gumbel coupling): the draft is the target's token whenever q and p allow it.
                index = torch.tensor(sub.keyed_rows, device=self.device)
                noise = race_noise(sub.select(sub.keyed_rows), logits.shape[-1], offset=step)
                chosen = chosen.index_copy(0, index, (q[index] / noise).argmax(dim=-1))
        if sub is not None:
            self.probs_buffer()[torch.tensor(active, device=self.device), step] = q
        return self.record(active, step, chosen.tolist(), q.max(dim=-1).values.tolist())

    def record(self, active: list[int], step: int, chosen: list[int], tops: list[float]) -> list[int]:
        """Position `step` of the active rows: each one's drafted token and its probability (the
        confidence) -> the tokens kept (-1: stopped by p_min, or refused by the row's grammar)."""
        kept = []
        for b, token, top in zip(active, chosen, tops):
            self.confidences[b][step] = top
            if top < self.p_min or (b in self.forks and not self.forks[b].accept(token)):
                token = -1  # a constrained row advances its fork; a token it refuses ends the row
            if token >= 0:
                self.tokens[b][step] = token
                self.num[b] += 1
                self.tops[b].append(top)
            kept.append(token)
        return kept

    def set_confidence(self, rows: list[int], step: int, values: list[float]) -> None:
        """Replace the confidences of position `step` (a drafter's own calibrated estimate)."""
        for b, value in zip(rows, values):
            self.confidences[b][step] = value

    def continuing(self, step: int, active: list[int], chosen: list[int], max_tokens: list[int]) -> list[int]:
        """The rows of `active` that draft position step + 1: not stopped by p_min, below their
        limit and, with a stop rule, worth another step. The rule sees confidences up to `step`,
        which depend on tokens before it only: lossless, as p_min is."""
        still = [b for b, token in zip(active, chosen) if token >= 0 and step + 1 < max_tokens[b]]
        if self.stop is not None and still:
            still = self.stop(step, self.tops, still)
        return still

    def result(self) -> Draft:
        return Draft.from_host(self.tokens, self.num, self.device, self.probs, self.confidences)
