"""The layer stack as one C++ call (models/native_stack.py, kernels/decode_stack_cpu.cpp): bit-identical
to the Python modules for every batch it serves, and never serving what it does not reproduce."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import bf16_copy, make_hf_model, make_native_model

from specdecode import LLM, SamplingParams
from specdecode.engine.ragged import ForwardEntry
from specdecode.kernels import decode_stack_cpu, gemm_a8_cpu, gemv_bf16w_cpu, gemv_cpu, gemv_int8_cpu
from specdecode.models import kernel_probe, llama, native_stack, wide_kernels
from specdecode.models.inference import Bf16WeightLinear, PackedLinear, can_pack, detach_few_row_kernels
from specdecode.models.quant import QuantizedLinear
from specdecode.models.layers import AttentionBatch

pytestmark = pytest.mark.skipif(decode_stack_cpu.extension() is None, reason="the C++ stack needs a C++ compiler")


@pytest.fixture
def forced_kernels(monkeypatch):
    """Every int8 / int4 shape takes its few-row kernel up to its widest probe, whatever this machine measures."""
    monkeypatch.setattr(kernel_probe, "faster_by_width", lambda candidate, baseline, k, dtype, widths: [True] * len(widths))
    monkeypatch.setattr(kernel_probe, "load_choices", dict)
    monkeypatch.setattr(kernel_probe, "save_choices", lambda cached: None)


class CallList(list):
    chains: list[int]
    batches: list[int]

    def __init__(self):
        super().__init__()
        self.chains = []
        self.batches = []


@pytest.fixture
def stack_calls(monkeypatch) -> list[int]:
    """The forwards C++ stacks ran: the token counts of whole models' (more than one block, per
    sequence), then (blocks, tokens) of single blocks'; `calls.chains`: the token counts of those that
    ran with their embedding and LM head as one call (a runner's one-sequence forward); `calls.batches`:
    the token counts of each batch of several sequences that ran as one call on the lean path."""
    calls = CallList()
    forward = native_stack.NativeStack.forward

    def counted(self, x, cos, sin, batch, cache_k, *args, **kwargs):
        calls.append(x.shape[1] if len(cache_k) > 1 else (1, x.shape[1]))
        return forward(self, x, cos, sin, batch, cache_k, *args, **kwargs)

    def counted_chain(self, chain, cache_k, cache_v, token_ids, *args):
        calls.append(len(token_ids))
        calls.chains.append(len(token_ids))
        return chain_forward(self, chain, cache_k, cache_v, token_ids, *args)

    def counted_batch(self, token_ids, *args):
        out = forward_batch(self, token_ids, *args)
        if out is not None:  # else the ragged batch runs through NativeStack.forward
            calls.append(max(len(row) for row in token_ids))
            calls.batches.append([len(row) for row in token_ids])
        return out

    chain_forward = native_stack.NativeStack.chain_forward
    forward_batch = native_stack.NativeChain.forward_batch
    monkeypatch.setattr(native_stack.NativeStack, "forward", counted)
    monkeypatch.setattr(native_stack.NativeStack, "chain_forward", counted_chain)
    monkeypatch.setattr(native_stack.NativeChain, "forward_batch", counted_batch)
    return calls


def _steps(vocab: int) -> list[list[ForwardEntry]]:
    """Prefill, a decode step (every query sees every key: no mask), a chain verify (causal mask),
    two sequences decoding side by side, a tree verify (its mask), two sequences at different
    columns (a ragged batch: written by index), two at rows out of order (read by a gather), a
    decode step of two sequences at rows out of order and different columns, and two verifications
    of two sequences (chains of 4 and 3 tokens, logits at 4 and 2 of them; 3 and 3)."""
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    return [[ForwardEntry(0, ids(9), 0)], [ForwardEntry(0, ids(1), 9)],
            [ForwardEntry(0, ids(5), 10, num_logits=5)],
            [ForwardEntry(0, ids(1), 15), ForwardEntry(1, ids(1), 15)],
            [ForwardEntry(0, ids(3), 16, num_logits=3, tree_mask=tree)],
            [ForwardEntry(0, ids(2), 19, num_logits=2), ForwardEntry(1, ids(1), 16)],
            [ForwardEntry(1, ids(1), 17), ForwardEntry(0, ids(2), 21, num_logits=2)],
            [ForwardEntry(1, ids(1), 18), ForwardEntry(0, ids(1), 23)],
            [ForwardEntry(0, ids(4), 24, num_logits=4), ForwardEntry(1, ids(3), 19, num_logits=2)],
            [ForwardEntry(1, ids(3), 22, num_logits=3), ForwardEntry(0, ids(3), 28, num_logits=3)]]


@pytest.mark.parametrize("form", ["C++", "Python"])
def test_a_watch_sees_a_replaced_or_deleted_attribute(form, monkeypatch):
    # What a C++ object was built on, checked before every forward: in one C++ loop where the stack's
    # extension is built, else by Python's lookups; both see a replaced parameter, a replaced plain
    # attribute and a deleted one, and nothing where nothing changed.
    if form == "Python":
        monkeypatch.setattr(native_stack.decode_stack_cpu, "extension", lambda: None)
    module = torch.nn.Linear(2, 2)
    module.plain = object()
    watch = native_stack.Watch()
    watch.get(module, "weight")
    watch.get(module, "plain")
    assert watch.current()
    for change in (lambda: setattr(module, "weight", torch.nn.Parameter(torch.zeros(2, 2))),
                   lambda: setattr(module, "plain", object()), lambda: delattr(module, "plain")):
        change()
        assert not watch.current()
        watch = native_stack.Watch()
        watch.get(module, "weight")
        if hasattr(module, "plain"):
            watch.get(module, "plain")
        assert watch.current()


def _run(llm: LLM, steps, taps=(0, 1, 2)) -> list:
    return [llm.runner.forward(entries, hidden_taps=taps) for entries in steps]


def _assert_bit_identical(ours, theirs) -> None:
    """Logits whole (padding rows repeat a sequence's last), hidden states and taps at real tokens (a
    padded batch's padding rows are its padding tokens' states; the lean batch repeats the last row)."""
    def real(x: torch.Tensor, num_new: list[int]) -> list[torch.Tensor]:
        return [x[b, :n] for b, n in enumerate(num_new)]

    def equal(x: torch.Tensor, y: torch.Tensor, num_new: list[int]) -> bool:
        return all(torch.equal(p, q) for p, q in zip(real(x, num_new), real(y, num_new)))

    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert a.num_new == b.num_new, step
        assert torch.equal(a.logits, b.logits) and equal(a.hidden, b.hidden, a.num_new), step
        assert a.taps.keys() == b.taps.keys() and all(equal(a.taps[i], b.taps[i], a.num_new) for i in a.taps), step


def _compare(llm: LLM, stack_calls: list[int], monkeypatch) -> None:
    steps = _steps(llm.model.config.vocab_size)
    ours = _run(llm, steps)
    assert stack_calls == [9, 1, 5, 1, 3, 2, 2, 1, 4, 3]  # every step
    assert stack_calls.chains == [9, 1, 5]  # one sequence's chain: embedding to logits in one C++ call
    with monkeypatch.context() as m:
        m.setattr(llama, "native_stack_for", lambda *args: None)
        m.setattr(llama, "native_chain_for", lambda *args: None)
        m.setattr(llama, "native_block_for", lambda *args: None)
        theirs = _run(llm, steps)
    assert len(stack_calls) == 10
    _assert_bit_identical(ours, theirs)


def test_argmax_rows_picks_as_torch_argmax_does():
    """The C++ argmax a greedy step takes from the forward (`ForwardResult.argmax`) must be torch.argmax's
    pick in every case: the first of tied maxima (within 8 lanes, across lanes, in the tail), NaN as the
    largest (its first), infinities, and widths that are not a multiple of 8."""
    argmax_rows = decode_stack_cpu.extension().argmax_rows
    g = torch.Generator().manual_seed(0)
    rows = []
    for V in (1, 7, 8, 13, 8192, 8199):
        base = torch.randn(V, generator=g)
        rows.append(base)
        for at in ((0, V - 1), (V // 3, V // 2), (V - 1,), (3 % V, 11 % V, V - 2 if V > 2 else 0)):
            tied = base.clone()
            tied[list(at)] = 100.0
            rows.append(tied)
            nan = base.clone()
            nan[list(at)] = float("nan")
            rows.append(nan)
            inf = base.clone()
            inf[list(at)] = float("inf")
            rows.append(inf)
        rows += [torch.full((V,), float("-inf")), torch.zeros(V), -torch.zeros(V)]
    for row in rows:
        assert argmax_rows(row[None].contiguous()) == [int(row.argmax())], row
    batch = torch.randn(5, 8192, generator=g)
    assert argmax_rows(batch) == batch.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_paths_swiglu_computes_what_pytorchs_silu_and_mul_do(dtype):
    """The lean path's silu(gate) * up (kernels/swiglu.h) runs PyTorch's own silu arithmetic without its
    op: it must give `F.silu(gate).mul_(up)` bit for bit, in the vectorised steps and in each row's rest
    (widths that are not a multiple of the step), at the extremes of exp and on rows split over threads."""
    if not gemm_a8_cpu.available("cpu"):
        pytest.skip("the lean path needs AVX-512 VNNI")
    silu_mul_rows = decode_stack_cpu.extension().silu_mul_rows
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, 89.0, -89.0, 104.0, -104.0, 1e30,
                            -1e30, float("inf"), float("-inf"), float("nan")])
    for rows, width in [(1, 1), (1, 17), (2, 31), (3, 32), (1, 33), (2, 64), (3, 95), (1, 1408), (5, 1408),
                        (40, 1408)]:  # 40 x 1408 values: past PyTorch's grain, rows split over threads
        gate = torch.randn(rows, width, generator=g) * torch.tensor([0.5, 4.0, 30.0])[torch.arange(width) % 3]
        flat = gate.view(-1)
        flat[torch.randperm(flat.numel(), generator=g)[: len(special)]] = special[: flat.numel()]
        gate_up = torch.cat([gate, torch.randn(rows, width, generator=g) * 3], dim=1).to(dtype)
        ours = silu_mul_rows(gate_up)
        theirs = torch.nn.functional.silu(gate_up[:, :width]).mul_(gate_up[:, width:])
        assert torch.equal(ours.isnan(), theirs.isnan()), (rows, width)
        finite = ~theirs.isnan()
        assert torch.equal(ours[finite].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           theirs[finite].view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), (rows, width)


@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", "w4a8")])
def test_a_one_sequence_forward_asked_for_its_argmax_takes_torch_argmax_of_its_logits(native_model, stack_calls,
                                                                                       dtype, quantization):
    llm = LLM(native_model, dtype=dtype, quantization=quantization, max_num_seqs=2)
    for entries in _steps(llm.model.config.vocab_size):
        result = llm.runner.forward(entries, argmax=True)
        if len(entries) == 1 and entries[0].tree_mask is None:  # one sequence's chain: one C++ call
            assert result.argmax == [result.logits[0].argmax(dim=-1).tolist()]
        else:
            assert result.argmax is None
    assert stack_calls.chains == [9, 1, 5]
    assert llm.runner.forward(_steps(llm.model.config.vocab_size)[1]).argmax is None  # not asked


@pytest.mark.parametrize("dtype,quantization,kv_cache_dtype", [
    ("float32", "int8", "auto"), ("float32", None, "auto"), ("bfloat16", "int8", "auto"), ("bfloat16", None, "auto"),
    ("float32", "int4", "auto"), ("bfloat16", "int4", "auto"), ("float32", "w8a8", "auto"),
    ("bfloat16", "w8a8", "auto"),
    ("bfloat16", "w4a8", "auto"), ("float32", None, "int8"), ("bfloat16", "w4a8", "int8")])
def test_the_stack_equals_the_modules_bit_for_bit(native_model, forced_kernels, stack_calls, monkeypatch, dtype,
                                                  quantization, kv_cache_dtype):
    # float32 + int4: the int4 few-row kernel up to its width, the layers' dequantised copies past it. An int8
    # KV cache: heads of 16, which the attention op hands to PyTorch's kernel on the dequantised cache.
    if quantization == "int8" and not gemv_int8_cpu.fits(8, "cpu"):
        pytest.skip("the few-row int8 kernel needs AVX2 and FMA")
    if quantization in ("w8a8", "w4a8") and not gemm_a8_cpu.available("cpu"):
        pytest.skip("the int8-activation kernels need AVX-512 VNNI")
    llm = LLM(native_model, dtype=dtype, quantization=quantization, max_num_seqs=2, kv_cache_dtype=kv_cache_dtype)
    assert llm.runner.kv_cache.k[0].dtype == (torch.int8 if kv_cache_dtype == "int8" else llm.dtype)
    _compare(llm, stack_calls, monkeypatch)


@pytest.mark.parametrize("dtype,quantization,kv_cache_dtype", [
    ("bfloat16", "w4a8", "auto"), ("float32", "w4a8", "auto"), ("bfloat16", "w8a8", "auto"), ("bfloat16", None, "auto"),
    ("bfloat16", "w4a8", "int8"), ("float32", "w4a8", "int8"), ("bfloat16", None, "int8")])
def test_the_lean_path_equals_the_modules_bit_for_bit(lean_model, forced_kernels, stack_calls, monkeypatch, dtype,
                                                      quantization, kv_cache_dtype):
    # w8a8 / w4a8 layers, or bf16 ones the few-row bf16 kernel takes (forced up to 16 rows), and heads the
    # attention kernel takes: the kernels called directly, plain loops between. An int8 KV cache: the lean
    # path's quantiser and the attention kernel's int8 reads against the modules' quantize_kv and op.
    if not gemm_a8_cpu.available("cpu"):
        pytest.skip("the lean path needs AVX-512 VNNI")
    if quantization is None and not gemv_cpu.fits(128, torch.bfloat16, "cpu"):
        pytest.skip("the few-row bf16 kernel needs AVX-512 BF16")
    llm = LLM(lean_model, dtype=dtype, quantization=quantization, max_num_seqs=2, kv_cache_dtype=kv_cache_dtype)
    stack = native_stack.native_stack_for(llm.model, llama.NATIVE_TYPES)
    _compare(llm, stack_calls, monkeypatch)
    # the 9-token prefill, the decode step, the 5-token chain and the 3-token tree: one sequence, at most
    # 40 query rows per KV head (the prefill has 18); every batch of two sequences' chains as one call
    # (embedding to logits): decode steps, ragged columns and rows, verifications
    assert stack_calls.batches == [[1, 1], [2, 1], [1, 2], [1, 1], [4, 3], [3, 3]]
    assert stack.lean_forwards() == 10


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("float32", "auto"), ("bfloat16", "int8")])
def test_the_lean_paths_loops_run_on_one_thread_team_and_compute_what_a_fixed_split_does(
        lean_model, forced_kernels, stack_calls, dtype, kv_cache_dtype):
    # A lean forward's matmul and attention loops run on the threads of one parallel region
    # (kernels/thread_team.h), each thread claiming items as it goes (its own share, then others'):
    # an item is one thread's work whichever thread it is, so every result equals that of every loop
    # in its own OpenMP region over fixed halves (the team switched off).
    if not gemm_a8_cpu.available("cpu"):
        pytest.skip("the lean path needs AVX-512 VNNI")
    if torch.get_num_threads() < 2 or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a thread team needs two threads on two CPUs")
    extension = decode_stack_cpu.extension()
    llm = LLM(lean_model, dtype=dtype, quantization="w4a8", max_num_seqs=2, kv_cache_dtype=kv_cache_dtype)
    steps = _steps(llm.model.config.vocab_size)
    before = extension.thread_team_loops()
    ours = _run(llm, steps)
    ran = extension.thread_team_loops() - before
    assert ran >= 10 * 5 * llm.model.config.num_hidden_layers  # every step: four matmuls and attention a layer
    extension.set_thread_team(False)
    try:
        theirs = _run(llm, steps)
    finally:
        extension.set_thread_team(True)
    assert extension.thread_team_loops() - before == ran
    _assert_bit_identical(ours, theirs)


@pytest.mark.parametrize("model,kv_cache_dtype", [("native_model", "auto"), ("lean_model", "auto"),
                                                   ("lean_model", "int8")])
def test_bf16_weights_with_float32_activations_equal_the_modules_bit_for_bit(request, tmp_path, stack_calls,
                                                                            monkeypatch, model, kv_cache_dtype):
    # A bf16 checkpoint served in float32 (Bf16WeightLinear): the stack calls the layers' op (heads of 16),
    # the lean path the kernel itself (heads of 32), at every width.
    if not gemv_bf16w_cpu.available("cpu"):
        pytest.skip("the bf16-weight kernel needs AVX2 + FMA")
    llm = LLM(bf16_copy(request.getfixturevalue(model), tmp_path / "m"), dtype="float32", max_num_seqs=2,
              kv_cache_dtype=kv_cache_dtype)
    assert isinstance(llm.model.model.layers[0].mlp.down_proj, Bf16WeightLinear)
    stack = native_stack.native_stack_for(llm.model, llama.NATIVE_TYPES)
    _compare(llm, stack_calls, monkeypatch)
    if model == "lean_model" and gemm_a8_cpu.available("cpu"):  # the lean path is built with the VNNI kernels
        assert stack_calls.batches == [[1, 1], [2, 1], [1, 2], [1, 1], [4, 3], [3, 3]]
        assert stack.lean_forwards() == 10


def test_the_lean_path_runs_a_bf16_layers_own_op_past_the_lean_width(lean_model, forced_kernels, stack_calls,
                                                                       monkeypatch):
    # bf16 layers whose few-row kernel serves 2 rows: wider forwards and batches still take the lean path,
    # each linear past 2 rows on the layer's own op (oneDNN's matmul), as the modules compute it.
    if not gemv_cpu.fits(128, torch.bfloat16, "cpu") or not gemm_a8_cpu.available("cpu"):
        pytest.skip("the lean path's bf16 layers need AVX-512 BF16")
    llm = LLM(lean_model, dtype="bfloat16", max_num_seqs=2)
    layers = [m for m in llm.model.model.layers.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.few_rows is not None for m in layers)
    for layer in layers:
        layer.few_rows = (layer.few_rows[0], 2)
    llm.model.lean_rows = 0  # the layers' own widths: 2
    stack = native_stack.native_stack_for(llm.model, llama.NATIVE_TYPES)
    _compare(llm, stack_calls, monkeypatch)
    assert stack_calls.batches == [[1, 1], [2, 1], [1, 2], [1, 1], [4, 3], [3, 3]]
    assert stack.lean_forwards() == 10

    def logits():  # a 9-token forward, then a one-token one after it
        return [llm.runner.forward([entry]).logits.clone() for entry in (ForwardEntry(0, list(range(5, 14)), 0, 9),
                                                                         ForwardEntry(0, [7], 9))]

    before = logits()
    layer = llm.model.model.layers[0].mlp.gate_up
    layer.few_rows[0].mul_(1.01)  # the few-row kernel's copy of the weights only
    wide, one = logits()
    assert torch.equal(wide, before[0]) and not torch.equal(one, before[1])  # 9 rows ran on oneDNN, 1 on the kernel


@pytest.mark.parametrize("hidden", [320, 384])
def test_the_lean_path_takes_heads_of_80_and_96(tmp_path, forced_kernels, stack_calls, monkeypatch, hidden):
    # Phi-2's and Phi-3's head sizes: bf16 scores of 80 (no whole number of 32-value chunks) by the
    # 8-lane chain, of 96 by 32-value chunks.
    if not gemm_a8_cpu.available("cpu"):
        pytest.skip("the lean path needs AVX-512 VNNI")
    llm = LLM(make_native_model(tmp_path / "m", hidden=hidden), dtype="bfloat16", quantization="w4a8", max_num_seqs=2)
    assert llm.model.config.head_dim == hidden // 4
    stack = native_stack.native_stack_for(llm.model, llama.NATIVE_TYPES)
    _compare(llm, stack_calls, monkeypatch)
    assert len(stack_calls.batches) == 6 and stack.lean_forwards() == 10


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantised_layers_wide_copies_are_reproduced(native_model, forced_kernels, stack_calls, monkeypatch,
                                                     quantization):
    # bf16 verification widths: from 3 rows on every int layer runs its dense packed copy, which itself takes
    # the few-row bf16 kernel (where built) up to 16 rows: the stack must choose as each module does.
    if not can_pack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("packed bf16 copies need oneDNN's bf16 path (AVX-512)")
    monkeypatch.setattr(wide_kernels, "measure_wide_from", lambda layers, dense, dtype: 3)
    monkeypatch.setattr(wide_kernels, "load_choices", dict)  # measured (as 3), whatever was cached
    monkeypatch.setattr(wide_kernels, "save_choices", lambda cached: None)
    llm = LLM(native_model, dtype="bfloat16", quantization=quantization, max_num_seqs=2)
    layers = [m for m in llm.model.modules() if isinstance(m, QuantizedLinear) and not m.is_view]
    assert layers and all(m.wide is not None and m.wide[1] == 3 for m in layers)
    _compare(llm, stack_calls, monkeypatch)


YARN = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 64}}


@pytest.mark.parametrize("family,extra", [("qwen3", {}), ("qwen2", {}), ("llama", {"kv_heads": 4}), ("llama", YARN)])
def test_variant_blocks_are_reproduced_too(tmp_path, stack_calls, monkeypatch, family, extra):
    # q/k norm (Qwen3), q/k/v biases (Qwen2), one KV head per query head (no GQA folding), YaRN's
    # RoPE (an attention factor: the C++ chain's RoPE table holds its product).
    model = make_hf_model(tmp_path / family, family, **extra)
    _compare(LLM(model, dtype="float32", max_num_seqs=2), stack_calls, monkeypatch)


def test_a_changed_model_is_examined_again(native_model, forced_kernels, stack_calls, monkeypatch):
    if not gemv_int8_cpu.fits(8, "cpu"):
        pytest.skip("the few-row int8 kernel needs AVX2 and FMA")
    llm = LLM(native_model, dtype="float32", quantization="int8", max_num_seqs=2)
    steps = _steps(llm.model.config.vocab_size)[:2]
    _run(llm, steps)
    assert stack_calls == [9, 1]
    detach_few_row_kernels(llm.model)  # as exact mode does: the stack built on the kernels must not serve
    after = _run(llm, steps)
    assert stack_calls == [9, 1, 9, 1]  # rebuilt: int8 layers without their kernel run their dense copy
    with monkeypatch.context() as m:
        m.setattr(llama, "native_stack_for", lambda *args: None)
        m.setattr(llama, "native_chain_for", lambda *args: None)
        m.setattr(llama, "native_block_for", lambda *args: None)
        _assert_bit_identical(after, _run(llm, steps))


def test_exact_mode_autograd_hooks_and_other_batches_keep_the_modules(native_model, stack_calls):
    llm = LLM(native_model, dtype="float32", max_num_seqs=2)
    stack = native_stack.native_stack_for(llm.model, llama.NATIVE_TYPES)
    assert stack is not None
    x = torch.zeros(1, 1, llm.model.config.hidden_size)
    assert native_stack.batch_served(AttentionBatch(attn_mask=None, slot_range=(0, 1), write_start=0))
    assert not native_stack.batch_served(AttentionBatch(attn_mask=None, slot_range=(0, 1), write_start=0, exact=True))
    assert not native_stack.batch_served(AttentionBatch(attn_mask=None, slot_range=None, write_start=0))
    assert not native_stack.batch_served(AttentionBatch(attn_mask=None, slot_range=(0, 2), write_start=None))
    ragged = AttentionBatch(attn_mask=None, slot_ids=torch.tensor([1, 0]), write_indices=torch.tensor([[3], [5]]))
    assert native_stack.batch_served(ragged)  # written by index, read by a gather
    with torch.inference_mode():
        assert stack.serves(x.dtype) and not stack.serves(torch.bfloat16)
    assert not stack.serves(x.dtype)  # autograd on
    # A forward hook anywhere in the stack (exact/bisect.py records outputs through them) must run.
    seen = []
    handle = llm.model.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, args, out: seen.append(out))
    with torch.inference_mode():
        assert not stack.serves(x.dtype)
    llm.runner.forward(_steps(llm.model.config.vocab_size)[0])
    assert len(seen) == 1 and stack_calls == [(1, 9)]  # the other block alone
    handle.remove()
    llm.runner.forward(_steps(llm.model.config.vocab_size)[0])
    assert len(seen) == 1 and stack_calls == [(1, 9), 9]


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "ngram", "num_speculative_tokens": 3, "verify_pruning": "dcut"}])
def test_steps_of_several_sequences_run_as_one_lean_call_and_equal_each_sequence_alone(
        lean_model, forced_kernels, stack_calls, spec):
    """At concurrency, a decode step (every sequence's one next token: plain decoding, or a speculative
    step where nobody drafted) and a verification (each sequence's last token and drafts) run embedding
    to logits as one C++ call on the lean path: every linear over the batch's rows at once, attention
    per sequence on its own cache row, length and causal mask. Each sequence's rows are its own
    forward, so a batch decodes what each request decodes alone (W4A8, bf16)."""
    if not gemm_a8_cpu.available("cpu"):
        pytest.skip("the lean path needs AVX-512 VNNI")
    llm = LLM(lean_model, dtype="bfloat16", quantization="w4a8", max_num_seqs=3, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = ["def f(x):\n    return", "class A:\n", "import os\nprint("]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert [1, 1, 1] in stack_calls.batches  # the three decoding side by side
    if spec is not None and "verify_pruning" not in spec:  # fixed k: verifications of several tokens too
        assert any(max(lengths) > 1 for lengths in stack_calls.batches)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3", "mtp", "eagle"])
def test_decoding_is_unchanged_by_the_stack(native_model, native_drafter, trained_drafters, stack_calls, monkeypatch,
                                           method):
    # The target's stack, a draft model's, and the one block of EAGLE / EAGLE-3 / MTP drafters.
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = str(native_drafter)
    elif method != "ngram":
        spec["model"] = str(trained_drafters[method])
    llm = LLM(native_model, dtype="float32", max_num_seqs=2, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["def f(x):\n    return", "class A:\n"]
    ours = [o.token_ids for o in llm.generate(prompts, params)]
    ours += [o.token_ids for o in llm.generate(prompts[:1], params)]  # batch 1
    assert stack_calls
    if method not in ("ngram", "draft_model"):  # the drafter's own block ran in C++ too
        assert (1, 1) in stack_calls
    with monkeypatch.context() as m:
        m.setattr(llama, "native_stack_for", lambda *args: None)
        m.setattr(llama, "native_chain_for", lambda *args: None)
        m.setattr(llama, "native_block_for", lambda *args: None)
        theirs = [o.token_ids for o in llm.generate(prompts, params)]
        theirs += [o.token_ids for o in llm.generate(prompts[:1], params)]
    assert ours == theirs
