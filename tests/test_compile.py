"""Compiled forwards (`compile=True`): the same tokens as eager, and no recompiling in steady state."""

from __future__ import annotations

import pytest
from helpers import PROMPTS, generate_ids

from specdecode import LLM, SamplingParams
from specdecode.errors import ConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_compiled_plain_and_speculative_decoding_equal_eager_and_stop_compiling(native_model, trained_drafters):
    # EAGLE-3 reads hidden-state taps from the target's forward: the path compilation once got wrong.
    eagle3 = {"method": "eagle3", "num_speculative_tokens": 3, "model": str(trained_drafters["eagle3"])}
    eager_plain = generate_ids(native_model, PROMPTS, GREEDY)
    eager_spec = generate_ids(native_model, PROMPTS, GREEDY, eagle3)
    llm = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config=eagle3, compile=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == eager_spec
    assert [o.token_ids for o in llm.generate(PROMPTS[:1], GREEDY)] == eager_spec[:1]  # batch 1 too
    graphs = llm.runner.model_forward.num_graphs
    drafter = llm.speculator.proposer.drafter_forward  # the EAGLE-3 drafter's step is compiled too
    drafter_graphs = drafter.num_graphs
    assert drafter_graphs > 0
    assert graphs > 0 and llm.runner.model_forward.seconds > 0
    # Steady state: other prompt lengths, batch sizes, contexts and verify widths reuse the graphs.
    others = [{"prompt_token_ids": p["prompt_token_ids"] + [7, 9, 11]} for p in PROMPTS] + PROMPTS[:1]
    llm.generate(others, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    llm.generate(others[1:3], GREEDY)
    assert llm.runner.model_forward.num_graphs == graphs, "a steady-state forward recompiled"
    assert drafter.num_graphs == drafter_graphs, "a steady-state drafter step recompiled"
    print(f"{graphs} graphs compiled in {llm.runner.model_forward.seconds:.1f}s")
    plain = LLM(native_model, dtype="float32", max_num_seqs=4, compile=True)
    assert [o.token_ids for o in plain.generate(PROMPTS, GREEDY)] == eager_plain


def test_compile_must_be_a_bool(native_model):
    with pytest.raises(ConfigError, match="compile must be True or False"):
        LLM(native_model, compile="yes")


def test_compiled_int8_decoding_takes_the_few_row_kernel_and_equals_eager(native_model, trained_drafters, monkeypatch):
    # int8 layers with float32 activations (the tests' precision) take the few-row kernel at decode and
    # verify widths, eager and compiled alike, through one C++ op: the same tokens, no steady-state recompiles.
    from specdecode.kernels import gemv_int8_cpu
    from specdecode.models import kernel_probe
    from specdecode.models.quant import QuantizedLinear

    if not gemv_int8_cpu.fits(8, "cpu"):
        pytest.skip("the few-row int8 kernel needs AVX2, FMA and a C++ compiler")
    # Every shape takes the kernel up to its widest probe, whatever this machine measures.
    monkeypatch.setattr(kernel_probe, "faster_by_width", lambda candidate, baseline, k, dtype, widths: [True] * len(widths))
    monkeypatch.setattr(kernel_probe, "load_choices", dict)
    monkeypatch.setattr(kernel_probe, "save_choices", lambda cached: None)
    eagle3 = {"method": "eagle3", "num_speculative_tokens": 3, "model": str(trained_drafters["eagle3"])}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4}, eagle3):
        eager = generate_ids(native_model, PROMPTS, GREEDY, spec, quantization="int8")
        llm = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config=spec, quantization="int8",
                  compile=True)
        layers = [m for m in llm.runner.model.modules() if isinstance(m, QuantizedLinear) and not m.is_view]
        assert layers and all(m.few_rows is not None for m in layers)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == eager, spec
        assert [o.token_ids for o in llm.generate(PROMPTS[:1], GREEDY)] == eager[:1], spec  # batch 1 too
        graphs = llm.runner.model_forward.num_graphs
        llm.generate(PROMPTS[1:3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        assert llm.runner.model_forward.num_graphs == graphs, spec  # other batches, widths and contexts reuse them
