"""GKE's policies beside the InferencePool (gemma_operator/builders/gke_gateway.py): golden dicts, no cluster
involved."""

from __future__ import annotations

from gemma_operator.builders.gke_gateway import build_backend_policy, build_health_check_policy

from .specs import LABELS, META, tpu_spec

POOL = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "gemma"}


def test_the_health_check_asks_the_servers_own_health_on_its_port():
    spec = tpu_spec(server={"port": 9000}, gateway={"inferencePool": True, "endpointPicker": {"name": "epp"}})
    assert build_health_check_policy(spec, META) == {
        "apiVersion": "networking.gke.io/v1", "kind": "HealthCheckPolicy",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {"targetRef": POOL, "default": {"config": {
            "type": "HTTP", "httpHealthCheck": {"requestPath": "/health", "port": 9000}}}}}


def test_the_backend_timeout_defaults_to_an_hour_and_follows_the_spec():
    gateway = {"inferencePool": True, "endpointPicker": {"name": "epp"}}
    assert build_backend_policy(tpu_spec(gateway=gateway), META) == {
        "apiVersion": "networking.gke.io/v1", "kind": "GCPBackendPolicy",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {"targetRef": POOL, "default": {"timeoutSec": 3600}}}
    longer = tpu_spec(gateway={**gateway, "backendTimeoutSeconds": 7200})
    assert build_backend_policy(longer, META)["spec"]["default"] == {"timeoutSec": 7200}
