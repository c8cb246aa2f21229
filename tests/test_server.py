"""The OpenAI-compatible server, driven by the official `openai` client over real HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from specdecode import LLM, SamplingParams
from specdecode.server.serve import BackgroundServer, create_server

PROMPTS = ["def fib", "class Stack:", "import os", "    return a", "for x in", "self.items"]


class RunningServer(BackgroundServer):
    def __init__(self, **kwargs):
        super().__init__(dtype="float32", log_interval=0.5, **kwargs)

    def client(self, api_key="none"):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)


def wait_idle(srv, timeout: float = 20) -> None:
    """Until the engine has no request and every KV slot is free (aborts apply between steps)."""
    deadline = time.time() + timeout
    while srv.engine.num_free_slots != srv.engine.llm.scheduler.num_slots or srv.engine.llm.has_unfinished():
        assert time.time() < deadline, "slots leaked"
        time.sleep(0.02)


def server_fixture(drafter: bool = False, **kwargs):
    """A module-scoped fixture: a RunningServer on the native test model, served as "tiny";
    `drafter`: with the draft-model drafter (3 tokens) and 8 slots."""

    @pytest.fixture(scope="module")
    def fixture(request, native_model):
        options = dict(kwargs)
        if drafter:
            config = {"method": "draft_model", "model": str(request.getfixturevalue("native_drafter")),
                      "num_speculative_tokens": 3}
            options = {"speculative_config": json.dumps(config), "max_num_seqs": 8, **options}
        srv = RunningServer(model=str(native_model), served_model_name="tiny", **options)
        yield srv
        srv.stop()

    return fixture


plain_server = server_fixture(max_num_seqs=4)
spec_server = server_fixture(drafter=True)


@pytest.fixture(scope="module")
def offline(native_model):
    llm = LLM(native_model, dtype="float32")

    def run(prompt, max_tokens=16):
        return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0]

    return run


@pytest.mark.parametrize("server_name", ["plain_server", "spec_server"])
def test_completion_chat_and_stream_equal_offline_greedy(request, server_name, offline):
    srv = request.getfixturevalue(server_name)
    client = srv.client()
    ref = offline(PROMPTS[0])
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0)
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert "spec_decode" in out.model_extra
    # Token-id prompts.
    by_ids = client.completions.create(model="tiny", prompt=ref.prompt_token_ids, max_tokens=16, temperature=0)
    assert by_ids.choices[0].text == ref.text
    # Streaming: the deltas add up to the same text.
    stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == ref.text
    # Chat: the model's template, then the same greedy decoding.
    chat_prompt = srv.engine.llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    chat_ref = offline(chat_prompt)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=16,
                                          temperature=0)
    assert chat.choices[0].message.content == chat_ref.text
    chat_stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices) == chat_ref.text
    assert [m.id for m in client.models.list().data] == ["tiny"]


@pytest.mark.parametrize("path, extra", [("/v1/completions", {"prompt": PROMPTS[1]}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_stream_and_answer_shapes(spec_server, path, extra):
    """Byte-level SSE: `data: <json>` events, one choice each, the chat role on the first chunk
    only, the finish reason on the last one, then usage and spec_decode without choices, then
    [DONE]; the whole answer has the same id prefix and figures."""
    chat = "messages" in extra
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "stop": ["ab"], **extra}
    whole = httpx.post(spec_server.url + path, json=body, timeout=60).json()
    r = httpx.post(spec_server.url + path, json={**body, "stream": True}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])
    chunks = [json.loads(e[6:]) for e in events[:-2]]
    assert r.text == "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    *content, last = chunks
    prefix, obj = ("chatcmpl-", "chat.completion.chunk") if chat else ("cmpl-", "text_completion")
    assert content and {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith(prefix)
    assert {(c["object"], c["created"], c["model"]) for c in chunks} == {(obj, chunks[0]["created"], "tiny")}
    assert all(len(c["choices"]) == 1 and c["choices"][0]["index"] == 0 for c in content)
    reasons = [c["choices"][0]["finish_reason"] for c in content]
    assert reasons[:-1] == [None] * (len(content) - 1) and reasons[-1] == whole["choices"][0]["finish_reason"]
    if chat:
        deltas = [c["choices"][0]["delta"] for c in content]
        assert deltas[0].keys() == {"role", "content"} and deltas[0]["role"] == "assistant"
        assert all(d.keys() == {"content"} for d in deltas[1:])
        text = "".join(d["content"] for d in deltas)
        assert whole["object"] == "chat.completion" and whole["choices"][0]["message"] == {"role": "assistant",
                                                                                          "content": text}
    else:
        assert all(c["choices"][0].keys() == {"index", "text", "logprobs", "finish_reason"} for c in content)
        text = "".join(c["choices"][0]["text"] for c in content)
        assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == text
    assert whole["id"].startswith(prefix) and whole["id"] != chunks[0]["id"]
    assert last.keys() == {"id", "object", "created", "model", "choices", "usage", "spec_decode"} and last["choices"] == []
    assert last["usage"] == whole["usage"] and last["usage"]["completion_tokens"] >= 1
    assert last["spec_decode"].keys() == whole["spec_decode"].keys() >= {"num_drafts", "acceptance_rate"}


def test_concurrent_requests_disconnects_and_metrics(spec_server, offline):
    srv = spec_server

    async def one(client, i):
        prompt = PROMPTS[i % len(PROMPTS)]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": i % 3 == 0}
        if body["stream"]:
            text, stats = "", None
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        text += "".join(c["text"] for c in chunk["choices"])
                        stats = chunk.get("spec_decode", stats)
            return prompt, text, stats
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        return prompt, data["choices"][0]["text"], data["spec_decode"]

    async def disconnect(client):
        body = {"model": "tiny", "prompt": "def", "max_tokens": 200, "temperature": 0, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for _ in r.aiter_lines():
                break  # go away mid-stream

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
            results = await asyncio.gather(*[one(client, i) for i in range(32)], *[disconnect(client) for _ in range(4)])
        return results[:32]

    results = asyncio.run(main())
    stats_sum = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    for prompt, text, stats in results:
        assert text == offline(prompt, 24).text
        for key in stats_sum:
            stats_sum[key] += stats[key]
    wait_idle(srv)  # aborted requests free their slots
    metrics = httpx.get(srv.url + "/metrics").text
    counted = {}
    for line in metrics.splitlines():
        for key in stats_sum:
            if line.startswith(f"specdecode:spec_decode_{key}_total"):
                counted[key] = float(line.split()[-1])
    # The counters also saw the aborted requests' steps: at least the finished ones' stats.
    for key, value in stats_sum.items():
        assert counted[key] >= value
    assert 'specdecode:request_success_total{finished_reason="length",model_name="tiny"} ' in metrics
    assert "specdecode:time_to_first_token_seconds_bucket" in metrics
    assert "specdecode:spec_decode_num_accepted_tokens_per_pos_total" in metrics


def test_metrics_counters_equal_response_stats_exactly(native_model, native_drafter):
    config = {"method": "draft_model", "model": str(native_drafter), "num_speculative_tokens": 2}
    srv = RunningServer(model=str(native_model), speculative_config=config, max_num_seqs=2, served_model_name="tiny")
    try:
        totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        for prompt in PROMPTS[:3]:
            data = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 20,
                                                                 "temperature": 0}, timeout=60).json()
            for key in totals:
                totals[key] += data["spec_decode"][key]
        metrics = httpx.get(srv.url + "/metrics").text
        for key, value in totals.items():
            line = next(l for l in metrics.splitlines() if l.startswith(f"specdecode:spec_decode_{key}_total"))
            assert float(line.split()[-1]) == value
    finally:
        srv.stop()


@pytest.mark.parametrize("body, status, fragment", [
    ("{not json", 400, "not valid JSON"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 10_000}, 400, "context length"),
    ({"model": "tiny", "prompt": list(range(3, 300)), "max_tokens": 4}, 400, "context is 256"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x", "n": 3}, 400, "n=1"),
    ({"model": "tiny", "prompt": [5, 999]}, 400, "[0, 320)"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "messages": []}, 400, "messages"),
])
def test_errors_are_openai_json(plain_server, body, status, fragment):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(plain_server.url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"]
    # ... and the server keeps serving.
    ok = httpx.post(plain_server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_api_key(native_model):
    srv = RunningServer(model=str(native_model), max_num_seqs=1, api_key="sekret", served_model_name="tiny")
    try:
        r = httpx.get(srv.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert srv.client("sekret").models.list().data[0].id == "tiny"
        assert httpx.get(srv.url + "/health").status_code == 200  # not under /v1
    finally:
        srv.stop()


def test_bad_speculative_config_fails_at_startup(native_model):
    from specdecode.errors import ConfigError

    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        create_server(model=str(native_model), speculative_config='{"method": "ngram", "num_speculative_tokens": -1}')


exact_spec_server = server_fixture(drafter=True, exact=True)


def test_exact_server_reproduces_seeded_plain_decoding(exact_spec_server, native_model):
    """Exact mode through the API: a seeded, sampled completion from the speculative server equals
    plain decoding of the same request offline in exact mode, token for token."""
    llm = LLM(native_model, dtype="float32", exact=True)
    client = exact_spec_server.client()
    for i, prompt in enumerate(PROMPTS[:3]):
        ref = llm.generate(prompt, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=40 + i))[0]
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=1.0, top_p=0.9,
                                        seed=40 + i)
        assert out.choices[0].text == ref.text


def test_serve_freezes_the_start_up_heap_before_serving(native_model, monkeypatch):
    """`specdecode serve` owns its process: what start-up built is frozen, so the collector's full
    passes do not walk it while streams wait."""
    import gc

    import uvicorn

    from specdecode.server import serve as serve_module

    frozen = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: frozen.append(gc.get_freeze_count()))
    gc.unfreeze()
    try:
        serve_module.serve("127.0.0.1", 0, model=str(native_model), max_num_seqs=1)
    finally:
        gc.unfreeze()
    assert len(frozen) == 1 and frozen[0] > 10_000
