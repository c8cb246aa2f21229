"""Decode steps of several sequences with the lean path's batched call on and off, in one engine.

One plain engine decodes 2 x concurrency prompts, round by round in alternating order, with
`LlamaForCausalLM.forward_decode_batch` served (on) or refused (off: the ragged batch's general path,
as before it existed); only the engine's decode steps are timed (prefill excluded). `--control` refuses
nothing in either arm (an A/A run: the spread of the comparison itself). Prints decode tok/s per arm,
their ratio, and whether every round decoded the same tokens.

    python benchmarks/decode_batch_ab.py --quantization w4a8 --concurrency 4 [--control]
"""

from __future__ import annotations

import argparse
import json
import time

from specdecode import LLM, SamplingParams
from specdecode.bench.prompts import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default=None, help="w4a8, w8a8, int8, int4 (default: none, bf16)")
    parser.add_argument("--concurrency", type=int, default=4, help="sequences in flight (default 4)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per arm, alternating (default 4)")
    parser.add_argument("--control", action="store_true", help="both arms batched (A/A)")
    args = parser.parse_args()

    llm = LLM(quantization=args.quantization, max_num_seqs=args.concurrency)
    model = llm.runner.model
    prompts = load_prompts("humaneval", 2 * args.concurrency)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    timing = {"on": [0.0, 0], "off": [0.0, 0]}  # arm -> [decode seconds, tokens]
    arm = ["on"]
    decode = llm._decode

    def timed_decode(seqs):
        start = time.perf_counter()
        out = decode(seqs)
        timing[arm[0]][0] += time.perf_counter() - start
        timing[arm[0]][1] += len(seqs)
        return out

    llm._decode = timed_decode
    llm.generate(prompts, params)  # warm-up (not counted)
    timing = {"on": [0.0, 0], "off": [0.0, 0]}
    tokens: dict[str, list] = {"on": [], "off": []}
    for round_ in range(args.rounds):
        for name in (["on", "off"] if round_ % 2 == 0 else ["off", "on"]):
            arm[0] = name
            if name == "off" and not args.control:
                model.forward_decode_batch = lambda *a, **k: None  # refused: the general path
            else:
                model.__dict__.pop("forward_decode_batch", None)
            tokens[name].append([o.token_ids for o in llm.generate(prompts, params)])
    model.__dict__.pop("forward_decode_batch", None)
    rates = {name: round(n / seconds, 1) for name, (seconds, n) in timing.items()}
    print(json.dumps({"concurrency": args.concurrency, "quantization": args.quantization or "none",
                      "mode": "A/A" if args.control else "A/B", "decode tok/s on": rates["on"],
                      "decode tok/s off": rates["off"], "on/off": round(rates["on"] / rates["off"], 3),
                      "equal": all(run == tokens["on"][0] for runs in tokens.values() for run in runs)}))


if __name__ == "__main__":
    main()
