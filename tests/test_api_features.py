"""Every sampling feature under every drafter, chain and tree: penalties, logit_bias, bad words,
logprobs and structured outputs give plain decoding's output (greedy: token for token;
logprobs: to float32 rounding), constrained output always parses, and the penalised sampler
keeps the target's distribution (statistical test with a negative control)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from helpers import PROMPTS, cases, chi_square, generate_ids

from specdecode import LLM, SamplingParams
from specdecode.config import StructuredOutputsParams
from specdecode.errors import InvalidRequestError

PENALTIES = dict(repetition_penalty=1.15, frequency_penalty=0.2, presence_penalty=0.1, logit_bias={276: 4.0, 84: 2.5},
                 bad_words=["self", "items"])
PENALISED = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, **PENALTIES)
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "color", "n"], "additionalProperties": False}
REGEX = r"[a-c]{2}-[0-9]{2}( [xyz]{1,3})?"


def _llm(model, spec_config=None, max_num_seqs: int = 4, **kwargs):
    return LLM(model, dtype="float32", max_num_seqs=max_num_seqs, speculative_config=spec_config, **kwargs)


def _matches_schema(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"ok", "color", "n"} and isinstance(value["ok"], bool) and value["color"] in
            ("red", "green", "blue") and isinstance(value["n"], int) and 0 <= value["n"] <= 9)


@cases
def test_penalised_greedy_equals_plain_decoding(native_model, spec_config):
    plain = generate_ids(native_model, PROMPTS, PENALISED)
    assert plain != generate_ids(native_model, PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    outs = _llm(native_model, spec_config).generate(PROMPTS, PENALISED)
    assert [o.token_ids for o in outs] == plain
    banned = {265, 283, 285}  # "self", " self", "items": single-token bad words never appear
    assert not banned & {t for o in outs for t in o.token_ids}
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


@cases
def test_logprobs_equal_plain_decodings(native_model, spec_config):
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=3, **(PENALTIES if b % 2 else {}))
              for b in range(len(PROMPTS))]
    plain = _llm(native_model).generate(PROMPTS, params)
    spec = _llm(native_model, spec_config).generate(PROMPTS, params)
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids and len(s.logprobs) == len(s.token_ids)
        for a, b in zip(p.logprobs, s.logprobs):
            assert (a.token_id, a.rank) == (b.token_id, b.rank) == (b.token_id, 1)  # greedy: the top token
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert abs(a.logprob - b.logprob) < 1e-4 and all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))
    assert sum(o.metrics.num_draft_tokens for o in spec) > 0


@pytest.mark.parametrize("shape", [{}, {"tree_topk": 2, "tree_num_nodes": 6}])
def test_logprobs_of_accepted_and_bonus_tokens_equal_plain_decodings(native_model, trained_drafters, shape):
    """The target drafting for itself (draft_model) and an EAGLE tree: most tokens are accepted
    drafts or bonus tokens, whose logprobs come from verification rows past the first."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2, **PENALTIES)
    plain = _llm(native_model).generate(PROMPTS, params)
    config = ({"method": "eagle", "model": str(trained_drafters["eagle"]), "num_speculative_tokens": 3, **shape}
              if shape else {"method": "draft_model", "model": str(native_model), "num_speculative_tokens": 3})
    spec = _llm(native_model, config).generate(PROMPTS, params)
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids
        assert all(abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]
                   for a, b in zip(p.logprobs, s.logprobs))
    if not shape:
        assert sum(o.metrics.num_accepted_tokens for o in spec) > 0.8 * sum(len(o.token_ids) - 1 for o in spec) / 2


@cases
def test_json_schema_output_always_parses_and_equals_plain(native_model, spec_config):
    constrained = StructuredOutputsParams(json=SCHEMA)
    greedy = SamplingParams(temperature=0, max_tokens=48, structured_outputs=constrained)
    plain = _llm(native_model).generate(PROMPTS, greedy)
    spec = _llm(native_model, spec_config).generate(PROMPTS, greedy)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    sampled = [SamplingParams(temperature=1.0, max_tokens=48, seed=s, structured_outputs=constrained) for s in range(4)]
    for out in spec + _llm(native_model, spec_config).generate(PROMPTS, sampled):
        assert out.finish_reason == "stop" and _matches_schema(out.text), out.text


@cases
def test_regex_output_always_matches_and_equals_plain(native_model, spec_config):
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=REGEX)),
              SamplingParams(temperature=0.8, max_tokens=24, seed=3, structured_outputs=StructuredOutputsParams(regex=REGEX),
                             **PENALTIES),
              SamplingParams(temperature=0, max_tokens=24, **PENALTIES),  # an unconstrained row in the same batch
              SamplingParams(temperature=1.0, max_tokens=24, seed=5, structured_outputs=StructuredOutputsParams(regex=REGEX))]
    spec = _llm(native_model, spec_config).generate(PROMPTS, params)
    plain = _llm(native_model).generate(PROMPTS, params)
    assert spec[0].token_ids == plain[0].token_ids and spec[2].token_ids == plain[2].token_ids
    for out in (spec[0], spec[1], spec[3]):
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text


def test_choice_and_grammar_constrain_every_path(native_model):
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    lark = 'start: "def " NAME "(" NAME ")"\nNAME: /[a-z]{1,6}/'
    gbnf = 'root ::= "x" [0-9] [0-9]?'
    for spec in (None, ngram):
        llm = _llm(native_model, spec)
        choice = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=1, max_tokens=12, structured_outputs={
            "choice": ["yes", "no", "maybe not"]}))
        assert all(o.text in ("yes", "no", "maybe not") for o in choice)
        tree = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, structured_outputs={"grammar": lark}))
        assert all(re.fullmatch(r"def [a-z]{1,6}\([a-z]{1,6}\)", o.text) for o in tree), [o.text for o in tree]
        small = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, structured_outputs={"grammar": gbnf}))
        assert all(re.fullmatch(r"x[0-9][0-9]?", o.text) for o in small), [o.text for o in small]
        json_object = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=64,
                                                                structured_outputs={"json_object": True}))[0]
        assert json_object.finish_reason == "length" or isinstance(json.loads(json_object.text), dict)


def test_bad_grammars_are_refused_before_anything_runs(native_model):
    llm = _llm(native_model)
    for spec, message in [({"regex": "(unclosed"}, "regex"), ({"json": "{not json"}, "not valid JSON"),
                          ({"grammar": "start: undefined_rule"}, "grammar"),
                          ({"json": {"type": "object", "properties": {"a": {"type": "nosuchtype"}}}}, "json")]:
        with pytest.raises(InvalidRequestError, match=message):
            llm.generate(PROMPTS[0], SamplingParams(structured_outputs=spec))
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={10 ** 6: 1.0}))
    assert not llm.has_unfinished()


def test_prompt_logprobs_are_the_models_raw_distribution(native_model):
    from specdecode.models.loader import load_model

    ids = PROMPTS[1]["prompt_token_ids"]
    out = _llm(native_model).generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2,
                                                                 logprobs=0))[0]
    model = load_model(native_model, torch.float32)
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), torch.arange(len(ids))[None]).hidden[0]
        expected = torch.log_softmax(model.compute_logits(hidden), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i, lp in enumerate(out.prompt_logprobs[1:], start=1):
        assert lp.token_id == ids[i] and abs(lp.logprob - float(expected[i - 1, ids[i]])) < 1e-4
        assert [t for t, _ in lp.top] == expected[i - 1].topk(2).indices.tolist()
    assert len(out.logprobs) == 2 and all(lp.top == [] for lp in out.logprobs)


def test_logprobs_are_bitwise_plain_decodings_in_exact_mode(native_model, native_drafter):
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=16, ignore_eos=True, logprobs=2, **PENALTIES)
              for s in range(4)]
    config = {"method": "draft_model", "model": str(native_drafter), "num_speculative_tokens": 3}
    plain = _llm(native_model, exact=True).generate(PROMPTS, params)
    spec = _llm(native_model, config, exact=True).generate(PROMPTS, params)
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids
        assert [(lp.token_id, lp.logprob, lp.rank, lp.top) for lp in s.logprobs] == \
               [(lp.token_id, lp.logprob, lp.rank, lp.top) for lp in p.logprobs]


CHI2_999_DF3 = 16.27


def _penalised_third_token_probs(model_dir, prompt: list[int], params: SamplingParams, allowed: list[int]) -> torch.Tensor:
    """[V] float64: the exact distribution of the third output token under the penalties, over
    paths of `allowed` tokens (logit_bias +100 on them leaves every other path below e^-90)."""
    from test_logit_adjust import reference

    from specdecode.models.loader import load_model

    model = load_model(model_dir, torch.float32)

    def dist(output: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            logits = model.compute_logits(model(ids, torch.arange(ids.shape[1])[None]).hidden[0, -1])
        return torch.softmax(reference(logits, params, prompt, output, []).double(), dim=-1)

    third = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    first = dist([])
    for t0 in allowed:
        second = dist([t0])
        for t1 in allowed:
            third += first[t0] * second[t1] * dist([t0, t1])
    return third


def test_penalised_sampling_keeps_the_target_distribution(native_model, native_drafter, monkeypatch):
    """The third token is decided at the first speculative step's second position, so its
    penalties must count the accepted draft token before it. Plain sampling calibrates the
    statistic; a speculator that forgets in-draft tokens (the committed output only, as a naive
    per-step penalty would) is detected."""
    allowed = [5, 17, 99, 42]
    params = dict(temperature=1.0, frequency_penalty=2.0, presence_penalty=1.0, repetition_penalty=1.3,
                  logit_bias={t: 100.0 for t in allowed})
    prompt = [8, 200, 31]
    exact = _penalised_third_token_probs(native_model, prompt, SamplingParams(**params), allowed)
    assert math.isclose(float(exact[allowed].sum()), 1.0, abs_tol=1e-9)
    seeds = [SamplingParams(max_tokens=3, seed=s, ignore_eos=True, **params) for s in range(3000)]
    config = {"method": "draft_model", "model": str(native_drafter), "num_speculative_tokens": 3}

    def third_tokens(speculative_config):
        outs = _llm(native_model, speculative_config, max_num_seqs=16).generate(
            [{"prompt_token_ids": prompt}] * len(seeds), seeds)
        return [o.token_ids[2] for o in outs], sum(o.metrics.num_accepted_tokens for o in outs)

    plain, _ = third_tokens(None)
    assert chi_square(plain, exact, buckets=4) < CHI2_999_DF3
    spec, accepted = third_tokens(config)
    assert accepted > 900 and chi_square(spec, exact, buckets=4) < CHI2_999_DF3
    from specdecode.speculative import speculator

    monkeypatch.setattr(speculator, "path_tokens", lambda tokens, parents=None: torch.full(
        (tokens.shape[0], tokens.shape[1] + 1, tokens.shape[1]), -1, dtype=torch.long))
    broken, _ = third_tokens(config)
    assert chi_square(broken, exact, buckets=4) > CHI2_999_DF3
