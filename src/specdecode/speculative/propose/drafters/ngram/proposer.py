"""`ngram`: prompt lookup decoding (model-free).

Find the most recent earlier occurrence of the sequence's last n tokens, n from
prompt_lookup_max down to prompt_lookup_min, in prompt + output, and propose the tokens that
followed it. Drafts are deterministic, so the verifier treats them as one-hot.

Where that occurrence overlaps or abuts the last n tokens (it ends p <= n tokens before them),
the sequence has just repeated a block of p tokens, and what followed the occurrence is that
block, cut short by the sequence's end: the draft then follows the loop to k tokens, as
llama.cpp's lookup does by drafting each token from the n-gram before it. A draft that stopped
at the sequence's end proposed at most p tokens a step: on the default model's greedy HumanEval
outputs, which loop, 57% of the drafts (k=8) were 2 tokens long.

Each request keeps an index of its n-grams (like llama.cpp's n-gram cache), extended by the
tokens committed since its last proposal: a lookup is a few dictionary probes, where scanning
the whole sequence for every n each step cost ~0.15 ms a step at batch 1 (a third of a W4A8
decoding step), most of it on the steps that find no match.
"""

from __future__ import annotations

import dataclasses

from specdecode.speculative.propose.proposer import Draft, ProposerBase, ProposerContext
from specdecode.speculative.propose.registry import register


@dataclasses.dataclass(slots=True)
class NgramIndex:
    """One request's n-grams (n_min..n_max tokens) -> the position where their latest occurrence
    ends, over the n-grams ending before `indexed`."""

    last_end: dict[tuple[int, ...], int] = dataclasses.field(default_factory=dict)
    indexed: int = 0

    def continuation(self, tokens: list[int], n_min: int, n_max: int, k: int, follow_loops: bool = True) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the last n tokens (longest n
        first), continued around the loop where the match ends p <= n tokens before the last token
        (unless not `follow_loops`). "Earlier": the match ends before the last token (the suffix is
        not its own match)."""
        L = len(tokens)
        if self.indexed > L:  # the tokens are not an extension of what was indexed
            self.last_end.clear()
            self.indexed = 0
        last_end = self.last_end
        for end in range(self.indexed, L - 1):  # the n-grams ending at `end`, up to the one before the last token
            for n in range(n_min, min(n_max, end + 1) + 1):
                last_end[tuple(tokens[end + 1 - n: end + 1])] = end
        self.indexed = max(self.indexed, L - 1)
        for n in range(min(n_max, L - 1), n_min - 1, -1):
            end = last_end.get(tuple(tokens[L - n:]))
            if end is not None:
                draft = tokens[end + 1: end + 1 + k]
                period = L - 1 - end  # draft == tokens[end + 1:], one period, when it ran into the end
                if follow_loops and len(draft) < k and period <= n:  # the last n + period tokens repeat with this period
                    draft = (draft * -(-k // period))[:k]
                return draft
        return []


@register("ngram")
class NgramProposer(ProposerBase[NgramIndex]):
    draft_cost_prior = 0.02  # a host-side lookup
    state_type = NgramIndex

    def __init__(self, ctx: ProposerContext):
        super().__init__(ctx)
        self.n_min = ctx.config.prompt_lookup_min
        self.n_max = ctx.config.prompt_lookup_max
        self.follow_loops = True  # False: drafts stop at the sequence's end (benchmarks/ngram_loops.py)

    def propose(self, seqs, max_tokens, sampling, stop=None) -> Draft:
        k = max(max_tokens)
        rows = []  # [B][k] drafts padded with -1
        nums = []
        for seq, limit in zip(seqs, max_tokens):
            cont = (self.state(seq).continuation(seq.token_ids, self.n_min, self.n_max, limit, self.follow_loops)
                    if limit > 0 else [])
            rows.append(cont + [-1] * (k - len(cont)))
            nums.append(len(cont))
        return Draft.from_host(rows, nums, self.device)
