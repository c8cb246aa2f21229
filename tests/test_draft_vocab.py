"""FR-Spec's reduced draft vocabulary: served head rows, the drop-in head, every learned family
still lossless and drafting only kept tokens, the frequency file and clear refusals."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import PROMPTS, TEXT, cases, generate_ids
from torch import nn

from specdecode import LLM, SamplingParams
from specdecode.errors import ConfigError
from specdecode.models.inference import PackedLinear, can_pack, select_output_rows
from specdecode.models.quant import QuantizedLinear, QuantScheme
from specdecode.speculative.propose import draft_vocab
from specdecode.speculative.propose.draft_vocab import ReducedHead, load_frequencies, most_frequent
from specdecode.train.token_frequencies import write_frequencies

KEEP = 48  # of the test vocabulary's 320 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def frequencies(native_model, tmp_path_factory):
    text = tmp_path_factory.mktemp("corpus") / "a.py"
    text.write_text(TEXT * 4)
    out = tmp_path_factory.mktemp("freq") / "token_frequencies.json"
    write_frequencies(native_model, out, [text])
    return out


def _index(n: int) -> torch.Tensor:
    return torch.tensor(sorted(torch.randperm(n, generator=torch.Generator().manual_seed(0))[: n // 3].tolist()))


def test_selected_rows_of_a_dense_layer_compute_those_outputs_exactly():
    torch.manual_seed(0)
    layer = nn.Linear(64, 96, bias=True).requires_grad_(False)
    index = _index(96)
    x = torch.randn(5, 64)
    assert torch.equal(select_output_rows(layer, index, torch.float32)(x), layer(x)[:, index])


@pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")), reason="oneDNN packing unavailable")
def test_a_packed_layer_gives_back_its_exact_weight_and_selected_rows_stay_packed():
    torch.manual_seed(0)
    weight = torch.randn(96, 64).to(torch.bfloat16)
    packed = PackedLinear(weight, None)
    assert torch.equal(packed.dense_weight(), weight)  # identity rows through the packed matmul: no rounding
    rows = select_output_rows(packed, _index(96), torch.bfloat16)
    assert isinstance(rows, PackedLinear)
    x = torch.randn(3, 64).to(torch.bfloat16)
    torch.testing.assert_close(rows(x).float(), packed(x)[:, _index(96)].float(), rtol=0, atol=1e-2)


@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_selected_rows_of_a_quantised_layer_keep_its_stored_values(scheme):
    torch.manual_seed(0)
    layer = QuantizedLinear.from_weight(torch.randn(96, 64), None, QuantScheme.parse(scheme))
    index = _index(96)
    rows = select_output_rows(layer, index, torch.float32)
    assert isinstance(rows, QuantizedLinear) and rows.scheme == layer.scheme
    assert torch.equal(rows.dequantize(), layer.dequantize()[index])
    x = torch.randn(4, 64)
    assert torch.equal(rows(x), layer(x)[:, index])


def test_the_reduced_head_scores_its_tokens_and_rules_out_the_rest():
    torch.manual_seed(0)
    full = nn.Linear(16, 40, bias=False).requires_grad_(False)
    ids = torch.tensor([1, 5, 6, 30])
    head = ReducedHead(select_output_rows(full, ids, torch.float32), ids, 40)
    x = torch.randn(2, 16)
    out = head(x)
    assert out.shape == (2, 40)
    assert torch.equal(out[:, ids], full(x)[:, ids])
    rest = torch.ones(40, dtype=torch.bool)
    rest[ids] = False
    assert torch.isneginf(out[:, rest]).all()


def test_most_frequent_ranks_by_count_and_breaks_ties_by_position():
    counts = torch.tensor([5, 9, 9, 0, 7, 1])
    assert most_frequent(counts, torch.arange(6), 3).tolist() == [1, 2, 4]
    # Within a sub-vocabulary (EAGLE-3's draft ids): positions in it, not token ids.
    assert most_frequent(counts, torch.tensor([0, 3, 4]), 2).tolist() == [0, 2]


def _record_drafts(llm) -> list[torch.Tensor]:
    drafted = []
    proposer = llm.speculator.proposer
    propose = proposer.propose

    def recording(*args, **kwargs):
        draft = propose(*args, **kwargs)
        cols = torch.arange(draft.token_ids.shape[1])[None, :]
        drafted.append(draft.token_ids[cols < draft.num_tokens[:, None]])  # the nodes each row drafts
        return draft

    proposer.propose = recording
    return drafted


@cases
def test_every_learned_family_stays_lossless_and_drafts_only_frequent_tokens(native_model, spec_config, frequencies):
    if spec_config["method"] == "ngram":
        pytest.skip("n-gram drafts copy the context: it has no LM head to reduce")
    config = {**spec_config, "draft_vocab_size": KEEP, "draft_vocab_frequencies": str(frequencies)}
    plain = generate_ids(native_model, PROMPTS, GREEDY)
    llm = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config=config)
    drafted = _record_drafts(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
    counts = load_frequencies(frequencies, 320)
    keep = set(torch.sort(-counts, stable=True).indices[:KEEP].tolist())
    if spec_config["method"] == "eagle3":  # the most frequent of its own draft vocabulary
        d2t = llm.speculator.proposer.drafter.draft_to_target
        keep = set(d2t[most_frequent(counts, d2t, KEEP)].tolist())
    tokens = set(torch.cat(drafted).tolist())
    assert tokens and tokens <= keep


def _keep(llm, frequencies, method: str, size: int) -> set[int]:
    """The tokens a head over the `size` most frequent ones may draft (EAGLE-3: of its own draft vocabulary)."""
    counts = load_frequencies(frequencies, 320)
    if method == "eagle3":
        d2t = llm.speculator.proposer.drafter.draft_to_target
        return set(d2t[most_frequent(counts, d2t, size)].tolist())
    return set(torch.sort(-counts, stable=True).indices[:size].tolist())


def _generate_recording(llm, params) -> tuple[list[list[int]], set[int], list[torch.Tensor]]:
    """Outputs, the set of drafted tokens and every proposal's drafts."""
    drafted = _record_drafts(llm)
    outputs = [o.token_ids for o in llm.generate(PROMPTS, params)]
    return outputs, set(torch.cat(drafted).tolist()), drafted


@cases
def test_greedy_proposals_draft_over_their_own_reduced_vocabulary(native_model, spec_config, frequencies):
    # greedy_draft_vocab_size: an all-greedy proposal scores KEEP tokens, a sampled one every token,
    # drafting (and so generating) exactly what a run without FR-Spec does.
    if spec_config["method"] == "ngram":
        pytest.skip("n-gram drafts copy the context: it has no LM head to reduce")
    counted = {**spec_config, "draft_vocab_frequencies": str(frequencies)}
    llm = LLM(native_model, dtype="float32", max_num_seqs=4,
              speculative_config={**counted, "greedy_draft_vocab_size": KEEP})
    outputs, tokens, _ = _generate_recording(llm, GREEDY)
    assert outputs == generate_ids(native_model, PROMPTS, GREEDY)
    assert tokens and tokens <= _keep(llm, frequencies, spec_config["method"], KEEP)
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)
    full = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config={**counted, "greedy_draft_vocab_size": 0})
    ours, theirs = _generate_recording(llm, sampled), _generate_recording(full, sampled)
    assert ours[0] == theirs[0]
    assert len(ours[2]) == len(theirs[2]) and all(torch.equal(a, b) for a, b in zip(ours[2], theirs[2]))


def _head_widths(llm) -> list[tuple[int, int]]:
    """(sampled, greedy): the number of tokens each of the EAGLE-family proposer's heads scores."""
    x = torch.zeros(1, llm.speculator.proposer.target.config.hidden_size)
    return [(int(torch.isfinite(heads.sampled(x)).sum()), int(torch.isfinite(heads.greedy(x)).sum()))
            for heads in llm.speculator.proposer.draft_heads.values()]


def test_greedy_proposals_draft_over_the_methods_default_where_token_counts_are_at_hand(
        native_model, trained_drafters, frequencies, monkeypatch):
    monkeypatch.setattr(draft_vocab, "DEFAULT_GREEDY_DRAFT_VOCAB_SIZE", {"mtp": KEEP})  # 2,048 of the default model's 8,192
    mtp = {"method": "mtp", "model": str(trained_drafters["mtp"]), "num_speculative_tokens": 3}
    counted = {**mtp, "draft_vocab_frequencies": str(frequencies)}

    def widths(**keys):
        return _head_widths(LLM(native_model, dtype="float32", speculative_config={**counted, **keys}))

    assert widths() == [(320, KEEP)]
    assert widths(greedy_draft_vocab_size=0) == [(320, 320)]
    assert widths(greedy_draft_vocab_size=64) == [(320, 64)]
    assert widths(draft_vocab_size=64) == [(64, 64)]  # both, unless greedy_draft_vocab_size says otherwise
    assert widths(draft_vocab_size=64, greedy_draft_vocab_size=0) == [(64, 320)]
    # No counts at hand (none beside the test model): every token.
    assert _head_widths(LLM(native_model, dtype="float32", speculative_config=mtp)) == [(320, 320)]
    # A method without a default keeps its own head (EAGLE-3: its draft vocabulary).
    eagle3 = {"method": "eagle3", "model": str(trained_drafters["eagle3"]), "draft_vocab_frequencies": str(frequencies)}
    llm = LLM(native_model, dtype="float32", speculative_config=eagle3)
    width = len(llm.speculator.proposer.drafter.draft_to_target)
    assert _head_widths(llm) == [(width, width)]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_reduced_vocabulary_with_quantised_weights_is_lossless(native_model, trained_drafters, frequencies,
                                                                  quantization):
    plain = generate_ids(native_model, PROMPTS, GREEDY, quantization=quantization)
    for method in ("mtp", "eagle3"):
        config = {"method": method, "model": str(trained_drafters[method]), "num_speculative_tokens": 3,
                  "draft_vocab_size": KEEP, "draft_vocab_frequencies": str(frequencies)}
        assert generate_ids(native_model, PROMPTS, GREEDY, config, quantization=quantization) == plain


def test_the_frequency_file_counts_the_corpus(native_model, frequencies):
    from specdecode.tokenizer import Tokenizer

    data = json.loads(frequencies.read_text())
    ids = Tokenizer(native_model).encode(TEXT * 4)
    assert data["vocab_size"] == 320 and data["num_tokens"] == len(ids)
    assert data["counts"] == torch.bincount(torch.tensor(ids), minlength=320).tolist()


def test_bad_reduced_vocabulary_configurations_are_refused(native_model, trained_drafters, frequencies, tmp_path):
    mtp = {"method": "mtp", "model": str(trained_drafters["mtp"])}
    with pytest.raises(ConfigError, match="draft_vocab_size.*learned drafter"):
        LLM(native_model, dtype="float32", speculative_config={"method": "ngram", "draft_vocab_size": 8})
    with pytest.raises(ConfigError, match="greedy_draft_vocab_size.*learned drafter"):
        LLM(native_model, dtype="float32", speculative_config={"method": "ngram", "greedy_draft_vocab_size": 8})
    with pytest.raises(ConfigError, match="draft_vocab_size is invalid"):
        LLM(native_model, dtype="float32", speculative_config={**mtp, "draft_vocab_size": 0})
    with pytest.raises(ConfigError, match="greedy_draft_vocab_size is invalid"):
        LLM(native_model, dtype="float32", speculative_config={**mtp, "greedy_draft_vocab_size": -1})
    with pytest.raises(ConfigError, match="token-frequencies"):  # no file beside the test model's weights
        LLM(native_model, dtype="float32", speculative_config={**mtp, "draft_vocab_size": 8})
    with pytest.raises(ConfigError, match="greedy_draft_vocab_size needs token counts"):
        LLM(native_model, dtype="float32", speculative_config={**mtp, "greedy_draft_vocab_size": 8})
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="not a token-frequencies file"):
        LLM(native_model, dtype="float32", speculative_config={**mtp, "draft_vocab_size": 8,
                                                               "draft_vocab_frequencies": str(bad)})
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"counts": [1, 2, 3]}))
    with pytest.raises(ConfigError, match="counts 3 tokens"):
        LLM(native_model, dtype="float32", speculative_config={**mtp, "draft_vocab_size": 8,
                                                               "draft_vocab_frequencies": str(short)})
