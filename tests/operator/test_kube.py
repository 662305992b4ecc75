"""gemma_operator.kube against an API server that is not there (a closed loopback port): no answer is an
ApiError like any other, which `handlers.sync` turns into kopf's short retry instead of its 60 s default."""

from __future__ import annotations

import logging
import socket

import kopf
import pytest
from kubernetes.client import ApiClient, Configuration

from gemma_operator import handlers
from gemma_operator.kube import UNREACHABLE, ApiError, Kube
from gemma_operator.registry import Registry


@pytest.fixture
def unreachable() -> Kube:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = Configuration(host=f"https://127.0.0.1:{port}")
    config.retries = 0
    return Kube(ApiClient(config), timeout=2)


def test_an_unreachable_api_server_is_an_api_error_that_says_so(unreachable):
    with pytest.raises(ApiError) as e:
        unreachable.request("GET", "/api/v1/namespaces")
    assert e.value.status == UNREACHABLE
    assert str(e.value).startswith("GET /api/v1/namespaces: could not reach the API server: ")
    assert "HTTP" not in str(e.value).split(":")[1]


def test_sync_against_an_unreachable_api_server_asks_kopf_to_retry_in_seconds(unreachable, monkeypatch):
    monkeypatch.setattr(handlers, "REGISTRY", Registry(kube=unreachable))
    body = {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer",
            "metadata": {"name": "g", "namespace": "ns", "uid": "u-1", "generation": 1},
            "spec": {"model": {"source": "hf://google/gemma-4-e2b-it"}, "accelerator": {"type": "cpu"}}}
    with pytest.raises(kopf.TemporaryError) as e:
        handlers.sync(body, logging.getLogger("test"))
    assert e.value.delay == 5
    assert "could not reach the API server" in str(e.value)
