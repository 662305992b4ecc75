"""The FastAPI app: thin routes over the engine thread, the error handlers, and the drain on SIGTERM.

Routes (vLLM's `entrypoints/openai/api_server.py` set): POST /v1/chat/completions, POST /v1/completions,
POST /v1/responses with GET and DELETE /v1/responses/{id} (OpenAI's Responses API: responses.py), POST
/v1/messages (Anthropic's Messages API: messages.py), POST /v1/audio/transcriptions and /v1/audio/translations
(OpenAI's Audio API as chat requests holding the audio: transcriptions.py), POST /tokenize, POST /detokenize
(vLLM's shapes), GET /v1/models, GET /health (+ /ping), GET /live, GET /v1/engine, GET /version, GET /metrics,
GET / (chat page), and /mcp (the Model Context Protocol's tools: mcp_server.py). The Responses, Messages and
audio routes turn their request into chat requests and take the same path; a chat request's images and audio
become soft tokens there (media.py).
Route bodies only parse, check, admit and hand over (`ServerState.start`, the one path every request takes);
the work is in protocol.py (what a request means), chat_template.py (a request's prompt ids), serving.py
(tokens -> responses) and scheduler.py (the queue and the engines).

A request's constraint (response_format, a forced tool_choice, vLLM's structured_outputs) becomes a
grammar that the checkpoint's `gemma_engine.Grammars` compiles before the request is queued, on a worker
thread (a schema built to be expensive is refused by llguidance's limits without holding the event loop);
one that does not compile is a 400 naming the field.

Every error is `{"error": {...}}` (errors.py); FastAPI's 422 for a malformed body becomes 400 naming
the field, as vLLM's `validation_exception_handler` does. Each route declares the statuses it answers,
and /openapi.json is openapi.py's document of them.

With `--api-key` the API routes (/v1/chat/completions, /v1/completions, /v1/responses[/{id}], /v1/messages,
/v1/audio/transcriptions, /v1/audio/translations, /v1/models, /tokenize, /detokenize, /mcp) need `Authorization: Bearer <key>` (compared in constant time), as
vLLM's `--api-key` (/v1/messages also takes it as Anthropic's `X-Api-Key`); /metrics needs it with
`--metrics-need-key`. The key is checked by ASGI middleware (`ApiKeyGate`) from the headers alone, before
a byte of the body is read, parsed or logged: a client without it costs the server a header parse. /health,
/ping, /live, /version and / stay open for probes, and so does the boot report /v1/engine: the operator
reads it for the custom resource's status, and the operator holds no Secrets. No route shows a filesystem
path (the checkpoint directory, the engine module) unless `--expose-paths` says so.

What one client may hold: requests in flight are capped (`InFlightLimit`, --max-concurrent-requests; the
probes are never counted), and so are the choices one client address has queued or running
(--max-requests-per-client, scheduler.ClientShares), so one client cannot take every slot and the whole
queue. The kubelet's probes have a listener of their own (--probe-port, `create_probe_app`) on its own
thread and event loop, so no load on the API's connections or loop reaches them. Connections themselves
are capped and timed in connections.py.

Shutdown (vLLM's --shutdown-timeout): on SIGTERM /health turns 503
and new requests get 503; queued and running requests get `--shutdown-timeout` seconds to finish;
what remains is aborted (error event, then [DONE]); then uvicorn exits.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, nullcontext
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Form, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from gemma_server import media, media_worker, messages, openapi, responses, transcriptions
from gemma_server.boot import Boot
from gemma_server.chat_template import CacheMarks, chat_prompt, encode, tokenize_completion
from gemma_server.config import Config
from gemma_server.connections import STALLED
from gemma_server.errors import ApiError, as_api_error, bad_request, error_body, from_scheduler, invalid_request
from gemma_server.metrics import Metrics
from gemma_server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    MAX_GRAMMAR_BYTES,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    grammar_text,
    max_prompt_chars,
)
from gemma_server.scheduler import Cause, ClientShares, NotReady, Scheduler, SchedulerError, StepObserver
from gemma_server.serving import (
    ClientDisconnected,
    Formatter,
    Generation,
    Output,
    ReplyFormat,
    collect,
    open_stream,
    race_disconnect,
)

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"


class ServerState:
    """Everything the routes share. One per app.

    Args:
        config: the server config.
        boot_class: Boot or a subclass (tests swap the engine for a Fake* one this way).
    """

    def __init__(self, config: Config, boot_class: type[Boot] = Boot) -> None:
        self.config = config
        # The paths that need the API key (none without --api-key): key_refused and /openapi.json read it.
        self.keyed = frozenset(["/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize",
                                "/v1/responses", "/v1/responses/{response_id}", "/v1/messages", "/mcp",
                                "/v1/audio/transcriptions", "/v1/audio/translations",
                                *(["/metrics"] if config.metrics_need_key else [])] if config.api_key else [])
        # The same paths as one pattern over request paths: a template's `{parameter}` matches one segment.
        self._keyed_paths = re.compile("|".join(
            re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(path)) for path in sorted(self.keyed)) or "(?!)")
        self.responses = responses.ResponseStore(config.responses_store_max_count,
                                                 config.responses_store_max_bytes, config.responses_store_max_age,
                                                 config.responses_store_max_count_per_key,
                                                 config.responses_store_max_bytes_per_key)
        self.metrics = m = Metrics(config.model_name, config.context)
        self.scheduler = Scheduler(config.queue_limit, StepObserver(
            on_waiting=m.num_requests_waiting.set, on_running=m.num_requests_running.set,
            on_usage=m.kv_cache_usage_perc.set, on_steps=m.observe_steps,
        ))
        self.boot = boot_class(config, self.metrics, self._boot_failed, self.scheduler)
        self.boot_thread = threading.Thread(target=self._boot, name="boot", daemon=True)
        self.draining = False
        self.exit_code = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.request_exit = lambda: None  # set by __main__ to stop uvicorn
        self._fingerprint: str | None = None
        self._token_texts: dict[int, str] = {}
        self._reply_format: ReplyFormat | None = None
        self._reply_lock = threading.Lock()
        self.client_shares = ClientShares(config.max_requests_per_client)
        self.media_limits = media.Limits.of(config)
        # The processes that decode images and audio (media_worker.py), started once the checkpoint's towers are.
        self.media_workers = media_worker.Workers.of(config)

    def _boot(self) -> None:
        try:
            self.boot.run()
        except BaseException:  # noqa: BLE001 - the boot records and reports its own failure
            return
        if self.boot.loaded is not None and self.boot.loaded.media is not None:
            self.media_workers.start()

    def _boot_failed(self, reason: str) -> None:
        self.exit_code = 1
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.request_exit)

    @property
    def tokenizer(self):
        return self.boot.loaded.tokenizer

    @property
    def loaded(self):
        """The boot's Loaded (tokenizer, engines, grammars).

        Raises:
            NotReady: the weights are not loaded yet.
        """
        if self.boot.loaded is None:
            raise NotReady("The model is loading.")
        return self.boot.loaded

    def reply_format(self) -> ReplyFormat:
        """The tokenizer's reply markers and token bytes, read once (off the event loop: the first request
        reads the whole vocabulary)."""
        with self._reply_lock:
            if self._reply_format is None:
                self._reply_format = ReplyFormat.of(self.tokenizer)
            return self._reply_format

    def constrain(self, body: ChatCompletionRequest | CompletionRequest, chat: bool) -> tuple[str | None, dict | None]:
        """The request's grammar, compiled once to check it, and the server's own logit bias (tool_choice
        none forbids `<|tool_call>`). Runs on a worker thread (it reads the vocabulary once and compiles).

        Raises:
            ApiError: 400 naming the field: tools for a tokenizer without Gemma 4's tool tokens, a constraint
                on a checkpoint without grammars, a grammar too large or that does not compile.
        """
        from gemma_server.grammars import forbid_calls

        reply = self.reply_format()
        bias = None
        if chat and body.tools:
            if reply.fmt is None:
                raise bad_request("tools", "This checkpoint's tokenizer lacks Gemma 4's tool-call tokens "
                                           "(<|tool_call>, <tool_call|>, <|\"|>, <|tool_response>): it cannot "
                                           "answer tools.")
            if body.tool_choice_mode() == "none":
                bias = forbid_calls(reply.fmt)
        c = body.constraint()
        if c is None:
            return None, bias
        loaded = self.loaded
        if loaded.grammars is None:
            raise bad_request(c.param, f"Structured outputs are not available: {loaded.grammars_missing}.")
        thinking = reply.thinking if chat and body.enable_thinking() else None
        tools = body.template_tools() if chat else None
        parallel = chat and body.parallel_tool_calls is not False and body.tool_choice_mode() != "named"
        grammar = grammar_text(c, tools or [], reply.fmt, thinking, parallel)
        if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
            raise bad_request(c.param, f"The constraint's grammar is {len(grammar.encode())} bytes; at most "
                                       f"{MAX_GRAMMAR_BYTES} are compiled.")
        t0 = time.monotonic()
        try:
            loaded.grammars.check(grammar)
        except ValueError as e:
            raise bad_request(c.param, f"The constraint cannot be compiled: {' '.join(str(e).split())[:1000]}") from e
        finally:
            self.metrics.grammar_compile_seconds.observe(time.monotonic() - t0)
        return grammar, bias

    @property
    def fingerprint(self) -> str:
        """system_fingerprint: names the engine build (crate version, torch, device)."""
        if self._fingerprint is None:
            b = self.boot.state.build
            self._fingerprint = f"gemma_engine-{b.get('version', '?')}-torch{b.get('torch', '?')}-{self.config.device}"
        return self._fingerprint

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            if not model.isascii() and not _is_utf8(model):
                raise ApiError(400, "model is not valid Unicode text.", "model")
            raise ApiError(404, f"The model `{model}` does not exist.", "model")

    def not_ready_reason(self) -> str | None:
        """Why /health is 503, or None when ready."""
        s = self.scheduler
        if s.dead or self.boot.state.failed:
            return f"The engine is not available: {s.dead or self.boot.state.failed}"
        if self.draining:
            return "The server is shutting down."
        if not s.ready:
            return f"Loading model (stage: {self.boot.state.stage})."
        return None

    def key_refused(self, path: str, authorization: bytes | None, x_api_key: bytes | None = None) -> ApiError | None:
        """The 401 for a request to `path` with this Authorization header, or None when the path is open
        (not in `keyed`) or the header carries the key (compared in constant time). On /v1/messages the key
        may come as Anthropic's `X-Api-Key` header instead (what Anthropic's SDK sends for `api_key`)."""
        if not self._keyed_paths.fullmatch(path):
            return None
        if path == "/v1/messages" and x_api_key is not None:
            authorization = b"Bearer " + x_api_key
        scheme, _, token = (authorization or b"").partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token, self.config.api_key.encode()):
            return ApiError(401, "Invalid or missing API key: send `Authorization: Bearer <key>`.",
                            headers={"WWW-Authenticate": "Bearer"})
        return None

    async def chat_ids(self, body: ChatCompletionRequest, mark: bool, decoded: Sequence[media.Decoded] | None = None,
                       receive: Callable[[], Awaitable[dict]] | None = None) -> tuple[list[int], CacheMarks, tuple]:
        """A chat request's prompt: the template rendered and tokenized off the event loop (chat_template.py),
        then its images and audio read and decoded in a media worker (unless `decoded` holds them already),
        encoded into soft tokens (media.soft_tokens) and placed (media.place). With `receive` (the request's
        ASGI receive), a client that leaves while its media are read stops that work: its decode is killed.

        Returns:
            (ids, the cache marks (chat_template.CacheMarks; none without `mark`), the engine's media items).
        Raises:
            ApiError: 400 naming the field: the template's refusal, a media part the checkpoint does not take
                or that breaks a limit or cannot be read.
            ClientDisconnected: the client left while its media were read.
        """
        parts = body.media_parts()
        loaded = self.loaded
        if parts:  # what needs no reading is refused first: a kind the checkpoint lacks, too many, a URL not fetched
            media.check_parts(parts, self.media_limits, loaded.modalities, loaded.media_missing)
        ids, marks = await asyncio.get_running_loop().run_in_executor(
            None, chat_prompt, self.tokenizer, body, mark)
        if not parts:
            return ids, marks, ()
        work = media.soft_tokens(loaded.media, self.media_workers, parts, self.media_limits, decoded)
        soft = await (race_disconnect(receive, work) if receive is not None else work)
        ids, placed, marks = media.place(ids, soft, loaded.media.tokens, marks)
        return ids, marks, placed

    async def start(self, body: ChatCompletionRequest | CompletionRequest, chat: bool, client: str,
                    gone: Callable[[], Cause], decoded: Sequence[media.Decoded] | None = None,
                    receive: Callable[[], Awaitable[dict]] | None = None) -> list[Generation]:
        """Admit, tokenize, constrain and queue one request: its choices, queued. The one path every way in
        takes (the HTTP routes and the MCP tools), so the limits, the client's share, the metrics and the
        cancellation of a choice whose reader left (`Generation.leave`, `gone` naming why) are the same.
        `decoded`: the chat request's media parts already read (the transcription routes), in order;
        `receive`: the HTTP request's ASGI receive, so a client that leaves stops its media work (`chat_ids`).

        Raises:
            ApiError: 400 (a bad field), 404 (another model), 429 (the client's share is full).
            SchedulerError: the queue is full, the server loads, drains or has no engine (`from_scheduler`
                makes it the 429 or 503 a client sees).
            ClientDisconnected: the client left while its media were read (a 499 nobody reads).
        """
        arrival = time.monotonic()
        config = self.config
        self.check_model(body.model)
        body.check()
        body.check_size(config.context)
        sched = self.scheduler
        n = body.n or 1
        shares = self.client_shares
        shares.take(client, n, sched.capacity() + sched.queue_limit)  # 429: past one client's share
        try:
            sched.admit(n)  # 429 / 503 before any tokenizing
        except BaseException:
            shares.give_back(client, n)
            raise
        try:
            tok = self.tokenizer
            # Rendering and tokenizing run off the event loop: a long prompt must not stall /live. A chat
            # prompt's cache marks (the end of its system turn and tools, where its next turn departs) are
            # found when prefix caching is on.
            if chat:
                ids, marks, placed = await self.chat_ids(body, config.enable_prefix_caching, decoded, receive)
            else:
                ids, marks, placed = await asyncio.get_running_loop().run_in_executor(
                    None, tokenize_completion, tok, body), CacheMarks(), ()
            grammar, bias = await asyncio.to_thread(self.constrain, body, chat)
            loaded = self.boot.loaded
            params = body.engine_params(ids, loaded.context, loaded.vocab_size, config.default_temperature,
                                        grammar=grammar, internal_bias=bias, cache_boundary=marks.boundary,
                                        next_turn=marks.next_turn, media=placed)
            # Each choice gives its place in the client's share back when it is recorded, however it ends.
            ended = functools.partial(shares.give_back, client, 1)
            reply = self.reply_format()
            choices = [Generation.create(params, i, arrival, tok, sched, self.metrics, on_end=ended, gone=gone,
                                         **({"splitter": reply.splitter(params)} if chat else {}))
                       for i in range(n)]
            sched.submit(*(gen.job for gen in choices))
        except BaseException:  # nothing was queued: every admission and share goes back
            sched.release(n)
            shares.give_back(client, n)
            raise
        return choices

    @contextmanager
    def queue_place(self, client: str) -> Iterator[None]:
        """One place in the queue and in the client's share, held while a request reads media outside `start`
        (/tokenize, a transcription's file): media are read only after admission on every route, so a flood of
        them is a 429, not a pile of bodies waiting for the media workers.

        Raises:
            SchedulerError: as `start`'s admission: the client's share or the queue is full (429), the server
                loads, drains or has no engine (503).
        """
        sched, shares = self.scheduler, self.client_shares
        shares.take(client, 1, sched.capacity() + sched.queue_limit)
        try:
            sched.admit(1)
        except BaseException:
            shares.give_back(client, 1)
            raise
        try:
            yield
        finally:
            sched.release(1)
            shares.give_back(client, 1)

    def engine_report(self) -> dict[str, Any]:
        """GET /v1/engine's body (and the MCP tool engine_info's): the boot's report, the serving settings,
        the engines; filesystem paths only with --expose-paths."""
        config = self.config
        info = self.boot.state.as_json()
        if not config.expose_paths:
            info.pop("model_dir", None)
            info["build"].pop("module", None)
            info["build"].pop("torch_tpu_compile_cache_dir", None)
        s = self.scheduler
        loaded = self.boot.loaded
        workers = loaded.workers if loaded else []
        if info.get("compile") is not None:
            compilers = self.boot.compilers
            for i, engine in enumerate(info["compile"]["engines"]):
                engine.update(compilers[i].describe() if i in compilers else {})
        if loaded is not None:
            info["media"] = ({**loaded.media.describe(), "decoding": self.media_workers.describe()}
                             if loaded.media is not None else {"modalities": [], "missing": loaded.media_missing})
        info.update(
            model=config.shown_source, served_model_name=config.model_name, read_every=config.read_every,
            queue_limit=config.queue_limit, max_num_seqs=config.max_num_seqs, ready=self.not_ready_reason() is None,
            draining=self.draining, engine_error=s.dead, engines=[w.describe() for w in workers],
            engine_class=type(workers[0].engine).__qualname__ if workers and workers[0].engine is not None else None,
        )
        return info

    def token_text(self, token_id: int) -> str:
        """The text of one token as log-probabilities report it, decoded once per id."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    async def drain(self) -> None:
        """SIGTERM: refuse new work, let current work finish up to the timeout, abort the rest, exit."""
        if self.draining:
            return
        log.info("draining: new requests get 503; %.1fs for the running ones", self.config.shutdown_timeout)
        self.draining = True
        self.metrics.engine_ready.set(0)
        t = self.scheduler
        t.start_drain()
        deadline = time.monotonic() + self.config.shutdown_timeout
        while t.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if t.busy():
            log.warning("shutdown timeout reached: aborting what is left")
            t.abort_all()
            # The engine stops within one token batch; give the streams a moment to send their error event.
            grace = time.monotonic() + 5
            while t.busy() and time.monotonic() < grace:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)  # let the last responses flush
        published = await asyncio.to_thread(self.boot.publish_compile_cache)
        if published:
            log.info("%s", published)
        self.request_exit()


async def serve_response(state: ServerState, body: responses.ResponsesRequest, request: Request) -> Response:
    """POST /v1/responses (responses.py): the request as chat, through `ServerState.start` as every request,
    then its reply as a response object or the Responses stream; stored unless `store` is false."""
    owner = responses.owner_of(request.headers.get("authorization"))
    body.check()
    earlier = None
    if body.previous_response_id is not None:
        earlier = state.responses.get(body.previous_response_id, owner, "previous_response_id").conversation
    chat = responses.to_chat(body, earlier)
    try:
        gens = await state.start(chat.request, True, client_of(request), gone_of(request), receive=request.receive)
    except ApiError as e:
        raise responses.rename(e, chat) from e
    gen = gens[0]
    fmt = responses.ResponseFormatter(body, state.config.model_name, Formatter(
        True, state.config.model_name, state.fingerprint, state.token_text))

    def keep(response: dict[str, Any]) -> None:
        if body.store is not False:
            state.responses.put(owner, response, chat.history + [responses.assistant_message(response)])

    async def whole(outputs: list[Output]) -> Response:
        response = fmt.collect(outputs[0], gen)
        keep(response)
        return JSONResponse(response)

    return await reply(request, gens, (lambda: responses.stream(gen, fmt, request.receive, keep))
                       if body.stream else None, whole)


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


def health_response(state: ServerState) -> Response:
    """/health: 200 once serving, else 503 with the reason (boot stage, draining, engine error)."""
    reason = state.not_ready_reason()
    if reason is None:
        return JSONResponse({"status": "ok"})
    return JSONResponse(error_body(503, reason), status_code=503, headers={"Retry-After": "5"})


def live_response(state: ServerState) -> Response:
    """/live: 200 unless the boot failed or no engine is left running."""
    s = state.scheduler
    if s.dead or state.boot.state.failed:
        return JSONResponse(error_body(503, f"No engine is running: {s.dead or state.boot.state.failed}"),
                            status_code=503)
    return JSONResponse({"status": "alive"})


def create_probe_app(state: ServerState) -> Starlette:
    """The probe listener's app (--probe-port): /live, /health and /ping alone, read from `state`. It runs
    on its own thread and event loop (__main__), so the kubelet's probes never queue behind the API's
    connections or wait for its loop."""

    async def health(request: Request) -> Response:
        return health_response(state)

    async def live(request: Request) -> Response:
        return live_response(state)

    return Starlette(routes=[Route("/health", health), Route("/ping", health), Route("/live", live)])


def _is_utf8(text: str) -> bool:
    """False for strings holding lone UTF-16 surrogates (valid JSON escapes, invalid text)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def send_error(send, err: ApiError) -> None:
    """Answer with `err` from ASGI middleware (no route, no body read)."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ApiKeyGate:
    """ASGI middleware: a request to a keyed path without the key is a 401 from its headers alone, before
    its body is read (the body is never parsed, validated or logged)."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            authorization = next((v for k, v in scope.get("headers") or () if k == b"authorization"), None)
            x_api_key = next((v for k, v in scope.get("headers") or () if k == b"x-api-key"), None)
            refused = self.state.key_refused(scope["path"], authorization, x_api_key)
            if refused is not None:
                return await send_error(send, refused)
        await self.app(scope, receive, send)


# The probe routes: never counted against the in-flight cap (the probe listener serves them too).
PROBE_PATHS = frozenset({"/health", "/ping", "/live"})


class InFlightLimit:
    """ASGI middleware: at `limit` requests in flight a new one is a 503 (Retry-After), probes excepted.

    Requests, not connections: a connection still sending its headers has not reached the app, so a flood
    of unfinished requests (which connections.py times out) cannot turn real requests away, as uvicorn's
    `limit_concurrency` (which counts open connections) would.
    """

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            return await self.app(scope, receive, send)
        if self.in_flight >= self.limit:
            return await send_error(send, ApiError(
                503, f"The server is at its limit of {self.limit} requests in flight. Retry later.",
                headers={"Retry-After": "1"}))
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is a 413 before any of it is parsed.

    A declared Content-Length over the limit is refused at once; otherwise the body is read here, counting
    as it arrives (a chunked body is cut at the limit), and handed on whole. Starlette reads the whole body
    before FastAPI parses it anyway, so this holds no more than it would.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or {}).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(send)
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        whole = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay():
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        await send_error(send, ApiError(413, f"The request body is larger than {self.max_bytes} bytes."))


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    err = invalid_request(exc.errors(), exc.body)
    return JSONResponse(err.body(), status_code=err.status)


def create_app(config: Config, boot_class: type[Boot] = Boot) -> FastAPI:
    """Build the app. The engine thread (and its boot) starts with the app's lifespan.

    Args:
        config: the server config.
        boot_class: Boot, or a Fake* subclass in tests that need a timing the real engine cannot give.
    Returns:
        the FastAPI app; `app.state.server` is its ServerState.
    """
    state = ServerState(config, boot_class)
    mcp_lifespan = None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.boot_thread.start()
        async with mcp_lifespan() if mcp_lifespan else nullcontext():
            yield
        state.scheduler.stop()
        state.media_workers.shutdown()
        if state.boot.loaded is not None and state.boot.loaded.media is not None:
            state.boot.loaded.media.shutdown()

    app = FastAPI(title="gemma-rust-operator server", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.server = state
    # No redirect from /v1/models/ to /v1/models: Starlette builds that Location from the Host header, which
    # the client chooses (an open redirect); an unknown path is a 404.
    app.router.redirect_slashes = False

    def document() -> dict[str, Any]:
        """openapi.py's document; kept once the model's limits are in it."""
        if app.openapi_schema is None:
            loaded = state.boot.loaded
            limits = (openapi.ModelLimits(loaded.vocab_size, loaded.context, max_prompt_chars(loaded.context),
                                          tools=state.reply_format().fmt is not None, modalities=loaded.modalities,
                                          fetch=bool(config.fetch_hosts))
                      if loaded else None)
            doc = openapi.document(app, state.keyed, limits)
            if limits is None:
                return doc
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = document
    # Outermost last: the key is checked first, then the in-flight cap, then the body's size.
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(InFlightLimit, limit=config.max_concurrent_requests)
    app.add_middleware(ApiKeyGate, state=state)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:  # Starlette's Allow names the first matching route's methods, not every route's
            headers = {"Allow": ", ".join(sorted({m for r in app.router.routes if isinstance(r, APIRoute)
                                                  and r.path_regex.match(request.url.path) for m in r.methods}))}
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=headers)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # the client left before its reply began: nobody reads this

    @app.exception_handler(SchedulerError)
    async def _refused(request: Request, exc: SchedulerError) -> JSONResponse:
        err = from_scheduler(exc)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        err = as_api_error(exc)  # logs the exception with a request id; the body names only the id
        return JSONResponse(err.body(), status_code=err.status)

    async def generate(request: Request, body: ChatCompletionRequest | CompletionRequest, chat: bool) -> Response:
        gens = await state.start(body, chat, client_of(request), gone_of(request), receive=request.receive)
        tok = state.tokenizer
        params = gens[0].params
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        echo = None
        if not chat and body.echo:
            prompt = body.single_prompt()
            echo = (prompt if isinstance(prompt, str) else tok.decode(params.prompt_ids), params.prompt_ids)
        fmt = Formatter(chat, state.config.model_name, state.fingerprint, state.token_text, include_usage, echo)

        async def whole(outputs: list[Output]) -> Response:
            # A large answer (n x tokens x top log-probabilities) is built and serialised off the event loop.
            content = await asyncio.get_running_loop().run_in_executor(None, fmt.response_json, outputs, gens)
            return Response(content, media_type="application/json")

        return await reply(request, gens, (lambda: open_stream(gens, fmt, request.receive)) if body.stream else None,
                           whole)

    @app.post("/v1/chat/completions", response_model=None, responses=openapi.generation(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await generate(request, body, chat=True)

    @app.post("/v1/completions", response_model=None, responses=openapi.generation(CompletionResponse))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await generate(request, body, chat=False)

    # The stored response's id leads to GET and DELETE (OpenAPI links: a client, or schemathesis's stateful
    # phase, follows them with the id the POST returned).
    created = openapi.generation(responses.ResponseObject)
    created[200] = {**created[200], "links": {
        op: {"operationId": op, "parameters": {"response_id": "$response.body#/id"},
             "description": "For a stored response only: one created with store false is not kept (404)."}
        for op in ("get_response", "delete_response")}}

    @app.post("/v1/responses", response_model=None, responses=created)
    async def create_response(body: responses.ResponsesRequest, request: Request) -> Response:
        return await serve_response(state, body, request)

    @app.get("/v1/responses/{response_id}", operation_id="get_response", responses=openapi.errors(401, 404))
    async def get_response(response_id: str, request: Request) -> dict[str, Any]:
        return state.responses.get(response_id, responses.owner_of(request.headers.get("authorization"))).response

    @app.delete("/v1/responses/{response_id}", operation_id="delete_response", responses=openapi.errors(401, 404))
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        state.responses.delete(response_id, responses.owner_of(request.headers.get("authorization")))
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/audio/transcriptions", response_model=None, responses=transcriptions.RESPONSES)
    async def create_transcription(body: Annotated[transcriptions.TranscriptionForm, Form()],
                                   request: Request) -> Response:
        return await transcriptions.serve(state, body, request, "transcribe")

    @app.post("/v1/audio/translations", response_model=None, responses=transcriptions.RESPONSES)
    async def create_translation(body: Annotated[transcriptions.TranslationForm, Form()],
                                 request: Request) -> Response:
        return await transcriptions.serve(state, body, request, "translate")

    async def create_message(body: messages.MessagesRequest, request: Request) -> Response:
        """Anthropic's Messages API: the request as a chat request (messages.to_chat), admitted by the one
        path (`ServerState.start`), its reply as Anthropic's message or events (errors: messages.AnthropicRoute)."""
        translation = messages.to_chat(body)
        try:
            gens = await state.start(translation.chat, True, client_of(request), gone_of(request),
                                     receive=request.receive)
        except ApiError as e:
            raise translation.names.error(e) from None
        fmt = messages.MessageFormatter(state.config.model_name)

        async def whole(outputs: list[Output]) -> Response:
            return Response(fmt.response_json(outputs[0], gens[0]), media_type="application/json")

        return await reply(request, gens, (lambda: messages.open_stream(gens, fmt, request.receive))
                           if body.stream else None, whole)

    app.router.add_api_route("/v1/messages", create_message, methods=["POST"], response_model=None,
                             responses=messages.RESPONSES, route_class_override=messages.AnthropicRoute)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=openapi.errors(400, 404, 413, 429, 503))
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        state.check_model(body.model)
        body.check()
        loaded = state.loaded
        if body.messages is not None:
            chat = body.as_chat()
            chat.check()
            chat.check_size(loaded.context)
            # Media are read with a place in the queue (`queue_place`), as a chat request's are.
            with state.queue_place(client_of(request)) if chat.media_parts() else nullcontext():
                ids, _, _ = await state.chat_ids(chat, mark=False, receive=request.receive)
        else:
            if len(body.prompt) > max_prompt_chars(loaded.context):
                raise bad_request("prompt", f"The prompt is longer than {max_prompt_chars(loaded.context)} characters.")
            ids = await asyncio.get_running_loop().run_in_executor(
                None, encode, loaded.tokenizer, body.prompt, "prompt", body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=loaded.context, tokens=ids).model_dump()

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=openapi.errors(400, 404, 413, 503))
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        loaded = state.loaded
        bad = [t for t in body.tokens if not 0 <= t < loaded.vocab_size]
        if bad:
            raise bad_request("tokens", f"Token id {bad[0]} is outside the vocabulary [0, {loaded.vocab_size}).")
        text = await asyncio.get_running_loop().run_in_executor(None, loaded.tokenizer.decode, body.tokens)
        return DetokenizeResponse(prompt=text).model_dump()

    @app.get("/v1/models", response_model=ModelList)
    async def models(request: Request) -> dict[str, Any]:
        card = ModelCard(id=config.model_name, root=config.shown_source, max_model_len=config.context)
        return ModelList(data=[card]).model_dump()

    @app.get("/health", responses=openapi.PROBE)
    @app.get("/ping", responses=openapi.PROBE)
    async def health() -> Response:
        return health_response(state)

    @app.get("/live", responses=openapi.PROBE)
    async def live() -> Response:
        return live_response(state)

    @app.get("/v1/engine")
    async def engine_info() -> dict[str, Any]:
        return state.engine_report()

    @app.get("/version")
    async def version() -> dict[str, Any]:
        from gemma_server import __version__

        return {"version": __version__, "engine": state.boot.state.build.get("version")}

    @app.get("/metrics", response_class=PlainTextResponse, responses=openapi.METRICS)
    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse, responses=openapi.PAGE)
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    if config.enable_mcp:
        from gemma_server import mcp_server

        mcp_lifespan = mcp_server.mount(app, mcp_server.build(state), config.mcp_hosts)

    return app
