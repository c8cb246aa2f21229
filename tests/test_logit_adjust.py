"""Logit adjustments (penalties, logit_bias, bad words, min_p) against a plain reference, and the
vectorised draft context: a verification row at draft position j must be adjusted exactly as
a plain decoding row whose output already holds the drafts before j."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode import SamplingParams
from specdecode.logit_adjust import LogitAdjust, RowHistory, path_tokens
from specdecode.sampling import SamplingBatch, adjust_logits, process_logits

V = 12


def reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
              bad: list[list[int]]) -> torch.Tensor:
    """vLLM's formulas written out token by token (the slow, obvious way)."""
    x = logits.clone().double()
    for ids in bad:
        if len(ids) == 1 or output[-(len(ids) - 1):] == ids[:-1] and len(output) >= len(ids) - 1:
            x[ids[-1]] = -math.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in range(logits.shape[0]):
        count = output.count(t)
        if (t in prompt or count) and p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return x.float()


def batch_of(params, histories) -> SamplingBatch:
    adjust = LogitAdjust.build(params, histories, V, "cpu")
    return SamplingBatch.build(params, [None] * len(params), "cpu", adjust=adjust)


PENALISED = SamplingParams(temperature=0, repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=0.9,
                           logit_bias={2: 3.0, 7: -1.5}, bad_words=["x"])


def test_adjustments_match_the_reference_and_spare_other_rows():
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 3
    prompt, output, bad = [1, 4, 4], [5, 6, 5, 9], [[3], [6, 9, 8]]
    params = [PENALISED, SamplingParams(temperature=0), PENALISED]
    histories = [RowHistory(prompt, output, bad), None, RowHistory([0], [8, 6, 9], bad)]
    got = adjust_logits(logits, batch_of(params, histories))
    torch.testing.assert_close(got[0], reference(logits[0], PENALISED, prompt, output, bad))
    assert torch.equal(got[1], logits[1])  # a row that asks for nothing is left as it was
    torch.testing.assert_close(got[2], reference(logits[2], PENALISED, [0], [8, 6, 9], bad))
    assert got[2, 8] == -math.inf and got[0, 8] != -math.inf  # the 3-token word ends only where its prefix does
    assert got[0, 3] == got[2, 3] == -math.inf


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, V - 1), min_size=0, max_size=6), st.lists(st.integers(0, V - 1), min_size=1, max_size=5),
       st.integers(0, 2 ** 16))
def test_chain_positions_are_adjusted_as_plain_decoding_after_the_drafts(output, draft, seed):
    """Row j of a verification (x_1..x_j drafted before it) = a plain row whose output ends in x_1..x_j."""
    torch.manual_seed(seed)
    k = len(draft)
    logits = torch.randn(k + 1, V) * 2
    bad = [[draft[0], 5], [7]]
    params = [PENALISED]
    base = batch_of(params, [RowHistory([1, 2], output, bad)])
    drafts = torch.tensor([draft])
    rows = base.repeat_rows([k + 1]).with_context(path_tokens(drafts).view(k + 1, k), None)
    got = adjust_logits(logits, rows)
    for j in range(k + 1):
        plain = adjust_logits(logits[j:j + 1], batch_of(params, [RowHistory([1, 2], output + draft[:j], bad)]))
        torch.testing.assert_close(got[j], plain[0], msg=f"position {j}")


def test_tree_paths_hold_each_nodes_ancestors_root_side_first():
    #        root
    #       /    \
    #     n0(4)  n1(5)
    #     /  \      \
    #  n2(6) n3(7)  n4(8)
    #   |
    #  n5(9)
    tokens = torch.tensor([[4, 5, 6, 7, 8, 9, -1]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2, -2]])
    got = path_tokens(tokens, parents)[0].tolist()
    pad = [-1] * 7
    expected = [pad, [4] + pad[1:], [5] + pad[1:], [4, 6] + pad[2:], [4, 7] + pad[2:], [5, 8] + pad[2:],
                [4, 6, 9] + pad[3:], pad]
    assert got == expected
    chain = path_tokens(torch.tensor([[3, 1, 2]]))[0].tolist()
    assert chain == [[-1, -1, -1], [3, -1, -1], [3, 1, -1], [3, 1, 2]]


def test_min_p_drops_tokens_below_its_share_of_the_top_probability():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    batch = SamplingBatch.build([SamplingParams(temperature=1.0, min_p=0.2)], [None], "cpu")
    probs = process_logits(logits, batch)[0]
    assert probs[3] == 0 and probs[2] > 0  # 0.08 < 0.2 * 0.5 <= 0.12
    torch.testing.assert_close(probs[:3].sum(), torch.tensor(1.0))
    greedy = SamplingBatch.build([SamplingParams(temperature=0, min_p=0.9)], [None], "cpu")
    assert (process_logits(logits, greedy) > 0).all()  # greedy rows ignore min_p (as top-k / top-p)


def test_sampling_params_validate_the_new_knobs():
    import pytest

    from specdecode.errors import InvalidRequestError

    for bad in [dict(presence_penalty=3), dict(frequency_penalty=float("nan")), dict(repetition_penalty=0),
                dict(min_p=1.5), dict(logit_bias={-1: 1.0}), dict(logit_bias={3: 200}), dict(bad_words=[""]),
                dict(logprobs=21), dict(prompt_logprobs=-1), dict(structured_outputs={"regex": "a", "choice": ["b"]}),
                dict(structured_outputs={})]:
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)
    p = SamplingParams(structured_outputs={"regex": "[ab]+"}, logit_bias={3: 0.0})
    assert p.structured_outputs.regex == "[ab]+" and p.logit_bias is None and not p.adjusts_logits
