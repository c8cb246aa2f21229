import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(min(2, os.cpu_count() or 1))

from helpers import make_hf_model, make_native_model  # noqa: E402


@pytest.fixture(scope="session")
def native_model(tmp_path_factory) -> Path:
    return make_native_model(tmp_path_factory.mktemp("native") / "m")


@pytest.fixture(scope="session")
def native_drafter(tmp_path_factory) -> Path:
    """A different random model with the same tokenizer: a drafter that is often wrong."""
    return make_native_model(tmp_path_factory.mktemp("drafter") / "d", seed=7, layers=1, hidden=32)


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": make_hf_model(root / "llama", "llama"),
        "mistral": make_hf_model(root / "mistral", "mistral"),
        "qwen2": make_hf_model(root / "qwen2", "qwen2"),
        "qwen3": make_hf_model(root / "qwen3", "qwen3"),
        "llama-tied": make_hf_model(root / "llama-tied", "llama", tie=True),
        "llama3-rope": make_hf_model(root / "llama3-rope", "llama", rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
    }
