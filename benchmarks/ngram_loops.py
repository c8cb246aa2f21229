"""n-gram drafts that follow a loop past the sequence's end, A / B in one process.

    python benchmarks/ngram_loops.py --quantization w4a8 --prompts humaneval --out benchmarks/results/engine/NAME.json
    python benchmarks/ngram_loops.py --control ...     # an A / A run: both engines follow loops

Engine A's n-gram drafts stop at the sequence's end (as before `NgramIndex.continuation` followed
loops), engine B's follow a loop to k tokens; both at batch 1, k = `--k`, greedy unless `--temperature`, the same prompts
(`--num-prompts` x `--max-tokens`), interleaved prompt by prompt over `--passes` passes so a slow
phase of the machine lands on both. Reports each pass's tok/s (wall, prefill included), A / B time,
the tokens drafted and accepted, and (greedy) whether both engines' outputs equal plain decoding's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specdecode import LLM, SamplingParams
from specdecode.bench.prompts import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default=None, help="the target's weights (w4a8, ...); default: bf16")
    parser.add_argument("--prompts", default="humaneval", help="humaneval, mtbench or a JSONL file")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled (seeded), no equality check")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--control", action="store_true", help="A built as B (an A / A run)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    config = {"method": "ngram", "num_speculative_tokens": args.k}
    plain = LLM(quantization=args.quantization, max_num_seqs=1)
    engines = {name: LLM(quantization=args.quantization, max_num_seqs=1, speculative_config=config) for name in "AB"}
    engines["A"].speculator.proposer.follow_loops = args.control
    params = SamplingParams(temperature=args.temperature, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = load_prompts(args.prompts, args.num_prompts)

    reference = [o.token_ids for o in plain.generate(prompts, params)] if args.temperature == 0 else None
    equal = {name: [o.token_ids for o in engine.generate(prompts, params)] == reference  # also the warm-up
             for name, engine in engines.items()} if reference is not None else None
    del plain
    rows = []
    for i in range(args.passes):
        seconds, drafted, accepted = {n: 0.0 for n in engines}, {n: 0 for n in engines}, {n: 0 for n in engines}
        for prompt in prompts:
            for name, engine in engines.items():
                start = time.perf_counter()
                out = engine.generate([prompt], params)[0]
                seconds[name] += time.perf_counter() - start
                drafted[name] += out.metrics.num_draft_tokens
                accepted[name] += out.metrics.num_accepted_tokens
        tokens = len(prompts) * args.max_tokens
        row = {"a_tok_s": tokens / seconds["A"], "b_tok_s": tokens / seconds["B"],
               "a_over_b_time": seconds["A"] / seconds["B"], "drafted": drafted, "accepted": accepted}
        rows.append(row)
        print(f"pass {i}: A {row['a_tok_s']:.1f} tok/s, B {row['b_tok_s']:.1f} tok/s, A / B time "
              f"{row['a_over_b_time']:.3f}; drafted {drafted}, accepted {accepted}", flush=True)
    ratios = [r["a_over_b_time"] for r in rows]
    print(f"median A / B time {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}); "
          f"outputs equal to plain decoding's: {equal}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "equal_to_plain": equal,
                                        "passes": rows}, indent=1))


if __name__ == "__main__":
    main()
