"""What one engine step did to each of its sequences; the scheduler applies it in one place."""

from __future__ import annotations

import dataclasses

from typing import TYPE_CHECKING

from specdecode.engine.sequence import Sequence

if TYPE_CHECKING:
    from specdecode.logprobs import TokenLogprob


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
    # Per sequence: a TokenLogprob per committed token, or None (the request did not ask).
    logprobs: "list[list[TokenLogprob] | None] | None" = None
    prompt_logprobs: "list[list[TokenLogprob | None] | None] | None" = None  # prefills only

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

        def joined_optional(field: str) -> list | None:  # None in a part: nobody there asked
            if all(getattr(part, field) is None for part in parts):
                return None
            return [x for part in parts for x in (getattr(part, field) or [None] * len(part.seqs))]

        speculative = parts[0].num_draft is not None  # the parts are steps of one kind
        return cls(joined("seqs"), joined("token_ids"), joined("num_cached"),
                   joined("num_draft") if speculative else None, joined("num_accepted") if speculative else None,
                   sum(part.draft_seconds for part in parts), sum(part.verify_seconds for part in parts),
                   joined_optional("logprobs"), joined_optional("prompt_logprobs"))
