"""DFlash: a block-diffusion drafter that drafts a whole block in one non-causal pass
(z-lab, arXiv 2602.06036; METHODS.md 2.7).

Input block at positions a .. a+B-1: [last committed token x_a, MASK x (B-1)], embedded with
the target's embedding (MASK = the tokenizer's reserved mask token). A few decoder layers
(the project's DecoderLayer) run once over it, bidirectional inside the block. Conditioning:
the hidden states of several evenly spaced target layers are concatenated, projected
(Linear n*d -> d) and RMS-normed into one context vector per committed position; every
draft layer turns those into extra keys and values (its own k_proj / v_proj, RoPE at the
absolute position), so block queries attend to [context ; block]. Output j (j >= 1), through
the drafter's norm and the target's LM head, is the distribution of token a+j.

Context K/V of committed positions persist in the drafter's cache (written once, when the
position is consumed); block columns are overwritten by the next proposal. Drafts at the B-1
positions are drawn independently from their q_j (greedy: argmax); q_j does not depend on
the draws before it, which is still an exact proposal for rejection sampling.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from specdecode.errors import ModelLoadError
from specdecode.models.checkpoint import read_checkpoint, save_checkpoint
from specdecode.models.config import ModelConfig
from specdecode.models.llama import AttentionBatch, DecoderLayer, KVCache, RMSNorm, RotaryEmbedding, write_kv


def default_target_layers(num_target_layers: int, n: int = 3) -> tuple[int, ...]:
    """n evenly spaced target layers (HF hidden_states numbering, 1 .. L-1 for n >= 2)."""
    if n == 1:
        return (num_target_layers // 2,)
    step = (num_target_layers - 2) / (n - 1)
    return tuple(sorted({1 + round(i * step) for i in range(n)}))


@dataclasses.dataclass(slots=True)
class DFlashConfig:
    layers: ModelConfig  # the draft layers: the target's width and heads, num_hidden_layers = draft depth
    block_size: int  # B: one anchor + B - 1 drafts
    target_layer_ids: tuple[int, ...]
    mask_token_id: int

    def to_json(self) -> dict:
        return {"architectures": ["SpecdecodeDFlashDrafter"], "block_size": self.block_size,
                "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
                "layers": self.layers.to_hf_dict()}

    @classmethod
    def from_json(cls, data: dict) -> "DFlashConfig":
        return cls(ModelConfig.from_hf_dict(data["layers"]), data["block_size"],
                   tuple(data["dflash_config"]["target_layer_ids"]), data["dflash_config"]["mask_token_id"])


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        d, eps = cfg.layers.hidden_size, cfg.layers.rms_norm_eps
        self.fc = nn.Linear(len(cfg.target_layer_ids) * d, d, bias=False)
        self.context_norm = RMSNorm(d, eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg.layers) for _ in range(cfg.layers.num_hidden_layers))
        self.norm = RMSNorm(d, eps)
        self.rotary = RotaryEmbedding(cfg.layers)

    def context(self, raw: torch.Tensor) -> torch.Tensor:
        """Concatenated target taps [.., n*d] -> context vectors [.., d]."""
        return self.context_norm(self.fc(raw))

    def write_context(self, context: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, cache: KVCache) -> None:
        """Each draft layer's K/V of the context vectors [B, T, d] into the cache columns of `batch`."""
        cos, sin = self.rotary(positions, context.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(context, cos, sin)
            write_kv(cache.k[i], cache.v[i], batch, k, v)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, cache: KVCache) -> torch.Tensor:
        """Block embeddings [B, T, d] -> normed outputs [B, T, d] (attending to cached context)."""
        cos, sin = self.rotary(positions, embeds.dtype)
        x = embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, batch, cache.k[i], cache.v[i])
        return self.norm(x)


def save_dflash(drafter: DFlashDrafter, out: Path, target_dir: Path, report: dict | None = None) -> None:
    save_checkpoint(drafter.state_dict(), drafter.cfg.to_json(), out, target_dir, report)


def load_block_drafter(path: Path, kind: str, build, dtype, device):
    """A DFlash-family drafter: build(config json) -> module, then its weights."""
    config, state = read_checkpoint(path, kind)
    try:
        drafter = build(config)
        drafter.load_state_dict(state, strict=False)
    except (KeyError, RuntimeError) as e:
        raise ModelLoadError(f"{path} is not a {kind} checkpoint: {e}") from None
    drafter.rotary = RotaryEmbedding(drafter.cfg.layers)
    return drafter.to(device=device, dtype=dtype).eval().requires_grad_(False)  # served: prepare_for_inference fuses


def load_dflash(path: Path, dtype, device) -> DFlashDrafter:
    return load_block_drafter(path, "DFlash", lambda c: DFlashDrafter(DFlashConfig.from_json(c)), dtype, device)
