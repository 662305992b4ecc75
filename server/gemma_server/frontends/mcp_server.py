"""The server's MCP endpoint: POST/GET/DELETE /mcp, the Model Context Protocol's streamable HTTP transport.

Built on the official SDK (`mcp` 2.3.0, `mcp.server.mcpserver.MCPServer`) and served stateless
(`stateless_http=True`): no session id is kept between requests, so replicas behind one Service need no
affinity. Tools:

- `ask`: one chat turn (optionally about an image, a data URL); the text, finish reason, token counts,
  prompt-read seconds, decode tokens/s;
- `stream`: the same, with a progress notification for each piece of text as it is decoded (progress =
  tokens so far, total = max_tokens) and the time to first token in the result;
- `engine_info`: what GET /v1/engine says (build, versions, device, engines, slots, KV bytes);
- `endpoint_status`: ready or why not, draining, queued and running requests, free slots;
- `serving_metrics`: a parsed snapshot of the counters that matter, read from the server's own registry.

A tool's generation goes through `ServerState.start`, the path the HTTP routes take: the same checks (a bad
field is a tool error naming it, as the route's 400 does), the same queue limit and per-client share (429
and 503 come back as tool errors with their status), the same metrics, and the same cancellation: a tool
call the client cancels (or whose HTTP stream closes) cancels its task, and `Generation.pieces` ends the
choice, freeing its slot.

Security: with `--api-key`, /mcp needs the key (the `ApiKeyGate` middleware checks it before the body is
read). The SDK's DNS-rebinding protection (`TransportSecuritySettings`) checks the Host header against
`--mcp-allowed-hosts` (localhost by default; the operator adds the Service's in-cluster names) and a
browser's Origin against the same hosts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp
from mcp.server.transport_security import TransportSecuritySettings
from pydantic import BaseModel, Field, ValidationError

from gemma_server.errors import as_api_error, invalid_request
from gemma_server.jobs import Cause
from gemma_server.protocol.requests import ChatCompletionRequest

if TYPE_CHECKING:
    from gemma_server.state import ServerState
    from gemma_server.serving import Generation

PATH = "/mcp"
DEFAULT_MAX_TOKENS = 256

Prompt = Annotated[str, Field(description="The user's message.", min_length=1)]
System = Annotated[str | None, Field(description="A system turn before the message.")]
MaxTokens = Annotated[int, Field(description="The most tokens to generate.", ge=1)]
Temperature = Annotated[float | None, Field(description="Sampling temperature, 0 for greedy (default: the "
                                                         "server's --default-temperature).", ge=0, le=2)]
Schema = Annotated[dict[str, Any] | None, Field(description="A JSON schema the answer must follow (structured "
                                                            "outputs, as OpenAI's response_format json_schema).")]
Image = Annotated[str | None, Field(description="An image the message is about, as a data URL "
                                                "(data:image/png;base64,...), for a checkpoint with a vision tower.")]


class Answer(BaseModel):
    """One generated answer and what it cost."""

    text: str = Field(description="The answer (without the model's thinking).")
    finish_reason: str | None = Field(description="stop, length, or abort.")
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = Field(description="Prompt tokens taken from the prefix cache.")
    prompt_read_seconds: float = Field(description="Seconds the engine spent reading the prompt.")
    decode_tokens_per_second: float = Field(description="Generated tokens over the decode's seconds.")
    time_to_first_token_seconds: float | None = Field(description="From arrival to the first generated token.")


class EndpointStatus(BaseModel):
    ready: bool
    reason: str | None = Field(description="Why the server is not ready (boot stage, draining, engine error).")
    stage: str = Field(description="The boot stage: build, import, smoke, weights, compile (with --compile), "
                                   "warmup, serving.")
    draining: bool
    queued: int = Field(description="Requests admitted but not yet in an engine's slot.")
    running: int = Field(description="Sequence slots occupied.")
    free_slots: int
    queue_limit: int


class ServingMetrics(BaseModel):
    """Totals since the server started, from its Prometheus registry (the same numbers /metrics shows)."""

    requests: dict[str, float] = Field(description="Finished requests by finished_reason (stop, length, "
                                                   "abort, error).")
    prompt_tokens: float
    generation_tokens: float
    running: float
    waiting: float
    kv_cache_usage: float = Field(description="Occupied sequence slots over all of them (0..1).")
    prefix_cache_hit_rate: float | None = Field(description="Cached prompt tokens over queried ones; None "
                                                            "before any query.")
    mean_time_to_first_token_seconds: float | None
    mean_e2e_latency_seconds: float | None
    stalled_replies: float


def transport_security(allowed_hosts: list[str]) -> TransportSecuritySettings:
    """The SDK's DNS-rebinding protection for these host names: each with or without a port, and the same
    hosts as http/https origins (a browser page on another origin is refused)."""
    hosts = [h for name in allowed_hosts for h in (name, f"{name}:*")]
    origins = [f"{scheme}://{h}" for scheme in ("http", "https") for h in hosts]
    return TransportSecuritySettings(enable_dns_rebinding_protection=True, allowed_hosts=hosts,
                                     allowed_origins=origins)


def chat_request(model: str, prompt: str, system: str | None, max_tokens: int, temperature: float | None,
                 json_schema: dict[str, Any] | None, image: str | None = None) -> ChatCompletionRequest:
    """The chat request a tool call means (pure): with an image, the user turn is the image, then the text.

    Raises:
        ToolError: the route's 400 for a field the request model refuses, naming it.
    """
    content: str | list[dict[str, Any]] = prompt
    if image is not None:
        content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": prompt}]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens}
    if temperature is not None:
        body["temperature"] = temperature
    if json_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": json_schema}}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise tool_error(invalid_request(e.errors(), body)) from e


def tool_error(exc: BaseException) -> ToolError:
    """What a tool caller sees for a refusal: the HTTP status and message the route would have answered."""
    err = as_api_error(exc)
    return ToolError(f"{err.status}: {err.message}" + (f" (param: {err.param})" if err.param else ""))


def answer(gen: Generation, text: str) -> Answer:
    t = gen.timings()
    decode_rate = gen.completion_tokens / t.decode_seconds if t.decode_seconds > 0 else 0.0
    ttft = gen.first_token - gen.job.arrival if gen.first_token else None
    return Answer(text=text, finish_reason=gen.finish_reason, prompt_tokens=len(gen.params.prompt_ids),
                  completion_tokens=gen.completion_tokens, cached_prompt_tokens=gen.cached_tokens,
                  prompt_read_seconds=t.prompt_read_seconds, decode_tokens_per_second=decode_rate,
                  time_to_first_token_seconds=ttft)


def client_of(ctx: Context) -> str:
    """The caller's address, for its share of the queue (as the HTTP routes count it)."""
    request = ctx.request_context.request
    client = getattr(request, "client", None)
    return client.host if client else "mcp"


def build(state: ServerState) -> MCPServer:
    """The MCP server over `state`'s request path; `mount` serves it."""
    server = MCPServer(name="gemma-server", title="Gemma 4 model server",
                       instructions="Ask the served Gemma 4 model, stream from it, and read its engine's build, "
                                    "readiness and counters.")

    async def run(ctx: Context, body: ChatCompletionRequest, progress: bool) -> Answer:
        try:
            gens = await state.start(body, client_of(ctx), lambda: Cause.CLIENT_GONE)
        except Exception as e:  # noqa: BLE001 - every refusal becomes the caller's tool error
            raise tool_error(e) from e
        gen, text = gens[0], []
        try:
            async for piece in gen.pieces():  # ends the choice (freeing its slot) if this task is cancelled
                if piece.text:
                    text.append(piece.text)
                    if progress:
                        await ctx.report_progress(gen.completion_tokens, body.max_tokens, piece.text)
        except Exception as e:  # noqa: BLE001
            raise tool_error(e) from e
        return answer(gen, "".join(text))

    @server.tool(description="Ask the model one question and wait for the whole answer; the question may be "
                             "about an image (a data URL).")
    async def ask(ctx: Context, prompt: Prompt, system: System = None, max_tokens: MaxTokens = DEFAULT_MAX_TOKENS,
                  temperature: Temperature = None, json_schema: Schema = None, image: Image = None) -> Answer:
        body = chat_request(state.config.model_name, prompt, system, max_tokens, temperature, json_schema, image)
        return await run(ctx, body, progress=False)

    @server.tool(description="Ask the model and receive its answer as it is written: a progress notification "
                             "per piece of text (progress: tokens so far; total: max_tokens), then the whole "
                             "answer with its time to first token. Cancelling the call stops the decode.")
    async def stream(ctx: Context, prompt: Prompt, system: System = None, max_tokens: MaxTokens = DEFAULT_MAX_TOKENS,
                     temperature: Temperature = None, json_schema: Schema = None, image: Image = None) -> Answer:
        body = chat_request(state.config.model_name, prompt, system, max_tokens, temperature, json_schema, image)
        return await run(ctx, body, progress=True)

    @server.tool(description="The engine's build and boot report, as GET /v1/engine: build key and versions, "
                             "torch, device, dtype, boot stages with their seconds, engines, slots, KV bytes.")
    async def engine_info() -> dict[str, Any]:
        return state.engine_report()

    @server.tool(description="Whether the endpoint serves now, and if not why; its queue and free slots.")
    async def endpoint_status() -> EndpointStatus:
        s = state.scheduler
        running = s.running()
        life = s.lifecycle.now()
        reason = state.not_ready_reason(life)
        return EndpointStatus(ready=reason is None, reason=reason, stage=state.boot.state.stage,
                              draining=life.draining, queued=s.queued(), running=running,
                              free_slots=max(s.capacity() - running, 0), queue_limit=s.queue_limit)

    @server.tool(description="A snapshot of the serving counters (requests by outcome, tokens, queue, KV "
                             "usage, prefix-cache hit rate, mean latencies), parsed from the server's registry.")
    async def serving_metrics() -> ServingMetrics:
        return metrics_snapshot(state.metrics.registry)

    return server


def metrics_snapshot(registry) -> ServingMetrics:
    """The counters that matter, from a prometheus_client registry (pure over its samples)."""
    values: dict[str, float] = {}
    requests: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == "gemma_request_success_total":
                requests[sample.labels["finished_reason"]] = sample.value
            elif not sample.labels.keys() - {"model_name"}:
                values[sample.name] = sample.value

    def mean(name: str) -> float | None:
        count = values.get(f"{name}_count", 0.0)
        return values[f"{name}_sum"] / count if count else None

    queries = values.get("gemma_prefix_cache_queries_total", 0.0)
    return ServingMetrics(
        requests=requests, prompt_tokens=values.get("gemma_prompt_tokens_total", 0.0),
        generation_tokens=values.get("gemma_generation_tokens_total", 0.0),
        running=values.get("gemma_num_requests_running", 0.0), waiting=values.get("gemma_num_requests_waiting", 0.0),
        kv_cache_usage=values.get("gemma_kv_cache_usage_perc", 0.0),
        prefix_cache_hit_rate=values.get("gemma_prefix_cache_hits_total", 0.0) / queries if queries else None,
        mean_time_to_first_token_seconds=mean("gemma_time_to_first_token_seconds"),
        mean_e2e_latency_seconds=mean("gemma_e2e_request_latency_seconds"),
        stalled_replies=values.get("gemma_stalled_replies_total", 0.0),
    )


def mount(app, server: MCPServer, allowed_hosts: list[str]):
    """Add /mcp to `app` (a FastAPI app) and return the session manager's lifespan context (the caller's
    lifespan enters it: the SDK's task group runs there)."""
    from starlette.routing import Route

    server.streamable_http_app(streamable_http_path=PATH, stateless_http=True,
                               transport_security=transport_security(allowed_hosts))
    manager = server.session_manager
    app.router.routes.append(Route(PATH, endpoint=StreamableHTTPASGIApp(manager), methods=["GET", "POST", "DELETE"]))
    return manager.run

