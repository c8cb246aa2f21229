"""OpenAI-compatible HTTP API on FastAPI: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics.

A request passes the Guard (API key, body size: guard.py), has its body read, takes a place
among `max_num_seqs + max_waiting` (else 503 with Retry-After), and is prepared in the
engine's thread pool, off the event loop: parsed and validated (protocol.py), templated,
length-checked cheaply, tokenised. Then the engine runs it. Every error is OpenAI-style JSON
(`{"error": {"message", "type", "param", "code"}}`); nothing leaks a traceback; a stream that
fails ends with an error event and [DONE], and no request's failure reaches another.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import re
import time
import uuid

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode.config import SamplingParams, StructuredOutputsParams
from specdecode.engine.engine import RequestOutput
from specdecode.errors import SpecDecodeError
from specdecode.server.async_engine import AsyncEngine, EngineBusy, EngineUnavailable, RequestFailed
from specdecode.server.guard import Guard
from specdecode.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, check_sizes, error_body,
                                        parse_body, request_schema, validate)
from specdecode.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 2 * 2 ** 20
DISCONNECT_POLL_SECONDS = 0.25  # how often a non-streaming request checks that its client is still there
# Request fields passed to SamplingParams when the client sent them (their names are the same).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "min_p",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "bad_words")
_INVALID_KEY = re.compile(r"invalid (\w+)")


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(message, type_, param, code), headers=headers)


def _spec_stats(out: RequestOutput) -> dict:
    m = out.metrics
    return {"num_drafts": m.num_drafts, "num_draft_tokens": m.num_draft_tokens, "num_accepted_tokens": m.num_accepted_tokens,
            "acceptance_rate": round(m.acceptance_rate, 4), "mean_acceptance_length": round(m.mean_acceptance_length, 4),
            "accepted_per_position": m.accepted_per_position}


def _usage(out: RequestOutput) -> dict:
    n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def _body(base: dict, choices: list[dict], out: RequestOutput) -> dict:
    """A response with the finished request's usage and speculative-decoding figures: the whole
    answer, or the last chunk of a stream (no choices)."""
    return {**base, "choices": choices, "usage": _usage(out), "spec_decode": _spec_stats(out)}


class _Shape:
    """What one endpoint takes and what its answers look like; everything else (admission,
    preparation, streaming, the final usage chunk, [DONE], aborts, errors) is shared."""

    id_prefix: str
    object: str  # of the whole answer
    chunk_object: str  # of a streamed chunk
    schema: type  # the request body
    prompt_field: str  # the field errors about the prompt name

    @staticmethod
    def prompt(req, tokenizer) -> str | dict:
        """The engine prompt: text, or {"prompt_token_ids": [...]}."""
        raise NotImplementedError

    @staticmethod
    def max_tokens(req) -> tuple[int | None, str]:
        """(the max_tokens the client asked for, or None; the field it came in)."""
        return req.max_tokens, "max_tokens"

    @staticmethod
    def num_logprobs(req) -> int | None:
        """SamplingParams.logprobs for this request (None: not asked)."""
        raise NotImplementedError

    @staticmethod
    def choice(text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
        """The choice of the whole answer (logprobs: this shape's logprobs object, or None)."""
        raise NotImplementedError

    @staticmethod
    def chunk_choice(text: str, finish_reason: str | None, first: bool, logprobs: dict | None) -> dict:
        """The choice of a streamed chunk; `first`: the stream's first chunk."""
        raise NotImplementedError

    @staticmethod
    def logprobs(tokenizer, values: list, text_offset: int) -> dict:
        """This shape's logprobs object for some output tokens (text_offset: where their text starts)."""
        raise NotImplementedError


# JSON has no -inf or NaN: a token the row's grammar or filters forbid has logprob -inf, and a distribution
# whose processed logits overflowed (a repetition_penalty of 1e-245 divides a logit into inf) has NaN ones.
# They go out as vLLM's floor for -inf.
LOGPROB_FLOOR = -9999.0


def _json_logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def _completion_prompt(prompt) -> str | dict:
    if isinstance(prompt, str):
        return prompt
    if not prompt or isinstance(prompt[0], int):
        return {"prompt_token_ids": list(prompt)}
    if len(prompt) == 1:  # a batch of one
        return _completion_prompt(prompt[0])
    raise APIError(400, f"prompt holds a batch of {len(prompt)} prompts; send one prompt per request (a string or "
                   "an array of token ids)", param="prompt")


class _Completion(_Shape):
    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"
    schema, prompt_field = CompletionRequest, "prompt"

    @staticmethod
    def prompt(req, tokenizer):
        return _completion_prompt(req.prompt)

    @staticmethod
    def num_logprobs(req):
        return req.logprobs

    @staticmethod
    def choice(text, finish_reason, logprobs):
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    @staticmethod
    def chunk_choice(text, finish_reason, first, logprobs):
        return _Completion.choice(text, finish_reason, logprobs)

    @staticmethod
    def logprobs(tokenizer, values, text_offset):
        """The legacy completions shape: parallel lists, top_logprobs as {token text: logprob}."""
        tokens, offsets = [], []
        for v in values:
            tokens.append(tokenizer.token_text(v.token_id))
            offsets.append(text_offset)
            text_offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [_json_logprob(v.logprob) for v in values],
                "top_logprobs": [{tokenizer.token_text(t): _json_logprob(lp) for t, lp in v.top} for v in values],
                "text_offset": offsets}


class _ChatCompletion(_Shape):
    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"
    schema, prompt_field = ChatCompletionRequest, "messages"

    @staticmethod
    def prompt(req, tokenizer):
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name is not None else {})}
                    for m in req.messages]
        try:
            return tokenizer.apply_chat_template(messages)
        except jinja2.TemplateError as e:
            raise APIError(400, f"the model's chat template could not render these messages: {e}",
                           param="messages") from None

    @staticmethod
    def max_tokens(req):
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens differ; send one of them",
                           param="max_completion_tokens")
        if req.max_completion_tokens is not None:
            return req.max_completion_tokens, "max_completion_tokens"
        return req.max_tokens, "max_tokens"

    @staticmethod
    def num_logprobs(req):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None

    @staticmethod
    def choice(text, finish_reason, logprobs):
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}

    @staticmethod
    def chunk_choice(text, finish_reason, first, logprobs):
        delta = {"role": "assistant", "content": text} if first else {"content": text}  # the role comes once
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    @staticmethod
    def logprobs(tokenizer, values, text_offset):
        def entry(token_id: int, logprob: float) -> dict:
            return {"token": tokenizer.token_text(token_id), "logprob": _json_logprob(logprob),
                    "bytes": tokenizer.token_bytes(token_id)}

        return {"content": [{**entry(v.token_id, v.logprob), "top_logprobs": [entry(t, lp) for t, lp in v.top]}
                            for v in values]}


@dataclasses.dataclass(slots=True)
class _Prepared:
    prompt: dict  # {"prompt_token_ids": [...], "prompt": text | None}
    params: SamplingParams
    stream: bool


def _structured_outputs(req) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever of OpenAI's response_format, vLLM's
    structured_outputs or its guided_* fields it came in (at most one)."""
    given = {}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given["response_format"] = StructuredOutputsParams(json_object=True)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, 'response_format of type "json_schema" needs json_schema.schema', param="response_format")
        given["response_format"] = StructuredOutputsParams(json=fmt.json_schema.schema_)
    if req.structured_outputs is not None:
        so = req.structured_outputs
        given["structured_outputs"] = dict(json=so.json_, json_object=bool(so.json_object), regex=so.regex,
                                           choice=so.choice, grammar=so.grammar)
    for field, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(req, field) is not None:
            given[field] = {key: getattr(req, field)}
    if len(given) > 1:
        raise APIError(400, f"send one output constraint, not {len(given)} ({', '.join(given)})", param=list(given)[1])
    if not given:
        return None
    field, spec = next(iter(given.items()))
    try:
        return spec if isinstance(spec, StructuredOutputsParams) else StructuredOutputsParams(**spec)
    except SpecDecodeError as e:
        raise APIError(400, str(e), param=field) from None


def _logit_bias(req) -> dict[int, float] | None:
    if req.logit_bias is None:
        return None
    out = {}
    for key, bias in req.logit_bias.items():
        if not key.isdigit():
            raise APIError(400, f"logit_bias keys are token ids (strings of digits), got {key[:40]!r}", param="logit_bias")
        out[int(key)] = bias
    return out


def _prompt_logprobs(tokenizer, values: list) -> list:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}},
    the token itself and the likeliest ones."""
    out = []
    for v in values:
        if v is None:
            out.append(None)
            continue
        entries = {v.token_id: {"logprob": _json_logprob(v.logprob), "rank": v.rank}}
        for rank, (t, lp) in enumerate(v.top, start=1):
            entries.setdefault(t, {"logprob": _json_logprob(lp), "rank": rank})
        out.append({str(t): {**e, "decoded_token": tokenizer.token_text(t)} for t, e in entries.items()})
    return out


def _param_of(error: SpecDecodeError, prompt_field: str) -> str | None:
    """The request field an engine error is about: its `param`, the key of an "invalid KEY"
    message (SamplingParams names them as the API does), or the prompt."""
    param = getattr(error, "param", None)
    if param:
        return param
    message = str(error)
    key = _INVALID_KEY.match(message)
    if key and key.group(1) in SAMPLING_FIELDS + ("max_tokens", "logit_bias", "logprobs", "prompt_logprobs"):
        return key.group(1)
    return prompt_field if "prompt" in message or "template" in message else None


def _check_content_type(request: Request) -> None:
    value = request.headers.get("content-type")
    if value is None:
        return
    media = value.split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"the request body must be JSON (Content-Type: application/json), got Content-Type "
                       f"{media[:80]!r}; with curl add -H 'Content-Type: application/json'",
                       code="unsupported_media_type")


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, public_metrics: bool = False) -> FastAPI:
    app = FastAPI(title="specdecode", version="0.1.0",
                  description="OpenAI-compatible server with speculative decoding")
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_request_bytes, public_metrics=public_metrics)
    llm = engine.llm
    max_prompt_bytes = llm.tokenizer.max_text_bytes(llm.max_model_len - 1)  # None: no cheap bound

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message, code = f"there is no route {where}; the API is under /v1 (see /docs)", "not_found"
        elif exc.status_code == 405:
            allowed = {k.lower(): v for k, v in (exc.headers or {}).items()}.get("allow", "?")
            message, code = f"{where} is not allowed; allowed: {allowed}", "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        return error_response(exc.status_code, message, code=code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(400, "the request is not valid for this route")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        return error_response(500, "internal server error", "server_error")

    def _check_model(name: str) -> None:
        if name != served_model_name:
            raise APIError(404, f"model {name[:200]!r} does not exist; this server serves {served_model_name!r}",
                           param="model", code="model_not_found")

    def _check_length(text: str, field: str) -> None:
        """Refuse, before tokenising it, a text too long for any tokenisation to fit the context."""
        if max_prompt_bytes is None or len(text) * 4 <= max_prompt_bytes:
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > max_prompt_bytes:
            raise APIError(400, f"the prompt is too long: {size} bytes of text need more tokens than this model's "
                           f"context of {llm.max_model_len} tokens holds (no text over {max_prompt_bytes} bytes can "
                           "fit)", param=field)

    def _prepare(shape: type[_Shape], body: bytes) -> _Prepared:
        """The request as the engine takes it (runs in the engine's thread pool)."""
        data = parse_body(body)
        check_sizes(data, llm.max_model_len)
        req = validate(shape.schema, data)
        _check_model(req.model)
        max_tokens, max_tokens_field = shape.max_tokens(req)
        try:
            sent = {key: getattr(req, key) for key in SAMPLING_FIELDS if getattr(req, key) is not None}
            params = SamplingParams(**sent, max_tokens=max_tokens or 1,  # the real default once the prompt is known
                                    logit_bias=_logit_bias(req), logprobs=shape.num_logprobs(req),
                                    prompt_logprobs=getattr(req, "prompt_logprobs", None),
                                    structured_outputs=_structured_outputs(req))
            prompt = shape.prompt(req, llm.tokenizer)
            if isinstance(prompt, str):
                _check_length(prompt, shape.prompt_field)
            prepared = engine.validate(prompt, params)
        except SpecDecodeError as e:
            raise APIError(400, str(e), param=_param_of(e, shape.prompt_field)) from None
        n_prompt = len(prepared["prompt_token_ids"])
        room = llm.max_model_len - n_prompt
        if max_tokens is None:  # as vLLM: whatever fits
            params = dataclasses.replace(params, max_tokens=room)
        elif max_tokens > room:
            raise APIError(400, f"{max_tokens_field} ({max_tokens}) plus the prompt ({n_prompt} tokens) exceeds the "
                           f"context length ({llm.max_model_len}); ask for at most {room}", param=max_tokens_field)
        return _Prepared(prepared, params, bool(req.stream))

    def _as_api_error(error: Exception, shape: type[_Shape]) -> APIError:
        if isinstance(error, APIError):
            return error
        if isinstance(error, SpecDecodeError):
            return APIError(400, str(error), param=_param_of(error, shape.prompt_field))
        if isinstance(error, RequestFailed):
            return APIError(500, str(error), "server_error")
        if isinstance(error, EngineUnavailable):
            return APIError(503, str(error), "server_error", code="engine_unavailable")
        if isinstance(error, EngineBusy):
            return APIError(503, str(error), "server_error", code="server_busy", headers={"Retry-After": "1"})
        log.error("request failed", exc_info=error)
        return APIError(500, "internal server error", "server_error")

    def _sse(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    async def _stream(prepared: _Prepared, base: dict, shape: type[_Shape]):
        """SSE: a chunk per engine step that adds text (held back while it could still be the
        start of a stop string), the last one with the finish reason, then usage and
        spec_decode in a chunk without choices, then [DONE]. A request that fails ends with an
        error event instead, then [DONE]. A client that goes away ends this generator, and
        with it AsyncEngine.generate, which aborts the request."""
        params = prepared.params
        detok = IncrementalDetokenizer(hold_back=max((len(s) for s in params.stop), default=1) - 1)
        first = True
        sent_logprobs, text_offset = 0, 0
        try:
            async for out in engine.generate(prepared.prompt, params):
                delta = detok.delta(out.text, final=out.finished)
                new_logprobs = out.logprobs[sent_logprobs:] if out.logprobs is not None else []
                if delta or out.finished or new_logprobs:
                    logprobs = None
                    if out.logprobs is not None:
                        logprobs = shape.logprobs(llm.tokenizer, new_logprobs, text_offset)
                        sent_logprobs = len(out.logprobs)
                    choice = shape.chunk_choice(delta, out.finish_reason if out.finished else None, first, logprobs)
                    if first and out.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = _prompt_logprobs(llm.tokenizer, out.prompt_logprobs)
                    text_offset += len(delta)
                    yield _sse({**base, "choices": [choice]})
                    first = False
                if out.finished:
                    yield _sse(_body(base, [], out))
        except Exception as e:
            yield _sse(_as_api_error(e, shape).body())
        yield "data: [DONE]\n\n"

    async def _final(request: Request, prepared: _Prepared) -> RequestOutput | None:
        """The finished output, or None if the client went away first (the request is then
        aborted: cancelling the task ends AsyncEngine.generate)."""

        async def run() -> RequestOutput:
            final = None
            async for out in engine.generate(prepared.prompt, prepared.params):
                final = out
            return final

        task = asyncio.ensure_future(run())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    return None
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _serve(request: Request, shape: type[_Shape]):
        _check_content_type(request)
        try:
            body = await request.body()  # before taking a place: a slow body holds a connection, not a place
            with engine.admission():
                prepared = await engine.offload(_prepare, shape, body)
        except Exception as e:
            raise _as_api_error(e, shape) from None
        base = {"id": f"{shape.id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": served_model_name,
                "object": shape.chunk_object if prepared.stream else shape.object}
        if prepared.stream:
            return StreamingResponse(_stream(prepared, base, shape), media_type="text/event-stream")
        try:
            out = await _final(request, prepared)
        except Exception as e:
            raise _as_api_error(e, shape) from None
        if out is None:
            return error_response(499, "the client closed the request")
        logprobs = None if out.logprobs is None else shape.logprobs(llm.tokenizer, out.logprobs, 0)
        choice = shape.choice(out.text, out.finish_reason, logprobs)
        if out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = _prompt_logprobs(llm.tokenizer, out.prompt_logprobs)
        return _body(base, [choice], out)

    completion_doc, components = request_schema(CompletionRequest)
    chat_doc, chat_components = request_schema(ChatCompletionRequest)
    components.update(chat_components)

    @app.post("/v1/completions", openapi_extra={"requestBody": completion_doc})
    async def completions(request: Request):
        return await _serve(request, _Completion)

    @app.post("/v1/chat/completions", openapi_extra={"requestBody": chat_doc})
    async def chat_completions(request: Request):
        return await _serve(request, _ChatCompletion)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": 0,
                                            "owned_by": "specdecode", "max_model_len": llm.max_model_len}]}

    @app.get("/health")
    async def health():
        """200 while the engine can serve; 503 (with the reason) while its loop is not running,
        or after `max_failed_steps` failed engine steps in a row, until a step succeeds."""
        reason = engine.health()
        if reason is not None:
            return error_response(503, reason, "server_error", code="engine_unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    default_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            spec = default_openapi()
            spec.setdefault("components", {}).setdefault("schemas", {}).update(components)
        return app.openapi_schema

    app.openapi = openapi
    return app
