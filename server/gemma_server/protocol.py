"""What /v1/chat/completions and /v1/completions accept and return.

Design: vLLM's `vllm/entrypoints/openai/chat_completion/protocol.py` and `completion/protocol.py`.
Request fields follow the OpenAI API reference's order; our extensions (the vLLM ones a greedy engine can
use) are fenced below the standard fields. Unknown fields are accepted and logged as ignored, as vLLM's
`OpenAIBaseModel` does. Turning a request into engine parameters is a pure method
(`GenerationRequest.engine_params`), so it is unit-tested without a socket or an engine.

The engine decodes greedily. A sampling field that would change the output (temperature > 0, top_p < 1,
penalties, logit_bias, n > 1, ...) is refused with 400 naming it rather than silently ignored: a client
asking for sampling should learn it does not get it. `seed` and `user` are accepted (greedy decoding needs
no seed).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gemma_server.errors import bad_request

log = logging.getLogger(__name__)

# Completions default to 16 new tokens when max_tokens is absent (OpenAI reference; vLLM keeps it).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class OpenAIModel(BaseModel):
    """Base of every request: unknown fields are kept so they can be logged, then ignored."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_ignored_fields(self) -> OpenAIModel:
        if self.model_extra:
            log.warning("ignored unknown request fields: %s", ", ".join(sorted(self.model_extra)))
        return self


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension; accepted, not used


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


@dataclass(frozen=True)
class EngineParams:
    """One decode, as the engine thread runs it.

    Attributes:
        prompt_ids: the prompt's token ids.
        max_new: most tokens to generate (already capped at context - prompt).
        stop_ids: token ids that end the decode (besides the model's eos ids).
        stop: strings that end the output, matched in the detokenized text.
    """

    prompt_ids: tuple[int, ...]
    max_new: int
    stop_ids: tuple[int, ...]
    stop: tuple[str, ...]


class GenerationRequest(OpenAIModel):
    """Fields and checks shared by chat and legacy completions."""

    def _unsupported(self) -> None:
        """Raise 400 naming the first field whose value asks for something greedy decoding cannot do."""
        g = lambda name: getattr(self, name, None)  # noqa: E731 - fields differ between the two requests
        temperature = g("temperature")
        if temperature is not None and temperature < 0:
            raise bad_request("temperature", "temperature must be >= 0.")
        if temperature is not None and temperature > 0:
            raise bad_request(
                "temperature", "Only greedy decoding is supported: temperature must be 0 or absent."
            )
        if g("top_p") is not None and g("top_p") != 1:
            raise bad_request("top_p", "Only greedy decoding is supported: top_p must be 1 or absent.")
        if g("n") is not None and g("n") != 1:
            raise bad_request("n", "Only one choice per request is supported: n must be 1.")
        for name in ("frequency_penalty", "presence_penalty"):
            if g(name):
                raise bad_request(name, f"{name} is not supported: it must be 0 or absent.")
        if g("logit_bias"):
            raise bad_request("logit_bias", "logit_bias is not supported.")
        if g("logprobs") or g("top_logprobs"):
            name = "logprobs" if g("logprobs") else "top_logprobs"
            raise bad_request(name, f"{name} is not supported.")
        # vLLM extensions with their neutral values.
        if g("top_k") not in (None, 0, -1, 1):
            raise bad_request("top_k", "Only greedy decoding is supported: top_k must be 0, -1, 1 or absent.")
        if g("min_p") not in (None, 0):
            raise bad_request("min_p", "min_p is not supported: it must be 0 or absent.")
        if g("repetition_penalty") not in (None, 1):
            raise bad_request("repetition_penalty", "repetition_penalty is not supported: it must be 1 or absent.")
        if g("ignore_eos"):
            raise bad_request("ignore_eos", "ignore_eos is not supported.")
        if g("min_tokens"):
            raise bad_request("min_tokens", "min_tokens is not supported: it must be 0 or absent.")
        if g("seed") is not None and not (-(2**63) <= g("seed") < 2**63):
            raise bad_request("seed", "seed must fit in a signed 64-bit integer.")

    def stop_strings(self) -> tuple[str, ...]:
        stop = getattr(self, "stop", None)
        if stop is None:
            return ()
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(s == "" for s in stops):
            raise bad_request("stop", "stop strings must not be empty.")
        return stops

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens (OpenAI reference, vLLM)."""
        mct = getattr(self, "max_completion_tokens", None)
        if mct is not None:
            return mct
        return self.max_tokens

    def default_max_tokens(self) -> int | None:
        return None

    def check(self) -> None:
        """Every check that needs no tokenizer; raises ApiError(400) naming the field."""
        self._unsupported()
        self.stop_strings()
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options", "stream_options is only allowed when stream is true.")
        requested = self.requested_max_tokens()
        if requested is not None and requested < 1:
            name = "max_completion_tokens" if getattr(self, "max_completion_tokens", None) is not None else "max_tokens"
            raise bad_request(name, f"{name} must be at least 1.")

    def engine_params(self, prompt_ids: list[int], context: int, vocab_size: int) -> EngineParams:
        """Turn this request and its tokenized prompt into one engine decode.

        Args:
            prompt_ids: the prompt, tokenized (chat template applied for chat).
            context: the engine's context (most tokens, prompt + generated).
            vocab_size: ids must lie in [0, vocab_size).
        Returns:
            EngineParams with max_new capped at context - len(prompt) (vLLM's `get_max_tokens`).
        Raises:
            ApiError: 400 naming the field: a bad sampling field, an empty or too long prompt, a token id
                out of range.
        """
        self.check()
        prompt_field = self._prompt_field()
        if not prompt_ids:
            raise bad_request(prompt_field, "The prompt is empty.")
        if len(prompt_ids) >= context:
            raise bad_request(
                prompt_field,
                f"Input length ({len(prompt_ids)}) exceeds the model's maximum context length ({context}): "
                "the prompt must leave room for at least one new token.",
            )
        bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(prompt_field, f"Token id {bad[0]} is outside the vocabulary [0, {vocab_size}).")
        stop_ids = tuple(self.stop_token_ids or ())
        bad = [t for t in stop_ids if not 0 <= t < vocab_size]
        if bad:
            raise bad_request("stop_token_ids", f"Token id {bad[0]} is outside the vocabulary [0, {vocab_size}).")
        room = context - len(prompt_ids)
        requested = self.requested_max_tokens()
        if requested is None:
            requested = self.default_max_tokens()
        max_new = room if requested is None else min(requested, room)
        return EngineParams(tuple(prompt_ids), max_new, stop_ids, self.stop_strings())

    def _prompt_field(self) -> str:
        return "prompt"


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions. Field order: OpenAI API reference (as vLLM's ChatCompletionRequest)."""

    messages: list[ChatMessage]
    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_tokens: int | None = Field(default=None, description="Deprecated by OpenAI; max_completion_tokens wins.")
    max_completion_tokens: int | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None

    # --- extensions (vLLM's names) -------------------------------------------------------------
    stop_token_ids: list[int] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # --- end of extensions -------------------------------------------------------------------

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise bad_request("messages", "messages must hold at least one message.")
        if self.tools:
            raise bad_request("tools", "Tool calling is not supported.")
        if self.tool_choice not in (None, "none"):
            raise bad_request("tool_choice", "Tool calling is not supported: tool_choice must be none or absent.")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("response_format", "Only response_format type text is supported.")
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                for part in m.content:
                    if part.type != "text" or part.text is None:
                        raise bad_request(
                            f"messages[{i}].content", f"Only text content parts are supported, not {part.type!r}."
                        )

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template wants them: text content parts joined into one string."""
        out = []
        for m in self.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(p.text or "" for p in content)
            out.append({"role": m.role, "content": content or ""})
        return out

    def _prompt_field(self) -> str:
        return "messages"


class CompletionRequest(GenerationRequest):
    """POST /v1/completions (legacy). Field order: OpenAI API reference."""

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool | None = False
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None
    max_tokens: int | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None

    # --- extensions (vLLM's names) -------------------------------------------------------------
    stop_token_ids: list[int] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    # --- end of extensions -------------------------------------------------------------------

    def default_max_tokens(self) -> int | None:
        return COMPLETIONS_DEFAULT_MAX_TOKENS

    def check(self) -> None:
        super().check()
        if self.best_of not in (None, 1):
            raise bad_request("best_of", "best_of must be 1 or absent.")
        if self.echo:
            raise bad_request("echo", "echo is not supported.")
        if self.suffix:
            raise bad_request("suffix", "suffix is not supported.")
        self.single_prompt()

    def single_prompt(self) -> str | list[int]:
        """The one prompt: a string or a list of token ids (a batch of one is unwrapped).

        Raises:
            ApiError: 400 on a batch of several prompts or an empty one.
        """
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise bad_request("prompt", "The prompt is empty.")
        if all(isinstance(x, int) for x in p):
            return list(p)
        if len(p) != 1:
            raise bad_request("prompt", f"Only one prompt per request is supported, got {len(p)}.")
        return p[0]


# ---- responses ---------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timings(BaseModel):
    """Extension: the engine's own clocks for this request (like llama.cpp's `timings`)."""

    prompt_read_seconds: float
    decode_seconds: float


FinishReason = Literal["stop", "length", "abort"]


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: None = None
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
    logprobs: None = None
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
