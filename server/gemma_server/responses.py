"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API, on the chat path.

Design: the OpenAI API reference's Responses endpoints and the openai SDK's types (openai 3.57.0
`openai/types/responses/`: `response_create_params.py`, `response.py`, `response_stream_event.py`) and its
stream helper (`openai/lib/streaming/responses/_responses.py`, which rebuilds the response from the events and
checks their order); vLLM's `vllm/entrypoints/openai/serving_responses.py` turns a Responses request into chat
messages the same way.

A request becomes a `protocol.ChatCompletionRequest` (`to_chat`, pure): `instructions` a leading system
message, `input` items chat messages (a message's text parts joined; `reasoning`, an assistant message and its
`function_call` items one assistant message with reasoning_content and tool_calls; `function_call_output` a
`tool` message, which chat_template.py puts where Gemma 4's template wants tool results; a user message's
`input_image` and `input_audio` parts chat's `image_url` and `input_audio` parts), `tools` and
`tool_choice` chat's, `text.format` chat's response_format, `reasoning.effort` the template's
enable_thinking, `max_output_tokens` max_tokens. It then takes the one path every request takes
(`ServerState.start`: the same checks, client share, queue, metrics and cancellation as chat), and a 400 from
the chat checks is renamed to the Responses field it came from (`rename`). The reply comes back as output
items: a `reasoning` item (the thought channel), a `message` with one `output_text` part, and a
`function_call` item per call; status `incomplete` (reason max_output_tokens) when max_output_tokens cut it.

Streaming sends the SDK's event sequence, each `event: <type>` with a `sequence_number`:
`response.created`, `response.in_progress`, then per item `response.output_item.added`, its deltas
(`response.reasoning_text.delta`, `response.content_part.added` + `response.output_text.delta`,
`response.function_call_arguments.delta`) and their `.done` events, `response.output_item.done`, and last
`response.completed` or `response.incomplete`. An error after the stream opened is an `error` event.

Stored responses (`store`, default true as OpenAI's): `ResponseStore` keeps each response and the
conversation that led to it in memory, as compact JSON bytes so that the bytes it counts are the memory they
take, bounded by count, bytes and age for each API key and for all together (past the whole store's caps, the
key that holds the most loses its oldest, so one client's stores evict its own), and `metadata` by OpenAI's
bounds. Each is visible only to the bearer token that made it (a hash of it is kept, never the token), so
`previous_response_id` continues a conversation (its instructions are not carried over, as OpenAI documents)
and GET/DELETE read and remove it; an id that is not there (or not the caller's) is a 404 naming it.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from gemma_server.errors import ApiError, as_api_error, bad_request, invalid_request
from gemma_server.openapi import documented
from gemma_server.protocol import (
    FUNCTION_NAME,
    MAX_CACHE_SALT,
    MAX_MESSAGES,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    SEED,
    ChatCompletionRequest,
    InputAudio,
    Integer,
    OpenAIModel,
    part_type,
)
from gemma_server.serving import Formatter, Generation, Output, Piece, merged, race_disconnect, usage
from gemma_server.toolcalls import CallStart

NAME = {"pattern": f"^{FUNCTION_NAME.pattern}$"}
MAX_INPUT_ITEMS = 2 * MAX_MESSAGES  # calls and their outputs are items of their own
MAX_PARTS = 1024
# `metadata`'s bounds, OpenAI's (the API reference's Metadata: 16 pairs, keys of at most 64 characters, values of
# at most 512), which also bound what a stored response keeps of it.
MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


# ---- request ------------------------------------------------------------------------------------------


class Strict(BaseModel):
    """An item or part: strict as the request is, unknown keys kept (and ignored)."""

    model_config = ConfigDict(extra="allow", strict=True)


class InputText(Strict):
    type: Literal["input_text"]
    text: str


class OutputText(Strict):
    """A part of an earlier assistant message sent back as input."""

    type: Literal["output_text"]
    text: str


class Refusal(Strict):
    type: Literal["refusal"]
    refusal: str


class InputImage(Strict):
    """An image in a user message: a data URL (an http(s) URL where the server fetches from its host)."""

    type: Literal["input_image"]
    image_url: str = Field(description="A data URL (data:image/png;base64,...); file ids are not supported.")
    detail: Literal["auto", "low", "high", "original"] | None = None


class InputAudioPart(Strict):
    """A clip of at most 30 s in a user message (base64 wav, mp3 or flac)."""

    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[
    Annotated[InputText, Tag("input_text")] | Annotated[OutputText, Tag("output_text")]
    | Annotated[Refusal, Tag("refusal")] | Annotated[InputImage, Tag("input_image")]
    | Annotated[InputAudioPart, Tag("input_audio")],
    Discriminator(part_type, custom_error_type="invalid_part", custom_error_message=(
        "A content part is input_text, output_text, refusal, input_image or input_audio; files are not "
        "supported."))]


class MessageItem(Strict):
    """A message (OpenAI's EasyInputMessage and ResponseInputMessageItem: `type` may be left out)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_PARTS)]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in self.content
                       if not isinstance(p, (InputImage, InputAudioPart)))

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content as chat's: the text, or with images or audio chat's parts, one for each part (so a
        chat 400 naming `content[j]` names this message's part j)."""
        if isinstance(self.content, str) or not any(isinstance(p, (InputImage, InputAudioPart))
                                                    for p in self.content):
            return self.text()
        parts: list[dict[str, Any]] = []
        for p in self.content:
            if isinstance(p, InputImage):
                parts.append({"type": "image_url", "image_url": {"url": p.image_url}})
            elif isinstance(p, InputAudioPart):
                parts.append({"type": "input_audio", "input_audio": p.input_audio.model_dump()})
            else:
                parts.append({"type": "text", "text": p.refusal if isinstance(p, Refusal) else p.text})
        return parts


class FunctionCallItem(Strict):
    """A call the model made, sent back as input (`call_id` pairs it with its output)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(json_schema_extra=NAME)
    arguments: str = Field(description="The arguments: a JSON object's text.")
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    """A tool's result for the call `call_id`."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | Annotated[list[InputText], Field(max_length=MAX_PARTS)]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningPart(Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Strict):
    """A thought the model wrote, sent back as input (it reaches the next assistant turn's reasoning_content)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: Annotated[list[ReasoningPart], Field(max_length=MAX_PARTS)] = Field(default_factory=list)
    content: Annotated[list[ReasoningPart], Field(max_length=MAX_PARTS)] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(p.text for p in self.content or self.summary)


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict) and "type" not in value:
        return "message"  # OpenAI's EasyInputMessage has no type
    return part_type(value)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type="invalid_item", custom_error_message=(
        "An input item is a message, function_call, function_call_output or reasoning item; images, files "
        "and other tools' items are not supported."))]


class FunctionTool(Strict):
    """A function the model may call (the Responses API's flat shape: no `function` wrapper)."""

    type: Literal["function"]
    name: str = Field(json_schema_extra=NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    """`tool_choice: {"type": "function", "name": ...}`: exactly that function is called."""

    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    """`text.format`: text, json_object, or json_schema (name, schema, strict, description flat)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True, json_schema_extra={"allOf": [
        {"anyOf": [{"properties": {"type": {"enum": ["text", "json_object"]}}},
                   {"required": ["name", "schema"]}]}]})


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Strict):
    """`reasoning`: an effort other than none or minimal turns Gemma 4's thinking on (its templates take
    enable_thinking; there is no budget to set)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


# As chat's FORCED_TOOL_RULE and FORCED_ALONE_RULE: a forced call needs tools and is the whole reply.
_NOT_FORCED = {"properties": {"tool_choice": {"not": {"anyOf": [{"const": "required"}, {"type": "object"}]}}}}
RESPONSES_RULES = [
    {"anyOf": [_NOT_FORCED, {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}]},
    {"anyOf": [_NOT_FORCED, {"properties": {"text": {"anyOf": [{"type": "null"}, {"properties": {"format": {
        "anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]}}}]}}}]},
]


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses. Field order: the OpenAI API reference's."""

    model_config = ConfigDict(json_schema_extra={"allOf": RESPONSES_RULES})

    background: bool | None = documented(enum=[False, None], description="Not supported.")
    include: Annotated[list[str], Field(max_length=16)] | None = None
    input: Annotated[str, Field()] | Annotated[list[InputItem], Field(max_length=MAX_INPUT_ITEMS)] = Field(
        json_schema_extra=lambda s: s["anyOf"][1].update(minItems=1))
    instructions: str | None = None
    max_output_tokens: Integer | None = documented(minimum=1)
    metadata: Annotated[dict[str, str], Field(max_length=MAX_METADATA)] | None = documented(
        maxProperties=MAX_METADATA, propertyNames={"maxLength": MAX_METADATA_KEY},
        additionalProperties={"type": "string", "maxLength": MAX_METADATA_VALUE},
        description=f"At most {MAX_METADATA} pairs, keys of at most {MAX_METADATA_KEY} characters, values of at "
                    f"most {MAX_METADATA_VALUE}; echoed in the response, and stored with it.")
    model: str | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    reasoning: ReasoningConfig | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool | None = True
    stream: bool = False
    temperature: float | None = documented(minimum=0.0, maximum=2.0)
    text: TextConfig | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    top_logprobs: Integer | None = documented(minimum=0, maximum=MAX_TOP_LOGPROBS)
    top_p: float | None = documented(exclusiveMinimum=0.0, maximum=1.0)
    truncation: Literal["disabled", "auto"] | None = documented(enum=["disabled", None],
                                                                description="Only disabled: a prompt too long "
                                                                            "for the context is a 400.")
    user: str | None = None

    # --- extensions (vLLM's names, as chat takes them) ------------------------------------------------
    top_k: Integer | None = documented(minimum=-1)
    seed: Integer | None = Field(default=None, description=SEED)
    cache_salt: str | None = documented(minLength=1, maxLength=MAX_CACHE_SALT,
                                        description="Requests share cached prompt KV only with requests of the "
                                                    "same salt (vLLM's cache_salt).")
    # --- end of extensions ----------------------------------------------------------------------------

    def check(self) -> None:
        """What the chat checks do not see; raises ApiError(400) naming the field."""
        if self.background:
            raise bad_request("background", "background responses are not supported.")
        if self.truncation == "auto":
            raise bad_request("truncation", "truncation auto is not supported: a prompt too long for the context "
                                            "is refused (truncation disabled).")
        if isinstance(self.input, list) and not self.input:
            raise bad_request("input", "input must hold at least one item.")
        for key, value in (self.metadata or {}).items():
            if len(key) > MAX_METADATA_KEY:
                raise bad_request("metadata", f"metadata keys have at most {MAX_METADATA_KEY} characters, got one of "
                                              f"{len(key)} ({key[:MAX_METADATA_KEY]!r}...).")
            if len(value) > MAX_METADATA_VALUE:
                raise bad_request("metadata", f"metadata values have at most {MAX_METADATA_VALUE} characters, got "
                                              f"{len(value)} for {key!r}.")
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema" and (fmt.name is None or fmt.schema_ is None):
            raise bad_request("text.format", "text.format json_schema needs name and schema.")

    def thinking(self) -> bool:
        effort = self.reasoning.effort if self.reasoning else None
        return effort not in (None, "none", "minimal")


# ---- request -> chat ----------------------------------------------------------------------------------


@dataclass
class ChatFromResponses:
    """A Responses request as chat: the request, and for each chat message the Responses field it came from
    (`rename` reads it)."""

    request: ChatCompletionRequest
    origins: list[str]
    history: list[dict[str, Any]]  # the conversation without instructions (what a stored response keeps)
    call_origins: dict[int, list[str]] = field(default_factory=dict)  # message -> its tool calls' items


def to_chat(body: ResponsesRequest, earlier: list[dict[str, Any]] | None = None) -> ChatFromResponses:
    """The chat request of `body`, after the conversation `earlier` (a stored response's, for
    previous_response_id). Pure.

    Raises:
        ApiError: 400 naming `input[i]` for an item chat cannot take.
    """
    history = [dict(m) for m in earlier or ()]
    origins = ["previous_response_id"] * len(history)
    new, new_origins, new_calls = input_messages(body.input)
    call_origins = {len(history) + i: calls for i, calls in new_calls.items()}
    history += new
    origins += new_origins
    messages = list(history)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
        origins.insert(0, "instructions")
        call_origins = {i + 1: calls for i, calls in call_origins.items()}
    fields: dict[str, Any] = {
        "messages": messages, "model": body.model, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
        "cache_salt": body.cache_salt, "parallel_tool_calls": body.parallel_tool_calls, "stream": body.stream,
    }
    if body.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                           for t in body.tools]
    if body.tool_choice is not None:
        fields["tool_choice"] = (body.tool_choice if isinstance(body.tool_choice, str)
                                 else {"type": "function", "function": {"name": body.tool_choice.name}})
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type != "text":
        fields["response_format"] = ({"type": "json_object"} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}})
    if body.top_logprobs is not None:
        fields.update(logprobs=True, top_logprobs=body.top_logprobs)
    if body.thinking():
        fields["chat_template_kwargs"] = {"enable_thinking": True}
    try:
        request = ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:  # what the Responses models let through and chat's do not: a 400, never a 500
        raise invalid_request(e.errors(), fields) from e
    return ChatFromResponses(request, origins, history, call_origins)


def input_messages(given: str | list) -> tuple[list[dict[str, Any]], list[str], dict[int, list[str]]]:
    """`input` as chat messages, for each the item it came from, and for an assistant turn the items of its
    tool calls. Consecutive reasoning, assistant message and function_call items are one assistant turn
    (the output of one response)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}], ["input"], {}
    out: list[dict[str, Any]] = []
    origins: list[str] = []
    call_origins: dict[int, list[str]] = {}
    turn: dict[str, Any] | None = None  # the assistant turn being gathered

    def assistant(i: int) -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": None}
            out.append(turn)
            origins.append(f"input[{i}]")
        return turn

    for i, item in enumerate(given):
        if isinstance(item, ReasoningItem):
            if turn is not None and (turn.get("tool_calls") or turn["content"]):
                turn = None  # a thought opens the next turn
            t = assistant(i)
            t["reasoning_content"] = (t.get("reasoning_content") or "") + item.text()
        elif isinstance(item, MessageItem) and item.role == "assistant":
            if turn is not None and turn.get("tool_calls"):
                turn = None
            t = assistant(i)
            t["content"] = (t["content"] or "") + item.text()
        elif isinstance(item, FunctionCallItem):
            assistant(i).setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
            call_origins.setdefault(len(out) - 1, []).append(f"input[{i}]")
        else:
            turn = None
            if isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            else:
                out.append({"role": item.role, "content": item.chat_content()})
            origins.append(f"input[{i}]")
    return out, origins, call_origins


# Chat's field names -> the Responses API's (a chat 400 is renamed on its way out).
_FIELDS = (("max_tokens", "max_output_tokens"), ("response_format.json_schema.schema", "text.format.schema"),
           ("response_format", "text.format"), ("logprobs", "top_logprobs"))


def rename(err: ApiError, chat: ChatFromResponses) -> ApiError:
    """`err` of the chat request naming the Responses field: `messages[i]...` the item (or instructions,
    or previous_response_id) message i came from (a tool call's field its function_call item's), `tools[i].
    function.x` `tools[i].x`, chat's own names the Responses ones."""
    param = err.param
    if param is None:
        return err
    origins = chat.origins
    if param.startswith("messages[") and "]" in param:
        index, _, rest = param[len("messages["):].partition("]")
        call = rest.partition("].function")
        if index.isdigit() and int(index) < len(origins):
            calls = chat.call_origins.get(int(index), [])
            j = call[0][len(".tool_calls["):]
            if rest.startswith(".tool_calls[") and j.isdigit() and int(j) < len(calls):
                param = calls[int(j)] + call[2]
            else:
                param = origins[int(index)] + (rest if origins[int(index)].startswith("input[") else "")
        else:
            param = "input"
    elif param == "messages":
        param = "input"
    elif param.startswith("tools[") and ".function." in param:
        param = param.replace(".function.", ".", 1)
    else:
        for chat, ours in _FIELDS:
            if param == chat or param.startswith(chat + "."):
                param = ours + param[len(chat):]
                break
    message = err.message.replace("max_tokens", "max_output_tokens").replace("response_format", "text.format")
    return ApiError(err.status, message, param, err.headers)


# ---- response objects ---------------------------------------------------------------------------------


class ResponseObject(BaseModel):
    """The response object, as the OpenAPI document shows it (`ResponseFormatter.final` builds it; the
    request's settings are echoed beside these, as OpenAI's are)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    incomplete_details: dict[str, Any] | None
    usage: dict[str, Any] | None
    previous_response_id: str | None


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Item:
    """One output item as it is built: its kind, id, index among the outputs, and its text so far."""

    kind: Literal["reasoning", "message", "function_call"]
    id: str
    index: int
    text: str = ""
    logprobs: list = field(default_factory=list)
    call_id: str = ""
    name: str = ""
    done: bool = False  # its .done events went out

    def json(self, status: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": self.text}]}
        if self.kind == "message":
            return {"id": self.id, "type": "message", "role": "assistant", "status": status,
                    "content": [self.part()]}
        return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                "arguments": self.text, "status": status}

    def part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}


class ResponseFormatter:
    """The response object and the stream events of one Responses request.

    Args:
        body: the request.
        model: the served model name.
        chat_format: a chat `serving.Formatter`, for the log-probability entries (OpenAI's shape is chat's).
    """

    def __init__(self, body: ResponsesRequest, model: str, chat_format: Formatter) -> None:
        self.body = body
        self.model = model
        self.id = _id("resp")
        self.created = int(time.time())
        self._chat = chat_format
        self.items: list[Item] = []
        self._sequence = 0

    def shell(self, status: str) -> dict[str, Any]:
        """The response object without output and usage (the request's settings echoed, as OpenAI does)."""
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": None, "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens, "model": self.model, "output": [],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None, "summary": None},
            "store": b.store is not False, "temperature": b.temperature, "top_p": b.top_p,
            "text": {"format": (b.text.format.model_dump(by_alias=True, exclude_none=True)
                                if b.text and b.text.format else {"type": "text"})},
            "tool_choice": (b.tool_choice if isinstance(b.tool_choice, str) or b.tool_choice is None
                            else b.tool_choice.model_dump()) or ("auto" if b.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()],
            "top_logprobs": b.top_logprobs, "truncation": "disabled", "usage": None,
            "user": b.user, "metadata": b.metadata or {},
        }

    def final(self, gen: Generation) -> dict[str, Any]:
        """The whole response once `gen` has ended: status, output items, usage."""
        incomplete = gen.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        obj = self.shell(status)
        obj["output"] = [item.json("incomplete" if incomplete and item is self.items[-1] else "completed")
                         for item in self.items]
        if incomplete:
            obj["incomplete_details"] = {"reason": "max_output_tokens"}
        u = usage([gen])
        obj["usage"] = {"input_tokens": u.prompt_tokens,
                        "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
                        "output_tokens": u.completion_tokens,
                        "output_tokens_details": {"reasoning_tokens": gen.reasoning_tokens},
                        "total_tokens": u.total_tokens}
        return obj

    def add(self, piece: Piece) -> list[tuple[str, dict[str, Any]]]:
        """Take one piece of the reply into the items; returns the stream events it makes ((type, data))."""
        events: list[tuple[str, dict[str, Any]]] = []
        if piece.reasoning:
            item = self._open("reasoning", events)
            item.text += piece.reasoning
            events.append(("response.reasoning_text.delta", {"item_id": item.id, "output_index": item.index,
                                                             "content_index": 0, "delta": piece.reasoning}))
        if piece.text or piece.logprobs:
            item = self._open("message", events)
            lp = (self._chat.logprobs(0, piece.logprobs) or {}).get("content") or []
            item.text += piece.text
            item.logprobs += lp
            events.append(("response.output_text.delta", {"item_id": item.id, "output_index": item.index,
                                                          "content_index": 0, "delta": piece.text, "logprobs": lp}))
        for call in piece.calls:
            if isinstance(call, CallStart):
                self._close(events)
                item = Item("function_call", _id("fc"), len(self.items), call_id=call.id, name=call.name)
                self.items.append(item)
                events.append(("response.output_item.added", {"output_index": item.index,
                                                              "item": item.json("in_progress")}))
            else:
                item = self.items[-1]
                item.text += call.text
                events.append(("response.function_call_arguments.delta",
                               {"item_id": item.id, "output_index": item.index, "delta": call.text}))
        return events

    def _open(self, kind: str, events: list) -> Item:
        """The open item of `kind`, or a new one (closing the open item of another kind)."""
        if self.items and self.items[-1].kind == kind and kind != "function_call":
            return self.items[-1]
        self._close(events)
        item = Item(kind, _id("rs" if kind == "reasoning" else "msg"), len(self.items))
        self.items.append(item)
        events.append(("response.output_item.added", {"output_index": item.index, "item": item.json("in_progress")}))
        if kind == "message":
            events.append(("response.content_part.added", {"item_id": item.id, "output_index": item.index,
                                                           "content_index": 0, "part": {**item.part(), "text": ""}}))
        return item

    def _close(self, events: list, status: str = "completed") -> None:
        """The `.done` events of the last item, if it is still open."""
        if not self.items or self.items[-1].done:
            return
        item = self.items[-1]
        item.done = True
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "reasoning":
            events.append(("response.reasoning_text.done", {**where, "content_index": 0, "text": item.text}))
        elif item.kind == "message":
            events.append(("response.output_text.done", {**where, "content_index": 0, "text": item.text,
                                                         "logprobs": item.logprobs}))
            events.append(("response.content_part.done", {**where, "content_index": 0, "part": item.part()}))
        else:
            events.append(("response.function_call_arguments.done", {**where, "name": item.name,
                                                                     "arguments": item.text}))
        events.append(("response.output_item.done", {"output_index": item.index, "item": item.json(status)}))

    def finish(self, gen: Generation) -> list[tuple[str, dict[str, Any]]]:
        """The closing events: the last item's `.done`, then response.completed or response.incomplete."""
        events: list[tuple[str, dict[str, Any]]] = []
        if not self.items:  # a reply of nothing is still one (empty) message
            self._open("message", events)
        final = self.final(gen)
        self._close(events, "incomplete" if final["status"] == "incomplete" else "completed")
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return events + [(kind, {"response": final})]

    def event(self, kind: str, data: dict[str, Any]) -> bytes:
        """One server-sent event: `event: <type>` and the data with its type and sequence number."""
        body = {"type": kind, **data, "sequence_number": self._sequence}
        self._sequence += 1
        text = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {text}\n\n".encode()

    def error_event(self, err: ApiError) -> bytes:
        """The stream's last event when it fails: OpenAI's `error` event (its `error` object too, which the
        openai SDK raises as APIError)."""
        info = err.body()["error"]
        return self.event("error", {"code": info["type"], "message": info["message"], "param": info["param"],
                                    "error": info})

    def collect(self, out: Output, gen: Generation) -> dict[str, Any]:
        """The non-streamed response of a whole output."""
        if out.reasoning:
            self.add(Piece("", reasoning=out.reasoning))
        if out.text or out.logprobs:
            self.add(Piece(out.text, out.logprobs))
        elif not gen.calls:  # a reply of nothing is still one (empty) message
            self._open("message", [])
        for c in gen.calls:
            self.items.append(Item("function_call", _id("fc"), len(self.items), c.arguments, call_id=c.id,
                                   name=c.name))
        return self.final(gen)


def assistant_message(response: dict[str, Any]) -> dict[str, Any]:
    """A response's output as the assistant chat message a later request's history holds."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for item in response["output"]:
        if item["type"] == "reasoning":
            message["reasoning_content"] = "".join(p["text"] for p in item["content"])
        elif item["type"] == "message":
            message["content"] = "".join(p["text"] for p in item["content"])
        else:
            message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
    return message


async def stream(gen: Generation, fmt: ResponseFormatter, receive,
                 on_done: Callable[[dict[str, Any]], None]) -> AsyncIterator[bytes]:
    """Wait for the first engine event (an error before any token raises here, as chat's `open_stream`),
    then return the SSE body; `on_done` gets the final response.

    Raises:
        ApiError: the request failed before any token.
        ClientDisconnected: the client left while the request waited.
    """
    items = merged([gen])
    first = await race_disconnect(receive, items.__anext__())
    return _events(gen, fmt, items, first, on_done)


async def _events(gen: Generation, fmt: ResponseFormatter, items: AsyncIterator, first,
                  on_done: Callable[[dict[str, Any]], None]) -> AsyncIterator[bytes]:
    try:
        head = fmt.event("response.created", {"response": fmt.shell("in_progress")})
        head += fmt.event("response.in_progress", {"response": fmt.shell("in_progress")})
        pending = first
        while True:
            _, piece = pending
            if piece is None:
                events = fmt.finish(gen)
                on_done(events[-1][1]["response"])
            else:
                events = fmt.add(piece)
            head += b"".join(fmt.event(kind, data) for kind, data in events)
            if head:
                yield head
                head = b""
            try:
                pending = await items.__anext__()
            except StopAsyncIteration:
                break
    except Exception as e:  # noqa: BLE001 - the stream is open: the error becomes its last event
        yield fmt.error_event(as_api_error(e))
    finally:
        await items.aclose()


# ---- the store ----------------------------------------------------------------------------------------


def owner_of(authorization: str | None) -> str:
    """Whose a stored response is: a hash of the request's bearer token (empty without one)."""
    token = (authorization or "").partition(" ")[2] if (authorization or "").lower().startswith("bearer ") else ""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def _pack(value: Any) -> bytes:
    """`value` as compact JSON in UTF-8 (a lone surrogate, which a JSON request may carry, kept as it is)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def _unpack(data: bytes) -> Any:
    return json.loads(data.decode("utf-8", "surrogatepass"))


# What the store's bookkeeping takes, on CPython 3.11 (64-bit), measured with tracemalloc (tests/server/
# test_responses.py holds the counted bytes to the memory a batch of entries takes): an entry besides its two
# byte strings (the Stored object, its id, a str keying two ordered dicts, and their nodes and slots), and an
# owner (its hash, a _Holding and its ordered dict, its slot in the store's dict of owners).
ENTRY_BYTES = 240
OWNER_BYTES = 384


@dataclass(frozen=True, slots=True)
class Stored:
    """One stored response: whose it is, when it was stored, and the response and the conversation that led to
    it as compact JSON bytes, decoded when read (`response`, `conversation`). Kept as Python objects they would
    take 4 to 5.5 times their JSON's length; kept as bytes, what the store counts (`size`) is what they take."""

    owner: str
    created: float
    response_json: bytes
    conversation_json: bytes

    @property
    def response(self) -> dict[str, Any]:
        return _unpack(self.response_json)

    @property
    def conversation(self) -> list[dict[str, Any]]:
        return _unpack(self.conversation_json)

    @property
    def size(self) -> int:
        """Bytes of memory it holds: its two byte strings as CPython keeps them, and ENTRY_BYTES."""
        return sys.getsizeof(self.response_json) + sys.getsizeof(self.conversation_json) + ENTRY_BYTES


@dataclass(eq=False, slots=True)
class _Holding:
    """One owner's part of the store: its ids, oldest first, and the bytes they and this bookkeeping take."""

    owner: str  # the one copy of the owner's hash that its entries share
    ids: OrderedDict[str, None] = field(default_factory=OrderedDict)
    size: int = OWNER_BYTES


class ResponseStore:
    """Stored responses in memory, with caps on each owner (an API key: `owner_of`) and on all of them.

    One owner keeps at most `max_count_per_key` responses and `max_bytes_per_key` bytes; past either, its own
    oldest goes. All owners together keep at most `max_count` and `max_bytes`; past either, the owner that holds
    the most (responses for the count, bytes for the bytes; of two that hold as much, the one whose oldest is
    older) loses its oldest, so a client that floods the store evicts its own responses, not another's smaller
    share. None is kept longer than `max_age` seconds. Bytes are memory: each response and its conversation are
    kept as compact JSON bytes (`Stored`). Thread-safe (the routes run on the event loop, tests read it).

    Args:
        max_count, max_bytes, max_age: the caps of the whole store (--responses-store-max-count, -max-bytes,
            -max-age).
        max_count_per_key, max_bytes_per_key: the caps of one owner (--responses-store-max-count-per-key,
            -max-bytes-per-key); None: the whole store's.
        clock: seconds (time.monotonic; tests pass their own).
    """

    def __init__(self, max_count: int, max_bytes: int, max_age: float, max_count_per_key: int | None = None,
                 max_bytes_per_key: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_count, self.max_bytes, self.max_age = max_count, max_bytes, max_age
        self.max_count_per_key = max_count if max_count_per_key is None else max_count_per_key
        self.max_bytes_per_key = max_bytes if max_bytes_per_key is None else max_bytes_per_key
        self._clock = clock
        self._items: OrderedDict[str, Stored] = OrderedDict()  # every owner's, oldest first
        self._owners: dict[str, _Holding] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, owner: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep `response` and the conversation that led to it (with its own reply at the end); one larger than
        the owner's or the whole store's byte cap alone is not kept, and evicts nothing."""
        response_json, conversation_json = _pack(response), _pack(conversation)
        with self._lock:
            self._drop(response["id"])
            holding = self._owners.get(owner) or _Holding(owner)
            stored = Stored(holding.owner, self._clock(), response_json, conversation_json)
            if (OWNER_BYTES + stored.size > min(self.max_bytes, self.max_bytes_per_key)
                    or min(self.max_count, self.max_count_per_key) == 0):
                return
            if owner not in self._owners:
                self._owners[owner] = holding
                self._bytes += holding.size
            self._items[response["id"]] = stored
            holding.ids[response["id"]] = None
            holding.size += stored.size
            self._bytes += stored.size
            self._expire()
            while len(holding.ids) > self.max_count_per_key or holding.size > self.max_bytes_per_key:
                self._drop(next(iter(holding.ids)))
            while len(self._items) > self.max_count or self._bytes > self.max_bytes:
                self._drop(next(iter(self._largest(self._bytes > self.max_bytes).ids)))

    def get(self, response_id: str, owner: str, param: str = "response_id") -> Stored:
        """The caller's stored response.

        Raises:
            ApiError: 404 naming `param` when there is none by that id for this owner (expired, deleted,
                evicted, or another key's).
        """
        with self._lock:
            self._expire()
            stored = self._items.get(response_id)
        if stored is None or stored.owner != owner:
            raise ApiError(404, f"No response with id {response_id[:80]!r} is stored for this API key.", param)
        return stored

    def delete(self, response_id: str, owner: str) -> None:
        """Remove the caller's stored response. Raises: ApiError 404 as `get`."""
        self.get(response_id, owner)
        with self._lock:
            self._drop(response_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def total_bytes(self) -> int:
        """Bytes of memory the stored responses take, as the caps count them."""
        with self._lock:
            return self._bytes

    def held(self, owner: str) -> tuple[int, int]:
        """How many responses `owner` holds, and their bytes."""
        with self._lock:
            holding = self._owners.get(owner)
            return (len(holding.ids), holding.size) if holding else (0, 0)

    def _largest(self, by_bytes: bool) -> _Holding:
        """The owner that holds the most bytes (`by_bytes`) or responses; of those that hold as much, the one
        whose oldest response is oldest (the caller holds the lock)."""
        return max(self._owners.values(), key=lambda h: (h.size if by_bytes else len(h.ids),
                                                         -self._items[next(iter(h.ids))].created))

    def _expire(self) -> None:
        """Drop what is older than max_age, oldest first (the caller holds the lock)."""
        oldest = self._clock() - self.max_age
        while self._items and next(iter(self._items.values())).created < oldest:
            self._drop(next(iter(self._items)))

    def _drop(self, response_id: str) -> None:
        """Remove one response if it is there (the caller holds the lock)."""
        stored = self._items.pop(response_id, None)
        if stored is None:
            return
        holding = self._owners[stored.owner]
        del holding.ids[response_id]
        holding.size -= stored.size
        self._bytes -= stored.size
        if not holding.ids:
            del self._owners[stored.owner]
            self._bytes -= holding.size
