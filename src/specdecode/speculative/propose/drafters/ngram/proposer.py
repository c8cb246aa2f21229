"""`ngram`: prompt lookup decoding (model-free).

Find the most recent earlier occurrence of the sequence's last n tokens, n from
prompt_lookup_max down to prompt_lookup_min, in prompt + output, and propose the tokens that
followed it. Drafts are deterministic, so the verifier treats them as one-hot.
"""

from __future__ import annotations

import numpy as np
import torch

from specdecode.speculative.propose.proposer import Draft, ProposerBase, ProposerContext
from specdecode.speculative.propose.registry import register


def find_continuation(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the last n tokens (longest n first)."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pattern = tokens[L - n:]
        # windows[i] = tokens[i : i + n] for every start i whose window ends before the suffix.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: L - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start: start + k].tolist()
    return []


@register("ngram")
class NgramProposer(ProposerBase):
    draft_cost_prior = 0.02  # a host-side lookup

    def __init__(self, ctx: ProposerContext):
        super().__init__(ctx)
        self.n_min = ctx.config.prompt_lookup_min
        self.n_max = ctx.config.prompt_lookup_max

    def propose(self, seqs, max_tokens, sampling, stop=None) -> Draft:
        k = max(max_tokens)
        token_ids = torch.full((len(seqs), k), -1, dtype=torch.long)
        num = torch.zeros(len(seqs), dtype=torch.long)
        for b, (seq, limit) in enumerate(zip(seqs, max_tokens)):
            if limit == 0:
                continue
            cont = find_continuation(np.asarray(seq.token_ids, dtype=np.int64), self.n_min, self.n_max, limit)
            token_ids[b, : len(cont)] = torch.tensor(cont, dtype=torch.long)
            num[b] = len(cont)
        return Draft(token_ids.to(self.device), num.to(self.device))
