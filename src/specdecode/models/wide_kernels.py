"""A per-width choice of kernel for served linear layers, measured per layer shape on this machine.

Two choices live here. Verification widths under int8 / int4 (`attach_wide_kernels`, below),
and decode widths under bf16 (`attach_few_row_kernels`): a packed bf16 layer also keeps its
weight in the few-row kernel's layout (`kernels/gemv_cpu.py`), and forwards of at most
`few_rows` rows take that kernel, which streams the weights faster than oneDNN at one or two
rows; `few_rows` is the widest probe up to which it is faster at every narrower one. Costs the
bf16 weight's bytes a second time, only for shapes where it wins.

Quantised layers:

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

import functools
import json
import logging
import time

import torch
from torch import nn

from specdecode.models.inference import PackedLinear, can_pack
from specdecode.models.quant import QuantizedLinear

log = logging.getLogger(__name__)

PROBE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
MARGIN = 0.95  # the dense copy must be this much faster: a near tie keeps the int kernel (less memory)
FLUSH_BYTES = 64 << 20  # written between timed calls: more than the last-level cache of the CPUs we serve on
PROBE_LAYERS = 4  # layers of a shape timed per probe
# Widths the few-row kernel is probed at. Probed alone, small layers (512 -> 512, 512 -> 1024) measured
# it faster up to 8 rows, but whole forwards of 3-8 tokens measured 0.1-0.2 ms slower with it than
# with oneDNN (EAGLE-3 / MTP k=4 verification 4-6% slower end to end), and 1-2 rows 0.4-1.0 ms faster.
FEW_ROWS_PROBE = (1, 2)


def _cache_path():
    from specdecode.defaults import cache_root
    from specdecode.kernels.build import cpu_fingerprint

    return cache_root() / "wide_kernels" / f"{cpu_fingerprint()}-t{torch.get_num_threads()}.json"


def _cold_seconds(layers: list[nn.Module], x: torch.Tensor, flush: torch.Tensor, repeats: int = 3) -> float:
    """Seconds of one call on x, its weights out of the caches (as in a forward, which reads a model's
    weights from memory: in-cache timing hides the int kernels' 1-row advantage, which is bandwidth).
    The fastest of `repeats` per layer, summed over the layers."""
    total = 0.0
    for layer in layers:
        best = float("inf")
        for _ in range(repeats):
            flush.add_(1)  # evicts the caches
            start = time.perf_counter()
            layer(x)
            best = min(best, time.perf_counter() - start)
        total += best
    return total


@torch.inference_mode()
def _faster_by_width(candidate: list, baseline: list, in_features: int, dtype: torch.dtype,
                     widths: tuple[int, ...]) -> list[bool]:
    """For each width: whether the `candidate` callables beat the `baseline` ones (same layers) by MARGIN."""
    flush = torch.zeros(FLUSH_BYTES // 4)
    candidate, baseline = candidate[:PROBE_LAYERS], baseline[:PROBE_LAYERS]
    faster = []
    for rows in widths:
        x = torch.randn(rows, in_features, dtype=dtype)
        _cold_seconds(candidate, x, flush, 1), _cold_seconds(baseline, x, flush, 1)  # warm-up
        faster.append(_cold_seconds(candidate, x, flush) < MARGIN * _cold_seconds(baseline, x, flush))
    return faster


def measure_wide_from(layers: list[QuantizedLinear], dense: list[PackedLinear], dtype: torch.dtype) -> int | None:
    """The smallest probed width from which `dense` beats `layers` at every wider probe (None: never)."""
    faster = _faster_by_width(dense, layers, layers[0].in_features, dtype, PROBE_ROWS)
    wide_from = None
    for rows, wins in reversed(list(zip(PROBE_ROWS, faster))):
        if not wins:
            break
        wide_from = rows
    return wide_from


def _load_choices() -> dict:
    path = _cache_path()
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def _save_choices(cached: dict) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)
    except OSError as e:  # a read-only cache costs a new measurement next start, nothing else
        log.warning("could not write the kernel choices %s: %s", path, e)


def attach_few_row_kernels(module: nn.Module, dtype: torch.dtype) -> dict[str, int]:
    """Give every packed bf16 layer under `module` whose shape measures faster under the few-row
    kernel its blocked weight and the most rows it serves (`PackedLinear.few_rows`). Returns
    {"KxN": few_rows} for the shapes that got one."""
    from specdecode.kernels import gemv_cpu

    layers = [m for m in module.modules() if isinstance(m, PackedLinear) and m.few_rows is None]
    layers = [m for m in layers if gemv_cpu.fits(m.in_features, dtype, m.packed.device) and m.dtype == dtype]
    if not layers:
        return {}
    by_shape: dict[str, list[PackedLinear]] = {}
    for layer in layers:
        # The probed widths are part of the key: a choice made over other widths is not this one.
        by_shape.setdefault(f"{layer.in_features}x{layer.out_features}-few-rows{max(FEW_ROWS_PROBE)}-{dtype}",
                            []).append(layer)
    cached, measured, chosen = _load_choices(), False, {}
    for key, group in by_shape.items():
        blocked = [gemv_cpu.block_weight(layer.dense_weight()) for layer in group]
        if key not in cached:
            kernel = [functools.partial(_few_rows_call, w=w, layer=layer) for w, layer in zip(blocked, group)]
            faster = _faster_by_width(kernel, [layer._matmul for layer in group], group[0].in_features, dtype,
                                      FEW_ROWS_PROBE)
            few = 0
            for rows, wins in zip(FEW_ROWS_PROBE, faster):
                if not wins:
                    break
                few = rows
            cached[key], measured = few or None, True
        if cached[key] is None:
            continue
        for layer, w in zip(group, blocked):
            layer.few_rows = (w, cached[key])
        chosen[key.split("-")[0]] = cached[key]
    if measured:
        _save_choices(cached)
        if chosen:
            log.info("bf16 layers take the few-row kernel up to these widths (rows): %s", chosen)
    return chosen


def _few_rows_call(x: torch.Tensor, w: torch.Tensor, layer: PackedLinear) -> torch.Tensor:
    from specdecode.kernels.gemv_cpu import few_rows_linear

    return few_rows_linear(x, w, layer.bias, layer.out_features)


def detach_few_row_kernels(module: nn.Module) -> None:
    """Back to oneDNN at every width (exact mode: its row tilings are probed on oneDNN's kernel)."""
    for layer in module.modules():
        if isinstance(layer, PackedLinear):
            layer.few_rows = None


def attach_wide_kernels(module: nn.Module, dtype: torch.dtype) -> dict[str, int]:
    """Give every quantised layer of `module` whose shape measures faster densely at verify widths
    its dense packed copy and the width it takes over from (`QuantizedLinear.wide`). Returns {"KxN": wide_from} for the shapes that got one."""
    layers = [m for m in module.modules() if isinstance(m, QuantizedLinear) and not m.is_view]
    layers = [m for m in layers if m._uses_kernel(dtype, m.qweight.device)]
    if not layers or not can_pack(dtype, layers[0].qweight.device):
        return {}
    by_shape: dict[str, list[QuantizedLinear]] = {}
    for layer in layers:
        by_shape.setdefault(f"{layer.in_features}x{layer.out_features}-{layer.scheme.name}-{dtype}", []).append(layer)
    cached, chosen, measured = _load_choices(), {}, False
    for key, group in by_shape.items():
        dense = [PackedLinear(layer.dequantize().to(dtype), layer.bias) for layer in group]
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
        _save_choices(cached)
    if chosen:
        log.info("quantised layers take their dense copy from these widths on (rows): %s", chosen)
    return chosen
