"""Building an autoregressive chain draft one step at a time (draft_model, eagle, eagle3, mtp)."""

from __future__ import annotations

import torch

from specdecode.sampling import RowMasks, SamplingBatch, adjust_logits, bitmask_words, process_logits, race_noise
from specdecode.speculative.propose.proposer import Draft


class ChainDraft:
    """Buffers of a chain draft for a batch of B sequences, k steps at most.

    Each step samples (or takes the argmax of) the drafter's processed distribution q for the
    still-active rows and records q, since rejection sampling needs the exact q the token
    was drawn from (an all-greedy, unadjusted batch records none: it is verified by token
    equality, so its drafts go out one-hot). Confidence = the drafter's top probability at that
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

    def __init__(self, batch_size: int, k: int, vocab_size: int, device, p_min: float = 0.0, stop=None):
        self.token_ids = torch.full((batch_size, k), -1, dtype=torch.long, device=device)  # [B, k]
        # [B, k, V], made by the first step that needs it: an all-greedy batch verifies by token
        # equality alone, so its drafts go out one-hot (None) and q is never stored.
        self.probs: torch.Tensor | None = None
        self.shape = (batch_size, k, vocab_size)
        self.confidence = torch.zeros(batch_size, k, device=device)  # [B, k]
        self.num = [0] * batch_size
        self.device = device
        self.p_min = p_min
        self.stop = stop
        self.tops: list[list[float]] = [[] for _ in range(batch_size)]  # host confidences of kept drafts (stop only)
        self.forks: dict = {}  # row -> GrammarState after its drafted tokens (constrained rows)

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

    def add_step(self, active: list[int], step: int, logits: torch.Tensor, sampling: SamplingBatch) -> list[int]:
        """logits [A, V] of the active rows -> the drafted token of each active row (-1 = stopped by p_min)."""
        rows = torch.tensor(active, device=self.device)
        # An all-greedy, unadjusted batch: q is the softmax of the logits (temperature 1, no filter),
        # read for its top probability only, and not stored (verification compares tokens).
        greedy = sampling.all_greedy and not sampling.adjusts and not sampling.constrained
        sub = None if greedy else sampling.select(active)
        if sub is not None and (sub.adjusts or sampling.constrained):
            sub = sub.with_context(self.token_ids[rows, :step], self._grammar_masks(active, sampling, logits.shape[-1]))
            logits = adjust_logits(logits, sub)
        q = torch.softmax(logits, dim=-1) if sub is None else process_logits(logits, sub)  # [A, V]
        chosen = logits.argmax(dim=-1)
        if sub is not None and not sub.all_greedy:
            # Keyed rows race q against the noise the target will race p against at this position
            # (Gumbel coupling): the draft is the target's token whenever q and p allow it.
            noise = race_noise(sub, logits.shape[-1], offset=step)
            chosen = torch.where(sub.temperature > 0, (q / noise).argmax(dim=-1), chosen)
        if sub is not None:
            if self.probs is None:
                self.probs = torch.zeros(self.shape, device=self.device)
            self.probs[rows, step] = q
        top = q.max(dim=-1).values
        self.confidence[rows, step] = top
        if self.p_min > 0:
            chosen = torch.where(top >= self.p_min, chosen, torch.full_like(chosen, -1))
        self.token_ids[rows, step] = chosen
        chosen_host = chosen.tolist()
        for j, b in enumerate(active):  # constrained rows advance their fork; a token it refuses ends the row
            if b in self.forks and chosen_host[j] >= 0 and not self.forks[b].accept(chosen_host[j]):
                chosen_host[j] = -1
                self.token_ids[b, step] = -1
        tops = top.tolist() if self.stop is not None else [None] * len(active)
        for b, token, t in zip(active, chosen_host, tops):
            if token >= 0:
                self.num[b] += 1
                self.tops[b].append(t)
        return chosen_host

    def continuing(self, step: int, active: list[int], chosen: list[int], max_tokens: list[int]) -> list[int]:
        """The rows of `active` that draft position step + 1: not stopped by p_min, below their
        limit and, with a stop rule, worth another step. The rule sees confidences up to `step`,
        which depend on tokens before it only: lossless, as p_min is."""
        still = [b for b, token in zip(active, chosen) if token >= 0 and step + 1 < max_tokens[b]]
        if self.stop is not None and still:
            still = self.stop(step, self.tops, still)
        return still

    def result(self) -> Draft:
        return Draft(self.token_ids, torch.tensor(self.num, device=self.device), self.probs, self.confidence)
