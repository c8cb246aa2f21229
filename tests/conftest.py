import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(min(2, os.cpu_count() or 1))

from helpers import make_hf_model, make_native_model  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory):
    """What the engine measures and converts (kernel choices, quantised tensors, cost profiles) in a
    cache of the session's own: a run must not depend on what earlier runs on this machine left there
    (a quantisation cache written by a bf16 load once failed the w4a8 tests). Compiled kernels stay
    shared: their builds are keyed by source, flags, CPU and torch."""
    from specdecode.defaults import cache_root

    shared, root = cache_root() / "extensions", tmp_path_factory.mktemp("cache")
    shared.mkdir(parents=True, exist_ok=True)
    (root / "extensions").symlink_to(shared, target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDECODE_CACHE", str(root))
        yield root


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


@pytest.fixture(scope="session")
def trained_drafters(native_model, tmp_path_factory) -> dict[str, Path]:
    """One drafter per learned family for the native test model, randomly initialised and
    briefly trained (so it is not pure noise), exported as a checkpoint folder."""
    from helpers import train_briefly

    from specdecode.models.loader import load_model
    from specdecode.train.drafter import RECIPES, DrafterTrainConfig, calibrate_dspark

    root = tmp_path_factory.mktemp("drafters")
    target = load_model(native_model, torch.float32)
    tokens = torch.randint(3, 320, (5000,), generator=torch.Generator().manual_seed(0)).numpy()
    shapes = {  # method -> (config overrides, training steps, window shape)
        "medusa": (dict(medusa_heads=3), 20, (4, 32)),
        "eagle": ({}, 25, (4, 32)),
        "eagle3": (dict(draft_vocab_size=200), 25, (4, 32)),
        "mtp": ({}, 25, (4, 32)),
        "dflash": (dict(block_size=4, dflash_layers=1), 25, (4, 64)),
        "dspark": (dict(block_size=4, dflash_layers=1, markov_rank=16, context=64, eval_windows=6), 30, (4, 64)),
    }
    out = {}
    for method, (overrides, steps, window) in shapes.items():
        cfg = DrafterTrainConfig(method=method, target=native_model, out_dir=root / method, work_dir=root / "work",
                                 **overrides)
        recipe = RECIPES[method]
        torch.manual_seed(0)
        drafter = recipe.build(target, cfg, tokens)
        losses = train_briefly(recipe, drafter, target, steps, window)
        assert sum(losses[-5:]) < sum(losses[:5]), method  # it learns the target's behaviour
        report = {"steps": steps}
        if method == "dspark":
            held_out = torch.randint(3, 320, (4000,), generator=torch.Generator().manual_seed(1)).numpy()
            report.update(calibrate_dspark(drafter, target, held_out, cfg, "cpu"))
        recipe.export(drafter, target, cfg, report)
        out[method] = root / method
    return out


@pytest.fixture(scope="session")
def lean_model(tmp_path_factory) -> Path:
    """A native model with heads of 32 (the test models' 16 are below what the cached-attention kernel
    takes): its w8a8 / w4a8 forwards take the C++ stack's lean path, and its attention computes a row
    alike whatever rows and keys are beside it (PyTorch's, which serves 16, does not)."""
    return make_native_model(tmp_path_factory.mktemp("lean") / "m", hidden=128)


@pytest.fixture(scope="session")
def lean_drafters(lean_model, tmp_path_factory) -> dict[str, Path]:
    """Untrained EAGLE-3 and MTP drafters for lean_model, and a draft model with its heads: equality
    tests need drafts, not good ones."""
    from specdecode.models.loader import load_model
    from specdecode.train.drafter import RECIPES, DrafterTrainConfig

    root = tmp_path_factory.mktemp("lean_drafters")
    target = load_model(lean_model, torch.float32)
    tokens = torch.randint(3, 320, (2000,), generator=torch.Generator().manual_seed(0)).numpy()
    out = {"draft_model": make_native_model(root / "draft_model", seed=7, layers=1, hidden=128)}
    for method, overrides in {"eagle3": dict(draft_vocab_size=200), "mtp": {}}.items():
        cfg = DrafterTrainConfig(method=method, target=lean_model, out_dir=root / method, work_dir=root / "work",
                                 **overrides)
        torch.manual_seed(0)
        RECIPES[method].export(RECIPES[method].build(target, cfg, tokens), target, cfg, {"steps": 0})
        out[method] = root / method
    return out


@pytest.fixture()
def work_dir(tmp_path):
    """A drafter-training work dir with a cached token file, so tests do not tokenize the standard library."""
    import numpy as np

    rng = np.random.default_rng(0)
    work = tmp_path / "work"
    work.mkdir()
    np.savez(work / "tokens.npz", train=rng.integers(3, 320, 4000).astype(np.uint16),
             val=rng.integers(3, 320, 1000).astype(np.uint16))
    return work


@pytest.fixture()
def spec_config(request, native_drafter, trained_drafters):
    """speculative_config of one (method, shape) case."""
    method, shape = request.param
    from helpers import CASES, K

    config = {"method": method, "num_speculative_tokens": K, **CASES[method][shape]}
    if method == "draft_model":
        config["model"] = str(native_drafter)  # a different random model: mostly rejected drafts
    elif method in trained_drafters:
        config["model"] = str(trained_drafters[method])
    return config
