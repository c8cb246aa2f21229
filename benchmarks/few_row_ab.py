"""Two engines in one process, timed in alternate rounds: an effect on decoding end to end as a
paired ratio (the machine's drift hits both alike). `--against pytorch` (the default): the few-row
kernels' effect (the baseline engine has them detached); `--against eager`: torch.compile's (the
candidate engine is compiled, the baseline eager, both with the kernels); `--against modules`: the
C++ layer stack's (models/native_stack.py; the baseline's models and drafter blocks run their
Python modules); `--against python-draft`: the C++ drafting step's (speculative/propose/native_step.py;
the baseline's proposer drafts through its Python step); `--against python-runner`: the runner's
one-sequence forward in one C++ call (models/native_stack.py NativeChain; the baseline's runners keep
their Python around the stack); `--against host-argmax`: a greedy step's argmax taken by that C++ call
(the baseline's runners leave it to the caller, from the logits); `--against float32-weights`: a bf16
checkpoint's weights kept as bf16 under float32 activations (models/inference.py Bf16WeightLinear; the
baseline's target and drafter hold them as float32, PyTorch's matmuls); `--against int4-avx2`: the int4
kernel's lane layout on an AVX-512 CPU (kernels/gemv_int4_cpu.cpp; the baseline's int4 layers take its
AVX2 layout, the same numbers); `--against same`: an A / A control (the baseline built as the candidate).

    python benchmarks/few_row_ab.py --quantization int8 [--method ngram] [--compile]
    python benchmarks/few_row_ab.py --dtype float32 --quantization int8 --against eager
    python benchmarks/few_row_ab.py --dtype float32 --quantization int8 --against modules --method eagle3
    python benchmarks/few_row_ab.py --dtype float32 --quantization int8 --against python-draft --method mtp
    python benchmarks/few_row_ab.py --dtype float32 --quantization int8 --against python-runner
    python benchmarks/few_row_ab.py --quantization w4a8 --against host-argmax --num-prompts 16 --rounds 8
    python benchmarks/few_row_ab.py --dtype float32 --against float32-weights --method ngram
    python benchmarks/few_row_ab.py --dtype float32 --quantization int4 --against int4-avx2 [--model DIR]

Greedy, the first --num-prompts HumanEval prompts one at a time, --max-tokens each (EOS ignored), the
two engines taking turns prompt by prompt (which goes first alternates by round); prints each round's
tok/s (wall, prefill included) and the median of the per-round ratios candidate / baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from unittest import mock

from torch import nn

from specdecode import LLM, SamplingParams
from specdecode.bench.prompts import load_prompts
from specdecode.kernels import gemv_bf16w_cpu, gemv_int4_cpu
from specdecode.models.inference import detach_few_row_kernels
from specdecode.models.native_stack import serve_by_modules


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: the shipped model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--method", default="none",
                        help="none, ngram (k=8), or a shipped drafter: draft_model, eagle3, mtp (k=4)")
    parser.add_argument("--compile", action="store_true", help="both engines compiled (--against pytorch)")
    parser.add_argument("--against", choices=("pytorch", "eager", "modules", "python-draft", "python-runner",
                                              "host-argmax", "float32-weights", "int4-avx2", "same"),
                        default="pytorch",
                        help="the baseline: PyTorch's kernels in place of the few-row ones, eager forwards, the "
                             "Python modules in place of the C++ layer stack, the proposer's Python drafting step in "
                             "place of the C++ one, the runners' Python around the stack, greedy argmaxes taken "
                             "after the forward, float32 weights in place of a bf16 checkpoint's bf16 ones (float32 "
                             "activations), the int4 kernel's AVX2 layout in place of its lane one, or the "
                             "candidate itself (an A / A control)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    spec = None if args.method == "none" else {"method": args.method,
                                                "num_speculative_tokens": 8 if args.method == "ngram" else 4}
    compiled = {"candidate": args.compile or args.against == "eager", "baseline": args.compile and args.against != "eager"}
    engines = {}
    for name in ("candidate", "baseline"):
        baseline = {"float32-weights": mock.patch.object(gemv_bf16w_cpu, "available", return_value=False),
                    "int4-avx2": mock.patch.object(gemv_int4_cpu, "packer", return_value=gemv_int4_cpu.pack)}
        with baseline.get(args.against, contextlib.nullcontext()) if name == "baseline" else contextlib.nullcontext():
            engines[name] = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization,
                                compile=compiled[name], speculative_config=spec)
    if args.against == "pytorch":
        detach_few_row_kernels(engines["baseline"].model)
    elif args.against == "modules":
        proposer = getattr(engines["baseline"].speculator, "proposer", None)
        for module in [engines["baseline"].model, *(vars(proposer).values() if proposer is not None else ())]:
            if isinstance(module, nn.Module):
                serve_by_modules(module)
    elif args.against == "python-draft":
        engines["baseline"].speculator.proposer.native_drafting = False
    elif args.against in ("python-runner", "host-argmax"):
        proposer = getattr(engines["baseline"].speculator, "proposer", None)
        for runner in (engines["baseline"].runner, getattr(proposer, "runner", None)):
            if runner is not None:
                setattr(runner, "native_chain" if args.against == "python-runner" else "forward_argmax", False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    prompts = load_prompts("humaneval", args.num_prompts)
    outputs = {}
    for name, llm in engines.items():  # warm-up (and compilation)
        outputs[name] = [llm.generate([p], params)[0].token_ids for p in prompts]
    speed: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):  # prompt by prompt, the engines' order alternating by round
        seconds = dict.fromkeys(engines, 0.0)
        for p in prompts:
            for name in list(engines)[:: 1 if r % 2 == 0 else -1]:
                start = time.perf_counter()
                engines[name].generate([p], params)
                seconds[name] += time.perf_counter() - start
        for name in engines:
            speed[name].append(len(prompts) * args.max_tokens / seconds[name])
    ratios = [a / b for a, b in zip(speed["candidate"], speed["baseline"])]
    result = {"args": {k: v for k, v in vars(args).items() if k != "out"},
              "tok_s": {name: [round(s, 1) for s in v] for name, v in speed.items()},
              "ratio_median": round(statistics.median(ratios), 3), "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
              "same_outputs": outputs["candidate"] == outputs["baseline"]}
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
