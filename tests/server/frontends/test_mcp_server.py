"""The server's MCP endpoint (/mcp), driven by the official `mcp` client over streamable HTTP on loopback.

The server is the real app on the real engine (the chat checkpoint, greedy by default: tests/server/conftest.py
`server`). Tools go through the HTTP routes' request path, so a greedy `ask` must write exactly what
/v1/chat/completions writes for the same messages, and a refusal must carry the status and field the route
would answer with.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import anyio
import httpx
import httpx2
import mcp
import pytest
from mcp.client.streamable_http import streamable_http_client

from tests.server.conftest import InProcessServer, start_in_process
from tests.server.fakes import FakeSlowGrammars

TOOLS = {"ask", "stream", "engine_info", "endpoint_status", "serving_metrics"}
KEY = "mcp-test-key"
SERVICE_HOST = "gemma.team-a.svc.cluster.local"


def call(base: str, name: str, args: dict | None = None, headers: dict | None = None, progress=None):
    """One tool call over a fresh connection: the CallToolResult."""

    async def go():
        transport = streamable_http_client(base + "/mcp", http_client=httpx2.AsyncClient(headers=headers or {},
                                                                                         timeout=120))
        async with mcp.Client(transport) as client:
            return await client.call_tool(name, args or {}, progress_callback=progress)

    return asyncio.run(go())


def counter(base: str, reason: str) -> float:
    text = httpx.get(base + "/metrics").text
    m = re.search(rf'^gemma_request_success_total{{finished_reason="{reason}",model_name="[^"]*"}} (\S+)$', text, re.M)
    return float(m.group(1))


def chat_reply(base: str, prompt: str, max_tokens: int) -> dict:
    r = httpx.post(base + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()


def test_tools_are_listed_with_input_and_output_schemas(server):
    async def go():
        async with mcp.Client(server.base + "/mcp") as client:
            return (await client.list_tools()).tools

    tools = {t.name: t for t in asyncio.run(go())}
    assert set(tools) == TOOLS
    ask = tools["ask"]
    assert ask.input_schema["required"] == ["prompt"]
    assert set(ask.input_schema["properties"]) == {"prompt", "system", "max_tokens", "temperature", "json_schema",
                                                  "image"}
    assert {"text", "finish_reason", "completion_tokens", "decode_tokens_per_second"} <= set(
        ask.output_schema["properties"])
    assert tools["stream"].input_schema["properties"] == ask.input_schema["properties"]


def test_ask_writes_what_the_chat_route_writes(server):
    before = counter(server.base, "length")
    r = call(server.base, "ask", {"prompt": "Tell me about the sea.", "max_tokens": 12})
    assert not r.is_error, r.content
    got = r.structured_content
    want = chat_reply(server.base, "Tell me about the sea.", 12)
    assert got["text"] == want["choices"][0]["message"]["content"]
    assert got["finish_reason"] == want["choices"][0]["finish_reason"] == "length"
    assert (got["prompt_tokens"], got["completion_tokens"]) == (want["usage"]["prompt_tokens"], 12)
    assert got["decode_tokens_per_second"] > 0 and got["prompt_read_seconds"] > 0
    assert counter(server.base, "length") == before + 2  # the tool's request is counted as the route's is


def test_stream_sends_the_text_as_progress_then_the_whole_answer(server):
    seen: list[tuple[float, float | None, str | None]] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        seen.append((done, total, message))

    r = call(server.base, "stream", {"prompt": "Count with me.", "max_tokens": 16}, progress=progress)
    assert not r.is_error, r.content
    got = r.structured_content
    assert len(seen) > 1 and "".join(m for _, _, m in seen) == got["text"]
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen) and seen[-1][0] <= 16
    assert {t for _, t, _ in seen} == {16}
    assert 0 < got["time_to_first_token_seconds"] < 60
    assert got["text"] == chat_reply(server.base, "Count with me.", 16)["choices"][0]["message"]["content"]


def test_a_cancelled_stream_frees_its_slot(server):
    aborted = counter(server.base, "abort")

    async def go():
        async with mcp.Client(server.base + "/mcp") as client:
            first = anyio.Event()

            async def progress(done, total, message) -> None:
                first.set()

            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    await client.call_tool("stream", {"prompt": "Go on.", "max_tokens": 900},
                                           progress_callback=progress)
                    raise AssertionError("the stream ended before it was cancelled")

                tg.start_soon(stream)
                with anyio.fail_after(60):
                    await first.wait()
                tg.cancel_scope.cancel()
            with anyio.fail_after(60):
                while True:
                    status = (await client.call_tool("endpoint_status")).structured_content
                    if status["running"] == 0 and counter(server.base, "abort") == aborted + 1:
                        return status
                    await anyio.sleep(0.05)

    status = asyncio.run(go())
    assert status["free_slots"] == 4 and status["ready"]


def test_refusals_carry_the_routes_status_and_field(server):
    bad_schema = call(server.base, "ask", {"prompt": "hi", "json_schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}})
    assert bad_schema.is_error
    assert "400" in bad_schema.content[0].text and "response_format.json_schema.schema" in bad_schema.content[0].text
    too_hot = call(server.base, "ask", {"prompt": "hi", "temperature": 5})
    assert too_hot.is_error and "temperature" in too_hot.content[0].text
    empty = call(server.base, "ask", {"prompt": ""})
    assert empty.is_error and "prompt" in empty.content[0].text
    long_prompt = call(server.base, "ask", {"prompt": "word " * 5000})
    assert long_prompt.is_error and "400" in long_prompt.content[0].text
    assert call(server.base, "endpoint_status").structured_content["running"] == 0


def test_a_full_queue_is_the_routes_429(server, monkeypatch):
    # Requests count against the queue from admission, through their grammar's compile, until an engine
    # takes them: 8 held in a slowed compile fill the fixture's queue of 8 for as long as it lasts.
    loaded = server.state.loaded
    slow = FakeSlowGrammars(loaded.grammars, 5.0)
    monkeypatch.setattr(loaded, "grammars", slow)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": {"type": "json_object"}}

    async def go():
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=server.base, timeout=120, limits=limits) as http, \
                mcp.Client(server.base + "/mcp") as client:
            held = [asyncio.ensure_future(http.post("/v1/chat/completions", json=body)) for _ in range(8)]
            with anyio.fail_after(4):
                while (await client.call_tool("endpoint_status")).structured_content["queued"] < 8:
                    await anyio.sleep(0.02)
            refused = await client.call_tool("ask", {"prompt": "hi", "max_tokens": 2})
            return refused, [r.status_code for r in await asyncio.gather(*held)]

    refused, statuses = asyncio.run(go())
    assert refused.is_error and refused.content[0].text.startswith("Error executing tool ask: 429"), refused.content
    assert statuses == [200] * 8


def test_a_draining_server_is_the_routes_503(chat_checkpoint):
    s = start_in_process(chat_checkpoint)
    try:
        s.state.scheduler.start_drain()
        refused = call(s.base, "ask", {"prompt": "hi", "max_tokens": 2})
        assert refused.is_error and refused.content[0].text.startswith("Error executing tool ask: 503"), refused.content
    finally:
        s.stop()


def test_structured_outputs_through_ask(agent_server):
    import json

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = call(agent_server.base, "ask", {"prompt": "Is it fine?", "json_schema": schema, "max_tokens": 40})
    assert not r.is_error, r.content
    assert r.structured_content["finish_reason"] == "stop"
    assert set(json.loads(r.structured_content["text"])) == {"ok"}


def test_engine_info_status_and_metrics_are_the_servers_own(server):
    info = call(server.base, "engine_info").structured_content
    want = httpx.get(server.base + "/v1/engine").json()
    assert info["build"] == want["build"] and info["engines"] == want["engines"]
    assert info["stage"] == want["stage"] == "serving"
    status = call(server.base, "endpoint_status").structured_content
    assert status == {"ready": True, "reason": None, "stage": "serving", "draining": False, "queued": 0,
                      "running": 0, "free_slots": 4, "queue_limit": 8}
    before = call(server.base, "serving_metrics").structured_content
    chat_reply(server.base, "hello", 3)
    after = call(server.base, "serving_metrics").structured_content
    assert after["requests"]["length"] == before["requests"]["length"] + 1
    assert after["generation_tokens"] == before["generation_tokens"] + 3
    assert after["mean_time_to_first_token_seconds"] > 0


@pytest.fixture(scope="module")
def keyed_server(chat_checkpoint) -> Iterator[InProcessServer]:
    s = start_in_process(chat_checkpoint, "--api-key", KEY, "--default-temperature", "0",
                         "--mcp-allowed-hosts", f"localhost,127.0.0.1,{SERVICE_HOST}")
    yield s
    s.stop()


def test_with_an_api_key_mcp_needs_it(keyed_server):
    r = httpx.post(keyed_server.base + "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                   headers={"Accept": "application/json, text/event-stream"})
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    with pytest.raises(ExceptionGroup) as refused:  # the SDK's client fails the call on the 401
        call(keyed_server.base, "endpoint_status")
    assert refused.value.subgroup(mcp.MCPError) is not None
    ok = call(keyed_server.base, "endpoint_status", headers={"Authorization": f"Bearer {KEY}"})
    assert not ok.is_error and ok.structured_content["ready"]


def test_a_service_host_is_accepted_and_a_foreign_host_refused(keyed_server):
    port = keyed_server.base.rsplit(":", 1)[1]
    auth = {"Authorization": f"Bearer {KEY}"}
    ok = call(keyed_server.base, "endpoint_status", headers={**auth, "Host": f"{SERVICE_HOST}:{port}"})
    assert not ok.is_error and ok.structured_content["ready"]
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    accept = {"Accept": "application/json, text/event-stream"}
    foreign = httpx.post(keyed_server.base + "/mcp", json=listing,
                         headers={**auth, **accept, "Host": "attacker.example:80"})
    assert foreign.status_code == 421
    page = httpx.post(keyed_server.base + "/mcp", json=listing,
                      headers={**auth, **accept, "Origin": "http://attacker.example"})
    assert page.status_code == 403


def test_mcp_can_be_turned_off(chat_checkpoint):
    s = start_in_process(chat_checkpoint, "--no-enable-mcp")
    try:
        assert httpx.post(s.base + "/mcp", json={}).status_code == 404
    finally:
        s.stop()
