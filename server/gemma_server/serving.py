"""The way out, for every API: engine job -> text pieces -> the API's format -> a response or a stream.

Design: vLLM's `chat_completion/serving.py` and `completion/serving.py`: a generator turns engine output
into text pieces (`Generation`); the streaming path hands them to the API's `Format` (frontends/: chat and
completions, Responses, Messages, transcriptions), the non-streaming path joins them and asks the format
for the whole body. `stream` and `reply` are the one place that merges choices, races the client's
disconnect, coalesces what is ready into one write, sends an error as the stream's last event and closes.
Differences from vLLM, each on purpose:

- the first engine event is awaited before the stream opens, so an error before any token (engine error,
  shutdown while queued) is a JSON error with its status, not a broken stream;
- while a request waits for the engine, a task watches for `http.disconnect` (vLLM's
  `with_cancellation`) and cancels it; once the stream is open, Starlette's own disconnect listener
  cancels the generator. Either way that is the request's end (`Job.end`, decided once), which stops the
  decode within one token batch, and the request is recorded with finished_reason="abort";
- an error after the stream opened is the format's last event (OpenAI's: `data: {"error": {...}}` then
  `data: [DONE]`, as vLLM and llama.cpp send it, which the openai SDK raises as APIError).

Each choice's ids go through a `toolcalls.ReplySplitter` before any detokenizing: content ids to the
detokenizer and the stop strings, thought ids to a detokenizer of their own (`reasoning_content`, vLLM's
field), tool calls as `CallStart` / `CallArguments` events (a call's name, then its argument fragments),
with finish_reason "tool_calls" when the reply called. A call that does not parse (tool_choice auto) comes
back as content and is counted (`gemma_tool_call_parse_failures_total`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gemma_server import sse
from gemma_server.connections import STALLED
from gemma_server.errors import ApiError, as_api_error
from gemma_server.jobs import Cause, Done, Job
from gemma_server.metrics import Metrics
from gemma_server.protocol.engine import EngineParams
from gemma_server.protocol.replies import PromptTokensDetails, Timings, Usage
from gemma_server.scheduler import Scheduler
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


class Format(Protocol):
    """One API's replies as bytes: what `stream` and `reply` send, and nothing else. A format is pure (no
    I/O, no asyncio): it is built per request with what it needs to know (the request, its choices) and
    unit-tested by feeding it pieces.

    `open` is the stream's first bytes, `piece` one choice's new output, `finish` one choice's end, `close`
    the stream's last bytes once every choice has ended, `error` its last bytes when it fails after opening;
    `whole` is the non-streamed body, of `media_type`.
    """

    media_type: str

    def open(self) -> bytes: ...

    def piece(self, index: int, piece: Piece) -> bytes: ...

    def finish(self, index: int) -> bytes: ...

    def close(self) -> bytes: ...

    def error(self, err: ApiError) -> bytes: ...

    def whole(self, outputs: list[Output]) -> bytes: ...


Items = AsyncIterator[tuple[int, "Piece | None"]]


async def collect(items: Items) -> list[Output]:
    """The whole output of a non-streamed request, per choice (in the order of their indexes). Texts are
    joined once at the end: a long reply comes in thousands of pieces."""
    outputs: dict[int, Output] = {}
    texts: dict[int, tuple[list[str], list[str]]] = {}
    async for index, piece in items:
        out = outputs.setdefault(index, Output())
        text, reasoning = texts.setdefault(index, ([], []))
        if piece is not None:
            text.append(piece.text)
            reasoning.append(piece.reasoning)
            out.logprobs += piece.logprobs
            if piece.prompt_logprobs is not None:
                out.prompt_logprobs = piece.prompt_logprobs
    for index, (text, reasoning) in texts.items():
        outputs[index].text, outputs[index].reasoning = "".join(text), "".join(reasoning)
    return [outputs[i] for i in sorted(outputs)]


async def merged(gens: list[Generation]) -> Items:
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


async def stream(items: Items, fmt: Format, receive) -> AsyncIterator[bytes]:
    """Wait for the first item (an error before any token raises here), then return the stream's body.

    Raises:
        ApiError: the request failed before any token.
        ClientDisconnected: the client left while the request waited.
    """
    first = await race_disconnect(receive, anext(items, None))
    return _events(items, first, fmt)


async def _events(items: Items, first: tuple[int, Piece | None] | None, fmt: Format) -> AsyncIterator[bytes]:
    """The stream's bytes: `fmt.open`, each item as `piece` or `finish`, `close`; an error after the stream
    opened is `fmt.error`, its last bytes. What is ready goes out in one write (the opening events with the
    first piece: one send, one wake-up of the client). Leaving early (a disconnect cancels this generator)
    closes `items`, which ends every choice and cancels its decode."""
    try:
        head = fmt.open()
        pending = first
        while pending is not None:
            index, piece = pending
            head += fmt.finish(index) if piece is None else fmt.piece(index, piece)
            if head:
                yield head
                head = b""
            pending = await anext(items, None)
        yield head + fmt.close()
    except ClientDisconnected:  # the client left while a later part of the reply queued: nobody reads on
        return
    except Exception as e:  # noqa: BLE001 - the stream is open: the error becomes its last event
        yield fmt.error(as_api_error(e))
    finally:
        await items.aclose()


def client_of(request: Request) -> str:
    """The client's address, as the per-client share counts it."""
    return request.client.host if request.client else "?"


def gone_of(request: Request) -> Callable[[], Cause]:
    """Why a request's client went, asked when it has: connections.py marks a reply it aborted for stalling."""
    return lambda: Cause.STALLED if request.scope.get(STALLED) else Cause.CLIENT_GONE


async def reply(request: Request, items: Items, fmt: Format, streamed: bool) -> Response:
    """The HTTP reply of an admitted request, in any API: with `streamed`, the server-sent events `stream`
    opens (it awaits the first item, so an early failure is a JSON error with its status); else `fmt.whole`
    of every choice's output, built off the event loop (a large answer, n x tokens x top log-probabilities,
    is serialised by C calls that hold the GIL). A client that leaves first is every choice's end (499,
    which nobody reads).

    Args:
        request: the HTTP request (its disconnect).
        items: the reply's pieces, per choice (`merged`), ending with (index, None) for each.
        fmt: the API's format.
        streamed: the request asked for a stream.
    """
    try:
        if streamed:
            return StreamingResponse(await stream(items, fmt, request.receive), media_type="text/event-stream",
                                     headers=sse.HEADERS)
        outputs = await race_disconnect(request.receive, collect(items))
    except ClientDisconnected:
        await items.aclose()
        return Response(status_code=499)
    content = await asyncio.get_running_loop().run_in_executor(None, fmt.whole, outputs)
    return Response(content, media_type=fmt.media_type)
