"""Logprobs, penalties and structured outputs through the HTTP API and the official `openai`
client, with speculation on: the same values as the offline engine's plain decoding."""

from __future__ import annotations

import json
import re

import pytest
from test_server import server_fixture

from specdecode import LLM, SamplingParams

spec_server = server_fixture(drafter=True)
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
          "required": ["ok", "color"], "additionalProperties": False}


@pytest.fixture(scope="module")
def offline(native_model):
    return LLM(native_model, dtype="float32")


def test_logprobs_through_the_openai_client_equal_offline_plain_decoding(spec_server, offline):
    client = spec_server.client()
    penalties = dict(presence_penalty=0.3, frequency_penalty=0.2)
    extra = {"repetition_penalty": 1.1, "bad_words": ["self"]}
    ref = offline.generate("def fib", SamplingParams(temperature=0, max_tokens=12, logprobs=3, repetition_penalty=1.1,
                                                     bad_words=["self"], **penalties))[0]
    out = client.completions.create(model="tiny", prompt="def fib", max_tokens=12, temperature=0, logprobs=3,
                                    extra_body=extra, **penalties)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == ref.text and len(lp.tokens) == len(ref.token_ids)
    assert lp.token_logprobs == pytest.approx([v.logprob for v in ref.logprobs], abs=1e-4)
    # {token text: logprob}: tokens whose text is the same (partial UTF-8 bytes) share a key, as in OpenAI's format
    assert all(1 <= len(top) <= 3 and token in top for token, top in zip(lp.tokens, lp.top_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    chat_ref = offline.generate(offline.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]),
                                SamplingParams(temperature=0, max_tokens=10, logprobs=2))[0]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([v.logprob for v in chat_ref.logprobs], abs=1e-4)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)  # greedy: top 1
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace") == chat.choices[0].message.content

    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                            temperature=0, logprobs=True, top_logprobs=2, stream=True)
    streamed = [c for chunk in stream for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)


def test_response_format_and_guided_fields_constrain_the_output(spec_server, offline):
    client = spec_server.client()
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "color?"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    value = json.loads(out.choices[0].message.content)
    assert set(value) == {"ok", "color"} and value["color"] in ("red", "green")
    ref = offline.generate(offline.tokenizer.apply_chat_template([{"role": "user", "content": "color?"}]),
                           SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": SCHEMA}))[0]
    assert out.choices[0].message.content == ref.text
    regex = client.completions.create(model="tiny", prompt="id:", max_tokens=12, temperature=1.0, seed=4,
                                      extra_body={"guided_regex": "[a-f]{3}[0-9]"})
    assert re.fullmatch("[a-f]{3}[0-9]", regex.choices[0].text)
    choice = client.completions.create(model="tiny", prompt="x", max_tokens=8, extra_body={"guided_choice": ["up", "down"]})
    assert choice.choices[0].text in ("up", "down")
    obj = client.completions.create(model="tiny", prompt="{", max_tokens=48, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].finish_reason == "length" or isinstance(json.loads(obj.choices[0].text), dict)


def test_prompt_logprobs_and_refusals(spec_server, offline):
    import httpx

    url = spec_server.url + "/v1/completions"
    r = httpx.post(url, json={"model": "tiny", "prompt": "def fib", "max_tokens": 2, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    prompt = r.json()["choices"][0]["prompt_logprobs"]
    ids = offline.tokenizer.encode("def fib")
    assert prompt[0] is None and len(prompt) == len(ids)
    assert all(str(t) in entry and entry[str(t)]["decoded_token"] == offline.tokenizer.token_text(t)
               for t, entry in zip(ids[1:], prompt[1:]))
    for body, param in [({"guided_regex": "(", "prompt": "a"}, None), ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
                        ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"99999": 1}}, "logit_bias"),
                        ({"response_format": {"type": "json_schema"}}, "response_format"), ({"presence_penalty": 5}, "presence_penalty"),
                        ({"n": 2}, "n")]:
        r = httpx.post(url, json={"model": "tiny", "prompt": "a", "max_tokens": 2, **body})
        assert r.status_code == 400, (body, r.text)
        assert param is None or r.json()["error"]["param"] == param, r.json()
    chat = spec_server.url + "/v1/chat/completions"
    r = httpx.post(chat, json={"model": "tiny", "messages": [{"role": "user", "content": "a"}], "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
