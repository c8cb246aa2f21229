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
