"""Admission and the bounded queue. These tests hold a decode "running" for as long as they need, a timing
the real engine cannot give on demand, so the engine here is tests/server/fakes.py's FakeGatedEngine;
the server, tokenizer, sockets and openai SDK are real."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import openai
import pytest

from tests.server.conftest import sample, start_in_process, wait_for
from tests.server.fakes import fake_gated_boot

MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def gated(chat_checkpoint):
    s = start_in_process(chat_checkpoint, "--queue-limit", "1", boot_class=fake_gated_boot(str(chat_checkpoint)))
    engine = s.state.boot.loaded.workers[0].engine
    yield s, engine
    engine.gate.set()
    s.stop()


def post_in_thread(url: str, body: dict) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        r = httpx.post(url, json=body, timeout=60)
        out["status"], out["body"] = r.status_code, r.json()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def raw_request(base: str, path: str, body: dict) -> socket.socket:
    """Send a request over a plain socket, so the test can drop the connection whenever it wants."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_overflowing_queue_returns_429_with_retry_after(gated):
    server, engine = gated
    engine.gate.clear()
    url = server.base + "/v1/chat/completions"
    running, running_out = post_in_thread(url, {"messages": MESSAGES, "max_tokens": 3})
    wait_for(engine.decoding.is_set, 30, "the first request to start decoding")
    queued, queued_out = post_in_thread(url, {"messages": MESSAGES, "max_tokens": 3})
    wait_for(lambda: sample(server, "gemma_num_requests_waiting") == 1, 30, "one request waiting")

    r = httpx.post(url, json={"messages": MESSAGES, "max_tokens": 3})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == 429
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=server.state.config.model_name, messages=MESSAGES)

    engine.gate.set()
    running.join(30)
    queued.join(30)
    assert running_out["status"] == queued_out["status"] == 200
    assert running_out["body"]["usage"]["completion_tokens"] == 3
    assert engine.decodes == 2


def test_a_queued_request_that_disconnects_leaves_the_queue_without_decoding(gated):
    server, engine = gated
    aborts = sample(server, "gemma_request_success_total", finished_reason="abort")
    engine.gate.clear()
    running, running_out = post_in_thread(server.base + "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    wait_for(engine.decoding.is_set, 30, "the first request to start decoding")
    sock = raw_request(server.base, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3})
    wait_for(lambda: sample(server, "gemma_num_requests_waiting") == 1, 30, "one request waiting")
    sock.close()
    wait_for(lambda: sample(server, "gemma_num_requests_waiting") == 0, 30, "the queue to empty")
    wait_for(lambda: sample(server, "gemma_request_success_total", finished_reason="abort") == aborts + 1, 30, "the abort to be counted")
    engine.gate.set()
    running.join(30)
    assert running_out["status"] == 200
    assert engine.decodes == 1  # the one that left never reached the engine


def test_a_streamed_request_that_disconnects_while_queued_is_aborted(gated):
    server, engine = gated
    aborts = sample(server, "gemma_request_success_total", finished_reason="abort")
    engine.gate.clear()
    running, _ = post_in_thread(server.base + "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    wait_for(engine.decoding.is_set, 30, "the first request to start decoding")
    sock = raw_request(server.base, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "stream": True})
    wait_for(lambda: sample(server, "gemma_num_requests_waiting") == 1, 30, "one request waiting")
    sock.close()
    wait_for(lambda: sample(server, "gemma_request_success_total", finished_reason="abort") == aborts + 1, 30, "the abort to be counted")
    assert sample(server, "gemma_num_requests_waiting") == 0
    engine.gate.set()
    running.join(30)
    assert engine.decodes == 1


def test_choices_past_the_queue_limit_are_refused_together_and_hold_no_admission(gated):
    server, engine = gated
    url = server.base + "/v1/chat/completions"
    # n = 2 jobs against a queue limit of 1: refused as a whole, before tokenizing...
    r = httpx.post(url, json={"messages": MESSAGES, "max_tokens": 2, "n": 2})
    assert r.status_code == 429
    # ...and nothing of it stays admitted: the gauge is back at 0 and the next request is served.
    assert sample(server, "gemma_num_requests_waiting") == 0
    r = httpx.post(url, json={"messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_one_client_holds_at_most_half_the_slots_and_queue_and_another_is_served(chat_checkpoint):
    # One slot and a queue of 40: a client may hold max(16, 41 // 2) = 20 choices.
    s = start_in_process(chat_checkpoint, "--queue-limit", "40", boot_class=fake_gated_boot(str(chat_checkpoint)))
    engine = s.state.boot.loaded.workers[0].engine
    try:
        engine.gate.clear()
        url = s.base + "/v1/chat/completions"
        first, first_out = post_in_thread(url, {"messages": MESSAGES, "max_tokens": 1, "n": 16})
        wait_for(lambda: s.state.client_shares.held.get("127.0.0.1") == 16, 30, "16 choices held")
        over = httpx.post(url, json={"messages": MESSAGES, "max_tokens": 1, "n": 16}, timeout=30)
        assert over.status_code == 429 and over.headers["retry-after"] == "1"
        assert "one client may hold 20" in over.json()["error"]["message"]
        # Within its share the same client is still admitted, and another address is served past it.
        small, small_out = post_in_thread(url, {"messages": MESSAGES, "max_tokens": 1, "n": 4})
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=60) as other:
            other_thread = threading.Thread(target=lambda: other_out.update(
                status=other.post(url, json={"messages": MESSAGES, "max_tokens": 1, "n": 16}).status_code))
            other_out: dict = {}
            other_thread.start()
            wait_for(lambda: s.state.client_shares.held.get("127.0.0.2") == 16, 30, "the other client's 16")
            engine.gate.set()
            for t in (first, small, other_thread):
                t.join(60)
        assert (first_out["status"], small_out["status"], other_out["status"]) == (200, 200, 200)
        # Every share was given back.
        wait_for(lambda: not s.state.client_shares.held, 30, "the shares given back")
    finally:
        engine.gate.set()
        s.stop()
