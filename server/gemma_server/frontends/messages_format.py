"""Anthropic's Messages API replies (a `serving.Format`): the Message object and its stream's events.

Shapes: Anthropic's Messages API reference and the anthropic SDK's types (`anthropic/types/`: message.py,
raw_message_stream_event.py and the content block events), as vLLM's `vllm/entrypoints/anthropic/
serving_messages.py` converts chat's output: a thinking block when the reply thought, a text block, a tool_use
block per call (its `input` the call's arguments parsed; streamed as `input_json_delta` fragments). Every event
is named by its type; an error after the stream opened is an `error` event, its last.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from gemma_server import openapi, sse
from gemma_server.errors import ApiError
from gemma_server.jobs import Cause
from gemma_server.serving import Generation, Output, Piece, usage
from gemma_server.toolcalls import CallStart


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    """The reply's thought. Nothing signs it here, so its signature is empty (clients hand it back; this
    server does not read it)."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = Annotated[TextBlock | ThinkingBlock | ToolUseBlock, Field(discriminator="type")]


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(BaseModel):
    """Anthropic's usage: the prompt is input_tokens + cache_read_input_tokens (+ cache_creation_input_tokens,
    always 0 here)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(BaseModel):
    """The reply: a thinking block when it thought, a text block, its tool_use blocks."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ContentBlock]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: MessageUsage


# /v1/messages's statuses are chat's; its stream is Anthropic's events.
RESPONSES = {**openapi.generation(Message)}
RESPONSES[200] = {**RESPONSES[200], "description": (
    "The message; with `stream: true`, server-sent events named as Anthropic's: message_start, then "
    "content_block_start / content_block_delta / content_block_stop per block, message_delta, message_stop "
    "(or an `error` event).")}


# OpenAI's finish_reason -> Anthropic's stop_reason. "abort" (the engine loop stopped under the request) has
# no Anthropic reason, so none is claimed.
STOP_REASONS: dict[str | None, StopReason | None] = {"stop": "end_turn", "length": "max_tokens",
                                                      "tool_calls": "tool_use"}


def stop_reason(gen: Generation) -> tuple[StopReason | None, str | None]:
    """The choice's (stop_reason, stop_sequence): a stop string's end is the job's (Cause.STOP_STRING), and
    the string is the one text.StopMatcher matched."""
    ended = gen.job.ended
    if ended is not None and ended.cause is Cause.STOP_STRING:
        return "stop_sequence", gen.matched_stop
    return STOP_REASONS.get(gen.finish_reason), None


def message_usage(gen: Generation) -> MessageUsage:
    u = usage([gen])
    cached = u.prompt_tokens_details.cached_tokens
    return MessageUsage(input_tokens=u.prompt_tokens - cached, output_tokens=u.completion_tokens,
                        cache_read_input_tokens=cached)


def call_input(arguments: str) -> dict[str, Any]:
    """A call's input object from its arguments' JSON text. A call cut by max_tokens has only a prefix of
    it: that is read as far as its values are complete (`partial_object`), as the SDK's stream helper reads
    the fragments (jiter's partial mode in `accumulate_event`)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = partial_object(arguments)
    return value if isinstance(value, dict) else {}


def partial_object(text: str) -> dict[str, Any]:
    """The JSON object a prefix of an object's text begins: cut after its last complete value, then closed.

    The prefix is append-only JSON (toolcalls.GemmaToJson writes a bare scalar only once its `,`, `}` or `]`
    came), so it can be cut after an opening bracket, a closing one, a value string, or before a comma.
    """
    stack: list[str] = []
    cut, closing = 0, ""
    in_string = escaped = key_string = False
    expect_key = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if not key_string:
                    cut, closing = i + 1, _closers(stack)
            continue
        if ch == '"':
            in_string, key_string = True, bool(stack) and stack[-1] == "{" and expect_key
        elif ch in "{[":
            stack.append(ch)
            expect_key = ch == "{"
            cut, closing = i + 1, _closers(stack)
        elif ch in "}]":
            if not stack:
                break
            stack.pop()
            expect_key = False
            cut, closing = i + 1, _closers(stack)
        elif ch == ",":
            cut, closing = i, _closers(stack)
            expect_key = bool(stack) and stack[-1] == "{"
        elif ch == ":":
            expect_key = False
    try:
        value = json.loads(text[:cut] + closing)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _closers(stack: list[str]) -> str:
    return "".join("}" if c == "{" else "]" for c in reversed(stack))


class MessagesFormat:
    """One request's Message and its stream events (a `serving.Format`): message_start, the blocks' events
    (`Blocks`), message_delta and message_stop; an error after the stream opened is an `error` event, the
    stream's last.

    Args:
        model: the served model name.
        gen: the request's one choice.
    """

    media_type = "application/json"

    def __init__(self, model: str, gen: Generation) -> None:
        self.id = "msg_" + uuid.uuid4().hex
        self.model = model
        self.gen = gen
        self.blocks = Blocks()

    def message(self, out: Output) -> Message:
        """The non-streamed reply: a thinking block when it thought, the text (left out when the reply only
        called, as chat's message leaves whitespace out), its calls as tool_use blocks."""
        gen = self.gen
        content: list[Any] = []
        if out.reasoning:
            content.append(ThinkingBlock(thinking=out.reasoning))
        calls = gen.calls
        if out.text and (not calls or out.text.strip()):
            content.append(TextBlock(text=out.text))
        content += [ToolUseBlock(id=c.id, name=c.name, input=call_input(c.arguments)) for c in calls]
        reason, sequence = stop_reason(gen)
        return Message(id=self.id, content=content, model=self.model, stop_reason=reason, stop_sequence=sequence,
                       usage=message_usage(gen))

    def whole(self, outputs: list[Output]) -> bytes:
        return sse.dumps(self.message(outputs[0]).model_dump())

    def open(self) -> bytes:
        """message_start: the message with no content yet; the prompt's size (what the prefix cache held is
        known at the end, in message_delta, whose usage counts are totals that replace these)."""
        message = Message(id=self.id, content=[], model=self.model, stop_reason=None,
                          usage=MessageUsage(input_tokens=len(self.gen.params.prompt_ids), output_tokens=0))
        return _event({"type": "message_start", "message": message.model_dump()})

    def piece(self, index: int, piece: Piece) -> bytes:
        return self.blocks.piece(piece)

    def finish(self, index: int) -> bytes:
        """The last block's stop, message_delta (stop reason, usage) and message_stop."""
        reason, sequence = stop_reason(self.gen)
        return (self.blocks.close()
                + _event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                          "usage": message_usage(self.gen).model_dump()})
                + _event({"type": "message_stop"}))

    def close(self) -> bytes:
        return b""

    def error(self, err: ApiError) -> bytes:
        return _event(error_body(err))


class Blocks:
    """A streamed reply's content blocks, opened and closed in Anthropic's order (one open at a time, each
    ended by content_block_stop before the next starts), from the choice's pieces.

    Text that is only whitespace is held until text follows it; a reply that called drops it, as the
    non-streamed message does, so the stream and the message have the same blocks.
    """

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the open block's type
        self.space = ""
        self.called = False
        self._blocks_of_calls: dict[int, int] = {}

    def piece(self, piece: Piece) -> bytes:
        out = b""
        if piece.reasoning:
            out += self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out += self._delta({"type": "thinking_delta", "thinking": piece.reasoning})
        if piece.text:
            if self.open != "text" and not (self.space + piece.text).strip():
                self.space += piece.text
            else:
                text, self.space = self.space + piece.text, ""
                out += self._ensure("text", {"type": "text", "text": ""}) + self._delta({"type": "text_delta",
                                                                                         "text": text})
        for event in piece.calls:
            if isinstance(event, CallStart):
                self.called = True
                out += self._start("tool_use", {"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
                self._blocks_of_calls[event.index] = self.index
            else:
                out += _event({"type": "content_block_delta", "index": self._blocks_of_calls[event.index],
                               "delta": {"type": "input_json_delta", "partial_json": event.text}})
        return out

    def close(self) -> bytes:
        """The held whitespace of a reply that did not call, then the last block's stop."""
        out = b""
        if self.space and not self.called:
            out += self._ensure("text", {"type": "text", "text": ""})
            out += self._delta({"type": "text_delta", "text": self.space})
        self.space = ""
        return out + self._stop()

    def _ensure(self, kind: str, block: dict[str, Any]) -> bytes:
        return b"" if self.open == kind else self._start(kind, block)

    def _start(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._stop()
        self.index += 1
        self.open = kind
        return out + _event({"type": "content_block_start", "index": self.index, "content_block": block})

    def _stop(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return _event({"type": "content_block_stop", "index": self.index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event({"type": "content_block_delta", "index": self.index, "delta": delta})


def _event(data: dict[str, Any]) -> bytes:
    """One of Anthropic's events: named by its type."""
    return sse.event(data, data["type"])


def error_body(err: ApiError) -> dict[str, Any]:
    """The server's error shape with Anthropic's top-level `"type": "error"`."""
    return {"type": "error", **err.body()}
