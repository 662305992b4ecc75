"""What no client can do to the server's other clients (connections.py, app.ApiKeyGate, app.InFlightLimit):
hold enough connections to starve the kubelet's probes or a keyed client, cost the event loop anything
with bodies it sends without the key, or hold a reply (and its sequence slot) by not reading it.

The real server runs in its own process, with an API key and a probe listener of its own. Attackers
connect from loopback addresses of their own (127.0.0.2 and up: Linux routes all of 127.0.0.0/8 to lo),
as clients of a pod come from theirs; the probes and the keyed client come from 127.0.0.1.
"""

from __future__ import annotations

import json
import multiprocessing
import select
import selectors
import socket
import statistics
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import CONTEXT, Spawned, free_port, get_status, spawn_server, wait_for

KEY = "test-key-connections"
HEADER_TIMEOUT = 2.0  # the module server's --header-read-timeout
PER_CLIENT = 64  # the default --max-connections-per-client


@pytest.fixture(scope="module")
def guarded(chat_checkpoint, tmp_path_factory) -> Iterator[tuple[Spawned, str]]:
    """The server, and the base URL of its probe listener."""
    probe_port = free_port()
    s = spawn_server(tmp_path_factory.mktemp("connections"), "--model", str(chat_checkpoint),
                     "--use-installed-engine", "--context", str(CONTEXT), "--dtype", "float32",
                     "--probe-port", str(probe_port), "--header-read-timeout", str(HEADER_TIMEOUT),
                     "--request-read-timeout", "4", "--stream-stall-timeout", "1",
                     env={"GEMMA_API_KEY": KEY})
    probes = f"http://127.0.0.1:{probe_port}"
    try:
        wait_for(lambda: get_status(probes + "/health") == 200, 120, "/health 200 on the probe port")
        yield s, probes
    finally:
        s.proc.kill()
        s.proc.wait(10)


def address(base: str) -> tuple[str, int]:
    host, port = base.removeprefix("http://").split(":")
    return host, int(port)


def keyed() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def metric(base: str, name: str, **labels: str) -> float:
    """One sample of the server's /metrics (0 when absent)."""
    text = httpx.get(base + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def idle_probe_seconds(url: str, n: int = 20) -> float:
    """The slowest of n fresh-connection GETs of `url` on an idle server: this machine's own noise."""
    slowest = 0.0
    for _ in range(n):
        t0 = time.monotonic()
        httpx.get(url, timeout=10)
        slowest = max(slowest, time.monotonic() - t0)
    return slowest


class HalfOpenFlood:
    """`count` connections, spread over `sources` loopback addresses, each holding an unfinished request
    header; every one the server closes is opened again at once (the slowloris pattern: the connections
    stay held, the server's deadline only recycles them). Runs in a process of its own (so its work does not
    hold this process's GIL while the test times probes) until the `with` block ends."""

    HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"

    def __init__(self, target: tuple[str, int], count: int, sources: list[str]) -> None:
        self.target, self.count, self.sources = target, count, sources
        ctx = multiprocessing.get_context("fork")
        self._held, self._reopened, self._stop = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Event()
        self._process = ctx.Process(target=self._run, daemon=True)

    @property
    def held(self) -> int:
        return self._held.value

    @property
    def reopened(self) -> int:
        return self._reopened.value

    def __enter__(self) -> HalfOpenFlood:
        self._process.start()
        wait_for(lambda: self.held >= self.count, 60, f"{self.count} half-open connections")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()

    def _open(self, sel: selectors.BaseSelector, i: int) -> None:
        s = socket.socket()
        s.bind((self.sources[i % len(self.sources)], 0))
        s.settimeout(5)
        try:
            s.connect(self.target)
            s.sendall(self.HEAD)
        except OSError:
            s.close()
            return
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
        self._held.value += 1

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for i in range(self.count):
            self._open(sel, i)
        try:
            while not self._stop.is_set():
                lost = []
                for key, _ in sel.select(timeout=0.05):
                    try:
                        if key.fileobj.recv(4096):
                            continue
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        pass
                    lost.append(key)
                for key in lost:
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
                    self._held.value -= 1
                for key in lost:
                    self._open(sel, key.data)
                    self._reopened.value += 1
                if len(sel.get_map()) < self.count:  # a connect that failed: try again
                    for i in range(self.count - len(sel.get_map())):
                        self._open(sel, i)
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()
            sel.close()


def test_probes_and_a_keyed_request_outlive_600_half_open_connections(guarded):
    server, probes = guarded
    noise = idle_probe_seconds(probes + "/live")
    sources = [f"127.0.0.{i}" for i in range(2, 14)]  # 12 addresses x 50: each under the per-client cap
    with HalfOpenFlood(address(server.base), 600, sources) as flood:
        # The deadline recycles them: wait until the flood has been reopened once, so probing happens
        # while connections are being closed and reopened, not in a lull before the first deadline.
        wait_for(lambda: flood.reopened >= 300, 3 * HEADER_TIMEOUT + 10, "the flood's connections reopened")
        seconds, held = [], []
        reopened_before = flood.reopened
        end = time.monotonic() + 2 * HEADER_TIMEOUT + 1
        while time.monotonic() < end:
            t0 = time.monotonic()
            r = httpx.get(probes + "/live", timeout=10)
            seconds.append(time.monotonic() - t0)
            assert r.status_code == 200, r.text
            held.append(flood.held)
            time.sleep(0.05)
        served = httpx.post(server.base + "/v1/completions", headers=keyed(), timeout=60,
                            json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        attack_went_on = flood.reopened > reopened_before
        held_at_the_end = flood.held
    # Held all along: all 600 most of the time, dipping only while the deadline's closes are reopened.
    assert attack_went_on and statistics.median(held) >= 590 and min(held) >= 400, (min(held), statistics.median(held))
    # Nearly every probe within 100 ms of an idle one; on these 2 cores a probe that meets a burst of 600
    # closes and reopens (all the flood's deadlines fall together) has waited up to ~0.5 s for the CPU, still
    # far inside the kubelet's 3 to 5 s probe timeouts.
    within = sum(t < 0.1 + noise for t in seconds) / len(seconds)
    assert within >= 0.9 and max(seconds) < 1.5, (
        f"{within:.0%} of /live within 100 ms of idle ({noise:.3f}s), slowest {max(seconds):.3f}s, under 600 "
        "half-open connections")
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 2, served.text


def test_one_client_address_holds_at_most_its_share_of_connections(guarded):
    server, _ = guarded
    target = address(server.base)
    socks = []
    try:
        for _ in range(PER_CLIENT + 20):
            s = socket.socket()
            s.bind(("127.0.0.20", 0))
            s.connect(target)
            socks.append(s)
        time.sleep(0.5)  # well within the header deadline: only the cap closes connections here
        readable, _, _ = select.select(socks, [], [], 0)
        closed = len(readable)  # a connection the server closed reads EOF (or a reset)
        # The connections past the cap were closed as they opened; the first 64 are still open.
        assert closed == 20, closed
        # Meanwhile another address is served.
        r = httpx.get(server.base + "/v1/models", headers=keyed(), timeout=10)
        assert r.status_code == 200
    finally:
        for s in socks:
            s.close()


def send_unkeyed_body(target: tuple[str, int], source: str, body: bytes) -> int | None:
    """POST `body` without the key from `source`; the status the server answered with, if it got through."""
    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(10)
    try:
        s.connect(target)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        try:
            s.sendall(body)
        except OSError:
            pass  # the server answered and closed without reading it
        head = s.recv(64)
        return int(head.split()[1]) if head.startswith(b"HTTP/1.1") else None
    except OSError:
        return None
    finally:
        s.close()


def test_bodies_without_the_key_are_refused_from_their_headers_and_the_loop_stays_free(guarded):
    server, _ = guarded
    # 4 MB of empty messages: parsed and validated, it cost about a second of the event loop before its 401.
    body = json.dumps({"messages": [{"role": "user", "content": ""}] * 125_000}).encode()
    assert 3_900_000 < len(body) < 4 * 1024 * 1024
    target, stop, statuses = address(server.base), threading.Event(), []

    def sender(i: int) -> None:
        while not stop.is_set():
            statuses.append(send_unkeyed_body(target, f"127.0.0.{30 + i}", body))

    senders = [threading.Thread(target=sender, args=(i,), daemon=True) for i in range(8)]
    for t in senders:
        t.start()
    lives = []
    try:
        wait_for(lambda: len(statuses) >= 8, 60, "the senders' first answers")
        end = time.monotonic() + 5
        with httpx.Client(timeout=10) as c:
            while time.monotonic() < end:
                t0 = time.monotonic()
                assert c.get(server.base + "/live").status_code == 200
                lives.append(time.monotonic() - t0)
                time.sleep(0.02)
        sent_meanwhile = len(statuses)
    finally:
        stop.set()
        for t in senders:
            t.join(30)
    assert 401 in statuses and all(s in (401, None) for s in statuses), set(statuses)
    assert sent_meanwhile >= 16, sent_meanwhile
    p50 = statistics.median(lives)
    assert p50 < 0.25, f"/live p50 {p50:.3f}s while 8 clients sent 4 MB bodies without the key"


def test_a_client_that_stops_reading_its_stream_is_aborted_and_its_slots_freed(guarded, tokenizer):
    server, _ = guarded
    before_stalled = metric(server.base, "gemma_stalled_replies_total")
    before_aborts = metric(server.base, "gemma_request_success_total", finished_reason="abort")
    before_generated = metric(server.base, "gemma_request_generation_tokens_sum")
    stalled_ends = server.logs().count("aborted: the client stopped reading its reply")
    eos = {str(i): -100 for i in {tokenizer.eos_token_id, *tokenizer.all_special_ids}}
    n, max_tokens = 4, 900
    request = json.dumps({"messages": [{"role": "user", "content": "Tell me everything."}], "stream": True,
                          "n": n, "max_tokens": max_tokens, "logprobs": True, "top_logprobs": 20,
                          "temperature": 1.0, "logit_bias": eos}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that reads nothing, and buffers little
    s.connect(address(server.base))
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(request)
                  + request)
        wait_for(lambda: metric(server.base, "gemma_stalled_replies_total") == before_stalled + 1, 60,
                 "the stalled reply counted")
        wait_for(lambda: metric(server.base, "gemma_num_requests_running") == 0, 30, "the slots freed")
    finally:
        s.close()
    # Its choices ended as aborts, long before their 900 tokens.
    wait_for(lambda: metric(server.base, "gemma_request_success_total", finished_reason="abort")
             == before_aborts + n, 30, "the aborts counted")
    # Each choice's end names the stall (connections.py marks the request), not a plain disconnect.
    assert server.logs().count("aborted: the client stopped reading its reply") == stalled_ends + n
    generated = metric(server.base, "gemma_request_generation_tokens_sum") - before_generated
    assert generated < 0.8 * n * max_tokens, generated  # cut well before the end (kernel buffers hold ~half)
    served = httpx.post(server.base + "/v1/completions", headers=keyed(), timeout=60,
                        json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert served.status_code == 200
