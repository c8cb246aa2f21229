"""Medusa heads: static trees, chains, lossless verification, training signal."""

import pytest
import torch
from helpers import train_briefly

from specdecode import LLM, SamplingParams
from specdecode.errors import ConfigError
from specdecode.models.loader import load_model
from specdecode.speculative.propose.static_tree import static_tree
from specdecode.train.drafter import RECIPES, DrafterTrainConfig

PROMPTS = [{"prompt_token_ids": p} for p in ([5, 17, 99, 5, 17], [8, 200, 31, 77, 150, 3], [42], [100, 101, 102])]


@pytest.fixture(scope="module")
def heads_dir(native_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa")
    target = load_model(native_model, torch.float32)
    cfg = DrafterTrainConfig(method="medusa", target=native_model, out_dir=root / "m", work_dir=root / "w", medusa_heads=3)
    recipe = RECIPES["medusa"]
    torch.manual_seed(0)
    heads = recipe.build(target, cfg)
    losses = train_briefly(recipe, heads, target, 20, (4, 32))
    assert sum(losses[-5:]) < sum(losses[:5])
    recipe.export(heads, target, cfg, {})
    return root / "m"


def test_static_tree_shape():
    assert static_tree(3, 1, 10) == [(0,), (0, 0), (0, 0, 0)]
    tree = static_tree(3, 3, 12)
    assert len(tree) == 12 and tree[0] == (0,)
    assert all(p[:-1] in tree for p in tree if len(p) > 1)  # parents are in the tree
    assert [len(p) for p in tree] == sorted(len(p) for p in tree)  # parents first


@pytest.mark.parametrize("tree", [dict(tree_topk=1), dict(tree_topk=3, tree_num_nodes=10)])
def test_medusa_greedy_equals_plain(native_model, heads_dir, tree):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(native_model, dtype="float32", max_num_seqs=4).generate(PROMPTS, params)
    config = {"method": "medusa", "model": str(heads_dir), "num_speculative_tokens": 3, **tree}
    spec = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config=config).generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics.num_draft_tokens for o in spec) > 0


def test_medusa_tree_sampling_is_seeded_and_batch_independent(native_model, heads_dir):
    config = {"method": "medusa", "model": str(heads_dir), "num_speculative_tokens": 3, "tree_topk": 2, "tree_num_nodes": 6}
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=9, ignore_eos=True)
    alone = LLM(native_model, dtype="float32", max_num_seqs=1, speculative_config=config).generate(PROMPTS[0], seeded)
    others = SamplingParams(temperature=0.5, max_tokens=16, ignore_eos=True)
    mixed = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config=config).generate(
        PROMPTS, [seeded, others, others, others])
    assert mixed[0].token_ids == alone[0].token_ids


def test_configs_that_do_not_fit(native_model, heads_dir):
    with pytest.raises(ConfigError, match="exceeds this Medusa checkpoint's 3 heads"):
        LLM(native_model, dtype="float32", speculative_config={"method": "medusa", "model": str(heads_dir),
                                                               "num_speculative_tokens": 5})
    with pytest.raises(ConfigError, match="tree_topk.*not supported for method 'ngram'.*medusa"):
        LLM(native_model, dtype="float32", speculative_config={"method": "ngram", "tree_topk": 2})
