"""What weight quantisation (and an int8 KV cache) costs in quality: held-out loss, and how far the quantised
target's next-token distributions are from bf16's (top-1 agreement, total variation, KL).

    python -m specdecode.bench.quant_quality [--model DIR] [--schemes int8,int4-g32,int4-g64,int4-g128]
    python -m specdecode.bench.quant_quality --schemes w4a8 --kv-cache-dtype int8

Runs the model in bf16 and under each scheme over the validation split of the standard-library
corpus (the files the default model never trained on, `train/corpus.py`), in windows of
`--window` tokens, and reports per scheme: the mean next-token loss, its change from bf16, how
often the quantised model's argmax equals the bf16 model's (the rate at which greedy decoding
of the two agrees token by token, given the same prefix), and the mean total variation and
KL(p_bf16 || p_quantised) between their next-token distributions: the mismatch a drafter
trained against the bf16 target meets when it serves the quantised one (1 - TV bounds the
per-token acceptance of a drafter that were the bf16 target itself, METHODS.md 1). With
`--kv-cache-dtype int8` every model is also run with its window prefilled into an int8 KV cache
(`kv_cache_dtype="int8"`: attention reads the quantised keys and values), a row "<weights> + int8 KV",
and bf16 through a bf16 cache (the cached path alone, the control of those rows).
"""

from __future__ import annotations

import argparse
import json

import torch


@torch.inference_mode()
def next_token_logits(model, ids: torch.Tensor, kv_cache_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[T-1, V] float32 logits of each window position's next token; with `kv_cache_dtype`, the window
    prefilled into a KV cache of that dtype (its attention reads the cache)."""
    if kv_cache_dtype is None:
        positions = torch.arange(ids.shape[0])[None]
        return model.compute_logits(model(ids[None], positions).hidden)[0, :-1].float()
    from specdecode.engine.ragged import ForwardEntry, build_attention
    from specdecode.models.llama import KVCache

    cache = KVCache(model.config, 1, ids.shape[0], kv_cache_dtype, ids.device)
    input_ids, positions, batch = build_attention([ForwardEntry(0, ids.tolist(), 0)], cache.scratch_index, None,
                                                  ids.device)
    return model.compute_logits(model(input_ids, positions, batch, cache).hidden)[0, :-1].float()


def compare(reference: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Sums over one window's positions: next-token loss, top-1 agreement with the reference,
    total variation sum_x |p - q| / 2 and KL(p_ref || q) of the next-token distributions."""
    log_p, log_q = reference.log_softmax(-1), logits.log_softmax(-1)
    return {"loss": torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item(),
            "agree": (reference.argmax(-1) == logits.argmax(-1)).sum().item(),
            "tv": (0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)).sum().item(),
            "kl": (log_p.exp() * (log_p - log_q)).sum(-1).sum().item()}


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from specdecode.defaults import default_model_dir
    from specdecode.models.loader import load_model
    from specdecode.models.quant import QuantScheme
    from specdecode.tokenizer import Tokenizer
    from specdecode.train.corpus import iter_stdlib_files, split_files

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded model)")
    ap.add_argument("--schemes", default="int8,int4-g32,int4-g64,int4-g128")
    ap.add_argument("--window", type=int, default=256, help="tokens per evaluation window")
    ap.add_argument("--max-windows", type=int, default=200, help="windows evaluated (the first N of the split)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                    help="int8: also each model with an int8 KV cache (rows '<weights> + int8 KV'; "
                    "default: auto, none)")
    args = ap.parse_args(argv)

    model_dir = args.model or default_model_dir()
    tokenizer = Tokenizer(model_dir)
    _, validation = split_files(iter_stdlib_files())
    windows: list[torch.Tensor] = []
    for f in validation:
        ids = tokenizer.encode(f.text)
        for i in range(0, len(ids) - args.window, args.window):
            windows.append(torch.tensor(ids[i:i + args.window]))
        if len(windows) >= args.max_windows:
            break
    windows = windows[: args.max_windows]
    names = ["bf16", *(QuantScheme.parse(name).name for name in args.schemes.split(","))]
    models = {name: load_model(model_dir, torch.bfloat16, quantization=QuantScheme.parse(name if name != "bf16" else None))
              for name in names}
    # row name -> (model, KV cache dtype): each model as it is, then with an int8 cache where asked
    runs = {name: (models[name], None) for name in names}
    if args.kv_cache_dtype == "int8":  # and bf16 through a bf16 cache: the cached path's own control
        runs["bf16 + bf16 KV"] = (models["bf16"], torch.bfloat16)
        runs.update({f"{name} + int8 KV": (models[name], torch.int8) for name in names})
    totals = {name: {"loss": 0.0, "agree": 0.0, "tv": 0.0, "kl": 0.0} for name in runs}
    count = 0
    for ids in tqdm(windows, desc="windows"):
        reference = next_token_logits(models["bf16"], ids)
        for name, (model, kv_dtype) in runs.items():
            logits = reference if name == "bf16" else next_token_logits(model, ids, kv_dtype)
            for key, value in compare(reference, logits, ids[1:]).items():
                totals[name][key] += value
        count += ids.shape[0] - 1
    reference_loss = totals["bf16"]["loss"] / count
    rows = [{"scheme": name,
             "loss": round(totals[name]["loss"] / count, 4),
             "delta_loss": round(totals[name]["loss"] / count - reference_loss, 4),
             "top1_agreement": round(totals[name]["agree"] / count, 4),
             "tv": round(totals[name]["tv"] / count, 4), "kl": round(totals[name]["kl"] / count, 5)} for name in runs]
    print(f"{len(windows)} windows x {args.window} tokens of held-out standard-library code")
    print("| weights | loss | vs bf16 | top-1 agreement with bf16 | TV to bf16 | KL(bf16 ‖ q) |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['scheme']} | {r['loss']:.4f} | {r['delta_loss']:+.4f} | {r['top1_agreement']:.1%} | "
              f"{r['tv']:.4f} | {r['kl']:.5f} |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
