"""The contract every registered proposer must keep, chain and tree alike.

Parametrised over `PROPOSERS`: a new method is covered by adding its cases to `CASES` (the
first test fails until it is), and then gets the lossless checks for free:
- greedy output equals plain decoding's, token for token, in a ragged batch;
- a request decoded alone equals the same request decoded in a batch;
- a seeded sampled request gives the same tokens whatever else is in the batch;
- finishing and aborting requests frees every slot and all per-request drafter state;
- configurations that cannot work are refused with a message naming the problem.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import CASES, PROMPTS, bf16_copy, cases, generate_ids

from specdecode import LLM, SamplingParams
from specdecode.errors import SpecDecodeError
from specdecode.speculative.propose.registry import PROPOSERS

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def builtin_methods() -> set[str]:
    return {m for m in PROPOSERS if not m.startswith("test_")}  # tests may register their own proposers


def test_every_registered_method_has_conformance_cases():
    assert builtin_methods() == set(CASES)


@cases
def test_greedy_equals_plain_decoding(native_model, spec_config):
    plain = generate_ids(native_model, PROMPTS, GREEDY)
    llm = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config=spec_config)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0  # speculation really ran


@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8", "w4a8"])
@cases
def test_greedy_equals_plain_decoding_with_quantised_weights(native_model, spec_config, quantization):
    """Target and drafter quantised (float32 activations, as every greedy-equality test):
    speculation still changes nothing, against plain decoding of the same quantised target."""
    plain = generate_ids(native_model, PROMPTS, GREEDY, quantization=quantization)
    llm = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config=spec_config, quantization=quantization)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


@cases
def test_greedy_equals_plain_decoding_with_an_int8_kv_cache(native_model, spec_config):
    """The target's KV cache in int8 records (drafters keep theirs): verification reads the same quantised
    keys plain decoding reads, so speculation still changes nothing (chain and tree paths, whose accepted
    columns move as records)."""
    plain = generate_ids(native_model, PROMPTS, GREEDY, kv_cache_dtype="int8")
    llm = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config=spec_config, kv_cache_dtype="int8")
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


@cases
def test_greedy_equals_plain_decoding_with_bf16_weights(native_model, spec_config, tmp_path):
    """A bf16 checkpoint served in float32 keeps its weights as bf16 (Bf16WeightLinear, target and drafter):
    speculation still changes nothing, against plain decoding of the same checkpoint."""
    from specdecode.kernels import gemv_bf16w_cpu
    from specdecode.models.inference import Bf16WeightLinear

    if not gemv_bf16w_cpu.available("cpu"):
        pytest.skip("the bf16-weight kernel needs AVX2 + FMA")
    target = bf16_copy(native_model, tmp_path / "target")
    if "model" in spec_config:  # the drafter's layers bf16-weight too ("none": not its w4a8 default on VNNI CPUs)
        spec_config = {**spec_config, "model": str(bf16_copy(Path(spec_config["model"]), tmp_path / "drafter")),
                       "draft_quantization": "none"}
    plain = generate_ids(target, PROMPTS, GREEDY)
    llm = LLM(target, dtype="float32", max_num_seqs=4, speculative_config=spec_config)
    assert isinstance(llm.model.lm_head, Bf16WeightLinear)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


@cases
def test_a_request_alone_equals_it_batched(native_model, spec_config):
    batched = generate_ids(native_model, PROMPTS, GREEDY, spec_config)
    for prompt, expected in zip(PROMPTS[:2], batched):
        assert generate_ids(native_model, [prompt], GREEDY, spec_config, max_num_seqs=1) == [expected]


@cases
def test_seeded_sampling_is_independent_of_the_batch(native_model, spec_config):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=11, ignore_eos=True)
    others = SamplingParams(temperature=0.7, max_tokens=16, ignore_eos=True)
    alone = generate_ids(native_model, [PROMPTS[0]], seeded, spec_config, max_num_seqs=1)
    mixed = generate_ids(native_model, PROMPTS, [seeded, others, others, others], spec_config)
    again = generate_ids(native_model, PROMPTS[::-1], [others, others, others, seeded], spec_config)
    assert mixed[0] == alone[0] == again[3]


@cases
def test_finish_and_abort_free_every_slot_and_drafter_state(native_model, spec_config):
    config = {**spec_config, "draft_length_schedule": "heuristic"}  # keeps per-request policy state too
    llm = LLM(native_model, dtype="float32", max_num_seqs=2, speculative_config=config)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in PROMPTS]
    for _ in range(4):  # two requests running, two waiting
        llm.step()
    assert llm.speculator.proposer.num_live_states() <= 2
    running = [s.request_id for s in llm.scheduler.running]
    llm.abort(running[0])
    llm.abort(ids[-1])  # still waiting
    while llm.has_unfinished():
        llm.step()
    assert llm.speculator.proposer.num_live_states() == 0
    assert llm.speculator.depth.schedule_k == {}
    assert sorted(llm.scheduler.free_slots) == [0, 1] and not llm.scheduler.running and not llm.scheduler.waiting
    # The engine serves the next request as if nothing had happened.
    assert [o.token_ids for o in llm.generate(PROMPTS[1], GREEDY)] == generate_ids(native_model, [PROMPTS[1]], GREEDY)


@pytest.mark.parametrize("method", sorted(CASES))
def test_configurations_that_cannot_work_are_refused(native_model, trained_drafters, native_drafter, tmp_path, method):
    def refused(config, message):
        with pytest.raises(SpecDecodeError, match=message):
            LLM(native_model, dtype="float32", speculative_config={"method": method, **config})

    refused({"num_speculative_tokens": 0}, "num_speculative_tokens")
    if method != "ngram":  # every other method reads a checkpoint
        refused({"model": str(tmp_path)}, "not a checkpoint|config.json")
    if not PROPOSERS[method].supports_tree:
        refused({"tree_topk": 2}, f"not supported for method '{method}'.*methods with trees")
