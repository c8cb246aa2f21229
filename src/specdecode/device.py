"""One place that turns a device name into a torch device."""

from __future__ import annotations

import torch

from specdecode.errors import ConfigError


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """auto = CUDA when available, else CPU; a CUDA device asked for on a machine without
    CUDA is a ConfigError, not a crash at the first kernel."""
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device {name!r} is not a torch device; accepted: auto, cpu, cuda, cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r}: this machine has no CUDA device (torch.cuda.is_available() is "
                              "False); use device='cpu' or 'auto'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device
