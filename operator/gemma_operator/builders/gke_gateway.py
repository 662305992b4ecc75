"""GKE's policies for the load balancer in front of a GemmaRustServer's InferencePool (pure): a
HealthCheckPolicy, so the load balancer checks the server's own /health, and a GCPBackendPolicy, so a long
streamed completion is not cut at the load balancer's default backend timeout of 30 s.

Both are networking.gke.io/v1 kinds that GKE's Gateway controller serves (cloud.google.com/kubernetes-engine/
docs/how-to/configure-gateway-resources: `spec.default.config.httpHealthCheck`, `spec.default.timeoutSec`), and
target the InferencePool as gateway-api-inference-extension v1.5.0 does in its own chart
(config/charts/inferencepool/templates/gke.yaml).
"""

from __future__ import annotations

from typing import Any

from ..spec import GemmaRustServerSpec
from .ownership import Meta, child_object


def _pool_ref(meta: Meta) -> dict[str, str]:
    return {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": meta.name}


def build_health_check_policy(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any]:
    """HTTP GET /health on the server's port: 200 once the engine serves, 503 while it boots or drains."""
    obj = child_object("networking.gke.io/v1", "HealthCheckPolicy", meta.name, meta)
    obj["spec"] = {"targetRef": _pool_ref(meta), "default": {"config": {
        "type": "HTTP", "httpHealthCheck": {"requestPath": "/health", "port": spec.server.port}}}}
    return obj


def build_backend_policy(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any]:
    """The backend timeout: how long the load balancer waits for a whole response, a stream included."""
    obj = child_object("networking.gke.io/v1", "GCPBackendPolicy", meta.name, meta)
    obj["spec"] = {"targetRef": _pool_ref(meta), "default": {"timeoutSec": spec.gateway.backend_timeout_seconds}}
    return obj
