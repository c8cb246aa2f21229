"""The cached-attention kernel against PyTorch's attention, by head size, at decode and verify widths.

    python benchmarks/attention_heads.py --out benchmarks/results/engine/attention_heads.json
    python benchmarks/attention_heads.py --decode w4a8 [--control]
    python benchmarks/attention_heads.py --cache int8 --heads 32,64,128

`--decode SCHEME` (none, w4a8, ...): plain decoding of a Phi-3-shaped random-weight model (heads of
96, 8 layers, hidden 768, the default model's tokenizer) at batch 1, bf16, two engines in one
process, prompts interleaved A / B: A with the attention kernel withheld (PyTorch's attention, as
heads of 96 had before the kernel took them), B as built; `--control` builds A as B (an A / A run,
the spread to read the ratio against).

One layer's attention as a decode / verify step runs it (kernels/attention_cpu.cpp): 4 KV heads
shared by 2 query heads each, a causal tail of T new tokens over S cached keys read as strided views
of the cache. PyTorch's kernel gets the same call the op falls back to for head sizes it does not
serve (the folded queries and the row mask). Both in one process, in alternating rounds, the
fastest of `--repeats` calls each; prints the median over rounds of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.kernels import attention_cpu
from specdecode.models.layers import dequantize_kv, quantize_kv


def inputs(T: int, S: int, D: int, dtype: torch.dtype, kv_heads: int = 4, group: int = 2):
    g = torch.Generator().manual_seed(0)
    cache_k = torch.randn(2, S + 16, kv_heads, D, generator=g).to(dtype)  # [slots, columns, KVH, D]
    cache_v = torch.randn(2, S + 16, kv_heads, D, generator=g).to(dtype)
    keys, values = cache_k[:1, :S], cache_v[:1, :S]
    q = torch.randn(1, kv_heads, group * T, D, generator=g).to(dtype)
    mask = torch.tril(torch.ones(T, S, dtype=torch.bool), diagonal=S - T)[None, None]
    return q, keys, values, mask, group


def ours(q, keys, values, mask, group):
    return attention_cpu.cached_attention(q, keys, values, mask, group)


def pytorch(q, keys, values, mask, group):
    B, _, R, _ = q.shape
    rows = mask.expand(B, group, R // group, keys.shape[1]).reshape(B, 1, R, -1)
    return F.scaled_dot_product_attention(q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=rows)


def fastest(fn, args, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


def random_model(out: Path) -> Path:
    """A random-weight Llama with heads of 96 (8 query, 4 KV), 8 layers, hidden 768, FFN 2048."""
    import shutil

    from safetensors.torch import save_file

    from specdecode.defaults import default_model_dir
    from specdecode.models.config import ModelConfig
    from specdecode.models.llama import LlamaForCausalLM

    source = default_model_dir()
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config.update(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=96, tie_word_embeddings=False, max_position_embeddings=2048)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_dir(out))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
    save_file({k: v.contiguous().bfloat16() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    return out


def decode_ab(scheme: str, control: bool, passes: int) -> dict:
    """Plain decoding, A (kernel withheld unless `control`) against B, 4 prompts x 128 tokens a pass."""
    import tempfile

    from specdecode import LLM, SamplingParams

    built = attention_cpu.available, attention_cpu.serves

    def withheld(on: bool) -> None:  # the engine built and run while it is on sees no kernel
        attention_cpu.available, attention_cpu.serves = ((lambda: False), (lambda q: False)) if on else built

    quantization = None if scheme == "none" else scheme
    with tempfile.TemporaryDirectory() as tmp:
        model = random_model(Path(tmp) / "m")
        withheld(not control)
        engine_a = LLM(model, dtype="bfloat16", quantization=quantization, max_num_seqs=1)
        withheld(False)
        engine_b = LLM(model, dtype="bfloat16", quantization=quantization, max_num_seqs=1)
        g = torch.Generator().manual_seed(0)
        prompts = [{"prompt_token_ids": torch.randint(10, 8000, (200,), generator=g).tolist()} for _ in range(4)]
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)

        def seconds(engine, prompt, withhold: bool) -> float:
            withheld(withhold)
            start = time.perf_counter()
            engine.generate([prompt], params)
            elapsed = time.perf_counter() - start
            withheld(False)
            return elapsed

        seconds(engine_a, prompts[0], not control), seconds(engine_b, prompts[0], False)  # warm-up
        rows = []
        for i in range(passes):
            a = b = 0.0
            for prompt in prompts:
                a += seconds(engine_a, prompt, not control)
                b += seconds(engine_b, prompt, False)
            tokens = len(prompts) * params.max_tokens
            rows.append({"a_tok_s": tokens / a, "b_tok_s": tokens / b, "a_over_b_time": a / b})
            print(f"pass {i}: A {tokens / a:.1f} tok/s, B {tokens / b:.1f} tok/s, A / B time {a / b:.3f}", flush=True)
    ratios = [r["a_over_b_time"] for r in rows]
    print(f"median A / B time {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
    return {"scheme": scheme, "control": control, "passes": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="64,80,96", help="head sizes, comma-separated")
    parser.add_argument("--widths", default="1,5,9", help="new tokens a step, comma-separated")
    parser.add_argument("--keys", type=int, default=256, help="cached keys each token sees")
    parser.add_argument("--cache", choices=("dtype", "int8"), default="dtype",
                        help="int8: the kernel reads an int8 cache's records (kv_cache_dtype='int8'), PyTorch their "
                             "dequantised values (what the op runs where the int8 kernel is not built)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--decode", default=None, help="plain decoding A / B at this scheme instead (none, w4a8, ...)")
    parser.add_argument("--control", action="store_true", help="with --decode: A built as B (an A / A run)")
    parser.add_argument("--passes", type=int, default=6, help="with --decode: passes over the 4 prompts")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not attention_cpu.available():
        raise SystemExit("the attention kernel is not built here (needs AVX2, FMA and a C++ compiler)")
    if args.cache == "int8" and not attention_cpu.serves_int8():
        raise SystemExit("the int8 cache's attention kernel is not built here (needs AVX-512)")
    if args.decode is not None:
        result = decode_ab(args.decode, args.control, args.passes)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))
        return
    rows = []
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            for D in (int(h) for h in args.heads.split(",")):
                for T in (int(w) for w in args.widths.split(",")):
                    call = theirs = inputs(T, args.keys, D, dtype)
                    if args.cache == "int8":
                        q, keys, values, mask, group = call
                        call = (q, quantize_kv(keys), quantize_kv(values), mask, group)
                        theirs = (q, dequantize_kv(call[1], dtype), dequantize_kv(call[2], dtype), mask, group)
                    ours(*call), pytorch(*theirs)  # warm-up
                    a, b = [], []
                    for _ in range(args.rounds):
                        a.append(fastest(ours, call, args.repeats))
                        b.append(fastest(pytorch, theirs, args.repeats))
                    row = {"dtype": str(dtype).removeprefix("torch."), "cache": args.cache, "head_dim": D, "tokens": T,
                           "keys": args.keys, "kernel_us": 1e6 * statistics.median(a),
                           "pytorch_us": 1e6 * statistics.median(b)}
                    row["pytorch_over_kernel"] = row["pytorch_us"] / row["kernel_us"]
                    rows.append(row)
                    print(f"{row['dtype']:>8} D={D:<3} T={T:<2} kernel {row['kernel_us']:7.1f} us  "
                          f"PyTorch {row['pytorch_us']:7.1f} us  ({row['pytorch_over_kernel']:.2f}x)", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
