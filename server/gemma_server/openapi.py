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
come from the protocol package's models, where `check()` enforces them; the JSON Schema helpers those fields are
declared with (`documented`, the rules and the prompt and token-id schemas) are the first part of this
module, so what the document says of a request is written in one place.

What no JSON Schema can say, the 400's description does: the chat template's own rules (Gemma's templates
want user and assistant turns to alternate) and a prompt's length in tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import Field

from gemma_server.errors import ErrorResponse

# ---- JSON Schema of the request models (the protocol package's fields use these) -----------------------------

# logit_bias keys: token ids written in ASCII digits.
TOKEN_ID_KEY = re.compile(r"[0-9]+")


def documented(default: Any = None, **schema: Any) -> Any:
    """A pydantic field whose bounds its model's `check()` enforces (so the 400 names the field in
    the protocol package's words), shown in the document as the JSON Schema keywords `schema`."""
    return Field(default=default, json_schema_extra=schema)


def one_of_fields_null_or(field: str, other: str, value: Any) -> dict:
    """JSON Schema: `field` is absent or null unless `other` is `value`."""
    return {"anyOf": [{"properties": {field: {"type": "null"}}},
                      {"properties": {other: {"const": value}}, "required": [other]}]}


def best_of_rule(max_n: int) -> dict:
    """JSON Schema: best_of is absent, null or 1, or equals n (at most `max_n`)."""
    same = [{"properties": {"n": {"const": k}, "best_of": {"const": k}}, "required": ["n", "best_of"]}
            for k in range(2, max_n + 1)]
    return {"anyOf": [{"properties": {"best_of": {"enum": [None, 1]}}}, *same]}


def prompt_schema(vocab_size: int | None = None, context: int | None = None,
                  max_chars: int | None = None) -> list[dict]:
    """JSON Schema branches of `prompt` as protocol/requests.py's `single_prompt` and `engine_params` take it: a
    string, a list of one string, a non-empty list of token ids, or a list of one such list (an empty prompt
    is refused); with the served model's limits when given (ids below the vocabulary size, fewer ids than
    the context, text of at most `max_chars`, as `check_size` allows)."""
    text: dict[str, Any] = {"type": "string", "minLength": 1}
    ids: dict[str, Any] = {"type": "array", "items": token_id_schema(vocab_size), "minItems": 1}
    if max_chars is not None:
        text["maxLength"] = max_chars
    if context is not None:
        ids["maxItems"] = context - 1
    return [text, {"type": "array", "items": text, "minItems": 1, "maxItems": 1},
            ids, {"type": "array", "items": ids, "minItems": 1, "maxItems": 1}]


def token_id_schema(vocab_size: int | None = None) -> dict[str, Any]:
    """JSON Schema of one token id: [0, vocab_size) when the vocabulary size is known."""
    return {"type": "integer", "minimum": 0, **({"maximum": vocab_size - 1} if vocab_size else {})}


def token_id_key_pattern(vocab_size: int | None = None) -> str:
    """A regex of the logit_bias keys accepted: ASCII decimal token ids, below `vocab_size` when known."""
    if not vocab_size:
        return f"^{TOKEN_ID_KEY.pattern}$"
    return f"^0*(?:{_below(vocab_size - 1)})$"


def _below(top: int) -> str:
    """A regex of the decimal numbers 0..top without leading zeros."""
    digits = str(top)
    alternatives = ["[0-9]"] + [f"[1-9][0-9]{{{n - 1}}}" for n in range(2, len(digits))]
    if len(digits) > 1:
        for i, d in enumerate(digits):
            low = 1 if i == 0 else 0
            if int(d) > low:
                rest = len(digits) - i - 1
                alternatives.append(f"{digits[:i]}[{low}-{int(d) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
        alternatives.append(digits)
    else:
        alternatives = [f"[0-{top}]"]
    return "|".join(alternatives)


# ---- the document ----------------------------------------------------------------------------------

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
    """What the loaded model accepts: token ids in [0, vocab_size), at most `context` tokens, prompt text of
    at most `prompt_chars` characters (protocol.limits.max_prompt_chars)."""

    vocab_size: int
    context: int
    prompt_chars: int
    tools: bool = True  # the tokenizer has Gemma 4's tool-call tokens
    modalities: tuple[str, ...] = ()  # what the checkpoint takes besides text: "image", "audio"
    fetch: bool = False  # image URLs are fetched (--media-fetch-hosts), not data URLs alone


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
            content = operation.get("requestBody", {}).get("content", {})
            if "application/x-www-form-urlencoded" in content:
                # FastAPI names a form model's body urlencoded even when it holds a file (the audio routes).
                content["multipart/form-data"] = content.pop("application/x-www-form-urlencoded")
            if path in keyed:
                operation["security"] = [{"bearer": []}]
                operation["responses"]["401"] = {"description": _DESCRIPTIONS[401], "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    if keyed:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    if limits is not None:
        for name in _REQUESTS:
            _write_limits(schemas[name]["properties"], limits)
        for schema in schemas.values():
            if "tools" in schema.get("properties", {}) and not limits.tools and schema.get("title") != "TokenizeRequest":
                # Without the tool-call tokens a request with tools is refused (state.py `ServerState.constrain`).
                schema["properties"]["tools"] = {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}],
                                                 "description": "This checkpoint's tokenizer has no tool-call tokens."}
        if "DetokenizeRequest" in schemas:
            schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] = token_id_schema(limits.vocab_size)
        _write_media(doc, limits)
    return doc


# The content parts of each kind of media (protocol/content.py's chat parts, frontends/responses.py's), and
# the routes that take audio alone.
MEDIA_PARTS = {"image": ("ImagePart", "InputImage"), "audio": ("AudioPart", "InputAudioPart")}
AUDIO_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")


def _write_media(doc: dict[str, Any], limits: ModelLimits) -> None:
    """What the loaded checkpoint takes: a part of a kind it has no tower for leaves the content unions (it
    would be a 400), and without an audio tower so do the audio routes; without --media-fetch-hosts an image
    URL is a data URL."""
    schemas = doc["components"]["schemas"]
    gone = {f"#/components/schemas/{name}" for kind, names in MEDIA_PARTS.items() if kind not in limits.modalities
            for name in names}

    def prune(node: Any) -> None:
        if isinstance(node, dict):
            for key in ("oneOf", "anyOf"):
                if isinstance(node.get(key), list):
                    node[key] = [i for i in node[key] if not (isinstance(i, dict) and i.get("$ref") in gone)]
            for value in node.values():
                prune(value)
        elif isinstance(node, list):
            for value in node:
                prune(value)

    if gone:
        prune(schemas)
        for ref in gone:
            schemas.pop(ref.rsplit("/", 1)[1], None)
    if "audio" not in limits.modalities:
        for path in AUDIO_PATHS:
            doc["paths"].pop(path, None)
    if not limits.fetch and "ImageUrl" in schemas:
        schemas["ImageUrl"]["properties"]["url"]["pattern"] = "^data:image/[^,]*;base64,"


def _write_limits(properties: dict[str, Any], limits: ModelLimits) -> None:
    """The loaded model's limits, into one request schema's properties."""
    if "prompt" in properties:
        properties["prompt"]["anyOf"] = prompt_schema(limits.vocab_size, limits.context, limits.prompt_chars)
    properties["logit_bias"]["propertyNames"] = {"pattern": token_id_key_pattern(limits.vocab_size)}
    properties["stop_token_ids"]["items"] = token_id_schema(limits.vocab_size)
