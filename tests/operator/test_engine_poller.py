"""The pod poller (operator/gemma_operator/engine.py) against a real loopback HTTP server."""

from __future__ import annotations

import socket

import pytest

from gemma_operator import engine as e

from .fakes import FakeEngineEndpoint


def running_pod(name, *, ready, annotations=None, ip="127.0.0.1"):
    return {"metadata": {"name": name, "uid": f"uid-{name}", "annotations": annotations or {}},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_booting_pod_reports_engine_and_ready_pod_reports_models(monkeypatch):
    monkeypatch.setenv(e.TEST_URL_SETTING, "1")
    with FakeEngineEndpoint() as fake:
        fake.boot_to("weights", {"build": 41.5, "import": 0.4, "smoke": 2.0})
        pod = running_pod("p", ready=False, annotations={e.TEST_URL_ANNOTATION: fake.url})
        poller = e.EnginePoller(min_interval=0.0)
        reports = poller.poll([pod], 8000)
        assert reports.engine["p"]["stage"] == "weights"
        assert [s["stage"] for s in reports.engine["p"]["stages"]] == ["build", "import", "smoke", "weights"]
        assert reports.models == {}
        fake.models = {"object": "list", "data": [{"id": "gemma-4", "max_model_len": 8192}]}
        ready = running_pod("p", ready=True, annotations={e.TEST_URL_ANNOTATION: fake.url})
        reports = poller.poll([ready], 8000)
        assert reports.models["p"]["data"][0]["id"] == "gemma-4"
        assert reports.engine["p"]["stage"] == "weights"  # the last boot report is kept
        assert fake.requests == ["/v1/engine", "/v1/models"]
        poller.poll([ready], 8000)
        assert fake.requests == ["/v1/engine", "/v1/models"]  # the served model is fetched once per pod


def test_pod_ip_is_used_when_overrides_are_not_enabled(monkeypatch):
    monkeypatch.delenv(e.TEST_URL_SETTING, raising=False)
    with FakeEngineEndpoint() as fake:
        port = int(fake.url.rsplit(":", 1)[1])
        pod = running_pod("p", ready=False, annotations={e.TEST_URL_ANNOTATION: "http://127.0.0.1:1"})
        assert e.base_url(pod, port, e.test_urls_allowed()) == f"http://127.0.0.1:{port}"
        assert e.EnginePoller().poll([pod], port).engine["p"]["stage"] == "build"


def test_unreachable_pod_is_tolerated_and_backed_off():
    pod = running_pod("p", ready=False)
    calls = []

    def fetch(url, timeout):
        calls.append(url)
        return e.fetch_json(url, timeout)

    poller = e.EnginePoller(fetch=fetch, min_interval=10.0)
    port = closed_port()
    assert poller.poll([pod], port) == e.Reports({}, {})
    assert poller.poll([pod], port) == e.Reports({}, {})
    assert calls == [f"http://127.0.0.1:{port}/v1/engine"]  # the second call waits out the back-off


@pytest.mark.parametrize("phase", ["Pending", "Succeeded"])
def test_pods_not_running_are_not_polled(phase):
    pod = running_pod("p", ready=False)
    pod["status"]["phase"] = phase
    poller = e.EnginePoller(fetch=lambda url, timeout: pytest.fail(f"polled {url}"))
    assert poller.poll([pod], 8000) == e.Reports({}, {})


def test_ipv6_pod_address_is_bracketed():
    assert e.base_url(running_pod("p", ready=False, ip="fd00::5"), 8000, False) == "http://[fd00::5]:8000"
