"""DFlash block drafter: training mask, training signal, lossless serving."""

import pytest
import torch
from helpers import train_briefly

from specdecode import LLM, SamplingParams
from specdecode.errors import ConfigError
from specdecode.models.loader import load_model
from specdecode.train.drafter import RECIPES, DrafterTrainConfig, dflash_block_mask

PROMPTS = [{"prompt_token_ids": p} for p in ([5, 17, 99, 5, 17], [8, 200, 31, 77, 150, 3], [42], [100, 101, 102])]


def test_block_mask_on_a_hand_made_example():
    mask = dflash_block_mask(torch.tensor([[2, 5]]), block=2, context_len=7)[0, 0].int()
    expected = torch.tensor([
        # context 0..6         block0 block1
        [1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0],  # block 0 (anchor 2), anchor token
        [1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0],  # block 0, mask token: bidirectional inside the block
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1],  # block 1 (anchor 5) sees context 0..4 only
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1],
    ])
    assert torch.equal(mask, expected)


@pytest.fixture(scope="module")
def dflash_dir(native_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    target = load_model(native_model, torch.float32)
    cfg = DrafterTrainConfig(method="dflash", target=native_model, out_dir=root / "d", work_dir=root / "w", block_size=4,
                             dflash_layers=1)
    recipe = RECIPES["dflash"]
    torch.manual_seed(0)
    drafter = recipe.build(target, cfg)
    losses = train_briefly(recipe, drafter, target, 25, (4, 64))
    assert sum(losses[-5:]) < sum(losses[:5])
    recipe.export(drafter, target, cfg, {})
    return root / "d"


def test_dflash_greedy_equals_plain(native_model, dflash_dir):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(native_model, dtype="float32", max_num_seqs=4).generate(PROMPTS, params)
    config = {"method": "dflash", "model": str(dflash_dir), "num_speculative_tokens": 3}
    spec = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config=config).generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics.num_draft_tokens for o in spec) > 0
    single = LLM(native_model, dtype="float32", max_num_seqs=1, speculative_config=config).generate(PROMPTS[1], params)
    assert single[0].token_ids == plain[1].token_ids


def test_dflash_tree_greedy_equals_plain(native_model, dflash_dir):
    """A static tree over the block positions' top-k tokens, verified in one forward."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(native_model, dtype="float32", max_num_seqs=4).generate(PROMPTS, params)
    config = {"method": "dflash", "model": str(dflash_dir), "num_speculative_tokens": 3, "tree_topk": 3,
              "tree_num_nodes": 8}
    spec = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config=config).generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    single = LLM(native_model, dtype="float32", max_num_seqs=1, speculative_config=config).generate(PROMPTS[2], params)
    assert single[0].token_ids == plain[2].token_ids
    # A wide tree catches some of the target's choices even from this barely trained drafter:
    # accepted paths go through path compaction and the drafter's feature sync.
    wide = {**config, "tree_topk": 16, "tree_num_nodes": 64}
    spec = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config=wide).generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics.num_accepted_tokens for o in spec) > 0


def test_dflash_sampling_is_seeded_and_batch_independent(native_model, dflash_dir):
    config = {"method": "dflash", "model": str(dflash_dir), "num_speculative_tokens": 3}
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=4, ignore_eos=True)
    alone = LLM(native_model, dtype="float32", max_num_seqs=1, speculative_config=config).generate(PROMPTS[0], seeded)
    others = SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True)
    mixed = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config=config).generate(
        PROMPTS, [seeded, others, others, others])
    assert mixed[0].token_ids == alone[0].token_ids


def test_dflash_block_bounds_k(native_model, dflash_dir):
    with pytest.raises(ConfigError, match="block_size - 1"):
        LLM(native_model, dtype="float32", speculative_config={"method": "dflash", "model": str(dflash_dir),
                                                               "num_speculative_tokens": 4})


def test_serving_block_pass_equals_the_training_pass(native_model, dflash_dir):
    """The proposer's cached context + block pass must compute what training optimised."""
    from specdecode.engine.sequence import Sequence
    from specdecode.speculative.propose.features import FeatureState
    from specdecode.train.drafter import _block_states

    llm = LLM(native_model, dtype="float32", speculative_config={"method": "dflash", "model": str(dflash_dir),
                                                                 "num_speculative_tokens": 3})
    proposer = llm.speculator.proposer
    window = torch.randint(3, 320, (1, 16), generator=torch.Generator().manual_seed(5))
    anchor = 9
    with torch.no_grad():
        hidden, _, j, _ = _block_states(proposer.drafter, llm.model, window, 1, anchors=torch.tensor([[anchor]]))
        taps = llm.model(window, torch.arange(16)[None], hidden_taps=proposer.hidden_taps).taps
    raw = torch.cat([taps[i] for i in proposer.drafter.cfg.target_layer_ids], dim=-1)[0]
    # Committed tokens x_0 .. x_anchor; the target has processed positions 0 .. anchor - 1.
    seq = Sequence("t", None, window[0, : anchor + 1].tolist(), SamplingParams(), (0,), max_len=256, slot=0)
    proposer._states[seq.request_id] = FeatureState(0, [raw[:anchor]])
    served = proposer.block_pass([seq], [0])[0, 1:]  # block positions 1 .. B-1
    torch.testing.assert_close(served, hidden[0], atol=1e-4, rtol=1e-4)
