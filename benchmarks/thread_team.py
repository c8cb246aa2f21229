"""One parallel region a lean forward (kernels/thread_team.h) against one OpenMP region a kernel loop,
in one process: the team is switched (`set_thread_team`) between alternating forwards or requests.

    python benchmarks/thread_team.py --out benchmarks/results/engine/thread_team.json
    python benchmarks/thread_team.py --control      # both arms with the team on: the A / A spread

Forwards: the default model at `--quantization` (float32 activations), `--sequences` sequences in one
forward, each T new tokens at columns 200.. of its own prefilled cache row (`--widths`), `--blocks`
blocks of `--per-block` forwards, the arms alternating forward by forward (the first arm swapped every
block), so the machine's phase drifts hit both arms alike; per arm the block's summed time, and per
block the ratio team / OpenMP. Also the loops a forward ran on the team: 0 where the lean path does not
take the forward (more than 40 query rows of one sequence per KV head), whose arms then run alike.
Decoding (`--methods`, e.g. none,mtp:k=4): HumanEval prompts at batch 1, greedy, the arms
alternating request by request (the first arm swapped every prompt); the decode seconds of each arm
summed, and their ratio per prompt pair. Outputs must match between the arms (the team changes no
result), which the script checks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdecode import LLM, SamplingParams
from specdecode.bench.methods import parse_methods
from specdecode.bench.prompts import load_prompts
from specdecode.engine.ragged import ForwardEntry
from specdecode.kernels import decode_stack_cpu


def ratios(team: list[float], other: list[float]) -> dict:
    """The arms' total time ratio team / OpenMP and the spread of the paired (block or prompt) ratios."""
    paired = [a / b for a, b in zip(team, other)]
    return {"ratio": sum(team) / sum(other), "paired_median": statistics.median(paired), "paired_min": min(paired),
            "paired_max": max(paired)}


def forwards(extension, args, control: bool) -> dict:
    llm = LLM(None, dtype="float32", quantization=args.quantization, max_num_seqs=args.sequences)
    runner = llm.runner
    for slot in range(args.sequences):
        runner.forward([ForwardEntry(slot, list(range(100 + slot, 300 + slot)), start=0, num_logits=1)])
    out = {}
    for T in args.widths:
        entries = [ForwardEntry(slot, [5] * T, start=200, num_logits=T) for slot in range(args.sequences)]
        for _ in range(50):
            runner.forward(entries, argmax=True)
        before = extension.thread_team_loops()
        runner.forward(entries, argmax=True)
        loops = extension.thread_team_loops() - before
        blocks = {True: [], False: []}
        for block in range(args.blocks):
            spent = {True: 0.0, False: 0.0}
            for i in range(2 * args.per_block):
                arm = (i + block) % 2 == 0
                extension.set_thread_team(arm or control)
                start = time.perf_counter()
                runner.forward(entries, argmax=True)
                spent[arm] += time.perf_counter() - start
            for arm in spent:
                blocks[arm].append(spent[arm] / args.per_block * 1e6)
        row = out[str(T)] = {"team_us": statistics.mean(blocks[True]), "openmp_us": statistics.mean(blocks[False]),
                             "team_loops": loops, **ratios(blocks[True], blocks[False])}
        print(f"{args.sequences} x T={T}: team {row['team_us']:.1f} us, OpenMP {row['openmp_us']:.1f} us a forward; "
              f"team / OpenMP {row['ratio']:.3f} (blocks {row['paired_min']:.3f}-{row['paired_max']:.3f}); "
              f"{loops} loops a forward on the team")
    extension.set_thread_team(True)
    return out


def decoding(extension, args, control: bool) -> dict:
    prompts = load_prompts("humaneval", args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    out = {}
    for method in parse_methods(args.methods):
        llm = LLM(None, dtype="float32", quantization=args.quantization, max_num_seqs=1,
                  speculative_config=method.config)
        llm.generate(prompts[:2], params)  # warm-up
        spent = {True: [], False: []}
        for p, prompt in enumerate(prompts):
            tokens = {}
            for arm in ([True, False] if p % 2 == 0 else [False, True]):
                extension.set_thread_team(arm or control)
                result = llm.generate([prompt], params)[0]
                tokens[arm] = result.token_ids
                spent[arm].append(result.metrics.e2e_latency - result.metrics.time_to_first_token)
            assert tokens[True] == tokens[False], f"{method.label}: outputs differ on prompt {p}"
        extension.set_thread_team(True)
        decoded = (args.max_tokens - 1) * len(prompts)  # the tokens after each request's first
        row = out[method.label] = {"team_tok_per_s": decoded / sum(spent[True]),
                                   "openmp_tok_per_s": decoded / sum(spent[False]), **ratios(spent[True], spent[False])}
        print(f"{method.label}: team {row['team_tok_per_s']:.1f} tok/s, OpenMP {row['openmp_tok_per_s']:.1f} tok/s; "
              f"time team / OpenMP {row['ratio']:.3f} (prompt pairs {row['paired_min']:.3f}-{row['paired_max']:.3f})")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quantization", default="w4a8")
    parser.add_argument("--widths", default="1,5,9", help="new tokens a forward, comma-separated")
    parser.add_argument("--sequences", type=int, default=1, help="sequences a forward (batch size)")
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--per-block", type=int, default=100, help="forwards of each arm a block")
    parser.add_argument("--methods", default="none,mtp:k=4", help="decoding runs ('' for none)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--control", action="store_true", help="both arms with the team on (A / A)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.widths = [int(w) for w in args.widths.split(",")]
    torch.set_num_threads(args.threads)
    extension = decode_stack_cpu.extension()
    if extension is None or not hasattr(extension, "set_thread_team"):
        raise SystemExit("the decode-stack kernel's lean path is not built here (it needs AVX-512 VNNI)")
    result = {"threads": args.threads, "quantization": args.quantization, "sequences": args.sequences,
              "control": args.control,
              "forwards_us": forwards(extension, args, args.control)}
    if args.methods:
        result["decoding"] = decoding(extension, args, args.control)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
