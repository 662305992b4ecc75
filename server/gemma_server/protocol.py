"""What /v1/chat/completions and /v1/completions accept and return.

Design: vLLM's `vllm/entrypoints/openai/chat_completion/protocol.py` and `completion/protocol.py`.
Request fields follow the OpenAI API reference's order; our extensions (the vLLM ones a greedy engine can
use) are fenced below the standard fields. Unknown fields are accepted and logged as ignored, as vLLM's
`OpenAIBaseModel` does. Turning a request into engine parameters is a pure method
(`GenerationRequest.engine_params`), so it is unit-tested without a socket or an engine.

The OpenAPI document shows every bound `check()` enforces: a field checked here carries the same bound as
JSON Schema keywords (`documented`), and rules that tie two fields together are the models' `allOf`; those
JSON Schema helpers live in openapi.py, beside the code that adds the served model's own limits (vocabulary
size and context) to the document. Requests
are validated strictly, as JSON Schema reads them: "0.5" is not a number and 1 is not a boolean.

Sampling follows OpenAI's meanings and ranges: temperature (0 is greedy), top_p, presence and frequency
penalties, logit_bias, seed, logprobs / top_logprobs, n; and vLLM's extensions top_k, min_p,
repetition_penalty. The engine samples on the device in Transformers' processor order (rust/src/gemma4/
sampling.rs); a value outside its range is a 400 naming the field. Fields the engine cannot honour
(tools, best_of > 1, echo, suffix, ignore_eos, min_tokens) are refused the same way rather than ignored.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from gemma_server.errors import bad_request
from gemma_server.openapi import (
    TOKEN_ID_KEY,
    best_of_rule,
    documented,
    one_of_fields_null_or,
    prompt_schema,
)

log = logging.getLogger(__name__)

# Completions default to 16 new tokens when max_tokens is absent (OpenAI reference; vLLM keeps it).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def _json_integer(value: Any) -> Any:
    """A number with no fraction is an integer, as JSON Schema reads it (1.0 is 1); anything else goes on to
    the strict int check (which refuses strings, booleans and fractions)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Integer = Annotated[int, BeforeValidator(_json_integer)]


# stream_options is only allowed with stream true (OpenAI and vLLM refuse it otherwise).
STREAM_OPTIONS_RULE = one_of_fields_null_or("stream_options", "stream", True)


class OpenAIModel(BaseModel):
    """Base of every request: unknown fields are kept so they can be logged, then ignored. Strict, as the
    document's JSON Schema is: no string-to-number or number-to-boolean coercion."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _log_ignored_fields(self) -> OpenAIModel:
        if self.model_extra:
            log.warning("ignored %s", ignored_fields(self.model_extra))
        return self


def ignored_fields(extra: dict[str, Any], shown: int = 5, longest: int = 40) -> str:
    """What the log says of a request's unknown fields: their count and the first few names, each cut and
    escaped (repr), so a request cannot write a huge or forged line (a newline in a name) into the log."""
    names = [repr(name[:longest]) + ("..." if len(name) > longest else "") for name in itertools.islice(extra, shown)]
    more = f" and {len(extra) - shown} more" if len(extra) > shown else ""
    return f"{len(extra)} unknown request field{'s' if len(extra) > 1 else ''}: {', '.join(names)}{more}"


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension; accepted, not used


class TextPart(BaseModel):
    """A content part; only text parts are supported (`ChatCompletionRequest.check`)."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"required": ["type", "text"]})
    type: str = Field(json_schema_extra={"enum": ["text"]})
    text: str | None = Field(default=None, json_schema_extra={"type": "string"})


# Caps on the lists of a body are schema bounds (pydantic's max_length), so validation stops at the first
# item past a cap instead of building every item of a 4 MB list first.
MAX_CONTENT_PARTS = 1024


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None


# Bounds that keep one request's work small (OpenAI allows 4 stop strings; a few more do no harm, many
# would make stop matching the cost of a step).
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_N = 16
# The engine's own bounds (rust/src/engine/request.rs `LIMITS`, checked there again). They are written here,
# not read from gemma_engine: this module is imported before the boot has built the engine, to serve
# /health while it builds. tests/server/test_protocol.py holds them equal to `gemma_engine.LIMITS`.
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's own limit
MAX_MESSAGES = 1024
# Characters of prompt text per token of context: no tokenizer packs more, so text past
# context x this cannot fit and is refused before it is tokenized.
MAX_CHARS_PER_TOKEN = 32
MAX_INT64 = 2**63 - 1
# Most log-probabilities one response carries: n x max_tokens x (top_logprobs + 1). Each is a JSON object
# of ~60 bytes built on the host, so this keeps an answer near 16 MB (n=16 x 600 tokens x 21 fits; the
# default context x 16 x 21 would be 2.8 million, gigabytes of JSON).
MAX_LOGPROB_ENTRIES = 16 * 800 * 21
# Any integer is a seed: it is taken modulo 2**64 (choice i of n uses seed + i), so no bound can be missed by
# a JSON number that a float rounds (9.2e18 is 2**63 to a JSON Schema validator).
SEED = "Any integer, taken modulo 2**64 into the engine's signed 64-bit seed."


def max_prompt_chars(context: int) -> int:
    """The longest prompt text (`check_size`) that can fit `context` tokens."""
    return context * MAX_CHARS_PER_TOKEN


@dataclass(frozen=True)
class EngineParams:
    """One request, as the scheduler runs it.

    Attributes:
        prompt_ids: the prompt's token ids.
        max_new: most tokens to generate (already capped at context - prompt).
        stop_ids: token ids that end the decode (besides the model's eos ids).
        stop: strings that end the output, matched in the detokenized text.
        sampling: keyword arguments of gemma_engine.SamplingParams (for choice 0; `choice_sampling`
            gives each of the n choices its own seed).
        n: how many choices.
        logprobs: None, or how many top log-probabilities per token (0 for the chosen token's only).
    """

    prompt_ids: tuple[int, ...]
    max_new: int
    stop_ids: tuple[int, ...]
    stop: tuple[str, ...]
    sampling: tuple[tuple[str, Any], ...] = ()
    n: int = 1
    logprobs: int | None = None

    def choice_sampling(self, index: int, fresh_seed: Callable[[], int]) -> dict[str, Any]:
        """SamplingParams keywords for choice `index`: a given seed s gives choice i the seed s + i (so
        n > 1 choices differ but each is reproducible); without one every choice gets a fresh seed."""
        kwargs = dict(self.sampling)
        seed = kwargs.get("seed")
        kwargs["seed"] = fresh_seed() if seed is None else _wrap64(seed + index)
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
        return kwargs


def _wrap64(v: int) -> int:
    return (v + 2**63) % 2**64 - 2**63


def _in_range(name: str, value: float | None, lo: float, hi: float, lo_open: bool = False) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
        interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise bad_request(name, f"{name} must be in {interval}, got {value}.")


# JSON Schema of the fields both requests share, as `check()` enforces them.
PENALTY = {"minimum": -2.0, "maximum": 2.0}
LOGIT_BIAS = {"maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": f"^{TOKEN_ID_KEY.pattern}$"},
              "additionalProperties": {"minimum": -100.0, "maximum": 100.0}}
STOP = {"minLength": 1, "maxLength": MAX_STOP_LENGTH, "maxItems": MAX_STOP_STRINGS,
        "items": {"minLength": 1, "maxLength": MAX_STOP_LENGTH}}
TOKEN_IDS = {"maxItems": MAX_STOP_TOKEN_IDS, "items": {"minimum": 0}}


class GenerationRequest(OpenAIModel):
    """Fields and checks shared by chat and legacy completions."""

    # --- extensions both requests take (vLLM's names) ----------------------------------------------
    stop_token_ids: Annotated[list[Integer], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = documented(**TOKEN_IDS)
    top_k: Integer | None = documented(minimum=-1)
    min_p: float | None = documented(minimum=0.0, maximum=1.0)
    repetition_penalty: float | None = documented(exclusiveMinimum=0.0, maximum=2.0)
    ignore_eos: bool = documented(False, enum=[False], description="Not supported.")
    min_tokens: Integer = documented(0, enum=[0], description="Not supported.")

    def _check_sampling(self) -> None:
        """Raise 400 naming the first field whose value is out of range or cannot be honoured."""
        g = lambda name: getattr(self, name, None)  # noqa: E731 - fields differ between the two requests
        _in_range("temperature", g("temperature"), 0.0, 2.0)
        _in_range("top_p", g("top_p"), 0.0, 1.0, lo_open=True)
        _in_range("frequency_penalty", g("frequency_penalty"), -2.0, 2.0)
        _in_range("presence_penalty", g("presence_penalty"), -2.0, 2.0)
        _in_range("min_p", g("min_p"), 0.0, 1.0)
        _in_range("repetition_penalty", g("repetition_penalty"), 0.0, 2.0, lo_open=True)
        if g("top_k") is not None and g("top_k") < -1:
            raise bad_request("top_k", "top_k must be -1 or 0 (every token) or at least 1.")
        if g("n") is not None and not 1 <= g("n") <= MAX_N:
            raise bad_request("n", f"n must be between 1 and {MAX_N}.")
        bias = g("logit_bias") or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise bad_request("logit_bias", f"logit_bias holds at most {MAX_LOGIT_BIAS} entries, got {len(bias)}.")
        for key, value in bias.items():
            if not TOKEN_ID_KEY.fullmatch(key):
                raise bad_request("logit_bias", f"logit_bias keys must be token ids, got {key!r}.")
            _in_range("logit_bias", value, -100.0, 100.0)
        if g("ignore_eos"):
            raise bad_request("ignore_eos", "ignore_eos is not supported.")
        if g("min_tokens"):
            raise bad_request("min_tokens", "min_tokens is not supported: it must be 0 or absent.")
        ids = g("stop_token_ids") or []
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise bad_request("stop_token_ids", f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids.")

    def logprobs_wanted(self) -> int | None:
        """None, or how many top log-probabilities each token carries."""
        return None

    def sampling_kwargs(self, default_temperature: float = 1.0) -> tuple[tuple[str, Any], ...]:
        """The request's sampling fields as gemma_engine.SamplingParams keywords (absent fields: neutral;
        an absent temperature: the server's default, OpenAI's 1.0 unless configured)."""
        g = lambda name: getattr(self, name, None)  # noqa: E731
        top_k = g("top_k")
        kwargs = {
            "temperature": default_temperature if g("temperature") is None else g("temperature"),
            # Past the vocabulary every top_k keeps every token: clamped to the engine's i64.
            "top_k": 0 if top_k in (None, -1) else min(top_k, MAX_INT64),
            "top_p": 1.0 if g("top_p") is None else g("top_p"),
            "min_p": g("min_p") or 0.0,
            "presence_penalty": g("presence_penalty") or 0.0,
            "frequency_penalty": g("frequency_penalty") or 0.0,
            "repetition_penalty": 1.0 if g("repetition_penalty") is None else g("repetition_penalty"),
            "logit_bias": {int(k): float(v) for k, v in (g("logit_bias") or {}).items()} or None,
            "seed": g("seed"),
        }
        return tuple(kwargs.items())

    def stop_strings(self) -> tuple[str, ...]:
        stop = getattr(self, "stop", None)
        if stop is None:
            return ()
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request("stop", f"stop holds at most {MAX_STOP_STRINGS} strings, got {len(stops)}.")
        if any(s == "" for s in stops):
            raise bad_request("stop", "stop strings must not be empty.")
        if any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise bad_request("stop", f"stop strings are at most {MAX_STOP_LENGTH} characters long.")
        return stops

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens (OpenAI reference, vLLM)."""
        mct = getattr(self, "max_completion_tokens", None)
        if mct is not None:
            return mct
        return self.max_tokens

    def default_max_tokens(self) -> int | None:
        return None

    def check_size(self, context: int) -> None:
        """Refuse prompts that cannot fit `context` tokens, before they are rendered or tokenized."""
        limit = max_prompt_chars(context)
        if self._prompt_chars() > limit:
            raise bad_request(self._prompt_field(), f"The prompt is longer than {limit} characters; it cannot fit "
                                                    f"the model's context of {context} tokens.")
        ids = self._prompt_ids_count()
        if ids > context:
            raise bad_request(self._prompt_field(), f"The prompt has {ids} token ids; the context holds {context}.")

    def _prompt_chars(self) -> int:
        return 0

    def _prompt_ids_count(self) -> int:
        return 0

    def check(self) -> None:
        """Every check that needs no tokenizer; raises ApiError(400) naming the field."""
        self._check_sampling()
        self.stop_strings()
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options", "stream_options is only allowed when stream is true.")
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(self, name, None)
            if value is not None and value < 1:
                raise bad_request(name, f"{name} must be at least 1.")

    def engine_params(
        self, prompt_ids: list[int], context: int, vocab_size: int, default_temperature: float = 1.0
    ) -> EngineParams:
        """Turn this request and its tokenized prompt into one engine decode. The caller ran `check()` first
        (app.py does, before it admits the request): the checks that need the prompt's ids are here.

        Args:
            prompt_ids: the prompt, tokenized (chat template applied for chat).
            context: the engine's context (most tokens, prompt + generated).
            vocab_size: ids must lie in [0, vocab_size).
            default_temperature: the temperature of a request that sets none.
        Returns:
            EngineParams with max_new capped at context - len(prompt) (vLLM's `get_max_tokens`).
        Raises:
            ApiError: 400 naming the field: an empty or too long prompt, a token id out of range, more
                log-probabilities than one response may carry.
        """
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
        bias = [int(k) for k in (getattr(self, "logit_bias", None) or {})]
        bad = [t for t in bias if not 0 <= t < vocab_size]
        if bad:
            raise bad_request("logit_bias", f"Token id {bad[0]} is outside the vocabulary [0, {vocab_size}).")
        self._check_logprob_budget(max_new)
        return EngineParams(tuple(prompt_ids), max_new, stop_ids, self.stop_strings(), self.sampling_kwargs(default_temperature),
                            self.n or 1, self.logprobs_wanted())

    def _prompt_field(self) -> str:
        return "prompt"

    def _logprobs_field(self) -> str:
        return "logprobs"

    def _check_logprob_budget(self, max_new: int) -> None:
        """Refuse an answer of more than MAX_LOGPROB_ENTRIES log-probabilities, naming the product."""
        top = self.logprobs_wanted()
        if top is None:
            return
        n = self.n or 1
        entries = n * max_new * (top + 1)
        if entries > MAX_LOGPROB_ENTRIES:
            raise bad_request(self._logprobs_field(), (
                f"n x max_tokens x (top log-probabilities + 1) = {n} x {max_new} x {top + 1} = {entries} "
                f"log-probabilities, more than the {MAX_LOGPROB_ENTRIES} one response may carry: lower n, "
                f"max_tokens or the top log-probabilities."))



class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions. Field order: OpenAI API reference (as vLLM's ChatCompletionRequest)."""

    model_config = ConfigDict(json_schema_extra={"allOf": [
        STREAM_OPTIONS_RULE, one_of_fields_null_or("top_logprobs", "logprobs", True)]})

    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] = Field(json_schema_extra={"minItems": 1})
    model: str | None = None
    frequency_penalty: float | None = documented(**PENALTY)
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = documented(**LOGIT_BIAS)
    logprobs: bool | None = None
    top_logprobs: Integer | None = documented(minimum=0, maximum=MAX_TOP_LOGPROBS)
    max_tokens: Integer | None = documented(minimum=1, description="Deprecated by OpenAI; max_completion_tokens wins.")
    max_completion_tokens: Integer | None = documented(minimum=1)
    n: Integer | None = documented(1, minimum=1, maximum=MAX_N)
    presence_penalty: float | None = documented(**PENALTY)
    response_format: dict[str, Any] | None = documented(properties={"type": {"enum": ["text"]}})
    seed: Integer | None = Field(default=None, description=SEED)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = documented(**STOP)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = documented(minimum=0.0, maximum=2.0)
    top_p: float | None = documented(exclusiveMinimum=0.0, maximum=1.0)
    tools: list[dict[str, Any]] | None = documented(maxItems=0, description="Tool calling is not supported.")
    tool_choice: str | dict[str, Any] | None = documented(enum=["none", None])
    parallel_tool_calls: bool | None = None
    user: str | None = None

    # --- extensions (vLLM's names; the shared ones are GenerationRequest's) -------------------
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = documented(
        propertyNames={"not": {"enum": ["chat_template"]}},
        description="Variables of the checkpoint's chat template; names it does not read are ignored.")
    # --- end of extensions -------------------------------------------------------------------

    def logprobs_wanted(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def _prompt_chars(self) -> int:
        return sum(len(m["content"]) for m in self.template_messages())

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise bad_request("messages", "messages must hold at least one message.")
        if len(self.messages) > MAX_MESSAGES:
            raise bad_request("messages", f"messages holds at most {MAX_MESSAGES} messages, got {len(self.messages)}.")
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise bad_request("top_logprobs", f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}.")
            if not self.logprobs:
                raise bad_request("top_logprobs", "top_logprobs needs logprobs set to true.")
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

    def _logprobs_field(self) -> str:
        return "top_logprobs" if self.top_logprobs else "logprobs"


def _one_prompt(schema: dict) -> None:
    schema["anyOf"] = prompt_schema()



class CompletionRequest(GenerationRequest):
    """POST /v1/completions (legacy). Field order: OpenAI API reference."""

    model_config = ConfigDict(json_schema_extra={"allOf": [STREAM_OPTIONS_RULE, best_of_rule(MAX_N)]})

    model: str | None = None
    prompt: str | list[str] | list[Integer] | list[list[Integer]] = Field(json_schema_extra=_one_prompt)
    best_of: Integer | None = documented(description="Must be absent, 1, or equal to n.")
    echo: bool | None = documented(False, enum=[False, None], description="Not supported.")
    frequency_penalty: float | None = documented(**PENALTY)
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = documented(**LOGIT_BIAS)
    logprobs: Integer | None = documented(minimum=0, maximum=MAX_COMPLETION_LOGPROBS)
    max_tokens: Integer | None = documented(minimum=1)
    n: Integer | None = documented(1, minimum=1, maximum=MAX_N)
    presence_penalty: float | None = documented(**PENALTY)
    seed: Integer | None = Field(default=None, description=SEED)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = documented(**STOP)
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = documented(maxLength=0, description="Not supported.")
    temperature: float | None = documented(minimum=0.0, maximum=2.0)
    top_p: float | None = documented(exclusiveMinimum=0.0, maximum=1.0)
    user: str | None = None


    def default_max_tokens(self) -> int | None:
        return COMPLETIONS_DEFAULT_MAX_TOKENS

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def _prompt_chars(self) -> int:
        p = self.prompt
        if isinstance(p, str):
            return len(p)
        return sum(len(x) for x in p if isinstance(x, str))

    def _prompt_ids_count(self) -> int:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], list):
            return sum(len(x) for x in p)
        return len(p) if isinstance(p, list) and all(isinstance(x, int) for x in p) else 0

    def check(self) -> None:
        super().check()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise bad_request("logprobs", f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}.")
        if self.best_of not in (None, 1, self.n):
            raise bad_request("best_of", "best_of must be absent or equal to n.")
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
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
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
