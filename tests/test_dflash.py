"""DFlash beyond the conformance suite: the training mask, wide trees, block bounds, serving = training."""

import pytest
import torch
from helpers import PROMPTS, generate_ids

from specdecode import LLM, SamplingParams
from specdecode.errors import ConfigError
from specdecode.train.drafter import dflash_block_mask


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


def test_a_wide_static_tree_accepts_and_stays_exact(native_model, trained_drafters):
    """A wide tree catches some of the target's choices even from this barely trained drafter:
    accepted paths go through path compaction and the drafter's feature sync."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = generate_ids(native_model, PROMPTS, params)
    wide = {"method": "dflash", "model": str(trained_drafters["dflash"]), "num_speculative_tokens": 3, "tree_topk": 16,
            "tree_num_nodes": 64}
    spec = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config=wide).generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == plain
    assert sum(o.metrics.num_accepted_tokens for o in spec) > 0


def test_dflash_block_bounds_k(native_model, trained_drafters):
    with pytest.raises(ConfigError, match="block_size - 1"):
        LLM(native_model, dtype="float32", speculative_config={"method": "dflash", "model": str(trained_drafters["dflash"]),
                                                               "num_speculative_tokens": 4})


def test_serving_block_pass_equals_the_training_pass(native_model, trained_drafters):
    """The proposer's cached context + block pass must compute what training optimised."""
    from specdecode.engine.sequence import Sequence
    from specdecode.speculative.propose.features import FeatureState
    from specdecode.train.drafter import _block_states

    llm = LLM(native_model, dtype="float32", speculative_config={"method": "dflash", "model": str(trained_drafters["dflash"]),
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
    proposer._states[seq.request_id] = FeatureState(0, [(raw[None], 0, anchor)])
    served = proposer.block_pass([seq], [0])[0, 1:]  # block positions 1 .. B-1
    torch.testing.assert_close(served, hidden[0], atol=1e-4, rtol=1e-4)
