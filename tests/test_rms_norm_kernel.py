"""The one-call RMSNorm kernel (kernels/rms_norm_cpu.cpp) and when `RMSNorm` takes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdecode.kernels import rms_norm_cpu
from specdecode.models.layers import RMSNorm

pytestmark = pytest.mark.skipif(rms_norm_cpu._extension() is None, reason="the RMSNorm kernel needs a C++ compiler")


def _reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """models/layers.py RMSNorm's PyTorch ops."""
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 512), (3, 7, 512), (2, 5, 4, 64), (1, 70, 1408), (4, 37)])
def test_the_kernel_takes_the_same_rounding_steps(dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    out, ref = rms_norm_cpu.rms_norm(x, w, 1e-6), _reference(x, w, 1e-6)
    assert out.shape == ref.shape and out.dtype == dtype
    # Only the sum of squares' order differs: a unit in the last place or two (two roundings follow).
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), ref.float(), rtol=4 * ulp, atol=0)
    if dtype != torch.float32:
        assert (out == ref).float().mean() > 0.99  # rounded like PyTorch's ops almost everywhere
    assert not torch.allclose(rms_norm_cpu.rms_norm(x, w.flip(-1), 1e-6).float(), ref.float(), rtol=2 * ulp)


def test_strided_inputs_and_eps():
    x = torch.randn(2, 3, 8, 64)[..., :32]  # rows not contiguous
    w = torch.rand(32) + 0.5
    torch.testing.assert_close(rms_norm_cpu.rms_norm(x, w, 0.5), _reference(x, w, 0.5), rtol=1e-6, atol=0)
    assert not torch.allclose(rms_norm_cpu.rms_norm(x, w, 0.5), _reference(x, w, 1e-6), rtol=1e-4)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    x = torch.randn(300, 512).bfloat16()
    w = torch.rand(512).bfloat16()
    alone = torch.cat([rms_norm_cpu.rms_norm(x[i:i + 1], w, 1e-6) for i in range(300)])
    for m in (1, 2, 5, 64, 65, 300):
        assert torch.equal(rms_norm_cpu.rms_norm(x[:m], w, 1e-6), alone[:m]), m


def test_the_module_takes_the_kernel_for_inference_only():
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    x = torch.randn(3, 64)
    kernel = rms_norm_cpu.rms_norm(x, norm.weight.detach(), 1e-6)
    with torch.no_grad():
        assert torch.equal(norm(x), kernel)
    trained = norm(x)  # autograd: PyTorch's ops, so gradients flow
    assert trained.requires_grad
    trained.sum().backward()
    assert norm.weight.grad is not None
    compiled = torch.compile(norm, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), kernel, rtol=1e-6, atol=0)
    mixed = torch.randn(3, 64).bfloat16()  # float32 weight, bf16 input: PyTorch's type promotion
    with torch.no_grad():
        assert norm(mixed).dtype == torch.float32


def test_the_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SPECDECODE_NORM_KERNEL", "0")
    rms_norm_cpu._extension.cache_clear()
    try:
        assert not rms_norm_cpu.serves(torch.randn(2, 8), torch.ones(8))
    finally:
        monkeypatch.delenv("SPECDECODE_NORM_KERNEL")
        rms_norm_cpu._extension.cache_clear()
    assert rms_norm_cpu.serves(torch.randn(2, 8), torch.ones(8))
