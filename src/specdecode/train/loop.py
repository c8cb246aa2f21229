"""The one optimisation loop of `train-target` and `train-drafter`.

Per step: learning rate from the cosine schedule, `batch_size` random windows drawn from the
token array with the data generator, the loss under autocast, zero_grad / backward / gradient
clipping / optimizer step, a progress bar with loss, lr and tokens/s, and a checkpoint every
`checkpoint_minutes`; a final checkpoint after the last step. A run resumed from a
checkpoint (`Checkpointer.load`) continues with the same schedule and the same windows.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Protocol

import numpy as np
import torch
from tqdm import tqdm

from specdecode.train.common import Checkpointer, cosine_lr, sample_windows


class LoopConfig(Protocol):
    """The fields of a training config the loop reads (PretrainConfig, DrafterTrainConfig)."""

    max_steps: int
    warmup_steps: int
    lr: float
    min_lr_ratio: float
    batch_size: int
    context: int
    grad_clip: float
    checkpoint_minutes: float


def run_loop(cfg: LoopConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             loss_fn: Callable[[torch.Tensor], torch.Tensor], tokens: np.ndarray, window_length: int, *,
             checkpointer: Checkpointer, data_gen: torch.Generator, step: int, device: torch.device,
             autocast_dtype: torch.dtype, desc: str, params: Iterable[torch.nn.Parameter] | None = None,
             on_step: Callable[[int], None] | None = None) -> tuple[int, list[float]]:
    """Train `model` from `step` to `cfg.max_steps`; returns (the last step, this run's per-step losses).

    `loss_fn(window)` takes a [batch_size, window_length] token tensor on `device`; `params`
    are the clipped parameters (default: all of the model's); `on_step(step)` runs before each
    step (a phase that depends on the step, e.g. DSA's dense warm-up)."""
    params = list(model.parameters() if params is None else params)
    tokens_per_step = cfg.batch_size * cfg.context
    losses: list[float] = []
    bar = tqdm(total=cfg.max_steps, initial=step, desc=desc, unit="step", dynamic_ncols=True)
    model.train()
    while step < cfg.max_steps:
        t0 = time.time()
        lr = cosine_lr(step, cfg.max_steps, cfg.warmup_steps, cfg.lr, cfg.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        window = sample_windows(tokens, cfg.batch_size, window_length, data_gen).to(device)
        if on_step is not None:
            on_step(step)
        with torch.autocast(device.type, dtype=autocast_dtype):
            loss = loss_fn(window)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        step += 1
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_step / (time.time() - t0):.0f}")
        if checkpointer.due(cfg.checkpoint_minutes):
            checkpointer.save(model, optimizer, data_gen, step)
    bar.close()
    checkpointer.save(model, optimizer, data_gen, step)
    return step, losses
