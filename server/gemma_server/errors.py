"""The one error shape of the server: `{"error": {"message", "type", "param", "code"}}`.

Design from vLLM's `ErrorInfo` / `create_error_response` (vllm/entrypoints/openai/engine/protocol.py,
serve/utils/error_response.py): `code` is the HTTP status as an int, `param` names the offending request
field. The `type` strings follow llama.cpp's server (invalid_request_error, not_found_error,
unavailable_error, ...), which are the OpenAI reference's own where OpenAI has one. vLLM's bare
`{"error": "Unauthorized"}` is the inconsistency not to copy: every status here has this shape.
"""

from __future__ import annotations

import re
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from gemma_server import jobs

log = logging.getLogger(__name__)

# HTTP status -> OpenAI-style error type.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "unavailable_error",
}


class ApiError(Exception):
    """An error a client sees, with its HTTP status.

    Args:
        status: the HTTP status code.
        message: one sentence for a person, naming what is wrong.
        param: the request field at fault, if any (e.g. "temperature", "messages").
        headers: extra response headers (e.g. Retry-After).
    """

    def __init__(
        self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        """The JSON body: `{"error": {"message", "type", "param", "code"}}`."""
        return error_body(self.status, self.message, self.param)


class ErrorInfo(BaseModel):
    """The one error shape, as the OpenAPI document shows it: `code` is the HTTP status, `param` the request
    field at fault."""

    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """Build the OpenAI-shaped error object for `status`.

    Args:
        status: HTTP status; also sent as `code`.
        message: the human-readable message.
        param: the request field at fault, or None.
    Returns:
        `{"error": {"message", "type", "param", "code"}}`.
    """
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": status}}


def bad_request(param: str | None, message: str) -> ApiError:
    """A 400 naming `param`."""
    return ApiError(400, message, param)


# The scheduler's plain exceptions -> (status, extra headers). The one place where the engine layer's
# refusals become HTTP (vLLM's api_router maps its engine exceptions the same way).
_SCHEDULER_STATUS: dict[type, tuple[int, dict[str, str]]] = {
    jobs.QueueFull: (429, {"Retry-After": "1"}),
    jobs.OverShare: (429, {"Retry-After": "1"}),
    jobs.Draining: (503, {}),
    jobs.NotReady: (503, {"Retry-After": "5"}),
    jobs.EngineDead: (503, {}),
    jobs.Shutdown: (503, {}),
    jobs.EngineRefused: (400, {}),
    jobs.EngineFailed: (500, {}),
}


# A union's branch in a pydantic error location: "list[int]", "function-after[...]", a type's name, a model
# class's name. Never a field of a body (those are lowercase keys, read against the body first).
BRANCH = re.compile(r".*[\[-].*|str|int|float|bool|dict|list|none|[A-Z].*")


def param_from_loc(loc: tuple, body: Any = None) -> str | None:
    """pydantic's error location as a field path of the request body: ("body", "messages", 0, "content") ->
    "messages[0].content". Read against `body` (when given): a union's branch label is skipped, and so is the
    tag a discriminated union puts in an item's location (its `type` or `role` value, or the default tag of
    an item that has none): the segment after an item or a mapping that is not one of its keys and not the
    last (a missing field is always the last)."""
    out, data, entered = "", body, True
    parts = [p for p in loc if p != "body"]
    for n, p in enumerate(parts):
        tag_place = isinstance(data, dict) and entered and n < len(parts) - 1
        if isinstance(p, int):
            out += f"[{p}]"
            data = data[p] if isinstance(data, list) and 0 <= p < len(data) else None
            entered = True
        elif tag_place and p in (data.get("type"), data.get("role")):
            entered = False  # the tag, even where it is also a key ({"type": "thinking", "thinking": ...})
        elif isinstance(data, dict) and p in data:
            out += ("." if out else "") + p
            data, entered = data[p], True
        elif BRANCH.fullmatch(str(p)) or tag_place:
            entered = False  # a union's branch, or a default tag (an item without its `type`)
        else:  # a missing field, or a path the body does not reach
            out += ("." if out else "") + str(p)
            data = None
    return out or None


def invalid_request(errs: Sequence[dict[str, Any]], body: Any = None) -> ApiError:
    """The 400 for a body the request models refuse (pydantic's `errors()`, `body` what they read), naming
    the first field at fault, as vLLM's `validation_exception_handler` does."""
    # A list past its cap fails every branch of a union (`stop`: a string, or a list of at most 16): the
    # cap is the error that names what is wrong.
    fallback = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    first = next((e for e in errs if e.get("type") == "too_long"), None)
    if first is None:
        # Of a union's branches, the one that got furthest into the value names the fault (a list of items
        # whose third has a bad type, not "should be a valid string").
        top = param_from_loc(tuple(fallback.get("loc", ())), body) or ""
        same = [e for e in errs if (param_from_loc(tuple(e.get("loc", ())), body) or "").startswith(top)]
        first = max(same or [fallback], key=lambda e: len(param_from_loc(tuple(e.get("loc", ())), body) or ""))
    if first.get("type") == "json_invalid":
        return ApiError(400, f"The body is not valid JSON: {first.get('msg')}")
    param = param_from_loc(tuple(first.get("loc", ())), body)
    message = f"{param or 'body'}: {first.get('msg')}"
    if len(errs) > 1:
        message += f" (and {len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})"
    return ApiError(400, message, param)


def from_scheduler(exc: jobs.SchedulerError) -> ApiError:
    """The ApiError a client sees for one of the scheduler's refusals."""
    status, headers = _SCHEDULER_STATUS.get(type(exc), (500, {}))
    return ApiError(status, str(exc), headers=dict(headers))


def as_api_error(exc: BaseException) -> ApiError:
    """Any error a request ran into, as what its client sees. Unknown errors keep their text out of the
    body (it is logged with the request id instead)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, jobs.SchedulerError):
        return from_scheduler(exc)
    return internal_error(exc)


def internal_error(exc: BaseException) -> ApiError:
    """A 500 that names a request id, not the exception: the text goes to the log only."""
    request_id = uuid.uuid4().hex[:16]
    log.error("internal error %s: %s: %s", request_id, type(exc).__name__, exc, exc_info=exc)
    return ApiError(500, f"Internal error; the server log has the details under request id {request_id}.")
