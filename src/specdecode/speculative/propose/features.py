"""Per-request buffer of the target's features that a drafter has not consumed yet.

Drafters that read the target's hidden states (EAGLE family, DFlash, DSpark) get them from
the target forwards the engine runs anyway: the prefill (every prompt position) and each
verify (the last committed token and the accepted drafts, or the accepted tree path). The
features wait in the request's `FeatureState` as a list of chunks, each a row of one forward's
features and which of its positions count, sliced and concatenated once when the next
proposal consumes them: a step that does not draft appends one tuple per sequence (slicing
each step cost ~3 us a sequence in the engine: 50 of the 205 us a step of EAGLE-3 cost beyond
plain decoding's at 16 in flight while its policy declined to draft).

Drafter position t takes (token t+1, feature t), so of a sequence of N tokens the positions
0 .. N-2 can be consumed: `num_cached` counts those held in the drafter's own cache.
"""

from __future__ import annotations

import dataclasses

import torch

from specdecode.speculative.propose.proposer import ProposerBase


@dataclasses.dataclass(slots=True)
class FeatureState:
    num_cached: int = 0  # drafter positions 0 .. num_cached-1 are in the drafter's cache
    # Raw features of later positions, in order: (raw [B, T, *] of one forward, row b, positions:
    # the first n (an int) or these indices (a list)).
    features: list[tuple[torch.Tensor, int, int | list[int]]] = dataclasses.field(default_factory=list)
    # Recorded by `take_pending` in this step's proposal, applied by `on_commit` (dropped by
    # `rollback`): (the first `taken_chunks` chunks of `features` were consumed, num_cached then).
    taken: tuple[int, int] | None = None


class TargetFeatureBuffer(ProposerBase[FeatureState]):
    state_type = FeatureState

    def target_features(self, result) -> torch.Tensor:
        """[B, T, *] the drafter's raw input per position of a target forward: the final-normed hidden state,
        or the tapped layers concatenated in `hidden_taps` order (`ForwardResult.features`: the C++ forward's
        own block, where it made one)."""
        return result.features(self.hidden_taps) if self.hidden_taps else result.hidden

    def on_prefill(self, seqs, result) -> None:
        raw = self.target_features(result)
        for b, seq in enumerate(seqs):
            self._states[seq.request_id] = FeatureState(0, [(raw, b, len(seq.prompt_token_ids))])

    def on_commit(self, seqs, draft, verified, result) -> None:
        raw = self.target_features(result)
        accepted = verified.host()[1]
        path = verified.path.tolist() if verified.path is not None else None
        # The last committed token and the accepted drafts (tree: the nodes along the path).
        new = [(raw, b, 1 + a) if path is None else (raw, b, [0] + [1 + i for i in path[b][:a]])
               for b, a in enumerate(accepted)]
        for seq, features in zip(seqs, new):  # nothing above changed any state
            state = self.state(seq)
            if state.taken is not None:
                num_chunks, state.num_cached = state.taken
                del state.features[:num_chunks]
                state.taken = None
            state.features.append(features)

    def rollback(self, seqs) -> None:
        for seq in seqs:
            state = self._states.get(seq.request_id)
            if state is not None:
                state.taken = None

    def pending_tokens(self, seq) -> int:
        state = self._states.get(seq.request_id)
        return seq.num_tokens - 1 - (state.num_cached if state is not None else 0)

    def take_pending(self, seq) -> tuple[int, torch.Tensor]:
        """(first position not consumed, its features .. position N-2). They count as consumed
        once the step commits (`on_commit`); a step that fails leaves them pending."""
        state = self.state(seq)
        chunks = [raw[b, :positions] if isinstance(positions, int) else raw[b, positions]
                  for raw, b, positions in state.features]
        state.taken = (len(chunks), seq.num_tokens - 1)
        return state.num_cached, chunks[0] if len(chunks) == 1 else torch.cat(chunks)
