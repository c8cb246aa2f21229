"""Per-sequence buffer of the target's features that a drafter has not consumed yet.

Drafters that read the target's hidden states (EAGLE family, DFlash) get them from the
target forwards the engine runs anyway: the prefill (every prompt position) and each verify
(the last committed token and the accepted drafts, or the accepted tree path). The features
wait in `seq.drafter_state["features"]` until the next proposal consumes them.
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
            seq.drafter_state["features"] = raw[b, : len(seq.prompt_token_ids)]
            seq.drafter_state["draft_cached"] = 0

    def on_commit(self, seqs, draft, verified, result) -> None:
        raw = self.target_features(result)
        accepted = verified.num_accepted.tolist()
        path = verified.path.tolist() if verified.path is not None else None
        for b, seq in enumerate(seqs):
            # The last committed token and the accepted drafts (tree: the nodes along the path).
            rows = [0] + ([1 + i for i in path[b][: accepted[b]]] if path is not None else list(range(1, 1 + accepted[b])))
            pending = seq.drafter_state.get("features")
            new = raw[b, rows]
            seq.drafter_state["features"] = new if pending is None else torch.cat([pending, new])

    def take_pending(self, seq) -> tuple[int, torch.Tensor]:
        """(first position not consumed, its features .. position N-2); marks them consumed."""
        cached = seq.drafter_state["draft_cached"]
        features = seq.drafter_state.pop("features")
        seq.drafter_state["draft_cached"] = seq.num_tokens - 1
        return cached, features

    def release(self, seq) -> None:
        seq.drafter_state.pop("features", None)
