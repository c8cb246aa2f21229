"""The few-row int4 kernel (kernels/gemv_int4_cpu.cpp) and the int4 layers that take it at decode and verify widths."""

from __future__ import annotations

import pytest
import torch

from specdecode.kernels import gemv_int4_cpu
from specdecode.models import kernel_probe
from specdecode.models.inference import FEW_ROWS_PROBE, attach_few_row_kernels, detach_few_row_kernels
from specdecode.models.quant import QuantizedLinear, QuantScheme

pytestmark = pytest.mark.skipif(not gemv_int4_cpu.fits(32, 32, "cpu"),
                                reason="the few-row int4 kernel needs AVX2, FMA and a C++ compiler")


def _layer(n: int, k: int, group: int = 32, seed: int = 0, bias: bool = False) -> QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(n, generator=g) * 0.1 if bias else None
    return QuantizedLinear.from_weight(torch.randn(n, k, generator=g) * 0.05, b, QuantScheme(4, group))


PACKS = {"avx2": gemv_int4_cpu.pack, "lanes": gemv_int4_cpu.pack_lanes, "pairs": gemv_int4_cpu.pack_pairs}


def _kernel_tensors(layer: QuantizedLinear, layout: str = "avx2") -> tuple:
    packed, scale_offsets = PACKS[layout](layer.unpacked_int4(), layer.scales, layer.zeros)
    return packed, scale_offsets, None if layer.bias is None else layer.bias.float().contiguous()


needs_pairs = pytest.mark.skipif(not gemv_int4_cpu.pair_kernel(), reason="the bf16 pair layout needs AVX-512 BF16 and VBMI")
needs_lanes = pytest.mark.skipif(not gemv_int4_cpu.lane_kernel(), reason="the lane layout needs AVX-512")


def test_the_layout_holds_each_outputs_nibble_in_its_word():
    q = torch.randint(0, 16, (70, 64), generator=torch.Generator().manual_seed(0))
    packed, scale_offsets = gemv_int4_cpu.pack(q, torch.rand(70, 2), torch.rand(70, 2))
    assert packed.shape == (2, 64, 32) and scale_offsets.shape == (2, 2, 2, 64)
    words = packed.view(torch.int32).view(2, 64, 8)  # [group, input, word]
    for n in (0, 9, 63, 64, 69):
        word = words[n // 64, :, (n % 64) // 8]
        assert torch.equal((word >> (4 * (n % 8))) & 0xF, q[n].to(torch.int32)), n
    assert torch.count_nonzero(packed[1, :, 3:]) == 0  # outputs 70.. are padding


def test_the_lane_layout_holds_each_outputs_nibbles_in_its_lane():
    q = torch.randint(0, 16, (70, 64), generator=torch.Generator().manual_seed(0))
    scales, zeros = torch.rand(70, 2).bfloat16().float(), torch.rand(70, 2).bfloat16().float()
    packed, scale_zeros = gemv_int4_cpu.pack_lanes(q, scales, zeros)
    assert packed.shape == (2, 32, 16) and packed.dtype == torch.int32
    assert torch.equal(scale_zeros, gemv_int4_cpu.pack_pairs(q, scales, zeros)[1])  # the pair layout's scales and zeros
    for n in (0, 9, 16, 17, 63, 64, 69):  # word n % 16 of each pair's line, nibbles 2 v and 2 v + 1
        word, v = packed[n // 64, :, n % 16], (n % 64) // 16  # [K/2]
        assert torch.equal((word >> (8 * v)) & 0xF, q[n, 0::2].to(torch.int32)), n
        assert torch.equal((word >> (8 * v + 4)) & 0xF, q[n, 1::2].to(torch.int32)), n
    assert torch.count_nonzero(packed[1, :, 6:16] & 0xFF) == 0  # outputs 70.. (lanes 6.. of vector 0) are padding
    assert torch.count_nonzero(packed[1] >> 8) == 0  # and vectors 1-3


@needs_lanes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lane_layout_computes_what_the_avx2_one_does_bit_for_bit(dtype):
    for n, k, group in [(300, 512, 32), (70, 256, 64), (13, 1408, 128)]:
        layer = _layer(n, k, group, bias=True)
        lanes, avx2 = _kernel_tensors(layer, "lanes"), _kernel_tensors(layer)
        for m in (1, 2, 3, 4, 5, 8, 11, 16):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
            out = gemv_int4_cpu.few_rows_linear(x, *lanes, n, group)
            assert torch.equal(out, gemv_int4_cpu.few_rows_linear(x, *avx2, n, group)), (n, m)
    other = _kernel_tensors(_layer(n, k, group, seed=1, bias=True), "lanes")
    assert not torch.equal(gemv_int4_cpu.few_rows_linear(x, *other, n, group), out)  # the check can fail


def test_the_packer_picks_the_layout_the_build_serves():
    lanes = gemv_int4_cpu.lane_kernel()
    expected = gemv_int4_cpu.pack_lanes if lanes else gemv_int4_cpu.pack
    assert gemv_int4_cpu.packer(torch.float32, 32, bf16_values=True) is expected
    bf16 = gemv_int4_cpu.pack_pairs if gemv_int4_cpu.pair_kernel() else expected
    assert gemv_int4_cpu.packer(torch.bfloat16, 32, bf16_values=True) is bf16
    assert gemv_int4_cpu.packer(torch.float32, 32, bf16_values=False) is gemv_int4_cpu.pack  # fp32 scales


@needs_pairs
def test_the_pair_layout_holds_each_outputs_two_nibbles_where_the_kernel_picks_them():
    q = torch.randint(0, 16, (70, 64), generator=torch.Generator().manual_seed(0))
    scales, zeros = torch.rand(70, 2), torch.rand(70, 2)
    scales, zeros = scales.bfloat16().float(), zeros.bfloat16().float()  # bf16 values, as quantize_weight's
    packed, scale_zeros = gemv_int4_cpu.pack_pairs(q, scales, zeros)
    assert packed.shape == (2, 32, 64) and scale_zeros.shape == (2, 2, 2, 64) and scale_zeros.dtype == torch.bfloat16
    for n in (0, 9, 64, 69):  # [layout group, input group, scales | zeros, output]
        assert torch.equal(scale_zeros[n // 64, :, 0, n % 64].float(), scales[n])
        assert torch.equal(scale_zeros[n // 64, :, 1, n % 64].float(), zeros[n])
    for n in (0, 1, 9, 17, 63, 64, 69):
        j, m, i = (n % 64) // 16, (n % 16) // 2, n % 2
        byte = packed[n // 64, :, 8 * m + 2 * j + i].to(torch.int32)  # [K/2]
        assert torch.equal(byte & 0xF, q[n, 0::2].to(torch.int32)) and torch.equal(byte >> 4, q[n, 1::2].to(torch.int32)), n
    assert torch.count_nonzero(packed[1][:, [8 * m + 2 * j + i for m in range(8) for j in range(4) for i in range(2)
                                             if 16 * j + 2 * m + i >= 6]]) == 0  # outputs 70.. are padding


@pytest.mark.parametrize("n,k,group", [(8, 32, 32), (70, 64, 32), (1024, 512, 32), (13, 1408, 32), (200, 256, 64),
                                       (96, 256, 128)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype,layout", [(torch.bfloat16, "avx2"), (torch.float32, "avx2"),
                                          pytest.param(torch.float32, "lanes", marks=needs_lanes),
                                          pytest.param(torch.bfloat16, "pairs", marks=needs_pairs)])
def test_the_kernel_computes_the_int4_matmul(n, k, group, bias, dtype, layout):
    layer = _layer(n, k, group, bias=bias)
    tensors = _kernel_tensors(layer, layout)
    w = layer.dequantize()  # [n, k] float32: (q - 8) * scale + zero
    for m in (1, 2, 3, 4, 5, 9):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        ref = x.float() @ w.T + (layer.bias if bias else 0)  # [m, n] float32
        out = gemv_int4_cpu.few_rows_linear(x, *tensors, n, group)
        assert out.shape == (m, n) and out.dtype == dtype
        rtol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5  # the output's rounding
        torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=1e-4 * k ** 0.5)
    wrong = gemv_int4_cpu.few_rows_linear(x, *_kernel_tensors(_layer(n, k, group, seed=1, bias=bias), layout), n, group)
    assert not torch.allclose(wrong.float(), ref, rtol=2 ** -7, atol=1e-3)  # the check can fail


@pytest.mark.parametrize("layout", ["avx2", pytest.param("lanes", marks=needs_lanes),
                                    pytest.param("pairs", marks=needs_pairs)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(layout):
    layer = _layer(300, 512, bias=True)
    tensors = _kernel_tensors(layer, layout)
    x = torch.randn(16, 512).bfloat16()
    alone = torch.cat([gemv_int4_cpu.few_rows_linear(x[i:i + 1], *tensors, 300, 32) for i in range(16)])
    for m in range(1, 17):
        assert torch.equal(gemv_int4_cpu.few_rows_linear(x[:m], *tensors, 300, 32), alone[:m]), m


@needs_pairs
def test_the_pair_layout_takes_bf16_only_and_an_int4_layer_called_otherwise_falls_back():
    layer = _layer(40, 64, bias=True)
    packed, scale_offsets, bias = _kernel_tensors(layer, "pairs")
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="pair layout takes bf16"):
        gemv_int4_cpu.few_rows_linear(x, packed, scale_offsets, bias, 40, 32)
    with pytest.raises(RuntimeError, match="bf16 scales and zeros"):  # the AVX2 layout's fp32 scales and offsets
        gemv_int4_cpu.few_rows_linear(x.bfloat16(), packed, scale_offsets.float(), bias, 40, 32)
    lanes, _, _ = _kernel_tensors(layer, "lanes")  # the same scales and zeros
    out = gemv_int4_cpu.int4_linear(x, lanes, scale_offsets, bias, 40, 32, 16, None, None, None, None)
    torch.testing.assert_close(out, x @ layer.dequantize().T + layer.bias, rtol=1e-5, atol=1e-4)  # the lane kernel
    out = gemv_int4_cpu.int4_linear(x, packed, scale_offsets, bias, 40, 32, 16, layer.dense_weight(torch.float32),
                                    None, None, layer.bias)  # float32 rows: the dense copy, not the kernel
    torch.testing.assert_close(out, x @ layer.dense_weight(torch.float32).T + layer.bias)


def test_bad_inputs_are_refused():
    layer = _layer(16, 64)
    packed, scale_offsets, _ = _kernel_tensors(layer)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="packed layout"):
        gemv_int4_cpu.few_rows_linear(x, layer.qweight, scale_offsets, None, 16, 32)  # the stored layout
    with pytest.raises(RuntimeError, match="scales and offsets"):
        gemv_int4_cpu.few_rows_linear(x, packed, scale_offsets.bfloat16(), None, 16, 32)
    with pytest.raises(RuntimeError, match="multiple of the group"):
        gemv_int4_cpu.few_rows_linear(x, packed, scale_offsets, None, 16, 48)
    lanes, scale_zeros, _ = _kernel_tensors(layer, "lanes")
    with pytest.raises(RuntimeError, match="lane layout|bf16 scales and zeros"):  # fp32 scales, or no AVX-512
        gemv_int4_cpu.few_rows_linear(x, lanes, scale_offsets, None, 16, 32)
    with pytest.raises(RuntimeError, match="packed layout"):  # a line of 16 words per input pair
        gemv_int4_cpu.few_rows_linear(x, lanes.view(1, 64, 8), scale_zeros, None, 16, 32)


def test_float32_activations_take_the_kernel_up_to_its_width_and_the_dense_copy_past_it():
    layer = _layer(40, 64, bias=True)
    layer.prepare(torch.float32)
    x = torch.randn(20, 64)
    dense = layer(x).clone()
    layer.few_rows = (*_kernel_tensors(_layer(40, 64, seed=1, bias=True)), 16)  # another layer's: shows which ran
    assert torch.equal(layer(x[:16]), gemv_int4_cpu.few_rows_linear(x[:16], *layer.few_rows[:3], 40, 32))
    assert torch.equal(layer(x), dense)  # 20 rows: the dense copy, as before
    layer.few_rows = (*_kernel_tensors(layer), 16)
    torch.testing.assert_close(layer(x[:3]), dense[:3], rtol=1e-5, atol=1e-5)  # the same matmul, summed otherwise


def test_bf16_activations_fall_back_to_pytorchs_int4_kernel_past_the_width():
    layer = _layer(64, 64, bias=True)  # 64 outputs: PyTorch's int4 kernel serves bf16 (16-row blocks)
    layer.prepare(torch.bfloat16)
    x = torch.randn(6, 64).bfloat16()
    pytorch = layer(x).clone()
    layer.few_rows = (*_kernel_tensors(layer), 4)
    assert torch.equal(layer(x), pytorch)  # 6 rows: PyTorch's kernel, as before
    assert torch.equal(layer(x[:4]), gemv_int4_cpu.few_rows_linear(x[:4], *layer.few_rows[:3], 64, 32))


def test_int4_layers_are_probed_and_exact_mode_takes_the_kernel_away(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    probes = []

    def faster(candidate, baseline, in_features, dtype, widths):
        probes.append((in_features, tuple(widths)))
        return [True, True, True] + [False] * (len(widths) - 3)  # wins up to 4 rows

    monkeypatch.setattr(kernel_probe, "faster_by_width", faster)
    model = torch.nn.Sequential(_layer(64, 32), _layer(64, 32, seed=1), _layer(32, 64), _layer(64, 32).rows(0, 16))
    for m in model:
        m.prepare(torch.float32)
    assert attach_few_row_kernels(model, torch.float32) == {"32x64": 4, "64x32": 4}
    widths = FEW_ROWS_PROBE["int4"]
    assert probes == [(32, widths), (64, widths)]  # one probe per shape
    assert [m.few_rows and m.few_rows[-1] for m in model] == [4, 4, 4, None]  # a view keeps its fused layer's
    x = torch.randn(3, 32)
    assert torch.equal(model[1](x), gemv_int4_cpu.few_rows_linear(x, *model[1].few_rows[:3], 64, 32))
    detach_few_row_kernels(model)
    assert all(m.few_rows is None for m in model)


def test_a_forward_that_needs_the_inputs_gradient_takes_the_differentiable_path():
    # A drafter trained through the frozen target's int4 head: the few-row op has no backward.
    layer = _layer(40, 64)
    layer.prepare(torch.float32)
    layer.few_rows = (*_kernel_tensors(layer), 16)
    x = torch.randn(2, 64, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.dequantize().sum(0).expand(2, -1), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(layer(x), gemv_int4_cpu.few_rows_linear(x, *layer.few_rows[:3], 40, 32))
