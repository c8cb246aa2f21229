"""The few-row int8 kernel (kernels/gemv_int8_cpu.cpp) and the int8 layers that take it at decode and verify widths."""

from __future__ import annotations

import pytest
import torch

from specdecode.kernels import gemv_int8_cpu
from specdecode.models import kernel_probe
from specdecode.models.inference import FEW_ROWS_PROBE, attach_few_row_kernels, detach_few_row_kernels
from specdecode.models.quant import QuantizedLinear, QuantScheme

pytestmark = pytest.mark.skipif(not gemv_int8_cpu.fits(8, "cpu"),
                                reason="the few-row int8 kernel needs AVX2, FMA and a C++ compiler")

INT8 = QuantScheme.parse("int8")


def _layer(n: int, k: int, seed: int = 0, bias: bool = False, split_sizes=None) -> QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(n, generator=g) * 0.1 if bias else None
    return QuantizedLinear.from_weight(torch.randn(n, k, generator=g) * 0.05, b, INT8, split_sizes)


def _kernel_tensors(layer: QuantizedLinear) -> tuple:
    return (gemv_int8_cpu.block_weight(layer.qweight), layer.scales.float().contiguous(),
            None if layer.bias is None else layer.bias.float().contiguous())


@pytest.mark.parametrize("n,k", [(8, 8), (37, 64), (1024, 512), (13, 1408), (70, 36)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_computes_the_int8_matmul(n, k, bias, dtype):
    layer = _layer(n, k, bias=bias)
    tensors = _kernel_tensors(layer)
    w = layer.dequantize()  # [n, k] float32: q * scale
    for m in (1, 2, 3, 4, 5, 9):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        ref = x.float() @ w.T + (layer.bias if bias else 0)  # [m, n] float32
        out = gemv_int8_cpu.few_rows_linear(x, *tensors, n)
        assert out.shape == (m, n) and out.dtype == dtype
        rtol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5  # the output's rounding
        torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=1e-4 * k ** 0.5)
    other = _kernel_tensors(_layer(n, k, seed=1, bias=bias))
    wrong = gemv_int8_cpu.few_rows_linear(x, *other, n)
    assert not torch.allclose(wrong.float(), ref, rtol=2 ** -7, atol=1e-3)  # the check can fail


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    layer = _layer(300, 512, bias=True)
    tensors = _kernel_tensors(layer)
    x = torch.randn(16, 512).bfloat16()
    alone = torch.cat([gemv_int8_cpu.few_rows_linear(x[i:i + 1], *tensors, 300) for i in range(16)])
    for m in range(1, 17):
        assert torch.equal(gemv_int8_cpu.few_rows_linear(x[:m], *tensors, 300), alone[:m]), m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_avx512_form_computes_what_the_avx2_one_does_bit_for_bit(dtype):
    # On an AVX2-only CPU both ops run the AVX2 form and this holds trivially.
    for n, k in [(300, 512), (70, 36), (13, 1408)]:
        tensors = _kernel_tensors(_layer(n, k, bias=True))
        for m in range(1, 17):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
            out = gemv_int8_cpu.few_rows_linear(x, *tensors, n)
            assert torch.equal(out, gemv_int8_cpu.few_rows_linear(x, *tensors, n, avx2=True)), (n, m)
    other = _kernel_tensors(_layer(n, k, seed=1, bias=True))
    assert not torch.equal(gemv_int8_cpu.few_rows_linear(x, *other, n, avx2=True), out)  # the check can fail


def test_bad_inputs_are_refused():
    layer = _layer(16, 64)
    blocked, scales, _ = _kernel_tensors(layer)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="blocked layout"):
        gemv_int8_cpu.few_rows_linear(x, layer.qweight, scales, None, 16)  # not blocked
    with pytest.raises(RuntimeError, match="scales"):
        gemv_int8_cpu.few_rows_linear(x, blocked, scales.bfloat16(), None, 16)
    with pytest.raises(RuntimeError, match="bias"):
        gemv_int8_cpu.few_rows_linear(x, blocked, scales, torch.zeros(16).bfloat16(), 16)


def test_an_int8_layer_takes_the_kernel_up_to_its_width_and_pytorchs_past_it():
    layer = _layer(96, 64, bias=True, split_sizes=[64, 32])
    layer.prepare(torch.bfloat16)
    x = torch.randn(2, 3, 64).bfloat16()
    pytorch = [t.clone() for t in layer(x)]
    layer.few_rows = (*_kernel_tensors(layer), 2)
    narrow = layer(x[:1, :2])  # 2 rows: the kernel
    kernel = gemv_int8_cpu.few_rows_linear(x[0, :2], *layer.few_rows[:3], 96)
    assert torch.equal(torch.cat(narrow, dim=-1)[0], kernel)
    assert [t.shape for t in narrow] == [(1, 2, 64), (1, 2, 32)]
    assert all(torch.equal(a, c) for a, c in zip(layer(x), pytorch))  # 6 rows: PyTorch's kernel, as before


def test_float32_activations_take_the_kernel_up_to_its_width_and_the_dense_copy_past_it():
    layer = _layer(40, 64, bias=True)
    layer.prepare(torch.float32)
    x = torch.randn(20, 64)
    dense = layer(x).clone()
    layer.few_rows = (*_kernel_tensors(_layer(40, 64, seed=1, bias=True)), 16)  # another layer's: shows which ran
    assert torch.equal(layer(x[:16]), gemv_int8_cpu.few_rows_linear(x[:16], *layer.few_rows[:3], 40))
    assert torch.equal(layer(x), dense)  # 20 rows: the dense copy, as before
    layer.few_rows = (*_kernel_tensors(layer), 16)
    torch.testing.assert_close(layer(x[:3]), dense[:3], rtol=1e-5, atol=1e-5)  # the same matmul, summed otherwise


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_compiled_forward_takes_the_same_kernels_as_eager_in_one_graph(dtype):
    from torch._dynamo.utils import counters

    layer = _layer(64, 32, bias=True)
    layer.prepare(dtype)
    # Another layer's weights in the kernel's slot: whichever forward takes the kernel shows it.
    other = _kernel_tensors(_layer(64, 32, seed=1, bias=True))
    layer.few_rows = (*other, 4)
    inputs = [torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows)).to(dtype) for rows in (1, 3, 6)]
    eager = [layer(x) for x in inputs]
    assert torch.equal(eager[1], gemv_int8_cpu.few_rows_linear(inputs[1], *other, 64))  # 3 rows: the kernel
    assert not torch.allclose(eager[2], gemv_int8_cpu.few_rows_linear(inputs[2], *other, 64), atol=1e-2)  # 6: not
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    graphs = []
    for x, e in zip(inputs, eager):
        assert torch.equal(compiled(x), e)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[2] == graphs[1]  # 3 and 6 rows: one graph, the width chosen inside the op


def test_the_width_is_measured_once_per_shape_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    probes = []

    def faster(candidate, baseline, in_features, dtype, widths):
        probes.append((in_features, tuple(widths)))
        return [True, True] + [False] * (len(widths) - 2)  # wins at 1 and 2 rows, loses wider

    monkeypatch.setattr(kernel_probe, "faster_by_width", faster)
    model = torch.nn.Sequential(_layer(64, 32), _layer(64, 32, 1), _layer(32, 64), _layer(8, 36),
                                _layer(64, 32).rows(0, 16))
    for m in model:
        m.prepare(torch.bfloat16)
    shapes = {"32x64": 2, "64x32": 2, "36x8": 2}
    assert attach_few_row_kernels(model, torch.bfloat16) == shapes
    widths = FEW_ROWS_PROBE["int8"]
    assert probes == [(32, widths), (64, widths), (36, widths)]  # one probe per shape (any input size)
    assert [m.few_rows and m.few_rows[-1] for m in model] == [2, 2, 2, 2, None]  # views keep the fused layer's
    x = torch.randn(1, 32).bfloat16()
    assert torch.equal(model[1](x), gemv_int8_cpu.few_rows_linear(x, *model[1].few_rows[:3], 64))
    detach_few_row_kernels(model)
    assert all(m.few_rows is None for m in model)
    assert attach_few_row_kernels(model, torch.bfloat16) == shapes and len(probes) == 3  # cached

    monkeypatch.setattr(kernel_probe, "faster_by_width", lambda *a: [False] * len(widths))
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "other"))
    fresh = torch.nn.Sequential(_layer(64, 32))
    assert attach_few_row_kernels(fresh, torch.bfloat16) == {} and fresh[0].few_rows is None  # never faster


def test_a_tie_does_not_end_the_kernels_widths(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    verdicts = {32: [True, None, True, False, True, True, True],  # None: a tie
                64: [True, False, True, True, True, True, True]}
    monkeypatch.setattr(kernel_probe, "faster_by_width", lambda c, b, in_features, dtype, widths: verdicts[in_features])
    model = torch.nn.Sequential(_layer(64, 32), _layer(32, 64))
    for m in model:
        m.prepare(torch.bfloat16)
    # 32 inputs: on past the tie at the 2nd width to the 3rd, which it wins, and a loss ends it; 64: the loss.
    widths = FEW_ROWS_PROBE["int8"]
    assert attach_few_row_kernels(model, torch.bfloat16) == {"32x64": widths[2], "64x32": widths[0]}


def test_the_probe_tells_a_tie_from_a_loss(monkeypatch):
    # Scripted seconds per cold call (candidate, baseline, round by round; repeats 1: the warm-up): the
    # candidate 2.0 s against 1.95 s is within MARGIN (a tie), against 1.5 s a loss, against 2.5 s a win.
    rounds, calls = kernel_probe.PROBE_ROUNDS, 1 + kernel_probe.PROBE_CONFIRM
    script = {1: iter([2.0, 1.95] * rounds * calls), 2: iter([2.0, 1.5] * rounds * calls), 4: iter([2.0, 2.5] * rounds)}
    monkeypatch.setattr(kernel_probe, "cold_seconds", lambda layers, x, flush, repeats=3:
                        0.0 if repeats == 1 else next(script[len(x)]))
    monkeypatch.setattr(kernel_probe, "FLUSH_BYTES", 64)
    assert kernel_probe.faster_by_width([None], [None], 8, torch.float32, (1, 2, 4)) == [None, False, True]
    assert all(next(times, None) is None for times in script.values())  # measured exactly as scripted


def test_the_kernels_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SPECDECODE_FEW_ROW_KERNELS", "0")
    gemv_int8_cpu._extension.cache_clear()
    try:
        assert not gemv_int8_cpu.fits(64, "cpu")
        model = torch.nn.Sequential(_layer(64, 32))
        model[0].prepare(torch.bfloat16)
        assert attach_few_row_kernels(model, torch.bfloat16) == {} and model[0].few_rows is None
    finally:
        gemv_int8_cpu._extension.cache_clear()


def test_a_quantised_model_gets_the_kernel_and_exact_mode_takes_it_away(tmp_path, monkeypatch):
    from specdecode.defaults import default_model_dir
    from specdecode.exact.rows import make_rows_invariant
    from specdecode.models.loader import load_model

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_probe, "faster_by_width", lambda candidate, baseline, k, dtype, widths: [True] * len(widths))
    model = load_model(default_model_dir(), torch.bfloat16, quantization=QuantScheme.parse("int8"))
    served = [m for m in model.modules() if isinstance(m, QuantizedLinear) and not m.is_view]
    assert served and all(m.few_rows is not None and m.few_rows[-1] == max(FEW_ROWS_PROBE["int8"]) for m in served)
    make_rows_invariant(model, torch.bfloat16, "cpu")
    assert all(m.few_rows is None for m in model.modules() if isinstance(m, QuantizedLinear))
