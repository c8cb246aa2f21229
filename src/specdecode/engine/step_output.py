"""What one engine step did to each of its sequences; the scheduler applies it in one place."""

from __future__ import annotations

import dataclasses

from specdecode.engine.sequence import Sequence


@dataclasses.dataclass(slots=True)
class StepOutput:
    """The result of a prefill, a plain decode step or a speculative step.

    Nothing in a step changes sequence state: `Scheduler.postprocess` advances each cache
    length, appends the tokens (stopping at a stop condition), records speculative stats and
    finishes sequences.
    """

    seqs: list[Sequence]
    token_ids: list[list[int]]  # per sequence: the tokens it commits, in order
    num_cached: list[int]  # per sequence: tokens this step added to the target's KV cache
    # Speculative steps only: draft tokens verified / accepted per sequence, and the step's
    # drafting and verification seconds (shared by the batch, split evenly).
    num_draft: list[int] | None = None
    num_accepted: list[int] | None = None
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @classmethod
    def empty(cls) -> "StepOutput":
        return cls([], [], [])

    @classmethod
    def merge(cls, parts: list["StepOutput"]) -> "StepOutput":
        """One output of steps run on disjoint parts of a batch (a failed step retried on its
        halves); their seconds add up, shared evenly as for one step."""
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return cls.empty()

        def joined(field: str) -> list:
            return [x for part in parts for x in getattr(part, field)]

        speculative = parts[0].num_draft is not None  # the parts are steps of one kind
        return cls(joined("seqs"), joined("token_ids"), joined("num_cached"),
                   joined("num_draft") if speculative else None, joined("num_accepted") if speculative else None,
                   sum(part.draft_seconds for part in parts), sum(part.verify_seconds for part in parts))
