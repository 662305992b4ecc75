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

from gemma_server.errors import as_api_error, sse_error, sse_event
from gemma_server.metrics import Metrics
from gemma_server.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    EngineParams,
    ResponseMessage,
    Timings,
    Usage,
)
from gemma_server.scheduler import Cause, Done, Job, Scheduler
from gemma_server.text import IncrementalDetokenizer, StopMatcher

log = logging.getLogger(__name__)

DONE_EVENT = b"data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client went away before the response started."""


@dataclass
class Piece:
    """New output text of one choice, and the log-probabilities of the tokens behind it."""

    text: str
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)


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
    """

    def __init__(self, params: EngineParams, index: int, job: Job, tokenizer, scheduler: Scheduler,
                 metrics: Metrics, on_end: Callable[[], None] = lambda: None,
                 gone: Callable[[], Cause] = lambda: Cause.CLIENT_GONE) -> None:
        self.params = params
        self.index = index
        self.job = job
        self._on_end = on_end
        self._gone = gone
        self._scheduler = scheduler
        self._metrics = metrics
        self._detok = IncrementalDetokenizer(tokenizer, params.prompt_ids)
        self._stops = StopMatcher(params.stop)
        self.completion_tokens = 0  # tokens that made it into the output
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
                         asyncio.get_running_loop(), arrival)
        return cls(params, index, job, tokenizer, scheduler, metrics, **kw)

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason once the choice has ended ("stop", "length", "abort"); None before, or when
        it failed."""
        return self.job.ended.finish_reason if self.job.ended else None

    def _consume(self, ids: list[int], logprobs: list) -> Piece:
        out = Piece("")
        texts = []
        for i, t in enumerate(ids):
            if self._stops.stopped:
                break
            self.completion_tokens += 1
            texts.append(self._stops.feed(self._detok.add(t)))
            if logprobs:
                chosen, top = logprobs[i]
                out.logprobs.append((t, chosen, list(top)))
            if self._stops.stopped:
                self.job.end(Cause.STOP_STRING)  # the engine stops at its next read point
        out.text = "".join(texts)
        return out

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
                if kind == "tokens":
                    piece = self._tokens(*payload)
                    # When the client side fell behind, every batch already waiting becomes one piece:
                    # one SSE event and one write instead of one per batch.
                    while not events.empty():
                        kind, payload = events.get_nowait()
                        if kind != "tokens":
                            pending = (kind, payload)
                            break
                        more = self._tokens(*payload)
                        piece.text += more.text
                        piece.logprobs += more.logprobs
                    yield piece
                    continue
                if kind == "done":
                    self.done = payload
                    end = self.job.end(Cause.ENGINE, engine_finish=payload.finish)
                else:  # "error"
                    end = self.job.end(Cause.FAILED, error=payload)
                if end.error is not None:
                    raise as_api_error(end.error)
                yield Piece(self._tail())
                return
        finally:
            # Nothing is decided when the client left (a disconnect, a cancelled task): that is the end.
            self.leave()

    def _tail(self) -> str:
        """The text held back until the decode ended."""
        text = "" if self._stops.stopped else self._stops.feed(self._detok.flush())
        return text + self._stops.flush()

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

    def timings(self) -> Timings:
        d = self.done
        return Timings(prompt_read_seconds=d.prompt_s if d else 0.0, decode_seconds=d.decode_s if d else 0.0)


def usage(gens: list[Generation]) -> Usage:
    """One request's usage over its choices (the prompt counted once, as OpenAI does for n > 1)."""
    p = len(gens[0].params.prompt_ids)
    c = sum(g.completion_tokens for g in gens)
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


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


class Formatter:
    """Builds the response objects and SSE events of one request.

    Args:
        chat: chat completion (True) or legacy completion.
        model: the served model name.
        fingerprint: system_fingerprint.
        token_text: a token id's text, as log-probabilities report it (ServerState.token_text: decoded
            once per id, since a large answer names the same tokens many times).
        include_usage: stream_options.include_usage.
    """

    def __init__(self, chat: bool, model: str, fingerprint: str, token_text: Callable[[int], str],
                 include_usage: bool = False) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self._token = token_text
        self.include_usage = include_usage
        self._offsets: dict[int, int] = {}  # completions' text_offset, per choice

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

    def logprobs(self, index: int, entries: list) -> dict[str, Any] | None:
        """OpenAI's logprobs object (protocol.ChatLogprobs or CompletionLogprobs, as plain JSON values: a
        large answer holds hundreds of thousands of them) for `entries` [(token id, logprob, [(id, logprob),
        ...])], or None."""
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
                "top_logprobs": [{text(i): v for i, v in tops} for _, _, tops in entries], "text_offset": offsets}

    def role_event(self, index: int) -> bytes:
        """A chat choice's first event: the assistant role, empty content (OpenAI, vLLM)."""
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def piece_event(self, index: int, piece: Piece) -> bytes:
        lp = self.logprobs(index, piece.logprobs)
        if self.chat:
            return self._chunk([{"index": index, "delta": {"content": piece.text}, "logprobs": lp,
                                 "finish_reason": None}])
        return self._chunk([{"index": index, "text": piece.text, "logprobs": lp, "finish_reason": None}])

    def finish_event(self, index: int, reason: str) -> bytes:
        if self.chat:
            return self._chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}])
        return self._chunk([{"index": index, "text": "", "logprobs": None, "finish_reason": reason}])

    def usage_event(self, u: Usage) -> bytes:
        return self._chunk([], u.model_dump(), with_usage=True)

    def response_json(self, outputs: list[tuple[str, list]], gens: list[Generation]) -> bytes:
        """The non-streamed response as the JSON bytes sent (Starlette's JSONResponse rendering), with each
        choice's log-probabilities. The caller runs it off the event loop; it is built and serialised a
        choice at a time, since one C call (json.dumps, pydantic's model_dump) holds the GIL, and with it the
        event loop, until it returns."""
        shell = self.response(outputs, gens).model_dump()
        choices = []
        for choice, (_, lps), g in zip(shell.pop("choices"), outputs, gens):
            choice["logprobs"] = self.logprobs(g.index, lps)
            choices.append(_json(choice))
        return _json(shell)[:-1] + b',"choices":[' + b",".join(choices) + b"]}"

    def response(self, outputs: list[tuple[str, list]], gens: list[Generation]):
        """The non-streamed response without log-probabilities (`response_json` adds them): `outputs[i]` is
        choice i's (text, logprob entries)."""
        timings = gens[0].timings()
        common = dict(id=self.id, created=self.created, model=self.model, system_fingerprint=self.fingerprint,
                      usage=usage(gens), timings=timings)
        if self.chat:
            choices = [ChatChoice(index=g.index, message=ResponseMessage(content=text),
                                  finish_reason=g.finish_reason)
                       for (text, _), g in zip(outputs, gens)]
            return ChatCompletionResponse(choices=choices, **common)
        choices = [CompletionChoice(index=g.index, text=text, finish_reason=g.finish_reason)
                   for (text, _), g in zip(outputs, gens)]
        return CompletionResponse(choices=choices, **common)


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


async def collect(gens: list[Generation]) -> list[tuple[str, list]]:
    """The whole output of a non-streamed request: per choice, its text and log-probability entries."""

    async def one(gen: Generation) -> tuple[str, list]:
        text, lps = [], []
        async for piece in gen.pieces():
            text.append(piece.text)
            lps += piece.logprobs
        return "".join(text), lps

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
                elif piece.text or piece.logprobs:
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
