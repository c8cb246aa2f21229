"""Target forward time by new tokens, for each weight precision and verify-kernel choice, in one run.

    python benchmarks/verify_widths.py [--compile] --out benchmarks/results/engine/verify_widths.json

The default model at batch 1 over a 128-token context (`cost_model.profile`: the fastest of 3
calls per width), engines measured in turn, `--rounds` times, keeping each width's fastest:
a slow phase of the machine then lands on every engine alike. Engines: packed bf16, and int8 /
int4-g32 with `verify_kernels="quantized"` (the int kernels at every width) and `"auto"` (a dense
copy from the measured width on, models/wide_kernels.py), w8a8 and w4a8, and float32 activations
with the checkpoint's bf16 weights kept as bf16 (models/inference.py Bf16WeightLinear) or as float32
(`--engines` picks some).

    python benchmarks/verify_widths.py --engines "float32, bf16 weights,float32 weights"
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from unittest import mock

import torch

from specdecode import LLM
from specdecode.kernels import gemv_bf16w_cpu
from specdecode.speculative.policy.cost_model import profile

WIDTHS = [1, 2, 4, 5, 8, 9, 12, 16, 32]
# (name, quantization, verify_kernels, dtype); "float32 weights": the bf16 checkpoint's weights held as float32
ENGINES = [("bf16 packed", None, "auto", "auto"), ("int8, int kernels", "int8", "quantized", "auto"),
           ("int8, auto", "int8", "auto", "auto"), ("int4-g32, int kernels", "int4", "quantized", "auto"),
           ("int4-g32, auto", "int4", "auto", "auto"), ("w8a8", "w8a8", "auto", "auto"),
           ("w4a8", "w4a8", "auto", "auto"),
           ("float32, bf16 weights", None, "auto", "float32"), ("float32 weights", None, "auto", "float32")]


def split_names(text: str, names: list[str]) -> list[str]:
    """Comma-separated engine names, some of which hold commas themselves ("int8, auto")."""
    found, rest = [], text
    while rest:
        name = next((n for n in sorted(names, key=len, reverse=True) if rest.startswith(n)), rest.split(",")[0])
        found.append(name)
        rest = rest[len(name):].lstrip(",").lstrip()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engines", default=None,
                        help=f"comma-separated names of the engines to measure (default: all of {[e[0] for e in ENGINES]})")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    names = [e[0] for e in ENGINES]
    asked = names if args.engines is None else split_names(args.engines, names)
    chosen = [e for e in ENGINES if e[0] in asked]
    if not chosen:
        parser.error(f"--engines: none of {args.engines!r} is one of {names}")
    engines = {}
    for name, q, v, dtype in chosen:
        with mock.patch.object(gemv_bf16w_cpu, "available", return_value=False) if name == "float32 weights" else \
                contextlib.nullcontext():
            engines[name] = LLM(quantization=q, verify_kernels=v, compile=args.compile, max_num_seqs=1, dtype=dtype)
    wide = {name: sorted({f"{m.in_features}x{m.out_features}: {m.wide[1]}" for m in llm.model.modules()
                          if getattr(m, "wide", None) is not None}) for name, llm in engines.items()}
    best: dict[str, dict[int, float]] = {name: {} for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            for n, seconds in profile(llm.runner, [1], WIDTHS).table[1].items():
                best[name][n] = min(best[name].get(n, float("inf")), seconds)
    print(f"ms per target forward, batch 1, 128-token context ({'compiled' if args.compile else 'eager'}; "
          f"fastest of {args.rounds} rounds x 3)")
    print("| weights | " + " | ".join(str(n) for n in WIDTHS) + " | 8 / 1 |")
    print("| --- |" + " --- |" * (len(WIDTHS) + 1))
    for name, row in best.items():
        print(f"| {name} | " + " | ".join(f"{row[n] * 1e3:.2f}" for n in WIDTHS) + f" | {row[8] / row[1]:.2f}x |")
    for name, shapes in wide.items():
        if shapes:
            print(f"{name}: dense copy from (rows) {', '.join(shapes)}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                        "compiled": args.compile, "ms": {k: {n: round(v * 1e3, 3) for n, v in row.items()}
                                                                         for k, row in best.items()},
                                        "dense_copy_from": wide}, indent=1) + "\n")


if __name__ == "__main__":
    main()
