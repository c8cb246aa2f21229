"""Quantisation-aware training (`train-drafter --qat int8|int4`): the drafter's linear layers
compute with the weights they will be served with.

Every linear layer that serving quantises (`models/quant.py`'s `quantize_module`: all of them,
but an int4 layer whose input width is no multiple of the group) multiplies by
`dequantize(quantize(bf16(w)))` in the forward pass, made by the same `quantize_weight` serving
uses on the bf16 checkpoint, so the served int8/int4 drafter has exactly the weights training saw. The backward pass treats
the rounding as the identity (straight-through estimator): the gradient updates the latent
float weight `w`, which is what the checkpoint stores; serving quantises it again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models.quant import QuantizedLinear, QuantScheme, quantize_weight


def fake_quantize(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """weight [N, K] -> the weight serving will multiply by: rounded to bf16 as the checkpoint
    stores it, then quantised as `scheme` stores it. Gradient: the identity."""
    with torch.no_grad():
        N, K = weight.shape
        stored = weight.to(torch.bfloat16).float()  # save_checkpoint writes bf16; serving quantises that
        served = QuantizedLinear(quantize_weight(stored, scheme), K, N, scheme).dequantize().to(weight.dtype)
    return served + (weight - weight.detach())  # exactly `served` in value (w - w == 0), w's gradient


class FakeQuantLinear(nn.Linear):
    """An nn.Linear whose forward uses its fake-quantised weight (set by `enable_qat`; the
    parameters and their names stay the nn.Linear's, so checkpoints and exports are unchanged)."""

    qat_scheme: QuantScheme

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, fake_quantize(self.weight, self.qat_scheme), self.bias)


def enable_qat(drafter: nn.Module, scheme: QuantScheme, exclude: tuple[nn.Module, ...] = ()) -> list[str]:
    """Turn the drafter's served-quantised linear layers into FakeQuantLinear (in place); the
    layers of the `exclude` modules (the target, whose layers a drafter may hold) are left
    alone. Returns the names of the layers changed."""
    if not scheme.weight_only:
        from specdecode.errors import ConfigError

        raise ConfigError(f"quantisation-aware training covers weight-only schemes (int8, int4-g*), not {scheme.name}")
    shared = {id(m) for module in exclude for m in module.modules()}
    changed = []
    for name, module in drafter.named_modules():
        if type(module) is not nn.Linear or id(module) in shared:
            continue
        if not scheme.fits(module.in_features):
            continue  # serving keeps this layer in the model's dtype too (quantize_module's `fits`)
        module.__class__ = FakeQuantLinear
        module.qat_scheme = scheme
        changed.append(name)
    return changed
