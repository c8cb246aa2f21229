"""The cached-attention op (kernels/attention_cpu.cpp) that decode, drafting and verification forwards take on a CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdecode.kernels import attention_cpu

pytestmark = pytest.mark.skipif(not attention_cpu.available(),
                                reason="the attention op needs AVX2, FMA and a C++ compiler")


def _inputs(B, KVH, group, T, S, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache_k = torch.randn(B + 2, S + 9, KVH, D, generator=g).to(dtype)  # [slots, columns, KVH, D]
    cache_v = torch.randn(B + 2, S + 9, KVH, D, generator=g).to(dtype)
    keys, values = cache_k[1:1 + B, :S], cache_v[1:1 + B, :S]  # strided views, as the cache is read
    q = torch.randn(B, KVH, group * T, D, generator=g).to(dtype)
    mask = torch.tril(torch.ones(T, S, dtype=torch.bool), diagonal=S - T)[None, None].repeat(B, 1, 1, 1)
    if S > T:
        mask[-1, 0, :, 0] = False  # a hidden column that is not past the causal edge
    return q, keys, values, mask


def _reference(q, keys, values, mask, group):  # float64 SDPA, the mask expanded to the rows
    B, KVH, R, D = q.shape
    rows = None if mask is None else mask.expand(B, group, R // group, keys.shape[1]).reshape(B, 1, R, -1)
    return F.scaled_dot_product_attention(q.double(), keys.transpose(1, 2).double(), values.transpose(1, 2).double(),
                                          attn_mask=rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("B,KVH,group,T,S", [(1, 4, 2, 1, 250), (2, 4, 2, 5, 37), (1, 8, 1, 3, 9), (3, 2, 4, 1, 1)])
def test_the_op_computes_attention(dtype, D, B, KVH, group, T, S):
    q, keys, values, mask = _inputs(B, KVH, group, T, S, D, dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for m in (None, mask):
        out = attention_cpu.cached_attention(q, keys, values, m, group)
        assert out.shape == q.shape and out.dtype == dtype
        torch.testing.assert_close(out.double(), _reference(q, keys, values, m, group), rtol=tol, atol=tol)
    other = attention_cpu.cached_attention(q, *_inputs(B, KVH, group, T, S, D, dtype, seed=1)[1:3], mask, group)
    if S > 1:
        assert not torch.allclose(other.double(), _reference(q, keys, values, mask, group), atol=1e-2)  # can fail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 2])
def test_a_tokens_rows_do_not_depend_on_the_other_tokens(dtype, D, group):
    """17 tokens (k = 16 drafts), 17 or 34 rows per KV head, all served here. The kernel takes a KV
    head's rows in pairs (scores) and groups (values): a token's rows alone (one row at group 1: no
    pair) must round as beside the others, wherever the pairs and groups fall."""
    q, keys, values, mask = _inputs(1, 4, group, 17, 300, D, dtype)
    out = attention_cpu.cached_attention(q, keys, values, mask, group).view(1, 4, group, 17, D)
    for t in range(17):  # token t alone, with its mask row and the same keys
        alone = attention_cpu.cached_attention(q.view(1, 4, group, 17, D)[:, :, :, t], keys, values,
                                               mask[:, :, t:t + 1], group)
        assert torch.equal(alone, out[:, :, :, t]), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [32, 80, 96])
def test_a_rows_result_does_not_depend_on_the_hidden_keys_a_padded_batch_adds(dtype, D):
    """In a ragged verify batch every sequence sees as many key columns as the longest one, the rest
    hidden: its rows must round as with its own keys only (PyTorch's kernel, on heads it serves, did
    not, and draft-model speculation left plain decoding's tokens)."""
    q, keys, values, mask = _inputs(1, 4, 2, 3, 13, D, dtype)
    own = attention_cpu.cached_attention(q, keys, values, mask, 2)
    for S in (16, 17, 40):  # keys 13 .. S - 1 of another sequence's length, hidden from this one
        wide_k, wide_v = _inputs(1, 4, 2, 3, S, D, dtype, seed=2)[1:3]
        wide_mask = torch.zeros(1, 1, 3, S, dtype=torch.bool)
        wide_k[:, :13], wide_v[:, :13], wide_mask[..., :13] = keys, values, mask
        assert torch.equal(attention_cpu.cached_attention(q, wide_k, wide_v, wide_mask, 2), own), S


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_cache_is_head_major_and_the_op_reads_it_as_a_row_major_copy(dtype):
    from specdecode.models.config import ModelConfig
    from specdecode.models.llama import KVCache

    cfg = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=512)
    cache = KVCache(cfg, num_slots=3, max_len=300, dtype=dtype, device=torch.device("cpu"))
    k, v = cache.k[1], cache.v[1]
    assert k.shape == (3, 301, 4, 64) and k.stride(1) == 64 and v.stride(1) == 64  # a head's columns: one run
    g = torch.Generator().manual_seed(0)
    k.copy_(torch.randn(k.shape, generator=g))
    v.copy_(torch.randn(v.shape, generator=g))
    q, _, _, mask = _inputs(2, 4, 2, 3, 250, 64, dtype)
    head_major = attention_cpu.cached_attention(q, k[1:3, :250], v[1:3, :250], mask, 2)
    row_major = attention_cpu.cached_attention(q, k.contiguous()[1:3, :250], v.contiguous()[1:3, :250], mask, 2)
    assert torch.equal(head_major, row_major)
    torch.testing.assert_close(head_major.double(), _reference(q, k[1:3, :250], v[1:3, :250], mask, 2),
                               rtol=1e-2, atol=1e-2)


def _quantized(cache: torch.Tensor) -> torch.Tensor:
    from specdecode.models.layers import quantize_kv

    return quantize_kv(cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("B,KVH,group,T,S", [(1, 4, 2, 1, 250), (2, 4, 2, 5, 37), (3, 2, 4, 1, 1)])
def test_the_op_attends_over_an_int8_cache_as_over_its_dequantised_values(dtype, D, B, KVH, group, T, S):
    """An int8 cache's records (values, then the scale) give the attention of their dequantised values; a
    cache quantised from other keys gives another (the check can fail)."""
    from specdecode.models.layers import dequantize_kv

    if not attention_cpu.serves_int8():
        pytest.skip("the int8 cache's kernel needs AVX-512")
    q, keys, values, mask = _inputs(B, KVH, group, T, S, D, dtype)
    qk, qv = _quantized(keys), _quantized(values)
    assert qk.dtype == torch.int8 and qk.shape[-1] == D + 4
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for m in (None, mask):
        out = attention_cpu.cached_attention(q, qk, qv, m, group)
        assert out.shape == q.shape and out.dtype == dtype
        expected = _reference(q, dequantize_kv(qk, torch.float64), dequantize_kv(qv, torch.float64), m, group)
        torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    other_k, other_v = (_quantized(t) for t in _inputs(B, KVH, group, T, S, D, dtype, seed=1)[1:3])
    if S > 1:
        other = attention_cpu.cached_attention(q, other_k, other_v, mask, group)
        assert not torch.allclose(other.double(), _reference(q, keys, values, mask, group), atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,group", [(64, 2), (64, 1), (32, 1), (128, 1)])
def test_an_int8_caches_rows_do_not_depend_on_the_other_tokens_or_hidden_keys(dtype, D, group):
    """The int8 kernel keeps the op's invariance: a token's rows alone equal its rows in a 17-token step
    (at group 1 a token's one row is scored alone, beside the others in pairs), and a padded batch's
    hidden keys change nothing."""
    if not attention_cpu.serves_int8():
        pytest.skip("the int8 cache's kernel needs AVX-512")
    q, keys, values, mask = _inputs(1, 4, group, 17, 300, D, dtype)
    qk, qv = _quantized(keys), _quantized(values)
    out = attention_cpu.cached_attention(q, qk, qv, mask, group).view(1, 4, group, 17, D)
    for t in range(17):
        alone = attention_cpu.cached_attention(q.view(1, 4, group, 17, D)[:, :, :, t], qk, qv, mask[:, :, t:t + 1],
                                               group)
        assert torch.equal(alone, out[:, :, :, t]), t
    q, keys, values, mask = _inputs(1, 4, 2, 3, 13, 64, dtype)
    own = attention_cpu.cached_attention(q, _quantized(keys), _quantized(values), mask, 2)
    wide_k, wide_v = (_quantized(t) for t in _inputs(1, 4, 2, 3, 40, 64, dtype, seed=2)[1:3])
    wide_mask = torch.zeros(1, 1, 3, 40, dtype=torch.bool)
    wide_k[:, :13], wide_v[:, :13], wide_mask[..., :13] = _quantized(keys), _quantized(values), mask
    assert torch.equal(attention_cpu.cached_attention(q, wide_k, wide_v, wide_mask, 2), own)


def test_int8_records_hold_round_half_even_values_and_the_scale():
    from specdecode.models.layers import dequantize_kv, quantize_kv

    x = torch.tensor([[0.0] * 4, [1.0, -0.5, 0.25, 2.0], [3.0, 1e-3, -3.0, 0.0117]])
    records = quantize_kv(x)
    assert records.shape == (3, 8) and records.dtype == torch.int8
    assert records[0].tolist() == [0] * 8  # an all-zero head: zero values, scale 0
    scale = records[1, 4:].view(torch.float32).item()
    assert scale == torch.tensor(2.0 / 127).item()
    assert records[1, :4].tolist() == [64, -32, 16, 127]  # 63.5 -> 64 (even), -31.75 -> -32, 15.875 -> 16
    torch.testing.assert_close(dequantize_kv(records, torch.float32), x, atol=3.0 / 254, rtol=0)
    assert dequantize_kv(records, torch.float32).dtype == torch.float32


def test_the_c_plus_plus_quantiser_writes_the_same_records():
    """The C++ stack's cache writes (quantize_record) and quantize_kv must agree bit for bit, or a prompt
    prefilled by one and decoded by the other would read other keys."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(7, 5, 64, generator=g) * torch.rand(7, 5, 1, generator=g) * 10).to(dtype)
        x[0, 0] = 0
        assert torch.equal(attention_cpu.quantize_records(x), _quantized(x)), dtype


def test_a_row_that_sees_no_key_gives_zeros():
    q, keys, values, mask = _inputs(1, 4, 2, 1, 20, 64, torch.float32)
    mask[:] = False
    out = attention_cpu.cached_attention(q, keys, values, mask, 2)
    assert torch.equal(out, torch.zeros_like(out))


def test_prefill_widths_take_pytorchs_kernel():
    q, keys, values, mask = _inputs(1, 4, 2, 24, 40, 64, torch.float32)  # 48 rows per KV head
    rows = mask.expand(1, 2, 24, 40).reshape(1, 1, 48, 40)
    pytorch = F.scaled_dot_product_attention(q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=rows)
    assert torch.equal(attention_cpu.cached_attention(q, keys, values, mask, 2), pytorch)


def test_the_op_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SPECDECODE_ATTENTION_KERNEL", "0")
    attention_cpu.available.cache_clear()
    try:
        assert not attention_cpu.available() and not attention_cpu.serves(torch.zeros(1))
    finally:
        attention_cpu.available.cache_clear()  # decided again (switch restored) by the next caller


def test_eager_inference_takes_the_op_and_autograd_keeps_pytorchs(monkeypatch):
    from specdecode.models.config import ModelConfig
    from specdecode.models.llama import Attention, KVCache
    from specdecode.models.layers import AttentionBatch, RotaryEmbedding

    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    attn = Attention(cfg)
    cos, sin = RotaryEmbedding(cfg)(torch.arange(3)[None], torch.float32)
    x = torch.randn(1, 3, 64)
    calls = []
    real = attention_cpu.cached_attention
    monkeypatch.setattr(attention_cpu, "cached_attention", lambda *a: calls.append(a) or real(*a))

    def forward():
        cache = KVCache(cfg, 1, 8, torch.float32, "cpu")
        batch = AttentionBatch(attn_mask=torch.tril(torch.ones(3, 3, dtype=torch.bool))[None, None],
                               slot_ids=torch.tensor([0]), num_keys=3, slot_range=(0, 1), write_start=0)
        return attn(x, cos, sin, batch, cache.k[0], cache.v[0])

    with torch.inference_mode():
        served = forward()
    assert len(calls) == 1
    trained = forward()  # autograd on (the weights need gradients): PyTorch's kernel
    assert len(calls) == 1 and trained.requires_grad
    torch.testing.assert_close(served, trained.detach(), rtol=1e-5, atol=1e-6)
