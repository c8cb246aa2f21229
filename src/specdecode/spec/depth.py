"""Draft-depth policies: how many tokens each sequence may draft this step.

- constant: k every step;
- heuristic: Hugging Face's `num_assistant_tokens_schedule="heuristic"`: +2 after a step
  whose drafts were all accepted, else -1, never below 1 (and never above k here);
- draft_n_min (llama.cpp): a draft shorter than n_min is dropped and the step decodes
  normally. draft_p_min acts inside the drafting loop of the proposers that have
  probabilities (see drafters/draft_model.py).
"""

from __future__ import annotations

from specdecode.config import SpeculativeConfig
from specdecode.engine.sequence import Sequence


class DraftLengthPolicy:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.schedule = config.draft_length_schedule
        self.n_min = config.draft_n_min

    def limits(self, seqs: list[Sequence]) -> list[int]:
        """Per sequence: the most draft tokens it may use (also bounded by its remaining room:
        a step commits accepted + 1 tokens, so at most room - 1 drafts are useful)."""
        out = []
        for seq in seqs:
            k = seq.drafter_state.get("schedule_k", self.k) if self.schedule == "heuristic" else self.k
            out.append(max(0, min(k, seq.room - 1)))
        return out

    def apply_n_min(self, num_tokens: list[int]) -> list[int]:
        return [0 if n < self.n_min else n for n in num_tokens]

    def update(self, seqs: list[Sequence], num_draft: list[int], num_accepted: list[int]) -> None:
        if self.schedule != "heuristic":
            return
        for seq, n, a in zip(seqs, num_draft, num_accepted):
            if n == 0:
                continue
            k = seq.drafter_state.get("schedule_k", self.k)
            seq.drafter_state["schedule_k"] = min(self.k, k + 2) if a == n else max(1, k - 1)
