"""`specdecode train-drafter` end to end on a tiny target: train, resume, export, serve."""

import json

import numpy as np
import pytest

from specdecode import LLM, SamplingParams
from specdecode.train.drafter import DrafterTrainConfig, train_drafter


@pytest.fixture()
def work_dir(tmp_path):
    """A cached token file, so the test does not tokenize the standard library."""
    rng = np.random.default_rng(0)
    work = tmp_path / "work"
    work.mkdir()
    np.savez(work / "tokens.npz", train=rng.integers(3, 320, 4000).astype(np.uint16),
             val=rng.integers(3, 320, 1000).astype(np.uint16))
    return work


@pytest.mark.parametrize("method, extra", [("eagle3", {"draft_vocab_size": 128}), ("medusa", {}),
                                           ("dspark", {"block_size": 4, "dflash_layers": 1, "markov_rank": 8})])
def test_train_resume_export_and_serve(native_model, work_dir, tmp_path, method, extra):
    out = tmp_path / "drafter"
    common = dict(method=method, target=native_model, out_dir=out, work_dir=work_dir, batch_size=2, context=48,
                  eval_windows=2, warmup_steps=1, seed=0, **extra)
    first = train_drafter(DrafterTrainConfig(max_steps=2, **common))
    assert first["steps"] == 2 and (work_dir / "checkpoint.pt").is_file()
    report = train_drafter(DrafterTrainConfig(max_steps=4, **common), resume=True)
    assert report["steps"] == 4 and report["tokens_seen"] == 4 * 2 * 48  # continued, not restarted
    assert 0.0 <= report["val_top1_agreement"] <= 1.0 and report["before_training"] is None  # resumed run
    config = json.loads((out / "config.json").read_text())
    assert config["specdecode"]["method"] == method and config["specdecode"]["target"] == native_model.name
    assert json.loads((out / "training_report.json").read_text())["steps"] == 4
    if method == "dspark":
        assert len(report["confidence_temperatures"]) == 3  # calibrated per draft position
    llm = LLM(native_model, dtype="float32", speculative_config={"method": method, "model": str(out),
                                                                 "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(native_model, dtype="float32").generate([{"prompt_token_ids": [5, 17, 99]}], params)
    assert llm.generate([{"prompt_token_ids": [5, 17, 99]}], params)[0].token_ids == plain[0].token_ids
