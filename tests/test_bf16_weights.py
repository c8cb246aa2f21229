"""bf16 weights with float32 activations (kernels/gemv_bf16w_cpu.cpp, models/inference.py Bf16WeightLinear):
a bf16 checkpoint served in float32 keeps its weights as bf16 and computes the float32 model."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPTS, bf16_copy, generate_ids

from specdecode import LLM, SamplingParams
from specdecode.engine.ragged import ForwardEntry
from specdecode.kernels import gemv_bf16w_cpu
from specdecode.models.inference import Bf16WeightLinear, select_output_rows

pytestmark = pytest.mark.skipif(not gemv_bf16w_cpu.available("cpu"),
                                reason="the bf16-weight kernel needs AVX2 + FMA and a C++ compiler")

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def bf16_model(native_model, tmp_path_factory):
    return bf16_copy(native_model, tmp_path_factory.mktemp("bf16") / "m")


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).bfloat16().float()


def _within_float32_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias) -> torch.Tensor:
    """Per output: |y - the exact product| within a float32 sum's rounding bound (K + 2 units of rounding of
    sum |x w| + |bias|)."""
    exact = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ w.double().abs().t() + (0 if bias is None else bias.double().abs())
    bound = magnitude * (x.shape[1] + 2) * 2.0 ** -24 + 1e-30
    return (y.double() - exact).abs() <= bound


@pytest.mark.parametrize("k,n", [(2, 1), (64, 64), (96, 100), (130, 257), (512, 1536), (1536, 512)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_computes_the_float32_product_of_bf16_weights(k, n, with_bias):
    w = _weights(n, k, seed=k + n)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)) if with_bias else None
    blocked = gemv_bf16w_cpu.block_weight(w)
    assert blocked.dtype == torch.bfloat16 and blocked.shape == (-(-n // 64), k // 2, 64, 2)
    for m in (1, 2, 5, 6, 7, 13, 64):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = gemv_bf16w_cpu.linear(x, blocked, bias, n)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert bool(_within_float32_rounding(y, x, w, bias).all()), (k, n, m)
    # Negative control: one weight off by its bf16 step, on an input much larger than the others, shows.
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    x[:, k // 2] = 1000.0
    off = w.clone()
    off[n // 2, k // 2] = (off[n // 2, k // 2].bfloat16().view(torch.int16) + 1).view(torch.bfloat16).float()
    y = gemv_bf16w_cpu.linear(x, gemv_bf16w_cpu.block_weight(off), bias, n)
    assert not bool(_within_float32_rounding(y, x, w, bias)[:, n // 2].any())


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    # Each output is one FMA chain over the inputs in order, whatever the call's row count or tile.
    w, k, n = _weights(200, 384, seed=0), 384, 200
    blocked = gemv_bf16w_cpu.block_weight(w)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(0))
    alone = torch.cat([gemv_bf16w_cpu.linear(x[i:i + 1], blocked, None, n) for i in range(len(x))])
    for m in range(1, 41):
        assert torch.equal(gemv_bf16w_cpu.linear(x[:m], blocked, None, n), alone[:m]), m
    assert torch.equal(gemv_bf16w_cpu.linear(x[7:19], blocked, None, n), alone[7:19])


@pytest.mark.parametrize("k,n", [(2, 1), (64, 64), (96, 100), (130, 257), (512, 1536), (1536, 512)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_avx2_form_computes_what_the_builds_form_does_bit_for_bit(k, n, with_bias):
    """An AVX2-only CPU runs the kernel's 8-lane form (one row's 64 outputs at a time): each output the
    same FMA chain as the 16-lane form's, so the same float32 numbers, at every row count and tile
    remainder; and a row's result still does not depend on the rows beside it. (On an AVX2-only CPU
    both ops are the 8-lane form.)"""
    w = _weights(n, k, seed=k + n + 1)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)) if with_bias else None
    blocked = gemv_bf16w_cpu.block_weight(w)
    x = torch.randn(15, k, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([gemv_bf16w_cpu.linear(x[i:i + 1], blocked, bias, n, avx2=True) for i in range(len(x))])
    assert bool(_within_float32_rounding(alone, x, w, bias).all())
    for m in range(1, 16):
        ours = gemv_bf16w_cpu.linear(x[:m], blocked, bias, n, avx2=True)
        assert torch.equal(ours, gemv_bf16w_cpu.linear(x[:m], blocked, bias, n)), (k, n, m)
        assert torch.equal(ours, alone[:m]), (k, n, m)
    # Negative control: a weight one bf16 step off changes its output's bits.
    off = w.clone()
    off[n // 2, k // 2] = (off[n // 2, k // 2].bfloat16().view(torch.int16) + 1).view(torch.bfloat16).float()
    x[:, k // 2] = 1000.0
    assert not torch.equal(gemv_bf16w_cpu.linear(x, gemv_bf16w_cpu.block_weight(off), bias, n, avx2=True),
                           gemv_bf16w_cpu.linear(x, blocked, bias, n))


def test_a_bf16_checkpoint_served_in_float32_keeps_bf16_weights(bf16_model, native_model, monkeypatch):
    llm = LLM(bf16_model, dtype="float32", max_num_seqs=4)
    block = llm.model.model.layers[0]
    attention, mlp = block.self_attn, block.mlp
    for layer in (attention.qkv, attention.o_proj, mlp.gate_up, mlp.down_proj, llm.model.lm_head):
        assert isinstance(layer, Bf16WeightLinear) and layer.blocked.dtype == torch.bfloat16, layer
    assert not any(isinstance(m, torch.nn.Linear) for m in llm.model.modules())
    ours = generate_ids(bf16_model, PROMPTS, GREEDY)
    # The same checkpoint on PyTorch's float32 matmuls: the same model up to summation order.
    monkeypatch.setattr(gemv_bf16w_cpu, "available", lambda device: False)
    dense = LLM(bf16_model, dtype="float32", max_num_seqs=4)
    assert not any(isinstance(m, Bf16WeightLinear) for m in dense.model.modules())
    assert generate_ids(bf16_model, PROMPTS, GREEDY) == ours
    ids = PROMPTS[1]["prompt_token_ids"]
    a, b = (engine.runner.forward([ForwardEntry(0, ids, 0, num_logits=len(ids))]).logits for engine in (llm, dense))
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)  # float32 sums, in another order
    monkeypatch.undo()
    # A float32 checkpoint whose weights are not bf16 values keeps its float32 layers.
    assert not any(isinstance(m, Bf16WeightLinear) for m in LLM(native_model, dtype="float32").model.modules())


def test_dense_weight_and_selected_rows_are_the_layers_own():
    w, bias = _weights(150, 64, seed=3), torch.randn(150)
    layer = Bf16WeightLinear(w, bias)
    assert torch.equal(layer.dense_weight(), w)
    index = torch.tensor([149, 0, 64, 63, 77])
    rows = select_output_rows(layer, index, torch.float32)
    assert isinstance(rows, Bf16WeightLinear)
    x = torch.randn(5, 64)
    assert torch.equal(rows(x), layer(x)[:, index])  # each output's chain is its own: bit for bit


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
                                  "draft_model"])
def test_compiled_forwards_take_the_kernel_and_equal_eager(bf16_model, native_drafter, tmp_path, spec):
    if spec == "draft_model":
        spec = {"method": "draft_model", "num_speculative_tokens": 3,
                "model": str(bf16_copy(native_drafter, tmp_path / "drafter"))}
    eager = generate_ids(bf16_model, PROMPTS, GREEDY, spec)
    llm = LLM(bf16_model, dtype="float32", max_num_seqs=4, speculative_config=spec, compile=True)
    assert isinstance(llm.model.lm_head, Bf16WeightLinear)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == eager
    graphs = llm.runner.model_forward.num_graphs
    llm.generate(PROMPTS[1:3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert llm.runner.model_forward.num_graphs == graphs  # other batches, widths and contexts reuse them
