"""The few-row bf16 kernel (kernels/gemv_cpu.cpp) and the layers that take it at decode widths."""

from __future__ import annotations

import pytest
import torch

from specdecode.kernels import gemv_cpu
from specdecode.models import kernel_probe
from specdecode.models.inference import PackedLinear, attach_few_row_kernels, can_pack, detach_few_row_kernels

pytestmark = pytest.mark.skipif(
    not (can_pack(torch.bfloat16, torch.device("cpu")) and gemv_cpu.fits(32, torch.bfloat16, "cpu")),
    reason="the few-row kernel needs AVX-512 BF16 and a C++ compiler")


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16()


@pytest.mark.parametrize("n,k", [(16, 32), (40, 64), (1024, 512), (37, 1408), (130, 6)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_computes_the_matmul(n, k, bias):
    w = _weight(n, k)
    b = (torch.randn(n) * 0.1).bfloat16() if bias else None
    blocked = gemv_cpu.block_weight(w)
    for m in (1, 2, 3, 4, 5, 6, 7, 9, 13, 16):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        ref = x.float() @ w.float().T + (b.float() if bias else 0)  # [m, n] in float32
        out = gemv_cpu.few_rows_linear(x, blocked, b, n)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        # bf16 output: within two of its units in the last place, plus float32 summation error
        torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=1e-4 * k ** 0.5)
    wrong = gemv_cpu.few_rows_linear(x, gemv_cpu.block_weight(_weight(n, k, seed=1)), b, n)
    assert not torch.allclose(wrong.float(), ref, rtol=2 ** -7, atol=1e-3)  # the check can fail


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    w = _weight(300, 512)
    blocked = gemv_cpu.block_weight(w)
    x = torch.randn(16, 512).bfloat16()
    alone = torch.cat([gemv_cpu.few_rows_linear(x[i:i + 1], blocked, None, 300) for i in range(16)])
    for m in range(1, 17):
        assert torch.equal(gemv_cpu.few_rows_linear(x[:m], blocked, None, 300), alone[:m]), m


def test_a_packed_layer_takes_the_kernel_up_to_its_width_and_onednn_past_it():
    w, b = _weight(96, 64), (torch.randn(96) * 0.1).bfloat16()
    layer = PackedLinear(w, b, split_sizes=[64, 32])
    x = torch.randn(2, 3, 64).bfloat16()
    onednn = [t.clone() for t in layer(x)]
    layer.few_rows = (gemv_cpu.block_weight(w), 2)
    narrow = layer(x[:1, :2])  # 2 rows: the kernel
    kernel = gemv_cpu.few_rows_linear(x[0, :2], layer.few_rows[0], b, 96)
    assert torch.equal(torch.cat(narrow, dim=-1)[0], kernel)
    assert [t.shape for t in narrow] == [(1, 2, 64), (1, 2, 32)]
    assert all(torch.equal(a, c) for a, c in zip(layer(x), onednn))  # 6 rows: oneDNN, as before


def test_a_compiled_forward_keeps_onednn():
    w = _weight(64, 32)
    layer = PackedLinear(w, None)
    onednn = [layer(torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows)).bfloat16()) for rows in (1, 3)]
    layer.few_rows = (gemv_cpu.block_weight(w), 4)
    compiled = torch.compile(layer, fullgraph=True)
    for rows, expected in zip((1, 3), onednn):
        x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows)).bfloat16()
        assert torch.equal(compiled(x), expected)


def test_the_width_is_measured_once_per_shape_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    probes = []

    def faster(candidate, baseline, in_features, dtype, widths):
        probes.append(in_features)
        return [True, False][:len(widths)]  # wins at 1 row, loses at 2

    monkeypatch.setattr(kernel_probe, "faster_by_width", faster)
    model = torch.nn.Sequential(PackedLinear(_weight(64, 32), None), PackedLinear(_weight(64, 32, 1), None),
                                PackedLinear(_weight(32, 64), None), PackedLinear(_weight(8, 41), None))
    assert attach_few_row_kernels(model, torch.bfloat16) == {"32x64": 1, "64x32": 1}
    assert probes == [32, 64]  # one probe per shape; 41 inputs are no multiple of 2: not probed
    assert [m.few_rows and m.few_rows[1] for m in model] == [1, 1, 1, None]
    x = torch.randn(1, 32).bfloat16()
    assert torch.equal(model[1](x), gemv_cpu.few_rows_linear(x, model[1].few_rows[0], None, 64))
    detach_few_row_kernels(model)
    assert all(m.few_rows is None for m in model)
    assert attach_few_row_kernels(model, torch.bfloat16) == {"32x64": 1, "64x32": 1} and len(probes) == 2  # cached

    # Forgetting the choices (`specdecode profile --reprobe-kernels`) measures every shape again; it deletes
    # this machine's files of every probe version, not another thread count's.
    machine = kernel_probe.cache_path().name.removesuffix("-p3.json")
    older, other_threads = (kernel_probe.cache_path().with_name(machine + suffix)
                            for suffix in ("-p2.json", "4-p3.json"))
    older.write_text("{}")
    other_threads.write_text("{}")
    assert kernel_probe.forget_choices() == sorted([kernel_probe.cache_path(), older])
    assert other_threads.is_file() and kernel_probe.forget_choices() == []
    detach_few_row_kernels(model)
    assert attach_few_row_kernels(model, torch.bfloat16) == {"32x64": 1, "64x32": 1} and len(probes) == 4

    monkeypatch.setattr(kernel_probe, "faster_by_width", lambda *a: [False] * 2)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "other"))
    fresh = torch.nn.Sequential(PackedLinear(_weight(64, 32), None))
    assert attach_few_row_kernels(fresh, torch.bfloat16) == {} and fresh[0].few_rows is None  # never faster


def test_a_lost_width_is_measured_again_before_it_counts(monkeypatch):
    # Scripted seconds per cold call, in call order (candidate, baseline, round by round): width 1
    # wins at once; width 2 loses its first measurement (a burst of load) and wins the next; width
    # 4 loses all 1 + PROBE_CONFIRM of them.
    rounds, confirm = kernel_probe.PROBE_ROUNDS, kernel_probe.PROBE_CONFIRM
    wins, loses = [1.0, 2.0] * rounds, [3.0, 2.0] * rounds
    script = {1: iter(wins), 2: iter(loses + wins), 4: iter(loses * (1 + confirm))}

    def cold(layers, x, flush, repeats=3):
        return 0.0 if repeats == 1 else next(script[len(x)])  # (1: the warm-up)

    monkeypatch.setattr(kernel_probe, "cold_seconds", cold)
    monkeypatch.setattr(kernel_probe, "FLUSH_BYTES", 64)
    assert kernel_probe.faster_by_width([None], [None], 8, torch.float32, (1, 2, 4)) == [True, True, False]
    assert all(next(times, None) is None for times in script.values())  # measured exactly as scripted
    assert all(next(times, None) is None for times in script.values())  # measured exactly as scripted


def test_exact_mode_keeps_onednn_at_every_width():
    from specdecode.defaults import default_model_dir
    from specdecode.exact.rows import make_rows_invariant
    from specdecode.models.loader import load_model

    model = load_model(default_model_dir(), torch.bfloat16)
    for m in model.modules():
        if isinstance(m, PackedLinear) and m.few_rows is None and gemv_cpu.fits(m.in_features, torch.bfloat16, "cpu"):
            m.few_rows = (gemv_cpu.block_weight(m.dense_weight()), 8)
    make_rows_invariant(model, torch.bfloat16, "cpu")
    assert all(m.few_rows is None for m in model.modules() if isinstance(m, PackedLinear))
