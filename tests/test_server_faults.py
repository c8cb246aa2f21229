"""Failure isolation and accounting: a request the engine fails (or a step that raises) fails
alone, streams never end without a finish reason or an error event, /health follows the
engine, gauges and the aborted counter follow disconnects, a full queue answers 503."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import time
import types

import httpx
import pytest
from test_server import PROMPTS, RunningServer, server_fixture, wait_idle

COMPLETIONS = "/v1/completions"
SENTINEL = "POISON"


spec_server = server_fixture(drafter=True)


small_server = server_fixture(max_num_seqs=2)


def metric(srv, name: str) -> float:
    total = 0.0
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith(f"specdecode:{name}"):
            total += float(line.split()[-1])
    return total


def wait_for(condition, timeout: float = 10, what: str = "condition") -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def slow_steps(monkeypatch, llm, seconds: float = 0.02) -> None:
    step = llm.step

    def slow():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(llm, "step", slow)


def bodies(poisoned: int | None = None) -> list[dict]:
    """16 greedy requests, even ones streamed; unique prompts (a prompt names its request)."""
    out = []
    for i in range(16):
        prompt = f"{PROMPTS[i % len(PROMPTS)]} {i}"
        if i == poisoned:
            prompt = f"{SENTINEL} {prompt}"
        out.append({"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": i % 2 == 0})
    return out


async def stream_raw(client: httpx.AsyncClient, body: dict) -> dict:
    """A streamed answer, checked event by event."""
    text, finish, error, done, usage = "", None, None, False, None
    async with client.stream("POST", COMPLETIONS, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ") and not done, line  # nothing after [DONE]
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
                continue
            assert error is None, "chunks after an error event"
            usage = chunk.get("usage", usage)
            for choice in chunk["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    assert done, "stream cut without [DONE]"
    assert (finish is not None and usage is not None) != (error is not None), "neither finished nor failed"
    return {"text": text, "finish_reason": finish, "error": error}


async def answer(client: httpx.AsyncClient, body: dict) -> dict:
    if body["stream"]:
        return await stream_raw(client, body)
    r = await client.post(COMPLETIONS, json=body)
    data = r.json()
    if r.status_code != 200:
        assert r.status_code == 500 and data["error"]["type"] == "server_error", r.text
        return {"text": None, "finish_reason": None, "error": data["error"]}
    choice = data["choices"][0]
    return {"text": choice["text"], "finish_reason": choice["finish_reason"], "error": None}


async def run_all(srv, requests: list[dict], openai_index: int | None = None) -> list:
    """Every request at once; request `openai_index` goes through the official openai client
    (streamed), whose result is the exception it raised (or None)."""
    import openai

    async def through_openai(body):
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        try:
            stream = await client.completions.create(**{k: v for k, v in body.items()})
            async for _ in stream:
                pass
        except openai.APIError as e:
            return e
        finally:
            await client.close()
        return None

    async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
        return await asyncio.gather(*[through_openai(b) if i == openai_index else answer(client, b)
                                      for i, b in enumerate(requests)])


def error_output(out, message: str):
    """`out` finished with finish_reason "error", as the engine reports a request it failed."""
    fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    fields.update(finished=True, finish_reason="error")
    if "error" in fields:
        return type(out)(**{**fields, "error": message})
    return types.SimpleNamespace(**fields, error=message)  # before RequestOutput had `error`


def clean_run(srv) -> list[dict]:
    return asyncio.run(run_all(srv, bodies()))


def test_an_engine_error_output_fails_only_its_stream(spec_server, monkeypatch):
    """The contract with the engine: a request it fails comes out finished with finish_reason
    "error". 16 concurrent requests, one poisoned and streamed through the openai client: the
    client raises for it, the other 15 equal a clean run, no stream is cut."""
    llm = spec_server.engine.llm
    clean = clean_run(spec_server)
    step = llm.step

    def poisoned_step():
        outputs = []
        for out in step():
            if out.prompt and SENTINEL in out.prompt:
                llm.abort(out.request_id)
                out = error_output(out, "RuntimeError: injected fault")
            outputs.append(out)
        return outputs

    monkeypatch.setattr(llm, "step", poisoned_step)
    failed_before = metric(spec_server, "request_failed_total")
    results = asyncio.run(run_all(spec_server, bodies(poisoned=4), openai_index=4))
    import openai

    assert isinstance(results[4], openai.APIError) and "injected fault" in results[4].message
    for i, result in enumerate(results):
        if i != 4:
            assert result == clean[i], i
    assert metric(spec_server, "request_failed_total") == failed_before + 1
    monkeypatch.undo()
    wait_idle(spec_server)
    assert httpx.get(spec_server.url + "/health").status_code == 200


def test_a_request_whose_forward_raises_fails_alone(spec_server, monkeypatch):
    """The same end to end through the engine: the target's forward raises whenever the
    poisoned (non-streamed) request is in it; the engine isolates it, the server answers it
    500 server_error, the other 15 equal a clean run."""
    from specdecode.engine.engine import RequestOutput

    if "error" not in {f.name for f in dataclasses.fields(RequestOutput)}:
        pytest.skip("the engine does not isolate a failing request yet (RequestOutput.error)")
    llm = spec_server.engine.llm
    clean = clean_run(spec_server)
    forward = llm.runner.forward

    def faulty_forward(entries, *args, **kwargs):
        poisoned = {s.slot for s in llm.scheduler.running if s.prompt and SENTINEL in s.prompt}
        if any(e.slot in poisoned for e in entries):
            raise RuntimeError("injected fault")
        return forward(entries, *args, **kwargs)

    monkeypatch.setattr(llm.runner, "forward", faulty_forward)
    results = asyncio.run(run_all(spec_server, bodies(poisoned=5)))
    assert results[5]["error"]["type"] == "server_error" and "injected fault" in results[5]["error"]["message"]
    for i, result in enumerate(results):
        if i != 5:
            assert result == clean[i], i
    assert spec_server.engine.failed_steps == 0  # the engine handled it: no step raised


def test_a_step_that_raises_fails_only_the_requests_of_that_step(spec_server, monkeypatch):
    """An engine bug: LLM.step raises (once, in the prefill that admits the poisoned request).
    Exactly the requests admitted in that step fail (500 / error event, then [DONE]); every
    other one equals a clean run; the engine goes on."""
    llm = spec_server.engine.llm
    clean = clean_run(spec_server)
    step = llm.step
    failed_prompts: set[str] = set()

    def buggy_step():
        admitted_next = list(llm.scheduler.waiting)[: len(llm.scheduler.free_slots)]
        if not failed_prompts and any(SENTINEL in (s.prompt or "") for s in admitted_next):
            batch = llm.scheduler.schedule()  # the bug strikes after admission
            failed_prompts.update(s.prompt for s in batch.prefill)
            raise RuntimeError("injected engine bug")
        return step()

    monkeypatch.setattr(llm, "step", buggy_step)
    failed_before = metric(spec_server, "request_failed_total")
    requests = bodies(poisoned=9)
    results = asyncio.run(run_all(spec_server, requests))
    assert any(SENTINEL in p for p in failed_prompts)
    for body, result, ref in zip(requests, results, clean):
        if body["prompt"] in failed_prompts:
            assert result["error"]["type"] == "server_error", result
        else:
            assert result == ref, body
    assert metric(spec_server, "request_failed_total") == failed_before + len(failed_prompts)
    assert spec_server.engine.failed_steps == 0 and spec_server.engine.health() is None
    wait_idle(spec_server)


def test_health_follows_consecutive_failed_steps(small_server, monkeypatch):
    llm, engine = small_server.engine.llm, small_server.engine

    def broken_step():
        llm.scheduler.schedule()
        raise RuntimeError("broken engine")

    monkeypatch.setattr(llm, "step", broken_step)
    body = {"model": "tiny", "prompt": "def f", "max_tokens": 3}
    for n in range(1, engine.max_failed_steps + 1):
        assert httpx.get(small_server.url + "/health").status_code == 200
        r = httpx.post(small_server.url + COMPLETIONS, json=body, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        assert engine.failed_steps == n
    r = httpx.get(small_server.url + "/health")
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "engine_unavailable" and "failed" in err["message"]
    monkeypatch.undo()
    assert httpx.post(small_server.url + COMPLETIONS, json=body, timeout=60).status_code == 200
    assert httpx.get(small_server.url + "/health").json() == {"status": "ok"}


def test_engine_stopped_or_dead(native_model):
    """A stream in flight when the engine stops ends with an error event and [DONE]; then
    /health and new requests answer 503. The same when the engine loop dies."""
    srv = RunningServer(model=str(native_model), max_num_seqs=2, served_model_name="tiny")
    try:
        step = srv.engine.llm.step
        srv.engine.llm.step = lambda: (time.sleep(0.02), step())[1]
        body = {"model": "tiny", "prompt": "def", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + COMPLETIONS, json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            srv.engine.shutdown()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "shutting down" in json.loads(rest[-2][6:])["error"]["message"]
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
        r = httpx.post(srv.url + COMPLETIONS, json={**body, "stream": False}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    finally:
        srv.stop()

    class Crash(BaseException):
        pass

    srv = RunningServer(model=str(native_model), max_num_seqs=1, served_model_name="tiny")
    try:
        def crash():
            raise Crash("engine loop bug")

        srv.engine.llm.has_unfinished = crash
        wait_for(lambda: not srv.engine.alive, what="the engine loop to die")
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and "Crash: engine loop bug" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_gauges_and_aborted_counter_follow_disconnects(small_server, monkeypatch):
    """5 long streams on 2 slots: the gauges show 2 running and 3 waiting; all 5 clients go
    away: the gauges go back to 0 and request_aborted_total counts 5; no success is counted."""
    slow_steps(monkeypatch, small_server.engine.llm)
    aborted, succeeded = metric(small_server, "request_aborted_total"), metric(small_server, "request_success_total")
    body = {"model": "tiny", "prompt": "def", "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def main():
        async with httpx.AsyncClient(base_url=small_server.url, timeout=60) as client:
            async with contextlib.AsyncExitStack() as stack:
                for _ in range(5):
                    await stack.enter_async_context(client.stream("POST", COMPLETIONS, json=body))
                await asyncio.to_thread(wait_for, lambda: (metric(small_server, "num_requests_running"),
                                                           metric(small_server, "num_requests_waiting")) == (2, 3),
                                        10, "2 running, 3 waiting")
            # all five connections are closed here

    asyncio.run(main())
    wait_for(lambda: metric(small_server, "request_aborted_total") == aborted + 5, what="5 aborts counted")
    wait_idle(small_server)
    assert metric(small_server, "num_requests_running") == metric(small_server, "num_requests_waiting") == 0
    assert metric(small_server, "request_success_total") == succeeded


def test_non_streaming_request_is_aborted_when_its_client_goes(small_server, monkeypatch):
    slow_steps(monkeypatch, small_server.engine.llm)  # 200 tokens take over 4 s
    aborted = metric(small_server, "request_aborted_total")
    body = {"model": "tiny", "prompt": "def", "max_tokens": 200, "ignore_eos": True}
    start = time.time()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(small_server.url + COMPLETIONS, json=body, timeout=httpx.Timeout(30, read=0.5))
    wait_for(lambda: metric(small_server, "request_aborted_total") == aborted + 1, timeout=3, what="the abort")
    wait_idle(small_server, timeout=3)
    assert time.time() - start < 3.5  # long before the request would have finished


def test_full_queue_answers_503_with_retry_after(native_model, monkeypatch):
    srv = RunningServer(model=str(native_model), max_num_seqs=1, max_waiting=1, served_model_name="tiny")
    try:
        slow_steps(monkeypatch, srv.engine.llm)
        body = {"model": "tiny", "prompt": "def", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            with client.stream("POST", COMPLETIONS, json=body), client.stream("POST", COMPLETIONS, json=body):
                wait_for(lambda: srv.engine.num_in_flight == 2, what="1 running + 1 waiting")
                r = httpx.post(srv.url + COMPLETIONS, json={**body, "stream": False})
                assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                assert r.json()["error"]["code"] == "server_busy" and "capacity" in r.json()["error"]["message"]
        wait_idle(srv)
        monkeypatch.undo()
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as slow, socket.create_connection((host, int(port))) as slower:
            for s in (slow, slower):  # bodies that never finish arriving take no place in the queue
                s.sendall(f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                          "Content-Length: 1000\r\n\r\n{".encode())
            time.sleep(0.2)
            r = httpx.post(srv.url + COMPLETIONS, json={**body, "stream": False, "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        srv.stop()
