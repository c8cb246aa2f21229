"""Per-sequence buffer of the target's features that a drafter has not consumed yet.

Drafters that read the target's hidden states (EAGLE family, DFlash) get them from the
target forwards the engine runs anyway: the prefill (every prompt position) and each verify
(the last committed token and the accepted drafts, or the accepted tree path). The features
wait in `seq.drafter_state["features"]` (a list of [T_i, *] chunks, concatenated once when the
next proposal consumes them: a step that does not draft pays one slice per sequence, not a copy
of everything pending).
"""

from __future__ import annotations

import torch

from specdecode.spec.proposer import ProposerBase


class TargetFeatureBuffer(ProposerBase):
    def target_features(self, result) -> torch.Tensor:
        """[B, T, *] the drafter's raw input per position of a target forward."""
        raise NotImplementedError

    def on_prefill(self, seqs, result) -> None:
        raw = self.target_features(result)
        for b, seq in enumerate(seqs):
            seq.drafter_state["features"] = [raw[b, : len(seq.prompt_token_ids)]]
            seq.drafter_state["draft_cached"] = 0

    def on_commit(self, seqs, draft, verified, result) -> None:
        raw = self.target_features(result)
        accepted = verified.num_accepted.tolist()
        path = verified.path.tolist() if verified.path is not None else None
        for b, seq in enumerate(seqs):
            # The last committed token and the accepted drafts (tree: the nodes along the path).
            if path is None:
                new = raw[b, : 1 + accepted[b]]  # a view: chains accept a prefix
            else:
                new = raw[b, [0] + [1 + i for i in path[b][: accepted[b]]]]
            seq.drafter_state.setdefault("features", []).append(new)

    def pending_tokens(self, seq) -> int:
        return seq.num_tokens - 1 - seq.drafter_state.get("draft_cached", 0)

    def take_pending(self, seq) -> tuple[int, torch.Tensor]:
        """(first position not consumed, its features .. position N-2); marks them consumed."""
        cached = seq.drafter_state["draft_cached"]
        chunks = seq.drafter_state.pop("features")
        seq.drafter_state["draft_cached"] = seq.num_tokens - 1
        return cached, chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def release(self, seq) -> None:
        seq.drafter_state.pop("features", None)
