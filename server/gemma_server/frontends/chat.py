"""OpenAI's chat completions and completions as formats (`serving.Format`): `chat.completion.chunk` and
`text_completion` events ending with `data: [DONE]`, and the whole response objects.

Shapes: the OpenAI API reference and the openai SDK's types, as vLLM's `chat_completion/serving.py` and
`completion/serving.py` send them: a chat choice's first event is the assistant role with empty content; a
tool call's first delta has its index, id, type and name with empty arguments, then argument fragments;
`usage` is null on every chunk but the last when `stream_options.include_usage` is set. Completions' `echo`
prepends the prompt's text, and with `logprobs` its tokens' log-probabilities (the first token has none),
from the engine's `prompt_logprobs`, as vLLM's completion serving does.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from gemma_server import sse
from gemma_server.errors import ApiError
from gemma_server.protocol.replies import (
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    ResponseFunctionCall,
    ResponseMessage,
    ResponseToolCall,
)
from gemma_server.protocol.requests import ChatCompletionRequest, CompletionRequest
from gemma_server.serving import Format, Generation, Output, Piece, client_of, gone_of, merged, reply, usage
from gemma_server.toolcalls import CallArguments, CallStart

if TYPE_CHECKING:
    from gemma_server.state import ServerState

TokenText = Callable[[int], str]


def chat_logprobs(entries: list, text: TokenText) -> dict[str, Any] | None:
    """OpenAI's chat logprobs object (protocol.replies.ChatLogprobs, as plain JSON values: a large answer holds
    hundreds of thousands of them) for `entries` [(token id, logprob, [(id, logprob), ...])], or None."""
    if not entries:
        return None

    def top(tid: int, lp: float) -> dict[str, Any]:
        s = text(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**top(t, lp), "top_logprobs": [top(i, v) for i, v in tops]} for t, lp, tops in entries],
            "refusal": None}


def message(out: Output, gen: Generation) -> ResponseMessage:
    """A chat choice's message: content (null when the reply only called), its calls, its reasoning."""
    calls = [ResponseToolCall(id=c.id, function=ResponseFunctionCall(name=c.name, arguments=c.arguments))
             for c in gen.calls]
    content = None if calls and not out.text.strip() else out.text
    return ResponseMessage(content=content, tool_calls=calls, reasoning_content=out.reasoning or None)


def call_delta(event: CallStart | CallArguments) -> dict[str, Any]:
    """One tool-call stream delta in OpenAI's shape: a call's first names it (arguments empty), the next
    ones carry argument fragments."""
    if isinstance(event, CallStart):
        return {"index": event.index, "id": event.id, "type": "function",
                "function": {"name": event.name, "arguments": ""}}
    return {"index": event.index, "function": {"arguments": event.text}}


class _Chunks(ABC):
    """What chat and completions share: the request's id and chunk envelope, the finish and usage chunks, the
    error and [DONE] ending, and the whole response's assembly.

    Args:
        gens: the request's choices.
        model: the served model name.
        fingerprint: system_fingerprint.
        token_text: a token id's text, as log-probabilities report it (ServerState.token_text: decoded
            once per id, since a large answer names the same tokens many times).
        include_usage: stream_options.include_usage.
    """

    media_type = "application/json"
    object_name = ""
    id_prefix = ""

    def __init__(self, gens: list[Generation], model: str, fingerprint: str, token_text: TokenText,
                 include_usage: bool = False) -> None:
        self.gens = gens
        self.id = self.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self.token_text = token_text
        self.include_usage = include_usage

    def chunk(self, choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> bytes:
        obj = {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
               "system_fingerprint": self.fingerprint, "choices": choices}
        if self.include_usage or with_usage:
            obj["usage"] = usage  # OpenAI: null on every chunk but the last when include_usage is set
        return sse.event(obj)

    def close(self) -> bytes:
        last = self.chunk([], usage(self.gens).model_dump(), with_usage=True) if self.include_usage else b""
        return last + sse.DONE

    def error(self, err: ApiError) -> bytes:
        return sse.event(err.body()) + sse.DONE

    def whole(self, outputs: list[Output]) -> bytes:
        """The non-streamed response as the JSON bytes sent, with each choice's log-probabilities, built and
        serialised a choice at a time (one C call, json.dumps or pydantic's model_dump, holds the GIL until
        it returns)."""
        shell = self.response(outputs).model_dump(exclude_none=False)
        choices = [sse.dumps(self.whole_choice(choice, out, g))
                   for choice, out, g in zip(shell.pop("choices"), outputs, self.gens)]
        return sse.dumps(shell)[:-1] + b',"choices":[' + b",".join(choices) + b"]}"

    def common(self) -> dict[str, Any]:
        """The response object's fields besides its choices."""
        return dict(id=self.id, created=self.created, model=self.model, system_fingerprint=self.fingerprint,
                    usage=usage(self.gens), timings=self.gens[0].timings())

    @abstractmethod
    def response(self, outputs: list[Output]) -> ChatCompletionResponse | CompletionResponse:
        """The response object without log-probabilities (`whole` adds them)."""

    @abstractmethod
    def whole_choice(self, choice: dict[str, Any], out: Output, gen: Generation) -> dict[str, Any]:
        """One choice of the whole response, as `response` dumped it, with its log-probabilities."""


class ChatFormat(_Chunks):
    """A chat completion: `chat.completion.chunk` events, or the `chat.completion` object."""

    object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def open(self) -> bytes:
        """Each choice's first event: the assistant role, empty content (OpenAI, vLLM)."""
        return b"".join(self.chunk([{"index": g.index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]) for g in self.gens)

    def piece(self, index: int, piece: Piece) -> bytes:
        if piece.empty():
            return b""
        lp = chat_logprobs(piece.logprobs, self.token_text)
        delta: dict[str, Any] = {}
        if piece.reasoning:
            delta["reasoning_content"] = piece.reasoning
        if piece.text or not (piece.reasoning or piece.calls):
            delta["content"] = piece.text
        out = b""
        if delta or lp:
            out = self.chunk([{"index": index, "delta": delta, "logprobs": lp, "finish_reason": None}])
        return out + b"".join(self.chunk([{"index": index, "delta": {"tool_calls": [call_delta(c)]},
                                           "logprobs": None, "finish_reason": None}]) for c in piece.calls)

    def finish(self, index: int) -> bytes:
        return self.chunk([{"index": index, "delta": {}, "logprobs": None,
                            "finish_reason": self.gens[index].finish_reason}])

    def response(self, outputs: list[Output]) -> ChatCompletionResponse:
        """The response without log-probabilities (`whole` adds them)."""
        choices = [ChatChoice(index=g.index, message=message(out, g), finish_reason=g.finish_reason)
                   for out, g in zip(outputs, self.gens)]
        return ChatCompletionResponse(choices=choices, **self.common())

    def whole_choice(self, choice: dict[str, Any], out: Output, gen: Generation) -> dict[str, Any]:
        choice["logprobs"] = chat_logprobs(out.logprobs, self.token_text)
        if choice["message"]["reasoning_content"] is None:
            del choice["message"]["reasoning_content"]
        return choice


class CompletionFormat(_Chunks):
    """A (legacy) completion: `text_completion` events, or the `text_completion` object.

    Args:
        echo: completions' echo: the prompt's text and ids, put before each choice's text.
    """

    object_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, gens: list[Generation], model: str, fingerprint: str, token_text: TokenText,
                 include_usage: bool = False, echo: tuple[str, tuple[int, ...]] | None = None) -> None:
        super().__init__(gens, model, fingerprint, token_text, include_usage)
        self.echo = echo
        self._offsets: dict[int, int] = {}  # text_offset, per choice
        self._echoed: set[int] = set()

    def open(self) -> bytes:
        return b""

    def prompt_entries(self, prompt_logprobs: list | None) -> list:
        """The echoed prompt's log-probability entries: its first token has none (None, None); each later
        one (id, logprob, top) from the engine's `prompt_logprobs`."""
        if prompt_logprobs is None or self.echo is None:
            return []
        ids = self.echo[1]
        head = [(ids[0], None, None)] if ids else []
        return head + [(t, lp, list(top)) for t, (lp, top) in zip(ids[1:], prompt_logprobs)]

    def logprobs(self, index: int, entries: list) -> dict[str, Any] | None:
        """protocol.replies.CompletionLogprobs as plain JSON values, with text offsets running on over the choice's
        earlier entries."""
        if not entries:
            return None
        tokens = [self.token_text(t) for t, _, _ in entries]
        offsets = []
        at = self._offsets.get(index, 0)
        for s in tokens:
            offsets.append(at)
            at += len(s)
        self._offsets[index] = at
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [None if tops is None else {self.token_text(i): v for i, v in tops}
                                 for _, _, tops in entries],
                "text_offset": offsets}

    def piece(self, index: int, piece: Piece) -> bytes:
        text, entries = piece.text, piece.logprobs
        if self.echo is not None and index not in self._echoed:  # the echo goes out with the first piece
            self._echoed.add(index)
            text, entries = self.echo[0] + text, self.prompt_entries(piece.prompt_logprobs) + entries
        elif piece.empty():
            return b""
        return self.chunk([{"index": index, "text": text, "logprobs": self.logprobs(index, entries),
                            "finish_reason": None}])

    def finish(self, index: int) -> bytes:
        return self.chunk([{"index": index, "text": "", "logprobs": None,
                            "finish_reason": self.gens[index].finish_reason}])

    def response(self, outputs: list[Output]) -> CompletionResponse:
        """The response without log-probabilities (`whole` adds them)."""
        echo = self.echo[0] if self.echo else ""
        choices = [CompletionChoice(index=g.index, text=echo + out.text, finish_reason=g.finish_reason)
                   for out, g in zip(outputs, self.gens)]
        return CompletionResponse(choices=choices, **self.common())

    def whole_choice(self, choice: dict[str, Any], out: Output, gen: Generation) -> dict[str, Any]:
        choice["logprobs"] = self.logprobs(gen.index, self.prompt_entries(out.prompt_logprobs) + out.logprobs)
        return choice


async def serve(state: ServerState, body: ChatCompletionRequest | CompletionRequest, request: Request) -> Response:
    """POST /v1/chat/completions and POST /v1/completions: the request through `ServerState.start`, its reply
    through `serving.reply` as chat's or completions' format."""
    gens = await state.start(body, client_of(request), gone_of(request), receive=request.receive)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    common = (gens, state.config.model_name, state.fingerprint, state.token_text, include_usage)
    if isinstance(body, ChatCompletionRequest):
        fmt: Format = ChatFormat(*common)
    else:
        fmt = CompletionFormat(*common, echo=echo_of(body, gens[0].params.prompt_ids, state.tokenizer))
    return await reply(request, merged(gens), fmt, bool(body.stream))


def echo_of(body: CompletionRequest, prompt_ids: Sequence[int], tokenizer) -> tuple[str, tuple[int, ...]] | None:
    """What a completion's `echo` puts before each choice: the prompt's text (as given, or its ids decoded)
    and ids; None without echo."""
    if not body.echo:
        return None
    prompt = body.single_prompt()
    return (prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids), tuple(prompt_ids))
