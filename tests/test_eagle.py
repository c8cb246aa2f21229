"""EAGLE, EAGLE-3 and MTP drafters beyond the conformance suite: stop rules, checkpoints, the
speculators layout, and serving computing what training optimised."""

import pytest
import torch
from helpers import PROMPTS

from specdecode import LLM, SamplingParams
from specdecode.errors import ConfigError
from specdecode.speculative.propose.drafters.eagle.checkpoint import load_drafter, save_drafter


def test_stopping_rows_while_drafting_keeps_greedy_output(native_model, trained_drafters):
    """D-Cut's drafting half stops rows mid-chain; what is drafted stays exact (greedy)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(native_model, dtype="float32", max_num_seqs=4).generate(PROMPTS, params)
    spec = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config={
        "method": "eagle3", "model": str(trained_drafters["eagle3"]), "num_speculative_tokens": 4})
    spec.speculator.depth.draft_stop = lambda plan: lambda step, tops, rows: rows[1:]  # the first still-drafting row stops
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == [o.token_ids for o in plain]


def test_checkpoint_round_trip_and_variant_check(native_model, trained_drafters, tmp_path):
    d = load_drafter(trained_drafters["eagle3"], torch.float32, "cpu")
    assert d.cfg.variant == "eagle3" and d.cfg.draft_vocab_size == 200
    ids = d.draft_to_target
    assert len(set(ids.tolist())) == 200 and int(ids.max()) < 320  # a real map into the target vocabulary
    save_drafter(d, tmp_path / "again", native_model)
    assert load_drafter(tmp_path / "again", torch.float32, "cpu").cfg.aux_layers == d.cfg.aux_layers
    with pytest.raises(ConfigError, match="'mtp' drafter, not 'eagle'"):
        LLM(native_model, dtype="float32", speculative_config={"method": "eagle", "model": str(trained_drafters["mtp"])})


def test_export_speculators_layout_and_load_back(native_model, trained_drafters, tmp_path):
    import json

    from safetensors import safe_open

    from specdecode.cli import main

    out = tmp_path / "spec"
    assert main(["export", "--format", "speculators", "--drafter", str(trained_drafters["eagle3"]), "--target",
                 str(native_model), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 200 and config["vocab_size"] == 320
    assert config["speculators_model_type"] == "eagle3" and config["speculators_config"]["algorithm"] == "eagle3"
    ours = load_drafter(trained_drafters["eagle3"], torch.float32, "cpu")
    assert [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == list(ours.cfg.aux_layers)
    d = config["hidden_size"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["fc.weight"] == (d, len(ours.cfg.aux_layers) * d) and len(ours.cfg.aux_layers) == 3
    assert shapes["layers.0.self_attn.q_proj.weight"][1] == 2 * d  # q/k/v read [embedding ; feature]
    assert shapes["lm_head.weight"] == (200, d) and shapes["d2t"] == (200,) and shapes["t2d"] == (320,)
    for name in ("layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight", "norm.weight"):
        assert name in shapes
    back = load_drafter(out, torch.float32, "cpu")
    for (ka, va), (kb, vb) in zip(sorted(ours.state_dict().items()), sorted(back.state_dict().items())):
        assert ka == kb and torch.equal(va.to(torch.bfloat16).float() if va.is_floating_point() else va,
                                        vb.float() if vb.is_floating_point() else vb)


def test_ttt_mask_matches_inference_attention():
    from specdecode.train.drafter import ttt_mask

    mask = ttt_mask(step=3, num_anchors=3, block=4, device="cpu")[0, 0].int()
    # Columns: step-1 keys of anchors 0..3 | step-2 keys | step-3 keys.
    assert mask.tolist() == [
        [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0],
    ]


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_serving_catch_up_equals_the_training_step(native_model, trained_drafters, method):
    """The proposer's first draft state must be what training's first unroll step computed."""
    from specdecode.engine.sequence import Sequence
    from specdecode.speculative.propose.features import FeatureState
    from specdecode.train.drafter import _eagle_unroll

    llm = LLM(native_model, dtype="float32", speculative_config={"method": method, "model": str(trained_drafters[method]),
                                                                 "num_speculative_tokens": 2})
    proposer = llm.speculator.proposer
    window = torch.randint(3, 320, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, _, _, o, _ = next(_eagle_unroll(proposer.drafter, llm.model, window, 1))  # o[:, t]: anchor t
        out = llm.model(window, torch.arange(12)[None], hidden_taps=proposer.hidden_taps)
    raw = proposer.drafter.raw_features(out.hidden, out.taps, proposer.drafter.cfg.aux_layers)[0]
    n = 8  # committed tokens x_0 .. x_7; the target has processed positions 0 .. 6
    seq = Sequence("t", None, window[0, :n].tolist(), SamplingParams(), (0,), max_len=256, slot=0)
    proposer._states[seq.request_id] = FeatureState(0, [(raw[None], 0, n - 1)])
    first = proposer._catch_up([seq], [0])[0]
    served = proposer._forward_last([first[0]], [first[1]])[0]
    torch.testing.assert_close(served, o[0, n - 2], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_a_native_forward_hands_the_drafter_its_raw_feature_as_one_block(lean_model, lean_drafters, method):
    """The target's C++ forwards (one sequence, and a batch of several) return the tapped layers'
    states concatenated in order as one block, which the proposer reads as its raw feature instead of
    concatenating them after the call: equal to the drafter's `raw_features` of the taps, and the taps
    equal to the modules' own."""
    from specdecode.engine.ragged import ForwardEntry

    llm = LLM(lean_model, dtype="float32", quantization="w8a8",  # the lean path serves a batch of several
              speculative_config={"method": method, "model": str(lean_drafters[method]), "num_speculative_tokens": 2})
    proposer, runner = llm.speculator.proposer, llm.runner
    taps = proposer.hidden_taps
    prompts = [[5, 9, 13, 7, 21], [4, 8, 11, 2], [30, 31, 32]]
    # Each prompt alone (one sequence's forward), then one more token of each (a batch of several).
    steps = [[ForwardEntry(s, prompt[:-1], start=0)] for s, prompt in enumerate(prompts)]
    steps.append([ForwardEntry(s, prompt[-1:], start=len(prompt) - 1) for s, prompt in enumerate(prompts)])
    for entries in steps:
        result = runner.forward(entries, hidden_taps=taps)
        with torch.no_grad():
            for row, entry in enumerate(entries):
                ids = torch.tensor([prompts[entry.slot][: entry.start + len(entry.token_ids)]])
                out = llm.model(ids, torch.arange(ids.shape[1])[None], hidden_taps=taps)
                for layer in taps:
                    torch.testing.assert_close(result.taps[layer][row, : len(entry.token_ids)],
                                               out.taps[layer][0, entry.start:], atol=1e-5, rtol=1e-5)
        raw = proposer.drafter.raw_features(result.hidden, result.taps, proposer.drafter.cfg.aux_layers)
        assert torch.equal(proposer.target_features(result), raw)
        assert (result.tap_block is not None) == bool(taps)
        if len(taps) > 1:
            assert proposer.target_features(result) is result.tap_block  # no concatenation after the call


def test_a_catch_up_split_from_its_batch_keeps_greedy_output(native_model, trained_drafters, monkeypatch):
    """A long prompt admitted while another request decodes: the drafter's catch-up over it runs
    as a forward of its own (`LengthGrouping`), and the output stays plain decoding's."""
    from specdecode.engine import ragged

    splits = []
    original = ragged.LengthGrouping.run

    def spy(self, entries, forward, merge=None):
        calls = []
        out = original(self, entries, lambda group: calls.append(group) or forward(group), merge)
        splits.append(len(calls))
        return out

    monkeypatch.setattr(ragged.LengthGrouping, "run", spy)
    long_prompt = {"prompt_token_ids": [3 + (7 * i) % 300 for i in range(180)]}
    prompts = [PROMPTS[0], {"prompt_token_ids": [9, 10]}, long_prompt]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 30, 16)]
    plain = LLM(native_model, dtype="float32", max_num_seqs=2).generate(prompts, params)
    spec = LLM(native_model, dtype="float32", max_num_seqs=2, speculative_config={
        "method": "eagle3", "model": str(trained_drafters["eagle3"]), "num_speculative_tokens": 3}).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert max(splits) == 2  # the catch-up ran beside the decoding request, in its own forward
