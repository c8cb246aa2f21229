"""OpenAI-compatible HTTP API on FastAPI: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics. Every error is OpenAI-style JSON with a 4xx status; nothing leaks a traceback.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from specdecode.config import SamplingParams
from specdecode.engine.engine import RequestOutput
from specdecode.errors import SpecDecodeError
from specdecode.server.async_engine import AsyncEngine
from specdecode.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(message, type_, param, code))


# ---- request schemas (OpenAI's names; unknown fields are ignored like OpenAI does) ----------

class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    ignore_eos: StrictBool = False
    logprobs: Any = None
    stop_token_ids: list[StrictInt] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


def _sampling_params(req: _Sampling, default_max_tokens: int) -> SamplingParams:
    if req.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    if req.logprobs not in (None, False, 0):
        raise APIError(400, "logprobs are not supported by this server yet", param="logprobs")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k in (None, -1) else req.top_k,
        max_tokens=req.max_tokens or default_max_tokens,
        seed=req.seed, stop=stop, stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
    )


def _completion_prompt(prompt) -> str | dict:
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(t, int) for t in prompt):
        return {"prompt_token_ids": list(prompt)}
    if len(prompt) == 1:  # a batch of one
        return _completion_prompt(prompt[0])
    raise APIError(400, "send one prompt per request (a string or a list of token ids)", param="prompt")


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
    """What one endpoint's answers look like; everything else (admission, streaming, the
    final usage chunk, [DONE], aborts) is the same for every endpoint."""

    id_prefix: str
    object: str  # of the whole answer
    chunk_object: str  # of a streamed chunk

    @staticmethod
    def choice(text: str, finish_reason: str | None) -> dict:
        """The choice of the whole answer."""
        raise NotImplementedError

    @staticmethod
    def chunk_choice(text: str, finish_reason: str | None, first: bool) -> dict:
        """The choice of a streamed chunk; `first`: the stream's first chunk."""
        raise NotImplementedError


class _Completion(_Shape):
    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    @staticmethod
    def choice(text, finish_reason):
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    @staticmethod
    def chunk_choice(text, finish_reason, first):
        return _Completion.choice(text, finish_reason)


class _ChatCompletion(_Shape):
    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    @staticmethod
    def choice(text, finish_reason):
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}

    @staticmethod
    def chunk_choice(text, finish_reason, first):
        delta = {"role": "assistant", "content": text} if first else {"content": text}  # the role comes once
        return {"index": 0, "delta": delta, "finish_reason": finish_reason}


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              default_max_tokens: int = 256) -> FastAPI:
    app = FastAPI(title="specdecode", version="0.1.0",
                  description="OpenAI-compatible server with speculative decoding")
    llm = engine.llm

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        return error_response(400, f"{where}: {message}" if where else message, param=where or None)

    @app.exception_handler(SpecDecodeError)
    async def _engine_error(request: Request, exc: SpecDecodeError):
        return error_response(400, str(exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        return error_response(500, "internal server error", "server_error")

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error_response(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                                      "authentication_error", code="invalid_api_key")
        return await call_next(request)

    def _check_model(name: str) -> None:
        if name != served_model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {served_model_name!r}",
                           param="model", code="model_not_found")

    def _admit(prompt, params: SamplingParams) -> dict:
        prepared = engine.validate(prompt, params)
        n_prompt = len(prepared["prompt_token_ids"])
        if n_prompt + params.max_tokens > llm.max_model_len:
            raise APIError(400, f"max_tokens ({params.max_tokens}) plus the prompt ({n_prompt} tokens) exceeds the "
                           f"context length ({llm.max_model_len}); ask for at most {llm.max_model_len - n_prompt}",
                           param="max_tokens")
        return prepared

    async def _run(prompt, params: SamplingParams) -> RequestOutput:
        final = None
        async for out in engine.generate(prompt, params):
            final = out
        return final

    def _sse(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    async def _stream(prompt, params: SamplingParams, base: dict, shape: type[_Shape]):
        """SSE: a chunk per engine step that adds text (held back while it could still be the
        start of a stop string), the last one with the finish reason, then usage and
        spec_decode in a chunk without choices, then [DONE]. A client that goes away ends
        this generator, and with it AsyncEngine.generate, which aborts the request."""
        detok = IncrementalDetokenizer(hold_back=max((len(s) for s in params.stop), default=1) - 1)
        first = True
        try:
            async for out in engine.generate(prompt, params):
                delta = detok.delta(out.text, final=out.finished)
                if delta or out.finished:
                    choice = shape.chunk_choice(delta, out.finish_reason if out.finished else None, first)
                    yield _sse({**base, "choices": [choice]})
                    first = False
                if out.finished:
                    yield _sse(_body(base, [], out))
        except SpecDecodeError as e:
            yield _sse(error_body(str(e)))
        yield "data: [DONE]\n\n"

    async def _respond(prompt, params: SamplingParams, stream: bool, shape: type[_Shape]):
        base = {"id": f"{shape.id_prefix}-{uuid.uuid4().hex}", "object": shape.chunk_object if stream else shape.object,
                "created": int(time.time()), "model": served_model_name}
        if stream:
            return StreamingResponse(_stream(prompt, params, base, shape), media_type="text/event-stream")
        out = await _run(prompt, params)
        return _body(base, [shape.choice(out.text, out.finish_reason)], out)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        _check_model(req.model)
        params = _sampling_params(req, default_max_tokens)
        prompt = _admit(_completion_prompt(req.prompt), params)
        return await _respond(prompt, params, req.stream, _Completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        _check_model(req.model)
        params = _sampling_params(req, default_max_tokens)
        text = llm.tokenizer.apply_chat_template([m.model_dump() for m in req.messages])
        prompt = _admit(text, params)
        return await _respond(prompt, params, req.stream, _ChatCompletion)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": 0,
                                            "owned_by": "specdecode", "max_model_len": llm.max_model_len}]}

    @app.get("/health")
    async def health():
        if not engine.alive:
            return error_response(503, "engine loop is not running", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
