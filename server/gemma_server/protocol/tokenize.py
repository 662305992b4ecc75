"""POST /tokenize and POST /detokenize (vLLM's shapes)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from gemma_server.errors import bad_request
from gemma_server.openapi import documented
from gemma_server.protocol.base import Integer, OpenAIModel
from gemma_server.protocol.content import ChatMessage, Tool
from gemma_server.protocol.limits import MAX_MESSAGES, MAX_TOOLS
from gemma_server.protocol.requests import ChatCompletionRequest




class TokenizeRequest(OpenAIModel):
    """POST /tokenize (vLLM's `TokenizeCompletionRequest` / `TokenizeChatRequest`): a prompt, or messages
    rendered with the chat template."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}, "required": ["prompt"]},
        {"properties": {"prompt": {"type": "null"}, "messages": {"type": "array"}}, "required": ["messages"]}]})

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = documented(minItems=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("prompt", "Send exactly one of prompt and messages.")
        if self.messages is not None and not self.messages:
            raise bad_request("messages", "messages must hold at least one message.")

    def as_chat(self) -> ChatCompletionRequest:
        """The messages as a chat request, to render them as /v1/chat/completions does."""
        return ChatCompletionRequest(messages=self.messages, tools=self.tools,
                                     add_generation_prompt=self.add_generation_prompt,
                                     chat_template_kwargs=self.chat_template_kwargs)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: Annotated[list[Integer], Field(max_length=1 << 20)]


class DetokenizeResponse(BaseModel):
    prompt: str
