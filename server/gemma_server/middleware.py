"""The app's ASGI middleware, each answering from the request's headers before any of its body is parsed: the
API key (`ApiKeyGate`), the cap on requests in flight (`InFlightLimit`) and the body size (`BodyLimit`)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from gemma_server.errors import ApiError

if TYPE_CHECKING:
    from gemma_server.state import ServerState


async def send_error(send, err: ApiError) -> None:
    """Answer with `err` from ASGI middleware (no route, no body read)."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ApiKeyGate:
    """ASGI middleware: a request to a keyed path without the key is a 401 from its headers alone, before
    its body is read (the body is never parsed, validated or logged)."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            authorization = next((v for k, v in scope.get("headers") or () if k == b"authorization"), None)
            x_api_key = next((v for k, v in scope.get("headers") or () if k == b"x-api-key"), None)
            refused = self.state.key_refused(scope["path"], authorization, x_api_key)
            if refused is not None:
                return await send_error(send, refused)
        await self.app(scope, receive, send)


# The probe routes: never counted against the in-flight cap (the probe listener serves them too).
PROBE_PATHS = frozenset({"/health", "/ping", "/live"})


class InFlightLimit:
    """ASGI middleware: at `limit` requests in flight a new one is a 503 (Retry-After), probes excepted.

    Requests, not connections: a connection still sending its headers has not reached the app, so a flood
    of unfinished requests (which connections.py times out) cannot turn real requests away, as uvicorn's
    `limit_concurrency` (which counts open connections) would.
    """

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            return await self.app(scope, receive, send)
        if self.in_flight >= self.limit:
            return await send_error(send, ApiError(
                503, f"The server is at its limit of {self.limit} requests in flight. Retry later.",
                headers={"Retry-After": "1"}))
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is a 413 before any of it is parsed.

    A declared Content-Length over the limit is refused at once; otherwise the body is read here, counting
    as it arrives (a chunked body is cut at the limit), and handed on whole. Starlette reads the whole body
    before FastAPI parses it anyway, so this holds no more than it would.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or {}).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(send)
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        whole = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay():
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        await send_error(send, ApiError(413, f"The request body is larger than {self.max_bytes} bytes."))
