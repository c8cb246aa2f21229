"""Multi-head latent attention (DeepSeek-V2/V3, METHODS.md 2.6), with DSA (V3.2, GLM-5).

Per token the cache keeps one row of kv_lora_rank + qk_rope_head_dim values: the normed KV
latent c and the shared RoPE key k_rot (not per-head keys and values). Two equal ways to attend:

- expanded (training, no weights absorbed): kv_b_proj(c) gives per-head k_nope and v; keys are
  [k_nope ; k_rot] for every head;
- absorbed (every served forward): kv_b_proj's key part W_uk moves into the query,
  q_c = q_nope W_uk, so scores are q_c . c + q_rot . k_rot: one multi-query attention over the
  cached rows themselves (keys [c ; k_rot], values c), then W_uv maps each head's output
  latent to v_head_dim. Cheaper for decode and verify, which read S cached rows per new token.

DSA layers AND the causal/tree mask with the indexer's top-k selection (`dsa.py`). Decode and
verify forwards (few new tokens, more cached keys than k) gather each query's k selected rows
and attend to those alone, so attention reads k rows, not S; prefill and training attend
through the masked dense kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models.config import ModelConfig
from specdecode.models.dsa import Indexer, SparseContext
from specdecode.models.layers import (RMSNorm, apply_rope, apply_rope_interleaved, read_columns, write_columns,
                                      yarn_softmax_scale)

GATHER_MAX_QUERIES = 16  # DSA forwards of at most this many new tokens gather their selected keys (decode, verify)


class MLAAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        d, h = config.hidden_size, config.num_attention_heads
        self.num_heads, self.nope_dim, self.rope_dim = h, config.qk_nope_head_dim, config.head_dim
        self.v_dim, self.latent_dim = config.v_head_dim, config.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        self.q_lora_rank = config.q_lora_rank
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=config.qkv_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(config.q_lora_rank, h * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.latent_dim + self.rope_dim, bias=config.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, 1e-6)
        self.kv_b_proj = nn.Linear(self.latent_dim, h * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=config.qkv_bias)
        self.scale = yarn_softmax_scale(config, qk_dim)
        self.rope_interleave = config.rope_interleave
        self.runs_indexer = config.indexer_runs(layer_idx)
        self.sparse = config.has_dsa
        self.indexer = Indexer(config) if config.has_indexer_weights(layer_idx) else None
        # Set by `absorb()` for inference: kv_b_proj split per head into its key and value parts.
        self.w_uk: torch.Tensor | None = None  # [H, nope, latent]
        self.w_uv: torch.Tensor | None = None  # [H, v, latent]

    def absorb(self) -> None:
        """Inference: keep kv_b_proj's per-head parts for the absorbed attention (dense copies)."""
        w = self.kv_b_proj.weight.detach().view(self.num_heads, self.nope_dim + self.v_dim, self.latent_dim)
        self.w_uk, self.w_uv = w[:, : self.nope_dim].clone(), w[:, self.nope_dim:].clone()

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope_interleaved(x, cos, sin) if self.rope_interleave else apply_rope(x, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch, cache_k: torch.Tensor | None,
                cache_v: torch.Tensor | None = None, dsa: SparseContext | None = None) -> torch.Tensor:
        """x [B, T, d] -> [B, T, d]. cache_k [slots, max_len + 1, 1, latent + rope] (cache_v unused)."""
        B, T, _ = x.shape
        H = self.num_heads
        if self.q_lora_rank is None:
            q_latent, q = None, self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))  # [B, T, q_lora_rank] (also the indexer's input)
            q = self.q_b_proj(q_latent)
        q_nope, q_rot = q.view(B, T, H, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        q_rot = self._rope(q_rot, cos, sin)  # [B, T, H, rope]
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.latent_dim, self.rope_dim], dim=-1)
        rows = torch.cat((self.kv_a_layernorm(c), self._rope(k_rot[:, :, None], cos, sin)[:, :, 0]), dim=-1)  # [B, T, latent + rope]

        mask = batch.attn_mask[:, 0] if batch is not None and batch.attn_mask is not None else None  # [B, T, S]
        causal = mask is None  # no cache, no mask: plain causal attention over the new tokens
        if cache_k is not None:
            write_columns(cache_k, batch, rows[:, :, None])
            rows = read_columns(cache_k, batch, mask.shape[-1])[:, :, 0]  # [B, S, latent + rope]
        elif mask is None and self.sparse:  # training: DSA needs the causal mask explicitly
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None].expand(B, T, T)
        index_scores = None
        if self.sparse and dsa is not None:
            selected, index_scores = self._select(x, q_latent, mask, cos, sin, batch, dsa)
            if dsa.kl is not None and index_scores is not None:
                n = dsa.kl_rows or B
                kl_mask = mask[:n] if dsa.dense else selected[:n]
                dsa.kl.append(self._indexer_kl(q_nope[:n], q_rot[:n], rows[:n], kl_mask, index_scores[:n]))
            if not dsa.dense:
                mask, causal = selected, False
                if self.w_uk is not None and T <= GATHER_MAX_QUERIES and dsa.top.shape[-1] < mask.shape[-1]:
                    # Decode / verify with more keys than k: attend to the k selected rows only.
                    out = self._absorbed_selected(q_nope, q_rot, rows, dsa.top, mask)
                    return self.o_proj(out.reshape(B, T, H * self.v_dim))
        attn_mask = None if causal else mask  # None: SDPA's causal kernel instead of an explicit mask

        if self.w_uk is not None:
            out = self._absorbed(q_nope, q_rot, rows, attn_mask)
        else:
            out = self._expanded(q_nope, q_rot, rows, attn_mask)
        return self.o_proj(out.reshape(B, T, H * self.v_dim))

    def _select(self, x, q_latent, mask, cos, sin, batch, dsa: SparseContext):
        """A DSA layer's keys: the full layer's top-k (computed here, or shared from the latest
        full layer) AND the mask -> (selected [B, T, S] bool, this layer's index scores or None)."""
        if not self.runs_indexer:
            if dsa.selected is None:
                raise RuntimeError("a shared DSA layer needs an earlier full layer's top-k (IndexCache pattern starts with S)")
            return dsa.selected & mask, None
        if dsa.kl is not None:  # training: the indexer learns from its KL loss alone, not the LM loss
            x, q_latent = x.detach(), q_latent.detach()
        keys = self.indexer.key(x, cos, sin)  # [B, T, 1, D]
        if dsa.index_cache is not None:
            write_columns(dsa.index_cache, batch, keys)
            keys = read_columns(dsa.index_cache, batch, mask.shape[-1])  # [B, S, 1, D]
        scores = self.indexer.scores(x, q_latent, keys[:, :, 0], cos, sin)
        dsa.selected, dsa.top = self.indexer.select(scores, mask, dsa.record)
        return dsa.selected, scores

    @torch.no_grad()
    def _attention_distribution(self, q_nope, q_rot, rows, mask) -> torch.Tensor:
        """The layer's attention over keys, summed over heads and L1-normalised: [B, T, S] (the indexer's target)."""
        B, T, H, _ = q_nope.shape
        S = rows.shape[1]
        c, k_rot = rows.float().split([self.latent_dim, self.rope_dim], dim=-1)
        k_nope = F.linear(c, self.kv_b_proj.weight.float()).view(B, S, H, -1)[..., : self.nope_dim]
        logits = (torch.einsum("bthn,bshn->bhts", q_nope.float(), k_nope)
                  + torch.einsum("bthr,bsr->bhts", q_rot.float(), k_rot)) * self.scale
        return logits.masked_fill(~mask[:, None], float("-inf")).softmax(-1).mean(1)

    def _indexer_kl(self, q_nope, q_rot, rows, mask, index_scores) -> torch.Tensor:
        """KL(attention || softmax(index scores)) over the keys attended to (V3.2's indexer loss),
        mean per query, in float32 (under bf16 autocast the KL came out negative)."""
        with torch.autocast(q_nope.device.type, enabled=False):
            target = self._attention_distribution(q_nope.detach(), q_rot.detach(), rows.detach(), mask)
            log_q = index_scores.float().masked_fill(~mask, float("-inf")).log_softmax(-1).masked_fill(~mask, 0.0)
            return (torch.xlogy(target, target) - target * log_q).sum(-1).mean()

    def _absorbed(self, q_nope, q_rot, rows, mask) -> torch.Tensor:
        """Multi-query attention over the latent rows: [B, T, H, *] queries -> [B, T, H, v]."""
        B, T, H, _ = q_nope.shape
        q_c = torch.einsum("bthn,hnc->bthc", q_nope, self.w_uk)  # [B, T, H, latent]
        query = torch.cat((q_c, q_rot), dim=-1).permute(0, 2, 1, 3).reshape(B, 1, H * T, -1)  # heads folded into queries
        keys = rows[:, None]  # [B, 1, S, latent + rope]
        values = rows[:, None, :, : self.latent_dim]  # [B, 1, S, latent]
        if mask is not None:
            S = mask.shape[-1]
            attn_mask = mask[:, None].expand(B, H, T, S).reshape(B, 1, H * T, S)
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=attn_mask, scale=self.scale)
        else:  # causal over the new tokens (no cache, no mask): fold back to per-head causal attention
            out = F.scaled_dot_product_attention(
                query.view(B, H, T, -1), keys.expand(B, H, -1, -1), values.expand(B, H, -1, -1),
                is_causal=True, scale=self.scale)
        out = out.reshape(B, H, T, self.latent_dim)
        return torch.einsum("bhtc,hvc->bthv", out, self.w_uv)  # [B, T, H, v]

    def _absorbed_selected(self, q_nope, q_rot, rows, top, mask) -> torch.Tensor:
        """DSA's sparse attention proper: each query reads only its k selected latent rows.
        top [B, T, k] key indices (those its mask forbids, where fewer than k are visible, are
        masked again here) -> [B, T, H, v]. Cost per query: k rows, not S."""
        B, T, H, _ = q_nope.shape
        k, width = top.shape[-1], rows.shape[-1]
        q_c = torch.einsum("bthn,hnc->bthc", q_nope, self.w_uk)
        query = torch.cat((q_c, q_rot), dim=-1)  # [B, T, H, latent + rope]
        keys = rows.gather(1, top.reshape(B, T * k, 1).expand(B, T * k, width)).view(B, T, k, width)
        valid = mask.gather(-1, top)  # [B, T, k]
        scores = torch.einsum("bthd,btkd->bthk", query, keys) * self.scale
        probs = scores.masked_fill(~valid[:, :, None], float("-inf")).softmax(-1)
        out = torch.einsum("bthk,btkc->bthc", probs, keys[..., : self.latent_dim])  # [B, T, H, latent]
        return torch.einsum("bthc,hvc->bthv", out, self.w_uv)

    def _expanded(self, q_nope, q_rot, rows, mask) -> torch.Tensor:
        """Per-head keys and values from the latent (training and the reference's own way)."""
        B, T, H, _ = q_nope.shape
        S = rows.shape[1]
        c, k_rot = rows.split([self.latent_dim, self.rope_dim], dim=-1)
        k_nope, v = self.kv_b_proj(c).view(B, S, H, -1).split([self.nope_dim, self.v_dim], dim=-1)
        keys = torch.cat((k_nope, k_rot[:, :, None].expand(B, S, H, self.rope_dim)), dim=-1)
        query = torch.cat((q_nope, q_rot), dim=-1)
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2), keys.transpose(1, 2), v.transpose(1, 2),
            attn_mask=None if mask is None else mask[:, None], is_causal=mask is None, scale=self.scale)
        return out.transpose(1, 2)  # [B, T, H, v]
