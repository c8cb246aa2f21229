"""Weight-only kernels on this CPU: specdecode's (PyTorch's own kernels) against torchao's.

The layers of one target forward of the default model (6 x [qkv 512->1024, o 512->512,
gate/up 512->2816, down 1408->512] + LM head 512->8192), called in turn so that weights
stream from memory as in decoding, at 1-16 rows (decode and verification widths). Reports
microseconds for the whole set of layers (the median of `--repeats` passes), per backend:

  bf16 dense            F.linear on a plain bf16 weight
  bf16 packed           specdecode's PackedLinear (oneDNN blocked layout), the bf16 default
  int8 / int4-g32       specdecode's QuantizedLinear (torch._weight_int8pack_mm / _weight_int4pack_mm_for_cpu)
  torchao int8-wo       torchao Int8WeightOnlyConfig
  torchao int4-wo-g32   torchao's CPU int4 weight-only (PrototypeInt4WeightOnlyConfig; older: Int4CPULayout)
  torchao int8-dyn      torchao Int8DynamicActivationInt8WeightConfig (activations quantised too: another model)

torchao is not a dependency; run with a Python that has it:
    python benchmarks/torchao_kernels.py --out benchmarks/results/engine/torchao_kernels.json
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from specdecode.models.inference import PackedLinear
from specdecode.models.quant import QuantizedLinear, QuantScheme

SHAPES = [(512, 1024), (512, 512), (512, 2816), (1408, 512)] * 6 + [(512, 8192)]  # (in, out), one forward
ROWS = (1, 2, 4, 8, 16)


def dense_layers(seed: int = 0) -> list[nn.Linear]:
    torch.manual_seed(seed)
    layers = []
    for k, n in SHAPES:
        layer = nn.Linear(k, n, bias=False).requires_grad_(False)
        nn.init.normal_(layer.weight, std=k ** -0.5)
        layers.append(layer.to(torch.bfloat16))
    return layers


def specdecode_backends(layers: list[nn.Linear]) -> dict:
    backends = {"bf16 dense": layers, "bf16 packed": [PackedLinear(layer.weight, None) for layer in layers]}
    for name in ("int8", "int4-g32"):
        quantized = [QuantizedLinear.from_weight(layer.weight.float(), None, QuantScheme.parse(name)) for layer in layers]
        for layer in quantized:
            layer.prepare(torch.bfloat16)
        backends[name] = quantized
    return backends


def torchao_backends(layers: list[nn.Linear]) -> tuple[dict, str | None]:
    try:
        import torchao
        from torchao.quantization import (Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,
                                          Int8WeightOnlyConfig, quantize_)
    except ImportError as e:
        return {}, f"torchao not importable: {e}"
    configs = {"torchao int8-wo": lambda: Int8WeightOnlyConfig(),
               "torchao int8-dyn": lambda: Int8DynamicActivationInt8WeightConfig()}
    try:  # torchao >= 0.15: the CPU tinygemm layout is the prototype opaque int4 tensor
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

        configs["torchao int4-wo-g32"] = lambda: PrototypeInt4WeightOnlyConfig(group_size=32)
    except ImportError:
        from torchao.dtypes import Int4CPULayout

        configs["torchao int4-wo-g32"] = lambda: Int4WeightOnlyConfig(group_size=32, layout=Int4CPULayout())
    backends, errors = {}, []
    for name, config in configs.items():
        try:
            model = nn.Sequential(*[copy.deepcopy(layer) for layer in layers])
            quantize_(model, config())
            x = torch.randn(1, SHAPES[0][0], dtype=torch.bfloat16)
            model[0](x)  # fails here if the config has no CPU kernel
            backends[name] = list(model)
        except Exception as e:  # a config this torchao / CPU cannot run is reported, not fatal
            errors.append(f"{name}: {type(e).__name__}: {str(e)[:160]}")
    return backends, f"torchao {torchao.__version__}" + (f"; failed: {'; '.join(errors)}" if errors else "")


def time_forward(layers, rows: int, repeats: int) -> float:
    """Median microseconds to call every layer once on `rows` rows."""
    inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k, _ in SHAPES}
    passes = []
    with torch.inference_mode():
        for _ in range(3):  # warm-up
            for (k, _), layer in zip(SHAPES, layers):
                layer(inputs[k])
        for _ in range(repeats):
            start = time.perf_counter()
            for (k, _), layer in zip(SHAPES, layers):
                layer(inputs[k])
            passes.append(time.perf_counter() - start)
    return statistics.median(passes) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    layers = dense_layers()
    backends = specdecode_backends(layers)
    ao, note = torchao_backends(layers)
    backends.update(ao)
    table = {name: {rows: round(time_forward(b, rows, args.repeats), 1) for rows in ROWS} for name, b in backends.items()}
    print(f"microseconds for one forward's {len(SHAPES)} linear layers (median of {args.repeats}); {note}")
    print("| backend | " + " | ".join(f"{r} row{'s' if r > 1 else ''}" for r in ROWS) + " | 8 rows / 1 row |")
    print("| --- |" + " --- |" * (len(ROWS) + 1))
    for name, times in table.items():
        print(f"| {name} | " + " | ".join(f"{times[r]:,.0f}" for r in ROWS) + f" | {times[8] / times[1]:.2f}x |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                        "processor": platform.processor() or platform.machine(), "torchao": note,
                                        "shapes": SHAPES, "microseconds": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
