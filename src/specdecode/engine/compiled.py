"""torch.compile of a model forward that takes a ragged `AttentionBatch` (target, draft model, EAGLE/MTP).

Decode, verify and drafting forwards are compiled with dynamic shapes; prefill-sized ones
(more than `COMPILED_MAX_TOKENS` new tokens per sequence) run eager. One graph is made per
kind of forward, the first time that kind runs: batch 1 or more x 1 or more new tokens (PyTorch
specialises sizes 0 and 1), times the hidden-state taps asked for. Every width, batch size and
context after reuses them (tests/test_compile.py counts them). A quantised target whose layers
take a dense copy from some width on (models/wide_kernels.py) makes that choice inside one custom
op per layer (`specdecode::quantized_linear`), so it adds no graph; so do int8 layers with the
few-row kernel (`specdecode_int8::int8_linear`, a C++ op: a Python custom op's wrappers measured
about 22 us a call, more than a one-row matmul). The compile time is logged and summed in
`seconds`.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

log = logging.getLogger(__name__)

COMPILED_MAX_TOKENS = 64  # forwards with more new tokens per sequence (prefills, catch-ups) run eager


def apply_compile_settings() -> None:
    """Dynamo settings every compiled forward needs (they act when a graph is compiled):

    - No "duck" sizes: two dimensions equal once (4 sequences in 4 KV slots) must not become a
      guard that the next batch breaks.
    - Python ints are constants: traced as symbols, the hidden taps went wrong (`i in taps`
      was false, no tap came back); no forward reads an int that changes between steps.
    - 4 kinds of forward x 2 tap sets (profiling, drafting) fit the recompile limit with room.

    Set once for the process when the first compiled forward is made: patching them around each
    call measured 24-66 us, paid on every decode and drafting step. They also apply to any other
    `torch.compile` in the same process."""
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False
    dynamo_config.specialize_int = True
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 32)


class CompiledForward:
    """`forward(*args, batch=..., **kwargs)` compiled (enabled) or called as is (eager)."""

    def __init__(self, forward: Callable, enabled: bool, name: str):
        self.eager = forward
        self.enabled = enabled
        self.name = name
        if enabled:
            apply_compile_settings()
        self.compiled = torch.compile(forward, dynamic=True) if enabled else None
        self.seconds = 0.0  # wall time of the calls that compiled a new graph
        self.num_graphs = 0

    def __call__(self, num_new_tokens: int, batch, *args, **kwargs):
        """`num_new_tokens`: the forward's padded width T (prefill-sized ones run eager)."""
        if self.compiled is None or num_new_tokens > COMPILED_MAX_TOKENS:
            return self.eager(*args, batch=batch, **kwargs)
        from torch._dynamo.utils import counters

        # One code path for every batch: the slice fast paths would each be another graph (their
        # branches and integer values are guarded on), and compiled gathers cost little.
        batch.slot_range = batch.write_start = None
        before = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        out = self.compiled(*args, batch=batch, **kwargs)
        new = counters["stats"]["unique_graphs"] - before
        if new:
            seconds = time.perf_counter() - start
            self.seconds += seconds
            self.num_graphs += new
            log.info("compiled %d new graph(s) of the %s forward in %.1fs (%d in all, %.1fs)", new, self.name,
                     seconds, self.num_graphs, self.seconds)
        return out
