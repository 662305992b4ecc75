"""What a chat message holds (text, image and audio parts, tool calls), tools, tool_choice and response
formats, in OpenAI's shapes (the openai SDK's `types/chat/`), and a JSON Schema given as its text (`schema_of`)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from gemma_server.errors import bad_request
from gemma_server.openapi import documented
from gemma_server.protocol.limits import FUNCTION_NAME, MAX_CONTENT_PARTS, MAX_TOOL_CALLS




class TextPart(BaseModel):
    """A text content part."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    url: str = Field(description="A data URL (data:image/png;base64,...); an http(s) URL only on a server that "
                                 "fetches from its host (--media-fetch-hosts).")
    detail: Literal["auto", "low", "high"] | None = Field(
        default=None, description="Accepted; every image is read at the checkpoint's processor size.")


class ImagePart(BaseModel):
    """An image (OpenAI's `image_url` part), in a user message, for a checkpoint with a vision tower."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    data: str = Field(description="The file's bytes in base64.")
    format: Literal["wav", "mp3", "flac"] = Field(description="Informative: the file is read by its content.")


class AudioPart(BaseModel):
    """A clip of at most 30 s (OpenAI's `input_audio` part), in a user message, for a checkpoint with an audio
    tower."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["input_audio"]
    input_audio: InputAudio


def part_type(value: Any) -> str | None:
    """A content part's `type` (a dict's or a model's), for the parts' discriminators."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else None


ContentPart = Annotated[
    Annotated[TextPart, Tag("text")] | Annotated[ImagePart, Tag("image_url")]
    | Annotated[AudioPart, Tag("input_audio")],
    Discriminator(part_type, custom_error_type="invalid_part", custom_error_message=(
        "A content part is text, image_url or input_audio."))]


class FunctionCall(BaseModel):
    """An assistant message's call: `arguments` is a JSON object's text (OpenAI's shape)."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(json_schema_extra={"pattern": f"^{FUNCTION_NAME.pattern}$"})
    arguments: str


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# Per role, as `ChatCompletionRequest._check_tools` and `_check_parts` enforce it: a tool message has a
# tool_call_id, only an assistant message carries tool_calls, and only a user message images and audio.
MESSAGE_ROLE_RULES = [
    {"anyOf": [{"properties": {"role": {"not": {"const": "tool"}}}},
               {"properties": {"tool_call_id": {"type": "string"}}, "required": ["tool_call_id"]}]},
    {"anyOf": [{"properties": {"role": {"const": "assistant"}}},
               {"properties": {"tool_calls": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}}}]},
    {"anyOf": [{"properties": {"role": {"const": "user"}}},
               {"properties": {"content": {"not": {"type": "array", "contains": {
                   "type": "object", "properties": {"type": {"enum": ["image_url", "input_audio"]}},
                   "required": ["type"]}}}}}]},
]


class ChatMessage(BaseModel):
    """One message. An assistant message may carry `tool_calls` (its content then may be null); a `tool`
    message answers one of them by `tool_call_id`; a user message may hold images and audio among its parts."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"allOf": MESSAGE_ROLE_RULES})
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: str | None = None
    # vLLM's extension: an assistant turn's thought, which Gemma 4's templates render between the tool calls
    # that follow the last user turn (chat_template.gemma_turns).
    reasoning_content: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(json_schema_extra={"pattern": f"^{FUNCTION_NAME.pattern}$"})
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


# What of a tool's function the chat template sees (`template_tools`).
TEMPLATE_FUNCTION_KEYS = frozenset({"name", "description", "parameters"})


class Tool(BaseModel):
    """A function the model may call (OpenAI's `tools[]`)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: exactly that function is called."""

    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    function: NamedFunction


# response_format json_schema carries its json_schema.
JSON_SCHEMA_FORMAT_RULE = {"anyOf": [{"properties": {"type": {"enum": ["text", "json_object"]}}},
                                     {"properties": {"json_schema": {"type": "object"}}, "required": ["json_schema"]}]}



class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema` (OpenAI): the schema is `schema`."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, json_schema_extra={"allOf": [JSON_SCHEMA_FORMAT_RULE]})
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (vllm/sampling_params.py `StructuredOutputsParams`): one constraint.
    `json` (a schema, or its text) and `choice` and `grammar` (llguidance Lark, llguidance's
    docs/syntax.md) are supported; the other kinds are refused naming them."""

    # Unknown keys are kept to be refused by name (`_structured`), so the document allows none.
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"additionalProperties": False})
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = documented(enum=[None], description="Not supported.")
    choice: Annotated[list[str], Field(max_length=256)] | None = documented(minItems=1)
    grammar: str | None = None
    json_object: bool | None = None


def schema_of(value: dict[str, Any] | str | None, param: str) -> dict[str, Any] | None:
    """A JSON Schema given as an object or as its text (vLLM takes both).

    Raises:
        ApiError: 400 naming `param` when the text is not JSON or not a schema.
    """
    if value is None or isinstance(value, dict):
        return value
    try:
        schema = json.loads(value)
    except ValueError as e:
        raise bad_request(param, f"{param} is not a JSON Schema: {e}") from e
    if not isinstance(schema, (dict, bool)):
        raise bad_request(param, f"{param} must be a JSON Schema object.")
    return schema if isinstance(schema, dict) else ({} if schema else {"not": {}})
