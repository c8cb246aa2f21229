"""The few-row kernels against PyTorch's, by rows: bf16 (kernels/gemv_cpu.cpp) against oneDNN's
packed matmul, int8 (kernels/gemv_int8_cpu.cpp) against `torch._weight_int8pack_mm`, int4
(kernels/gemv_int4_cpu.cpp, its bf16 pair layout where the CPU has one, else its lane layout on AVX-512)
against `torch._weight_int4pack_mm_for_cpu`, int4f: int4 weights with float32 activations (the same
kernel, its lane layout on AVX-512, and its AVX2 form) against the dense dequantised float32 matmul,
W8A8 (kernels/gemm_a8_cpu.cpp, int8 activations) against
the packed bf16 matmul and the int8 weight-only few-row kernel, W4A8 against the bf16 one and the
int4 weight-only few-row kernel (its bf16 pair layout), bf16 weights with float32 activations
(kernels/gemv_bf16w_cpu.cpp; its AVX-512 form and its AVX2 form, which AVX2-only CPUs run) against
PyTorch's float32 matmul of the same weights held as float32.

    python benchmarks/few_row_kernel.py --out benchmarks/results/engine/few_row_kernel.json
    python benchmarks/few_row_kernel.py --kind int8 --out benchmarks/results/engine/few_row_kernel_int8.json
    python benchmarks/few_row_kernel.py --kind int4 --shapes 1b --repeats 5
    python benchmarks/few_row_kernel.py --kind int4f
    python benchmarks/few_row_kernel.py --kind w8a8
    python benchmarks/few_row_kernel.py --kind w4a8
    python benchmarks/few_row_kernel.py --kind bf16w

Every linear layer of the model in turn (`--shapes default`: the default model's 25 matmuls;
`1b`: the 1B random Llama's 89, benchmarks/make_random_llama.py, whose weights stream from
memory), as in one forward, so each comes after the others' weights; random weights of those
shapes, 1-16 rows (`--rows`), 2 threads; the fastest of `--repeats` passes per kernel and width, the kernels
interleaved pass by pass.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdecode.kernels import gemv_cpu, gemv_int8_cpu
from specdecode.models.quant import QuantScheme, quantize_weight

# The default model: per layer qkv 512 -> 1024, o 512 -> 512, gate/up 512 -> 2816, down 1408 -> 512; 6 layers; LM head 512 -> 8192.
SHAPES = {
    "default": [(1024, 512), (512, 512), (2816, 512), (512, 1408)] * 6 + [(8192, 512)],
    # The 1B model: qkv 2048 -> 3072, o 2048 -> 2048, gate/up 2048 -> 11264, down 5632 -> 2048; 22 layers; head 2048 -> 8192.
    "1b": [(3072, 2048), (2048, 2048), (11264, 2048), (2048, 5632)] * 22 + [(8192, 2048)],
}
ROWS = [1, 2, 3, 4, 8, 16]


def bf16_kernels(weights: list[torch.Tensor]) -> dict:
    if not gemv_cpu.fits(512, torch.bfloat16, "cpu"):
        raise SystemExit("the few-row bf16 kernel does not run here (it needs AVX-512 BF16 and a C++ compiler)")
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
    blocked = [gemv_cpu.block_weight(w) for w in weights]
    return {
        "onednn": lambda xs: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for x, p in zip(xs, packed)],
        "few_rows": lambda xs: [gemv_cpu.few_rows_linear(x, b, None, w.shape[0]) for x, b, w in zip(xs, blocked, weights)],
    }


def int8_kernels(weights: list[torch.Tensor]) -> dict:
    if not gemv_int8_cpu.fits(512, "cpu"):
        raise SystemExit("the few-row int8 kernel does not run here (it needs AVX2, FMA and a C++ compiler)")
    stored = [quantize_weight(w, QuantScheme.parse("int8")) for w in weights]
    scales = [q["scales"].bfloat16() for q in stored]
    blocked = [gemv_int8_cpu.block_weight(q["qweight"]) for q in stored]
    return {
        "int8pack": lambda xs: [torch._weight_int8pack_mm(x, q["qweight"], s) for x, q, s in zip(xs, stored, scales)],
        "few_rows": lambda xs: [gemv_int8_cpu.few_rows_linear(x, b, q["scales"], None, w.shape[0])
                                for x, b, q, w in zip(xs, blocked, stored, weights)],
        "few_rows_avx2": lambda xs: [gemv_int8_cpu.few_rows_linear(x, b, q["scales"], None, w.shape[0], avx2=True)
                                     for x, b, q, w in zip(xs, blocked, stored, weights)],
    }


def int4_kernels(weights: list[torch.Tensor]) -> dict:
    from specdecode.kernels import gemv_int4_cpu
    from specdecode.models.quant import DEFAULT_INT4_GROUP

    if not gemv_int4_cpu.fits(weights[0].shape[1], DEFAULT_INT4_GROUP, "cpu"):
        raise SystemExit("the few-row int4 kernel does not run here (it needs AVX2, FMA and a C++ compiler)")
    scheme = QuantScheme.parse("int4")
    stored = [quantize_weight(w, scheme) for w in weights]
    unpacked = [torch.stack((q["qweight"] & 0xF, q["qweight"] >> 4), dim=-1).view(w.shape).to(torch.int32)
                for q, w in zip(stored, weights)]
    pack = gemv_int4_cpu.packer(torch.bfloat16, DEFAULT_INT4_GROUP, bf16_values=True)
    ours = [pack(u, q["scales"], q["zeros"]) for u, q in zip(unpacked, stored)]
    theirs = [(torch._convert_weight_to_int4pack_for_cpu(u, 1),
               torch.stack((q["scales"], q["zeros"]), dim=-1).transpose(0, 1).contiguous().bfloat16())
              for u, q in zip(unpacked, stored)]
    group = scheme.group_size
    return {
        "int4pack": lambda xs: [torch._weight_int4pack_mm_for_cpu(x, p, group, sz) for x, (p, sz) in zip(xs, theirs)],
        "few_rows": lambda xs: [gemv_int4_cpu.few_rows_linear(x, p, so, None, w.shape[0], group)
                                for x, (p, so), w in zip(xs, ours, weights)],
    }


def int4f_kernels(weights: list[torch.Tensor]) -> dict:
    from specdecode.kernels import gemv_int4_cpu
    from specdecode.models.quant import QuantizedLinear

    if not gemv_int4_cpu.fits(weights[0].shape[1], 32, "cpu"):
        raise SystemExit("the few-row int4 kernel does not run here (it needs AVX2, FMA and a C++ compiler)")
    layers = [QuantizedLinear.from_weight(w.float(), None, QuantScheme.parse("int4")) for w in weights]
    dense = [layer.dequantize() for layer in layers]
    pack = gemv_int4_cpu.packer(torch.float32, 32, bf16_values=True)
    ours = [pack(layer.unpacked_int4(), layer.scales, layer.zeros) for layer in layers]
    avx2 = [gemv_int4_cpu.pack(layer.unpacked_int4(), layer.scales, layer.zeros) for layer in layers]
    kernels = {
        "float32": lambda xs: [torch.nn.functional.linear(x, w) for x, w in zip(xs, dense)],
        "few_rows": lambda xs: [gemv_int4_cpu.few_rows_linear(x, p, so, None, w.shape[0], 32)
                                for x, (p, so), w in zip(xs, ours, weights)],
    }
    if pack is not gemv_int4_cpu.pack:
        kernels["few_rows_avx2"] = lambda xs: [gemv_int4_cpu.few_rows_linear(x, p, so, None, w.shape[0], 32)
                                               for x, (p, so), w in zip(xs, avx2, weights)]
    return kernels


def w8a8_kernels(weights: list[torch.Tensor]) -> dict:
    from specdecode.kernels import gemm_a8_cpu

    if not (gemm_a8_cpu.available("cpu") and gemv_int8_cpu.fits(512, "cpu")):
        raise SystemExit("the W8A8 kernel does not run here (it needs AVX-512 VNNI and a C++ compiler)")  # (and the int8 kernel)
    stored = [quantize_weight(w, QuantScheme.parse("int8")) for w in weights]
    ours = [(gemm_a8_cpu.pack_w8(q["qweight"]), gemm_a8_cpu.pad_outputs(q["scales"])) for q in stored]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
    blocked = [gemv_int8_cpu.block_weight(q["qweight"]) for q in stored]
    return {
        "bf16_onednn": lambda xs: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for x, p in zip(xs, packed)],
        "int8_few_rows": lambda xs: [gemv_int8_cpu.few_rows_linear(x, b, q["scales"], None, w.shape[0])
                                     for x, b, q, w in zip(xs, blocked, stored, weights)],
        "w8a8": lambda xs: [gemm_a8_cpu.w8a8_linear(x, p, s, None, w.shape[0]) for x, (p, s), w in zip(xs, ours, weights)],
    }


def w4a8_kernels(weights: list[torch.Tensor]) -> dict:
    from specdecode.kernels import gemm_a8_cpu, gemv_int4_cpu
    from specdecode.models.quant import QuantizedLinear

    if not gemm_a8_cpu.available("cpu"):
        raise SystemExit("the W4A8 kernel does not run here (it needs AVX-512 VNNI and a C++ compiler)")
    layers = [QuantizedLinear.from_weight(w.float(), None, QuantScheme.parse("w4a8")) for w in weights]
    ours = [layer.a8_arguments(torch.device("cpu")) for layer in layers]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
    kernels = {
        "bf16_onednn": lambda xs: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for x, p in zip(xs, packed)],
        "w4a8": lambda xs: [gemm_a8_cpu.w4a8_linear(x, *args) for x, args in zip(xs, ours)],
    }
    if gemv_int4_cpu.fits(512, 32, "cpu") and gemv_int4_cpu.pair_kernel():  # its bf16 pair layout needs AVX-512 BF16
        pairs = [gemv_int4_cpu.pack_pairs(layer.unpacked_int4(), layer.scales, layer.zeros) for layer in layers]
        kernels["int4_few_rows"] = lambda xs: [gemv_int4_cpu.few_rows_linear(x, p, so, None, w.shape[0], 32)
                                               for x, (p, so), w in zip(xs, pairs, weights)]
    return kernels


def bf16w_kernels(weights: list[torch.Tensor]) -> dict:
    from specdecode.kernels import gemv_bf16w_cpu

    if not gemv_bf16w_cpu.available("cpu"):
        raise SystemExit("the bf16-weight kernel does not run here (it needs AVX2 + FMA and a C++ compiler)")
    dense = [w.float() for w in weights]
    blocked = [gemv_bf16w_cpu.block_weight(w) for w in weights]
    return {
        "float32": lambda xs: [torch.nn.functional.linear(x, w) for x, w in zip(xs, dense)],
        "bf16w": lambda xs: [gemv_bf16w_cpu.linear(x, b, None, w.shape[0]) for x, b, w in zip(xs, blocked, weights)],
        "bf16w_avx2": lambda xs: [gemv_bf16w_cpu.linear(x, b, None, w.shape[0], avx2=True)
                                  for x, b, w in zip(xs, blocked, weights)],
    }


KINDS = {"bf16": bf16_kernels, "int8": int8_kernels, "int4": int4_kernels, "int4f": int4f_kernels, "w8a8": w8a8_kernels,
         "w4a8": w4a8_kernels, "bf16w": bf16w_kernels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=tuple(KINDS), default="bf16")
    parser.add_argument("--shapes", choices=tuple(SHAPES), default="default", help="whose layer shapes")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)),
                        help="comma-separated row counts (default %(default)s)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    layers = SHAPES[args.shapes]
    weights = [(torch.randn(n, k, generator=gen) * 0.02).bfloat16() for n, k in layers]
    kernels = KINDS[args.kind](weights)
    activations = torch.float32 if args.kind in ("bf16w", "int4f") else torch.bfloat16
    result = {"kind": args.kind, "shapes": args.shapes, "threads": torch.get_num_threads(), "torch": torch.__version__,
              "ms_per_forward": {}}
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            xs = [torch.randn(rows, k, generator=gen).to(activations) for _, k in layers]
            best = {name: float("inf") for name in kernels}
            for name, fn in kernels.items():
                fn(xs)  # warm-up
            for _ in range(args.repeats):
                for name, fn in kernels.items():
                    start = time.perf_counter()
                    fn(xs)
                    best[name] = min(best[name], time.perf_counter() - start)
            result["ms_per_forward"][rows] = {name: round(s * 1e3, 3) for name, s in best.items()}
            print(f"{rows:2d} rows: " + ", ".join(f"{name} {s * 1e3:.3f} ms" for name, s in best.items()))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
