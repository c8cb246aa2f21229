"""What the output's text costs a step as an output grows: decoding the whole output every step
(as `LLM.step()` and the stop-string search did) against `OutputText` (only the new tokens behind a
few tokens of context). No model runs: the default model's tokenizer decodes code (the first 40
HumanEval prompts' text, repeated to the longest length) one token a step, or `--tokens-per-step`
at a time as speculative steps commit them.

    python benchmarks/detokenize.py --lengths 128,1024,4096

Prints microseconds a step (median over the steps, then the last step), for each length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specdecode.bench.prompts import load_prompts
from specdecode.defaults import default_model_dir
from specdecode.tokenizer import OutputText, Tokenizer


def per_step_us(text_of, ids: list[int], step: int) -> list[float]:
    times = []
    for n in range(step, len(ids) + 1, step):
        start = time.perf_counter()
        text_of(ids[:n])
        times.append((time.perf_counter() - start) * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="128,1024,4096", help="output lengths in tokens, comma-separated")
    parser.add_argument("--tokens-per-step", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    tok = Tokenizer(default_model_dir())
    lengths = [int(n) for n in args.lengths.split(",")]
    corpus = tok.encode("\n".join(load_prompts("humaneval", 40)), add_special_tokens=False)
    ids = (corpus * (max(lengths) // len(corpus) + 1))[: max(lengths)]
    results = {}
    for length in lengths:
        output = OutputText()
        full = per_step_us(tok.decode, ids[:length], args.tokens_per_step)
        incremental = per_step_us(lambda part: output.of(tok, part), ids[:length], args.tokens_per_step)
        assert output.of(tok, ids[:length]) == tok.decode(ids[:length])
        results[length] = {"full_median_us": statistics.median(full), "full_last_us": full[-1],
                           "incremental_median_us": statistics.median(incremental),
                           "incremental_last_us": incremental[-1]}
        print(f"{length:5d} tokens: whole output {statistics.median(full):7.1f} us a step (last {full[-1]:7.1f}); "
              f"OutputText {statistics.median(incremental):5.1f} us (last {incremental[-1]:5.1f})")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"tokens_per_step": args.tokens_per_step, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
