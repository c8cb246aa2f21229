"""Kernel weights laid out in one buffer in forward order: the same numbers, in module order."""

from __future__ import annotations

import torch
from torch import nn

from specdecode.models import inference
from specdecode.models.loader import load_model
from specdecode.models.quant import QuantScheme
from specdecode.models.weight_layout import lay_out_in_forward_order


class _Served(nn.Module):
    """A layer shaped like the served ones: a registered weight, kernel tensors beside it."""

    def __init__(self, n: int, wide: nn.Module | None = None):
        super().__init__()
        self.register_buffer("qweight", torch.randn(n, 8))
        self.few_rows = (torch.randn(n, 8), torch.randn(n), None, 4)
        self._kernel_weights = {("a8", "cpu"): (torch.randn(n, 16), self.qweight, 5)}
        self.wide = None if wide is None else (wide, 9)


def test_kernel_tensors_move_into_one_buffer_in_module_order_with_the_same_values():
    wide = _Served(3)
    model = nn.Sequential(_Served(4), _Served(5, wide=wide), _Served(6))
    before = [(m.few_rows[0].clone(), m.few_rows[1].clone(), m._kernel_weights[("a8", "cpu")][0].clone())
              for m in (*model, wide)]
    registered = [m.qweight for m in model]
    moved = lay_out_in_forward_order(model)
    assert moved > 0
    order = [model[0], model[1], wide, model[2]]  # a layer's wide copy right after it
    pointers = [p for m in order for p in (m.few_rows[0].data_ptr(), m.few_rows[1].data_ptr(),
                                           m._kernel_weights[("a8", "cpu")][0].data_ptr())]
    assert pointers == sorted(pointers) and all(p % 64 == 0 for p in pointers)
    assert len({m.few_rows[0].untyped_storage().data_ptr() for m in order}) == 1  # one buffer
    for m, (w, s, a8) in zip((*model, wide), before):
        assert torch.equal(m.few_rows[0], w) and torch.equal(m.few_rows[1], s)
        assert torch.equal(m._kernel_weights[("a8", "cpu")][0], a8)
        assert m.few_rows[2] is None and m.few_rows[3] == 4 and m._kernel_weights[("a8", "cpu")][2] == 5
    for m, q in zip(model, registered):  # registered tensors (the module's state) stay where they are
        assert m.qweight is q and m._kernel_weights[("a8", "cpu")][1] is q
    assert lay_out_in_forward_order(model) == 0  # views of the buffer: nothing left to move


def _in_a_buffer(layer: nn.Module) -> bool:
    few_rows = getattr(layer, "few_rows", None)
    return few_rows is not None and few_rows[0].untyped_storage().nbytes() > few_rows[0].nbytes


def test_a_laid_out_model_computes_exactly_what_it_did(native_model, monkeypatch):
    """int8 weights with float32 activations (few-row kernel tensors beside the registered ones), and
    bf16 where oneDNN packs: logits identical with and without the layout."""
    ids = torch.randint(3, 300, (2, 9))
    positions = torch.arange(9).expand(2, -1)
    for dtype, scheme in ((torch.float32, QuantScheme.parse("int8")), (torch.bfloat16, None)):
        laid_out = load_model(native_model, dtype, quantization=scheme)
        monkeypatch.setattr(inference, "lay_out_in_forward_order", lambda module: 0)
        scattered = load_model(native_model, dtype, quantization=scheme)
        monkeypatch.undo()
        # Where the few-row kernels serve this CPU, their tensors are views of the buffer.
        assert any(_in_a_buffer(m) for m in laid_out.modules()) == any(
            getattr(m, "few_rows", None) is not None for m in scattered.modules())
        for rows in (ids[:1, :1], ids):  # one token (the few-row kernels) and a prefill
            with torch.inference_mode():
                a = laid_out.compute_logits(laid_out(rows, positions[: rows.shape[0], : rows.shape[1]]).hidden)
                b = scattered.compute_logits(scattered(rows, positions[: rows.shape[0], : rows.shape[1]]).hidden)
            assert torch.equal(a, b)
