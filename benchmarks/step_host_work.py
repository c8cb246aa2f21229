"""Host work between a speculative engine's forwards against a plain engine's, in one process.

A plain engine and a speculative one (`--speculative-config`) decode the same prompts, round by round,
the engine that goes first alternating between rounds (the second engine of a round measured slower
forwards here: which one goes first must not decide the comparison). Per decode step of the target
(forwards of one new token a sequence, prefill apart) it reports the forward's time and the host gap
before it (from the end of the previous decode forward to this one's start: sampling, the depth
policy, the drafter's commit, the engine's bookkeeping), and the decode time per step; a speculative
engine whose policy declines to draft then spends its difference in that gap. Steps that drafted are
counted apart (their forwards verify several tokens a sequence) and excluded from both figures.

    python benchmarks/step_host_work.py --quantization w4a8 --concurrency 4 \\
        --speculative-config '{"method": "eagle3", "num_speculative_tokens": 4, "verify_pruning": "dcut"}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from specdecode import LLM, SamplingParams
from specdecode.bench.prompts import load_prompts


class StepClock:
    """Times an engine's one-token-a-sequence target forwards and the host gaps between consecutive ones."""

    def __init__(self, runner) -> None:
        self.reset()
        forward = runner.forward

        def timed(entries, *args, **kwargs):
            start = time.perf_counter()
            out = forward(entries, *args, **kwargs)
            end = time.perf_counter()
            if all(len(e.token_ids) == 1 for e in entries):
                self.forward_seconds += end - start
                self.steps += 1
                if self._last_end is not None:
                    self.gap_seconds += start - self._last_end
                self._last_end = end
            else:  # a prefill or a verification: the next decode forward's gap is not a declined step's
                if any(e.start > 0 for e in entries):
                    self.verifications += 1
                else:
                    self.prefill_seconds += end - start
                self._last_end = None
            return out

        runner.forward = timed

    def reset(self) -> None:
        self.forward_seconds, self.gap_seconds, self.prefill_seconds = 0.0, 0.0, 0.0
        self.steps, self.verifications = 0, 0
        self._last_end: float | None = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default=None, help="w4a8, w8a8, int8, int4 (default: none, bf16)")
    parser.add_argument("--concurrency", type=int, default=4, help="sequences in flight (default 4)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6, help="rounds, each engine once a round (default 6)")
    parser.add_argument("--speculative-config", required=True, help="JSON, as `specdecode generate` takes it")
    args = parser.parse_args()

    prompts = load_prompts("humaneval", args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {"plain": LLM(quantization=args.quantization, max_num_seqs=args.concurrency),
               "speculative": LLM(quantization=args.quantization, max_num_seqs=args.concurrency,
                                  speculative_config=json.loads(args.speculative_config))}
    clocks = {name: StepClock(llm.runner) for name, llm in engines.items()}
    for llm in engines.values():  # warm-up: kernels built, caches and the policy's prices settled
        llm.generate(prompts[: 2 * args.concurrency], params)
    per_round: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    prefill: dict[str, list[float]] = {name: [] for name in engines}  # seconds of prompt forwards per round
    wall: dict[str, list[float]] = {name: [] for name in engines}  # seconds of each round's generate()
    outputs: dict[str, list] = {}
    drafted: list[int] = []  # the speculative engine's verification forwards per round
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for name in order:
            clock = clocks[name]
            clock.reset()
            start = time.perf_counter()
            outputs[name] = [o.token_ids for o in engines[name].generate(prompts, params)]
            wall[name].append(time.perf_counter() - start)
            steps = max(1, clock.steps)
            per_round[name].append((clock.forward_seconds / steps, clock.gap_seconds / steps))
            prefill[name].append(clock.prefill_seconds)
            if name == "speculative":
                drafted.append(clock.verifications)
    same = outputs["plain"] == outputs["speculative"]
    for name in engines:
        forward = statistics.median(f for f, _ in per_round[name])
        gap = statistics.median(g for _, g in per_round[name])
        print(f"{name:12s} forward {1e3 * forward:.3f} ms, host gap {1e6 * gap:.1f} us, "
              f"step {1e3 * (forward + gap):.3f} ms; prompt forwards {statistics.median(prefill[name]):.3f} s, "
              f"generate() {statistics.median(wall[name]):.3f} s a round (medians of {args.rounds} rounds)")
    plain_gap = statistics.median(g for _, g in per_round["plain"])
    spec_gap = statistics.median(g for _, g in per_round["speculative"])
    print(f"host gap, speculative - plain: {1e6 * (spec_gap - plain_gap):.1f} us a step; "
          f"verifications (drafting steps) per round: {drafted}; same tokens: {same}")


if __name__ == "__main__":
    main()
