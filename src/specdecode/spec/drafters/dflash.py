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

from specdecode.defaults import DEFAULT_MODEL_NAME
from specdecode.engine.runner import ForwardEntry, build_attention, forward_overhead_tokens, length_groups
from specdecode.errors import ConfigError, ModelLoadError
from specdecode.models.config import ModelConfig
from specdecode.models.llama import (AttentionBatch, DecoderLayer, KVCache, RMSNorm, RotaryEmbedding, fuse_projections,
                                     write_kv)
from specdecode.sampling import SamplingBatch
from specdecode.spec.drafters.chain import ChainDraft
from specdecode.spec.drafters.checkpoint import read_checkpoint, save_checkpoint
from specdecode.spec.drafters.features import TargetFeatureBuffer
from specdecode.spec.proposer import Draft, ProposerContext, register, resolve_drafter_dir
from specdecode.spec.tree import StaticTree


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
    return fuse_projections(drafter.to(device=device, dtype=dtype).eval().requires_grad_(False))


def load_dflash(path: Path, dtype, device) -> DFlashDrafter:
    return load_block_drafter(path, "DFlash", lambda c: DFlashDrafter(DFlashConfig.from_json(c)), dtype, device)


@register("dflash")
class DFlashProposer(TargetFeatureBuffer):
    draft_cost_prior = 0.2  # one block pass shared by all k positions
    # Block positions are drafted independently given the context, so a static tree over their
    # top-k tokens (as Medusa's over its heads) is exact; DSpark's Markov head chains them.
    supports_tree = True
    default_checkpoint = f"{DEFAULT_MODEL_NAME}-dflash"

    def _load(self, ctx: ProposerContext, path: Path) -> DFlashDrafter:
        return load_dflash(path, ctx.dtype, ctx.device)

    def __init__(self, ctx: ProposerContext):
        path = resolve_drafter_dir(ctx, self.default_checkpoint)
        self.drafter = self._load(ctx, path)
        cfg = self.drafter.cfg
        if ctx.config.num_speculative_tokens > cfg.block_size - 1:
            raise ConfigError(f"speculative_config.num_speculative_tokens ({ctx.config.num_speculative_tokens}) exceeds "
                              f"this DFlash drafter's block_size - 1 ({cfg.block_size - 1})")
        if cfg.layers.hidden_size != ctx.target.config.hidden_size or cfg.mask_token_id >= ctx.target.config.vocab_size:
            raise ConfigError("speculative_config.model: the DFlash drafter does not fit the target (hidden size / mask id)")
        self.target = ctx.target
        self.device = ctx.device
        self.forward_overhead_tokens = forward_overhead_tokens(ctx.device)  # see `length_groups`
        self.vocab_size = ctx.target.config.vocab_size
        self.hidden_taps = cfg.target_layer_ids
        self.p_min = ctx.config.draft_p_min
        self.kv_cache = KVCache(cfg.layers, ctx.num_slots, ctx.max_len + cfg.block_size + 2, ctx.dtype, ctx.device)
        self.tree = None
        if ctx.config.tree_topk > 1 and self.supports_tree:
            self.tree = StaticTree(ctx.config.num_speculative_tokens, ctx.config.tree_topk, ctx.config.tree_num_nodes,
                                   ctx.device)
            self.max_tree_depth = self.tree.max_depth

    def target_features(self, result) -> torch.Tensor:
        return torch.cat([result.taps[i] for i in self.drafter.cfg.target_layer_ids], dim=-1)

    def block_pass(self, seqs, active: list[int]) -> torch.Tensor:
        """Consume pending context, then one bidirectional pass over [x_{N-1}, MASK x (B-1)] at
        positions N-1 ... Returns the normed block states [A, B, d]; state j >= 1 gives token N-1+j."""
        block = self.drafter.cfg.block_size
        mask_id = self.drafter.cfg.mask_token_id
        # 1. Context K/V of the committed positions not consumed yet (positions cached .. N-2).
        context_entries, contexts = [], []
        for b in active:
            cached, raw = self.take_pending(seqs[b])
            if raw.shape[0]:
                context_entries.append(ForwardEntry(seqs[b].slot, [0] * raw.shape[0], start=cached))
                contexts.append(self.drafter.context(raw))
        # A new request's whole prompt next to one-step contexts is written by its own pass (see `length_groups`).
        for group in length_groups([c.shape[0] for c in contexts], self.forward_overhead_tokens) if contexts else []:
            _, positions, batch = build_attention([context_entries[i] for i in group], self.kv_cache.scratch_index,
                                                  None, self.device)
            padded = torch.zeros(len(group), positions.shape[1], contexts[0].shape[-1], dtype=contexts[0].dtype,
                                 device=self.device)
            for row, i in enumerate(group):
                padded[row, : contexts[i].shape[0]] = contexts[i]
            self.drafter.write_context(padded, positions, batch, self.kv_cache)
        # 2. The block pass (its columns are overwritten by the next proposal's context).
        entries = [ForwardEntry(seqs[b].slot, [seqs[b].last_token_id] + [mask_id] * (block - 1),
                                start=seqs[b].num_tokens - 1, tree_mask=torch.ones(block, block, dtype=torch.bool))
                   for b in active]
        input_ids, positions, batch = build_attention(entries, self.kv_cache.scratch_index, None, self.device)
        return self.drafter(self.target.model.embed_tokens(input_ids), positions, batch, self.kv_cache)

    @torch.inference_mode()
    def propose(self, seqs, max_tokens, sampling: SamplingBatch) -> Draft:
        B, k = len(seqs), max(max_tokens)
        chain = ChainDraft(B, k, self.vocab_size, self.device, self.p_min)
        active = [b for b in range(B) if max_tokens[b] > 0]
        if not active:
            return chain.result()
        hidden = self.block_pass(seqs, active)  # [A, block, d]
        base = self.target.compute_logits(hidden[:, 1:])  # [A, block-1, V]: tokens N .. N+B-2
        if self.tree is not None:
            tokens = torch.zeros(B, len(self.tree.paths), dtype=torch.long, device=self.device)
            tokens[torch.tensor(active, device=self.device)] = self.tree.tokens(base)
            return self.tree.draft(tokens, [m > 0 for m in max_tokens])
        state = self.start_block(seqs, active)
        # Position by position; p_min stops a row at its first unsure position.
        for step in range(k):
            rows = [b for b in active if step < max_tokens[b] and chain.num[b] == step]
            if not rows:
                break
            index = torch.tensor([active.index(b) for b in rows], device=self.device)
            self.draw_step(chain, rows, index, step, hidden, base, state, sampling)
        return chain.result()

    def start_block(self, seqs, active: list[int]):
        """Per-block drafting state (DFlash: none, its positions are independent)."""
        return None

    def draw_step(self, chain: ChainDraft, rows: list[int], index: torch.Tensor, step: int, hidden: torch.Tensor,
                  base: torch.Tensor, state, sampling: SamplingBatch) -> None:
        """Draw position `step` of the given rows (DFlash: from its own q_j)."""
        chain.add_step(rows, step, base[index, step], sampling)
