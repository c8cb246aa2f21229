"""ModelConfig: the one description of a Llama-family transformer, read from HF config.json."""

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
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
        if model_type == "qwen2":
            kwargs["qkv_bias"] = True
        if model_type != "mistral":
            kwargs["sliding_window"] = None
        return cls(**kwargs)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"{config_path} not found: a model directory needs config.json (HF layout)")
        try:
            hf = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{config_path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(hf)

    def to_hf_dict(self) -> dict[str, Any]:
        """HF config.json for this model (LlamaForCausalLM when model_type is llama)."""
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.model_type]
        return {
            "architectures": [arch],
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
