"""What every frozen served linear layer (PackedLinear, Bf16WeightLinear, QuantizedLinear) does around its
matmul: exact mode's row tiling where it applies, and one output view per fused projection."""

from __future__ import annotations

import torch
from torch import nn


class ServedLinear(nn.Module):
    """A frozen linear layer whose subclass computes `_matmul(x [..., K]) -> [..., N]`. `split_sizes` makes
    it return one view per fused projection; `row_tiling` (exact mode: a RowTiling of models/llama.py
    found by exact/rows.py) calls the matmul on tiles of rows."""

    def __init__(self, split_sizes: list[int] | None = None):
        super().__init__()
        self.split_sizes = split_sizes
        self.row_tiling = None

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor):
        """x [..., K] -> [..., N] (or one view per split size)."""
        if self.row_tiling is not None and self.row_tiling.applies(x):
            from specdecode.models.llama import tile_rows  # llama.py imports what imports this module

            out = tile_rows(self._matmul, x, self.row_tiling)
        else:
            out = self._matmul(x)
        return out if self.split_sizes is None else out.split(self.split_sizes, dim=-1)
