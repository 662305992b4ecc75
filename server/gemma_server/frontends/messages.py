"""What /v1/messages (Anthropic's Messages API) accepts and returns, and how it maps onto chat.

Design: Anthropic's API reference ("Create a Message", https://docs.anthropic.com/en/api/messages, and
"Streaming Messages", https://docs.anthropic.com/en/docs/build-with-claude/streaming), whose shapes the
`anthropic` SDK 2.16.0 reads (`types/message.py`, `types/raw_message_stream_event.py`,
`lib/streaming/_messages.py` `accumulate_event`), and vLLM's `vllm/entrypoints/anthropic/` (`protocol.py`,
`serving.py`), which serves it by translating each request into a chat completion request. So does this
module: a Messages request becomes one `protocol.requests.ChatCompletionRequest` (`to_chat`, a pure function), which
takes the one admission path every request takes (`ServerState.start`: limits, queue, metrics,
cancellation), and the chat choice's pieces (content, thought, tool-call events) are framed as Anthropic's
content blocks and events. There is no second generation pipeline.

The mapping (vLLM's `_convert_anthropic_to_openai_request`): `system` -> a leading system message; text
blocks -> content (several joined by a newline, as vLLM's `chat_utils` joins text parts for string-content
templates); an assistant's `tool_use` blocks -> its `tool_calls` (arguments = the input as JSON text) and its
`thinking` blocks -> `reasoning_content`; each `tool_result` block -> a `tool` message right after the
assistant turn that called, before the text of its user turn; `tools` -> functions with `input_schema` as
parameters; `tool_choice` auto / any / tool / none -> auto / required / named / none, and
`disable_parallel_tool_use` -> `parallel_tool_calls` false; `stop_sequences` -> `stop`; `thinking` -> the
chat template variable `enable_thinking`; `metadata.user_id` -> `user`. A forced tool choice is therefore
grammar-constrained exactly as chat's required / named is. `Translation` keeps where each chat field came
from, so a 400 from chat's own checks names the Anthropic field (`messages[1].content[0].tool_use_id`, not
`messages[2].tool_call_id`).

What the server cannot honour is a 400 naming the field, never silently dropped: image, document and other
block types (`messages[i].content[j].type`), server tools (`tools[i].type`), `redacted_thinking`, and a final
assistant message (Anthropic's prefill: the reply would be a new turn, not its continuation; Anthropic
refuses it the same way on models without prefill). `cache_control` markers are accepted and ignored: the
prefix cache needs none. The request models follow the reference's field order and are as strict as
protocol/base.py's (`OpenAIModel`: JSON types as JSON Schema reads them, unknown fields logged); every bound is a
JSON Schema keyword that validation enforces (the discriminated unions on `role` and `type` say which fields
each block requires), so the OpenAPI document allows exactly what is served.

Errors keep the server's one shape (errors.py) with Anthropic's top-level `"type": "error"` added
(`AnthropicRoute`), so both the openai-style readers and Anthropic's SDK read them; the `type` strings
(invalid_request_error, not_found_error, ...) are already Anthropic's. Usage follows Anthropic's meaning:
`input_tokens` are the prompt tokens not read from the prefix cache, `cache_read_input_tokens` those that
were (their sum is the prompt), `cache_creation_input_tokens` is 0 (nothing is billed for writing).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gemma_server.errors import BRANCH, ApiError, as_api_error, bad_request, invalid_request, param_from_loc
from gemma_server.frontends.fields import FieldNames
from gemma_server.frontends.messages_format import MessagesFormat, error_body
from gemma_server.protocol.base import Integer, OpenAIModel
from gemma_server.protocol.limits import (
    FUNCTION_NAME,
    MAX_MESSAGES,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
)
from gemma_server.protocol.requests import ChatCompletionRequest
from gemma_server.serving import client_of, gone_of, merged, reply

if TYPE_CHECKING:
    from gemma_server.state import ServerState

# Tool names: the server's rule for function names (protocol.limits.FUNCTION_NAME, OpenAI's), the same as Anthropic's
# for client tools (its tool-use guide: `^[a-zA-Z0-9_-]{1,64}$`).
Name = Annotated[str, StringConstraints(pattern=f"^{FUNCTION_NAME.pattern}$")]
# Anthropic's `cache_control` ({"type": "ephemeral", "ttl": ...}) marks a prompt-cache breakpoint; the prefix
# cache here finds shared prefixes by itself, so the marker is accepted and ignored.
CacheControl = dict[str, Any] | None


# Anthropic's extended thinking takes a budget of at least 1,024 tokens (the reference's `budget_tokens`).
MIN_THINKING_BUDGET = 1024


def _integer(**bounds: int) -> Any:
    """protocol.base.Integer (1.0 is 1, as JSON Schema reads it) with bounds, which the document shows (pydantic
    documents a bound placed before Integer's validator, also in an optional field)."""
    return Annotated[(int, Field(**bounds), *Integer.__metadata__)]


PositiveInteger = _integer(ge=1)
NonNegativeInteger = _integer(ge=0)
ThinkingBudget = _integer(ge=MIN_THINKING_BUDGET)


# Blocks in one content list (a user turn, the system prompt, a tool_result). A user turn answers at most the
# MAX_TOOL_CALLS calls of the assistant turn before it, so twice that leaves room for its text. It is smaller
# than chat's MAX_CONTENT_PARTS because blocks nest: a message list one past MAX_MESSAGES whose turns are at
# this cap still fits the default --max-body-bytes, so it is refused for its length (a 400, as the document
# says), not for its size (a 413).
MAX_BLOCKS = 2 * MAX_TOOL_CALLS


class _Block(BaseModel):
    """Base of the nested request models: strict as protocol/content.py's, unknown fields kept (and ignored)."""

    model_config = ConfigDict(extra="allow", strict=True)


# ---- request: content blocks (reference field order: required fields first) -------------------------


class TextBlockParam(_Block):
    text: str
    type: Literal["text"]
    cache_control: CacheControl = None


class ToolUseBlockParam(_Block):
    """An assistant's call: becomes one of its chat message's `tool_calls`."""

    id: Annotated[str, StringConstraints(min_length=1)]
    input: dict[str, Any]
    name: Name
    type: Literal["tool_use"]
    cache_control: CacheControl = None


class ToolResultBlockParam(_Block):
    """A user turn's answer to one `tool_use` of the assistant turn before it: becomes a `tool` message."""

    tool_use_id: str
    type: Literal["tool_result"]
    cache_control: CacheControl = None
    content: str | Annotated[list[TextBlockParam], Field(max_length=MAX_BLOCKS)] | None = None
    is_error: bool | None = None


class ThinkingBlockParam(_Block):
    """An assistant turn's thought: becomes its `reasoning_content`. The signature is kept by clients to
    hand back; nothing here signs thoughts, so it is not read."""

    signature: str
    thinking: str
    type: Literal["thinking"]


UserBlock = Annotated[TextBlockParam | ToolResultBlockParam, Field(discriminator="type")]
AssistantBlock = Annotated[TextBlockParam | ToolUseBlockParam | ThinkingBlockParam, Field(discriminator="type")]


class UserMessageParam(_Block):
    content: str | Annotated[list[UserBlock], Field(min_length=1, max_length=MAX_BLOCKS)]
    role: Literal["user"]


class AssistantMessageParam(_Block):
    # At most MAX_TOOL_CALLS blocks: each tool_use becomes one of the chat message's tool_calls, which holds
    # at most that many.
    content: str | Annotated[list[AssistantBlock], Field(min_length=1, max_length=MAX_TOOL_CALLS)]
    role: Literal["assistant"]


MessageParam = Annotated[UserMessageParam | AssistantMessageParam, Field(discriminator="role")]


# ---- request: tools, tool_choice, thinking, metadata ------------------------------------------------


class InputSchema(_Block):
    """A tool's input as JSON Schema: an object (the reference's `InputSchema`)."""

    type: Literal["object"]
    properties: dict[str, Any] | None = None
    required: list[str] | None = None


class ToolParam(_Block):
    """A client tool. Server tools (web search, code execution, ...) carry a `type` of their own: the server
    cannot run them, so any type but `custom` is refused naming `tools[i].type`."""

    input_schema: InputSchema
    name: Name
    cache_control: CacheControl = None
    description: str | None = None
    type: Literal["custom"] | None = None


class ToolChoiceAutoParam(_Block):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAnyParam(_Block):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceToolParam(_Block):
    name: Name
    type: Literal["tool"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNoneParam(_Block):
    type: Literal["none"]


ToolChoiceParam = Annotated[ToolChoiceAutoParam | ToolChoiceAnyParam | ToolChoiceToolParam | ToolChoiceNoneParam,
                            Field(discriminator="type")]


class ThinkingConfigEnabledParam(_Block):
    """Thinking on. The engine has no separate thought budget: max_tokens bounds thought and answer
    together (as Anthropic counts thinking tokens towards max_tokens), so `budget_tokens` is not enforced."""

    budget_tokens: ThinkingBudget
    type: Literal["enabled"]


class ThinkingConfigAdaptiveParam(_Block):
    """The model decides whether to think: the template's thinking is on, and the model may leave its
    thought empty."""

    type: Literal["adaptive"]


class ThinkingConfigDisabledParam(_Block):
    type: Literal["disabled"]


ThinkingConfigParam = Annotated[
    ThinkingConfigEnabledParam | ThinkingConfigAdaptiveParam | ThinkingConfigDisabledParam,
    Field(discriminator="type")]


class MetadataParam(_Block):
    user_id: str | None = None


# tool_choice any or tool needs at least one tool (JSON Schema of `MessagesRequest.check`'s rule).
FORCED_TOOL_RULE = {"anyOf": [
    {"properties": {"tool_choice": {"not": {"type": "object", "required": ["type"],
                                            "properties": {"type": {"enum": ["any", "tool"]}}}}}},
    {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}]}

StopSequence = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_LENGTH)]


class MessagesRequest(OpenAIModel):
    """POST /v1/messages. Field order: Anthropic's API reference."""

    model_config = ConfigDict(json_schema_extra={"allOf": [FORCED_TOOL_RULE]})

    model: str
    messages: Annotated[list[MessageParam], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: PositiveInteger
    metadata: MetadataParam | None = None
    stop_sequences: Annotated[list[StopSequence], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    system: str | Annotated[list[TextBlockParam], Field(max_length=MAX_BLOCKS)] | None = None
    # Anthropic's range is [0, 1] (chat's is [0, 2]).
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    thinking: ThinkingConfigParam | None = None
    tool_choice: ToolChoiceParam | None = None
    tools: Annotated[list[ToolParam], Field(max_length=MAX_TOOLS)] | None = None
    top_k: NonNegativeInteger | None = None
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)

    def check(self) -> None:
        """The rules between fields that no single field's schema states.

        Raises:
            ApiError: 400 naming the field: a forced tool_choice without tools or naming a tool that tools
                lacks, a tool_result that answers no tool_use of the assistant turn before it, a final
                assistant message (prefill).
        """
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise bad_request("tool_choice", f"tool_choice {choice.type} needs tools.")
        if isinstance(choice, ToolChoiceToolParam) and choice.name not in {t.name for t in self.tools}:
            raise bad_request("tool_choice.name", f"tool_choice names {choice.name[:80]!r}, which is not in tools.")
        called: set[str] = set()  # the tool_use ids of the assistant turn just before
        for i, m in enumerate(self.messages):
            blocks = m.content if isinstance(m.content, list) else []
            if m.role == "user":
                for j, b in enumerate(blocks):
                    if b.type == "tool_result" and b.tool_use_id not in called:
                        param = f"messages[{i}].content[{j}].tool_use_id"  # worded as chat's (fold_tool_results)
                        raise bad_request(param, f"{param} {b.tool_use_id[:80]!r} answers no tool_use block of the "
                                                 "assistant message before it.")
            called = {b.id for b in blocks if b.type == "tool_use"} if m.role == "assistant" else set()
        last = len(self.messages) - 1
        if self.messages[last].role == "assistant":
            raise bad_request(f"messages[{last}].role", (
                "A final assistant message (prefill) is not supported: the reply is a new turn, not the "
                "continuation of that message; end the conversation with a user message."))


# ---- the translation to chat -------------------------------------------------------------------------

# Chat fields -> the Anthropic field they come from, for the fields that are not per message or per tool.
TOP_FIELDS = {
    "model": "model", "messages": "messages", "max_tokens": "max_tokens", "stop": "stop_sequences",
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "tools": "tools",
    "tool_choice": "tool_choice", "tool_choice.function": "tool_choice",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use", "chat_template_kwargs": "thinking",
    "user": "metadata.user_id",
}


@dataclass(frozen=True)
class Translation:
    """A Messages request as the chat completion request that serves it.

    Attributes:
        chat: the chat request.
        names: where its fields came from (a 400 from chat's checks names the Anthropic field).
    """

    chat: ChatCompletionRequest
    names: FieldNames


def _text(blocks: list[TextBlockParam]) -> str:
    """Text blocks as one text: joined by a newline, as vLLM's chat_utils joins text parts."""
    return "\n".join(b.text for b in blocks)


def _result_text(block: ToolResultBlockParam) -> str:
    """A tool_result's content as a tool message's. An error result is the object {"error": text}, the shape
    Gemma 4's templates render as a function's error response (`response:f{error:...}`): a chat tool message
    has no error flag of its own."""
    content = block.content
    text = content if isinstance(content, str) else _text(content or [])
    return json.dumps({"error": text}, ensure_ascii=False) if block.is_error else text


def to_chat(request: MessagesRequest) -> Translation:
    """The chat completion request that serves `request`, and where each of its fields came from.

    Raises:
        ApiError: 400 naming the Anthropic field (`MessagesRequest.check`; more chat messages than
            MAX_MESSAGES once each tool_result is one).
    """
    request.check()
    messages: list[dict[str, Any]] = []
    fields = dict(TOP_FIELDS)

    def add(message: dict[str, Any], source: str, **under: str) -> None:
        k = len(messages)
        messages.append(message)
        fields[f"messages[{k}]"] = source
        for chat_field, anthropic_field in under.items():
            fields[f"messages[{k}].{chat_field}"] = anthropic_field

    if request.system is not None:
        system = request.system if isinstance(request.system, str) else _text(request.system)
        add({"role": "system", "content": system}, "system", content="system")
    for i, m in enumerate(request.messages):
        at = f"messages[{i}]"
        if isinstance(m.content, str):
            add({"role": m.role, "content": m.content}, at, content=f"{at}.content")
            continue
        if m.role == "user":
            texts = [b for b in m.content if b.type == "text"]
            for j, b in enumerate(m.content):
                if b.type == "tool_result":
                    block = f"{at}.content[{j}]"
                    add({"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b)}, block,
                        tool_call_id=f"{block}.tool_use_id", content=f"{block}.content")
            if texts:  # a turn of tool results alone adds no user message
                add({"role": "user", "content": _text(texts)}, at, content=f"{at}.content")
            continue
        calls, thoughts, texts, under = [], [], [], {"content": f"{at}.content"}
        for j, b in enumerate(m.content):
            block = f"{at}.content[{j}]"
            if b.type == "tool_use":
                c = len(calls)
                calls.append({"id": b.id, "type": "function",
                              "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
                under |= {f"tool_calls[{c}]": block, f"tool_calls[{c}].function": block,
                          f"tool_calls[{c}].function.arguments": f"{block}.input"}
            elif b.type == "thinking":
                under.setdefault("reasoning_content", f"{block}.thinking")
                thoughts.append(b.thinking)
            else:
                texts.append(b)
        message: dict[str, Any] = {"role": "assistant", "content": _text(texts) if texts else None}
        if calls:
            message["tool_calls"] = calls
        if thoughts:
            message["reasoning_content"] = "\n".join(thoughts)
        add(message, at, **under)
    if len(messages) > MAX_MESSAGES:
        raise bad_request("messages", f"messages must hold at most {MAX_MESSAGES} messages once each tool_result "
                                      f"counts as one, got {len(messages)}.")

    chat: dict[str, Any] = {"model": request.model, "messages": messages, "max_tokens": request.max_tokens,
                            "stream": request.stream}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(request, name) is not None:
            chat[name] = getattr(request, name)
    if request.stop_sequences:
        chat["stop"] = list(request.stop_sequences)
    if request.metadata is not None and request.metadata.user_id is not None:
        chat["user"] = request.metadata.user_id
    if request.thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": request.thinking.type != "disabled"}
    for i, tool in enumerate(request.tools or ()):
        fields[f"tools[{i}].function"] = f"tools[{i}]"
        fields[f"tools[{i}].function.parameters"] = f"tools[{i}].input_schema"
        # A null `properties` or `required` is the keyword's absence (the SDK's InputSchema makes both optional).
        schema = {k: v for k, v in tool.input_schema.model_dump(exclude_unset=True).items()
                  if v is not None or k not in ("properties", "required")}
        function = {"name": tool.name, "parameters": schema}
        if tool.description is not None:
            function["description"] = tool.description
        chat.setdefault("tools", []).append({"type": "function", "function": function})
    choice = request.tool_choice
    if choice is not None:
        chat["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                               else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
        if getattr(choice, "disable_parallel_tool_use", None):
            chat["parallel_tool_calls"] = False
    names = FieldNames(fields)
    try:
        return Translation(ChatCompletionRequest.model_validate(chat), names)
    except ValidationError as e:  # a value the Messages models allow and chat's do not: named all the same
        raise names.error(invalid_request(e.errors(), chat)) from None


async def serve(state: ServerState, body: MessagesRequest, request: Request) -> Response:
    """POST /v1/messages: the request as a chat request (`to_chat`), admitted by the one path
    (`ServerState.start`), its reply through `serving.reply` as Anthropic's message or events (errors:
    `AnthropicRoute`)."""
    translation = to_chat(body)
    try:
        gens = await state.start(translation.chat, client_of(request), gone_of(request), receive=request.receive)
    except ApiError as e:
        raise translation.names.error(e) from None
    return await reply(request, merged(gens), MessagesFormat(state.config.model_name, gens[0]), bool(body.stream))


# ---- errors -----------------------------------------------------------------------------------------

_BLOCK_TYPES = "text, tool_use, tool_result (user turns) and thinking (assistant turns) blocks"


def invalid_body(errors: list[dict[str, Any]], body: Any) -> ApiError:
    """The 400 for a body the request models refuse, naming the most specific field at fault: the deepest
    error (a block inside `content` rather than the `content: string` branch of its union), a wrong `type`
    before the fields that type would need.

    The path is errors.param_from_loc's (read against the body, past the unions' branches and tags); unlike
    errors.invalid_request, an unsupported block or tool type says so.
    """
    if not errors or errors[0].get("type") == "json_invalid":
        return invalid_request(errors)
    first = next((e for e in errors if e.get("type") == "too_long"), None)
    first = first or max(errors, key=lambda e: (len(e.get("loc", ())), e.get("type") in _TYPE_ERRORS))
    param = param_from_loc(tuple(first.get("loc", ())), body)
    kind, ctx = first.get("type"), first.get("ctx") or {}
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        param = f"{param}.{str(ctx.get('discriminator', 'type')).strip(chr(39))}"
    blocks = re.search(r"(content|system)\[\d+\]\.type$", param or "") is not None
    if kind == "union_tag_not_found":
        message = f"{param} is missing."
    elif kind == "literal_error" and re.fullmatch(r"tools\[\d+\]\.type", param or ""):
        message = (f"{param}: {first.get('input')!r} is a server tool, which this server cannot run; only client "
                   "tools (type 'custom' or absent) are supported.")
    elif kind in ("union_tag_invalid", "literal_error") and (param or "").endswith((".type", ".role")):
        tag = ctx.get("tag", first.get("input"))
        message = f"{param}: {tag!r} is not supported here; expected {ctx.get('expected_tags') or ctx.get('expected')}."
    else:
        message = f"{param or 'body'}: {first.get('msg')}"
    if blocks:
        message += f" This server reads {_BLOCK_TYPES}."
    others = [e for e in errors if e is not first and not _alternative(e.get("loc", ()), first.get("loc", ()))]
    if others:
        message += f" (and {len(others)} more problem{'s' if len(others) > 1 else ''})"
    return ApiError(400, message, param)


_TYPE_ERRORS = ("literal_error", "union_tag_invalid", "union_tag_not_found")


def _alternative(a: tuple, b: tuple) -> bool:
    """Whether two error locations are two branches of one union (where they part, both name a branch):
    one input refused two ways, one problem."""
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return k is not None and all(isinstance(x, str) and BRANCH.fullmatch(x) for x in (a[k], b[k]))


class AnthropicRoute(APIRoute):
    """A route whose every error, the body's validation included, is the server's error object with
    Anthropic's `"type": "error"` (`error_body`), with its status and headers (a 429's Retry-After). The
    handler wrapper is FastAPI's documented way to handle a route's own validation errors ("Custom Request
    and APIRoute class")."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                err = invalid_body(list(e.errors()), e.body)
            except StarletteHTTPException as e:  # a body that is not UTF-8 text, as the app's handler says it
                err = ApiError(e.status_code, str(e.detail), headers=e.headers)
            except Exception as e:  # noqa: BLE001 - as the app's handlers answer them (as_api_error logs)
                err = as_api_error(e)
            return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)

        return route
