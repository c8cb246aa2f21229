"""A learned drafter built for another target is refused when the `LLM` is built, with a
ConfigError naming the mismatch: hidden size, vocabulary size and token map, the target
layers it taps, and the token ids it uses (DFlash's mask id, EAGLE-3's draft-to-target map)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import make_native_model, train_briefly

from specdecode import LLM
from specdecode.errors import ConfigError

LEARNED = ("eagle", "eagle3", "mtp", "medusa", "dflash", "dspark")
SHAPES = {  # method -> (config overrides, training window shape), as tests/conftest.py trains them
    "medusa": (dict(medusa_heads=3), (4, 32)),
    "eagle": ({}, (4, 32)),
    "eagle3": (dict(draft_vocab_size=200), (4, 32)),
    "mtp": ({}, (4, 32)),
    "dflash": (dict(block_size=4, dflash_layers=1), (4, 64)),
    "dspark": (dict(block_size=4, dflash_layers=1, markov_rank=16), (4, 64)),
}


def export_drafter(target_dir: Path, method: str, out: Path, steps: int = 2) -> Path:
    """A drafter of `method` for `target_dir`, built and trained a few steps by its recipe, exported."""
    from specdecode.models.loader import load_model
    from specdecode.train.drafter import RECIPES, DrafterTrainConfig

    target = load_model(target_dir, torch.float32)
    overrides, window = SHAPES[method]
    cfg = DrafterTrainConfig(method=method, target=target_dir, out_dir=out, work_dir=out.parent / "work", **overrides)
    recipe = RECIPES[method]
    torch.manual_seed(0)
    tokens = torch.randint(3, 320, (3000,), generator=torch.Generator().manual_seed(0)).numpy()
    drafter = recipe.build(target, cfg, tokens)
    train_briefly(recipe, drafter, target, steps, window)
    recipe.export(drafter, target, cfg, {"steps": steps})
    return out


def build(target: Path, method: str, drafter: Path) -> LLM:
    config = {"method": method, "model": str(drafter), "num_speculative_tokens": 3}  # within every drafter's depth
    return LLM(target, dtype="float32", max_num_seqs=2, speculative_config=config)


def refused(target: Path, method: str, drafter: Path, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(target, method, drafter)


@pytest.mark.parametrize("method, taps", [("eagle3", "aux_hidden_state_layer_ids"), ("dflash", "target_layer_ids"),
                                          ("dspark", "target_layer_ids")])
def test_a_drafter_tapping_layers_the_target_lacks_is_refused(native_model, tmp_path, method, taps):
    deep = make_native_model(tmp_path / "deep", layers=6)  # same width and vocabulary, 6 layers
    drafter = export_drafter(deep, method, tmp_path / method)
    build(deep, method, drafter)  # it fits the target it was built for
    refused(native_model, method, drafter, rf"{taps}=\[1, 3, 5\], but this target has 2 layers "
                                           r"\(hidden_states indices 0\.\.2\)")


@pytest.mark.parametrize("method", ["eagle", "mtp", "medusa", "eagle3", "dflash"])
def test_a_drafter_of_another_width_is_refused(native_model, tmp_path, method):
    narrow = make_native_model(tmp_path / "narrow", hidden=32)
    refused(native_model, method, export_drafter(narrow, method, tmp_path / method),
            "built for a target with hidden_size 32; this target's hidden_size is 64")


@pytest.mark.parametrize("method", ["eagle", "dspark"])
def test_a_drafter_of_another_vocabulary_is_refused(native_model, tmp_path, method):
    wide = make_native_model(tmp_path / "wide", vocab=400)
    refused(native_model, method, export_drafter(wide, method, tmp_path / method),
            "the drafter's vocab_size is 400, the target's is 320")


@pytest.mark.parametrize("method", LEARNED + ("draft_model",))
def test_a_drafter_with_another_token_map_is_refused(native_model, native_drafter, trained_drafters, tmp_path, method):
    drafter = tmp_path / method
    shutil.copytree(native_drafter if method == "draft_model" else trained_drafters[method], drafter)
    tokenizer = json.loads((drafter / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # same size, two tokens swapped
    (drafter / "tokenizer.json").write_text(json.dumps(tokenizer))
    refused(native_model, method, drafter, "tokenizer.json maps tokens differently from the target's "
                                           r"\(token '[ab]': id \d+ there, \d+ in the target's\)")


def test_a_dflash_mask_id_outside_the_vocabulary_is_refused(native_model, trained_drafters, tmp_path):
    drafter = tmp_path / "dflash"
    shutil.copytree(trained_drafters["dflash"], drafter)
    config = json.loads((drafter / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = 320
    (drafter / "config.json").write_text(json.dumps(config))
    refused(native_model, "dflash", drafter, "mask_token_id uses token id 320, outside this target's vocabulary")


def test_an_eagle3_draft_vocabulary_beyond_the_target_is_refused(native_model, trained_drafters, tmp_path):
    from safetensors.torch import load_file, save_file

    drafter = tmp_path / "eagle3"
    shutil.copytree(trained_drafters["eagle3"], drafter)
    state = load_file(str(drafter / "model.safetensors"))
    state["d2t"][-1] += 1000  # the last draft id maps past the target's vocabulary
    save_file(state, str(drafter / "model.safetensors"))
    refused(native_model, "eagle3", drafter, r"d2t uses token id \d+, outside this target's vocabulary")
