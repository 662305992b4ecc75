"""`ServerState`: what the routes share, and the one path every request takes (`ServerState.start`): admission,
the prompt, its media and its grammar, then the scheduler. The boot runs on its thread from here, and the drain
on SIGTERM ends here."""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from gemma_server import media, media_encoder, media_worker
from gemma_server.boot import Boot
from gemma_server.chat_template import CacheMarks, chat_prompt, tokenize_completion
from gemma_server.config import Config
from gemma_server.errors import ApiError, bad_request
from gemma_server.grammars import grammar_text
from gemma_server.jobs import Cause, ClientShares, NotReady
from gemma_server.metrics import Metrics
from gemma_server.protocol.limits import MAX_GRAMMAR_BYTES
from gemma_server.protocol.requests import ChatCompletionRequest, CompletionRequest
from gemma_server.response_store import ResponseStore
from gemma_server.scheduler import Life, Phase, Scheduler, StepObserver
from gemma_server.serving import (
    Generation,
    ReplyFormat,
    race_disconnect,
)

log = logging.getLogger(__name__)



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
        self.responses = ResponseStore(config.responses_store_max_count,
                                                 config.responses_store_max_bytes, config.responses_store_max_age,
                                                 config.responses_store_max_count_per_key,
                                                 config.responses_store_max_bytes_per_key)
        self.metrics = m = Metrics(config.model_name, config.context,
                                   (config.num_speculative_tokens or 0) if config.speculative_method else 0)
        self.scheduler = Scheduler(config.queue_limit, StepObserver(
            on_waiting=m.num_requests_waiting.set, on_running=m.num_requests_running.set,
            on_usage=m.kv_cache_usage_perc.set, on_steps=m.observe_steps,
        ))
        self.boot = boot_class(config, self.metrics, self._boot_failed, self.scheduler)
        self.boot_thread = threading.Thread(target=self._boot, name="boot", daemon=True)
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

    def constrain(self, body: ChatCompletionRequest | CompletionRequest) -> tuple[str | None, dict | None]:
        """The request's grammar, compiled once to check it, and the server's own logit bias (tool_choice
        none forbids `<|tool_call>`). Runs on a worker thread (it reads the vocabulary once and compiles).
        Tools, thinking and parallel calls are a chat request's; a completion's grammar is its constraint's.

        Raises:
            ApiError: 400 naming the field: tools for a tokenizer without Gemma 4's tool tokens, a constraint
                on a checkpoint without grammars, a grammar too large or that does not compile.
        """
        from gemma_server.grammars import forbid_calls

        chat = isinstance(body, ChatCompletionRequest)
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

    def not_ready_reason(self, life: Life | None = None) -> str | None:
        """Why /health is 503, or None when ready: `life`, one reading of the scheduler's `Lifecycle` (now by
        default)."""
        life = life or self.scheduler.lifecycle.now()
        if life.phase is Phase.DEAD:
            return f"The engine is not available: {life.reason}"
        if life.phase is Phase.DRAINING:
            return "The server is shutting down."
        if life.phase is Phase.LOADING:
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
        encoded into soft tokens (media_encoder.soft_tokens) and placed (media_encoder.place).
        With `receive` (the request's ASGI receive), a client that leaves while its media are read stops that
        work: its decode is killed.

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
        work = media_encoder.soft_tokens(loaded.media, self.media_workers, parts, self.media_limits, decoded)
        soft = await (race_disconnect(receive, work) if receive is not None else work)
        ids, placed, marks = media_encoder.place(ids, soft, loaded.media.tokens, marks)
        return ids, marks, placed

    async def start(self, body: ChatCompletionRequest | CompletionRequest, client: str,
                    gone: Callable[[], Cause], decoded: Sequence[media.Decoded] | None = None,
                    receive: Callable[[], Awaitable[dict]] | None = None) -> list[Generation]:
        """Admit, tokenize, constrain and queue one request: its choices, queued. The one path every way in
        takes (the HTTP routes and the MCP tools), so the limits, the client's share, the metrics and the
        cancellation of a choice whose reader left (`Generation.leave`, `gone` naming why) are the same.
        A chat request's prompt is its template's, with its media, and its replies are read for thoughts and
        calls; a completion's is its prompt's tokens.
        `decoded`: the chat request's media parts already read (the transcription routes), in order;
        `receive`: the HTTP request's ASGI receive, so a client that leaves stops its media work (`chat_ids`).

        Raises:
            ApiError: 400 (a bad field), 404 (another model), 429 (the client's share is full).
            SchedulerError: the queue is full, the server loads, drains or has no engine (`from_scheduler`
                makes it the 429 or 503 a client sees).
            ClientDisconnected: the client left while its media were read (a 499 nobody reads).
        """
        arrival = time.monotonic()
        chat = isinstance(body, ChatCompletionRequest)
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
            grammar, bias = await asyncio.to_thread(self.constrain, body)
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
        life = self.scheduler.lifecycle.now()
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
            queue_limit=config.queue_limit, max_num_seqs=config.max_num_seqs, ready=life.phase is Phase.SERVING,
            draining=life.draining, engine_error=life.reason, engines=[w.describe() for w in workers],
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
        t = self.scheduler
        if not t.start_drain():
            return
        log.info("draining: new requests get 503; %.1fs for the running ones", self.config.shutdown_timeout)
        self.metrics.engine_ready.set(0)
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


def _is_utf8(text: str) -> bool:
    """False for strings holding lone UTF-16 surrogates (valid JSON escapes, invalid text)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
