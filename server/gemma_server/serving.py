"""Request -> engine job -> text -> OpenAI response or SSE stream.

Design: vLLM's `chat_completion/serving.py` and `completion/serving.py`: a generator turns engine output
into text pieces; the streaming path frames them as `chat.completion.chunk` / `text_completion` events
ending with `data: [DONE]`, the non-streaming path joins them. Differences, each on purpose:

- the first engine event is awaited before the stream opens (STYLE.md), so an error before any token
  (engine error, shutdown while queued) is a JSON error with its status, not a broken stream;
- while a request waits for the engine, a task watches for `http.disconnect` (vLLM's
  `with_cancellation`) and cancels it; once the stream is open, Starlette's own disconnect listener
  cancels the generator. Either way the job's cancel flag stops the decode within one token batch and
  the request is recorded with finished_reason="abort";
- an error after the stream opened is sent as `data: {"error": {...}}` then `data: [DONE]` (vLLM,
  llama.cpp), which the openai SDK raises as APIError.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from gemma_server.engine_thread import Done, EngineThread, Job
from gemma_server.errors import ApiError, ShuttingDown, bad_request, sse_error, sse_event
from gemma_server.metrics import Metrics
from gemma_server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    EngineParams,
    ResponseMessage,
    Timings,
    Usage,
)
from gemma_server.text import IncrementalDetokenizer, StopMatcher

log = logging.getLogger(__name__)

DONE_EVENT = b"data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client went away before the response started."""


def render_chat(tokenizer, request: ChatCompletionRequest) -> list[int]:
    """Apply the checkpoint's chat template and tokenize (the template adds BOS itself).

    Raises:
        ApiError: 400 naming `messages` when the template rejects the conversation (e.g. roles that do
            not alternate) or `chat_template_kwargs` when those do not fit.
    """
    import jinja2

    kwargs = dict(request.chat_template_kwargs or {})
    # A template from the request would run arbitrary Jinja (loops that hold the event loop, errors of
    # any type): only the checkpoint's own template is used, as vLLM does by default.
    if "chat_template" in kwargs:
        raise bad_request("chat_template_kwargs", "chat_template cannot be set by a request; the checkpoint's own is used.")
    try:
        text = tokenizer.apply_chat_template(
            request.template_messages(), tokenize=False, add_generation_prompt=request.add_generation_prompt,
            **kwargs,
        )
    except TypeError as e:
        raise bad_request("chat_template_kwargs", f"Bad chat_template_kwargs: {e}") from e
    except (jinja2.TemplateError, ValueError, ArithmeticError, LookupError) as e:
        raise bad_request("messages", f"The chat template rejected the messages: {e}") from e
    return encode(tokenizer, text, "messages", add_special_tokens=False)


def encode(tokenizer, text: str, param: str, add_special_tokens: bool) -> list[int]:
    """tokenizer.encode, with text it cannot take (lone UTF-16 surrogates from a JSON escape) as a 400."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except (TypeError, ValueError, UnicodeError) as e:
        raise bad_request(param, f"The text cannot be tokenized (is it valid Unicode?): {e}") from e


def tokenize_completion(tokenizer, request: CompletionRequest) -> list[int]:
    """A text prompt is tokenized with the tokenizer's special tokens (BOS), as vLLM does; ids pass as they are."""
    prompt = request.single_prompt()
    if isinstance(prompt, str):
        return encode(tokenizer, prompt, "prompt", add_special_tokens=True)
    return list(prompt)


class Generation:
    """One request's decode seen from the asyncio side: token batches in, text pieces out, metrics at the end.

    Args:
        params: from the request's `engine_params`.
        tokenizer: for incremental detokenization.
        engine_thread: where the job goes.
        metrics: where the request is recorded when it ends.
        arrival: time.monotonic() when the request arrived.
    """

    def __init__(self, params: EngineParams, tokenizer, engine_thread: EngineThread, metrics: Metrics,
                 arrival: float) -> None:
        self.params = params
        self.job = Job(list(params.prompt_ids), params.max_new, list(params.stop_ids),
                       asyncio.get_running_loop(), arrival)
        self._thread = engine_thread
        self._metrics = metrics
        self._detok = IncrementalDetokenizer(tokenizer, params.prompt_ids)
        self._stops = StopMatcher(params.stop)
        self.completion_tokens = 0  # tokens that made it into the output
        self._seen = 0  # tokens received from the engine
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.finish_reason: str | None = None
        self.done: Done | None = None
        self._recorded = False

    def _consume(self, ids: list[int]) -> str:
        out = []
        for t in ids:
            self._seen += 1
            if self._stops.stopped:
                continue
            self.completion_tokens += 1
            out.append(self._stops.feed(self._detok.add(t)))
            if self._stops.stopped:
                self.job.cancel = self.job.cancel or "stop"  # the engine stops within one batch
        return "".join(out)

    async def pieces(self) -> AsyncIterator[str]:
        """Text pieces as they are decoded (possibly empty); sets `finish_reason` and `done` at the end.

        Raises:
            ApiError: 503 when the shutdown timeout cut the request, 400/500 when the engine raised.
        """
        reason = "abort"
        events = self.job.events
        pending = None  # an event taken while coalescing, handled next
        try:
            while True:
                kind, payload = pending or await events.get()
                pending = None
                if kind == "tokens":
                    text = self._tokens(*payload)
                    # When the client side fell behind, every batch already waiting becomes one piece:
                    # one SSE event and one write instead of one per batch.
                    while not events.empty():
                        kind, payload = events.get_nowait()
                        if kind != "tokens":
                            pending = (kind, payload)
                            break
                        text += self._tokens(*payload)
                    yield text
                elif kind == "done":
                    self.done = done = payload
                    # Tokens the callbacks did not deliver (the engine returns them all).
                    text = self._consume(done.tokens[self._seen :]) if done.finish != "cancelled" else ""
                    if not self._stops.stopped:
                        text += self._stops.feed(self._detok.flush())
                    text += self._stops.flush()
                    if self.job.cancel == "shutdown":
                        raise ShuttingDown("The server shut down before this request finished "
                                           "(--shutdown-timeout reached).")
                    if self._stops.stopped or done.finish == "stop":
                        reason = "stop"
                    elif done.finish == "length":
                        reason = "length"
                    else:
                        reason = "abort"
                    self.finish_reason = reason
                    yield text
                    return
                else:  # "error"
                    reason = "error"
                    raise _as_api_error(payload)
        except ShuttingDown:
            reason = "abort"
            raise
        finally:
            if self.finish_reason is None and reason != "error":
                # Left early (disconnect, cancellation): stop the decode or leave the queue.
                self.job.cancel = self.job.cancel or "abort"
                self._thread.withdraw(self.job)
            self.record(reason)

    def _tokens(self, ids: list[int], t: float) -> str:
        if self.last_token is not None:
            self._metrics.observe_token_gap(t - self.last_token, len(ids))
        self.first_token = self.first_token or t
        self.last_token = t
        return self._consume(ids)

    def abandon(self) -> None:
        """The client left before the generator ran: cancel the job and record the abort."""
        if not self._recorded:
            self.job.cancel = self.job.cancel or "abort"
            self._thread.withdraw(self.job)
            self.record("abort")

    def record(self, reason: str) -> None:
        """Record the request's metrics once."""
        if self._recorded:
            return
        self._recorded = True
        self._metrics.record_request(
            finished_reason=reason, prompt_tokens=len(self.params.prompt_ids),
            generation_tokens=self.completion_tokens, arrival=self.job.arrival, started=self.job.started,
            first_token=self.first_token, last_token=self.last_token, finished=time.monotonic(),
        )

    def usage(self) -> Usage:
        p = len(self.params.prompt_ids)
        return Usage(prompt_tokens=p, completion_tokens=self.completion_tokens,
                     total_tokens=p + self.completion_tokens)

    def timings(self) -> Timings:
        d = self.done
        return Timings(prompt_read_seconds=d.read_s if d else 0.0, decode_seconds=d.decode_s if d else 0.0)


def _as_api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValueError):  # the engine's own input checks; ours should have caught it first
        return ApiError(400, f"The engine rejected the request: {exc}")
    return ApiError(500, f"The engine failed: {type(exc).__name__}: {exc}")


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
        include_usage: stream_options.include_usage.
    """

    def __init__(self, chat: bool, model: str, fingerprint: str, include_usage: bool = False) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self.include_usage = include_usage

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

    def role_event(self) -> bytes:
        """The chat stream's first event: the assistant role, empty content (OpenAI, vLLM)."""
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def text_event(self, text: str) -> bytes:
        if self.chat:
            return self._chunk([{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}])
        return self._chunk([{"index": 0, "text": text, "logprobs": None, "finish_reason": None}])

    def finish_event(self, reason: str) -> bytes:
        if self.chat:
            return self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}])
        return self._chunk([{"index": 0, "text": "", "logprobs": None, "finish_reason": reason}])

    def usage_event(self, usage: Usage) -> bytes:
        return self._chunk([], usage.model_dump(), with_usage=True)

    def response(self, text: str, gen: Generation) -> ChatCompletionResponse | CompletionResponse:
        reason = gen.finish_reason or "abort"
        if self.chat:
            return ChatCompletionResponse(
                id=self.id, created=self.created, model=self.model, system_fingerprint=self.fingerprint,
                choices=[ChatChoice(message=ResponseMessage(content=text), finish_reason=reason)],
                usage=gen.usage(), timings=gen.timings(),
            )
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, system_fingerprint=self.fingerprint,
            choices=[CompletionChoice(text=text, finish_reason=reason)], usage=gen.usage(), timings=gen.timings(),
        )


async def collect(gen: Generation) -> str:
    """The whole output of a non-streamed request."""
    return "".join([piece async for piece in gen.pieces()])


async def open_stream(gen: Generation, fmt: Formatter, receive) -> AsyncIterator[bytes]:
    """Wait for the first engine event (errors surface as exceptions here), then return the SSE body.

    Raises:
        ApiError: the request failed before any token.
        ClientDisconnected: the client left while the request waited.
    """
    pieces = gen.pieces()
    first = await race_disconnect(receive, pieces.__anext__())
    return _sse_body(gen, fmt, pieces, first)


async def _sse_body(gen: Generation, fmt: Formatter, pieces: AsyncIterator[str], first: str) -> AsyncIterator[bytes]:
    try:
        # The role event and the first text go out in one write: one send, one wake-up of the client.
        head = fmt.role_event() if fmt.chat else b""
        if first:
            head += fmt.text_event(first)
        if head:
            yield head
        async for piece in pieces:
            if piece:
                yield fmt.text_event(piece)
        yield fmt.finish_event(gen.finish_reason or "abort")
        if fmt.include_usage:
            yield fmt.usage_event(gen.usage())
    except ApiError as e:
        yield sse_error(e.status, e.message, e.param)
    finally:
        await pieces.aclose()
    yield DONE_EVENT
