"""Request -> engine job -> text -> OpenAI response or SSE stream.

Design: vLLM's `chat_completion/serving.py` and `completion/serving.py`: a generator turns engine output
into text pieces; the streaming path frames them as `chat.completion.chunk` / `text_completion` events
ending with `data: [DONE]`, the non-streaming path joins them. Differences, each on purpose:

- the first engine event is awaited before the stream opens, so an error before any token (engine error,
  shutdown while queued) is a JSON error with its status, not a broken stream;
- while a request waits for the engine, a task watches for `http.disconnect` (vLLM's
  `with_cancellation`) and cancels it; once the stream is open, Starlette's own disconnect listener
  cancels the generator. Either way that is the request's end (`Job.end`, decided once), which stops the
  decode within one token batch, and the request is recorded with finished_reason="abort";
- an error after the stream opened is sent as `data: {"error": {...}}` then `data: [DONE]` (vLLM,
  llama.cpp), which the openai SDK raises as APIError.

Each choice's ids go through a `toolcalls.ReplySplitter` before any detokenizing: content ids to the
detokenizer and the stop strings, thought ids to a detokenizer of their own (`reasoning_content`, vLLM's
field), tool calls to `message.tool_calls` and to stream deltas in OpenAI's shape (a call's first delta has
its index, id, type and name with empty arguments; then argument fragments), with finish_reason
"tool_calls" when the reply called. A call that does not parse (tool_choice auto) comes back as content and
is counted (`gemma_tool_call_parse_failures_total`).

Completions' `echo` prepends the prompt's text, and with `logprobs` its tokens' log-probabilities (the first
token has none), from the engine's `prompt_logprobs`, as vLLM's completion serving does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gemma_server.connections import STALLED
from gemma_server.errors import as_api_error, sse_error, sse_event
from gemma_server.metrics import Metrics
from gemma_server.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    EngineParams,
    PromptTokensDetails,
    ResponseFunctionCall,
    ResponseMessage,
    ResponseToolCall,
    Timings,
    Usage,
)
from gemma_server.scheduler import Cause, Done, Job, Scheduler
from gemma_server.text import IncrementalDetokenizer, StopMatcher
from gemma_server.toolcalls import (
    CallArguments,
    CallStart,
    Content,
    GemmaFormat,
    Reasoning,
    ReplySplitter,
    ToolCall,
    thinking_markers,
    token_bytes_of,
)

log = logging.getLogger(__name__)

DONE_EVENT = b"data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client went away before the response started."""


@dataclass
class Piece:
    """New output of one choice: content text, reasoning text, tool-call events, the log-probabilities of
    the tokens behind them, and (on a choice's first piece, when asked for) the prompt's."""

    text: str
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    reasoning: str = ""
    calls: list[CallStart | CallArguments] = field(default_factory=list)
    prompt_logprobs: list | None = None

    def add(self, other: Piece) -> None:
        self.text += other.text
        self.reasoning += other.reasoning
        self.calls += other.calls
        self.logprobs += other.logprobs
        if other.prompt_logprobs is not None:
            self.prompt_logprobs = other.prompt_logprobs

    def empty(self) -> bool:
        return not (self.text or self.reasoning or self.calls or self.logprobs or self.prompt_logprobs)


@dataclass(frozen=True)
class ReplyFormat:
    """What a tokenizer's replies are read with: its Gemma 4 markers (None: it has no tool tokens), its
    thought-channel markers, and each id's bytes. Built once per tokenizer (`of`)."""

    fmt: GemmaFormat | None
    thinking: tuple[int, int] | None
    token_bytes: Callable[[int], bytes]

    @classmethod
    def of(cls, tokenizer) -> ReplyFormat:
        return cls(GemmaFormat.detect(tokenizer), thinking_markers(tokenizer), token_bytes_of(tokenizer))

    def splitter(self, params: EngineParams) -> ReplySplitter:
        """A chat choice's splitter: calls are read when the request declared tools (streamed as they come
        when a grammar forces them); thoughts whenever the tokenizer has the markers."""
        return ReplySplitter(self.fmt, self.thinking, self.token_bytes, tools=params.tools,
                             stream_calls=params.forced_calls)


def plain_splitter() -> ReplySplitter:
    """A splitter that reads every id as content (no tools, no thinking markers)."""
    return ReplySplitter(None, None, lambda i: b"", tools=False, stream_calls=False)


class Generation:
    """One choice's decode seen from the asyncio side: token batches in, text pieces out, metrics at the end.

    Its end is its job's (`Job.end`, decided once): `finish_reason` for the stream and the response, the
    label for the metrics.

    Args:
        params: from the request's `engine_params`.
        index: which of the request's n choices this is.
        job: its engine job (`Generation.create` makes one from `params`).
        tokenizer: for incremental detokenization.
        scheduler: where the job goes.
        metrics: where the request is recorded when it ends.
        on_end: called once, when the choice is recorded (the client's share of the server is given back).
        gone: why the client went, asked when it has (Cause.CLIENT_GONE, or Cause.STALLED when its reply
            stalled: connections.py).
        splitter: this choice's ReplySplitter (`plain_splitter` when the reply holds only content).
    """

    def __init__(self, params: EngineParams, index: int, job: Job, tokenizer, scheduler: Scheduler,
                 metrics: Metrics, on_end: Callable[[], None] = lambda: None,
                 gone: Callable[[], Cause] = lambda: Cause.CLIENT_GONE,
                 splitter: ReplySplitter | None = None) -> None:
        self.params = params
        self.index = index
        self.job = job
        self._on_end = on_end
        self._gone = gone
        self._scheduler = scheduler
        self._metrics = metrics
        self._detok = IncrementalDetokenizer(tokenizer, params.prompt_ids)
        self._thought = IncrementalDetokenizer(tokenizer, ())
        self._splitter = splitter or plain_splitter()
        self._prompt_logprobs: list | None = None
        self._calls: dict[int, tuple[str, str, list[str]]] = {}  # index -> id, name, argument fragments
        self._stops = StopMatcher(params.stop)
        self.completion_tokens = 0  # tokens that made it into the output
        self.reasoning_tokens = 0  # of those, the thought channel's
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.done: Done | None = None
        self._recorded = False

    @classmethod
    def create(cls, params: EngineParams, index: int, arrival: float, tokenizer, scheduler: Scheduler,
               metrics: Metrics, **kw: Any) -> Generation:
        """Choice `index` of a request, with its engine job (its own seed: `EngineParams.choice_sampling`).

        Raises:
            EngineRefused: the engine's own checks refused a value (`Job.create`).
        """
        sampling = params.choice_sampling(index, lambda: random.getrandbits(63))
        job = Job.create(list(params.prompt_ids), params.max_new, list(params.stop_ids), sampling,
                         asyncio.get_running_loop(), arrival, params.grammar, params.prompt_logprobs,
                         cache_salt=params.cache_salt, cache_boundary=params.cache_boundary, media=params.media,
                         next_turn=params.next_turn, speculative=params.speculative)
        return cls(params, index, job, tokenizer, scheduler, metrics, **kw)

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason once the choice has ended ("stop", "length", "abort", or "tool_calls" for
        a reply that stopped after calling); None before, or when it failed."""
        reason = self.job.ended.finish_reason if self.job.ended else None
        return "tool_calls" if reason == "stop" and self.calls else reason

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stops.matched

    @property
    def calls(self) -> list[ToolCall]:
        """The tool calls so far, as their events went out: a forced call cut by max_tokens is there with
        the arguments written before the cut (as the stream sent them)."""
        return [ToolCall(c[0], c[1], "".join(c[2])) for c in self._calls.values()]

    def _consume(self, ids: list[int], logprobs: list) -> Piece:
        out = Piece("")
        for i, t in enumerate(ids):
            if self._stops.stopped:
                break
            self.completion_tokens += 1
            self._split(self._splitter.feed([t]), out)
            if logprobs:
                chosen, top = logprobs[i]
                out.logprobs.append((t, chosen, list(top)))
            if self._stops.stopped:
                self.job.end(Cause.STOP_STRING)  # the engine stops at its next read point
        return out

    def _split(self, events: list, out: Piece) -> None:
        """The splitter's events into `out`: content through the detokenizer and the stop strings, thought
        text through its own detokenizer, calls as they are."""
        for e in events:
            if isinstance(e, Content):
                out.text += "".join(self._stops.feed(self._detok.add(t)) for t in e.ids)
            elif isinstance(e, Reasoning):
                self.reasoning_tokens += len(e.ids)
                out.reasoning += "".join(self._thought.add(t) for t in e.ids)
            elif isinstance(e, CallStart):
                self._calls[e.index] = (e.id, e.name, [])
                out.calls.append(e)
            else:
                self._calls[e.index][2].append(e.text)
                out.calls.append(e)

    async def pieces(self) -> AsyncIterator[Piece]:
        """Pieces as they are decoded (possibly empty), until the choice's end.

        Raises:
            ApiError: the choice failed (the engine refused or failed it: 400/500/503; the shutdown timeout
                cut it: 503).
        """
        events = self.job.events
        pending = None  # an event taken while coalescing, handled next
        try:
            while True:
                kind, payload = pending or await events.get()
                pending = None
                if kind == "prompt_logprobs":
                    self._prompt_logprobs = payload
                    continue
                if kind == "tokens":
                    piece = self._tokens(*payload)
                    # When the client side fell behind, every batch already waiting becomes one piece:
                    # one SSE event and one write instead of one per batch.
                    while not events.empty():
                        kind, payload = events.get_nowait()
                        if kind != "tokens":
                            pending = (kind, payload)
                            break
                        piece.add(self._tokens(*payload))
                    yield self._with_prompt(piece)
                    continue
                if kind == "done":
                    self.done = payload
                    end = self.job.end(Cause.ENGINE, engine_finish=payload.finish)
                else:  # "error"
                    end = self.job.end(Cause.FAILED, error=payload)
                if end.error is not None:
                    raise as_api_error(end.error)
                yield self._with_prompt(self._tail())
                return
        finally:
            # Nothing is decided when the client left (a disconnect, a cancelled task): that is the end.
            self.leave()

    def _with_prompt(self, piece: Piece) -> Piece:
        """`piece`, carrying the prompt's log-probabilities if they have not gone out yet."""
        piece.prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, None
        return piece

    def _tail(self) -> Piece:
        """What was held back until the decode ended: an unterminated call (as content), the text still in
        the detokenizers and the stop matcher. A call that did not parse is counted here."""
        out = Piece("")
        if not self._stops.stopped:
            self._split(self._splitter.close(), out)
            out.text += self._stops.feed(self._detok.flush())
        out.text += self._stops.flush()
        out.reasoning += self._thought.flush()
        if self._splitter.malformed:
            self._metrics.tool_call_parse_failures.inc(self._splitter.malformed)
        return out

    def _tokens(self, ids: list[int], logprobs: list, t: float) -> Piece:
        if self.last_token is not None:
            self._metrics.observe_token_gap(t - self.last_token, len(ids))
        self.first_token = self.first_token or t
        self.last_token = t
        return self._consume(ids, logprobs)

    def leave(self) -> None:
        """The client went away (or the request could not be queued): unless the choice has already ended,
        that is its end (`gone`), which takes the job out of the queue or cancels its decode; then the choice
        is recorded."""
        if self.job.ended is None:
            cause = self.job.end(self._gone()).cause
            self._scheduler.withdraw(self.job)
            log.info("request %d aborted: %s", self.job.id, cause.value)
        self._record()

    def _record(self) -> None:
        """Record the choice's metrics once, under its end's label."""
        if self._recorded:
            return
        self._recorded = True
        self._on_end()
        self._metrics.record_request(
            finished_reason=self.job.ended.label, prompt_tokens=len(self.params.prompt_ids),
            generation_tokens=self.completion_tokens, arrival=self.job.arrival, started=self.job.started,
            first_token=self.first_token, last_token=self.last_token, finished=time.monotonic(),
        )

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the engine took from its prefix cache for this choice (0 until it ends)."""
        return self.done.cached_tokens if self.done else 0

    def timings(self) -> Timings:
        d = self.done
        return Timings(prompt_read_seconds=d.prompt_s if d else 0.0, decode_seconds=d.decode_s if d else 0.0)


def usage(gens: list[Generation]) -> Usage:
    """One request's usage over its choices (the prompt counted once, as OpenAI does for n > 1)."""
    p = len(gens[0].params.prompt_ids)
    c = sum(g.completion_tokens for g in gens)
    # cached_tokens is a part of prompt_tokens, which counts the prompt once: so it is the prompt's cached
    # tokens, the most any choice took from the cache (the choices of one request read one prompt), not
    # their sum over the choices' jobs.
    cached = max(g.cached_tokens for g in gens)
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def race_disconnect(receive, awaitable: Awaitable[Any]) -> Any:
    """Await `awaitable` unless the client disconnects first (vLLM's `with_cancellation`).

    Args:
        receive: the ASGI receive callable of the request (its body already read).
        awaitable: the work.
    Returns:
        the work's result.
    Raises:
        ClientDisconnected: the client left first; the work was cancelled.
    """
    work = asyncio.ensure_future(awaitable)

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        watcher.cancel()
        raise
    if work.done():
        watcher.cancel()
        return work.result()
    work.cancel()
    try:
        await work
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientDisconnected()


@dataclass
class Output:
    """One choice's whole output (a non-streamed request): content and reasoning text, the log-probability
    entries of its tokens, and the prompt's when asked for."""

    text: str = ""
    reasoning: str = ""
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None


class Formatter:
    """Builds the response objects and SSE events of one request.

    Args:
        chat: chat completion (True) or legacy completion.
        model: the served model name.
        fingerprint: system_fingerprint.
        token_text: a token id's text, as log-probabilities report it (ServerState.token_text: decoded
            once per id, since a large answer names the same tokens many times).
        include_usage: stream_options.include_usage.
        echo: completions' echo: the prompt's text (and ids), put before each choice's text.
    """

    def __init__(self, chat: bool, model: str, fingerprint: str, token_text: Callable[[int], str],
                 include_usage: bool = False, echo: tuple[str, tuple[int, ...]] | None = None) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self._token = token_text
        self.include_usage = include_usage
        self.echo = echo
        self._offsets: dict[int, int] = {}  # completions' text_offset, per choice
        self._echoed: set[int] = set()

    def _chunk(self, choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> bytes:
        obj = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if self.include_usage or with_usage:
            obj["usage"] = usage  # OpenAI: null on every chunk but the last when include_usage is set
        return sse_event(obj)

    def prompt_entries(self, prompt_logprobs: list | None) -> list:
        """The echoed prompt's log-probability entries: its first token has none (None, None); each later
        one (id, logprob, top) from the engine's `prompt_logprobs`."""
        if prompt_logprobs is None or self.echo is None:
            return []
        ids = self.echo[1]
        head = [(ids[0], None, None)] if ids else []
        return head + [(t, lp, list(top)) for t, (lp, top) in zip(ids[1:], prompt_logprobs)]

    def logprobs(self, index: int, entries: list) -> dict[str, Any] | None:
        """OpenAI's logprobs object (protocol.ChatLogprobs or CompletionLogprobs, as plain JSON values: a
        large answer holds hundreds of thousands of them) for `entries` [(token id, logprob, [(id, logprob),
        ...])], or None. An echoed prompt's first entry has logprob and top None."""
        if not entries:
            return None
        text = self._token
        if self.chat:
            def top(tid: int, lp: float) -> dict[str, Any]:
                s = text(tid)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}

            content = [{**top(t, lp), "top_logprobs": [top(i, v) for i, v in tops]} for t, lp, tops in entries]
            return {"content": content, "refusal": None}
        tokens = [text(t) for t, _, _ in entries]
        offsets = []
        at = self._offsets.get(index, 0)
        for s in tokens:
            offsets.append(at)
            at += len(s)
        self._offsets[index] = at
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [None if tops is None else {text(i): v for i, v in tops} for _, _, tops in entries],
                "text_offset": offsets}

    def role_event(self, index: int) -> bytes:
        """A chat choice's first event: the assistant role, empty content (OpenAI, vLLM)."""
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def wants_event(self, index: int, piece: Piece) -> bool:
        """Whether `piece` is worth an event (a completion's echo goes out with its first piece)."""
        return not piece.empty() or (self.echo is not None and index not in self._echoed)

    def piece_event(self, index: int, piece: Piece) -> bytes:
        if self.chat:
            lp = self.logprobs(index, piece.logprobs)
            delta: dict[str, Any] = {}
            if piece.reasoning:
                delta["reasoning_content"] = piece.reasoning
            if piece.text or not (piece.reasoning or piece.calls):
                delta["content"] = piece.text
            out = b""
            if delta or lp:
                out = self._chunk([{"index": index, "delta": delta, "logprobs": lp, "finish_reason": None}])
            return out + b"".join(self._chunk([{"index": index, "delta": {"tool_calls": [call_delta(c)]},
                                                "logprobs": None, "finish_reason": None}]) for c in piece.calls)
        text, entries = piece.text, piece.logprobs
        if self.echo is not None and index not in self._echoed:
            self._echoed.add(index)
            text, entries = self.echo[0] + text, self.prompt_entries(piece.prompt_logprobs) + entries
        return self._chunk([{"index": index, "text": text, "logprobs": self.logprobs(index, entries),
                             "finish_reason": None}])

    def finish_event(self, index: int, reason: str) -> bytes:
        if self.chat:
            return self._chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}])
        return self._chunk([{"index": index, "text": "", "logprobs": None, "finish_reason": reason}])

    def usage_event(self, u: Usage) -> bytes:
        return self._chunk([], u.model_dump(), with_usage=True)

    def _entries(self, out: Output) -> list:
        return (self.prompt_entries(out.prompt_logprobs) if not self.chat else []) + out.logprobs

    def response_json(self, outputs: list[Output], gens: list[Generation]) -> bytes:
        """The non-streamed response as the JSON bytes sent (Starlette's JSONResponse rendering), with each
        choice's log-probabilities. The caller runs it off the event loop; it is built and serialised a
        choice at a time, since one C call (json.dumps, pydantic's model_dump) holds the GIL, and with it the
        event loop, until it returns."""
        shell = self.response(outputs, gens).model_dump(exclude_none=False)
        choices = []
        for choice, out, g in zip(shell.pop("choices"), outputs, gens):
            choice["logprobs"] = self.logprobs(g.index, self._entries(out))
            if self.chat and choice["message"]["reasoning_content"] is None:
                del choice["message"]["reasoning_content"]
            choices.append(_json(choice))
        return _json(shell)[:-1] + b',"choices":[' + b",".join(choices) + b"]}"

    def response(self, outputs: list[Output], gens: list[Generation]):
        """The non-streamed response without log-probabilities (`response_json` adds them)."""
        timings = gens[0].timings()
        common = dict(id=self.id, created=self.created, model=self.model, system_fingerprint=self.fingerprint,
                      usage=usage(gens), timings=timings)
        if self.chat:
            choices = [ChatChoice(index=g.index, message=message(out, g), finish_reason=g.finish_reason)
                       for out, g in zip(outputs, gens)]
            return ChatCompletionResponse(choices=choices, **common)
        echo = self.echo[0] if self.echo else ""
        choices = [CompletionChoice(index=g.index, text=echo + out.text, finish_reason=g.finish_reason)
                   for out, g in zip(outputs, gens)]
        return CompletionResponse(choices=choices, **common)


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


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


async def collect(gens: list[Generation]) -> list[Output]:
    """The whole output of a non-streamed request, per choice."""

    async def one(gen: Generation) -> Output:
        out = Output()
        text, reasoning = [], []
        async for piece in gen.pieces():
            text.append(piece.text)
            reasoning.append(piece.reasoning)
            out.logprobs += piece.logprobs
            if piece.prompt_logprobs is not None:
                out.prompt_logprobs = piece.prompt_logprobs
        out.text, out.reasoning = "".join(text), "".join(reasoning)
        return out

    tasks = [asyncio.ensure_future(one(g)) for g in gens]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


async def merged(gens: list[Generation]) -> AsyncIterator[tuple[int, Piece | None]]:
    """Every choice's pieces in the order they come; (index, None) when a choice ends. An error of any
    choice is raised here; leaving early closes every choice (which cancels its decode)."""
    if len(gens) == 1:  # the common case needs no tasks
        async for piece in gens[0].pieces():
            yield 0, piece
        yield 0, None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(gen: Generation) -> None:
        try:
            async for piece in gen.pieces():
                await queue.put((gen.index, piece, None))
            await queue.put((gen.index, None, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((gen.index, None, e))

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        left = len(gens)
        while left:
            index, piece, error = await queue.get()
            if error is not None:
                raise error
            if piece is None:
                left -= 1
            yield index, piece
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def open_stream(gens: list[Generation], fmt: Formatter, receive) -> AsyncIterator[bytes]:
    """Wait for the first engine event (errors surface as exceptions here), then return the SSE body.

    Raises:
        ApiError: the request failed before any token.
        ClientDisconnected: the client left while the request waited.
    """
    items = merged(gens)
    first = await race_disconnect(receive, items.__anext__())
    return _sse_body(gens, fmt, items, first)


async def _sse_body(gens: list[Generation], fmt: Formatter, items: AsyncIterator, first) -> AsyncIterator[bytes]:
    try:
        # The role events and the first text go out in one write: one send, one wake-up of the client.
        head = b"".join(fmt.role_event(g.index) for g in gens) if fmt.chat else b""
        pending = [first]
        while True:
            for index, piece in pending:
                if piece is None:
                    head += fmt.finish_event(index, gens[index].finish_reason)
                elif fmt.wants_event(index, piece):
                    head += fmt.piece_event(index, piece)
            if head:
                yield head
                head = b""
            try:
                pending = [await items.__anext__()]
            except StopAsyncIteration:
                break
        if fmt.include_usage:
            yield fmt.usage_event(usage(gens))
    except Exception as e:  # noqa: BLE001 - the stream is open: the error becomes its last event
        err = as_api_error(e)
        yield sse_error(err.status, err.message, err.param)
    finally:
        await items.aclose()
    yield DONE_EVENT


def client_of(request: Request) -> str:
    """The client's address, as the per-client share counts it."""
    return request.client.host if request.client else "?"


def gone_of(request: Request) -> Callable[[], Cause]:
    """Why a request's client went, asked when it has: connections.py marks a reply it aborted for stalling."""
    return lambda: Cause.STALLED if request.scope.get(STALLED) else Cause.CLIENT_GONE


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def reply(request: Request, gens: list[Generation],
                stream: Callable[[], Awaitable[AsyncIterator[bytes]]] | None,
                whole: Callable[[list[Output]], Awaitable[Response]]) -> Response:
    """The HTTP reply of an admitted generation, in any of the APIs: with `stream`, the server-sent events it
    opens (it awaits the first engine event, so an early failure is a JSON error with its status); else
    `whole` of every choice's output. A client that leaves first is every choice's end (499, which nobody
    reads)."""
    try:
        if stream is not None:
            return StreamingResponse(await stream(), media_type="text/event-stream", headers=SSE_HEADERS)
        outputs = await race_disconnect(request.receive, collect(gens))
    except ClientDisconnected:
        for gen in gens:
            gen.leave()
        return Response(status_code=499)
    return await whole(outputs)
