"""Measuring which kernel is faster for a layer shape, by width, on this machine, and caching the
choice (by shape, scheme, dtype, threads, torch and CPU), so every start of the same setup runs
the same kernels. Used by the per-width kernel choices of served layers: the dense copy of
quantised layers for verification widths (`models/wide_kernels.py`) and the few-row bf16 and
int8 kernels for decode widths (`models/inference.py`).

Each candidate is timed on up to `PROBE_LAYERS` layers of the shape, their weights evicted from
the caches before each call (a forward reads a model's weights from memory: in-cache timing hid
the int kernels' one-row advantage), the fastest of a few calls per layer, summed; candidate and
baseline alternate for PROBE_ROUNDS rounds, the fastest round of each compared. A width the
candidate loses is measured again, PROBE_CONFIRM more times, and lost only if lost every time:
a first start during a compile once cached the few-row bf16 kernel off from 4 rows for the down
projection alone (it is ~2x faster there on a quiet machine), which kept every bf16 verification
of 3 or more tokens off the C++ lean path (a 4-5-token forward 0.96-1.11 ms against 0.70-0.77).
A width lost within MARGIN (the candidate at most 1 / MARGIN slower) is a tie: a few-row kernel's
widths go on past it to the widest it wins (the int8 kernel against float32 weights measured
0.84-1.11x at 8 rows and 0.50-0.61x at 16, and ending at the tie served 5-8-row verifications from
the float32 weights, in a probe that chose 4 rows for three of the default model's layer shapes).
"""

from __future__ import annotations

import json
import logging
import time

import torch

log = logging.getLogger(__name__)

MARGIN = 0.95  # a candidate must be this much faster: a near tie keeps the baseline (less memory)
FLUSH_BYTES = 64 << 20  # written between timed calls: more than the last-level cache of most CPUs we serve on
PROBE_LAYERS = 4  # layers of a shape timed per probe
PROBE_ROUNDS = 3  # alternating rounds of candidate and baseline per width
PROBE_CONFIRM = 2  # further measurements of a width the candidate lost, before it counts as lost


def cache_path():
    """The choices of this CPU, thread count and torch (one JSON file of {key: choice})."""
    # -p2: choices made since a lost width is confirmed (PROBE_CONFIRM); -p3: since a tie does not end a
    # few-row kernel's widths. Earlier files are measured again.
    return _cache_dir() / f"{_machine()}-p3.json"


def _cache_dir():
    from specdecode.defaults import cache_root

    return cache_root() / "wide_kernels"


def _machine() -> str:
    from specdecode.kernels.build import cpu_fingerprint

    return f"{cpu_fingerprint()}-t{torch.get_num_threads()}"


def cold_seconds(layers: list, x: torch.Tensor, flush: torch.Tensor, repeats: int = 3) -> float:
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
def faster_by_width(candidate: list, baseline: list, in_features: int, dtype: torch.dtype,
                     widths: tuple[int, ...]) -> list[bool | None]:
    """For each width: True where the `candidate` callables beat the `baseline` ones (same layers) by
    MARGIN; else None for a tie (the last measurement within MARGIN the other way), False for a loss."""
    flush = torch.zeros(FLUSH_BYTES // 4)
    candidate, baseline = candidate[:PROBE_LAYERS], baseline[:PROBE_LAYERS]
    verdicts = []
    for rows in widths:
        x = torch.randn(rows, in_features, dtype=dtype)
        cold_seconds(candidate, x, flush, 1), cold_seconds(baseline, x, flush, 1)  # warm-up
        measured = []  # (candidate, baseline) seconds of each measurement

        def lost(c: float, b: float) -> bool:
            measured.append((c, b))
            return not c < MARGIN * b

        if not every_measurement(lambda: cold_seconds(candidate, x, flush), lambda: cold_seconds(baseline, x, flush),
                                 lost):
            verdicts.append(True)
        else:
            c, b = measured[-1]
            verdicts.append(None if MARGIN * c <= b else False)
    return verdicts


def every_measurement(time_a, time_b, holds) -> bool:
    """Whether `holds(a, b)` in each of 1 + PROBE_CONFIRM measurements of the seconds of `time_a()` and
    `time_b()` (stopping at the first where it does not). A measurement alternates PROBE_ROUNDS rounds of
    the two and keeps the fastest of each: a burst of load (another process on a 2-core machine) hits both,
    not just the one timed during it (a single round measured the int8 LM head slower under its kernel
    during a build, and the cached choice kept it off)."""
    for _ in range(1 + PROBE_CONFIRM):
        a = b = float("inf")
        for _ in range(PROBE_ROUNDS):
            a, b = min(a, time_a()), min(b, time_b())
        if not holds(a, b):
            return False
    return True


def forget_choices() -> list:
    """Delete this machine's cached choices (every probe version's file for this CPU and thread
    count), so the next load measures every shape again: a choice made while the machine was busy
    is otherwise kept for good. Returns the deleted files."""
    machine, deleted = _machine(), []
    for path in sorted(_cache_dir().glob(machine + "*.json")):
        if path.name == machine + ".json" or path.name.startswith(machine + "-"):  # not another thread count's
            path.unlink(missing_ok=True)
            deleted.append(path)
    return deleted


def load_choices() -> dict:
    """Every cached choice (empty when none or unreadable: they are measured again)."""
    path = cache_path()
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def save_choices(cached: dict) -> None:
    """Write the choices atomically."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)
    except OSError as e:  # a read-only cache costs a new measurement next start, nothing else
        log.warning("could not write the kernel choices %s: %s", path, e)
