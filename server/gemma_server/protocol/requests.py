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
(best_of > 1, suffix, ignore_eos, min_tokens, structured_outputs.regex) are refused the same way rather than
ignored.

Tools follow OpenAI's reference: `tools`, `tool_choice` ("none", "auto", "required" or a named function),
`parallel_tool_calls`, assistant messages with `tool_calls` (content null) and `tool` messages. The output
constraints (a forced tool_choice, `response_format` json_object / json_schema, vLLM's `structured_outputs`
and `guided_json`) become a `grammars.Constraint`, whose llguidance grammar grammars.py builds
(`grammar_text`); auto leaves the reply free and the server parses its calls. Completions take
`echo` (with `logprobs`, the prompt's log-probabilities; `max_tokens` 0 then returns only the prompt), as
vLLM does for the lm-evaluation-harness.

Images and audio: a user message's content parts may be OpenAI's `image_url` (a data URL; an http(s) URL
where the server fetches from its host) and `input_audio` (base64 wav, mp3 or flac); `media_parts` lists
them for media.py, which reads them, and `template_messages` gives the chat template their places.

Prefix caching: both requests take vLLM's `cache_salt` (requests with different salts never share KV, so
tenants cannot learn each other's prompts from timing), and responses report OpenAI's
`usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gemma_server.errors import bad_request
from gemma_server.grammars import Constraint
from gemma_server.media import Part
from gemma_server.openapi import (
    TOKEN_ID_KEY,
    best_of_rule,
    documented,
    one_of_fields_null_or,
    prompt_schema,
)
from gemma_server.protocol.base import Integer, OpenAIModel
from gemma_server.protocol.content import (
    AudioPart,
    ChatMessage,
    ImagePart,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputs,
    TEMPLATE_FUNCTION_KEYS,
    TextPart,
    Tool,
    schema_of,
)
from gemma_server.protocol.engine import EngineParams
from gemma_server.protocol.limits import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    FUNCTION_NAME,
    MAX_CACHE_SALT,
    MAX_COMPLETION_LOGPROBS,
    MAX_INT64,
    MAX_LOGIT_BIAS,
    MAX_LOGPROB_ENTRIES,
    MAX_MESSAGES,
    MAX_N,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    MIN_DIVISOR,
    SEED,
    max_prompt_chars,
)

log = logging.getLogger(__name__)


# stream_options is only allowed with stream true (OpenAI and vLLM refuse it otherwise).
STREAM_OPTIONS_RULE = one_of_fields_null_or("stream_options", "stream", True)
# tool_choice required or named needs at least one tool.
_NOT_FORCED = {"properties": {"tool_choice": {"not": {"anyOf": [{"const": "required"}, {"type": "object"}]}}}}
FORCED_TOOL_RULE = {"anyOf": [
    _NOT_FORCED, {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}]}
# A forced call is the whole reply: no response_format but text, no structured output, with it.
FORCED_ALONE_RULE = {"anyOf": [_NOT_FORCED, {"properties": {
    "response_format": {"anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]},
    "structured_outputs": {"anyOf": [{"type": "null"}, {"properties": {
        "json": {"type": "null"}, "json_object": {"enum": [None, False]}, "choice": {"type": "null"},
        "grammar": {"type": "null"}}}]},
    "guided_json": {"type": "null"}}}]}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension; accepted, not used


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
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = documented(description="vLLM's older name of structured_outputs.json.")
    cache_salt: str | None = documented(
        minLength=1, maxLength=MAX_CACHE_SALT,
        description="Requests share cached prompt KV only with requests of the same salt (vLLM's cache_salt).")
    speculative: bool = documented(True, description="False opts this request out of the server's speculative "
                                                     "decoding; its tokens are the same either way.")

    def _structured(self) -> Constraint | None:
        """The constraint of vLLM's `structured_outputs` or `guided_json`, or None.

        Raises:
            ApiError: 400 naming the unsupported kind, or more than one kind.
        """
        so = self.structured_outputs
        given = []
        if so is not None:
            if so.regex is not None:
                raise bad_request("structured_outputs.regex", "structured_outputs.regex is not supported; use "
                                                              "json, choice or grammar.")
            for key in so.model_extra or {}:
                raise bad_request(f"structured_outputs.{key}", f"structured_outputs.{key} is not supported.")
            if so.json_ is not None:
                given.append(Constraint("json", "structured_outputs.json",
                                        schema_of(so.json_, "structured_outputs.json")))
            if so.json_object:
                given.append(Constraint("json", "structured_outputs.json_object"))
            if so.choice is not None:
                if not so.choice:
                    raise bad_request("structured_outputs.choice", "structured_outputs.choice must not be empty.")
                given.append(Constraint("choice", "structured_outputs.choice", choices=tuple(so.choice)))
            if so.grammar is not None:
                given.append(Constraint("grammar", "structured_outputs.grammar", grammar=so.grammar))
        if self.guided_json is not None:
            given.append(Constraint("json", "guided_json", schema_of(self.guided_json, "guided_json")))
        if len(given) > 1:
            raise bad_request(given[1].param, f"Only one structured output constraint per request; "
                                              f"{given[0].param} and {given[1].param} were both given.")
        return given[0] if given else None

    def constraint(self) -> Constraint | None:
        """What the output must follow, or None (unconstrained)."""
        return self._structured()

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

    def _check_cache_salt(self) -> None:
        """A cache_salt is a non-empty string of valid Unicode text (it reaches the engine as UTF-8) of at
        most MAX_CACHE_SALT characters (vLLM's request models refuse an empty one: `check_cache_salt_support`)."""
        salt = self.cache_salt
        if salt is None:
            return
        if not 1 <= len(salt) <= MAX_CACHE_SALT:
            raise bad_request("cache_salt", f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} "
                                            f"characters, got {len(salt)}.")
        try:
            salt.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("cache_salt", "cache_salt is not valid Unicode text.") from None

    def logprobs_wanted(self) -> int | None:
        """None, or how many top log-probabilities each token carries."""
        return None

    def sampling_kwargs(self, default_temperature: float = 1.0) -> tuple[tuple[str, Any], ...]:
        """The request's sampling fields as gemma_engine.SamplingParams keywords (absent fields: neutral;
        an absent temperature: the server's default, OpenAI's 1.0 unless configured)."""
        g = lambda name: getattr(self, name, None)  # noqa: E731
        top_k = g("top_k")
        temperature = default_temperature if g("temperature") is None else g("temperature")
        repetition = 1.0 if g("repetition_penalty") is None else g("repetition_penalty")
        kwargs = {
            # A temperature this small is greedy already (and would divide a logit past float32's range).
            "temperature": 0.0 if temperature < MIN_DIVISOR else temperature,
            # Past the vocabulary every top_k keeps every token: clamped to the engine's i64.
            "top_k": 0 if top_k in (None, -1) else min(top_k, MAX_INT64),
            "top_p": 1.0 if g("top_p") is None else g("top_p"),
            "min_p": g("min_p") or 0.0,
            "presence_penalty": g("presence_penalty") or 0.0,
            "frequency_penalty": g("frequency_penalty") or 0.0,
            "repetition_penalty": max(repetition, MIN_DIVISOR),
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
        self._check_cache_salt()
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options", "stream_options is only allowed when stream is true.")
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(self, name, None)
            if value is not None and value < (0 if getattr(self, "echo", False) else 1):
                raise bad_request(name, f"{name} must be at least 1.")

    def engine_params(
        self, prompt_ids: list[int], context: int, vocab_size: int, default_temperature: float = 1.0,
        grammar: str | None = None, internal_bias: dict[int, float] | None = None,
        cache_boundary: int | None = None, media: tuple[tuple[int, Any, int], ...] = (),
        next_turn: int | None = None,
    ) -> EngineParams:
        """Turn this request and its tokenized prompt into one engine decode. The caller ran `check()` first
        (`ServerState.start` does, before it admits the request): the checks that need the prompt's ids are here.

        Args:
            prompt_ids: the prompt, tokenized (chat template applied for chat).
            context: the engine's context (most tokens, prompt + generated).
            vocab_size: ids must lie in [0, vocab_size).
            default_temperature: the temperature of a request that sets none.
            grammar: the grammar of the request's constraint (`grammars.grammar_text`), checked by the caller.
            internal_bias: the server's own logit bias (tool_choice none forbids `<|tool_call>`); it wins
                over the request's for its ids and does not count against the request's logit_bias cap.
            cache_boundary: where the prompt's shared part ends (chat_template.cache_boundary), or None.
            media: the prompt's soft tokens (media_encoder.place), passed through.
            next_turn: where the conversation's next turn departs from the prompt (chat_template.next_turn),
                or None.
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
        sampling = self.sampling_kwargs(default_temperature)
        if internal_bias:
            sampling = tuple((k, {**(v or {}), **internal_bias} if k == "logit_bias" else v) for k, v in sampling)
        return EngineParams(tuple(prompt_ids), max_new, stop_ids, self.stop_strings(), sampling,
                            self.n or 1, self.logprobs_wanted(), grammar=grammar,
                            prompt_logprobs=self.prompt_logprobs_wanted(), cache_salt=self.cache_salt,
                            cache_boundary=cache_boundary, next_turn=next_turn, media=media,
                            speculative=self.speculative, **self._reply_kind())

    def prompt_logprobs_wanted(self) -> int | None:
        """None, or how many top log-probabilities each prompt token carries (completions' echo)."""
        return None

    def _reply_kind(self) -> dict[str, bool]:
        return {}

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
        STREAM_OPTIONS_RULE, one_of_fields_null_or("top_logprobs", "logprobs", True), FORCED_TOOL_RULE,
        FORCED_ALONE_RULE]})

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
    response_format: ResponseFormat | None = None
    seed: Integer | None = Field(default=None, description=SEED)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = documented(**STOP)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = documented(minimum=0.0, maximum=2.0)
    top_p: float | None = documented(exclusiveMinimum=0.0, maximum=1.0)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
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
        """Message text, tool calls, tools and schemas: all of it is rendered into the prompt or a grammar."""
        chars = sum(content_chars(m["content"]) for m in self.template_messages())
        for m in self.messages:
            chars += sum(len(c.function.name) + len(c.function.arguments) for c in m.tool_calls or ())
        chars += sum(len(json.dumps(t.model_dump(exclude_none=True))) for t in self.tools or ())
        schema = self.response_format.json_schema if self.response_format else None
        if schema is not None and schema.schema_ is not None:
            chars += len(json.dumps(schema.schema_))
        return chars + _structured_chars(self)

    def tool_choice_mode(self) -> str:
        """"none", "auto", "required" or "named": OpenAI's default is auto with tools, none without."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template and the grammars read them: OpenAI's shape with a function's name,
        description and parameters only (unset ones out). Other keys a client adds never reach the template:
        Google's Gemma 4 templates render a `function.response` declaration's description, and no OpenAI
        client sends one."""
        if not self.tools:
            return None
        return [{"type": "function", "function": t.function.model_dump(include=TEMPLATE_FUNCTION_KEYS,
                                                                        exclude_none=True)}
                for t in self.tools]

    def constraint(self) -> Constraint | None:
        """tool_choice required or named: the calls (a grammar of them); else response_format json_object or
        json_schema, or vLLM's structured_outputs / guided_json; None for auto, none and text."""
        mode = self.tool_choice_mode()
        if mode in ("required", "named"):
            name = self.tool_choice.function.name if mode == "named" else None
            return Constraint("tools", "tool_choice", name=name)
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            return Constraint("json", "response_format")
        if rf is not None and rf.type == "json_schema":
            return Constraint("json", "response_format.json_schema.schema", rf.json_schema.schema_ or {})
        return self._structured()

    def _reply_kind(self) -> dict[str, bool]:
        mode = self.tool_choice_mode()
        return {"tools": bool(self.tools) and mode != "none", "forced_calls": mode in ("required", "named")}

    def _check_tools(self) -> None:
        """Tools, tool_choice and the tool calls of the messages, as OpenAI checks them."""
        names = []
        for i, tool in enumerate(self.tools or ()):
            name = tool.function.name
            if not FUNCTION_NAME.fullmatch(name):
                raise bad_request(f"tools[{i}].function.name", f"Function names are 1 to 64 of a-z, A-Z, 0-9, "
                                                               f"_ and -; got {name[:80]!r}.")
            if name in names:
                raise bad_request(f"tools[{i}].function.name", f"Two tools are named {name!r}.")
            names.append(name)
        mode = self.tool_choice_mode()
        if mode == "required" and not self.tools:
            raise bad_request("tool_choice", "tool_choice required needs tools.")
        if mode == "named":
            name = self.tool_choice.function.name
            if name not in names:
                raise bad_request("tool_choice", f"tool_choice names {name[:80]!r}, which is not in tools.")
        if mode in ("required", "named") and self.response_format and self.response_format.type != "text":
            raise bad_request("response_format", "response_format cannot be json while tool_choice forces a call.")
        if mode in ("required", "named") and self._structured() is not None:
            raise bad_request(self._structured().param, "A structured output constraint cannot be combined with a "
                                                        "tool_choice that forces a call.")
        rf = self.response_format
        if rf is not None and rf.type == "json_schema" and rf.json_schema is None:
            raise bad_request("response_format.json_schema", "response_format json_schema needs json_schema.")
        for i, m in enumerate(self.messages):
            if m.tool_calls and m.role != "assistant":
                raise bad_request(f"messages[{i}].tool_calls", "Only assistant messages carry tool_calls.")
            for j, call in enumerate(m.tool_calls or ()):
                try:
                    args = json.loads(call.function.arguments)
                except ValueError:
                    args = None
                if not isinstance(args, dict):
                    raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments",
                                      "Tool call arguments must be a JSON object's text.")
                if not FUNCTION_NAME.fullmatch(call.function.name):
                    raise bad_request(f"messages[{i}].tool_calls[{j}].function.name",
                                      "Function names are 1 to 64 of a-z, A-Z, 0-9, _ and -.")
            if m.role == "tool" and m.tool_call_id is None:
                raise bad_request(f"messages[{i}].tool_call_id", "A tool message needs tool_call_id.")

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
        self._check_tools()
        self.constraint()
        for i, m in enumerate(self.messages):
            for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
                if not isinstance(part, TextPart) and m.role != "user":
                    raise bad_request(f"messages[{i}].content[{j}]", f"Only a user message holds images and audio, "
                                                                     f"not a {m.role} message.")

    def media_parts(self) -> list[Part]:
        """The messages' images and audio, in prompt order, each named by its field."""
        parts = []
        for i, m in enumerate(self.messages):
            for j, p in enumerate(m.content if isinstance(m.content, list) else ()):
                if isinstance(p, ImagePart):
                    parts.append(Part("image", f"messages[{i}].content[{j}]", p.image_url.url))
                elif isinstance(p, AudioPart):
                    parts.append(Part("audio", f"messages[{i}].content[{j}]", p.input_audio.data))
        return parts

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template wants them: text content parts joined into one string, or, in a
        message with images or audio, the template's content items (`{"type": "text", "text"}`, `{"type":
        "image"}`, `{"type": "audio"}`: Google's Gemma 4 template writes `<|image|>` and `<|audio|>` for them);
        an assistant's tool calls with their arguments as objects (Gemma 4's templates render a mapping, as
        vLLM's chat_utils does for them) and its reasoning_content; a tool message with its tool_call_id
        and name. (chat_template.gemma_turns then fits them to the checkpoint's template.)"""
        out = []
        for m in self.messages:
            content = m.content
            if isinstance(content, list) and all(isinstance(p, TextPart) for p in content):
                content = "".join(p.text for p in content)
            elif isinstance(content, list):
                content = [{"type": "text", "text": p.text} if isinstance(p, TextPart)
                           else {"type": "image" if isinstance(p, ImagePart) else "audio"} for p in content]
            message: dict[str, Any] = {"role": m.role, "content": content or ""}
            if m.tool_calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                    for c in m.tool_calls]
            if m.role == "tool":
                message["tool_call_id"] = m.tool_call_id
                if m.name is not None:
                    message["name"] = m.name
            if m.role == "assistant" and m.reasoning_content:
                message["reasoning_content"] = m.reasoning_content
            out.append(message)
        return out

    def enable_thinking(self) -> bool:
        return bool((self.chat_template_kwargs or {}).get("enable_thinking"))

    def _prompt_field(self) -> str:
        return "messages"

    def _logprobs_field(self) -> str:
        return "top_logprobs" if self.top_logprobs else "logprobs"


def content_chars(content: str | list[dict[str, Any]] | None) -> int:
    """The text characters of a template message's content (a string, or content items)."""
    if isinstance(content, list):
        return sum(len(item.get("text") or "") for item in content)
    return len(content or "")


def _structured_chars(request: GenerationRequest) -> int:
    """The characters of a request's structured-output constraint (it becomes a grammar to compile)."""
    so, chars = request.structured_outputs, 0
    if so is not None:
        chars += len(json.dumps(so.model_dump(by_alias=True, exclude_none=True)))
    if request.guided_json is not None:
        chars += len(json.dumps(request.guided_json))
    return chars


def _one_prompt(schema: dict) -> None:
    schema["anyOf"] = prompt_schema()


class CompletionRequest(GenerationRequest):
    """POST /v1/completions (legacy). Field order: OpenAI API reference."""

    model_config = ConfigDict(json_schema_extra={"allOf": [STREAM_OPTIONS_RULE, best_of_rule(MAX_N)]})

    model: str | None = None
    prompt: str | list[str] | list[Integer] | list[list[Integer]] = Field(json_schema_extra=_one_prompt)
    best_of: Integer | None = documented(description="Must be absent, 1, or equal to n.")
    echo: bool | None = documented(False, description="The prompt comes back before the completion (with "
                                                     "its log-probabilities when logprobs is set).")
    frequency_penalty: float | None = documented(**PENALTY)
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = documented(**LOGIT_BIAS)
    logprobs: Integer | None = documented(minimum=0, maximum=MAX_COMPLETION_LOGPROBS)
    max_tokens: Integer | None = documented(minimum=0, description="0 only with echo: just the prompt.")
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

    def prompt_logprobs_wanted(self) -> int | None:
        return self.logprobs if self.echo else None

    def _prompt_chars(self) -> int:
        p = self.prompt
        if isinstance(p, str):
            return len(p) + _structured_chars(self)
        return sum(len(x) for x in p if isinstance(x, str)) + _structured_chars(self)

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
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens", "max_tokens must be at least 1 (0 only with echo).")
        if self.max_tokens == 0 and self.logprobs is None:
            raise bad_request("max_tokens", "max_tokens 0 needs logprobs: echo alone then has nothing to compute.")
        self.constraint()
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


