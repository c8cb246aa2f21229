"""Plain decoding rate by output length (batch 1, one prompt at a time): what the engine's per-step
host work costs as outputs grow. `--path generate` runs `LLM.generate`; `--path step` adds the
request and calls `LLM.step()` until it finishes, as the server and CLI streaming do (an output
with its text every step); `--stop` gives every request a stop string (one that never matches: the
search runs after every token). Run it on two checkouts in turn to compare them
(`PYTHONPATH=<other checkout>/src python benchmarks/output_length.py ...`), alternating, with
nothing else running.

    python benchmarks/output_length.py --quantization w4a8 --lengths 128,1024 --repeats 3
    python benchmarks/output_length.py --quantization w4a8 --lengths 128,896 --path step --stop

Tokens per second over wall time, prefill included (the same prompts for every length: the first
`--num-prompts` HumanEval prompts); the fastest of `--repeats` passes and all of them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdecode import LLM, SamplingParams
from specdecode.bench.prompts import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default=None, help="the target's scheme (default: none)")
    parser.add_argument("--lengths", default="128,1024", help="output lengths in tokens, comma-separated")
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--path", choices=("generate", "step"), default="generate",
                        help="LLM.generate, or add_request and LLM.step() to the end (default: generate)")
    parser.add_argument("--stop", action="store_true", help="give each request a stop string that never matches")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    llm = LLM(quantization=args.quantization)

    def run(prompt: str, params: SamplingParams) -> int:
        if args.path == "generate":
            return len(llm.generate([prompt], params)[0].token_ids)
        request_id = llm.add_request(prompt, params)
        while True:
            for output in llm.step():
                if output.request_id == request_id and output.finished:
                    return len(output.token_ids)

    prompts = load_prompts("humaneval", args.num_prompts)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))  # warm-up
    results = {}
    for length in (int(n) for n in args.lengths.split(",")):
        params = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True,
                                stop=["\x00 no such text"] if args.stop else None)
        rates = []
        for _ in range(args.repeats):
            start, tokens = time.perf_counter(), 0
            for prompt in prompts:
                tokens += run(prompt, params)
            rates.append(tokens / (time.perf_counter() - start))
        results[length] = {"best_tok_s": max(rates), "tok_s": rates}
        print(f"{length:5d} tokens: best {max(rates):7.1f} tok/s  ({', '.join(f'{r:.1f}' for r in rates)})")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"quantization": args.quantization, "num_prompts": args.num_prompts,
                                        "path": args.path, "stop": args.stop, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
