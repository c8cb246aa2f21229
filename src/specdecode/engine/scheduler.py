"""Continuous batching in plain Python: admission into KV slots, finishing, stop checks.

Memory is bounded by construction: the cache has `num_slots` rows of `max_len` columns and
each running sequence owns one row, so a request that finds no free slot waits in the
queue; nothing is evicted, nothing is corrupted. A step is either a prefill of newly
admitted sequences or a decode (plain or speculative) of all running ones.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time

from specdecode.engine.sequence import Sequence, SequenceStatus
from specdecode.engine.step_output import StepOutput
from specdecode.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class ScheduledBatch:
    prefill: list[Sequence]  # newly admitted: their whole prompt goes through the target
    decode: list[Sequence]  # running: one decode (or speculative) step each

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, num_slots: int, tokenizer: Tokenizer):
        self.num_slots = num_slots
        self.tokenizer = tokenizer
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(num_slots))  # kept sorted: low slots first keeps batches contiguous

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        admitted = []
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop(0)
            seq.status = SequenceStatus.RUNNING
            admitted.append(seq)
        if admitted:
            self.running.extend(admitted)
            self.running.sort(key=lambda s: s.slot)
            return ScheduledBatch(prefill=admitted, decode=[])
        return ScheduledBatch(prefill=[], decode=list(self.running))

    def postprocess(self, out: StepOutput) -> list[tuple[Sequence, Exception]]:
        """Apply a step to its sequences: cache lengths, speculative stats, tokens, stops.
        Returns the sequences whose update raised, with the exception (the engine finishes them
        with an error); every other sequence is applied as usual."""
        share = 1.0 / max(1, len(out.seqs))
        failed = []
        for b, seq in enumerate(out.seqs):
            try:
                seq.num_cached += out.num_cached[b]
                if out.num_draft is not None:
                    seq.stats.observe(out.num_draft[b], out.num_accepted[b])
                    seq.stats.draft_time += out.draft_seconds * share
                    seq.stats.verify_time += out.verify_seconds * share
                if out.prompt_logprobs is not None and out.prompt_logprobs[b] is not None:
                    seq.prompt_logprobs = out.prompt_logprobs[b]
                self.append_tokens(seq, out.token_ids[b], None if out.logprobs is None else out.logprobs[b])
            except Exception as error:
                log.exception("request %s: applying its step failed", seq.request_id)
                failed.append((seq, error))
        return failed

    def append_tokens(self, seq: Sequence, new_token_ids: list[int], logprobs: list | None = None) -> list[int]:
        """Append tokens one by one until a stop condition; returns the tokens kept. A
        constrained sequence's grammar commits each kept token (and a grammar that is complete
        stops the sequence); logprobs, when given, come one per token."""
        kept = []
        if seq.first_token_time is None and new_token_ids:
            seq.first_token_time = time.perf_counter()
        for i, token in enumerate(new_token_ids):
            if seq.grammar is not None:
                seq.grammar.consume(token)
            seq.output_token_ids.append(token)
            if logprobs is not None and seq.logprobs is not None:
                seq.logprobs.append(logprobs[i])
            kept.append(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
                break
        return kept

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if not params.ignore_eos and token in seq.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if params.stop and self._find_stop_string(seq):
            return "stop"
        if seq.grammar is not None and seq.grammar.is_stopped:
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= seq.max_len:
            return "length"
        return None

    def _find_stop_string(self, seq: Sequence) -> bool:
        """Whether the output text now holds a stop string; if so `seq.stop_text_len` is where
        the first one starts. Only text after what earlier searches cleared can hold a new one:
        the search starts (longest stop - 1) characters before the cleared end, whatever length
        of text the last token added. A trailing U+FFFD (a multi-byte character still
        incomplete) may still change, so it is searched but never counted as cleared."""
        text = seq.output_text.of(self.tokenizer, seq.output_token_ids)
        stops = seq.params.stop
        start = max(0, min(seq.stop_checked_chars, len(text)) - (max(len(s) for s in stops) - 1))
        found = [at for at in (text.find(s, start) for s in stops) if at != -1]
        if found:
            seq.stop_text_len = min(found)
            return True
        seq.stop_checked_chars = len(text.rstrip("\ufffd"))
        return False

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            self.free_slots.sort()
            seq.slot = None

    def find(self, request_id: str) -> Sequence | None:
        """The waiting or running sequence of this request, if any."""
        return next((seq for seq in itertools.chain(self.waiting, self.running) if seq.request_id == request_id), None)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.find(request_id)
        if seq is not None:
            if seq in self.waiting:
                self.waiting.remove(seq)
            self.finish(seq, "abort")
        return seq
