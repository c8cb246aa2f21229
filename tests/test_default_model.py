"""The embedded default model and its shipped drafters: they load, match transformers, and are the defaults."""

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.bench.prompts import load_prompts
from specdecode.defaults import default_model_dir, models_dir
from specdecode.errors import ConfigError
from specdecode.models.loader import load_model


def test_default_model_matches_transformers_logits():
    import transformers

    path = default_model_dir()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path, torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok("def fibonacci(n):\n    if n < 2:\n        return n\n").input_ids])
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours.compute_logits(ours(ids, torch.arange(ids.shape[1])[None]).hidden)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)


MERGE_SORTED = '''def merge_sorted(left, right):
    """Merge two sorted lists into one sorted list."""
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result
'''


def test_llm_without_model_uses_the_default_and_knows_python():
    """The default model predicts real Python far better than the same tokens shuffled
    (measured: 3.0 vs 8.0 nats per token; uniform over its vocabulary is 9.0)."""
    import random

    llm = LLM(dtype="float32")
    assert llm.config.model == default_model_dir()

    def loss(ids: list[int]) -> float:
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = llm.model.compute_logits(llm.model(x, torch.arange(len(ids))[None]).hidden)[0]
        return torch.nn.functional.cross_entropy(logits[:-1], x[0, 1:]).item()

    ids = llm.tokenizer.encode(MERGE_SORTED)
    shuffled = ids[:]
    random.Random(0).shuffle(shuffled)
    assert loss(ids) < 3.5 and loss(shuffled) > 6.5
    out = llm.generate("import os\n\n\ndef list_files(path):\n", SamplingParams(temperature=0, max_tokens=24))[0]
    assert len(out.token_ids) > 0 and out.text.strip()


def test_shipped_draft_model_is_lossless_and_accepts():
    prompts = load_prompts("humaneval", 2)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = LLM(dtype="float32").generate(prompts, params)
    spec = LLM(dtype="float32", speculative_config={"method": "draft_model", "num_speculative_tokens": 3}).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics.num_accepted_tokens for o in spec) / sum(o.metrics.num_draft_tokens for o in spec) > 0.3


def test_missing_shipped_drafter_names_the_fix(tmp_path, monkeypatch):
    # A models folder holding only the target: the drafter lookup must say how to get one.
    import shutil

    shutil.copytree(default_model_dir(), tmp_path / default_model_dir().name)
    monkeypatch.setenv("SPECDECODE_MODELS_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="train-drafter --method draft_model"):
        LLM(dtype="float32", speculative_config={"method": "draft_model"})
    assert models_dir() == tmp_path


def test_humaneval_prompt_set():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164 and prompts[0].startswith("from typing import List")
    assert len(load_prompts("humaneval", 5)) == 5


def test_mtbench_prompt_set_and_jsonl_files(tmp_path):
    prompts = load_prompts("mtbench")
    assert len(prompts) == 80 and all(p.strip() for p in prompts)
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a"}\n\n{"prompt": "b", "extra": 1}\n')
    assert load_prompts(str(good)) == ["a", "b"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n')
    with pytest.raises(ConfigError, match="line 1.*'prompt'"):
        load_prompts(str(bad))
    with pytest.raises(ConfigError, match="neither a built-in"):
        load_prompts("nope")


def test_generated_drafter_data_is_resumable(native_model, tmp_path):
    import numpy as np

    from specdecode.train.generated_data import generate_dataset

    corpus = np.arange(3, 300, dtype=np.uint16).repeat(4)
    first = generate_dataset(native_model, corpus, tmp_path / "g.npz", num_sequences=3, prompt_len=8,
                             continuation_len=5, batch_size=2)
    assert 3 * 9 <= len(first) <= 3 * 13  # prompt + 1..5 generated tokens each
    again = generate_dataset(native_model, corpus, tmp_path / "g.npz", num_sequences=5, prompt_len=8,
                             continuation_len=5, batch_size=2)
    assert np.array_equal(again[: len(first)], first) and len(again) > len(first)  # resumed, not redone
