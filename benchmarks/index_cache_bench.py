"""IndexCache speed: decode steps and prefill chunks at long context, every DSA layer full
against 1/2, 1/4 and 1/8 full layers, in one run (ratios), plus the indexer's share of a step.

    python benchmarks/index_cache_bench.py --out benchmarks/results/index_cache/speed.json

A random-weight DeepSeek-V3.2-shaped model sized for a 2-core CPU (8 layers, d 1024, MLA
latent 256 + RoPE 64, 16 heads, MoE 8 experts top-2 + 1 shared, indexer 16 heads x 64,
index_topk 2048 as V3.2), bf16. The cache is filled with random latent rows and indexer keys
up to the context depth (speed does not depend on their values, and a real 32k-token prefill
would take this machine many minutes per configuration); then, per depth, a one-token decode
step and a 128-token prefill chunk at that depth are timed with every pattern in turn,
round-robin, so the patterns see the same machine state. The indexer's share is timed by
wrapping its two calls (scores, top-k) in the all-full configuration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdecode.engine.ragged import ForwardEntry
from specdecode.engine.runner import Runner
from specdecode.models.config import ModelConfig, indexer_types_from
from specdecode.models.dsa import Indexer
from specdecode.models.index_cache import set_pattern
from specdecode.models.inference import prepare_for_inference
from specdecode.models.llama import LlamaForCausalLM


def model_config(layers: int, max_len: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=16, head_dim=64, max_position_embeddings=max_len, model_type="deepseek_v32",
        kv_lora_rank=256, q_lora_rank=384, qk_nope_head_dim=64, v_head_dim=64, rope_interleave=True,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, n_shared_experts=1,
        mlp_layer_types=tuple(["dense"] + ["sparse"] * (layers - 1)), index_topk=2048, index_n_heads=16,
        index_head_dim=64, indexer_types=indexer_types_from(layers))


def build(layers: int, max_len: int, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config(layers, max_len))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
    return prepare_for_inference(model.to(dtype), None, dtype, torch.device("cpu"))


class IndexerTimer:
    """Wall time spent in the indexer's scoring and top-k (CPU: calls are synchronous)."""

    def __init__(self):
        self.seconds = 0.0
        self._scores, self._select = Indexer.scores, Indexer.select

    def __enter__(self):
        timer = self

        def timed(fn):
            def wrapper(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    timer.seconds += time.perf_counter() - t
            return wrapper

        Indexer.scores, Indexer.select = timed(self._scores), timed(self._select)
        return self

    def __exit__(self, *exc):
        Indexer.scores, Indexer.select = self._scores, self._select


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", default="4096,16384,32768", help="context depths (cached tokens)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--decode-reps", type=int, default=12, help="decode steps per pattern and depth")
    ap.add_argument("--prefill-reps", type=int, default=3, help="prefill chunks per pattern and depth")
    ap.add_argument("--chunk", type=int, default=128, help="prefill chunk length")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    depths = [int(d) for d in args.depths.split(",")]
    dtype = torch.bfloat16
    max_len = max(depths) + args.chunk + 8
    model = build(args.layers, max_len, dtype)
    L = args.layers
    patterns = {"all full": "F" * L}
    for f in (2, 4, 8):
        if f <= L:
            patterns[f"1/{f} full"] = "".join("F" if t == "full" else "S" for t in indexer_types_from(L, freq=f, offset=1))
    runner = Runner(model, num_slots=1, max_len=max_len, dtype=dtype, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random cache contents up to the deepest depth (values do not change speed)
        for t in runner.kv_cache.k + [t for t in runner.kv_cache.index_k if t is not None]:
            t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    token = [5]
    chunk = torch.randint(3, 8000, (args.chunk,), generator=gen).tolist()
    results = []
    for depth in depths:
        decode = {name: [] for name in patterns}
        prefill = {name: [] for name in patterns}
        indexer = {"decode": [], "prefill": []}

        def step(entries):
            t = time.perf_counter()
            runner.forward(entries)
            return time.perf_counter() - t

        for name, pattern in patterns.items():  # warm-up
            set_pattern(model, pattern)
            step([ForwardEntry(0, token, start=depth)])
        for rep in range(args.decode_reps):
            for name, pattern in patterns.items():
                set_pattern(model, pattern)
                if name == "all full" and rep % 3 == 0:
                    with IndexerTimer() as timer:
                        seconds = step([ForwardEntry(0, token, start=depth)])
                    indexer["decode"].append(timer.seconds / seconds)
                else:
                    decode[name].append(step([ForwardEntry(0, token, start=depth)]))
        for rep in range(args.prefill_reps):
            for name, pattern in patterns.items():
                set_pattern(model, pattern)
                entry = [ForwardEntry(0, chunk, start=depth - args.chunk, num_logits=1)]
                if name == "all full" and rep == 0:
                    with IndexerTimer() as timer:
                        seconds = step(entry)
                    indexer["prefill"].append(timer.seconds / seconds)
                prefill[name].append(step(entry))
        base_decode = statistics.median(decode["all full"])
        base_prefill = statistics.median(prefill["all full"])
        for name in patterns:
            record = {
                "depth": depth, "pattern": name, "layers": patterns[name],
                "decode_ms": 1000 * statistics.median(decode[name]),
                "decode_ms_range": [1000 * min(decode[name]), 1000 * max(decode[name])],
                "decode_speedup": base_decode / statistics.median(decode[name]),
                "prefill_chunk_ms": 1000 * statistics.median(prefill[name]),
                "prefill_chunk_ms_range": [1000 * min(prefill[name]), 1000 * max(prefill[name])],
                "prefill_speedup": base_prefill / statistics.median(prefill[name]),
            }
            if name == "all full":
                record["indexer_share_decode"] = statistics.median(indexer["decode"])
                record["indexer_share_prefill"] = statistics.median(indexer["prefill"])
            results.append(record)
            print(json.dumps(record))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"chunk": args.chunk, "threads": torch.get_num_threads(), "dtype": str(dtype),
                                    "results": results}, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results, args.chunk) + "\n")
    print(markdown(results, args.chunk))


def markdown(results: list[dict], chunk: int) -> str:
    lines = [f"| context | layers (F = full) | decode ms (range) | decode speedup | {chunk}-token prefill chunk ms (range) "
             "| prefill speedup | indexer share (decode / prefill) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        share = (f"{r['indexer_share_decode']:.0%} / {r['indexer_share_prefill']:.0%}"
                 if "indexer_share_decode" in r else "")
        lines.append(f"| {r['depth']} | {r['pattern']} `{r['layers']}` | {r['decode_ms']:.1f} "
                     f"({r['decode_ms_range'][0]:.1f}-{r['decode_ms_range'][1]:.1f}) | {r['decode_speedup']:.2f}x | "
                     f"{r['prefill_chunk_ms']:.0f} ({r['prefill_chunk_ms_range'][0]:.0f}-{r['prefill_chunk_ms_range'][1]:.0f}) | "
                     f"{r['prefill_speedup']:.2f}x | {share} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
