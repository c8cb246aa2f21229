"""`specdecode train-target --arch deepseek_v32`: a small DeepSeek-V3.2-style code model.

The same corpus, tokenizer, loop and checkpoints as the Llama default (train/pretrain.py), with
the V3/V3.2 recipe scaled down:
- MLA attention, an MoE MLP (routed experts with auxiliary-loss-free bias balancing, one shared
  expert) after `first_dense_layers` dense layers, and DSA with a lightning indexer per layer;
- one MTP layer trained jointly: loss = LM loss + mtp_loss_weight * CE(MTP's token t+2), the MTP
  layer reading the model's final-normed hidden state and the embedding of token t+1;
- the indexer learns by KL to its layer's attention, on detached inputs (it never changes the
  LM): a dense warm-up (`indexer_warmup_steps`, attention over every key) and then sparse
  training, where attention and the KL are restricted to the indexer's top-k.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specdecode.models.config import ModelConfig, indexer_types_from
from specdecode.models.dsa import SparseContext
from specdecode.models.index_cache import get_pattern, set_pattern
from specdecode.models.llama import LlamaForCausalLM
from specdecode.train.common import option
from specdecode.train.pretrain import PretrainConfig


@dataclasses.dataclass(slots=True, kw_only=True)
class DeepSeekPretrainConfig(PretrainConfig):
    """11M parameters (~8M active per token), half the default model, so that its weights fit the
    repository's budget (22 MB in bf16), trained for under an hour on two CPU cores; 8 layers so
    that IndexCache patterns of 1/2, 1/4 and 1/8 full layers exist."""

    out_dir: Path = option(Path("models/stdlib-code-11m-dsv32"), "export directory (HF layout)")
    work_dir: Path = option(Path("runs/train-target-dsv32"), "checkpoints, tokenizer and token cache (not committed)")
    hidden_size: int = option(256, "model width")
    intermediate_size: int = option(768, "SwiGLU width of the dense layers")
    num_layers: int = option(8, "decoder layers (plus the MTP layer)")
    num_heads: int = option(4, "attention heads")
    num_kv_heads: int = option(4, "(MLA: every head has its own keys and values; must equal --heads)")
    context: int = option(512, "training window = model context length")
    batch_size: int = option(8, "windows of CONTEXT tokens per step")
    max_steps: int = option(800, "optimizer steps (the cosine schedule spans them)")
    q_lora_rank: int = option(128, "MLA query latent width")
    kv_lora_rank: int = option(96, "MLA KV latent width (what the cache keeps per token, plus the RoPE key)")
    qk_nope_head_dim: int = option(32, "MLA per-head query/key width without RoPE")
    qk_rope_head_dim: int = option(32, "MLA RoPE width (shared key)")
    v_head_dim: int = option(48, "MLA per-head value width")
    num_experts: int = option(4, "routed experts per MoE layer")
    experts_per_token: int = option(2, "routed experts each token uses")
    moe_intermediate_size: int = option(192, "SwiGLU width of each expert (and of the shared expert)")
    shared_experts: int = option(1, "shared experts per MoE layer")
    first_dense_layers: int = option(1, "leading layers with a dense MLP (first_k_dense_replace)")
    bias_update_rate: float = option(1e-3, "auxiliary-loss-free balancing: bias step per training step")
    index_topk: int = option(128, "keys each query attends to (DSA)")
    index_heads: int = option(4, "indexer heads")
    index_head_dim: int = option(64, "indexer head width")
    indexer_warmup_steps: int = option(120, "dense steps while the indexer learns, before sparse attention")
    mtp_layers: int = option(1, "MTP layers trained jointly (DeepSeek-V3: 1)")
    mtp_loss_weight: float = option(0.3, "weight of the MTP loss (DeepSeek-V3: 0.3, later 0.1)")
    indexer_kl_rows: int = option(2, "sequences of each batch the indexer's KL is computed on (it costs a second attention)")

    def __post_init__(self) -> None:
        PretrainConfig.__post_init__(self)
        if self.num_kv_heads != self.num_heads:
            raise ValueError(f"MLA gives every head its own keys: --kv-heads ({self.num_kv_heads}) must equal --heads")
        if self.num_experts % 1 or self.experts_per_token > self.num_experts:
            raise ValueError("--experts-per-token must be at most --num-experts")

    def objective(self, model: LlamaForCausalLM) -> "DeepSeekObjective":
        return DeepSeekObjective(model, self)

    def model_config(self, eos_id: int) -> ModelConfig:
        L = self.num_layers
        dense = min(self.first_dense_layers, L)
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=L, num_attention_heads=self.num_heads, num_key_value_heads=self.num_heads,
            head_dim=self.qk_rope_head_dim, max_position_embeddings=self.context, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=True, model_type="deepseek_v32", eos_token_id=eos_id,
            kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            v_head_dim=self.v_head_dim, rope_interleave=True, n_routed_experts=self.num_experts,
            num_experts_per_tok=self.experts_per_token, moe_intermediate_size=self.moe_intermediate_size,
            n_shared_experts=self.shared_experts, n_group=1, topk_group=1, routed_scaling_factor=1.0,
            norm_topk_prob=True, mlp_layer_types=tuple(["dense"] * dense + ["sparse"] * (L - dense)),
            index_topk=self.index_topk, index_n_heads=self.index_heads, index_head_dim=self.index_head_dim,
            indexer_rope_interleave=False, indexer_types=indexer_types_from(L), num_nextn_predict_layers=self.mtp_layers,
        )


class DeepSeekObjective:
    """The loss of one training window, and the phase (dense warm-up or sparse) it runs in."""

    def __init__(self, model: LlamaForCausalLM, cfg: DeepSeekPretrainConfig):
        self.model, self.cfg = model, cfg
        self.dense = True
        self.last: dict[str, float] = {}
        if cfg.mtp_layers:  # the MTP head shares the LM head (the embedding: tied), as in DeepSeek-V3
            for layer in model.model.layers[cfg.num_layers:]:
                layer.shared_head.head.weight = model.model.embed_tokens.weight
        for module in model.modules():
            if hasattr(module, "bias_update_rate"):
                module.bias_update_rate = cfg.bias_update_rate

    def evaluate(self, val: np.ndarray, device, autocast_dtype) -> dict:
        return evaluate_variants(self, val, self.cfg, device, autocast_dtype)

    def set_step(self, step: int) -> None:
        self.dense = step < self.cfg.indexer_warmup_steps

    def __call__(self, window: torch.Tensor) -> torch.Tensor:
        losses = self.losses(window, self.dense)
        self.last = {k: float(v.detach()) for k, v in losses.items()}
        return losses["lm"] + self.cfg.mtp_loss_weight * losses.get("mtp", 0.0) + losses["indexer_kl"]

    def losses(self, window: torch.Tensor, dense: bool, indexer_types: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """LM cross-entropy, MTP cross-entropy (token t+2) and the indexers' mean KL for
        window [B, T + 1]. `indexer_types` evaluates an IndexCache pattern (no KL then)."""
        model = self.model
        inputs, targets = window[:, :-1], window[:, 1:]
        B, T = inputs.shape
        positions = torch.arange(T, device=inputs.device).expand(B, T)
        kl: list[torch.Tensor] = []
        saved = _set_indexer_types(model, indexer_types)
        try:
            ctx = SparseContext(dense=dense, kl=kl if indexer_types is None else None, kl_rows=self.cfg.indexer_kl_rows)
            out = model(inputs, positions, dsa_record=ctx)
            logits = model.compute_logits(out.hidden)  # [B, T, V] float32
            result = {"lm": F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(-1))}
            for j, layer in enumerate(model.model.layers[self.cfg.num_layers:]):
                if j:
                    break  # deeper MTP layers would chain on the previous one's output; one is trained
                # MTP position i: (hidden state at i, token i+1) -> token i+2.
                x = layer.block_input(model.model.embed_tokens(inputs[:, 1:]), out.hidden[:, :-1])
                cos, sin = model.model.rotary_emb(positions[:, :-1], x.dtype)
                mtp_ctx = SparseContext(dense=dense, kl=kl if indexer_types is None else None,
                                        kl_rows=self.cfg.indexer_kl_rows)
                mtp_out = layer(x, cos, sin, dsa=mtp_ctx)
                mtp_logits = layer.logits(mtp_out)
                result["mtp"] = F.cross_entropy(mtp_logits.reshape(B * (T - 1), -1), targets[:, 1:].reshape(-1))
        finally:
            _set_indexer_types(model, saved)
        result["indexer_kl"] = torch.stack(kl).mean() if kl else torch.zeros((), device=window.device)
        return result


def _set_indexer_types(model: LlamaForCausalLM, types: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """Switch the main layers' IndexCache pattern (every layer keeps its indexer weights, as V3.2's
    do); returns the previous pattern. None leaves it unchanged."""
    if types is None:
        return None
    previous = get_pattern(model)
    set_pattern(model, types)
    return previous


@torch.no_grad()
def evaluate_variants(objective: DeepSeekObjective, val: np.ndarray, cfg: DeepSeekPretrainConfig, device,
                      autocast_dtype) -> dict:
    """Validation losses of the trained model: sparse (as served), dense attention (DSA's cost),
    IndexCache at 1/2, 1/4 and 1/8 full layers, MTP loss and top-1 accuracy, and the top-k
    overlap of adjacent layers' selections."""
    model = objective.model
    model.eval()
    n = min(cfg.eval_batches * cfg.batch_size, max(1, (len(val) - 1) // cfg.context))
    starts = np.linspace(0, len(val) - cfg.context - 1, n).astype(np.int64)
    L = cfg.num_layers
    patterns = {f"1/{f}": indexer_types_from(L, freq=f, offset=1) for f in (2, 4, 8) if f <= L}
    sums: dict[str, list[float]] = {}
    overlaps: list[list[float]] = []
    for i in range(0, n, cfg.batch_size):
        window = torch.from_numpy(np.stack([val[s: s + cfg.context + 1].astype(np.int64)
                                            for s in starts[i: i + cfg.batch_size]])).to(device)
        with torch.autocast(device.type, dtype=autocast_dtype):
            sparse = objective.losses(window, dense=False)
            sums.setdefault("val_loss", []).append(float(sparse["lm"]))
            sums.setdefault("val_mtp_loss", []).append(float(sparse.get("mtp", 0.0)))
            sums.setdefault("val_indexer_kl", []).append(float(sparse["indexer_kl"]))
            sums.setdefault("val_loss_dense_attention", []).append(float(objective.losses(window, dense=True)["lm"]))
            for name, types in patterns.items():
                loss = objective.losses(window, dense=False, indexer_types=types)["lm"]
                sums.setdefault(f"val_loss_index_cache_{name}", []).append(float(loss))
            overlaps.append(adjacent_topk_overlap(model, window[:, :-1]))
    model.train()
    report = {k: float(np.mean(v)) for k, v in sums.items()}
    report["index_cache_patterns"] = {name: "".join("F" if t == "full" else "S" for t in types)
                                      for name, types in patterns.items()}
    report["adjacent_layer_topk_overlap"] = [float(x) for x in np.mean(overlaps, axis=0)]
    return report


def adjacent_topk_overlap(model: LlamaForCausalLM, inputs: torch.Tensor) -> list[float]:
    """Mean |top-k(l) ∩ top-k(l+1)| / k over queries that see more than k keys, per adjacent layer pair."""
    B, T = inputs.shape
    record = SparseContext(record=[])
    model(inputs, torch.arange(T, device=inputs.device).expand(B, T), dsa_record=record)
    k = record.record[0].shape[-1]
    rows = torch.arange(T, device=inputs.device) >= k  # queries with more visible keys than k
    result = []
    for a, b in zip(record.record, record.record[1:]):
        sel_a = torch.zeros(B, T, T, dtype=torch.bool, device=inputs.device).scatter_(-1, a, True)
        sel_b = torch.zeros_like(sel_a).scatter_(-1, b, True)
        result.append(float((sel_a & sel_b)[:, rows].sum(-1).float().mean() / k))
    return result
