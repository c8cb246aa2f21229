"""DeepSeek Sparse Attention's lightning indexer and IndexCache's shared top-k (METHODS.md 3.2).

The indexer scores every key a query may see, I(t, s) = sum_h w_{t,h} ReLU(q_{t,h} . k_s) with
one shared indexer key per token (kept in its own cache column, so a rejected draft token's key
rolls back with the rest of the cache), and the query attends to its top-`index_topk` keys only.
That holds for every forward shape: prefill, decode, chain and tree verification (each new
token selects its own keys under its own mask row).

IndexCache: a "shared" layer runs no indexer and reuses the selection of the nearest preceding
"full" layer, which `SparseContext` carries from layer to layer within one forward.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models.config import ModelConfig
from specdecode.models.layers import apply_rope, apply_rope_interleaved


@dataclasses.dataclass(slots=True)
class SparseContext:
    """What DSA layers of one forward share: this layer's indexer-key cache (set by the model
    loop per layer), and the latest full layer's selection for the shared layers after it."""

    index_cache: torch.Tensor | None = None  # [slots, max_len + 1, 1, index_head_dim] of the current layer
    selected: torch.Tensor | None = None  # [B, T, S] bool: keys the latest full layer chose
    top: torch.Tensor | None = None  # [B, T, k] their indices (may name masked keys where fewer than k are visible)
    record: list[torch.Tensor] | None = None  # when a list: every full layer appends its top-k indices [B, T, k]
    # Training (train/deepseek_target.py): `dense` attends to every key while the indexer learns
    # (V3.2's dense warm-up); `kl` collects each indexer's KL to its layer's attention.
    dense: bool = False
    kl: list[torch.Tensor] | None = None
    kl_rows: int | None = None  # the KL over the first kl_rows sequences only (its cost is the layer's attention again)


class Indexer(nn.Module):
    """The lightning indexer (HF / checkpoint names: wq_b, wk, k_norm, weights_proj)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = config.index_n_heads, config.index_head_dim, config.head_dim
        self.topk = config.index_topk
        self.rope_interleave = config.indexer_rope_interleave
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        rot = apply_rope_interleaved(rot, cos, sin) if self.rope_interleave else apply_rope(rot, cos, sin)
        return torch.cat((rot, rest), dim=-1)

    def key(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] -> the indexer key of each token [B, T, 1, index_head_dim] (what the cache keeps)."""
        return self._rope(self.k_norm(self.wk(x))[:, :, None], cos, sin)

    def scores(self, x: torch.Tensor, q_latent: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """I(t, s): x [B, T, d], q_latent [B, T, q_lora_rank] (MLA's normed query latent), keys
        [B, S, D] -> [B, T, S] float32 (unmasked)."""
        B, T, _ = x.shape
        q = self._rope(self.wq_b(q_latent).view(B, T, self.n_heads, self.head_dim), cos, sin)
        # Scores in float32 like the reference: [B, T, H, S], ReLU, then weighted over heads.
        scores = F.relu(torch.einsum("bthd,bsd->bths", q.float(), keys.float()) * self.head_dim ** -0.5)
        weights = self.weights_proj(x).float() * self.n_heads ** -0.5  # [B, T, H]
        return torch.einsum("bth,bths->bts", weights, scores)

    def select(self, scores: torch.Tensor, mask: torch.Tensor, record: list | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's top-k keys among those its mask row allows: scores [B, T, S], mask
        [B, T, S] bool -> (selected [B, T, S] bool, a subset of mask; indices [B, T, k])."""
        index = scores.detach().masked_fill(~mask, float("-inf"))
        top = index.topk(min(self.topk, index.shape[-1]), dim=-1).indices  # [B, T, k]
        if record is not None:
            record.append(top)
        return torch.zeros_like(mask).scatter_(-1, top, True) & mask, top
