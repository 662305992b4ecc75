"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API, on the chat path.

Design: the OpenAI API reference's Responses endpoints and the openai SDK's types (openai 3.57.0
`openai/types/responses/`: `response_create_params.py`, `response.py`, `response_stream_event.py`) and its
stream helper (`openai/lib/streaming/responses/_responses.py`, which rebuilds the response from the events and
checks their order); vLLM's `vllm/entrypoints/openai/serving_responses.py` turns a Responses request into chat
messages the same way.

A request becomes a `protocol.requests.ChatCompletionRequest` (`to_chat`, pure): `instructions` a leading system
message, `input` items chat messages (a message's text parts joined; `reasoning`, an assistant message and its
`function_call` items one assistant message with reasoning_content and tool_calls; `function_call_output` a
`tool` message, which chat_template.py puts where Gemma 4's template wants tool results; a user message's
`input_image` and `input_audio` parts chat's `image_url` and `input_audio` parts), `tools` and
`tool_choice` chat's, `text.format` chat's response_format, `reasoning.effort` the template's
enable_thinking, `max_output_tokens` max_tokens. It then takes the one path every request takes
(`ServerState.start`: the same checks, client share, queue, metrics and cancellation as chat), and a 400 from
the chat checks is renamed to the Responses field it came from (`ChatFromResponses.names`). The reply, as
output items or the SDK's event sequence, is responses_format.py's.

Stored responses (`store`, default true as OpenAI's) are kept by response_store.py's `ResponseStore`, for the
bearer token that made them, with `metadata` by OpenAI's bounds; `previous_response_id` continues a
conversation (its instructions are not carried over, as OpenAI documents) and GET/DELETE read and remove it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from gemma_server.errors import ApiError, bad_request, invalid_request
from gemma_server.frontends.fields import FieldNames
from gemma_server.frontends.responses_format import ResponsesFormat, assistant_message
from gemma_server.openapi import documented
from gemma_server.protocol.base import Integer, OpenAIModel
from gemma_server.protocol.content import InputAudio, part_type
from gemma_server.protocol.limits import FUNCTION_NAME, MAX_CACHE_SALT, MAX_MESSAGES, MAX_TOOLS, MAX_TOP_LOGPROBS, SEED
from gemma_server.protocol.requests import ChatCompletionRequest
from gemma_server.response_store import owner_of
from gemma_server.serving import client_of, gone_of, merged, reply

if TYPE_CHECKING:
    from gemma_server.state import ServerState

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
    """A Responses request as chat: the request, where its fields came from (a 400 from chat's checks names
    the Responses field), and the conversation without instructions (what a stored response keeps)."""

    request: ChatCompletionRequest
    names: FieldNames
    history: list[dict[str, Any]]


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
    return ChatFromResponses(request, field_names(origins, call_origins), history)


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


# Chat's field names -> the Responses API's, for the fields that are not per message or per tool.
TOP_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens",
              "response_format.json_schema.schema": "text.format.schema", "response_format": "text.format",
              "logprobs": "top_logprobs"}
# Chat's names a message may mention, wherever they are in it.
WORDS = {"max_tokens": "max_output_tokens", "response_format": "text.format"}
# Tool i's chat fields are under `tools[i].function`, its Responses fields under `tools[i]`.
TOOL_FIELDS = {f"tools[{i}].function": f"tools[{i}]" for i in range(MAX_TOOLS)}


def field_names(origins: list[str], call_origins: dict[int, list[str]]) -> FieldNames:
    """Where each chat field came from: chat message k from `origins[k]` (an `input[i]` item, under which its
    fields map; or all of `instructions` or `previous_response_id`), its tool call j from `call_origins[k][j]`
    (a function_call item, whose fields are the call's function's), a message past them from `input`. Pure."""
    fields = dict(TOP_FIELDS) | TOOL_FIELDS
    whole = {"messages"}
    for k, origin in enumerate(origins):
        fields[f"messages[{k}]"] = origin
        if not origin.startswith("input["):
            whole.add(f"messages[{k}]")
    for k, items in call_origins.items():
        fields |= {f"messages[{k}].tool_calls[{j}].function": item for j, item in enumerate(items)}
    return FieldNames(fields, frozenset(whole), WORDS)




async def serve(state: ServerState, body: ResponsesRequest, request: Request) -> Response:
    """POST /v1/responses: the request as chat (`to_chat`), through `ServerState.start` as every request, then
    its reply through `serving.reply` as a response object or the Responses stream; stored unless `store` is
    false."""
    owner = owner_of(request.headers.get("authorization"))
    body.check()
    earlier = None
    if body.previous_response_id is not None:
        earlier = state.responses.get(body.previous_response_id, owner, "previous_response_id").conversation
    chat = to_chat(body, earlier)
    try:
        gens = await state.start(chat.request, client_of(request), gone_of(request), receive=request.receive)
    except ApiError as e:
        raise chat.names.error(e) from e

    def keep(response: dict[str, Any]) -> None:
        if body.store is not False:
            state.responses.put(owner, response, chat.history + [assistant_message(response)])

    fmt = ResponsesFormat(body, state.config.model_name, gens[0], state.token_text, keep)
    return await reply(request, merged(gens), fmt, bool(body.stream))
