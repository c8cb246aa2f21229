"""Write a Llama-family checkpoint (HF layout) as a GGUF file for llama.cpp.

Used by `specdecode export --format gguf` and by the benchmark's llama.cpp peer, so that
llama.cpp runs exactly the weights specdecode runs. Covers what the project's models use:
the `llama` architecture (RMSNorm, RoPE with theta, GQA, SwiGLU, tied or untied LM head)
and a byte-level BPE tokenizer (`tokenizer.json` with the GPT-2 pre-tokenizer regex).
Architectures llama.cpp names differently (qkv bias, q/k norms, rope scaling) are refused
with a clear error rather than written wrong.

llama.cpp applies RoPE to interleaved pairs (x0, x1), (x2, x3), ...; HF Llama checkpoints
rotate halves (x_i, x_{i + d/2}). llama.cpp's own converter permutes the rows of q_proj and
k_proj so both give the same attention; `_rope_permute` does the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from specdecode.errors import ConfigError
from specdecode.models.config import ModelConfig

TENSOR_NAMES = {  # HF name suffix -> GGUF name (per layer: blk.{i}.<name>)
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _rope_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """[heads * head_dim, in] rows from rotate-half order to llama.cpp's interleaved order."""
    out_dim = weight.shape[0]
    return (weight.reshape(num_heads, 2, out_dim // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _check_supported(cfg: ModelConfig) -> None:
    problems = []
    if cfg.is_mla or cfg.n_routed_experts:
        problems.append("DeepSeek-family blocks (MLA / MoE / DSA)")
    if cfg.qkv_bias or cfg.o_bias:
        problems.append("attention biases")
    if cfg.qk_norm:
        problems.append("q/k norms (Qwen3)")
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) not in (None, "default"):
        problems.append("RoPE scaling")
    if problems:
        raise ConfigError(f"GGUF export covers plain Llama checkpoints; this one has {', '.join(problems)}")


def export_gguf(model_dir: Path, out_path: Path, tensor_type: str = "f16") -> Path:
    """Write `model_dir` (config.json, model.safetensors, tokenizer.json) to `out_path`."""
    import gguf
    from safetensors.torch import load_file

    model_dir, out_path = Path(model_dir), Path(out_path)
    cfg = ModelConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))
    _check_supported(cfg)
    float_type = {"f16": (np.float16, gguf.LlamaFileType.MOSTLY_F16),
                  "f32": (np.float32, gguf.LlamaFileType.ALL_F32)}
    if tensor_type not in float_type:
        raise ConfigError(f"--gguf-type {tensor_type!r}: accepted: {', '.join(float_type)}")
    np_type, file_type = float_type[tensor_type]

    writer = gguf.GGUFWriter(str(out_path), "llama")
    writer.add_name(model_dir.name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(file_type)
    _add_tokenizer(writer, model_dir, cfg.vocab_size)

    state = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    state = {k.removeprefix("model."): v for k, v in state.items()}

    def put(name: str, tensor: torch.Tensor, is_norm: bool = False) -> None:
        data = tensor.numpy()
        writer.add_tensor(name, data.astype(np.float32 if is_norm else np_type))  # norms stay f32, as llama.cpp's

    put("token_embd.weight", state["embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        for suffix, gguf_name in TENSOR_NAMES.items():
            tensor = state[f"layers.{i}.{suffix}"]
            if suffix == "self_attn.q_proj.weight":
                tensor = torch.from_numpy(_rope_permute(tensor.numpy(), cfg.num_attention_heads))
            elif suffix == "self_attn.k_proj.weight":
                tensor = torch.from_numpy(_rope_permute(tensor.numpy(), cfg.num_key_value_heads))
            put(f"blk.{i}.{gguf_name}", tensor, is_norm=suffix.endswith("layernorm.weight"))
    put("output_norm.weight", state["norm.weight"], is_norm=True)
    if not cfg.tie_word_embeddings:
        put("output.weight", state["lm_head.weight"])  # tied: llama.cpp reuses token_embd

    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _add_tokenizer(writer, model_dir: Path, vocab_size: int) -> None:
    """Byte-level BPE vocabulary, merges and special ids (llama.cpp's `gpt2` tokenizer model)."""
    import gguf

    data = json.loads((model_dir / "tokenizer.json").read_text())
    model = data["model"]
    pre = data.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise ConfigError("GGUF export covers byte-level BPE tokenizers (GPT-2 pre-tokenizer) only")
    tokens = [""] * vocab_size
    for token, i in model["vocab"].items():
        tokens[i] = token
    special = {t["id"]: t["content"] for t in data.get("added_tokens", [])}
    for i, content in special.items():
        tokens[i] = content
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(vocab_size)]
    for i, token in enumerate(tokens):
        if not token:  # ids the tokenizer never assigned
            tokens[i], types[i] = f"[PAD{i}]", gguf.TokenType.UNUSED
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    config = json.loads((model_dir / "tokenizer_config.json").read_text()) if (model_dir / "tokenizer_config.json").is_file() else {}
    ids = {content: i for i, content in special.items()}
    for key, add in (("eos_token", writer.add_eos_token_id), ("bos_token", writer.add_bos_token_id),
                     ("pad_token", writer.add_pad_token_id)):
        if config.get(key) in ids:
            add(ids[config[key]])
    writer.add_add_bos_token(False)
