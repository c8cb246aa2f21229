"""Compiled forwards (`compile=True`): the same tokens as eager, and no recompiling in steady state."""

from __future__ import annotations

from helpers import PROMPTS, generate_ids

from specdecode import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_compiled_plain_and_speculative_decoding_equal_eager_and_stop_compiling(native_model):
    eager_plain = generate_ids(native_model, PROMPTS, GREEDY)
    eager_spec = generate_ids(native_model, PROMPTS, GREEDY, NGRAM)
    llm = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config=NGRAM, compile=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == eager_spec
    assert [o.token_ids for o in llm.generate(PROMPTS[:1], GREEDY)] == eager_spec[:1]  # batch 1 too
    graphs = llm.runner.num_graphs
    assert graphs > 0 and llm.runner.compile_seconds > 0
    # Steady state: other prompt lengths, batch sizes, contexts and verify widths reuse the graphs.
    others = [{"prompt_token_ids": p["prompt_token_ids"] + [7, 9, 11]} for p in PROMPTS] + PROMPTS[:1]
    llm.generate(others, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    llm.generate(others[1:3], GREEDY)
    assert llm.runner.num_graphs == graphs, "a steady-state forward recompiled"
    print(f"{graphs} graphs compiled in {llm.runner.compile_seconds:.1f}s")
    plain = LLM(native_model, dtype="float32", max_num_seqs=4, compile=True)
    assert [o.token_ids for o in plain.generate(PROMPTS, GREEDY)] == eager_plain
