"""DSpark: Markov head, confidence head, calibration, confidence scheduling; lossless."""

import json

import pytest
from helpers import CHI2_999_DF7, PROMPTS, chi_square, exact_second_token_probs, generate_ids, verify_against_the_drafter

from specdecode import LLM, SamplingParams


@pytest.fixture(scope="module")
def dspark(trained_drafters):
    """The briefly trained DSpark drafter and its calibration report."""
    path = trained_drafters["dspark"]
    return path, json.loads((path / "training_report.json").read_text())


def test_calibration_reduces_expected_calibration_error(dspark):
    _, calibration = dspark
    assert len(calibration["confidence_temperatures"]) == 3
    assert calibration["ece_after_calibration"] <= calibration["ece_before_calibration"] + 1e-9


@pytest.mark.parametrize("schedule", [{"confidence_threshold": 0.3}, {"verify_pruning": "dcut"}])  # {}: conformance
def test_dspark_greedy_equals_plain(native_model, dspark, schedule, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(native_model, dtype="float32", max_num_seqs=4).generate(PROMPTS, params)
    config = {"method": "dspark", "model": str(dspark[0]), "dspark_block_size": 3, **schedule}
    spec = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config=config).generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    single = LLM(native_model, dtype="float32", max_num_seqs=1, speculative_config=config).generate(PROMPTS[1], params)
    assert single[0].token_ids == plain[1].token_ids


def test_confidence_threshold_shortens_drafts(native_model, dspark):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = {"method": "dspark", "model": str(dspark[0]), "dspark_block_size": 3}
    full = LLM(native_model, dtype="float32", speculative_config=base).generate(PROMPTS, params)
    strict = LLM(native_model, dtype="float32", speculative_config={**base, "confidence_threshold": 0.9}).generate(PROMPTS, params)
    assert sum(o.metrics.num_draft_tokens for o in strict) < sum(o.metrics.num_draft_tokens for o in full)


def test_scheduled_sampling_keeps_the_target_distribution(native_model, dspark, monkeypatch):
    """Confidence scheduling cuts drafts by a prefix-only score: the first token a speculative
    step commits still follows the target's exact distribution (chi-square, 1200 seeded
    requests), and the same test catches a verifier that checks against the drafter."""
    prompt = [8, 200, 31]
    exact = exact_second_token_probs(native_model, prompt)
    params = [SamplingParams(temperature=1.0, max_tokens=5, seed=s, ignore_eos=True) for s in range(1200)]
    config = {"method": "dspark", "model": str(dspark[0]), "dspark_block_size": 3, "confidence_threshold": 0.2}

    def second_tokens():
        return [ids[1] for ids in generate_ids(native_model, [{"prompt_token_ids": prompt}] * len(params), params,
                                               config, max_num_seqs=16)]

    assert chi_square(second_tokens(), exact) < CHI2_999_DF7
    from specdecode.speculative import speculator
    from specdecode.speculative.verify.chain import verify

    monkeypatch.setattr(speculator, "verify", verify_against_the_drafter(verify))
    assert chi_square(second_tokens(), exact) > CHI2_999_DF7


def test_dspark_config_errors(native_model, dspark):
    from specdecode import SpeculativeConfig
    from specdecode.errors import ConfigError

    with pytest.raises(ConfigError, match="dspark_block_size.*only with method 'dspark'"):
        SpeculativeConfig.parse({"method": "ngram", "dspark_block_size": 3})
    with pytest.raises(ConfigError, match="confidence_threshold"):
        SpeculativeConfig.parse({"method": "dspark", "confidence_threshold": 1.5})
    with pytest.raises(ConfigError, match="block_size - 1"):
        LLM(native_model, dtype="float32", speculative_config={"method": "dspark", "model": str(dspark[0]),
                                                               "dspark_block_size": 5})
    with pytest.raises(ConfigError, match="methods with trees: .*dflash"):
        LLM(native_model, dtype="float32", speculative_config={"method": "dspark", "model": str(dspark[0]),
                                                               "num_speculative_tokens": 3, "tree_topk": 2})
