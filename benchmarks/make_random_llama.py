"""A random-weight Llama of about 1B parameters, for benchmarks where the weights stream from memory
(BENCHMARKS.md: plain decoding of a 1B random-weight Llama against llama.cpp).

    python benchmarks/make_random_llama.py OUT_DIR

22 layers, hidden 2048, GQA 16/4 (head_dim 128), FFN 5632, untied LM head, the default model's
tokenizer (vocab 8192): 1.03B parameters, bf16, weights normal(0, 0.02), norms 1, seed 0. Its
outputs are noise, so only speed means anything (speculation has nothing to accept).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdecode.defaults import default_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the checkpoint directory to write (about 2 GB)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    source = default_model_dir()
    args.out.mkdir(parents=True, exist_ok=True)
    d, ffn, layers, heads, kv_heads, head_dim = 2048, 5632, 22, 16, 4, 128
    config = json.loads((source / "config.json").read_text())
    config.update(hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=False,
                  max_position_embeddings=2048)
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, args.out / name)
    generator = torch.Generator().manual_seed(args.seed)
    vocab = config["vocab_size"]

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).bfloat16()

    ones = lambda: torch.ones(d).bfloat16()  # noqa: E731
    tensors = {"model.embed_tokens.weight": weight(vocab, d), "lm_head.weight": weight(vocab, d),
               "model.norm.weight": ones()}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": weight(heads * head_dim, d),
            p + "self_attn.k_proj.weight": weight(kv_heads * head_dim, d),
            p + "self_attn.v_proj.weight": weight(kv_heads * head_dim, d),
            p + "self_attn.o_proj.weight": weight(d, heads * head_dim),
            p + "mlp.gate_proj.weight": weight(ffn, d), p + "mlp.up_proj.weight": weight(ffn, d),
            p + "mlp.down_proj.weight": weight(d, ffn),
            p + "input_layernorm.weight": ones(), p + "post_attention_layernorm.weight": ones()})
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    print(f"{sum(t.numel() for t in tensors.values()) / 1e9:.2f}B parameters -> {args.out}")


if __name__ == "__main__":
    main()
