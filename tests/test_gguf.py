"""GGUF export (llama.cpp peer, `specdecode export --format gguf`)."""

import importlib.util
import json

import numpy as np
import pytest
import torch

from specdecode.errors import ConfigError
from specdecode.interop.gguf import _rope_permute, export_gguf

gguf = pytest.importorskip("gguf")


def _field(reader, key):
    return reader.fields[key].contents()


def test_gguf_layout_names_shapes_tokenizer(native_model, tmp_path):
    from safetensors.torch import load_file

    path = export_gguf(native_model, tmp_path / "m.gguf", "f32")
    reader = gguf.GGUFReader(str(path))
    cfg = json.loads((native_model / "config.json").read_text())
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.block_count") == cfg["num_hidden_layers"]
    assert _field(reader, "llama.attention.head_count_kv") == cfg["num_key_value_heads"]
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    tokens = _field(reader, "tokenizer.ggml.tokens")
    tok = json.loads((native_model / "tokenizer.json").read_text())
    assert len(tokens) == cfg["vocab_size"] and tokens[0] == "<|endoftext|>"
    assert all(tokens[i] == t for t, i in tok["model"]["vocab"].items())
    assert _field(reader, "tokenizer.ggml.eos_token_id") == 0

    tensors = {t.name: t for t in reader.tensors}
    layers = cfg["num_hidden_layers"]
    assert len(tensors) == 2 + 9 * layers + (0 if cfg["tie_word_embeddings"] else 1)
    state = load_file(str(native_model / "model.safetensors"))
    q = state["model.layers.1.self_attn.q_proj.weight"].float().numpy()
    stored = np.asarray(tensors["blk.1.attn_q.weight"].data).reshape(q.shape)
    np.testing.assert_array_equal(stored, _rope_permute(q, cfg["num_attention_heads"]))
    up = state["model.layers.0.mlp.up_proj.weight"].float().numpy()
    np.testing.assert_array_equal(np.asarray(tensors["blk.0.ffn_up.weight"].data).reshape(up.shape), up)


def _rope_half(x, pos, base=10000.0):  # HF: rotate halves (x_i, x_{i+d/2})
    d = x.shape[-1]
    angle = pos * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], -1)


def _rope_interleaved(x, pos, base=10000.0):  # llama.cpp (normal rope): rotate pairs (x_2i, x_2i+1)
    d = x.shape[-1]
    angle = pos * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * angle.cos() - odd * angle.sin(), odd * angle.cos() + even * angle.sin()], -1).flatten(-2)


def test_rope_permutation_gives_the_same_attention_scores():
    torch.manual_seed(0)
    heads, head_dim, width = 4, 16, 32
    wq, wk = torch.randn(heads * head_dim, width, dtype=torch.float64), torch.randn(heads * head_dim, width, dtype=torch.float64)
    x_q, x_k = torch.randn(width, dtype=torch.float64), torch.randn(width, dtype=torch.float64)
    pq, pk = (torch.from_numpy(_rope_permute(w.numpy(), heads)) for w in (wq, wk))
    for pos_q, pos_k in [(5, 2), (17, 17), (40, 3)]:
        hf = (_rope_half((wq @ x_q).view(heads, head_dim), pos_q) * _rope_half((wk @ x_k).view(heads, head_dim), pos_k)).sum(-1)
        cpp = (_rope_interleaved((pq @ x_q).view(heads, head_dim), pos_q)
               * _rope_interleaved((pk @ x_k).view(heads, head_dim), pos_k)).sum(-1)
        torch.testing.assert_close(cpp, hf)


def test_unsupported_architectures_are_refused(hf_models, tmp_path):
    with pytest.raises(ConfigError, match="biases"):
        export_gguf(hf_models["qwen2"], tmp_path / "q.gguf")


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed (peers extra)")
def test_llama_cpp_greedy_equals_specdecode(native_model, tmp_path):
    from llama_cpp import Llama

    from specdecode import LLM, SamplingParams

    llm = LLM(native_model, dtype="float32")
    ids = llm.tokenizer.encode("def fibonacci(n):")
    ours = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].token_ids
    cpp = Llama(str(export_gguf(native_model, tmp_path / "m.gguf", "f32")), n_ctx=128, n_threads=1, verbose=False)
    theirs = []
    for token in cpp.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0):
        theirs.append(token)
        if len(theirs) == len(ours):
            break
    assert theirs == ours
