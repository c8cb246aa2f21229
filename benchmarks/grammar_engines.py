"""Which grammar engine masks fastest on this CPU: llguidance, xgrammar, outlines-core.

For each engine: compile time of a JSON schema and a regex, then the per-token cost of what
speculation needs at each step (mask for the next token, consume one token), measured while
walking a valid output of the default model's tokenizer, the cost of rolling back 4 tokens and
consuming them again, and of forking a matcher (tree drafts).

    python benchmarks/grammar_engines.py [--model DIR] [--repeats 5]

Engines not installed are skipped (xgrammar and outlines-core are not specdecode dependencies).
specdecode/structured.py says which engine specdecode uses and why; the README records the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from specdecode.defaults import default_model_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "args": {"type": "array", "items": {"type": "string"}},
        "returns": {"type": "string"},
        "pure": {"type": "boolean"},
    },
    "required": ["name", "args", "returns", "pure"],
    "additionalProperties": False,
}
SAMPLE_JSON = '{"name": "parse_header", "args": ["line", "sep"], "returns": "dict", "pure": true}'
REGEX = r"def [a-z_]+\((?:[a-z_]+(?:, [a-z_]+)*)?\):"
SAMPLE_REGEX = "def parse_header(line, sep):"


def _time(fn, repeats: int) -> float:
    best = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t0)
    return statistics.median(best)


def bench_llguidance(tokenizer_json: str, eos: int, vocab: int, cases, repeats: int) -> dict:
    import llguidance
    import llguidance.torch as llt

    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    out = {}
    for name, grammar, tokens in cases:
        t0 = time.perf_counter()
        lark = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(grammar)) if name == "json" \
            else llguidance.LLMatcher.grammar_from_regex(grammar)
        matcher = llguidance.LLMatcher(tok, lark)
        compile_s = time.perf_counter() - t0
        assert not matcher.is_error(), matcher.get_error()
        bitmask = llt.allocate_token_bitmask(1, vocab)

        def walk():
            matcher.reset()
            for t in tokens:
                llt.fill_next_token_bitmask(matcher, bitmask)
                assert matcher.consume_token(t), "sample rejected"

        def rollback():  # undo the 4 tokens before EOS, consume them again
            matcher.rollback(4)
            assert matcher.consume_tokens(tokens[-5:-1])

        walk()
        mask_consume = _time(walk, repeats) / len(tokens)
        matcher.reset()
        matcher.consume_tokens(tokens[:-1])  # llguidance cannot roll back over EOS: stop before it
        out[name] = {"compile_ms": compile_s * 1e3, "mask_consume_us": mask_consume * 1e6,
                     "rollback4_reconsume_us": _time(rollback, repeats) * 1e6, "fork_us": _time(matcher.deep_copy, 50) * 1e6}
    return out


def bench_xgrammar(model_dir, vocab: int, eos: int, cases, repeats: int) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    out = {}
    for name, grammar, tokens in cases:
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(grammar)) if name == "json" else compiler.compile_regex(grammar)
        matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=16)
        compile_s = time.perf_counter() - t0
        bitmask = xgr.allocate_token_bitmask(1, vocab)

        def walk():
            matcher.reset()
            for t in tokens:
                matcher.fill_next_token_bitmask(bitmask)
                assert matcher.accept_token(t), "sample rejected"

        def rollback():  # undo the 4 tokens before EOS, accept them again
            matcher.rollback(4)
            for t in tokens[-5:-1]:
                assert matcher.accept_token(t)

        walk()
        mask_consume = _time(walk, repeats) / len(tokens)
        matcher.reset()
        for t in tokens[:-1]:
            matcher.accept_token(t)
        out[name] = {"compile_ms": compile_s * 1e3, "mask_consume_us": mask_consume * 1e6,
                     "rollback4_reconsume_us": _time(rollback, repeats) * 1e6, "fork_us": _time(matcher.fork, 50) * 1e6}
    return out


def bench_outlines(model_dir, vocab: int, eos: int, cases, repeats: int) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    mapping: dict[str, list[int]] = {}
    for i in range(tok.get_vocab_size()):
        if i == eos:
            continue
        mapping.setdefault(tok.decode([i], skip_special_tokens=False), []).append(i)
    mapping.pop("", None)
    vocabulary = Vocabulary(eos, mapping)
    out = {}
    for name, grammar, tokens in cases:
        t0 = time.perf_counter()
        regex = build_regex_from_schema(json.dumps(grammar)) if name == "json" else grammar
        index = Index(regex, vocabulary)
        compile_s = time.perf_counter() - t0
        import torch

        mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

        def walk():
            guide = Guide(index)
            for t in tokens[:-1]:  # outlines' guide ends in a final state: EOS is allowed there, not consumed
                guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
                guide.advance(t, return_tokens=False)
            assert guide.is_finished() or eos in guide.get_tokens()

        try:
            walk()
        except Exception as e:  # noqa: BLE001 - report, do not crash the comparison
            out[name] = {"compile_ms": compile_s * 1e3, "error": f"{type(e).__name__}: {e}"}
            continue
        out[name] = {"compile_ms": compile_s * 1e3, "mask_consume_us": _time(walk, repeats) / (len(tokens) - 1) * 1e6,
                     "rollback4_reconsume_us": None, "fork_us": None}  # outlines' states are ints: nothing to roll back or fork
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint whose tokenizer.json is used (default model)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from pathlib import Path

    from specdecode.tokenizer import Tokenizer

    model_dir = Path(args.model) if args.model else default_model_dir()
    tokenizer = Tokenizer(model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    eos = tokenizer.eos_token_id
    cases = [("json", SCHEMA, tokenizer.encode(SAMPLE_JSON, add_special_tokens=False) + [eos]),
             ("regex", REGEX, tokenizer.encode(SAMPLE_REGEX, add_special_tokens=False) + [eos])]
    results = {}
    runs = {"llguidance": lambda: bench_llguidance((model_dir / "tokenizer.json").read_text(), eos, vocab, cases,
                                                   args.repeats),
            "xgrammar": lambda: bench_xgrammar(model_dir, vocab, eos, cases, args.repeats),
            "outlines-core": lambda: bench_outlines(model_dir, vocab, eos, cases, args.repeats)}
    for engine, run in runs.items():
        try:
            results[engine] = run()
        except ImportError as e:
            results[engine] = {"skipped": str(e)}
        except Exception as e:  # noqa: BLE001 - one engine's failure must not hide the others
            results[engine] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
