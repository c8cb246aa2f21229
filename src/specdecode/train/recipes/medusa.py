"""Medusa-1 on a frozen target: K residual heads on the target's last hidden state, sharing its LM head."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdecode.models.llama import LlamaForCausalLM
from specdecode.speculative.propose.drafters.medusa.model import MedusaHeads, save_heads
from specdecode.train.recipes.base import DrafterRecipe, soft_ce

if TYPE_CHECKING:
    from specdecode.train.drafter import DrafterTrainConfig


def build_medusa(target: LlamaForCausalLM, cfg: DrafterTrainConfig, train_tokens=None):
    return MedusaHeads(target.config.hidden_size, cfg.medusa_heads)


def _medusa_logits(heads, target: LlamaForCausalLM, window: torch.Tensor):
    B, T = window.shape
    with torch.no_grad():
        out = target(window, torch.arange(T, device=window.device).expand(B, T))
        p_logits = target.compute_logits(out.hidden)  # [B, T, V]
    return target.lm_head(heads(out.hidden)).float(), p_logits  # [B, T, K, V]


def medusa_loss(heads, target, window) -> torch.Tensor:
    """Head i (0-based) at position t predicts token t+i+2: soft CE against the target's
    distribution at position t+i+1, weighted 0.8^i (Medusa-1 on a frozen target)."""
    q_logits, p_logits = _medusa_logits(heads, target, window)
    T = window.shape[1]
    total = 0.0
    for i in range(heads.num_heads):
        n = T - (i + 1)
        total = total + 0.8 ** i * soft_ce(q_logits[:, :n, i], p_logits[:, i + 1: i + 1 + n], None)
    return total


def medusa_predict(heads, target, window):
    q_logits, p_logits = _medusa_logits(heads, target, window)
    return q_logits[:, :-1, 0], p_logits[:, 1:]


def export_medusa(heads, target, cfg: DrafterTrainConfig, report: dict) -> None:
    save_heads(heads, cfg.out_dir, cfg.target, report)


MEDUSA = DrafterRecipe(build_medusa, medusa_loss, medusa_predict, export_medusa)
