"""EAGLE-family drafter folders: our layout, and EAGLE-3 checkpoints in the speculators layout."""

from __future__ import annotations

from pathlib import Path

import torch

from specdecode.errors import ModelLoadError
from specdecode.interop.speculators import from_speculators, is_speculators
from specdecode.models.checkpoint import read_checkpoint, save_checkpoint
from specdecode.models.llama import RotaryEmbedding
from specdecode.speculative.propose.drafters.eagle.model import EagleConfig, EagleDrafter, build_drafter


def save_drafter(drafter: EagleDrafter, out: Path, target_dir: Path, report: dict | None = None) -> None:
    save_checkpoint(drafter.state_dict(), drafter.cfg.to_json(), out, target_dir, report)


def load_drafter(path: Path, dtype: torch.dtype, device) -> EagleDrafter:
    """Our checkpoint layout, or an EAGLE-3 checkpoint in the speculators layout."""
    data, state = read_checkpoint(path, "EAGLE/MTP drafter")
    try:
        if is_speculators(data):
            cfg, state = from_speculators(data, state)
        else:
            cfg = EagleConfig.from_json(data)
    except KeyError as e:
        raise ModelLoadError(f"{path} is not an EAGLE/MTP drafter checkpoint: missing {e}") from None
    drafter = build_drafter(cfg)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("rotary")]
    if missing or unexpected:
        raise ModelLoadError(f"{path}: weights do not fit the config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    drafter.rotary = RotaryEmbedding(cfg.layer)
    return drafter.to(device=device).to(dtype).eval().requires_grad_(False)  # served: prepare_for_inference fuses
