"""What every drafter recipe is made of, and the loss pieces several recipes share."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

from specdecode.models.llama import LlamaForCausalLM


@dataclasses.dataclass(slots=True)
class DrafterRecipe:
    build: Callable  # (target, cfg, train_tokens) -> drafter module (trainable parameters set)
    loss: Callable  # (drafter, target, window [B, T]) -> scalar loss
    predict: Callable  # (drafter, target, window) -> (drafter logits, target logits) [B, T', V], aligned
    export: Callable  # (drafter, target, cfg, report) -> None
    finalize: Callable | None = None  # (drafter, target, val_tokens, cfg, device) -> report entries (calibration)


def target_logits(target: LlamaForCausalLM, inputs: torch.Tensor) -> torch.Tensor:
    B, T = inputs.shape
    with torch.no_grad():
        out = target(inputs, torch.arange(T, device=inputs.device).expand(B, T))
        return target.compute_logits(out.hidden)


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Forward KL(p_target || q_drafter) per token, averaged: soft cross-entropy minus target entropy."""
    V = student_logits.shape[-1]
    log_q = F.log_softmax(student_logits.float().reshape(-1, V), dim=-1)
    log_p = F.log_softmax(teacher_logits.float().reshape(-1, V), dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")


def soft_ce(q_logits: torch.Tensor, p_logits: torch.Tensor, draft_ids: torch.Tensor | None) -> torch.Tensor:
    """Mean soft cross-entropy of the drafter's logits against the target's distribution."""
    p = p_logits.float().softmax(-1)
    if draft_ids is not None:  # EAGLE-3: the target's distribution restricted to the draft vocabulary
        p = p[..., draft_ids]
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
    return -(p * F.log_softmax(q_logits.float(), dim=-1)).sum(-1).mean()
