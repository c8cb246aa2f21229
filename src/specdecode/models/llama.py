"""The one transformer definition: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm).

Parameter names follow Hugging Face (`model.layers.N.self_attn.q_proj.weight`, ...), so an HF
checkpoint loads with a plain `load_state_dict`. Drafters (EAGLE, MTP, DFlash, ...) reuse
`DecoderLayer`, `RMSNorm` and `RotaryEmbedding` from here instead of copying them.

One forward serves three callers:
- training: no cache, causal attention over the given tokens (or a custom mask);
- prefill / decode / speculative verify: a ragged batch writes its new K/V into a
  `KVCache` at per-token cache indices and attends through an explicit boolean mask, so a
  sequence may bring 1 token (decode), 1 + k (chain verify) or a whole tree (tree mask);
- hidden-state taps: the states of chosen layers come back from the same forward.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.kernels import attention_cpu
from specdecode.models.config import ModelConfig
from specdecode.models.dsa import SparseContext
from specdecode.models.layers import (KV_SCALE_BYTES, MLP, AttentionBatch, RMSNorm, RotaryEmbedding,  # noqa: F401
                                      apply_rope, apply_rope_interleaved, dequantize_kv, read_columns, write_columns,
                                      write_kv)
from specdecode.models.mla import MLAAttention
from specdecode.models.moe import MoE
from specdecode.models.native_stack import (NativeChain, ServedTypes, batch_served, native_block_for,
                                            native_chain_for, native_stack_for)


class KVCache:
    """Static cache: per layer K and V of shape [num_slots, max_len + 1, num_kv_heads, head_dim] (views of
    head-major storage: a head's columns are contiguous); with dtype torch.int8 (kv_cache_dtype "int8")
    [.., head_dim + 4] records, each head's values and their float32 scale (models/layers.py quantize_kv).

    A sequence owns one slot (row). Its length lives with the sequence, not here, so rolling
    back k tokens is setting a length: stale columns past it are masked out and overwritten
    later. Column `max_len` is scratch space where padding tokens of a ragged batch write.

    MLA layers (DeepSeek) keep one latent row per token in K, [.., 1, kv_lora_rank + rope dim],
    and a zero-width V; DSA layers that run their indexer add an indexer-key cache
    `index_k[i]` [.., 1, index_head_dim] (None elsewhere). `layer_ids` names the model layers the
    cache serves (a built-in MTP drafter's cache serves layers L .. L+n-1).
    """

    def __init__(self, config: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device,
                 layer_ids: range | list[int] | None = None):
        layer_ids = list(range(config.num_hidden_layers) if layer_ids is None else layer_ids)
        # dtype torch.int8: K and V hold one record per (token, KV head), head_dim int8 values and their
        # float32 scale (`quantize_kv`): half a bf16 cache's bytes that attention streams at depth.
        quantized = dtype == torch.int8
        if quantized and (config.is_mla or any(config.indexer_runs(i) for i in layer_ids)):
            raise ValueError("an int8 KV cache covers standard attention; MLA / DSA caches keep the model's dtype")
        record = KV_SCALE_BYTES if quantized else 0

        def columns(width: int, heads: int = 1) -> torch.Tensor:
            # Stored head-major, [num_slots, heads, max_len + 1, width], seen through a transposed view: a head's
            # keys (values) of a sequence are then one contiguous run, which attention streams (benchmarks/
            # kv_layout.py, default model, 4 sequences over 600-900 keys: decode steps 0.77-0.87x the row-major
            # layout's time at W4A8, 0.82-0.84x at bf16).
            return torch.zeros((num_slots, heads, max_len + 1, width), dtype=dtype, device=device).transpose(1, 2)

        if config.is_mla:
            self.k = [columns(config.kv_lora_rank + config.head_dim) for _ in layer_ids]
            self.v = [columns(0) for _ in layer_ids]
        else:
            self.k = [columns(config.head_dim + record, config.num_key_value_heads) for _ in layer_ids]
            self.v = [columns(config.head_dim + record, config.num_key_value_heads) for _ in layer_ids]
        self.index_k = [columns(config.index_head_dim) if config.indexer_runs(i) else None for i in layer_ids]
        self.num_slots = num_slots
        self.max_len = max_len
        self.device = torch.device(device)

    @property
    def scratch_index(self) -> int:
        return self.max_len

    def _tensors(self) -> list[torch.Tensor]:
        return self.k + self.v + [t for t in self.index_k if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def copy_columns(self, slot_ids: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move cache columns src [B, n] -> dst [B, n] per slot (tree path compaction)."""
        rows = slot_ids[:, None]
        for cache in self._tensors():
            cache[rows, dst] = cache[rows, src]


class FusedLinear:
    """Several linear layers reading the same input, computed as one matmul (inference only).

    Per-call cost matters in small-batch decoding on CPU (measured here, bf16, one row: 512
    outputs 40 us, 1024 outputs 55 us), so q/k/v and gate/up each become one call. The original
    layers' weights become views into the fused weight: no extra memory, state_dict and
    checkpoint names are unchanged."""

    def __init__(self, *layers: nn.Linear):
        self.sizes = [layer.out_features for layer in layers]
        self.weight = torch.cat([layer.weight for layer in layers])  # [sum(out), in]
        biases = [layer.bias for layer in layers]
        self.bias = torch.cat(biases) if all(b is not None for b in biases) else None
        if any(b is not None for b in biases) and self.bias is None:
            raise ValueError("FusedLinear: either every layer has a bias or none has")
        weights = self.weight.split(self.sizes)
        fused_biases = self.bias.split(self.sizes) if self.bias is not None else [None] * len(layers)
        for layer, w, b in zip(layers, weights, fused_biases):
            layer.weight = nn.Parameter(w, requires_grad=False)
            if b is not None:
                layer.bias = nn.Parameter(b, requires_grad=False)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [.., in] -> one [.., out_i] view per fused layer."""
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def fuse_projections(module: nn.Module) -> nn.Module:
    """Fuse q/k/v and gate/up of every attention and MLP block under `module` (frozen
    inference models: the engine's target, draft models, feature and block drafters)."""
    for m in module.modules():
        if isinstance(m, Attention) and m.qkv is None:
            m.qkv = FusedLinear(m.q_proj, m.k_proj, m.v_proj)
        elif isinstance(m, MLP) and m.gate_up is None:
            m.gate_up = FusedLinear(m.gate_proj, m.up_proj)
        elif isinstance(m, MLAAttention) and m.w_uk is None:
            m.absorb()
    return module


# Each fused projection (set by `fuse_projections`) and its member layers, in row order.
FUSED_MEMBERS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


def replace_linears(module: nn.Module, fused_layer, linear_layer) -> nn.Module:
    """Swap every fused projection and every other `nn.Linear` under `module` (in place): how
    quantisation and packing turn a fused inference model's layers into theirs.
    fused_layer(name, FusedLinear) -> (layer, [one layer per member]); linear_layer(name, nn.Linear) -> layer.
    Names are the modules' paths (`model.layers.0.self_attn.qkv`)."""
    for owner_name, owner in list(module.named_modules()):
        prefix = f"{owner_name}." if owner_name else ""
        for fused_name, member_names in FUSED_MEMBERS.items():
            fused = getattr(owner, fused_name, None)
            if isinstance(fused, FusedLinear):
                layer, members = fused_layer(prefix + fused_name, fused)
                setattr(owner, fused_name, layer)
                for member_name, member in zip(member_names, members):
                    setattr(owner, member_name, member)
        for child_name, child in list(owner.named_children()):
            if isinstance(child, nn.Linear):
                setattr(owner, child_name, linear_layer(prefix + child_name, child))
    return module


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, input_size: int | None = None):
        super().__init__()
        d, h, kvh, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, hd
        d_in = input_size or d  # EAGLE-3's layer reads a 2d input
        self.q_proj = nn.Linear(d_in, h * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d_in, kvh * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d_in, kvh * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(h * hd, d, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv: FusedLinear | None = None  # set by `fuse_projections` (inference; then quantised or packed)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, d]
        cos: torch.Tensor,  # [B, T, 1, head_dim]
        sin: torch.Tensor,
        batch: AttentionBatch | None,
        cache_k: torch.Tensor | None,  # [slots, max_len + 1, kv_heads, head_dim]
        cache_v: torch.Tensor | None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        if self.qkv is not None:  # one matmul instead of three (q, k, v are views of its output)
            q, k, v = self.qkv(x)
            k, v = self._shape_kv(k, v, cos, sin)
        else:
            q = self.q_proj(x)
            k, v = self.project_kv(x, cos, sin)
        q = q.view(B, T, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q, cos, sin)

        mask = batch.attn_mask if batch is not None else None
        if cache_k is not None and batch.exact:
            from specdecode.kernels.exact_cpu import exact_attention

            write_kv(cache_k, cache_v, batch, k, v)
            out = exact_attention(q, cache_k, cache_v, batch.slot_ids, mask[:, 0], 1.0 / math.sqrt(self.head_dim))
            return self.o_proj(out.reshape(B, T, -1))  # [B, T, H, D] -> [B, T, H * D]
        if cache_k is not None:
            write_kv(cache_k, cache_v, batch, k, v)
            S = mask.shape[-1] if mask is not None else batch.num_keys  # a size, not an int: compiled graphs stay general
            k, v = read_columns(cache_k, batch, S), read_columns(cache_v, batch, S)
        if cache_k is not None and batch.sees_all:
            mask = None  # no mask to apply (and no causal one either: every query sees every key)
        group = self.num_heads // self.num_kv_heads
        cached_op = cache_k is not None and attention_cpu.serves(q)  # eager CPU inference: the C++ op
        if cache_k is not None and cache_k.dtype == torch.int8 and not cached_op:  # PyTorch's kernel: the values
            k, v = dequantize_kv(k, q.dtype), dequantize_kv(v, q.dtype)
        if cached_op or (group > 1 and (mask is not None or cache_k is not None)):
            # GQA with an explicit mask or a cache: the `group` query heads that share a KV head
            # become `group` x T queries of that head, under the same per-token mask (if any).
            # PyTorch's CPU flash kernel is slow for one query per head (measured, 1 token, 8/4
            # heads, 200 keys: 98 us with enable_gqa, 36 us folded; 600 keys: 288 vs 63 us).
            KVH, D, S = self.num_kv_heads, self.head_dim, k.shape[1]
            folded = q.view(B, T, KVH, group, D).permute(0, 2, 3, 1, 4).reshape(B, KVH, group * T, D)
            if cached_op:  # decode and verify widths: measured 2-2.5x the flash kernel at one token, 1.1-1.7x at five
                out = attention_cpu.cached_attention(folded, k, v, mask, group)
            else:
                out = F.scaled_dot_product_attention(
                    folded,  # [B, KVH, group * T, D]
                    k.transpose(1, 2),  # [B, KVH, S, D]
                    v.transpose(1, 2),
                    attn_mask=None if mask is None else mask.expand(B, group, T, S).reshape(B, 1, group * T, S),
                )  # [B, KVH, group * T, D]
            return self.o_proj(out.view(B, KVH, group, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, -1))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),  # [B, H, T, D]
            k.transpose(1, 2),  # [B, KVH, S, D]
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=mask is None and cache_k is None,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, d_in] -> k, v [B, T, kv_heads, head_dim] (k with RoPE). DFlash also uses it
        to turn the target's context states into every draft layer's keys and values."""
        if self.qkv is not None:  # one matmul (q is computed and dropped) instead of two
            _, k, v = self.qkv(x)
            return self._shape_kv(k, v, cos, sin)
        return self._shape_kv(self.k_proj(x), self.v_proj(x), cos, sin)

    def _shape_kv(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projected k, v [B, T, kv_heads * head_dim] -> [B, T, kv_heads, head_dim], k normed and rotated."""
        B, T, _ = k.shape
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), v


class DecoderLayer(nn.Module):
    """One block; its variants follow the config: MLA attention (DeepSeek) or standard
    attention, an MoE MLP on the config's sparse layers or a dense one."""

    def __init__(self, config: ModelConfig, attn_input_size: int | None = None, layer_idx: int = 0):
        super().__init__()
        self.self_attn = MLAAttention(config, layer_idx) if config.is_mla else Attention(config, attn_input_size)
        self.mlp = MoE(config) if config.is_moe_layer(layer_idx) else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, batch=None, cache_k=None, cache_v=None, attn_input=None,
                dsa: SparseContext | None = None) -> torch.Tensor:
        """x [B, T, d] is the residual stream. `attn_input` replaces input_layernorm(x) as what
        attention reads (EAGLE-3: [norm(embedding) ; norm(feature)], 2d wide). `dsa` carries
        DSA's indexer cache and shared top-k between layers (DeepSeek-V3.2, GLM-5)."""
        if cache_k is not None and dsa is None and batch_served(batch) and x.device.type == "cpu" \
                and not torch.compiler.is_compiling():  # a drafter's block: the same ops from C++, where it serves
            native = native_block_for(self, NATIVE_TYPES)
            if native is not None and native.serves(x.dtype):
                return native.forward(x, cos, sin, batch, (cache_k,), (cache_v,), attn_input=attn_input)[0]
        h = self.input_layernorm(x) if attn_input is None else attn_input
        if dsa is None:
            x = x + self.self_attn(h, cos, sin, batch, cache_k, cache_v)
        else:
            x = x + self.self_attn(h, cos, sin, batch, cache_k, cache_v, dsa)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Module):
    """An MTP layer's output norm and LM head (`shared_head.norm`, `shared_head.head`)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class MTPLayer(DecoderLayer):
    """DeepSeek-V3's built-in multi-token-prediction layer, stored as model.layers.{L + j}:
    h' = eh_proj([enorm(embed(token t+1)) ; hnorm(h_t)]), one full decoder block, then
    shared_head's norm and LM head give token t+2. h_t is the target's final-normed hidden
    state (as vLLM and SGLang feed it); the embedding is the target's."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx=layer_idx)
        d = config.hidden_size
        self.enorm = RMSNorm(d, config.rms_norm_eps)
        self.hnorm = RMSNorm(d, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = SharedHead(config)

    def block_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds, hidden [B, T, d] -> the block's input [B, T, d]."""
        return self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The block's output [.., d] -> logits [.., vocab] float32."""
        return row_linear(self.shared_head.head, self.shared_head.norm(out)).float()


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        L = config.num_hidden_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, layer_idx=i) for i in range(L)]
                                    + [MTPLayer(config, L + j) for j in range(config.num_nextn_predict_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


@dataclasses.dataclass(slots=True)
class ForwardOutput:
    hidden: torch.Tensor  # [B, T, d] after the final norm: feed to `compute_logits`
    taps: dict[int, torch.Tensor]  # layer index -> [B, T, d] (HF hidden_states numbering)


def row_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) computed on x as 2-D rows [N, d]. A strided 3-D input (a slice such as
    hidden[:, 1:]) sends PyTorch's bf16 CPU matmul down a path measured ~50x slower here
    (50 ms instead of 1 ms for 15 rows through the 8192-token LM head)."""
    return layer(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


@dataclasses.dataclass(frozen=True, slots=True)
class RowTiling:
    """Exact mode: how a linear layer's rows reach its kernel so that a row never depends on the
    rows beside it (probed per kind of layer, `exact/rows.py`): chunks of at most `tile` rows, a
    chunk of fewer than `min_rows` rows padded with zero rows to `min_rows`."""

    tile: int
    min_rows: int = 1

    def applies(self, x: torch.Tensor) -> bool:
        rows = x.numel() // x.shape[-1]
        return rows < self.min_rows or rows > self.tile


def tile_rows(matmul, x: torch.Tensor, tiling: RowTiling) -> torch.Tensor:
    """matmul(rows [m, K]) -> [m, N] applied under `tiling` to x [..., K] -> [..., N]."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n <= tiling.tile:  # the common case (decode, verify): one call, padded if too short
        out = matmul(F.pad(rows, (0, 0, 0, tiling.min_rows - n)) if n < tiling.min_rows else rows)[:n]
    else:
        out = torch.cat([tile_rows(matmul, chunk, tiling) for chunk in rows.split(tiling.tile)])
    return out.view(*x.shape[:-1], -1)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # > 0: the C++ stack's lean path serves forwards of up to this many tokens with its bf16 layers
        # on the few-row kernel, a width measured on whole forwards (engine/lean_width.py); 0: up to the
        # narrowest layer's own kernel width.
        self.lean_rows = 0

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [B, T]
        positions: torch.Tensor,  # [B, T] RoPE positions
        batch: AttentionBatch | None = None,
        kv_cache: KVCache | None = None,
        hidden_taps: tuple[int, ...] = (),
        inputs_embeds: torch.Tensor | None = None,  # [B, T, d], instead of input_ids
        dsa_record: SparseContext | None = None,  # DSA analysis: a context whose `record` collects top-k
    ) -> ForwardOutput:
        """Run the stack. `hidden_taps` uses HF's hidden_states numbering: 0 is the embedding
        output, i is the output of layer i-1 (the input of layer i), L the last layer's
        output before the final norm. Taps cost no extra forward."""
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        if kv_cache is not None and batch_served(batch) and x.device.type == "cpu" and not torch.compiler.is_compiling():
            native = native_stack_for(self, NATIVE_TYPES)  # the same ops from C++ (models/native_stack.py), where it serves
            if native is not None and native.serves(x.dtype):
                return ForwardOutput(*native.forward(x, cos, sin, batch, kv_cache.k, kv_cache.v, hidden_taps))
        taps: dict[int, torch.Tensor] = {}
        L = self.config.num_hidden_layers  # MTP layers (model.layers[L:]) are drafters, not part of the stack
        dsa = (dsa_record if dsa_record is not None else SparseContext()) if self.config.has_dsa else None
        for i, layer in enumerate(self.model.layers[:L]):
            if i in hidden_taps:
                taps[i] = x
            if dsa is not None:
                dsa.index_cache = kv_cache.index_k[i] if kv_cache is not None else None
            if kv_cache is None:
                x = layer(x, cos, sin, batch, dsa=dsa)
            else:
                x = layer(x, cos, sin, batch, kv_cache.k[i], kv_cache.v[i], dsa=dsa)
        if L in hidden_taps:
            taps[L] = x
        return ForwardOutput(self.model.norm(x), taps)

    def forward_chain(self, token_ids: list[int], slot: int, start: int, num_logits: int, kv_cache: KVCache,
                      hidden_taps: tuple[int, ...] = (), argmax: bool = False) -> tuple | None:
        """One sequence's contiguous new tokens, written at cache columns start .. of row `slot`, as one
        C++ call (models/native_stack.py NativeChain: the embedding, RoPE, the stack and the LM head):
        (final-normed hidden [1, T, d], taps, logits [1, num_logits, V] float32, with `argmax` the logits
        rows' argmaxes as a list, else None) bit-identical to `forward` + `compute_logits` of the last
        num_logits tokens; None where that is not served."""
        chain = self._native_chain(kv_cache)
        return None if chain is None else chain.forward(token_ids, slot, start, num_logits, kv_cache, hidden_taps,
                                                        argmax)

    def forward_chains(self, token_ids: list[list[int]], slots: list[int], starts: list[int], num_logits: list[int],
                       kv_cache: KVCache, hidden_taps: tuple[int, ...] = (), argmax: bool = False) -> tuple | None:
        """B sequences' contiguous new tokens (sequence b's written at columns starts[b].. of cache row
        slots[b]; its logits at its last num_logits[b]) as one C++ call on the stack's lean path
        (NativeChain.forward_batch): `forward_chain`'s tuple for the batch (hidden [B, W, d], taps, logits
        [B, N, V] float32, padded with copies of a sequence's last row; each sequence's argmaxes or None),
        each sequence's rows bit-identical to its own `forward_chain`; None where that is not served."""
        chain = self._native_chain(kv_cache)
        return None if chain is None else chain.forward_batch(token_ids, slots, starts, num_logits, kv_cache,
                                                              hidden_taps, argmax)

    def _native_chain(self, kv_cache: KVCache) -> NativeChain | None:
        """The NativeChain (with its C++ stack) that serves a whole forward on this cache, or None."""
        if kv_cache.device.type != "cpu" or torch.compiler.is_compiling():
            return None
        return native_chain_for(self, NATIVE_TYPES)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> logits [..., vocab] in float32 (sampling needs the precision)."""
        return row_linear(self.lm_head, hidden).float()

    def num_parameters(self) -> int:
        seen, total = set(), 0
        for p in self.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        return total


# What the C++ stack (models/native_stack.py) reproduces: these types exactly.
NATIVE_TYPES = ServedTypes(block=DecoderLayer, attention=Attention, fused_linear=FusedLinear,
                           causal_lm=LlamaForCausalLM)
