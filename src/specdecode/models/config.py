"""ModelConfig: the one description of a supported transformer, read from HF config.json.

Llama-family models (Llama, Mistral, Qwen2, Qwen3) and the DeepSeek family (DeepSeek-V3,
DeepSeek-V3.2, GLM-5's `glm_moe_dsa`) share it: the DeepSeek fields (MLA, MoE, DSA, MTP) are
zero / None for a Llama and select the variant blocks of the one model definition."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from specdecode.errors import ModelLoadError, UnsupportedModelError

# model_type -> the family options HF implies for it (keys not spelled out in its config.json).
# Qwen2 puts a bias on q/k/v (not o) without saying so; Qwen3 RMS-normalises q and k per head.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    # V3: MLA (+ MoE). V3.2 and GLM-5: plus DSA; the main attention's RoPE is interleaved in all
    # three (V3 may say otherwise), the indexer's only in GLM-5.
    "deepseek_v3": {},
    "deepseek_v32": {"rope_interleave": True, "indexer_rope_interleave": False},
    "glm_moe_dsa": {"rope_interleave": True, "indexer_rope_interleave": True},
}
DEEPSEEK_FAMILY = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def indexer_types_from(num_layers: int, pattern: str | list[str] | None = None, freq: int = 1,
                       offset: int = 2) -> tuple[str, ...]:
    """IndexCache: which DSA layers run their indexer ("full") and which reuse the nearest
    preceding full layer's top-k ("shared"). vLLM's overrides: `index_topk_pattern` (one F/S
    per layer) wins over `index_topk_freq`, where layer i is full iff
    max(i - offset + 1, 0) % freq == 0 (`index_skip_topk_offset`, default 2)."""
    if pattern is not None:
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
        if len(types) != num_layers or any(t not in ("full", "shared") for t in types):
            raise UnsupportedModelError(
                f"index_topk_pattern must give one F or S per layer ({num_layers}), got {pattern!r}")
    else:
        if int(freq) < 1:
            raise UnsupportedModelError(f"index_topk_freq must be >= 1, got {freq}")
        types = ["full" if max(i - offset + 1, 0) % int(freq) == 0 else "shared" for i in range(num_layers)]
    if types and types[0] != "full":
        raise UnsupportedModelError("the first DSA layer must be full (F): shared layers reuse an earlier layer's top-k")
    return tuple(types)


@dataclasses.dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2, Llama attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # Mistral; None = full attention
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # ---- DeepSeek family (METHODS.md 2.6, 3.2); defaults = a Llama ----
    # MLA: queries through a q_lora_rank bottleneck (None: one q_proj), keys and values from a
    # cached kv_lora_rank latent plus a shared qk_rope_head_dim RoPE key. head_dim is the RoPE part.
    kv_lora_rank: int | None = None  # None = standard multi-head attention
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # MLA RoPE on interleaved pairs (DeepSeek layout)
    # MoE: grouped top-k routing (sigmoid scores + correction bias) over routed experts, plus shared experts.
    n_routed_experts: int = 0  # 0 = every MLP dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    mlp_layer_types: tuple[str, ...] | None = None  # "dense" / "sparse" per layer (first_k_dense_replace)
    # DSA: a lightning indexer picks each query's top index_topk keys.
    index_topk: int = 0  # 0 = dense attention
    index_n_heads: int = 0
    index_head_dim: int = 0
    indexer_rope_interleave: bool = False
    indexer_types: tuple[str, ...] | None = None  # IndexCache: "full" / "shared" per layer
    # MTP: model.layers.{L .. L+n-1} are next-token-prediction layers (DeepSeek-V3's built-in drafter).
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_scaling type {rope_type!r} is not supported; accepted: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def has_dsa(self) -> bool:
        return self.index_topk > 0

    def is_moe_layer(self, layer: int) -> bool:
        """MoE on the config's sparse layers; MTP layers (past the main stack) are MoE like DeepSeek-V3's."""
        if self.n_routed_experts == 0:
            return False
        types = self.mlp_layer_types or ()
        return layer >= len(types) or types[layer] == "sparse"

    def indexer_runs(self, layer: int) -> bool:
        """DSA layer `layer` computes its own top-k (IndexCache "full"); MTP layers always do."""
        return self.has_dsa and (self.indexer_types is None or layer >= len(self.indexer_types)
                                 or self.indexer_types[layer] == "full")

    def has_indexer_weights(self, layer: int) -> bool:
        """GLM-5 checkpoints carry no indexer in shared layers; V3.2's keep theirs (unused when shared)."""
        return self.has_dsa and (self.model_type != "glm_moe_dsa" or self.indexer_runs(layer))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        model_type = hf.get("model_type", "llama")
        if model_type not in FAMILY_DEFAULTS:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; accepted: {', '.join(FAMILY_DEFAULTS)}"
            )
        try:
            num_heads = hf["num_attention_heads"]
            hidden = hf["hidden_size"]
            rope_scaling = hf.get("rope_scaling")
            rope_theta = hf.get("rope_theta")
            # transformers >= 5 may nest theta and scaling under rope_parameters.
            rope_params = hf.get("rope_parameters") or {}
            if rope_theta is None:
                rope_theta = rope_params.get("rope_theta", 10000.0)
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
            attention_bias = bool(hf.get("attention_bias", False))
            kwargs: dict[str, Any] = dict(
                vocab_size=hf["vocab_size"],
                hidden_size=hidden,
                intermediate_size=hf["intermediate_size"],
                num_hidden_layers=hf["num_hidden_layers"],
                num_attention_heads=num_heads,
                num_key_value_heads=hf.get("num_key_value_heads") or num_heads,
                head_dim=hf.get("head_dim") or hidden // num_heads,
                max_position_embeddings=hf.get("max_position_embeddings", 2048),
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=attention_bias,
                o_bias=attention_bias if model_type == "llama" else False,
                mlp_bias=bool(hf.get("mlp_bias", False)),
                sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", True) else None,
                model_type=model_type,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=hf.get("eos_token_id"),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks the required key {e.args[0]!r}") from None
        kwargs.update(FAMILY_DEFAULTS[model_type])
        if model_type in DEEPSEEK_FAMILY:
            kwargs.update(_deepseek_fields(hf, model_type, kwargs["num_hidden_layers"]))
        if model_type == "qwen2":
            kwargs["qkv_bias"] = True
        if model_type != "mistral":
            kwargs["sliding_window"] = None
        return cls(**kwargs)

    @classmethod
    def from_dir(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "ModelConfig":
        """config.json of an HF checkpoint folder; `overrides` replace its keys (vLLM's hf_overrides)."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"{config_path} not found: a model directory needs config.json (HF layout)")
        try:
            hf = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{config_path} is not valid JSON: {e}") from None
        return cls.from_hf_dict({**hf, **(overrides or {})})

    def to_hf_dict(self) -> dict[str, Any]:
        """HF config.json for this model (LlamaForCausalLM when model_type is llama)."""
        hf = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
            "mlp_bias": self.mlp_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "bfloat16",
        }
        if self.model_type in DEEPSEEK_FAMILY:
            hf.update(kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank,
                      qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.head_dim,
                      v_head_dim=self.v_head_dim, n_routed_experts=self.n_routed_experts,
                      num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
                      n_shared_experts=self.n_shared_experts, n_group=self.n_group, topk_group=self.topk_group,
                      routed_scaling_factor=self.routed_scaling_factor, norm_topk_prob=self.norm_topk_prob,
                      mlp_layer_types=list(self.mlp_layer_types or ()),
                      first_k_dense_replace=(self.mlp_layer_types or ()).count("dense"),
                      num_nextn_predict_layers=self.num_nextn_predict_layers, num_key_value_heads=self.num_attention_heads)
            if self.model_type == "deepseek_v3":
                hf["rope_interleave"] = self.rope_interleave
            if self.has_dsa:
                hf.update(index_topk=self.index_topk, index_n_heads=self.index_n_heads, index_head_dim=self.index_head_dim)
            if self.model_type == "glm_moe_dsa":
                hf["indexer_types"] = list(self.indexer_types or ())
        return hf


def _deepseek_fields(hf: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """The MLA / MoE / DSA / MTP fields of a DeepSeek-family config.json (HF names)."""
    try:
        rope_dim = hf["qk_rope_head_dim"]
        fields: dict[str, Any] = dict(
            kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=hf.get("q_lora_rank"),
            qk_nope_head_dim=hf["qk_nope_head_dim"], v_head_dim=hf["v_head_dim"], head_dim=rope_dim,
            num_key_value_heads=hf["num_attention_heads"],  # MLA: every head has its own (latent-derived) K/V
            n_routed_experts=hf.get("n_routed_experts") or 0,
            num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
            moe_intermediate_size=hf.get("moe_intermediate_size") or 0,
            n_shared_experts=hf.get("n_shared_experts") or 0,
            n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            num_nextn_predict_layers=int(hf.get("num_nextn_predict_layers") or 0),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json ({model_type}) lacks the required key {e.args[0]!r}") from None
    if model_type == "deepseek_v3":
        fields["rope_interleave"] = bool(hf.get("rope_interleave", True))
    types = hf.get("mlp_layer_types")
    if types is None:
        dense = min(int(hf.get("first_k_dense_replace", 0)), num_layers)
        types = ["dense"] * dense + ["sparse"] * (num_layers - dense)
    fields["mlp_layer_types"] = tuple(types)
    if fields["n_routed_experts"] and fields["n_routed_experts"] % fields["n_group"]:
        raise UnsupportedModelError(f"n_routed_experts ({fields['n_routed_experts']}) must be a multiple of n_group")
    if model_type != "deepseek_v3":
        fields.update(index_topk=hf.get("index_topk", 2048), index_n_heads=hf["index_n_heads"],
                      index_head_dim=hf["index_head_dim"])
        overridden = any(k in hf for k in ("index_topk_pattern", "index_topk_freq"))
        if hf.get("indexer_types") is not None and not overridden:
            fields["indexer_types"] = indexer_types_from(num_layers, hf["indexer_types"])
        else:
            fields["indexer_types"] = indexer_types_from(num_layers, hf.get("index_topk_pattern"),
                                                         hf.get("index_topk_freq", 1),
                                                         hf.get("index_skip_topk_offset", 2))
    return fields
