"""One request's state: tokens, status, KV slot, grammar, logprobs, per-request metrics. Plain Python, no tensors."""

from __future__ import annotations

import dataclasses
import enum
import time

from typing import TYPE_CHECKING

import torch

from specdecode.config import SamplingParams
from specdecode.speculative.stats import SpecStats
from specdecode.tokenizer import OutputText

if TYPE_CHECKING:
    from specdecode.logprobs import TokenLogprob
    from specdecode.structured import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(slots=True)
class Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_len: int  # prompt + output may not exceed this (KV slot size)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None
    # Tokens whose K/V is in the target cache. Invariant between steps: every token but the
    # last one (which the next forward feeds) is cached, i.e. num_cached == num_tokens - 1.
    num_cached: int = 0
    generator: torch.Generator | None = None
    noise_key: int | None = None  # exact mode, seeded: sampling noise keyed by (seed, position, token)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # finish_reason "error": the exception's type and message
    stop_text_len: int | None = None  # text is cut here when a stop string matched
    # Stop strings: output characters known to hold no whole stop string (they were final,
    # not a trailing U+FFFD of an incomplete UTF-8 sequence, when last searched).
    stop_checked_chars: int = 0
    output_text: OutputText = dataclasses.field(default_factory=OutputText)  # the output's text, kept up to date
    stats: SpecStats = dataclasses.field(default_factory=SpecStats)
    grammar: "GrammarState | None" = None  # structured outputs: the matcher after the committed tokens
    bad_word_ids: list[list[int]] = dataclasses.field(default_factory=list)  # bad_words as token ids
    logprobs: "list[TokenLogprob] | None" = None  # params.logprobs set: one per output token
    prompt_logprobs: "list[TokenLogprob | None] | None" = None  # params.prompt_logprobs set
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def room(self) -> int:
        """How many more tokens this sequence may still produce."""
        return min(self.params.max_tokens - len(self.output_token_ids), self.max_len - self.num_tokens)
