"""What weight quantisation costs in quality: held-out loss and top-1 agreement with bf16.

    python -m specdecode.bench.quant_quality [--model DIR] [--schemes int8,int4-g32,int4-g64,int4-g128]

Runs the model in bf16 and under each scheme over the validation split of the standard-library
corpus (the files the default model never trained on, `train/corpus.py`), in windows of
`--window` tokens, and reports per scheme: the mean next-token loss, its change from bf16, and
how often the quantised model's argmax equals the bf16 model's (the rate at which greedy
decoding of the two agrees token by token, given the same prefix).
"""

from __future__ import annotations

import argparse
import json

import torch


@torch.inference_mode()
def evaluate(model, windows: list[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
    """Mean next-token loss over the windows, and each window's argmax [T-1]."""
    total, count, argmaxes = 0.0, 0, []
    for ids in windows:
        positions = torch.arange(ids.shape[0])[None]
        logits = model.compute_logits(model(ids[None], positions).hidden)[0, :-1]  # [T-1, V] float32
        total += torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum").item()
        count += ids.shape[0] - 1
        argmaxes.append(logits.argmax(-1))
    return total / count, argmaxes


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
    reference_loss, reference = evaluate(load_model(model_dir, torch.bfloat16), windows)
    rows = [{"scheme": "bf16", "loss": round(reference_loss, 4), "delta_loss": 0.0, "top1_agreement": 1.0}]
    for name in tqdm(args.schemes.split(","), desc="schemes"):
        scheme = QuantScheme.parse(name)
        loss, argmaxes = evaluate(load_model(model_dir, torch.bfloat16, quantization=scheme), windows)
        same = sum((a == b).sum().item() for a, b in zip(argmaxes, reference))
        total = sum(a.numel() for a in reference)
        rows.append({"scheme": scheme.name, "loss": round(loss, 4), "delta_loss": round(loss - reference_loss, 4),
                     "top1_agreement": round(same / total, 4)})
    print(f"{len(windows)} windows x {args.window} tokens of held-out standard-library code")
    print("| weights | loss | vs bf16 | top-1 agreement with bf16 |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['scheme']} | {r['loss']:.4f} | {r['delta_loss']:+.4f} | {r['top1_agreement']:.1%} |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
