"""DSpark: a DFlash backbone plus a Markov (bigram) head and a confidence head, the latter
calibrated position by position after training."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from specdecode.models.llama import LlamaForCausalLM
from specdecode.speculative.propose.drafters.dspark.model import DSparkConfig, DSparkDrafter, save_dspark
from specdecode.train.common import sample_windows
from specdecode.train.recipes.base import DrafterRecipe
from specdecode.train.recipes.dflash import _block_states, anchors_per_window, build_dflash, position_weighted

if TYPE_CHECKING:
    from specdecode.train.drafter import DrafterTrainConfig


def build_dspark(target: LlamaForCausalLM, cfg: DrafterTrainConfig, train_tokens=None):
    backbone = build_dflash(target, cfg)
    drafter = DSparkDrafter(DSparkConfig(backbone.cfg, cfg.markov_rank), target.config.vocab_size)
    drafter.load_state_dict(backbone.state_dict(), strict=False)
    return drafter


def _dspark_terms(drafter, target, window):
    hidden, p_logits, j, previous = _block_states(drafter, target, window, anchors_per_window(window))
    q_logits = drafter.markov_logits(target.lm_head(hidden).float(), previous)
    p = p_logits.float().softmax(-1)
    q = q_logits.softmax(-1)
    tv = 0.5 * (p - q).abs().sum(-1)  # [B, n]
    conf_logit = drafter.confidence_logit(hidden, previous)
    return q_logits, p_logits, p, tv, conf_logit, j


def dspark_loss(drafter, target, window) -> torch.Tensor:
    """0.1 soft CE + 0.9 TV + 1.0 BCE(confidence, 1 - TV), positions weighted exp(-(j-1)/4)."""
    q_logits, _, p, tv, conf_logit, j = _dspark_terms(drafter, target, window)
    ce = -(p * torch.log_softmax(q_logits, dim=-1)).sum(-1)
    bce = F.binary_cross_entropy_with_logits(conf_logit, (1 - tv).detach(), reduction="none")
    return position_weighted(0.1 * ce + 0.9 * tv + bce, j, 4.0)


def dspark_predict(drafter, target, window):
    q_logits, p_logits, _, _, _, j = _dspark_terms(drafter, target, window)
    first = j == 1
    return q_logits[:, first], p_logits[:, first]


@torch.no_grad()
def calibrate_dspark(drafter, target, val: np.ndarray, cfg: DrafterTrainConfig, device) -> dict:
    """Per-position temperature on the confidence logit, fitted left to right so that the
    cumulative product a_j matches the survival prod_{i<=j} (1 - TV_i) on held-out windows
    (BCE on a grid of temperatures). Reports the expected calibration error before / after."""
    drafter.eval()
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    logits, survival = [], []
    block = drafter.cfg.block_size
    for _ in range(cfg.eval_windows):
        window = sample_windows(val, 1, cfg.context, gen).to(device)
        _, _, _, tv, conf_logit, j = _dspark_terms(drafter, target, window)
        per_block = block - 1
        logits.append(conf_logit.reshape(-1, per_block))  # [blocks, B-1]
        survival.append(torch.cumprod(1 - tv.reshape(-1, per_block), dim=1))
    logits, survival = torch.cat(logits), torch.cat(survival)
    grid = torch.tensor([0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0])
    temps, prefix = [], torch.ones(logits.shape[0])
    for pos in range(logits.shape[1]):
        candidates = prefix[:, None] * torch.sigmoid(logits[:, pos, None] / grid[None, :])  # [N, grid]
        target_s = survival[:, pos, None].expand_as(candidates)
        loss = F.binary_cross_entropy(candidates.clamp(1e-6, 1 - 1e-6), target_s, reduction="none").mean(0)
        best = int(loss.argmin())
        temps.append(float(grid[best]))
        prefix = candidates[:, best]
    before = expected_calibration_error(torch.cumprod(torch.sigmoid(logits), dim=1), survival)
    drafter.dspark.confidence_temperatures = temps
    after = expected_calibration_error(torch.cumprod(torch.sigmoid(logits / torch.tensor(temps)), dim=1), survival)
    drafter.train()
    return {"confidence_temperatures": temps, "ece_before_calibration": before, "ece_after_calibration": after}


def expected_calibration_error(predicted: torch.Tensor, actual: torch.Tensor, bins: int = 10) -> float:
    """Mean |mean prediction - mean outcome| over equal-width prediction bins, weighted by bin size."""
    predicted, actual = predicted.flatten(), actual.flatten()
    index = (predicted * bins).long().clamp(max=bins - 1)
    total = 0.0
    for b in range(bins):
        sel = index == b
        if sel.any():
            total += sel.float().mean().item() * abs(predicted[sel].mean().item() - actual[sel].mean().item())
    return total


def export_dspark(drafter, target, cfg: DrafterTrainConfig, report: dict) -> None:
    save_dspark(drafter, cfg.out_dir, cfg.target, report)


DSPARK = DrafterRecipe(build_dspark, dspark_loss, dspark_predict, export_dspark, calibrate_dspark)
