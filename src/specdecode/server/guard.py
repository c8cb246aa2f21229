"""An ASGI middleware in front of every route: the API key and the request-body limit.

Both are decided before anything is routed or parsed: a request without the key gets a 401
(`WWW-Authenticate: Bearer`) without its body being read, and a body larger than
`max_body_bytes` gets a 413, from its Content-Length when it has one, else as soon as the
bytes streamed in pass the limit. A rejected body is read and dropped first (up to DRAIN_BYTES,
for at most DRAIN_SECONDS), so that a client still sending it reads the answer instead of a
reset connection.
"""

from __future__ import annotations

import hmac

import anyio
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from specdecode.server.protocol import APIError

DRAIN_BYTES = 64 * 2 ** 20
DRAIN_SECONDS = 5.0
ALWAYS_PUBLIC = frozenset({"/health"})
DOCS_AND_METRICS = frozenset({"/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server accepts ({limit} bytes; "
                    "see --max-request-bytes)", code="request_too_large")


class Guard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, public_metrics: bool = False):
        self.app = app
        self.key = api_key.encode("utf-8") if api_key else None
        self.max_body_bytes = max_body_bytes
        self.public = ALWAYS_PUBLIC | (DOCS_AND_METRICS if public_metrics else frozenset())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.key is not None and scope["path"] not in self.public and not self._authorized(headers):
            await _reject(scope, receive, send, APIError(
                401, "missing or invalid API key (send the header Authorization: Bearer <key>)",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
            return
        length = headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body_bytes:
            await _reject(scope, receive, send, body_too_large(self.max_body_bytes))
            return
        received = 0

        async def limited() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    if message.get("more_body", False):
                        await _drain(receive)
                    raise body_too_large(self.max_body_bytes)
            return message

        await self.app(scope, limited, send)

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        # Headers arrive as latin-1: its bytes are the ones the client sent.
        return hmac.compare_digest(token.strip().encode("latin-1"), self.key)


async def _drain(receive: Receive) -> None:
    """Read and drop what is left of a request body, within DRAIN_BYTES and DRAIN_SECONDS."""
    dropped = 0
    with anyio.move_on_after(DRAIN_SECONDS):
        while dropped < DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            dropped += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


async def _reject(scope: Scope, receive: Receive, send: Send, error: APIError) -> None:
    if scope.get("method") not in ("GET", "HEAD"):
        await _drain(receive)
    await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, receive, send)
