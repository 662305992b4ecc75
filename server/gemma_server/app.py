"""The FastAPI app: thin routes over the engine thread, the error handlers, and the drain on SIGTERM.

Routes (vLLM's `entrypoints/openai/api_server.py` set): POST /v1/chat/completions, POST /v1/completions,
POST /v1/responses with GET and DELETE /v1/responses/{id} (OpenAI's Responses API: frontends/responses.py),
POST /v1/messages (Anthropic's Messages API: frontends/messages.py), POST /v1/audio/transcriptions and
/v1/audio/translations (OpenAI's Audio API as chat requests holding the audio: frontends/transcriptions.py),
POST /tokenize, POST /detokenize (vLLM's shapes), GET /v1/models, GET /health (+ /ping), GET /live, GET
/v1/engine, GET /version, GET /metrics, GET / (chat page), and /mcp (the Model Context Protocol's tools:
frontends/mcp_server.py). The Responses, Messages and
audio routes turn their request into chat requests and take the same path; a chat request's images and audio
become soft tokens there (media.py).
Route bodies only hand over: to the front-end of their API (frontends/: chat.py, responses.py, messages.py,
transcriptions.py, mcp_server.py), which turns the request into a chat or completion request, admits it by
`ServerState.start` (state.py, the one path every request takes; the middleware is middleware.py's) and replies
through `serving.reply` with its format. The work is in protocol/ (what a request means), chat_template.py
(a request's prompt ids), serving.py (tokens -> pieces -> the format's bytes) and scheduler.py (the queue and
the engines).

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
(--max-requests-per-client, jobs.ClientShares), so one client cannot take every slot and the whole
queue. The kubelet's probes have a listener of their own (--probe-port, `create_probe_app`) on its own
thread and event loop, so no load on the API's connections or loop reaches them. Connections themselves
are capped and timed in connections.py.

Shutdown (vLLM's --shutdown-timeout): on SIGTERM /health turns 503
and new requests get 503; queued and running requests get `--shutdown-timeout` seconds to finish;
what remains is aborted (error event, then [DONE]); then uvicorn exits.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager, nullcontext
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Form, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from gemma_server import openapi
from gemma_server.boot import Boot
from gemma_server.chat_template import encode
from gemma_server.config import Config
from gemma_server.errors import ApiError, as_api_error, bad_request, error_body, from_scheduler, invalid_request
from gemma_server.frontends import chat, messages, messages_format, responses, responses_format, transcriptions
from gemma_server.jobs import SchedulerError
from gemma_server.middleware import ApiKeyGate, BodyLimit, InFlightLimit
from gemma_server.protocol.limits import max_prompt_chars
from gemma_server.protocol.replies import ChatCompletionResponse, CompletionResponse, ModelCard, ModelList
from gemma_server.protocol.requests import ChatCompletionRequest, CompletionRequest
from gemma_server.protocol.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from gemma_server.response_store import owner_of
from gemma_server.scheduler import Phase
from gemma_server.serving import ClientDisconnected, client_of
from gemma_server.state import ServerState

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"


def health_response(state: ServerState) -> Response:
    """/health: 200 once serving, else 503 with the reason (boot stage, draining, engine error)."""
    reason = state.not_ready_reason()
    if reason is None:
        return JSONResponse({"status": "ok"})
    return JSONResponse(error_body(503, reason), status_code=503, headers={"Retry-After": "5"})


def live_response(state: ServerState) -> Response:
    """/live: 200 unless the boot failed or no engine is left running (the scheduler's Lifecycle is DEAD)."""
    life = state.scheduler.lifecycle.now()
    if life.phase is Phase.DEAD:
        return JSONResponse(error_body(503, f"No engine is running: {life.reason}"), status_code=503)
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

    @app.post("/v1/chat/completions", response_model=None, responses=openapi.generation(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.serve(state, body, request)

    @app.post("/v1/completions", response_model=None, responses=openapi.generation(CompletionResponse))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await chat.serve(state, body, request)

    # The stored response's id leads to GET and DELETE (OpenAPI links: a client, or schemathesis's stateful
    # phase, follows them with the id the POST returned).
    created = openapi.generation(responses_format.ResponseObject)
    created[200] = {**created[200], "links": {
        op: {"operationId": op, "parameters": {"response_id": "$response.body#/id"},
             "description": "For a stored response only: one created with store false is not kept (404)."}
        for op in ("get_response", "delete_response")}}

    @app.post("/v1/responses", response_model=None, responses=created)
    async def create_response(body: responses.ResponsesRequest, request: Request) -> Response:
        return await responses.serve(state, body, request)

    @app.get("/v1/responses/{response_id}", operation_id="get_response", responses=openapi.errors(401, 404))
    async def get_response(response_id: str, request: Request) -> dict[str, Any]:
        return state.responses.get(response_id, owner_of(request.headers.get("authorization"))).response

    @app.delete("/v1/responses/{response_id}", operation_id="delete_response", responses=openapi.errors(401, 404))
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        state.responses.delete(response_id, owner_of(request.headers.get("authorization")))
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
        return await messages.serve(state, body, request)

    app.router.add_api_route("/v1/messages", create_message, methods=["POST"], response_model=None,
                             responses=messages_format.RESPONSES, route_class_override=messages.AnthropicRoute)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=openapi.errors(400, 404, 413, 429, 503))
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        state.check_model(body.model)
        body.check()
        loaded = state.loaded
        if body.messages is not None:
            conversation = body.as_chat()
            conversation.check()
            conversation.check_size(loaded.context)
            # Media are read with a place in the queue (`queue_place`), as a chat request's are.
            with state.queue_place(client_of(request)) if conversation.media_parts() else nullcontext():
                ids, _, _ = await state.chat_ids(conversation, mark=False, receive=request.receive)
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
        from gemma_server.frontends import mcp_server

        mcp_lifespan = mcp_server.mount(app, mcp_server.build(state), config.mcp_hosts)

    return app
