"""The KV cache's head-major storage (models/llama.py `KVCache`) against the row-major one it replaced.

One plain engine; between measurements its cache tensors are swapped between the default (head-major
storage seen as [slots, columns, KV heads, D]) and row-major tensors of the same shape, so both arms run
the same model instance, interleaved. Two measurements:

- forwards: decode steps of `--concurrency` sequences (one new token each) over a context of each
  `--contexts` length (every sequence prefilled to it in each arm), medians of `--steps` steps, `--rounds`
  rounds alternating the order, and an A/A control (head-major against itself);
- generation (`--max-tokens` > 0): HumanEval prompts decoded greedily to `--max-tokens` tokens at that
  concurrency, rounds alternating the arms; output tok/s of each (wall time, prompts included) and
  whether both decoded the same tokens.

    python benchmarks/kv_layout.py --quantization w4a8 --concurrency 4 --max-tokens 512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode import LLM, SamplingParams
from specdecode.bench.prompts import load_prompts
from specdecode.engine.ragged import ForwardEntry


ARMS = ("head-major", "row-major", "head-major (A/A)")


def row_major(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros(t.shape, dtype=t.dtype) for t in tensors]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default=None, help="w4a8, w8a8, int8, int4 (default: none, bf16)")
    parser.add_argument("--concurrency", type=int, default=4, help="sequences in flight (default 4)")
    parser.add_argument("--contexts", default="16,150,300,600,900", help="context lengths of the forwards")
    parser.add_argument("--steps", type=int, default=150, help="decode forwards per measurement (default 150)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per arm, alternating (default 4)")
    parser.add_argument("--max-tokens", type=int, default=0, help="also generate this many tokens a prompt (0: no)")
    parser.add_argument("--num-prompts", type=int, default=16)
    args = parser.parse_args()

    llm = LLM(quantization=args.quantization, max_num_seqs=args.concurrency)
    runner, cache = llm.runner, llm.runner.kv_cache
    arms = dict(zip(ARMS, [(list(cache.k), list(cache.v)), (row_major(cache.k), row_major(cache.v)),
                           (list(cache.k), list(cache.v))]))

    def use(arm: str) -> None:
        cache.k[:], cache.v[:] = arms[arm]

    R = args.concurrency
    print(f"decode forward of {R} sequences, median us ({args.steps} steps x {args.rounds} rounds a cell)")
    print("| context | row-major | head-major | head-major / row-major | A/A |")
    print("| --- | --- | --- | --- | --- |")
    for ctx in [int(c) for c in args.contexts.split(",")]:
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for r in range(args.rounds):
            for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                use(arm)
                for s in range(R):  # every arm's cache holds the same prompt
                    runner.forward([ForwardEntry(s, [(7 * i + s) % 8000 + 3 for i in range(ctx)], start=0)])
                entries = [ForwardEntry(s, [5], start=ctx) for s in range(R)]
                for _ in range(10):
                    runner.forward(entries, argmax=True)
                steps = []
                for _ in range(args.steps):
                    start = time.perf_counter()
                    runner.forward(entries, argmax=True)
                    steps.append(time.perf_counter() - start)
                times[arm].append(statistics.median(steps))
        head, row, same = (statistics.median(times[a]) for a in ARMS)
        print(f"| {ctx} | {1e6 * row:.0f} | {1e6 * head:.0f} | {head / row:.3f} | {same / head:.3f} |")
    use("head-major")
    if args.max_tokens <= 0:
        return

    prompts = load_prompts("humaneval", args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:R], SamplingParams(temperature=0, max_tokens=8))
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    tokens: dict[str, list] = {}
    for r in range(args.rounds):
        for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            use(arm)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            rates[arm].append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start))
            tokens[arm] = [o.token_ids for o in outputs]
    use("head-major")
    head, row, same = (statistics.median(rates[a]) for a in ARMS)
    print(f"\ngeneration: {args.num_prompts} prompts x {args.max_tokens} tokens, {R} in flight, output tok/s "
          f"(wall, median of {args.rounds} rounds)")
    print(f"row-major {row:.1f}, head-major {head:.1f}: {head / row:.3f}x (A/A {same / head:.3f}x); "
          f"same tokens: {tokens['row-major'] == tokens['head-major']}")


if __name__ == "__main__":
    main()
