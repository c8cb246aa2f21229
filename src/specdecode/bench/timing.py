"""Paired, interleaved timing of `specdecode bench` and the bootstrap interval of a speedup.

The prompts are cut into rounds (a multiple of the concurrency, at least `ROUND_PROMPTS`
prompts), and each round runs every method back to back, in an order that rotates from round
to round. A slow phase of a shared machine (measured here: the same work varies by 10-25%
over tens of seconds) then lands on every method alike. Speedup = total baseline wall time /
total method wall time over all rounds (the same work), with a 90% bootstrap interval over
rounds, resampled in pairs (a round's baseline time with the same round's method time).
"""

from __future__ import annotations

import dataclasses
import random
import time

from specdecode.config import SamplingParams
from specdecode.engine.engine import LLM
from specdecode.speculative.stats import SpecStats

ROUND_PROMPTS = 8  # prompts per timing round at low concurrency (a round at concurrency 1 lasts a few seconds)


@dataclasses.dataclass(slots=True)
class Measured:
    round_seconds: list[float]  # wall seconds of every timed round, repeats x rounds, in order
    outputs: list  # the last pass's outputs, in prompt order (its stats stay in llm.stats)
    # Per round: the requests' seconds from their first token to their last (prefill and queueing
    # left out). At concurrency 1 the requests run one after another, so this is the round's decode time.
    decode_seconds: list[float] = dataclasses.field(default_factory=list)


def rounds_of(num_prompts: int, concurrency: int) -> list[range]:
    """Prompt ranges of the timing rounds: whole batches of `concurrency`, >= ROUND_PROMPTS prompts."""
    size = concurrency * max(1, -(-ROUND_PROMPTS // concurrency))
    return [range(i, min(i + size, num_prompts)) for i in range(0, num_prompts, size)]


def measure_interleaved(llms: list[LLM], prompts: list, params: list[SamplingParams], repeats: int,
                        concurrency: int = 1, on_run=lambda: None, warm: bool = True) -> list[Measured]:
    """Time every engine on the same rounds of prompts, round by round: engines A, B, C on
    round 1, then B, C, A on round 2, ... (`repeats` passes over all rounds). warm=False: the
    engines have run these prompts already (no warm-up)."""
    for llm in llms if warm else []:  # warm-up (allocations, caches, and with compile=True every kind of step compiled)
        warm_up(llm, [prompts[i % len(prompts)] for i in range(max(1, concurrency))])
        # Every prompt's prefill once: oneDNN builds (and caches, process-wide) a primitive per new
        # matmul shape, which cost the first engine timed on a prompt length, and only it, that once.
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    rounds = rounds_of(len(prompts), concurrency)
    measured = [Measured([], []) for _ in llms]
    turn = 0
    for _ in range(repeats):
        for llm, m in zip(llms, measured):
            llm.stats, m.outputs = SpecStats(), []  # stats and outputs of the last pass only
        for idx in rounds:
            for i in [(turn + j) % len(llms) for j in range(len(llms))]:
                start = time.perf_counter()
                outs = llms[i].generate([prompts[j] for j in idx], [params[j] for j in idx])
                measured[i].round_seconds.append(time.perf_counter() - start)
                measured[i].decode_seconds.append(sum(decode_seconds(o) for o in outs))
                measured[i].outputs += outs
                on_run()
            turn += 1
    return measured


# Prompt processing passes per decode pass: one is ~1/50 of a decode pass at 128 new tokens, so more of
# them keep its timing rounds from being a few tens of milliseconds each.
PREFILL_PASSES = 4


def measure_prefill(llms: list[LLM], prompt_ids: list[list[int]], repeats: int) -> list[Measured]:
    """Prompt processing at batch 1: every prompt (as token ids: no tokenizer in the timing) run
    for one token, one request at a time, in the interleaved rounds of `measure_interleaved`,
    `PREFILL_PASSES` x `repeats` passes. What a round times is the engine's whole first step: the
    prompt's forward, sampling its first token and the request's bookkeeping."""
    one_token = [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)] * len(prompt_ids)
    return measure_interleaved(llms, [{"prompt_token_ids": ids} for ids in prompt_ids], one_token,
                               PREFILL_PASSES * repeats, concurrency=1, warm=False)


def decode_seconds(output) -> float:
    """A finished request's seconds from its first token to its last."""
    metrics = output.metrics
    if metrics.time_to_first_token is None or metrics.e2e_latency is None:
        return 0.0
    return metrics.e2e_latency - metrics.time_to_first_token


WARM_UP_PASSES = 6  # compiled engines: at most this many passes before timing


def warm_up(llm: LLM, prompts: list[str]) -> None:
    """Run `llm` on `prompts` until nothing is left to compile: every kind of step a timed run can
    take (batch 1 or more; drafting steps, and plain 1-token steps, which a speculative engine
    takes only when no room is left to draft: max_tokens=2), repeated while a pass still compiled
    a new graph, so no compilation lands in a timed round."""
    kinds = [(prompts, 32), (prompts, 2), (prompts[:1], 32), (prompts[:1], 2)]
    if not llm.config.compile:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        return
    from torch._dynamo.utils import counters

    for _ in range(WARM_UP_PASSES):
        before = counters["stats"]["unique_graphs"]
        for batch, max_tokens in kinds:
            llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        if counters["stats"]["unique_graphs"] == before:
            return


def speedup_interval(baseline: list[float], method: list[float], samples: int = 1000, seed: int = 0) -> tuple[float, float]:
    """90% bootstrap interval of sum(baseline) / sum(method) over paired rounds.

    A percentile interval: both ends are resampled ratios of sums, each a weighted mean of the
    per-round ratios baseline[i] / method[i], so lo <= hi and both lie within the smallest and
    the largest per-round ratio. It need not contain the observed ratio of sums (with few,
    unequal rounds that ratio can sit at an end of the resampled distribution)."""
    rng = random.Random(seed)
    n = len(baseline)
    ratios = []
    for _ in range(samples):
        pick = [rng.randrange(n) for _ in range(n)]
        ratios.append(sum(baseline[i] for i in pick) / sum(method[i] for i in pick))
    ratios.sort()
    return ratios[int(0.05 * samples)], ratios[int(0.95 * samples) - 1]
