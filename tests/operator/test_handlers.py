"""handlers.sync on a stored spec that no longer parses (operator/gemma_operator/handlers.py): its own path
builds, applies and deletes nothing, and writes a Failed status naming the problem."""

from __future__ import annotations

import logging

from gemma_operator import handlers
from gemma_operator.registry import Registry


class RecordingKube:
    """The calls sync makes, answered as an empty namespace would answer them."""

    def __init__(self):
        self.calls = []

    def list_pods(self, namespace, selector):
        self.calls.append(("list_pods", namespace, selector))
        return []

    def patch_status(self, namespace, name, status):
        self.calls.append(("patch_status", namespace, name))
        return {"status": status}

    def request(self, method, path, body=None, **_):
        self.calls.append((method, path))
        return {}

    def __getattr__(self, name):  # apply, delete_if_present, get_if_present, serves: must not be called
        raise AssertionError(f"sync called Kube.{name} for a spec that does not parse")


class IdlePoller:
    def observe(self, server, pods, port):
        from gemma_operator.poller import Reports
        return Reports({}, {}, {})


def test_a_spec_that_no_longer_parses_is_a_failed_status_and_touches_no_child(monkeypatch):
    kube = RecordingKube()
    monkeypatch.setattr(handlers, "REGISTRY", Registry(kube=kube, poller=IdlePoller()))
    body = {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer",
            "metadata": {"name": "g", "namespace": "ns", "uid": "u-1", "generation": 2},
            "spec": {"model": {"source": "hf://o/m"}, "replicas": -1}}
    status = handlers.sync(body, logging.getLogger("test"), prune=True)
    assert (status["phase"], status["reason"]) == ("Failed", "InvalidSpec")
    assert status["message"].startswith("spec does not fit the schema: replicas: ")
    assert (status["accelerator"], status["endpoint"], status["observedGeneration"]) == ("", "", 2)
    assert [c[0] for c in kube.calls] == ["list_pods", "patch_status", "POST"]  # the status, then its Event
    assert handlers.REGISTRY.server("u-1", "ns", "g").written == status
