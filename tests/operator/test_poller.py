"""The pod poller (operator/gemma_operator/poller.py) against real loopback HTTP servers, well-behaved and not.

A tenant's pod answers the operator's polls, so the hostile answers of FakeEngineEndpoint (a trickle, a
redirect, 10 MiB) must cost the operator a bounded time and memory, and hold up no other server.
"""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time
import tracemalloc

import pytest

from gemma_operator import poller as p
from gemma_operator.redact import MAX_BYTES

from .fakes import FakeEngineEndpoint
from .harness import wait_for


def running_pod(name, *, ready=False, url=None, ip="127.0.0.1"):
    annotations = {p.TEST_URL_ANNOTATION: url} if url else {}
    return {"metadata": {"name": name, "uid": f"uid-{name}", "annotations": annotations},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def make_poller():
    made = []

    def make(**kw):
        kw.setdefault("allow_test_urls", True)
        made.append(p.PodPoller(**kw))
        return made[-1]
    yield make
    for poller in made:
        poller.close()


def fetch_once(url, deadline=p.FETCH_DEADLINE_SECONDS):
    async def go():
        async with p.new_session(deadline) as session:
            return await p.fetch_json(session, url)
    return asyncio.run(go())


def reported(poller, server, pods, port=8000, what="engine"):
    """Observe until the reports hold every pod (the poller fetches in the background)."""
    def check():
        reports = poller.observe(server, pods, port)
        return reports if set(getattr(reports, what)) == {q["metadata"]["name"] for q in pods} else None
    return wait_for(check, timeout=10, what=f"{what} reports of {[q['metadata']['name'] for q in pods]}")


# ------------------------------------------------------------------------------------------- well-behaved pods


def test_booting_pod_reports_its_stage_and_ready_pod_its_model_once(make_poller):
    with FakeEngineEndpoint() as fake:
        fake.boot_to("weights", {"build": 41.5, "import": 0.4, "smoke": 2.0})
        poller = make_poller(min_interval=0.0)
        reports = reported(poller, "ns/g", [running_pod("p", url=fake.url)])
        assert reports.engine["p"]["stage"] == "weights"
        assert [s["stage"] for s in reports.engine["p"]["stages"]] == ["build", "import", "smoke", "weights"]
        assert reports.served_models == {} and reports.errors == {}
        fake.serve("gemma-4")
        ready = running_pod("p", ready=True, url=fake.url)
        reports = reported(poller, "ns/g", [ready], what="served_models")
        assert reports.served_models["p"] == "gemma-4"
        assert reports.engine["p"]["stage"] == "serving"
        assert set(fake.requests) == {"/v1/engine"}
        wait_for(lambda: not poller.in_flight(), what="no fetch in flight")
        seen = len(fake.requests)
        poller.observe("ns/g", [ready], 8000)
        poller.observe("ns/g", [ready], 8000)
        # observe marks a fetch it starts in flight before it returns: none was started.
        assert not poller.in_flight()
        assert len(fake.requests) == seen  # the served model is fetched once per pod


def test_pod_ip_is_used_when_overrides_are_not_enabled(make_poller):
    with FakeEngineEndpoint() as fake:
        port = int(fake.url.rsplit(":", 1)[1])
        pod = running_pod("p", url="http://127.0.0.1:1")
        assert p.base_url(pod, port, False) == f"http://127.0.0.1:{port}"
        poller = make_poller(allow_test_urls=False)
        assert reported(poller, "ns/g", [pod], port).engine["p"]["stage"] == "build"


def test_unreachable_pod_is_tolerated_and_backed_off(make_poller):
    calls = []

    async def fetch(session, url):
        calls.append(url)
        return await p.fetch_json(session, url)

    poller = make_poller(fetch=fetch, min_interval=10.0, allow_test_urls=False)
    port = closed_port()
    pod = running_pod("p")
    errors = wait_for(lambda: poller.observe("ns/g", [pod], port).errors, what="the failed poll recorded")
    assert errors["p"].startswith("unreachable")
    assert poller.observe("ns/g", [pod], port).engine == {}
    assert calls == [f"http://127.0.0.1:{port}/v1/engine"]  # the second observe waits out the back-off


@pytest.mark.parametrize("phase", ["Pending", "Succeeded"])
def test_pods_not_running_are_not_polled(make_poller, phase):
    async def fetch(session, url):
        raise AssertionError(f"polled {url}")

    pod = running_pod("p")
    pod["status"]["phase"] = phase
    poller = make_poller(fetch=fetch)
    assert poller.observe("ns/g", [pod], 8000) == p.Reports({}, {}, {})
    assert not poller.in_flight()


def test_ipv6_pod_address_is_bracketed():
    assert p.base_url(running_pod("p", ip="fd00::5"), 8000, False) == "http://[fd00::5]:8000"


class Stepper:
    """A fetch for PodPoller that lets the test drive the polls of one pod one at a time, against the real
    endpoint at `gated` (other URLs are fetched at once, each call reported on `others`).

    A poll of the gated pod waits until `step()` lets it through. `step()` returns once the poller has started
    the next poll of that pod, which it does only after it recorded this one and made its `on_change` call
    (both on the polling loop, before that loop can start another fetch of the pod), so the test then sees
    the poll's whole outcome. `answered` is the number of the poll last answered; an `on_change` callback
    reads it to say which poll it was called for.
    """

    def __init__(self, gated: str):
        self.gated = gated
        self.others: queue.Queue[str] = queue.Queue()
        self.started = 0   # polls of the gated pod the poller has started
        self.answered = 0  # of those, answered
        self._steps = 0
        self._permits = threading.Semaphore(0)
        self._started = threading.Condition()

    async def fetch(self, session, url):
        if not url.startswith(self.gated + "/"):
            self.others.put(url)
            return await p.fetch_json(session, url)
        with self._started:
            self.started += 1
            self._started.notify_all()
        while not self._permits.acquire(blocking=False):
            await asyncio.sleep(0.005)  # on the polling loop: it keeps serving other pods meanwhile
        result = await p.fetch_json(session, url)
        self.answered += 1
        return result

    def release(self) -> None:
        """Let the waiting (or next) poll of the gated pod through, without waiting for what follows."""
        self._steps += 1
        self._permits.release()

    def step(self, timeout: float = 10.0) -> None:
        """Let one poll through and wait until the poller has started the next one."""
        self.release()
        with self._started:
            assert self._started.wait_for(lambda: self.started > self._steps, timeout), (
                f"the poller started no poll after poll {self._steps} within {timeout:g} s")


def test_pods_are_polled_on_the_pollers_own_schedule_until_forgotten(make_poller):
    with FakeEngineEndpoint() as fake, FakeEngineEndpoint() as other:
        stepper = Stepper(fake.url)
        changed = []
        poller = make_poller(min_interval=0.2, fetch=stepper.fetch,
                             on_change=lambda server: changed.append((server, stepper.answered)))
        pod = running_pod("p", url=fake.url)
        poller.observe("ns/g", [pod], 8000)
        stepper.step()  # poll 1: stage build; poll 2 is started by the poller's own schedule
        fake.boot_to("weights", {"build": 1.0})  # no observe from here on: the poller polls by itself
        stepper.step()  # poll 2: stage weights, and poll 3 started, still without an observe
        assert changed == [("ns/g", 1), ("ns/g", 2)]
        assert poller.observe("ns/g", [pod], 8000).engine["p"]["stage"] == "weights"
        poller.forget("ns/g")
        stepper.release()  # poll 3, started before the forget, ends
        wait_for(lambda: not poller.in_flight(), what="no fetch in flight")
        polls = len(fake.requests)
        fake.boot_to("warmup", {"build": 1.0, "weights": 2.0})
        # No fourth poll, shown by what the poller did instead: it polled another server's pod four times,
        # the first when observed, then on three of its ticks (0.25 s apart). The second of those ticks came
        # more than `min_interval` after poll 3 ended, so a pod still polled would have been started on it,
        # on the polling loop, before the next tick polled the other pod again.
        poller.observe("ns/other", [running_pod("q", url=other.url)], 8000)
        for _ in range(4):
            stepper.others.get(timeout=10)
        assert stepper.started == 3 and len(fake.requests) == polls


def test_a_change_of_stage_is_announced_and_a_growing_stage_time_is_not(make_poller):
    with FakeEngineEndpoint() as fake:
        stepper = Stepper(fake.url)
        changed = []
        poller = make_poller(min_interval=0.0, fetch=stepper.fetch,
                             on_change=lambda server: changed.append((server, stepper.answered)))
        pod = running_pod("p", url=fake.url)
        poller.observe("ns/g", [pod], 8000)
        stepper.step()  # poll 1: the first report
        assert changed == [("ns/g", 1)]
        fake.engine["stages"][0]["seconds"] = 7.5  # the running stage's clock moves on
        stepper.step()  # poll 2
        assert poller.observe("ns/g", [pod], 8000).engine["p"]["stages"][0].get("seconds") == 7.5
        assert changed == [("ns/g", 1)]
        fake.boot_to("smoke", {"build": 8.0, "import": 0.5})
        stepper.step()  # poll 3
        assert changed == [("ns/g", 1), ("ns/g", 3)]


# ------------------------------------------------------------------------------------------- hostile pods


def test_a_trickling_reply_ends_at_the_total_deadline():
    with FakeEngineEndpoint() as fake:
        fake.mode, fake.trickle_seconds = "trickle", 0.05
        start = time.monotonic()
        result = fetch_once(fake.url + "/v1/engine", deadline=1.0)
        took = time.monotonic() - start
    assert result == p.Fetched(None, "no complete reply within 1 s")
    # Every read got a byte well inside any per-read timeout; only a total deadline ends it.
    assert fake.bytes_sent >= 10
    assert 1.0 <= took < 1.5, took


def test_a_redirect_is_refused_and_not_followed():
    with FakeEngineEndpoint() as target, FakeEngineEndpoint() as fake:
        fake.mode, fake.redirect_to = "redirect", target.url
        assert fetch_once(fake.url + "/v1/engine") == p.Fetched(None, "redirect refused (HTTP 302)")
        assert target.requests == []


def test_a_10_mib_reply_is_refused_after_64_kib_with_bounded_memory():
    with FakeEngineEndpoint() as fake:
        fake.mode = "huge"
        tracemalloc.start()
        try:
            result = fetch_once(fake.url + "/v1/engine")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert result == p.Fetched(None, f"reply over {p.MAX_REPLY_BYTES} bytes refused")
    assert peak < 1024 * 1024, peak  # the operator read about 64 KiB of the 10 MiB, not all of it


def test_a_declared_oversized_reply_is_refused_before_its_body():
    with FakeEngineEndpoint() as fake:
        fake.engine = {"stage": "build", "pad": "x" * (p.MAX_REPLY_BYTES + 1)}
        assert fetch_once(fake.url + "/v1/engine").error == f"reply over {p.MAX_REPLY_BYTES} bytes refused"


@pytest.mark.parametrize("body,error", [(b"[1, 2]", "reply is not a JSON object"),
                                        (b'{"stage": NaN}', "reply is not JSON"),
                                        (b"[" * 30000 + b"]" * 30000, "reply is not JSON")])
def test_replies_a_status_cannot_hold_are_refused(body, error):
    assert len(body) <= p.MAX_REPLY_BYTES
    with FakeEngineEndpoint() as fake:
        fake.mode, fake.raw = "raw", body
        assert fetch_once(fake.url + "/v1/engine") == p.Fetched(None, error)


def test_slow_pods_of_one_server_hold_up_neither_observe_nor_another_servers_polls(make_poller):
    with FakeEngineEndpoint() as slow, FakeEngineEndpoint() as good:
        slow.mode = "trickle"
        poller = make_poller(min_interval=0.0, deadline=30.0)
        trickling = [running_pod(f"slow-{i}", url=slow.url) for i in range(2 * p.PER_SERVER_FETCHES)]
        start = time.monotonic()
        assert poller.observe("ns/slow", trickling, 8000).engine == {}
        assert time.monotonic() - start < 0.1  # observe started the fetches and returned
        wait_for(lambda: slow.bytes_sent > 0, what="the slow server trickling")
        start = time.monotonic()
        reports = reported(poller, "ns/good", [running_pod("good", url=good.url)])
        assert reports.engine["good"]["stage"] == "build"
        assert time.monotonic() - start < 2.0
        assert {q["metadata"]["uid"] for q in trickling} <= poller.in_flight()  # still trickling, up to 30 s


# ------------------------------------------------------------------------------------------- what is kept


def test_only_bounded_status_fields_of_a_report_are_kept():
    doc = {
        "stage": "weights" * 100, "model_dir": "/secret/path", "build": {"x": "y" * 10000},
        "failed": "HF_TOKEN=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 " + "y" * 60000,
        "stages": [{"stage": "build", "status": "ok", "seconds": 41.51234, "message": "m" * 1000}] * 100
                  + [{"stage": "bad", "seconds": float("inf")}],
        "engines": [{"index": i, "device": f"tpu:{i}", "max_batch": 8, "active": 2, "extra": "z" * 100}
                    for i in range(100)],
    }
    kept = p.keep_engine_fields(doc)
    assert set(kept) == {"stage", "failed", "stages", "engines"}
    assert kept["stage"] == ("weights" * 100)[:p.MAX_NAME]
    assert "hf_" not in kept["failed"] and len(kept["failed"].encode()) <= MAX_BYTES
    assert kept["stages"] == [{"stage": "build", "status": "ok", "seconds": 41.512}] * p.MAX_STAGES
    assert len(kept["engines"]) == p.MAX_ENGINES
    assert kept["engines"][3] == {"index": 3, "device": "tpu:3", "max_batch": 8, "active": 2}
    assert len(str(kept)) < 8 * 1024


def test_a_real_shaped_report_keeps_what_the_status_shows():
    doc = {"stage": "serving", "stages": [{"stage": "build", "status": "ok", "seconds": 2.0, "message": ""}],
           "failed": None, "device": "tpu", "engines": [{"index": 0, "device": "tpu:0", "max_batch": 4, "active": 0}]}
    assert p.keep_engine_fields(doc) == {
        "stage": "serving", "stages": [{"stage": "build", "status": "ok", "seconds": 2.0}],
        "engines": [{"index": 0, "device": "tpu:0", "max_batch": 4, "active": 0}]}
    assert p.served_model_of({**doc, "served_model_name": "m" * 1000}) == "m" * 256
    assert p.served_model_of({**doc, "served_model_name": ["nope"]}) == ""
    assert p.served_model_of(doc) == ""
