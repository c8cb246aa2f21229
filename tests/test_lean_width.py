"""The C++ lean path widened past the layers' own few-row kernel widths (engine/lean_width.py)."""

from __future__ import annotations

import pytest
import torch

from specdecode import LLM
from specdecode.engine import engine, lean_width
from specdecode.engine.ragged import ForwardEntry
from specdecode.kernels import decode_stack_cpu, gemm_a8_cpu, gemv_cpu
from specdecode.models import kernel_probe, llama, native_stack
from specdecode.models.inference import PackedLinear

faster_by_width = kernel_probe.faster_by_width

pytestmark = pytest.mark.skipif(
    decode_stack_cpu.extension() is None or not gemm_a8_cpu.available("cpu")
    or not gemv_cpu.fits(128, torch.bfloat16, "cpu"),
    reason="the bf16 lean path needs a C++ compiler, AVX-512 VNNI and AVX-512 BF16")


@pytest.fixture
def choices(monkeypatch) -> dict:
    """The kernel choices' cache, in memory (a cache directory of its own would build the C++ kernels again)."""
    store: dict = {}
    monkeypatch.setattr(kernel_probe, "load_choices", lambda: dict(store))
    monkeypatch.setattr(kernel_probe, "save_choices", store.update)
    return store


@pytest.fixture
def narrow_llm(lean_model, choices, monkeypatch):
    """A bf16 engine whose gate_up layers take the few-row kernel up to 2 rows and every other block
    layer up to 16 (so its lean path serves 1-2 tokens)."""

    def faster(candidate, baseline, in_features, dtype, widths):
        gate_up = candidate[0].keywords["layer"].split_sizes is not None and in_features == 128 and \
            candidate[0].keywords["layer"].out_features > 3 * 128
        return [w <= 2 for w in widths] if gate_up else [True] * len(widths)

    monkeypatch.setattr(kernel_probe, "faster_by_width", faster)
    monkeypatch.setattr(engine, "widen_lean_path", lambda runner: 0)  # the engine's own call: tested below
    llm = LLM(lean_model, dtype="bfloat16", max_num_seqs=2)
    monkeypatch.setattr(kernel_probe, "faster_by_width", faster_by_width)
    monkeypatch.setattr(engine, "widen_lean_path", lean_width.widen_lean_path)
    widths = sorted({m.few_rows[-1] for m in llm.model.model.layers.modules() if isinstance(m, PackedLinear)})
    assert widths == [2, 16]
    return llm


def _scripted(monkeypatch, narrow_wins) -> list:
    """Forward seconds by script: the layers' own widths (lean_rows below the width) take 1.0 s where
    narrow_wins(width, call) says so, else 2.0; the lean path 1.5. Returns the (width, lean_rows) calls."""
    calls = []

    def seconds(runner, entry, lean_rows):
        width = len(entry[0].token_ids)
        calls.append((width, lean_rows))
        if lean_rows >= width:
            return 1.5
        return 1.0 if narrow_wins(width, sum(1 for w, r in calls if w == width and r < w)) else 2.0

    monkeypatch.setattr(lean_width, "_seconds", seconds)
    return calls


def test_the_lean_path_widens_up_to_where_the_layers_own_widths_win(narrow_llm, choices, monkeypatch):
    calls = _scripted(monkeypatch, lambda width, call: width >= 7)
    assert lean_width.widen_lean_path(narrow_llm.runner) == 6 == narrow_llm.model.lean_rows
    assert sorted({w for w, _ in calls}) == [3, 4, 5, 6, 7]  # widths 3 .. 7 measured, 8 .. 16 not
    rounds = kernel_probe.PROBE_ROUNDS * (1 + kernel_probe.PROBE_CONFIRM)  # 7 lost every confirmation
    assert sum(1 for w, r in calls if w == 7 and r < w) == rounds
    assert {r for w, r in calls if r < w} == {0, 3, 4, 5, 6}  # against the width chosen so far
    # Cached: a second start reads it, measuring nothing.
    assert [v for k, v in choices.items() if k.startswith("lean-")] == [6]
    narrow_llm.model.lean_rows = 0
    calls.clear()
    assert lean_width.widen_lean_path(narrow_llm.runner) == 6 and calls == []


def test_a_width_the_layers_own_widths_win_once_is_measured_again(narrow_llm, monkeypatch):
    # At width 3 they win the first measurement (a burst of load on the lean path's rounds) and lose the
    # next: 3 stays the lean path's. From 4 on they win every time.
    calls = _scripted(monkeypatch, lambda width, call: width >= 4 or call <= kernel_probe.PROBE_ROUNDS)
    assert lean_width.widen_lean_path(narrow_llm.runner) == 3


def test_the_widened_lean_path_equals_the_modules_bit_for_bit(narrow_llm, monkeypatch):
    # Measured for real (tiny model: whatever it finds), then forced to 9 tokens: a 9-token forward takes the
    # lean path and computes what the modules compute with every block layer on the few-row kernel at 9 rows.
    assert lean_width.widen_lean_path(narrow_llm.runner) == narrow_llm.model.lean_rows in {0, *range(3, 17)}
    model, runner = narrow_llm.model, narrow_llm.runner
    model.lean_rows = 9
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    steps = [[ForwardEntry(0, ids[:11], 0)], [ForwardEntry(0, ids[11:20], 11, num_logits=9)]]
    stack = native_stack.native_stack_for(model, llama.NATIVE_TYPES)
    before = stack.lean_forwards()
    ours = [runner.forward(entries) for entries in steps]
    assert stack.lean_forwards() == before + 2  # the 11-token prefill too, its linears past 9 rows on their own op
    for layer in model.model.layers.modules():
        if isinstance(layer, PackedLinear):
            layer.few_rows = (layer.few_rows[0], 16)
    model.lean_rows = 0
    with monkeypatch.context() as m:
        m.setattr(llama, "native_stack_for", lambda *args: None)
        m.setattr(llama, "native_chain_for", lambda *args: None)
        theirs = [runner.forward(entries) for entries in steps]
    assert all(torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden) for a, b in zip(ours, theirs))
    # The check can fail: one layer's kernel weight changed slightly changes the modules' result.
    layer = model.model.layers[0].mlp.gate_up
    blocked = layer.few_rows[0]
    layer.few_rows = (blocked + (blocked.float().abs() * 2 ** -6).bfloat16(), 16)
    with monkeypatch.context() as m:
        m.setattr(llama, "native_stack_for", lambda *args: None)
        m.setattr(llama, "native_chain_for", lambda *args: None)
        other = runner.forward(steps[1])
    assert not torch.equal(other.logits, ours[1].logits)


def test_a_float32_engine_is_not_probed(lean_model, choices, monkeypatch):
    measured = []
    monkeypatch.setattr(lean_width, "_measure", lambda runner, widths: measured.append(widths) or 16)
    assert LLM(lean_model, dtype="float32", max_num_seqs=1).model.lean_rows == 0 and measured == []
