"""Medusa's network: K residual heads on the target's last hidden state, and its checkpoint folder."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specdecode.errors import ModelLoadError
from specdecode.models.checkpoint import read_checkpoint, save_checkpoint


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for block in self.blocks:  # residual blocks start as the identity
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [.., d] -> per-head states [.., K, d] (feed to the target's LM head)."""
        return torch.stack([hidden + nn.functional.silu(block(hidden)) for block in self.blocks], dim=-2)


def save_heads(heads: MedusaHeads, out: Path, target_dir: Path, report: dict | None = None) -> None:
    config = {"architectures": ["SpecdecodeMedusaHeads"], "medusa_num_heads": heads.num_heads,
              "hidden_size": heads.blocks[0].in_features}
    save_checkpoint(heads.state_dict(), config, out, target_dir, report)


def load_heads(path: Path, dtype, device) -> MedusaHeads:
    config, state = read_checkpoint(path, "Medusa")
    try:
        heads = MedusaHeads(config["hidden_size"], config["medusa_num_heads"])
        heads.load_state_dict(state)
    except (KeyError, RuntimeError) as e:
        raise ModelLoadError(f"{path} is not a Medusa checkpoint: {e}") from None
    return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)
