"""The target's step time as a function of forward size, measured on the machine it runs on.

T(B, n): seconds for one target forward of B sequences with n new tokens each, over a
`context`-token KV cache. Verification of a ragged step with N tokens in total is priced at
T(B, N / B), interpolated linearly in n and in B between profiled points.

A short profile runs at engine start-up (few points, few repeats); `specdecode profile`
runs a thorough one. Both include a prefill-sized width (`PREFILL_WIDTH` tokens per sequence),
so that pricing a drafter's catch-up over many tokens interpolates instead of extrapolating
a decode-sized slope. Each point is the fastest of its repeats (timing noise on a shared CPU
only ever adds time), and the table is made monotone: a forward never costs less with more
sequences or more tokens, so a noisy point is replaced by the cheaper larger one. Results are
cached per model (path + weights' mtime), dtype, device, torch version, thread count and the
forward's C++ kernels (a kernel change moves step times: a cached profile priced 9-token forwards
at 1.4-1.5x what they cost once the attention kernel served them), in $SPECDECODE_CACHE (default
~/.cache/specdecode).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path

import torch

from specdecode.defaults import cache_root
from specdecode.engine.runner import ForwardEntry, Runner
from specdecode.kernels import attention_cpu, build, decode_stack_cpu
from specdecode.speculative.policy.estimators import clipped

log = logging.getLogger(__name__)

PREFILL_WIDTH = 32  # tokens per sequence of the profile's prefill-sized point
PROFILE_VERSION = 3  # cached profiles of another version are re-measured (3: points timed in interleaved rounds)


@dataclasses.dataclass(slots=True)
class CostModel:
    table: dict[int, dict[int, float]]  # batch size B -> {tokens per sequence n: seconds}
    context: int
    # Sorted keys, computed once: the depth policies price thousands of forwards per second.
    sizes: list[int] = dataclasses.field(init=False, repr=False, compare=False)
    widths: dict[int, list[int]] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.sizes = sorted(self.table)
        self.widths = {b: sorted(row) for b, row in self.table.items()}

    def step_time(self, batch_size: int, total_tokens: int) -> float:
        """Seconds for a forward of `batch_size` sequences carrying `total_tokens` new tokens."""
        n = total_tokens / max(1, batch_size)
        sizes = self.sizes
        i = bisect.bisect_left(sizes, batch_size)
        if i == 0:
            return self._at(sizes[0], n)
        if i == len(sizes):  # beyond the profile: scale the largest linearly (compute-bound regime)
            return self._at(sizes[-1], n) * batch_size / sizes[-1]
        lo, hi = sizes[i - 1], sizes[i]
        w = (batch_size - lo) / (hi - lo)
        return (1 - w) * self._at(lo, n) + w * self._at(hi, n)

    def _at(self, batch_size: int, n: float) -> float:
        row = self.table[batch_size]
        widths = self.widths[batch_size]
        j = bisect.bisect_left(widths, n)
        if j < len(widths) and widths[j] == n:
            return row[widths[j]]
        if j == 0:
            return row[widths[0]]
        if j == len(widths):  # extrapolate with the last slope
            a, b = widths[-2:] if len(widths) > 1 else (widths[-1], widths[-1])
            slope = (row[b] - row[a]) / (b - a) if b != a else 0.0
            return row[b] + slope * (n - b)
        a, b = widths[j - 1], widths[j]
        return row[a] + (row[b] - row[a]) * (n - a) / (b - a)

    def to_json(self) -> dict:
        table = {str(b): {str(n): t for n, t in row.items()} for b, row in self.table.items()}
        return {"version": PROFILE_VERSION, "context": self.context, "table": table}

    @classmethod
    def from_json(cls, data: dict) -> "CostModel":
        return cls({int(b): {int(n): float(t) for n, t in row.items()} for b, row in data["table"].items()}, int(data["context"]))


class LiveCost:
    """The profile at the measured level and, where steps of a width have run, the measured shape.

    A profile is one snapshot of a machine whose speed drifts (measured here: +-25% over tens
    of seconds), and a start-up profile taken while the machine was busy is cached and reused:
    one such profile priced batch-1 steps at 15.8 ms that took 11 ms, and batch-16 steps at 20 ms
    that took 12 ms. So every served step's measured time outside drafting is compared with the
    profile's price of its forward, and an EMA of that ratio per batch-size bucket (powers of two)
    scales the profile (the level); a bucket not measured yet takes the nearest measured one's level.
    The ratio also carries what the profile never sees (sampling, verification, bookkeeping).

    That part is roughly constant per step, not proportional to the forward, and the profile's own
    points are noisy, so one level per bucket keeps the profile's shape across widths where the
    engine's differs (traced, batch 1, bf16: verifying 5 tokens measured 1.09x a one-token step
    where the cached profile priced 1.42x, and D-Cut verified 1-2 drafts where fixed k=4 paid most).
    So each width (tokens per sequence, rounded) keeps its own EMA of ratio / level, its shape
    correction, used once `min_samples` steps measured it; other widths take the nearest measured
    width's (the guard's deeper probes measure the next width up).

    The level is the machine's speed alone: a step moves it by its ratio over its width's correction,
    and only once that width is measured; a width's first steps set its correction at the level of
    the moment. A level moved by every step's raw ratio followed the mix of widths instead: traced,
    MTP k=3 D-Cut at W4A8, batch 1, it read 1.61 over drafting steps (their width-4 verification cost
    ~2.8x a one-token forward, the profile priced 1.3x) and 0.76 over plain ones, so the guard, which
    divides step times by it, measured drafting at 0.91x plain decoding where raw times gave 0.56x (in
    another run at 1.59x, and drafting went on; beside a plain engine in one process that configuration
    ran at 0.85-0.95x its speed). Corrections move at `shape_weight`, a tenth of the level's: in a phase
    of one width the two EMAs see the same steps, and the faster one takes most of a change in the
    machine's speed.
    """

    def __init__(self, profile: CostModel, weight: float = 0.1, min_samples: int = 4, reprice_every: int = 1,
                 shape_weight: float = 0.01):
        self.profile = profile
        self.weight = weight
        self.shape_weight = shape_weight
        self.min_samples = min_samples
        self.scale: dict[int, float] = {}  # batch-size bucket (bit length) -> measured / profiled
        # bucket -> {width: [EMA of ratio / level, steps, the bucket's `observed` count at its last step]}
        self.shape: dict[int, dict[int, list[float]]] = {}
        self.observed: dict[int, int] = {}  # bucket -> steps observed
        self.measured: dict[int, tuple[list[int], list[float]]] = {}  # bucket -> widths with min_samples, corrections
        # Prices asked since the last repricing, which comes every `reprice_every` observations (`epoch` counts
        # them): one step's policies price the same few forwards ~20 times (auto-k, D-Cut's stop rule, its
        # cut), ~3 us each on the caches a forward left cold, and an EMA moving 10% a step changes a price
        # little in a few steps (`DepthController` reprices every 8 and keeps its own decisions as long).
        self._prices: dict[tuple[int, int], float] = {}
        self.reprice_every = reprice_every
        self.epoch = 0
        self._since_reprice = 0

    def factor(self, batch_size: int) -> float:
        """The level: measured / profiled step time in this batch size's bucket (the machine's speed)."""
        if not self.scale:
            return 1.0
        bucket = batch_size.bit_length()
        return self.scale.get(bucket) or self.scale[min(self.scale, key=lambda b: abs(b - bucket))]

    def step_time(self, batch_size: int, total_tokens: int) -> float:
        key = (batch_size, total_tokens)
        price = self._prices.get(key)
        if price is None:
            profiled = self.profile.step_time(batch_size, total_tokens)
            price = self._prices[key] = self.factor(batch_size) * self._shape(batch_size, total_tokens) * profiled
        return price

    def _shape(self, batch_size: int, total_tokens: int) -> float:
        measured = self.measured.get(batch_size.bit_length())
        if measured is None:
            return 1.0
        widths, corrections = measured
        n = total_tokens / max(1, batch_size)
        i = bisect.bisect_left(widths, n)
        if i == len(widths) or (i > 0 and n - widths[i - 1] < widths[i] - n):
            i -= 1
        return corrections[i]

    def stale(self, batch_size: int, total_tokens: int, horizon: int) -> bool:
        """Whether this forward's width has fewer than `min_samples` steps measured in its bucket, or
        none among the bucket's last `horizon` steps (its price is then the profile's shape, or an old
        measurement of it)."""
        bucket = batch_size.bit_length()
        entry = self.shape.get(bucket, {}).get(round(total_tokens / max(1, batch_size)))
        return entry is None or entry[1] < self.min_samples or self.observed.get(bucket, 0) - entry[2] > horizon

    def observe(self, batch_size: int, total_tokens: int, seconds: float) -> None:
        """A step's measured seconds outside drafting, for a forward of these dimensions."""
        self._since_reprice += 1
        if self._since_reprice >= self.reprice_every:
            self._prices.clear()
            self._since_reprice, self.epoch = 0, self.epoch + 1
        bucket = batch_size.bit_length()
        count = self.observed[bucket] = self.observed.get(bucket, 0) + 1
        old = self.scale.get(bucket)
        widths = self.shape.setdefault(bucket, {})
        width = round(total_tokens / max(1, batch_size))
        entry = widths.setdefault(width, [1.0, 0, 0])
        known = entry[1] >= self.min_samples  # the width's correction is measured
        correction = entry[0] if known else self._shape(batch_size, total_tokens)  # else the nearest measured one's
        ratio = clipped(seconds / self.profile.step_time(batch_size, total_tokens),
                        None if old is None else old * correction)
        if old is None:  # the bucket's first step: its width's correction starts at 1
            level = self.scale[bucket] = ratio
        elif known:  # the machine's speed: moved by ratio / correction
            level = self.scale[bucket] = (1 - self.weight) * old + self.weight * ratio / correction
        else:  # the width's own cost is what its first steps measure
            level = old
        entry[1] += 1
        entry[2] = count
        # The plain mean of the steps that measure the width, then a slow EMA
        w = 1 / entry[1] if entry[1] <= self.min_samples else self.shape_weight
        entry[0] = (1 - w) * entry[0] + w * ratio / level
        if entry[1] >= self.min_samples:
            measured = self.measured.get(bucket)
            if measured is None or entry[1] == self.min_samples:  # a width joins the measured ones
                ready = sorted(n for n, (_, steps, _) in widths.items() if steps >= self.min_samples)
                self.measured[bucket] = (ready, [widths[n][0] for n in ready])
            else:
                measured[1][measured[0].index(width)] = entry[0]


def cache_path(model_dir: Path, dtype: torch.dtype, device: torch.device, variant: str = "") -> Path:
    """`variant`: what else changes the forward's speed (the weights' quantisation, compilation)."""
    weights = sorted(Path(model_dir).glob("*.safetensors"))
    stamp = [str(Path(model_dir).resolve())] + [f"{w.name}:{w.stat().st_mtime_ns}" for w in weights]
    kernels = [build.source_digest(source) for source in (decode_stack_cpu.SOURCE, attention_cpu.SOURCE)]
    key = "|".join(stamp + [str(dtype), str(device), torch.__version__, str(torch.get_num_threads())] + kernels
                   + ([variant] if variant else []))
    return cache_root() / "cost" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")


@torch.inference_mode()
def profile(runner: Runner, batch_sizes: list[int], widths: list[int], context: int = 128, repeats: int = 3) -> CostModel:
    """Time target forwards of B sequences x n new tokens after a `context`-token prefix.

    Uses the runner's own cache slots (writes past every sequence's length are overwritten
    later), so it must run before requests are admitted."""
    context = min(context, runner.max_len - max(widths) - 1)
    num_slots = runner.kv_cache.num_slots
    prefix = list(range(3, 3 + context))
    runner.forward([ForwardEntry(s, prefix, start=0) for s in range(min(num_slots, max(batch_sizes)))])
    points = list(dict.fromkeys((min(B, num_slots), n) for B in batch_sizes for n in widths))
    entries = {(B, n): [ForwardEntry(s, list(range(5, 5 + n)), start=context, num_logits=n) for s in range(B)]
               for B, n in points}
    for point in points:
        runner.forward(entries[point])  # warm-up for this shape
    # Round-robin over the points, the fastest of each point's repeats: a slow spell of the machine
    # (seconds long here) then costs every point a repeat, not all repeats of the points it hits
    # (with each point's repeats back to back, a cached profile priced batch-1 widths 3 and 5 at
    # 1.4x width 1; four profiles taken in a row: 1.0-1.27x).
    table: dict[int, dict[int, float]] = {B: {} for B, _ in points}
    for _ in range(repeats):
        for B, n in points:
            t0 = time.perf_counter()
            runner.forward(entries[B, n])
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            table[B][n] = min(table[B].get(n, elapsed), elapsed)
    return CostModel(monotone(table), context)


def monotone(table: dict[int, dict[int, float]]) -> dict[int, dict[int, float]]:
    """Each point becomes the cheapest of itself and every point with at least as many sequences
    and tokens per sequence (noise on a busy machine only ever adds time)."""
    out = {B: dict(row) for B, row in table.items()}
    sizes = sorted(out, reverse=True)
    for i, B in enumerate(sizes):
        for n in sorted(out[B], reverse=True):
            cheaper = [out[B][m] for m in out[B] if m > n] + [out[C][n] for C in sizes[:i] if n in out[C]]
            out[B][n] = min([out[B][n], *cheaper])
    return out


def load_or_profile(runner: Runner, model_dir: Path, max_batch: int, max_width: int, thorough: bool = False) -> CostModel:
    variant = [runner.quantization.name] if runner.quantization is not None else []
    variant += ["compiled"] if runner.model_forward.enabled else []
    variant += ["exact"] if runner.exact else []
    variant += [f"lean{runner.model.lean_rows}"] if getattr(runner.model, "lean_rows", 0) else []  # engine/lean_width.py
    # Quantised layers with a dense copy for wide forwards (models/wide_kernels.py): their widths' cost, as chosen
    variant += sorted({f"wide{m.wide[1]}" for m in runner.model.modules() if getattr(m, "wide", None) is not None})
    path = cache_path(model_dir, runner.dtype, runner.device, "+".join(variant))
    if path.is_file() and not thorough:
        try:
            data = json.loads(path.read_text())
            model = CostModel.from_json(data)
            covers = (max(model.table) >= min(max_batch, runner.kv_cache.num_slots)
                      and max(max(r) for r in model.table.values()) >= max_width)
            if data.get("version") == PROFILE_VERSION and covers:
                return model
        except (json.JSONDecodeError, KeyError, ValueError):
            pass  # a stale or broken cache file is simply re-measured
    sizes = sorted({1, *[2 ** i for i in range(1, 8) if 2 ** i < max_batch], max_batch})
    widths = list(range(1, max_width + 1)) if thorough else sorted({1, 2, 3, max(1, max_width // 2), max_width})
    widths = sorted({*widths, max(PREFILL_WIDTH, max_width + 1)})
    start = time.perf_counter()
    model = profile(runner, sizes, widths, repeats=7 if thorough else 3)
    log.info("profiled the target's step time (%d points) in %.1fs", len(sizes) * len(widths), time.perf_counter() - start)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(model.to_json(), indent=2))
    return model


def plot(model: CostModel, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for B, row in sorted(model.table.items()):
        ns = sorted(row)
        ax.plot([B * n for n in ns], [row[n] * 1000 for n in ns], marker="o", label=f"batch {B}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in the forward (batch x new tokens per sequence)")
    ax.set_ylabel("target step time (ms)")
    ax.set_title(f"target forward cost, context {model.context}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
