"""`specdecode train-drafter`: train a drafter against a target's own behaviour.

Methods register a `DrafterRecipe` in `RECIPES`; the loop (data windows from the stdlib
corpus, target soft labels computed on the fly, AdamW + cosine, checkpoints, --resume,
export, validation agreement) is shared.

draft_model: a 2-layer Llama with the target's width, distilled from the target's logits
(forward KL = soft cross-entropy against the target distribution). It starts from the
target itself: the embedding / LM head (tied, frozen: drafts must live in the target's
vocabulary anyway), the final norm, the attention of the target's first and last layers,
and the `intermediate_size` MLP neurons of those layers with the largest output norm.
Distillation then teaches two layers to imitate six.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from specdecode.models.llama import LlamaForCausalLM
from specdecode.models.loader import load_model
from specdecode.train.common import Checkpointer, cosine_lr, sample_windows, tokenize_corpus

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class DrafterTrainConfig:
    method: str
    target: Path
    out_dir: Path
    work_dir: Path
    max_steps: int = 600
    batch_size: int = 4
    context: int = 1024
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_minutes: float = 5.0
    eval_windows: int = 16
    dtype: str = "bfloat16"  # autocast dtype for target and drafter
    device: str = "auto"
    data: str = "corpus"  # corpus: stdlib windows; generated: the target's own continuations of corpus prompts
    generated_sequences: int = 2000
    # draft_model shape
    num_layers: int = 2
    intermediate_size: int = 512
    # eagle3: reduced draft vocabulary (most frequent tokens)
    draft_vocab_size: int = 4096
    medusa_heads: int = 4
    # dflash / dspark
    block_size: int = 8
    dflash_layers: int = 2
    markov_rank: int = 128

    def __post_init__(self) -> None:
        self.target, self.out_dir, self.work_dir = Path(self.target), Path(self.out_dir), Path(self.work_dir)
        if self.method not in RECIPES:
            raise ValueError(f"--method {self.method!r} has no trainer; accepted: {', '.join(RECIPES)}")
        if self.data not in ("corpus", "generated"):
            raise ValueError(f"--data {self.data!r}: accepted: corpus, generated")


@dataclasses.dataclass(slots=True)
class DrafterRecipe:
    build: Callable  # (target, cfg, train_tokens) -> drafter module (trainable parameters set)
    loss: Callable  # (drafter, target, window [B, T]) -> scalar loss
    predict: Callable  # (drafter, target, window) -> (drafter logits, target logits) [B, T', V], aligned
    export: Callable  # (drafter, target, cfg, report) -> None
    finalize: Callable | None = None  # (drafter, target, val_tokens, cfg, device) -> report entries (calibration)


# ---- draft_model -------------------------------------------------------------------------------

def build_draft_model(target: LlamaForCausalLM, cfg: DrafterTrainConfig, train_tokens=None) -> LlamaForCausalLM:
    tc = target.config
    dc = dataclasses.replace(tc, num_hidden_layers=cfg.num_layers, intermediate_size=cfg.intermediate_size,
                             tie_word_embeddings=True)
    drafter = LlamaForCausalLM(dc)
    with torch.no_grad():
        drafter.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        drafter.model.norm.weight.copy_(target.model.norm.weight)
        # The first layers and the last one: the last layer shapes the output distribution most.
        sources = list(range(cfg.num_layers - 1)) + [tc.num_hidden_layers - 1]
        for layer, source in zip(drafter.model.layers, sources):
            src = target.model.layers[source]
            layer.self_attn.load_state_dict(src.self_attn.state_dict())
            layer.input_layernorm.load_state_dict(src.input_layernorm.state_dict())
            layer.post_attention_layernorm.load_state_dict(src.post_attention_layernorm.state_dict())
            keep = src.mlp.down_proj.weight.norm(dim=0).topk(cfg.intermediate_size).indices  # strongest neurons
            layer.mlp.gate_proj.weight.copy_(src.mlp.gate_proj.weight[keep])
            layer.mlp.up_proj.weight.copy_(src.mlp.up_proj.weight[keep])
            layer.mlp.down_proj.weight.copy_(src.mlp.down_proj.weight[:, keep])
    drafter.model.embed_tokens.weight.requires_grad_(False)  # tied with the LM head: the target's vocabulary
    return drafter


def draft_model_predict(drafter: LlamaForCausalLM, target: LlamaForCausalLM, window: torch.Tensor):
    B, T = window.shape
    out = drafter(window, torch.arange(T, device=window.device).expand(B, T))
    return drafter.compute_logits(out.hidden), target_logits(target, window)


def draft_model_loss(drafter, target, window) -> torch.Tensor:
    return distill_loss(*draft_model_predict(drafter, target, window))


def export_draft_model(drafter: LlamaForCausalLM, target: LlamaForCausalLM, cfg: DrafterTrainConfig, report: dict) -> None:
    from specdecode.models.checkpoint import save_checkpoint

    state = {k: v for k, v in drafter.state_dict().items() if k != "lm_head.weight"}  # tied
    save_checkpoint(state, drafter.config.to_hf_dict(), cfg.out_dir, cfg.target, report)


# ---- EAGLE, EAGLE-3, MTP ------------------------------------------------------------------------

def build_eagle(target: LlamaForCausalLM, cfg: DrafterTrainConfig, train_tokens=None):
    from specdecode.speculative.propose.drafters.eagle.model import EagleConfig, build_drafter, default_aux_layers

    tc = target.config
    layer = dataclasses.replace(tc, num_hidden_layers=1)
    aux = default_aux_layers(tc.num_hidden_layers) if cfg.method == "eagle3" else ()
    draft_vocab = min(cfg.draft_vocab_size, tc.vocab_size) if cfg.method == "eagle3" else 0
    drafter = build_drafter(EagleConfig(cfg.method, layer, aux, draft_vocab))
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
        if cfg.method == "eagle3":
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
    from specdecode.models.llama import AttentionBatch

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


def _soft_ce(q_logits: torch.Tensor, p_logits: torch.Tensor, draft_ids: torch.Tensor | None) -> torch.Tensor:
    p = p_logits.float().softmax(-1)
    if draft_ids is not None:  # EAGLE-3: the target's distribution restricted to the draft vocabulary
        p = p[..., draft_ids]
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
    return -(p * F.log_softmax(q_logits.float(), dim=-1)).sum(-1).mean()


def eagle_loss(drafter, target, window) -> torch.Tensor:
    """Soft cross-entropy against the target at every unrolled step, weighted 0.8^(j-1);
    EAGLE-1 adds its SmoothL1 feature regression on the first step."""
    steps = drafter.train_unroll_steps
    draft_ids = drafter.draft_to_target
    total = 0.0
    for j, q_logits, p_logits, o, next_feature in _eagle_unroll(drafter, target, window, steps):
        total = total + 0.8 ** (j - 1) * _soft_ce(q_logits, p_logits, draft_ids)
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
    from specdecode.speculative.propose.drafters.eagle.checkpoint import save_drafter

    save_drafter(drafter, cfg.out_dir, cfg.target, report)


# ---- Medusa ----------------------------------------------------------------------------------------

def build_medusa(target: LlamaForCausalLM, cfg: DrafterTrainConfig, train_tokens=None):
    from specdecode.speculative.propose.drafters.medusa.model import MedusaHeads

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
        total = total + 0.8 ** i * _soft_ce(q_logits[:, :n, i], p_logits[:, i + 1: i + 1 + n], None)
    return total


def medusa_predict(heads, target, window):
    q_logits, p_logits = _medusa_logits(heads, target, window)
    return q_logits[:, :-1, 0], p_logits[:, 1:]


def export_medusa(heads, target, cfg: DrafterTrainConfig, report: dict) -> None:
    from specdecode.speculative.propose.drafters.medusa.model import save_heads

    save_heads(heads, cfg.out_dir, cfg.target, report)


# ---- DFlash ------------------------------------------------------------------------------------

def build_dflash(target: LlamaForCausalLM, cfg: DrafterTrainConfig, train_tokens=None):
    from specdecode.speculative.propose.drafters.dflash.model import DFlashConfig, DFlashDrafter, default_target_layers
    from specdecode.tokenizer import Tokenizer

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
    j [n], and the true previous token x_{a+j-1} [B, n] (DSpark's Markov head input)."""
    from specdecode.models.llama import AttentionBatch, KVCache

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


def _position_weighted(per_token: torch.Tensor, j: torch.Tensor, gamma: float) -> torch.Tensor:
    weights = torch.exp(-(j.float() - 1) / gamma)
    return (per_token * weights).sum() / (weights.sum() * per_token.shape[0])


def _anchors(window: torch.Tensor) -> int:
    return max(1, window.shape[1] // 32)


def dflash_loss(drafter, target, window) -> torch.Tensor:
    """Soft CE per block position, weighted exp(-(k-1)/gamma), gamma 7 for blocks of 16, 4 for 8."""
    hidden, p_logits, j, _ = _block_states(drafter, target, window, _anchors(window))
    q_logits = target.lm_head(hidden).float()
    gamma = 7.0 if drafter.cfg.block_size >= 16 else 4.0
    return _position_weighted(-(p_logits.float().softmax(-1) * torch.log_softmax(q_logits, dim=-1)).sum(-1), j, gamma)


def dflash_predict(drafter, target, window):
    """First draft position of each block (token a + 1) vs the target."""
    hidden, p_logits, j, _ = _block_states(drafter, target, window, _anchors(window))
    first = j == 1
    return target.lm_head(hidden[:, first]).float(), p_logits[:, first]


def export_dflash(drafter, target, cfg: DrafterTrainConfig, report: dict) -> None:
    from specdecode.speculative.propose.drafters.dflash.model import save_dflash

    save_dflash(drafter, cfg.out_dir, cfg.target, report)


# ---- DSpark ------------------------------------------------------------------------------------

def build_dspark(target: LlamaForCausalLM, cfg: DrafterTrainConfig, train_tokens=None):
    from specdecode.speculative.propose.drafters.dspark.model import DSparkConfig, DSparkDrafter

    backbone = build_dflash(target, cfg)
    drafter = DSparkDrafter(DSparkConfig(backbone.cfg, cfg.markov_rank), target.config.vocab_size)
    drafter.load_state_dict(backbone.state_dict(), strict=False)
    return drafter


def _dspark_terms(drafter, target, window):
    hidden, p_logits, j, previous = _block_states(drafter, target, window, _anchors(window))
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
    return _position_weighted(0.1 * ce + 0.9 * tv + bce, j, 4.0)


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
    from specdecode.speculative.propose.drafters.dspark.model import save_dspark

    save_dspark(drafter, cfg.out_dir, cfg.target, report)


RECIPES: dict[str, DrafterRecipe] = {
    "dspark": DrafterRecipe(build_dspark, dspark_loss, dspark_predict, export_dspark, calibrate_dspark),
    "dflash": DrafterRecipe(build_dflash, dflash_loss, dflash_predict, export_dflash),
    "medusa": DrafterRecipe(build_medusa, medusa_loss, medusa_predict, export_medusa),
    "draft_model": DrafterRecipe(build_draft_model, draft_model_loss, draft_model_predict, export_draft_model),
    **{m: DrafterRecipe(build_eagle, eagle_loss, eagle_predict, export_eagle) for m in ("eagle", "eagle3", "mtp")},
}


# ---- the shared loop ---------------------------------------------------------------------------

def invocation() -> str | None:
    """The command line that is running, as typed (None when not run from the CLI)."""
    import shlex
    import sys

    name = Path(sys.argv[0]).name
    return shlex.join(["specdecode", *sys.argv[1:]]) if name == "specdecode" else None


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


@torch.no_grad()
def evaluate_agreement(recipe: DrafterRecipe, drafter, target, val: np.ndarray, cfg: DrafterTrainConfig, device, dtype) -> dict:
    """On fixed validation windows: top-1 agreement with the target (greedy acceptance per
    token) and mean sum_x min(p, q) = 1 - TV (sampled acceptance per token, METHODS.md 1)."""
    drafter.eval()
    n = cfg.eval_windows
    starts = np.linspace(0, len(val) - cfg.context - 1, n).astype(np.int64)
    agree, overlap, kl = [], [], []
    for i in range(0, n, cfg.batch_size):
        window = torch.from_numpy(np.stack([val[s: s + cfg.context].astype(np.int64) for s in starts[i: i + cfg.batch_size]])).to(device)
        with torch.autocast(device.type, dtype=dtype):
            q_logits, p_logits = recipe.predict(drafter, target, window)
        p, q = p_logits.float().softmax(-1), q_logits.float().softmax(-1)
        agree.append((p_logits.argmax(-1) == q_logits.argmax(-1)).float().mean().item())
        overlap.append(torch.minimum(p, q).sum(-1).mean().item())
        kl.append(distill_loss(q_logits, p_logits).item())
    drafter.train()
    return {"val_top1_agreement": float(np.mean(agree)), "val_one_minus_tv": float(np.mean(overlap)),
            "val_kl": float(np.mean(kl))}


def train_drafter(cfg: DrafterTrainConfig, resume: bool = False) -> dict:
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if cfg.device == "auto" else cfg.device))
    dtype = getattr(torch, cfg.dtype)
    recipe = RECIPES[cfg.method]
    target = load_model(cfg.target, torch.float32, device)
    train_tokens, val_tokens = tokenize_corpus(cfg.target / "tokenizer.json", cfg.work_dir / "tokens.npz")
    if cfg.data == "generated":
        from specdecode.tokenizer import Tokenizer
        from specdecode.train.generated_data import generate_dataset

        train_tokens = generate_dataset(cfg.target, train_tokens, cfg.work_dir / "generated.npz", cfg.generated_sequences,
                                        eos_id=Tokenizer(cfg.target).eos_token_id, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    drafter = recipe.build(target, cfg, train_tokens).to(device).train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    data_gen = torch.Generator().manual_seed(cfg.seed)
    ckpt = Checkpointer(cfg.work_dir / "checkpoint.pt")
    step = ckpt.load(drafter, opt, data_gen, device) if resume else 0
    before = evaluate_agreement(recipe, drafter, target, val_tokens, cfg, device, dtype) if step == 0 else None
    bar = tqdm(total=cfg.max_steps, initial=step, desc=f"train-drafter {cfg.method}", unit="step", dynamic_ncols=True)
    losses = []
    while step < cfg.max_steps:
        t0 = time.time()
        lr = cosine_lr(step, cfg.max_steps, cfg.warmup_steps, cfg.lr, cfg.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        window = sample_windows(train_tokens, cfg.batch_size, cfg.context, data_gen).to(device)
        with torch.autocast(device.type, dtype=dtype):
            loss = recipe.loss(drafter, target, window)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr:.2e}",
                        tok_s=f"{cfg.batch_size * cfg.context / (time.time() - t0):.0f}")
        if ckpt.due(cfg.checkpoint_minutes):
            ckpt.save(drafter, opt, data_gen, step)
    bar.close()
    ckpt.save(drafter, opt, data_gen, step)
    after = evaluate_agreement(recipe, drafter, target, val_tokens, cfg, device, dtype)
    if recipe.finalize is not None:
        after.update(recipe.finalize(drafter, target, val_tokens, cfg, device))
    report = {
        "method": cfg.method, "target": cfg.target.name, "command": invocation(), "data": cfg.data,
        "steps": step, "tokens_seen": step * cfg.batch_size * cfg.context,
        "wall_seconds": ckpt.elapsed(), "parameters": sum(p.numel() for p in drafter.parameters()),
        "final_train_loss": float(np.mean(losses[-30:])) if losses else None,
        "before_training": before, **after,
    }
    recipe.export(drafter, target, cfg, report)
    return report
