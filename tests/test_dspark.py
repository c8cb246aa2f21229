"""DSpark: Markov head, confidence head, calibration, confidence scheduling; lossless."""

from collections import Counter

import pytest
import torch
from helpers import train_briefly

from specdecode import LLM, SamplingParams
from specdecode.models.loader import load_model
from specdecode.train.drafter import RECIPES, DrafterTrainConfig, calibrate_dspark

PROMPTS = [{"prompt_token_ids": p} for p in ([5, 17, 99, 5, 17], [8, 200, 31, 77, 150, 3], [42], [100, 101, 102])]


@pytest.fixture(scope="module")
def dspark(native_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    target = load_model(native_model, torch.float32)
    cfg = DrafterTrainConfig(method="dspark", target=native_model, out_dir=root / "d", work_dir=root / "w", block_size=4,
                             dflash_layers=1, markov_rank=16, context=64, eval_windows=6)
    recipe = RECIPES["dspark"]
    torch.manual_seed(0)
    drafter = recipe.build(target, cfg)
    losses = train_briefly(recipe, drafter, target, 30, (4, 64))
    assert sum(losses[-5:]) < sum(losses[:5])
    held_out = torch.randint(3, 320, (4000,)).numpy()
    calibration = calibrate_dspark(drafter, target, held_out, cfg, "cpu")
    recipe.export(drafter, target, cfg, calibration)
    return root / "d", calibration


def test_calibration_reduces_expected_calibration_error(dspark):
    _, calibration = dspark
    assert len(calibration["confidence_temperatures"]) == 3
    assert calibration["ece_after_calibration"] <= calibration["ece_before_calibration"] + 1e-9


@pytest.mark.parametrize("schedule", [{}, {"confidence_threshold": 0.3}, {"verify_pruning": "dcut"}])
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


def test_scheduled_sampling_keeps_the_target_distribution(native_model, dspark):
    prompt = {"prompt_token_ids": [8, 200, 31]}
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True) for s in range(300)]
    config = {"method": "dspark", "model": str(dspark[0]), "dspark_block_size": 3, "confidence_threshold": 0.2}
    plain = LLM(native_model, dtype="float32", max_num_seqs=16).generate([prompt] * 300, params)
    spec = LLM(native_model, dtype="float32", max_num_seqs=16, speculative_config=config).generate([prompt] * 300, params)
    a, b = Counter(o.token_ids[2] for o in plain), Counter(o.token_ids[2] for o in spec)
    top = a.most_common(1)[0][0]
    assert abs(a[top] - b[top]) / 300 < 0.12


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
