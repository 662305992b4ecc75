"""handlers.sync without a cluster (operator/gemma_operator/handlers.py): a stored spec that no longer parses
takes its own path, which builds, applies and deletes nothing and writes a Failed status naming the problem; a
model that does not fit its slice is Failed with ModelDoesNotFit and no child is applied."""

from __future__ import annotations

import logging

from gemma_operator import handlers, memory
from gemma_operator.registry import Registry
from gemma_operator.settings import Settings
from gemma_operator.spec import parse_spec


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


class ApplyingKube(RecordingKube):
    """An empty namespace of a cluster that serves none of the optional kinds; what is applied is kept."""

    def __init__(self):
        super().__init__()
        self.applied = []

    def serves(self, api_version):
        return False

    def get_if_present(self, api_version, kind, namespace, name):
        return None

    def apply(self, obj):
        self.applied.append(obj)
        return obj


def gemma_31b(accelerator, generation=1):
    return {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer",
            "metadata": {"name": "big", "namespace": "ns", "uid": "u-31b", "generation": generation},
            "spec": {"model": {"source": "hf://google/gemma-4-31B-it"}, "accelerator": accelerator}}


def condition(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_a_model_that_does_not_fit_its_slice_fails_before_any_deployment(monkeypatch):
    kube = ApplyingKube()
    monkeypatch.setattr(handlers, "REGISTRY", Registry(kube=kube, poller=IdlePoller(), settings=Settings.from_env({})))
    body = gemma_31b({"topology": "1x1"})
    status = handlers.sync(body, logging.getLogger("test"), prune=True)
    explanation = memory.placement(parse_spec(body["spec"])).plan.explanation
    assert explanation.startswith("Gemma 4 31B (bf16) does not fit v5e 1x1 with tensorParallelSize 1")
    assert (status["phase"], status["reason"], status["message"]) == ("Failed", "ModelDoesNotFit", explanation)
    assert condition(status, "Degraded") | {"lastTransitionTime": None} == {
        "type": "Degraded", "status": "True", "reason": "ModelDoesNotFit", "message": explanation,
        "lastTransitionTime": None, "observedGeneration": 1}
    assert (condition(status, "Ready")["status"], condition(status, "Ready")["reason"]) == ("False", "ModelDoesNotFit")
    assert kube.applied == []  # no Deployment, nor any other child


def test_a_fitting_model_gets_its_tensor_parallel_size_and_a_later_misfit_leaves_the_deployment_alone(monkeypatch):
    kube = ApplyingKube()
    monkeypatch.setattr(handlers, "REGISTRY", Registry(kube=kube, poller=IdlePoller(), settings=Settings.from_env({})))
    status = handlers.sync(gemma_31b({"topology": "2x4"}), logging.getLogger("test"), prune=True)
    assert condition(status, "Degraded")["status"] == "False"
    (dep,) = [o for o in kube.applied if o["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (env["GEMMA_DEVICES"], env["GEMMA_TENSOR_PARALLEL_SIZE"]) == ("8", "8")
    applied = len(kube.applied)
    # Down to one chip: the Deployment the API server holds keeps its spec (its pods keep serving) and nothing
    # new is applied.
    status = handlers.sync(gemma_31b({"topology": "1x1"}, generation=2), logging.getLogger("test"), prune=True)
    assert (status["phase"], status["reason"]) == ("Failed", "ModelDoesNotFit")
    assert len(kube.applied) == applied


def served_through_a_pool(picker, generation=1):
    return {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer",
            "metadata": {"name": "pooled", "namespace": "ns", "uid": "u-pool", "generation": generation},
            "spec": {"model": {"source": "hf://google/gemma-4-e2b-it"}, "accelerator": {"type": "cpu"},
                     "gateway": {"inferencePool": True, "endpointPicker": picker}}}


def test_the_pickers_config_is_for_the_operators_release_unless_the_spec_names_one(monkeypatch):
    kube = ApplyingKube()
    settings = Settings.from_env({"GEMMA_OPERATOR_ENDPOINT_PICKER": "gateway-api-inference-extension/v1.5.0"})
    monkeypatch.setattr(handlers, "REGISTRY", Registry(kube=kube, poller=IdlePoller(), settings=settings))
    handlers.sync(served_through_a_pool({"name": "epp"}), logging.getLogger("test"), prune=True)
    handlers.sync(served_through_a_pool({"name": "epp", "release": "llm-d-router/v0.10.0"}, generation=2),
                  logging.getLogger("test"), prune=True)
    (gie, router) = [o for o in kube.applied if o["kind"] == "ConfigMap"]
    assert gie["metadata"]["annotations"] == {
        "gemmarust.dev/endpoint-picker-version": "gateway-api-inference-extension/v1.5.0"}
    assert router["metadata"]["annotations"] == {"gemmarust.dev/endpoint-picker-version": "llm-d-router/v0.10.0"}
    assert "apiVersion: llm-d.ai/v1alpha1" in router["data"]["config.yaml"]


def test_a_picker_release_the_operator_writes_no_config_for_is_a_degraded_condition_naming_it(monkeypatch):
    kube = ApplyingKube()
    monkeypatch.setattr(handlers, "REGISTRY", Registry(kube=kube, poller=IdlePoller(), settings=Settings.from_env({})))
    status = handlers.sync(served_through_a_pool({"name": "epp", "release": "llm-d-router/v0.9.0"}),
                           logging.getLogger("test"), prune=True)
    degraded = condition(status, "Degraded")
    assert (status["phase"], degraded["status"], degraded["reason"]) == ("Degraded", "True", "UnsupportedEndpointPicker")
    assert degraded["message"].startswith("endpoint picker release 'llm-d-router/v0.9.0' (spec.gateway.endpointPicker")
    assert degraded["message"].endswith(
        "set one of: llm-d-router/v0.10.0, gateway-api-inference-extension/v1.5.0")
    # The pods are made all the same; the picker's ConfigMap is neither written nor deleted.
    assert "Deployment" in {o["kind"] for o in kube.applied}
    assert "ConfigMap" not in {o["kind"] for o in kube.applied}
