"""OpenAI's Responses API replies (a `serving.Format`): the response object and its stream's events.

Shapes: the openai SDK's types (openai 3.57.0 `openai/types/responses/`: `response.py`,
`response_stream_event.py`) and its stream helper (`openai/lib/streaming/responses/_responses.py`, which
rebuilds the response from the events and checks their order). The reply is output items: a `reasoning` item
(the thought channel), a `message` with one `output_text` part, and a `function_call` item per call; status
`incomplete` (reason max_output_tokens) when max_output_tokens cut it.

Streaming sends the SDK's event sequence, each `event: <type>` with a `sequence_number`:
`response.created`, `response.in_progress`, then per item `response.output_item.added`, its deltas
(`response.reasoning_text.delta`, `response.content_part.added` + `response.output_text.delta`,
`response.function_call_arguments.delta`) and their `.done` events, `response.output_item.done`, and last
`response.completed` or `response.incomplete`. An error after the stream opened is an `error` event.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

from gemma_server import sse
from gemma_server.errors import ApiError
from gemma_server.frontends.chat import chat_logprobs
from gemma_server.serving import Generation, Output, Piece, usage
from gemma_server.toolcalls import CallStart

if TYPE_CHECKING:
    from gemma_server.frontends.responses import ResponsesRequest


class ResponseObject(BaseModel):
    """The response object, as the OpenAPI document shows it (`ResponsesFormat.final` builds it; the
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


class ResponsesFormat:
    """The response object and the stream events of one Responses request (a `serving.Format`).

    Args:
        body: the request.
        model: the served model name.
        gen: the request's one choice.
        token_text: a token id's text, for the log-probability entries (OpenAI's shape is chat's).
        on_done: called with the final response, once (the route stores it unless `store` is false).
    """

    media_type = "application/json"

    def __init__(self, body: ResponsesRequest, model: str, gen: Generation, token_text: Callable[[int], str],
                 on_done: Callable[[dict[str, Any]], None] = lambda response: None) -> None:
        self.body = body
        self.model = model
        self.gen = gen
        self.id = _id("resp")
        self.created = int(time.time())
        self._token_text = token_text
        self._on_done = on_done
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

    def final(self) -> dict[str, Any]:
        """The whole response once the choice has ended: status, output items, usage."""
        gen = self.gen
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

    def open(self) -> bytes:
        return (self.event("response.created", {"response": self.shell("in_progress")})
                + self.event("response.in_progress", {"response": self.shell("in_progress")}))

    def piece(self, index: int, piece: Piece) -> bytes:
        return b"".join(self.event(kind, data) for kind, data in self.add(piece))

    def finish(self, index: int) -> bytes:
        """The closing events: the last item's `.done`, then response.completed or response.incomplete."""
        events: list[tuple[str, dict[str, Any]]] = []
        if not self.items:  # a reply of nothing is still one (empty) message
            self._open("message", events)
        final = self.final()
        self._close(events, "incomplete" if final["status"] == "incomplete" else "completed")
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        self._on_done(final)
        return b"".join(self.event(k, data) for k, data in events + [(kind, {"response": final})])

    def close(self) -> bytes:
        return b""

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
            lp = (chat_logprobs(piece.logprobs, self._token_text) or {}).get("content") or []
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

    def event(self, kind: str, data: dict[str, Any]) -> bytes:
        """One server-sent event: `event: <type>` and the data with its type and sequence number."""
        body = {"type": kind, **data, "sequence_number": self._sequence}
        self._sequence += 1
        return sse.event(body, kind)

    def error(self, err: ApiError) -> bytes:
        """The stream's last event when it fails: OpenAI's `error` event (its `error` object too, which the
        openai SDK raises as APIError)."""
        info = err.body()["error"]
        return self.event("error", {"code": info["type"], "message": info["message"], "param": info["param"],
                                    "error": info})

    def whole(self, outputs: list[Output]) -> bytes:
        """The non-streamed response of a whole output."""
        out, gen = outputs[0], self.gen
        if out.reasoning:
            self.add(Piece("", reasoning=out.reasoning))
        if out.text or out.logprobs:
            self.add(Piece(out.text, out.logprobs))
        elif not gen.calls:  # a reply of nothing is still one (empty) message
            self._open("message", [])
        for c in gen.calls:
            self.items.append(Item("function_call", _id("fc"), len(self.items), c.arguments, call_id=c.id,
                                   name=c.name))
        final = self.final()
        self._on_done(final)
        return sse.dumps(final)


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
