"""Engine benchmark (no speculation): decode tokens/s and the verify-width cost curve.

    python benchmarks/engine_bench.py --out benchmarks/results/engine.json

On a randomly initialised ~100M-parameter Llama-shaped model saved in HF layout, in one run:
1. decode tokens/s at batch 1, 4 and 16, float32 and bfloat16, specdecode vs transformers
   `generate` (greedy, same checkpoint, same prompt lengths);
2. the target's forward time for 1, 2, 4, 8 and 16 new tokens per sequence at batch 1 over
   a 128-token context: the curve speculative decoding lives on.
Random weights are fine here: speed does not depend on what the weights say (EOS is ignored).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def make_model(out: Path) -> Path:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                   num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
                                   tie_word_embeddings=False, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    # A word-level tokenizer with the model's vocabulary size (prompts are token ids anyway).
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(32000)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t0"}))
    return out


def bench_specdecode(path: Path, dtype: str, batch: int, prompt_len: int, new_tokens: int) -> float:
    from specdecode import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, max_num_seqs=batch, max_model_len=prompt_len + new_tokens + 8)
    g = torch.Generator().manual_seed(batch)
    prompts = [{"prompt_token_ids": torch.randint(2, 32000, (prompt_len,), generator=g).tolist()} for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    # Time decode only: prefill first, then the remaining steps.
    for p in prompts:
        llm.add_request(p, params)
    llm.step()  # prefill
    start = time.perf_counter()
    steps = 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
    return batch * steps / (time.perf_counter() - start)


def bench_transformers(path: Path, dtype: str, batch: int, prompt_len: int, new_tokens: int) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(2, 32000, (batch, prompt_len), generator=g)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, **kwargs)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kwargs)  # prefill + 1 token
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - t0
    return batch * (new_tokens - 1) / (total - prefill)


def forward_curve(path: Path, dtype: str, widths: list[int], context: int = 128, repeats: int = 20) -> dict:
    from specdecode.engine.ragged import ForwardEntry
    from specdecode.engine.runner import Runner
    from specdecode.models.loader import load_model

    model = load_model(path, getattr(torch, dtype))
    runner = Runner(model, num_slots=1, max_len=context + max(widths) + 8, dtype=getattr(torch, dtype), device=torch.device("cpu"))
    runner.forward([ForwardEntry(0, list(range(2, 2 + context)), start=0)])
    out = {}
    for n in widths:
        times = []
        for _ in range(repeats + 3):
            t0 = time.perf_counter()
            runner.forward([ForwardEntry(0, list(range(5, 5 + n)), start=context, num_logits=n)])
            times.append(time.perf_counter() - t0)
        out[n] = statistics.median(times[3:]) * 1000
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/engine.json")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(), "decode": [], "forward_ms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "llama-100m")
        from specdecode.models.config import ModelConfig

        cfg = ModelConfig.from_dir(path)
        n_params = cfg.vocab_size * cfg.hidden_size * 2 + cfg.num_hidden_layers * (
            cfg.hidden_size * cfg.head_dim * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
            + 3 * cfg.hidden_size * cfg.intermediate_size)
        results["parameters"] = n_params
        for dtype in args.dtypes.split(","):
            for batch in map(int, args.batches.split(",")):
                ours = bench_specdecode(path, dtype, batch, args.prompt_len, args.new_tokens)
                theirs = bench_transformers(path, dtype, batch, args.prompt_len, args.new_tokens)
                row = {"dtype": dtype, "batch": batch, "specdecode_tok_s": round(ours, 1),
                       "transformers_tok_s": round(theirs, 1), "ratio": round(ours / theirs, 2)}
                print(row, flush=True)
                results["decode"].append(row)
            curve = forward_curve(path, dtype, [1, 2, 4, 8, 16])
            results["forward_ms"][dtype] = {str(k): round(v, 2) for k, v in curve.items()}
            print(dtype, "forward ms by new tokens:", results["forward_ms"][dtype], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
