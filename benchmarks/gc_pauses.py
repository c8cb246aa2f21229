"""The garbage collector's pauses in an engine process: collections per generation and their time over
a run (gc callbacks), and what one full collection costs with the start-up heap live and frozen
(`specdecode serve` freezes it).

    python benchmarks/gc_pauses.py --num-prompts 164 --max-tokens 64 --max-num-seqs 16
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import time

from specdecode import LLM, SamplingParams
from specdecode.bench.prompts import load_prompts


def full_collection_ms() -> float:
    start = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=164)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--speculative-config", default=None, help="JSON, as `specdecode bench` takes it")
    args = parser.parse_args()

    spec = json.loads(args.speculative_config) if args.speculative_config else None
    llm = LLM(quantization=args.quantization, max_num_seqs=args.max_num_seqs, speculative_config=spec)
    prompts = load_prompts(args.prompts, args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[: args.max_num_seqs], params)  # lazily built state first

    pauses: dict[int, list[float]] = collections.defaultdict(list)
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses[info["generation"]].append((time.perf_counter() - started[0]) * 1e3)

    gc.collect()
    gc.callbacks.append(timed)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    gc.callbacks.remove(timed)
    tokens = sum(len(o.token_ids) for o in outputs)
    print(f"{len(prompts)} prompts, {tokens} tokens in {seconds:.1f} s (max_num_seqs {args.max_num_seqs})")
    for generation in range(3):
        times = pauses.get(generation, [])
        print(f"  generation {generation}: {len(times)} collections, {sum(times):.1f} ms in all, "
              f"longest {max(times, default=0.0):.2f} ms")
    print(f"tracked objects {len(gc.get_objects())}; a full collection {full_collection_ms():.1f} ms live, ", end="")
    gc.freeze()
    print(f"{full_collection_ms():.2f} ms with them frozen ({gc.get_freeze_count()} objects)")
    gc.unfreeze()


if __name__ == "__main__":
    main()
