"""Steps of several sequences with the lean path's batched call on and off, in one engine.

One engine (plain, or speculative with `--speculative-config`) decodes 2 x concurrency prompts, round
by round in alternating order, with `LlamaForCausalLM.forward_chains` served (on) or refused (off: the
ragged batch's general path, as before it existed); only the engine's decode steps are timed (plain
decoding's or speculative ones; prefill excluded). `--refuse verify` refuses only batches in which a
sequence brings several tokens (verifications; decode steps of one token each still batched: the
default with a speculative config), `--refuse all` every batch (the default for plain decoding).
`--refuse drafting` keeps every forward batched and refuses the drafter's batched C++ drafting step
instead (`_batch_step` of EAGLE / EAGLE-3 / MTP and draft models: the Python step drafts batches of
several sequences). `--refuse wide` refuses batches of more rows than a bf16 model's measured lean
width (`LlamaForCausalLM.lean_rows`), which the lean path did not serve before its linears ran the
layers' own op past that width (the narrowest bf16 layer's few-row width where none was measured).
`--control` refuses nothing in either arm (an A/A run: the spread of the comparison itself). Prints
decode tok/s per arm, their ratio, and whether every round decoded the same tokens.

    python benchmarks/decode_batch_ab.py --quantization w4a8 --concurrency 4 [--control]
    python benchmarks/decode_batch_ab.py --quantization w4a8 --concurrency 4 \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' [--control]
"""

from __future__ import annotations

import argparse
import json
import time

from specdecode import LLM, SamplingParams
from specdecode.bench.prompts import load_prompts
from specdecode.models.inference import PackedLinear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default=None, help="w4a8, w8a8, int8, int4 (default: none, bf16)")
    parser.add_argument("--concurrency", type=int, default=4, help="sequences in flight (default 4)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per arm, alternating (default 4)")
    parser.add_argument("--speculative-config", default=None, help="JSON, as `specdecode generate` takes it")
    parser.add_argument("--refuse", choices=("all", "verify", "drafting", "wide"), default=None,
                        help="what the off arm refuses (default: verify with a speculative config, else all; "
                             "drafting: batched C++ drafting steps; wide: batches wider than the lean width)")
    parser.add_argument("--control", action="store_true", help="both arms batched (A/A)")
    args = parser.parse_args()
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    refuse = args.refuse or ("verify" if spec else "all")

    llm = LLM(quantization=args.quantization, max_num_seqs=args.concurrency, speculative_config=spec)
    model = llm.runner.model
    served = model.forward_chains
    proposer = llm.speculator.proposer if spec else None
    if refuse == "drafting" and not hasattr(proposer, "_batch_step"):
        parser.error("--refuse drafting needs a drafter's speculative config (eagle, eagle3, mtp, draft_model)")

    # The lean width: measured (lean_rows), else the narrowest bf16 layer's few-row kernel width.
    few_rows = [m.few_rows[-1] for m in model.model.layers.modules() if isinstance(m, PackedLinear) and m.few_rows]
    width = model.lean_rows or min(few_rows, default=0)
    if refuse == "wide" and not width:
        parser.error("--refuse wide needs bf16 layers with the few-row kernel (no --quantization)")

    def refused(token_ids, *args, **kwargs):  # the off arm's forward_chains: None sends the batch to the general path
        if refuse == "wide":
            return None if sum(map(len, token_ids)) > width else served(token_ids, *args, **kwargs)
        return None if refuse == "all" or max(map(len, token_ids)) > 1 else served(token_ids, *args, **kwargs)

    prompts = load_prompts("humaneval", 2 * args.concurrency)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    timing = {"on": [0.0, 0], "off": [0.0, 0]}  # arm -> [decode seconds, tokens]
    arm = ["on"]
    step_name = "_speculative" if spec else "_decode"
    step = getattr(llm, step_name)

    def timed_step(seqs):
        start = time.perf_counter()
        out = step(seqs)
        timing[arm[0]][0] += time.perf_counter() - start
        timing[arm[0]][1] += sum(map(len, out.token_ids))
        return out

    setattr(llm, step_name, timed_step)
    llm.generate(prompts, params)  # warm-up (not counted)
    timing = {"on": [0.0, 0], "off": [0.0, 0]}
    tokens: dict[str, list] = {"on": [], "off": []}
    for round_ in range(args.rounds):
        for name in (["on", "off"] if round_ % 2 == 0 else ["off", "on"]):
            arm[0] = name
            off = name == "off" and not args.control
            if off and refuse == "drafting":
                proposer._batch_step = lambda first, sampling: None
            elif off:
                model.forward_chains = refused
            else:
                model.__dict__.pop("forward_chains", None)
                if proposer is not None:
                    proposer.__dict__.pop("_batch_step", None)
            tokens[name].append([o.token_ids for o in llm.generate(prompts, params)])
    model.__dict__.pop("forward_chains", None)
    rates = {name: round(n / seconds, 1) for name, (seconds, n) in timing.items()}
    print(json.dumps({"concurrency": args.concurrency, "quantization": args.quantization or "none",
                      "speculative_config": spec, "mode": "A/A" if args.control else f"A/B (off refuses {refuse})",
                      "decode tok/s on": rates["on"],
                      "decode tok/s off": rates["off"], "on/off": round(rates["on"] / rates["off"], 3),
                      "equal": all(run == tokens["on"][0] for runs in tokens.values() for run in runs)}))


if __name__ == "__main__":
    main()
