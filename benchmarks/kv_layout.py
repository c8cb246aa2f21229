"""The KV cache's storage against an alternative, in one engine: `--compare layout` (default) the head-major
storage (models/llama.py `KVCache`) against the row-major one it replaced; `--compare int8` an int8 cache
(`kv_cache_dtype="int8"`: records of int8 values and a scale per token and KV head) against the served
dtype's.

One plain engine; between measurements its cache tensors are swapped between the two arms (the default:
head-major storage seen as [slots, columns, KV heads, D], or the engine's own served-dtype cache; the
other: row-major tensors of the same shape, or an int8 cache), so both arms run the same model instance,
interleaved. Two measurements:

- forwards: decode steps of `--concurrency` sequences (one new token each) over a context of each
  `--contexts` length (every sequence prefilled to it in each arm), medians of `--steps` steps, `--rounds`
  rounds alternating the order, and an A/A control (the first arm against itself);
- generation (`--max-tokens` > 0): HumanEval prompts decoded greedily to `--max-tokens` tokens at that
  concurrency, rounds alternating the arms; output tok/s of each (wall time, prompts included) and
  whether both decoded the same tokens (an int8 cache decodes its own: the share of equal tokens).

    python benchmarks/kv_layout.py --quantization w4a8 --concurrency 4 --max-tokens 512
    python benchmarks/kv_layout.py --compare int8 --quantization w4a8 --concurrency 4 --max-tokens 512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode import LLM, SamplingParams
from specdecode.bench.prompts import load_prompts
from specdecode.engine.ragged import ForwardEntry
from specdecode.models.llama import KVCache


# --compare -> the arms' names: (the measured arm, the baseline, the measured arm again)
ARMS = {"layout": ("head-major", "row-major", "head-major (A/A)"),
        "int8": ("int8", "served dtype", "int8 (A/A)")}


def row_major(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros(t.shape, dtype=t.dtype) for t in tensors]


def cache_arms(llm: LLM, compare: str) -> tuple[tuple, tuple]:
    """(measured, baseline): each arm's per-layer K and V tensor lists."""
    cache = llm.runner.kv_cache
    own = (list(cache.k), list(cache.v))
    if compare == "layout":
        return own, (row_major(cache.k), row_major(cache.v))
    int8 = KVCache(llm.model.config, cache.num_slots, cache.max_len, torch.int8, llm.runner.device)
    return (int8.k, int8.v), own


def share_equal(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", choices=tuple(ARMS), default="layout",
                        help="layout: head-major against row-major storage; int8: an int8 cache against the served "
                        "dtype's (default layout)")
    parser.add_argument("--dtype", default="auto", help="the served dtype (default auto: bf16 on CPUs with AVX-512 "
                        "BF16 or AMX, else float32)")
    parser.add_argument("--quantization", default=None, help="w4a8, w8a8, int8, int4 (default: none, the dtype's)")
    parser.add_argument("--concurrency", type=int, default=4, help="sequences in flight (default 4)")
    parser.add_argument("--contexts", default="16,150,300,600,900", help="context lengths of the forwards")
    parser.add_argument("--steps", type=int, default=150, help="decode forwards per measurement (default 150)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per arm, alternating (default 4)")
    parser.add_argument("--max-tokens", type=int, default=0, help="also generate this many tokens a prompt (0: no)")
    parser.add_argument("--num-prompts", type=int, default=16)
    args = parser.parse_args()

    llm = LLM(dtype=args.dtype, quantization=args.quantization, max_num_seqs=args.concurrency)
    runner, cache = llm.runner, llm.runner.kv_cache
    names = ARMS[args.compare]
    measured, baseline = cache_arms(llm, args.compare)
    arms = dict(zip(names, [measured, baseline, measured]))

    def use(arm: str) -> None:
        cache.k[:], cache.v[:] = arms[arm]

    R = args.concurrency
    new, old, _ = names
    print(f"{str(llm.dtype).replace('torch.', '')} activations, weights {args.quantization or 'unquantised'}; "
          f"decode forward of {R} sequences, median us ({args.steps} steps x {args.rounds} rounds a cell)")
    print(f"| context | {old} | {new} | {new} / {old} | A/A |")
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
        head, row, same = (statistics.median(times[a]) for a in names)
        print(f"| {ctx} | {1e6 * row:.0f} | {1e6 * head:.0f} | {head / row:.3f} | {same / head:.3f} |")
    use(old)
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
    use(old)
    head, row, same = (statistics.median(rates[a]) for a in names)
    print(f"\ngeneration: {args.num_prompts} prompts x {args.max_tokens} tokens, {R} in flight, output tok/s "
          f"(wall, median of {args.rounds} rounds)")
    print(f"{old} {row:.1f}, {new} {head:.1f}: {head / row:.3f}x (A/A {same / head:.3f}x); "
          f"same tokens: {tokens[old] == tokens[new]} ({share_equal(tokens[new], tokens[old]):.1%} of positions)")


if __name__ == "__main__":
    main()
