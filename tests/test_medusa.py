"""Medusa heads beyond the conformance suite: the static tree's shape and configs that do not fit."""

import pytest

from specdecode import LLM
from specdecode.errors import ConfigError
from specdecode.speculative.propose.static_tree import static_tree


def test_static_tree_shape():
    assert static_tree(3, 1, 10) == [(0,), (0, 0), (0, 0, 0)]
    tree = static_tree(3, 3, 12)
    assert len(tree) == 12 and tree[0] == (0,)
    assert all(p[:-1] in tree for p in tree if len(p) > 1)  # parents are in the tree
    assert [len(p) for p in tree] == sorted(len(p) for p in tree)  # parents first


def test_configs_that_do_not_fit(native_model, trained_drafters):
    with pytest.raises(ConfigError, match="exceeds this Medusa checkpoint's 3 heads"):
        LLM(native_model, dtype="float32", speculative_config={"method": "medusa", "model": str(trained_drafters["medusa"]),
                                                               "num_speculative_tokens": 5})
    with pytest.raises(ConfigError, match="tree_topk.*not supported for method 'ngram'.*medusa"):
        LLM(native_model, dtype="float32", speculative_config={"method": "ngram", "tree_topk": 2})
