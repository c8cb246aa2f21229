"""The server's request handling: every error OpenAI-shaped and naming its field, refused
parameters, text-part content, the default max_tokens, the cheap prompt-length bound, and a
fuzz suite of hostile bodies for both endpoints (no 5xx, every error OpenAI-shaped)."""

from __future__ import annotations

import collections
import json

import httpx
import pytest
from test_server import server_fixture, wait_idle

from specdecode.server.protocol import UNSUPPORTED, ChatCompletionRequest, CompletionRequest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER_HI = [{"role": "user", "content": "hi"}]


server = server_fixture(max_num_seqs=4)


def assert_openai_error(r: httpx.Response) -> dict:
    body = r.json()
    assert body.keys() == {"error"}, body
    err = body["error"]
    assert err.keys() == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)
    for jargon in ("Input should be", "Field required", "Extra inputs", "Value error", "detail"):
        assert jargon not in err["message"], err
    return err


def post(srv, path, body, headers=None, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(srv.url + path, content=content, timeout=60,
                      headers={"content-type": "application/json", **(headers or {})}, **kw)


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "def f", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": USER_HI, "max_tokens": 2, **fields}


@pytest.mark.parametrize("path, body, status, param, fragment", [
    # the body itself
    (COMPLETIONS, b"", 400, None, "body is empty"),
    (COMPLETIONS, b"   ", 400, None, "body is empty"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None, "not valid UTF-8"),
    (COMPLETIONS, "[]", 400, None, "must be a JSON object"),
    (COMPLETIONS, '"text"', 400, None, "must be a JSON object"),
    (COMPLETIONS, '{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, None, "NaN is not a JSON number"),
    (COMPLETIONS, '{"model": "tiny", "prompt": "x", "temperature": 1e999}', 400, "temperature", "finite"),
    (COMPLETIONS, '{"model": "tiny", "prompt": "x", "seed": ' + "9" * 5000 + "}", 400, None, "not valid JSON"),
    (COMPLETIONS, '{"model": "tiny", "prompt": "x", "stop": ' + "[" * 100 + "]" * 100 + "}", 400, "stop[0]",
     "stop[0] must be a string, got an array"),
    (COMPLETIONS, '{"model": "tiny", "prompt": "x", "bogus": ' + "[" * 500 + "]" * 500 + "}", 400, "bogus",
     "not a supported parameter"),
    (COMPLETIONS, completion(prompt=[7] * 300), 400, "prompt", "prompt has 300 items, more than fit: this model's context is 256"),
    (COMPLETIONS, completion(prompt=[[7] * 300]), 400, "prompt[0]", "prompt[0] has 300 items"),
    (COMPLETIONS, completion(stop_token_ids=[7] * 300), 400, "stop_token_ids", "300 items"),
    (CHAT, chat(messages=USER_HI * 257), 400, "messages", "257 items"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 257}]), 400,
     "messages[0].content", "257 items"),
    (COMPLETIONS, "[" * 100000 + "]" * 100000, 400, None, "too deeply"),
    (COMPLETIONS, '{"model": "tiny", "prompt": "x", "max_tokens": 2, "stop": "\\ud800"}', 400, "stop", "surrogate"),
    (CHAT, json.dumps(chat(messages=[{"role": "user", "content": "a\ud800"}])), 400, "messages[0].content", "surrogate"),
    # fields
    (COMPLETIONS, {"model": "tiny"}, 400, "prompt", "prompt is required"),
    (COMPLETIONS, {"prompt": "x"}, 400, "model", "model is required"),
    (COMPLETIONS, completion(prompt=[1.5]), 400, "prompt[0]", "prompt[0] must be an integer, got 1.5"),
    (COMPLETIONS, completion(prompt=[True]), 400, "prompt", "array of token ids"),
    (COMPLETIONS, completion(prompt={"a": 1}), 400, "prompt", "must be a string"),
    (COMPLETIONS, completion(prompt=["a", "b"]), 400, "prompt", "one prompt per request"),
    (COMPLETIONS, completion(max_tokens="ten"), 400, "max_tokens", "max_tokens must be an integer, got a string"),
    (COMPLETIONS, completion(max_tokens=0), 400, "max_tokens", "max_tokens must be >= 1"),
    (COMPLETIONS, completion(temperature="inf"), 400, "temperature", "temperature must be a number"),
    (COMPLETIONS, completion(temperature=True), 400, "temperature", "must be a number, got true"),
    (COMPLETIONS, completion(top_k=9223372036854775808), 400, "top_k", "top_k"),
    (COMPLETIONS, completion(seed=2 ** 64), 400, "seed", "seed"),
    (COMPLETIONS, completion(stop=5), 400, "stop", "stop must be a string or an array of strings"),
    (COMPLETIONS, completion(stop=["ok", 5]), 400, "stop[1]", "stop[1] must be a string"),
    (COMPLETIONS, completion(stream="yes"), 400, "stream", "stream must be true or false"),
    (COMPLETIONS, completion(bogus=1), 400, "bogus", "bogus is not a supported parameter"),
    (COMPLETIONS, completion(model="gpt-9"), 404, "model", "does not exist"),
    (COMPLETIONS, completion(prompt=list(range(3, 259)), max_tokens=None), 400, "prompt", "context is 256"),
    (COMPLETIONS, completion(max_tokens=10_000), 400, "max_tokens", "ask for at most"),
    (COMPLETIONS, completion(stream_options={"include_usage": True, "x": 1}), 400, "stream_options.x", "not a supported"),
    (CHAT, chat(messages=[]), 400, "messages", "at least 1"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role", "must be one of"),
    (CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content", "messages[0].content is required"),
    (CHAT, chat(messages=[{"role": "user", "content": None}]), 400, "messages[0].content", "array of text parts"),
    (CHAT, chat(messages=[{"role": "user", "content": "x", "tool_calls": []}]), 400, "messages[0].tool_calls",
     "not a supported field"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, "messages[0].content[1]", "type 'image_url'"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400, "messages[0].content[0].text",
     "is required"),
    (CHAT, chat(messages=[{"role": "user", "content": []}]), 400, "messages[0].content", "at least 1"),
    (CHAT, chat(max_tokens=3, max_completion_tokens=4), 400, "max_completion_tokens", "differ"),
    (CHAT, chat(max_completion_tokens=10_000, max_tokens=None), 400, "max_completion_tokens", "ask for at most"),
])
def test_errors_name_their_field(server, path, body, status, param, fragment):
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if v is not None}
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = assert_openai_error(r)
    assert fragment in err["message"], err
    assert err["param"] == param, err


@pytest.mark.parametrize("name, value", [
    ("echo", True), ("suffix", "tail"), ("best_of", 2), ("n", 2), ("n", True),
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
    ("parallel_tool_calls", "x"), ("functions", [{"name": "f"}]), ("function_call", "auto"),
])
def test_unimplemented_parameters_are_refused_by_name(server, name, value):
    schemas = [s for s in (CompletionRequest, ChatCompletionRequest) if name in s.model_fields]
    assert schemas and name in UNSUPPORTED
    for schema in schemas:
        path, body = (COMPLETIONS, completion()) if schema is CompletionRequest else (CHAT, chat())
        r = post(server, path, {**body, name: value})
        assert r.status_code == 400, r.text
        err = assert_openai_error(r)
        assert err["param"] == name and name.split("_")[0] in err["message"], err


@pytest.mark.parametrize("fields", [
    dict(echo=False, suffix="", best_of=1, n=1, presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1,
         logit_bias={}, logprobs=None, user="u-1", stream_options={"include_usage": True}),
    dict(n=None, echo=None, top_k=-1, seed=0, stop=[], stop_token_ids=[], ignore_eos=False),
])
def test_neutral_values_of_unimplemented_parameters_are_accepted(server, fields):
    r = post(server, COMPLETIONS, completion(**fields))
    assert r.status_code == 200, r.text
    chat_fields = {k: v for k, v in fields.items() if k in ChatCompletionRequest.model_fields}
    r = post(server, CHAT, chat(**{**chat_fields, "logprobs": False}, tools=[], tool_choice="none",
                               response_format={"type": "text"}))
    assert r.status_code == 200, r.text


def test_text_parts_are_chat_content(server):
    """[{"type": "text", ...}, ...] is the text parts joined by newlines (as vLLM does)."""
    joined = post(server, CHAT, chat(messages=[{"role": "user", "content": "a\nb"}], max_tokens=6, temperature=0))
    parts = post(server, CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                            {"type": "text", "text": "b"}]}],
                                    max_tokens=6, temperature=0))
    assert parts.status_code == joined.status_code == 200, parts.text
    assert parts.json()["choices"][0]["message"] == joined.json()["choices"][0]["message"]
    assert parts.json()["usage"] == joined.json()["usage"]


def test_routes_and_methods_outside_the_api_are_openai_errors(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "GET /v1/nothing" in assert_openai_error(r)["message"]
    r = httpx.get(server.url + COMPLETIONS)
    assert r.status_code == 405 and "POST" in assert_openai_error(r)["message"] and "POST" in r.headers["allow"]
    r = post(server, COMPLETIONS, json.dumps(completion()), headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "application/json" in assert_openai_error(r)["message"]
    r = httpx.post(server.url + COMPLETIONS, content=json.dumps(completion()))  # no content type: JSON anyway
    assert r.status_code == 200, r.text
    r = post(server, COMPLETIONS, b"x" * (3 * 2 ** 20))  # over the default 2 MiB
    assert r.status_code == 413 and assert_openai_error(r)["code"] == "request_too_large"


def test_default_max_tokens_is_whatever_fits(server):
    """No max_tokens: as vLLM, max_model_len - prompt tokens; an error never shows a default."""
    r = post(server, COMPLETIONS, {"model": "tiny", "prompt": "def f", "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    usage, choice = r.json()["usage"], r.json()["choices"][0]
    assert usage["total_tokens"] == server.engine.llm.max_model_len and choice["finish_reason"] == "length"
    r = post(server, COMPLETIONS, {"model": "tiny", "prompt": list(range(3, 258))})  # 255 tokens: room for one
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
    r = post(server, COMPLETIONS, {"model": "tiny", "prompt": list(range(3, 259))})  # 256 tokens: none
    assert r.status_code == 400 and "max_tokens" not in assert_openai_error(r)["message"]


def test_prompt_too_long_for_any_tokenisation_is_refused_before_tokenising(server):
    llm = server.engine.llm
    bound = llm.tokenizer.max_text_bytes(llm.max_model_len - 1)
    assert bound is not None
    r = post(server, COMPLETIONS, completion(prompt="x" * (bound + 1)))
    err = assert_openai_error(r)
    assert r.status_code == 400 and err["param"] == "prompt" and "too long" in err["message"]
    r = post(server, CHAT, chat(messages=[{"role": "user", "content": "é" * bound}]))
    err = assert_openai_error(r)
    assert r.status_code == 400 and err["param"] == "messages" and "too long" in err["message"]


def test_max_text_bytes_bounds_every_tokenisation(native_model):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from specdecode.tokenizer import Tokenizer

    tok = Tokenizer(native_model)
    specials = st.sampled_from(["<|endoftext|>", "<|pad|>", "<|mask|>", " ", "\n", "def ", "é", "\U0001d400"])
    texts = st.lists(st.one_of(st.text(st.characters(exclude_categories=["Cs"]), max_size=30), specials), max_size=30)

    @settings(max_examples=200, deadline=None, database=None)
    @given(parts=texts)
    def check(parts):
        text = "".join(parts)
        n = len(tok.encode(text))
        assert len(text.encode("utf-8")) <= tok.max_text_bytes(n)

    check()


def test_max_text_bytes_is_none_where_no_bound_holds():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, pre_tokenizers

    from specdecode.tokenizer import _bytes_per_token

    wordpiece = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    assert _bytes_per_token(wordpiece) is None  # drops whitespace; one [UNK] for any unknown word
    bpe = HFTokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    assert _bytes_per_token(bpe) == 2
    bpe.normalizer = normalizers.NFKC()
    assert _bytes_per_token(bpe) == 8  # NFKC can turn a 4-byte character into one byte
    bpe.normalizer = normalizers.Strip()
    assert _bytes_per_token(bpe) is None


def test_openapi_documents_the_request_bodies(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    body = spec["paths"][COMPLETIONS]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    schemas = spec["components"]["schemas"]
    assert {"prompt", "max_tokens", "echo"} <= schemas["CompletionRequest"]["properties"].keys()
    assert "messages" in schemas["ChatCompletionRequest"]["properties"] and "ChatMessage" in schemas


# ---- fuzz ---------------------------------------------------------------------------------------

HUGE_INTS = [0, 1, 2, 3, -1, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -(2 ** 63) - 1, 10 ** 40]
ODD_STRINGS = ["", "inf", "-inf", "nan", "NaN", "Infinity", "1e999", "tiny", "text", "\x00", "\ud800", "a\udfffb",
               "<|endoftext|>", "x" * 3000, "é" * 500]


def _strategies():
    from hypothesis import strategies as st

    scalar = st.one_of(st.none(), st.booleans(), st.sampled_from(HUGE_INTS), st.integers(-5, 400),
                       st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([float("nan"), float("inf")]),
                       st.sampled_from(ODD_STRINGS), st.text(max_size=12))
    junk = st.recursive(scalar, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids,
                                                                                              max_size=4), max_leaves=10)
    small = st.integers(1, 3)
    part = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}),
                     st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "", 3]),
                                            "image_url": junk}),
                     junk)
    message = st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "x", 1]),
                               "content": st.one_of(st.text(max_size=20), st.lists(part, max_size=3), junk)},
                              optional={"name": st.one_of(st.text(max_size=5), junk), "extra": junk}),
        junk)
    plausible = {
        "model": st.sampled_from(["tiny", "tiny", "other", ""]),
        "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-2, 400), max_size=8),
                            st.lists(st.lists(st.integers(0, 319), max_size=4), max_size=2),
                            st.lists(st.text(max_size=5), max_size=2)),
        "messages": st.lists(message, max_size=3),
        "max_tokens": small, "max_completion_tokens": small,
        "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "top_k": st.integers(-2, 400),
        "seed": st.integers(-5, 2 ** 64 + 5),
        "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=70)),
        "stop_token_ids": st.lists(st.integers(-1, 400), max_size=4),
        "stream": st.booleans(), "ignore_eos": st.booleans(),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(), "x": junk}),
        "n": small, "logprobs": st.one_of(st.booleans(), small), "top_logprobs": small,
        "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
        "repetition_penalty": st.floats(-1, 3), "min_p": st.floats(-1, 2),
        "logit_bias": st.dictionaries(st.one_of(st.text(max_size=3), st.integers(-2, 400).map(str)),
                                      st.floats(-200, 200), max_size=3),
        "bad_words": st.lists(st.text(max_size=4), max_size=3),
        "response_format": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "x"])}),
                                     st.just({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "boolean"}}})),
        "guided_regex": st.sampled_from(["[ab]{1,3}", "(", ""]), "guided_choice": st.lists(st.text(max_size=3), max_size=3),
        "guided_json": st.sampled_from([{"type": "boolean"}, "{", {"type": "nosuch"}]),
        "guided_grammar": st.sampled_from(['start: "a"', "root ::= [0-9]", "start: nope", ""]),
    }

    plausible.update({name: st.sampled_from([None, *neutral]) for name, (neutral, _) in UNSUPPORTED.items()
                      if name not in plausible})

    def body(schema, base):
        keys = sorted(schema.model_fields) + ["unknown_field", "Model", "prompt_token_ids"]
        field = st.sampled_from(keys).flatmap(
            lambda k: st.tuples(st.just(k), st.one_of(plausible[k], plausible[k], junk) if k in plausible else junk))
        return st.lists(field, max_size=5).map(lambda kv: {**base, **dict(kv)})

    return (body(CompletionRequest, {"model": "tiny", "max_tokens": 2, "prompt": "def f"}),
            body(ChatCompletionRequest, {"model": "tiny", "max_tokens": 2, "messages": USER_HI}))



def _check_answer(r: httpx.Response, body) -> None:
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert_openai_error(r)
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]", (body, r.text)
        payloads = [json.loads(e[6:]) for e in events[:-1]]
        ended = [p for p in payloads if "usage" in p or "error" in p]
        assert len(ended) == 1, (body, r.text)
        if "error" in ended[0]:
            assert ended[0]["error"]["type"] == "invalid_request_error", (body, r.text)
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), (body, r.text)


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_fuzzed_bodies_never_get_5xx(server, endpoint):
    """Bodies built from the request schema's fields with plausible and hostile values (huge
    ints, NaN / Infinity, numbers and keywords as strings, wrong types, nested junk, lone
    surrogates, long strings): every answer is 2xx or an OpenAI-shaped 4xx, and a stream ends
    in [DONE] after its usage chunk or an error event."""
    from hypothesis import HealthCheck, given, settings

    completion_bodies, chat_bodies = _strategies()
    statuses = collections.Counter()

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(body=completion_bodies if endpoint == COMPLETIONS else chat_bodies)
    def check(body):
        content = json.dumps(body)  # NaN / inf go out as the non-standard tokens NaN / Infinity
        r = post(server, endpoint, content)
        _check_answer(r, body)
        statuses[r.status_code] += 1

    check()
    print(endpoint, dict(statuses))
    assert statuses[200] and statuses[400]  # both valid and refused bodies were sent
    wait_idle(server)  # ... and the server is still whole: every slot free, a plain request answered
    assert post(server, COMPLETIONS, completion()).status_code == 200


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_forbidden_tokens_and_overflowed_logits_are_json_numbers(server, endpoint, stream):
    """A token the row's grammar forbids has logprob -inf, and a repetition_penalty of 1e-245 divides
    a seen token's logit into inf (its distribution's logprobs NaN): found by the fuzz suite as a 500,
    neither value being JSON. They go out as -9999.0 (vLLM's floor)."""
    asks = {"logprobs": 5} if endpoint == COMPLETIONS else {"logprobs": True, "top_logprobs": 5}
    make = completion if endpoint == COMPLETIONS else chat
    for fields in ({"repetition_penalty": 1e-245, "prompt": "def f(f"} if endpoint == COMPLETIONS
                   else {"repetition_penalty": 1e-245}, {"guided_choice": ["yes", "no"]}):
        r = post(server, endpoint, make(stream=stream, **asks, **fields))
        assert r.status_code == 200, r.text
        texts = [e[6:] for e in r.text.split("\n\n") if e and e != "data: [DONE]"] if stream else [r.text]

        def strict(token):
            raise AssertionError(f"{token} is not JSON: {r.text}")

        payloads = [json.loads(t, parse_constant=strict) for t in texts]
        values = json.dumps(payloads)
        assert "logprob" in values
        if "guided_choice" in fields:
            assert "-9999.0" in values  # the forbidden tokens among the top 5 (can fail)
