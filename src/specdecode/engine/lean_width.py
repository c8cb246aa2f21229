"""How many tokens a bf16 model's C++ lean path serves, measured on whole forwards.

The few-row bf16 kernel is chosen per layer shape and width, each shape timed alone
(`models/inference.py attach_few_row_kernels`), and the C++ stack's lean path serves a forward
only where every block layer takes that kernel at its width (`decode_stack_cpu.cpp
Stack::lean_forward`): one shape that measured oneDNN faster at 4 rows sent every forward of 3 or
more tokens through ~75 aten calls a layer. Measured on a 2-core Intel Xeon with AMX (default
model, bf16, in situ, n-gram k=8 at batch 1): with the per-shape widths {qkv 16, o_proj 16,
down 8, gate_up 2} a 3-token forward took 2.9 ms and a 9-token one 4.7 ms; with every block layer
on the kernel, 1.75 and 3.4 ms (one token: 1.4-1.8 ms either way), and n-gram decoding ran 1.23-1.32x
faster. A shape timed alone does not see what its choice costs the forward around it.

So, where the layers' own widths leave the lean path's few-row kernel narrower than 16 tokens, whole
forwards at each wider width are timed both ways (alternating rounds, the fastest of each, as
`models/kernel_probe.py` times a shape), and the lean path gives every layer the kernel up to the
width before the first one at which the layers' own widths measured faster every time
(`LlamaForCausalLM.lean_rows`). Past that width the lean path still serves, each linear on its
layer's own op at that width (oneDNN's matmul; thirty-seventh pass: before, wider forwards took the
general path). The result is cached with the kernel choices (per CPU, thread count and kernel build),
so a start measures it once.
"""

from __future__ import annotations

import hashlib
import logging
import time

import torch

from specdecode.engine.ragged import ForwardEntry
from specdecode.kernels import build, decode_stack_cpu, gemv_cpu
from specdecode.models import kernel_probe
from specdecode.models.inference import PackedLinear
from specdecode.models.llama import NATIVE_TYPES
from specdecode.models.native_stack import native_stack_for

log = logging.getLogger(__name__)

REPEATS = 3  # forwards per timing, the fastest kept
# Every verification width up to 16 tokens: the two paths cross between the few-row kernel probe's
# coarse widths (Xeon with AMX: the lean path won at 8 tokens and lost at 16).
WIDTHS = tuple(range(2, 17))


def widen_lean_path(runner) -> int:
    """Measure (or read from the cache) and set `runner.model.lean_rows`; returns it (0: the layers' own
    widths). Only for eager bf16 models on a CPU whose stack the C++ lean path serves; it uses the
    runner's KV slot 0, so it must run before any request is admitted."""
    model = runner.model
    if (runner.device.type != "cpu" or runner.exact or runner.model_forward.enabled or runner.dtype != torch.bfloat16
            or native_stack_for(model, NATIVE_TYPES) is None):
        return 0
    layers = [m for m in model.model.layers.modules() if isinstance(m, PackedLinear)]
    if not layers or any(m.few_rows is None for m in layers):
        return 0  # a layer without the kernel's layout: the lean path cannot serve bf16 forwards
    narrowest = min(m.few_rows[-1] for m in layers)
    widths = [w for w in WIDTHS if w > narrowest and w + 1 < runner.max_len]
    if not widths:
        return 0
    key = _cache_key(layers, widths)
    cached = kernel_probe.load_choices()
    if key not in cached:
        cached[key] = _measure(runner, widths)
        kernel_probe.save_choices(cached)
        if cached[key]:
            log.info("the C++ lean path serves forwards of up to %d tokens (the layers' own kernel widths: %d)",
                     cached[key], narrowest)
    model.lean_rows = cached[key]
    return model.lean_rows


def _cache_key(layers: list[PackedLinear], widths: list[int]) -> str:
    """The block layers' shapes and kernel widths, the kernels' builds and the probed widths."""
    shapes = sorted(f"{m.in_features}x{m.out_features}:{m.few_rows[-1]}" for m in layers)
    sources = [build.source_digest(source) for source in (gemv_cpu.SOURCE, decode_stack_cpu.SOURCE)]
    digest = hashlib.sha256("|".join(shapes + sources + [str(w) for w in widths]).encode()).hexdigest()[:12]
    return f"lean-bf16-{digest}"


@torch.inference_mode()
def _measure(runner, widths: list[int]) -> int:
    """The widest of `widths` up to which the widened lean path is not measured slower: a width is the
    lean path's unless the layers' own widths beat it by MARGIN in each of 1 + PROBE_CONFIRM measurements
    (alternating rounds, the fastest forward of each). The benefit of the doubt goes to the lean path:
    timed alone, a forward of 9 tokens measured the two paths level (medians 4.0-5.4 ms each), while in situ
    the lean one ran n-gram k=8 decoding (verifying up to 9 tokens) 1.04-1.20x faster than a lean path
    of 8 (six passes interleaved prompt by prompt, the same tokens)."""
    model = runner.model
    context = min(128, runner.max_len - max(widths) - 1)
    runner.forward([ForwardEntry(0, list(range(3, 3 + context)), start=0)])  # a context to attend to
    chosen = 0
    try:
        model.lean_rows = widths[0]
        stack = native_stack_for(model, NATIVE_TYPES)  # built for this width: its count of lean forwards at 0
        runner.forward([ForwardEntry(0, list(range(5, 5 + widths[0])), start=context, num_logits=widths[0])])
        if stack is None or stack.lean_forwards() == 0:
            return 0  # the lean path does not serve this model (its attention heads, say): nothing to widen
        for width in widths:
            entry = [ForwardEntry(0, list(range(5, 5 + width)), start=context, num_logits=width)]
            if kernel_probe.every_measurement(lambda: _seconds(runner, entry, width),
                                              lambda: _seconds(runner, entry, chosen),
                                              lambda lean, narrow: narrow < kernel_probe.MARGIN * lean):
                break  # the layers' own widths won every time
            chosen = width
    finally:
        model.lean_rows = chosen
    return chosen


def _seconds(runner, entry: list[ForwardEntry], lean_rows: int) -> float:
    """The fastest of REPEATS forwards of `entry` with the model's lean path serving up to `lean_rows` tokens."""
    runner.model.lean_rows = lean_rows
    runner.forward(entry)  # warm-up (and the C++ stack rebuilt for this setting)
    fastest = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        runner.forward(entry)
        fastest = min(fastest, time.perf_counter() - start)
    return fastest
