"""The replies: chat completion and completion objects, usage, log-probabilities, the model list."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field




class PromptTokensDetails(BaseModel):
    """OpenAI's `usage.prompt_tokens_details`: of the prompt tokens, how many came from the prefix cache."""

    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class Timings(BaseModel):
    """Extension: the engine's own clocks for this request (like llama.cpp's `timings`)."""

    prompt_read_seconds: float
    decode_seconds: float


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object's text


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)
    reasoning_content: str | None = None  # vLLM's extension: the thought channel's text


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """OpenAI's `choices[].logprobs` of a chat completion."""

    content: list[TokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions API's `choices[].logprobs`."""

    tokens: list[str]
    token_logprobs: list[float | None]  # echo: the prompt's first token has none
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str
    timings: Timings  # extension


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str
    timings: Timings  # extension


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "gemma-rust-operator"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
