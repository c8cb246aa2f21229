"""Verification widths under int8 / int4: a per-width choice of kernel for quantised layers.

PyTorch's weight-only kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) read a
layer's weights once per row, so a verify forward of 8 tokens costs 2.4-2.9x one token, while
the packed bf16 matmul (oneDNN) costs 1.2x (measured here, every layer of the default model
in turn: int8 1.1 ms at 1 row and 3.1 ms at 8; packed bf16 1.8 and 2.1 ms). Speculation lives on
wide forwards costing about what one token does, so a quantised target keeps, beside each
layer, its dequantised weight packed in the served dtype, and a forward of at least
`wide_from` rows takes that one: the int kernel where it is faster (decoding, short drafts),
the dense one where it is (verification). Both compute the same quantised model (the dense
copy is `dequantize()` in the served dtype), with different rounding, so exact mode, which
needs every width to round alike, keeps the int kernels only.

`wide_from` is measured per layer shape on this machine: each kernel on that shape's layers,
their weights evicted from the caches before each call (a forward reads them from memory), at
1-16 rows; the smallest width from which the
dense copy is faster at every wider probe. The choice is cached (by shape, scheme, dtype,
threads, torch and CPU), so every start of the same setup runs the same kernels. Costs memory:
the served dtype's bytes per weight beside the quantised ones, only for shapes where it wins.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from specdecode.kernels import build, gemv_cpu
from specdecode.models.inference import PackedLinear, attach_few_row_kernels, can_pack
from specdecode.models.kernel_probe import faster_by_width, load_choices, save_choices
from specdecode.models.quant import QuantizedLinear

log = logging.getLogger(__name__)

# Verification widths only. With the few-row bf16 kernel on the dense copies, the per-shape probe also
# found them faster at 1-2 rows (cold single calls), but whole 1-token forwards then measured 1.7-2.0 ms
# against 0.6-1.0 ms on the int kernels (`specdecode profile`, int4 / int8): decoding and drafting keep them.
PROBE_ROWS = (4, 6, 8, 12, 16)


def measure_wide_from(layers: list[QuantizedLinear], dense: list[PackedLinear], dtype: torch.dtype) -> int | None:
    """The smallest probed width from which `dense` beats `layers` at every wider probe (None: never)."""
    faster = faster_by_width(dense, layers, layers[0].in_features, dtype, PROBE_ROWS)
    wide_from = None
    for rows, wins in reversed(list(zip(PROBE_ROWS, faster))):
        if not wins:
            break
        wide_from = rows
    return wide_from


def choice_key(layer: QuantizedLinear, dtype: torch.dtype) -> str:
    """The cached choice's key of a layer's shape. The dense copies take the few-row bf16 kernel where it
    measures faster (verification widths up to 16 rows), so the width they take over from is measured
    with it: its build is part of the key."""
    return (f"{layer.in_features}x{layer.out_features}-{layer.scheme.name}-{dtype}"
            f"-bf16kernel{build.source_digest(gemv_cpu.SOURCE)}-probed{PROBE_ROWS[0]}-{PROBE_ROWS[-1]}")


def attach_wide_kernels(module: nn.Module, dtype: torch.dtype) -> dict[str, int]:
    """Give every quantised layer of `module` whose shape measures faster densely at verify widths
    its dense packed copy and the width it takes over from (`QuantizedLinear.wide`). Returns {"KxN": wide_from} for the shapes that got one."""
    layers = [m for m in module.modules() if isinstance(m, QuantizedLinear) and not m.is_view]
    layers = [m for m in layers if m._uses_kernel(dtype, m.qweight.device)]
    if not layers or not can_pack(dtype, layers[0].qweight.device):
        return {}
    by_shape: dict[str, list[QuantizedLinear]] = {}
    for layer in layers:
        by_shape.setdefault(choice_key(layer, dtype), []).append(layer)
    cached, chosen, measured = load_choices(), {}, False
    for key, group in by_shape.items():
        if key in cached and cached[key] is None:  # never faster here: no copy to build
            continue
        dense = [PackedLinear(layer.dequantize().to(dtype), layer.bias) for layer in group]
        attach_few_row_kernels(nn.ModuleList(dense), dtype)
        if key not in cached:
            cached[key] = measure_wide_from(group, dense, dtype)
            measured = True
        wide_from = cached[key]
        if wide_from is None:
            continue
        for layer, copy in zip(group, dense):
            layer.wide = (copy, wide_from)
        chosen[key.split("-")[0]] = wide_from
    if measured:
        save_choices(cached)
    if chosen:
        log.info("quantised layers take their dense copy from these widths on (rows): %s", chosen)
    return chosen
