"""RMSNorm as one C++ call per forward on a CPU (rms_norm_cpu.cpp): the float32 statistics and the
rounding steps of `models.layers.RMSNorm`, without PyTorch's five to seven ops per call.

Served to eager inference forwards on a CPU (no autograd, not under `torch.compile`, weight in the
input's dtype) where the build succeeds; anything else keeps the PyTorch ops.
SPECDECODE_NORM_KERNEL=0 turns it off.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from specdecode.kernels.build import optional_extension

SOURCE = Path(__file__).with_name("rms_norm_cpu.cpp")


@functools.cache
def _extension():
    """The built module, or None where it is turned off or the build failed (logged once)."""
    return optional_extension("rms_norm_cpu", SOURCE, "SPECDECODE_NORM_KERNEL")


def serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this call can take the kernel (checked per call: cheap attribute reads first)."""
    return (x.device.type == "cpu" and weight.dtype == x.dtype and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and _extension() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] (x's dtype) -> dtype(weight * dtype(x * rsqrt(mean(x^2) + eps)))."""
    return _extension().rms_norm(x, weight, eps)
