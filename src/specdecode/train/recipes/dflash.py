"""DFlash: a block-diffusion drafter over the target's fused hidden states, trained on
random anchors with all blocks packed in one forward under `dflash_block_mask`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from specdecode.models.llama import AttentionBatch, KVCache, LlamaForCausalLM
from specdecode.speculative.propose.drafters.dflash.model import DFlashConfig, DFlashDrafter, default_target_layers, save_dflash
from specdecode.tokenizer import Tokenizer
from specdecode.train.recipes.base import DrafterRecipe

if TYPE_CHECKING:
    from specdecode.train.drafter import DrafterTrainConfig


def build_dflash(target: LlamaForCausalLM, cfg: DrafterTrainConfig, train_tokens=None):
    tc = target.config
    mask_id = Tokenizer(cfg.target).mask_token_id
    if mask_id is None:
        raise ValueError("the target's tokenizer_config.json names no mask_token: DFlash needs a reserved mask id")
    layers = dataclasses.replace(tc, num_hidden_layers=cfg.dflash_layers)
    drafter = DFlashDrafter(DFlashConfig(layers, cfg.block_size, default_target_layers(tc.num_hidden_layers), mask_id))
    with torch.no_grad():
        torch.nn.init.normal_(drafter.fc.weight, 0.0, 0.02)
        for i, layer in enumerate(drafter.layers):  # start from the target's last layers
            layer.load_state_dict(target.model.layers[tc.num_hidden_layers - cfg.dflash_layers + i].state_dict())
        drafter.norm.load_state_dict(target.model.norm.state_dict())
    return drafter


def dflash_block_mask(anchors: torch.Tensor, block: int, context_len: int) -> torch.Tensor:
    """[B, 1, m*block, context_len + m*block] bool training mask: block i (anchor a_i) sees the
    context strictly before a_i, every position of its own block, and no other block."""
    B, m = anchors.shape
    n = m * block
    block_of = torch.arange(n, device=anchors.device) // block  # [n]
    anchor_of = anchors[:, block_of]  # [B, n]
    context = torch.arange(context_len, device=anchors.device)[None, None, :] < anchor_of[:, :, None]  # [B, n, C]
    same_block = (block_of[:, None] == block_of[None, :]).expand(B, n, n)
    return torch.cat([context, same_block], dim=2)[:, None]


def _block_states(drafter, target: LlamaForCausalLM, window: torch.Tensor, anchors_per_seq: int,
                  anchors: torch.Tensor | None = None):
    """The DFlash training pass: random anchors, all blocks packed in one forward under
    `dflash_block_mask`. Returns, for block positions j >= 1: the drafter's normed states
    [B, n, d], the target's logits at a + j - 1 (its distribution of token a + j) [B, n, V],
    j [n], and the true previous token x_{a+j-1} [B, n] (DSpark's Markov head input).
    Random anchors come from the global torch RNG (saved in training checkpoints)."""
    B, T = window.shape
    block = drafter.cfg.block_size
    device = window.device
    with torch.no_grad():
        out = target(window, torch.arange(T, device=device).expand(B, T), hidden_taps=drafter.cfg.target_layer_ids)
        p_logits = target.compute_logits(out.hidden)
        raw = torch.cat([out.taps[i] for i in drafter.cfg.target_layer_ids], dim=-1)
    if anchors is None:  # random anchors, sorted per sequence
        anchors = torch.stack([torch.randperm(T - block, device=device)[:anchors_per_seq] + 1
                               for _ in range(B)]).sort(dim=1).values  # [B, m]
    m = anchors.shape[1]
    n = m * block
    cache = KVCache(drafter.cfg.layers, B, T + n, torch.float32, device)
    slots = torch.arange(B, device=device)
    context_batch = AttentionBatch(None, slots, torch.arange(T, device=device).expand(B, T), T)
    drafter.write_context(drafter.context(raw), torch.arange(T, device=device).expand(B, T), context_batch, cache)
    j = torch.arange(n, device=device) % block  # position inside the block
    positions = anchors.repeat_interleave(block, dim=1) + j  # [B, n]
    ids = torch.where(j == 0, window.gather(1, positions), torch.full_like(positions, drafter.cfg.mask_token_id))
    batch = AttentionBatch(dflash_block_mask(anchors, block, T), slots, (T + torch.arange(n, device=device)).expand(B, n),
                           T + n, (0, B))
    hidden = drafter(target.model.embed_tokens(ids), positions, batch, cache)  # [B, n, d]
    labels = p_logits.gather(1, (positions - 1).clamp(min=0)[:, :, None].expand(-1, -1, p_logits.shape[-1]))
    previous = window.gather(1, (positions - 1).clamp(min=0))
    keep = j >= 1
    return hidden[:, keep], labels[:, keep], j[keep], previous[:, keep]


def position_weighted(per_token: torch.Tensor, j: torch.Tensor, gamma: float) -> torch.Tensor:
    """Mean of per-token losses [B, n], block position j weighted exp(-(j-1)/gamma)."""
    weights = torch.exp(-(j.float() - 1) / gamma)
    return (per_token * weights).sum() / (weights.sum() * per_token.shape[0])


def anchors_per_window(window: torch.Tensor) -> int:
    """One random anchor per 32 tokens of window."""
    return max(1, window.shape[1] // 32)


def dflash_loss(drafter, target, window) -> torch.Tensor:
    """Soft CE per block position, weighted exp(-(k-1)/gamma), gamma 7 for blocks of 16, 4 for 8."""
    hidden, p_logits, j, _ = _block_states(drafter, target, window, anchors_per_window(window))
    q_logits = target.lm_head(hidden).float()
    gamma = 7.0 if drafter.cfg.block_size >= 16 else 4.0
    return position_weighted(-(p_logits.float().softmax(-1) * torch.log_softmax(q_logits, dim=-1)).sum(-1), j, gamma)


def dflash_predict(drafter, target, window):
    """First draft position of each block (token a + 1) vs the target."""
    hidden, p_logits, j, _ = _block_states(drafter, target, window, anchors_per_window(window))
    first = j == 1
    return target.lm_head(hidden[:, first]).float(), p_logits[:, first]


def export_dflash(drafter, target, cfg: DrafterTrainConfig, report: dict) -> None:
    save_dflash(drafter, cfg.out_dir, cfg.target, report)


DFLASH = DrafterRecipe(build_dflash, dflash_loss, dflash_predict, export_dflash)
