"""Tiny random models and tokenizers built in-test (never downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TEXT = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()
'''

VOCAB = 320

# Ragged prompts used across the suite: a repeating one (n-gram hits), a long one, a single
# token and a short run, so every batch has rows of different lengths.
PROMPT_IDS = [[5, 17, 99, 5, 17, 99, 5, 17], [8, 200, 31, 77, 150, 3, 12, 64, 9], [42], [100, 101, 102, 103, 104, 105]]
PROMPTS = [{"prompt_token_ids": p} for p in PROMPT_IDS]


def generate_ids(model: Path, prompts, params, speculative_config=None, max_num_seqs: int = 4, **llm_kwargs) -> list[list[int]]:
    """Token ids of a float32 LLM's outputs, in input order."""
    from specdecode import LLM

    llm = LLM(model, dtype="float32", speculative_config=speculative_config, max_num_seqs=max_num_seqs, **llm_kwargs)
    return [o.token_ids for o in llm.generate(prompts, params)]


def hf_model(path: Path, eager: bool = False):
    """The transformers reference for a checkpoint, float32, eval mode (`eager` attention where
    the SDPA path would drop an explicit mask detail, as for DSA)."""
    import transformers

    kwargs = {"attn_implementation": "eager"} if eager else {}
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def make_tokenizer(out: Path, vocab_size: int = VOCAB) -> None:
    from specdecode.train.corpus import SourceFile
    from specdecode.train.tokenizer_train import save_tokenizer, train_tokenizer

    tok = train_tokenizer([SourceFile("a.py", TEXT * 3)], vocab_size)
    save_tokenizer(tok, out, 256)


FAMILIES = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"]),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"]),
}


def make_hf_model(out: Path, family: str = "llama", seed: int = 0, tie: bool = False, layers: int = 2,
                  hidden: int = 64, heads: int = 4, kv_heads: int = 2, max_pos: int = 256, **extra) -> Path:
    """A random transformers model saved with save_pretrained, plus a tokenizer."""
    import transformers

    torch.manual_seed(seed)
    cfg_kwargs = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                      tie_word_embeddings=tie, eos_token_id=0, pad_token_id=1, rope_theta=10000.0)
    cfg_kwargs.update({k: v for k, v in FAMILIES[family].items() if k not in ("model_type", "architectures")})
    if family == "qwen3":
        cfg_kwargs["head_dim"] = hidden // heads
    cfg_kwargs.update(extra)
    config_cls = transformers.AutoConfig.for_model(FAMILIES[family]["model_type"], **cfg_kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config_cls)
    # Random init is near-uniform; scale up so argmaxes are decisive (no float ties).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
            elif "bias" in str(p.shape):
                pass
    model.save_pretrained(out, safe_serialization=True)
    make_tokenizer(out)
    return out


def make_native_model(out: Path, seed: int = 0, layers: int = 2, hidden: int = 64, vocab: int = VOCAB, max_pos: int = 256) -> Path:
    """A random specdecode model saved in HF layout without transformers (fast)."""
    from safetensors.torch import save_file

    from specdecode.models.config import ModelConfig
    from specdecode.models.llama import LlamaForCausalLM

    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=max_pos,
                      tie_word_embeddings=False, eos_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    make_tokenizer(out, vocab)
    return out


def bf16_copy(src: Path, out: Path) -> Path:
    """A copy of a checkpoint folder whose floating-point tensors are rounded to bf16 and stored so (a
    bf16 checkpoint, which float32 serving keeps in bf16 on CPUs with AVX-512: models/inference.py
    `Bf16WeightLinear`). Other files are copied as they are."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    for file in out.glob("*.safetensors"):
        tensors = load_file(str(file))
        save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in tensors.items()}, str(file))
    return out


def train_briefly(recipe, drafter, target, steps: int, window_shape: tuple[int, int], lr: float = 3e-3) -> list[float]:
    """A few optimizer steps of a drafter recipe on random windows; returns the losses."""
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        loss = recipe.loss(drafter, target, torch.randint(3, VOCAB, window_shape, generator=gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# 99.9% quantile of the chi-square distribution with 7 degrees of freedom (8 buckets).
CHI2_999_DF7 = 24.32


def exact_second_token_probs(model_dir: Path, prompt_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[V] float64: the exact distribution (at `temperature`) of the second generated token,
    sum over t0 of p(t0 | prompt) * p(t1 | prompt, t0): the first token a speculative step
    decides (the first comes from the prefill)."""
    from specdecode.models.loader import load_model

    model = load_model(model_dir, torch.float32)
    ids, T = torch.tensor(prompt_ids), len(prompt_ids)
    with torch.no_grad():
        first = (model.compute_logits(model(ids[None], torch.arange(T)[None]).hidden[0, -1]).double() / temperature).softmax(-1)  # [V]
        V = first.shape[0]
        continued = torch.cat([ids.expand(V, T), torch.arange(V)[:, None]], dim=1)  # [V, T + 1]: every t0
        hidden = model(continued, torch.arange(T + 1).expand(V, T + 1)).hidden[:, -1]
        second = (model.compute_logits(hidden).double() / temperature).softmax(-1)  # [V (t0), V (t1)]
    return (first[:, None] * second).sum(0)


def chi_square(samples: list[int], probs: torch.Tensor, buckets: int = 8) -> float:
    """Pearson's statistic of samples against probs over the buckets-1 likeliest tokens and
    the rest (buckets - 1 degrees of freedom)."""
    top = probs.topk(buckets - 1).indices.tolist()
    expected = [float(probs[t]) for t in top]
    expected.append(1.0 - sum(expected))
    index = {t: i for i, t in enumerate(top)}
    observed = [0] * buckets
    for s in samples:
        observed[index.get(s, buckets - 1)] += 1
    n = len(samples)
    return sum((o - n * e) ** 2 / (n * e) for o, e in zip(observed, expected))


def verify_against_the_drafter(verify):
    """A broken verifier for negative controls: it checks drafts against the drafter's own
    distribution instead of the target's, so every draft is accepted and the output follows
    the drafter. A distribution test must catch it."""
    def broken(draft, target_logits, sampling, rows=None, choices=None):
        wrong = target_logits.clone()
        temperature = sampling.temperature.clamp(min=1e-6)[:, None, None]
        wrong[:, : draft.probs.shape[1]] = draft.probs.clamp(min=1e-30).log() * temperature  # process_logits divides by T
        return verify(draft, wrong, sampling, rows)

    return broken


class Interrupted(Exception):
    """What `interrupt_after` raises: a training run killed right after a checkpoint."""


def interrupt_after(monkeypatch, stop_step: int) -> None:
    """Checkpoint saves go through; right after the one of `stop_step` the run dies."""
    from specdecode.train.common import Checkpointer

    save = Checkpointer.save

    def save_then_die(self, model, optimizer, data_gen, step):
        save(self, model, optimizer, data_gen, step)
        if step == stop_step:
            raise Interrupted

    monkeypatch.setattr(Checkpointer, "save", save_then_die)


# 16 indexer heads: with few heads, ReLU often zeroes every head's score of a key, and tied
# index scores at the top-k boundary make the choice (here and in transformers) arbitrary.
DEEPSEEK = {
    "deepseek_v3": dict(q_lora_rank=24),
    "deepseek_v3-noqlora-yarn": dict(q_lora_rank=None, rope_interleave=False, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "deepseek_v32": dict(q_lora_rank=24, index_topk=6, index_head_dim=16, index_n_heads=16),
    "glm_moe_dsa": dict(q_lora_rank=24, index_topk=6, index_head_dim=16, index_n_heads=16,
                        indexer_types=["full", "shared", "full"]),
}


def make_deepseek_model(out: Path, variant: str = "deepseek_v3", seed: int = 0, mtp_layers: int = 0, **extra) -> Path:
    """A random transformers DeepSeek-family model (MLA, MoE from layer 1, 3 layers), saved with
    save_pretrained, plus a tokenizer. `mtp_layers` appends random MTP layers
    (model.layers.3.*: enorm, hnorm, eh_proj, a decoder block, shared_head), which transformers
    itself does not build."""
    import transformers
    from safetensors.torch import load_file, save_file

    model_type = variant.split("-")[0]
    torch.manual_seed(seed)
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16,
                  qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, first_k_dense_replace=1,
                  max_position_embeddings=256, eos_token_id=0, pad_token_id=1, num_nextn_predict_layers=mtp_layers)
    kwargs.update(DEEPSEEK[variant])
    kwargs.update(extra)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # decisive argmaxes, and routing that depends on the input
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    model.save_pretrained(out, safe_serialization=True)
    if mtp_layers:
        from specdecode.models.config import ModelConfig
        from specdecode.models.llama import MTPLayer

        cfg = ModelConfig.from_dir(out)
        state = load_file(str(out / "model.safetensors"))
        for j in range(mtp_layers):
            layer = MTPLayer(cfg, cfg.num_hidden_layers + j)
            with torch.no_grad():
                for p in layer.parameters():
                    if p.dim() >= 2:
                        p.normal_(0, 0.2)
            state.update({f"model.layers.{cfg.num_hidden_layers + j}.{k}": v.contiguous()
                          for k, v in layer.state_dict().items()})
        save_file(state, str(out / "model.safetensors"))
    make_tokenizer(out)
    return out


# ---- conformance cases: every registered proposer, chain and tree (fixture `spec_config` in conftest) ----

K = 3
TREE = {"tree_topk": 3, "tree_num_nodes": 10}
# method -> {shape: speculative_config keys beyond method / model / k}
CASES: dict[str, dict[str, dict]] = {
    "ngram": {"chain": {"prompt_lookup_min": 1, "prompt_lookup_max": 3}},
    "draft_model": {"chain": {}},
    "medusa": {"chain": {}, "static tree": TREE},
    "eagle": {"chain": {}, "dynamic tree": TREE},
    "eagle3": {"chain": {}, "dynamic tree": TREE},
    "mtp": {"chain": {}, "dynamic tree": TREE},
    "dflash": {"chain": {}, "static tree": TREE},
    "dspark": {"chain": {}},
}
PARAMS = [(method, shape) for method, shapes in CASES.items() for shape in shapes]


def cases(test):
    ids = [f"{m}-{s.replace(' ', '_')}" for m, s in PARAMS]
    import pytest

    return pytest.mark.parametrize("spec_config", PARAMS, ids=ids, indirect=True)(test)


