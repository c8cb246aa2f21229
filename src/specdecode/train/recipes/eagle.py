"""EAGLE, EAGLE-3 and MTP: one recipe over the feature-level drafters.

The variants differ only where their drafter classes say so (speculative/propose/drafters/
eagle/model.py): which target layers feed the feature (`feature_taps`, `raw_features`), how
deep training unrolls the drafter on its own outputs (`train_unroll_steps`), whether EAGLE-1's
feature regression is added (`regress_features`) and whether the LM head covers a reduced
draft vocabulary (`draft_to_target`). EAGLE-3's build adds its taps and that vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from specdecode.models.llama import AttentionBatch, LlamaForCausalLM
from specdecode.speculative.propose.drafters.eagle.checkpoint import save_drafter
from specdecode.speculative.propose.drafters.eagle.model import EagleConfig, build_drafter, default_aux_layers
from specdecode.train.recipes.base import DrafterRecipe, soft_ce

if TYPE_CHECKING:
    from specdecode.train.drafter import DrafterTrainConfig


def _build(target: LlamaForCausalLM, cfg: DrafterTrainConfig, aux_layers: tuple[int, ...], draft_vocab: int):
    layer = dataclasses.replace(target.config, num_hidden_layers=1)
    drafter = build_drafter(EagleConfig(cfg.method, layer, aux_layers, draft_vocab))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, 0.0, 0.02)
        # Start the decoder layer from the target's last layer: it already speaks the target's features
        # (EAGLE-3's 2d-wide q/k/v start from the feature half of that layer's projections).
        source = target.model.layers[-1].state_dict()
        for name, value in drafter.layer.state_dict().items():
            if source[name].shape == value.shape:
                value.copy_(source[name])
            else:
                value.zero_()
                value[..., value.shape[-1] - source[name].shape[-1]:].copy_(source[name])
    return drafter


def build_eagle(target: LlamaForCausalLM, cfg: DrafterTrainConfig, train_tokens=None):
    """EAGLE-1 and MTP: the target's vocabulary, no auxiliary taps."""
    return _build(target, cfg, (), 0)


def build_eagle3(target: LlamaForCausalLM, cfg: DrafterTrainConfig, train_tokens=None):
    """EAGLE-3: low / mid / high taps and a reduced draft vocabulary of the most frequent corpus tokens."""
    tc = target.config
    draft_vocab = min(cfg.draft_vocab_size, tc.vocab_size)
    drafter = _build(target, cfg, default_aux_layers(tc.num_hidden_layers), draft_vocab)
    with torch.no_grad():
        # Reduced draft vocabulary: the most frequent corpus tokens (EAGLE-3's d2t / t2d maps).
        counts = np.bincount(np.asarray(train_tokens, dtype=np.int64), minlength=tc.vocab_size)
        keep = np.sort(np.argsort(-counts, kind="stable")[:draft_vocab])
        drafter.d2t.copy_(torch.from_numpy(keep) - torch.arange(draft_vocab))
        drafter.lm_head.weight.copy_(target.lm_head.weight[torch.from_numpy(keep)])
        drafter.norm.load_state_dict(target.model.norm.state_dict())
    return drafter


def ttt_mask(step: int, num_anchors: int, block: int, device) -> torch.Tensor:
    """[1, 1, n, step * block] bool attention mask of unroll step `step` (1-based), anchors t < n.

    Keys are laid out step by step (block columns each). As at inference, the query of
    anchor t sees the first step's keys of anchors <= t (the drafter's cache of true-feature
    positions) and, of every later step up to its own, only the key of the same anchor t
    (the chain it drafted itself): EAGLE-3's training-time-test attention."""
    t = torch.arange(num_anchors, device=device)[:, None]
    cols = torch.arange(step * block, device=device)[None, :]
    first = (cols < block) & (cols <= t)
    own_chain = (cols >= block) & (cols % block == t)
    return (first | own_chain)[None, None]


def _eagle_unroll(drafter, target: LlamaForCausalLM, window: torch.Tensor, steps: int):
    """Yield (step j, drafter logits [B, n, V'], target logits [B, n, V], drafter output, next target feature)
    for j = 1..steps. Step j at anchor t takes (token t+j, feature): the target's f_t at j = 1, the
    drafter's own step-(j-1) output after that, at drafter position t+j-1, attending as at
    inference (`ttt_mask`). Each step's keys go into a fresh concatenated cache, so autograd sees
    no in-place change of anything an earlier step saved."""
    B, T = window.shape
    device = window.device
    taps = drafter.feature_taps(target.config, drafter.cfg.aux_layers)
    with torch.no_grad():
        out = target(window, torch.arange(T, device=device).expand(B, T), hidden_taps=taps)
        p_logits = target.compute_logits(out.hidden)  # [B, T, V]
        raw = drafter.raw_features(out.hidden, out.taps, drafter.cfg.aux_layers)
        embeds = target.model.embed_tokens(window)
    feats = drafter.features(raw)  # [B, T, d]
    f_in = feats[:, :-1]
    layer = drafter.cfg.layer
    kv_shape = (B, T, layer.num_key_value_heads, layer.head_dim)
    cache_k = cache_v = torch.zeros(B, 0, *kv_shape[2:], device=device)
    slots = torch.arange(B, device=device)
    for j in range(1, steps + 1):
        n = T - j
        if n <= 1:
            return
        cache_k = torch.cat([cache_k, torch.zeros(kv_shape, device=device)], dim=1)
        cache_v = torch.cat([cache_v, torch.zeros(kv_shape, device=device)], dim=1)
        write = ((j - 1) * T + torch.arange(n, device=device)).expand(B, n)
        batch = AttentionBatch(ttt_mask(j, n, T, device).expand(B, 1, n, j * T), slots, write, j * T, (0, B))
        positions = (torch.arange(n, device=device) + j - 1).expand(B, n)
        o = drafter(embeds[:, j: j + n], f_in[:, :n], positions, batch, cache_k, cache_v)
        yield j, drafter.logits(o, target), p_logits[:, j: j + n], o, feats[:, j: j + n]
        f_in = o[:, : n - 1]


def eagle_loss(drafter, target, window) -> torch.Tensor:
    """Soft cross-entropy against the target at every unrolled step, weighted 0.8^(j-1);
    EAGLE-1 adds its SmoothL1 feature regression on the first step."""
    steps = drafter.train_unroll_steps
    draft_ids = drafter.draft_to_target
    total = 0.0
    for j, q_logits, p_logits, o, next_feature in _eagle_unroll(drafter, target, window, steps):
        total = total + 0.8 ** (j - 1) * soft_ce(q_logits, p_logits, draft_ids)
        if j == 1 and drafter.regress_features:
            total = total + F.smooth_l1_loss(o.float(), next_feature.float())
    return total


def eagle_predict(drafter, target, window):
    """First draft position (true features): drafter logits over the target vocabulary vs the target's."""
    _, q_logits, p_logits, _, _ = next(_eagle_unroll(drafter, target, window, 1))
    draft_ids = drafter.draft_to_target
    if draft_ids is not None:
        # Tokens outside the draft vocabulary get a very low (finite, so KL stays defined) logit.
        full = torch.full((*q_logits.shape[:-1], p_logits.shape[-1]), -1e4, device=q_logits.device)
        q_logits = full.index_copy(-1, draft_ids, q_logits)
    return q_logits, p_logits


def export_eagle(drafter, target, cfg: DrafterTrainConfig, report: dict) -> None:
    save_drafter(drafter, cfg.out_dir, cfg.target, report)


EAGLE = DrafterRecipe(build_eagle, eagle_loss, eagle_predict, export_eagle)  # eagle, mtp
EAGLE3 = DrafterRecipe(build_eagle3, eagle_loss, eagle_predict, export_eagle)
