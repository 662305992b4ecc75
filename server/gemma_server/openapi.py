"""The server's OpenAPI document (`/openapi.json`), as the server really answers.

FastAPI documents a 422 for every route with a body, but this server answers a bad request with 400 in
OpenAI's error shape (app.py's validation handler, as vLLM's `validation_exception_handler` in
vllm/entrypoints/openai/api_server.py). So each route declares the statuses it answers (`responses=`
below, each error with `ErrorResponse`), and `document` builds the rest with FastAPI's own `get_openapi`
(fastapi/openapi/utils.py), then:

- removes the 422 and its schemas;
- with `--api-key`, adds the bearer scheme and the 401 to the routes that need the key;
- once the model is loaded, writes its limits into the request schemas: token ids below the vocabulary
  size, a token-id prompt shorter than the context, prompt text within the length `check_size` allows.

The request constraints themselves (ranges, enums, non-empty messages, rules tying two fields together)
come from protocol.py's models, where `check()` enforces them.

What no JSON Schema can say, the 400's description does: the chat template's own rules (Gemma's templates
want user and assistant turns to alternate) and a prompt's length in tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gemma_server.protocol import ErrorResponse, prompt_schema, token_id_key_pattern, token_id_schema

_DESCRIPTIONS = {
    400: "A request field is malformed or out of range (`param` names it), or the chat template refused the "
         "messages, or the prompt does not fit the context in tokens.",
    401: "The API key is missing or wrong (`Authorization: Bearer <key>`).",
    404: "`model` is not the served model.",
    413: "The request body is larger than --max-body-bytes.",
    429: "The queue is full; retry after the `Retry-After` seconds.",
    500: "An internal error; the message names the request id the server log has the details under.",
    503: "The server is booting, draining for shutdown, or its engine failed.",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for these error statuses, each with OpenAI's error shape."""
    return {status: {"model": ErrorResponse, "description": _DESCRIPTIONS[status]} for status in statuses}


def generation(model: type) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a generation route: `model` as JSON, or server-sent events when `stream` is true."""
    ok = {"model": model, "description": "The completion; with `stream: true`, server-sent events ending with "
                                         "`data: [DONE]`.",
          "content": {"text/event-stream": {"schema": SSE_EVENT}}}
    return {200: ok, **errors(400, 404, 413, 429, 500, 503)}


# One server-sent event (before Open API 3.2, an event stream's `schema` describes each event): its `data` is
# a JSON chunk, an error object, or `[DONE]`.
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "A JSON chunk, an error object, or [DONE]."}, "event": {"type": "string"}}}
PROBE = {200: {"description": "Ready (or alive)."}, **errors(503)}
METRICS = {200: {"description": "Prometheus text exposition.", "content": {"text/plain": {"schema": {"type": "string"}}}}}
PAGE = {200: {"description": "The chat page.", "content": {"text/html": {"schema": {"type": "string"}}}}}

_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")
_REQUESTS = ("ChatCompletionRequest", "CompletionRequest")


@dataclass(frozen=True)
class ModelLimits:
    """What the loaded model accepts: token ids in [0, vocab_size), at most `context` tokens."""

    vocab_size: int
    context: int


def document(app: FastAPI, keyed: frozenset[str], limits: ModelLimits | None) -> dict[str, Any]:
    """The OpenAPI document of `app` (see the module docstring).

    Args:
        app: the app, its routes declared with their `responses=`.
        keyed: the paths that need the bearer key (none without --api-key).
        limits: the loaded model's limits, or None while it loads.
    Returns:
        the document as a dict.
    """
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.get("components", {}).get("schemas", {})
    for name in _VALIDATION_SCHEMAS:
        schemas.pop(name, None)
    for path, operations in doc["paths"].items():
        for operation in operations.values():
            operation["responses"].pop("422", None)
            if path in keyed:
                operation["security"] = [{"bearer": []}]
                operation["responses"]["401"] = {"description": _DESCRIPTIONS[401], "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    if keyed:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    if limits is not None:
        for name in _REQUESTS:
            _write_limits(schemas[name]["properties"], limits)
    return doc


def _write_limits(properties: dict[str, Any], limits: ModelLimits) -> None:
    """The loaded model's limits, into one request schema's properties."""
    if "prompt" in properties:
        properties["prompt"]["anyOf"] = prompt_schema(limits.vocab_size, limits.context)
    properties["logit_bias"]["propertyNames"] = {"pattern": token_id_key_pattern(limits.vocab_size)}
    properties["stop_token_ids"]["items"] = token_id_schema(limits.vocab_size)
