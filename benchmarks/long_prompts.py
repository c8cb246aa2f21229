"""Long prompts for prompt processing and decoding at depth: a JSONL of `--num-prompts` prompts of
about `--tokens` tokens each (the default model's tokenizer), each the HumanEval prompts from the
i-th on, joined and cut to their last `--tokens` tokens (so each ends in a function to complete).

    python benchmarks/long_prompts.py --tokens 512 --out /tmp/long512.jsonl
    specdecode bench --prompts /tmp/long512.jsonl --methods none,ngram:k=8,none --peers llama.cpp-bin
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdecode.bench.prompts import load_prompts
from specdecode.defaults import default_model_dir
from specdecode.tokenizer import Tokenizer


def long_prompts(tokenizer: Tokenizer, tokens: int, num_prompts: int) -> list[str]:
    source = load_prompts("humaneval")
    prompts = []
    for i in range(num_prompts):
        ids: list[int] = []
        j = i
        while len(ids) < tokens:
            ids += tokenizer.encode(source[j % len(source)], add_special_tokens=False)
            j += 1
        prompts.append(tokenizer.decode(ids[-tokens:]))
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per prompt (about: text re-encodes)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    args = parser.parse_args()
    tokenizer = Tokenizer(default_model_dir())
    prompts = long_prompts(tokenizer, args.tokens, args.num_prompts)
    args.out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    mean = sum(lengths) / len(lengths)
    print(f"{len(prompts)} prompts, {min(lengths)}-{max(lengths)} tokens (mean {mean:.1f}) -> {args.out}")


if __name__ == "__main__":
    main()
