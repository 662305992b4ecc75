"""The Gateway API inference extension's InferencePool over a GemmaRustServer's pods, an optional kind
(builders.optional) (pure)."""

from __future__ import annotations

from typing import Any

from ..spec import GemmaRustServerSpec
from .ownership import Meta, child_object, labels, selector_labels


def build_inference_pool(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any]:
    """An InferencePool (inference.networking.k8s.io/v1, gateway-api-inference-extension v1.2.0
    config/crd/bases/inference.networking.k8s.io_inferencepools.yaml) selecting this server's pods on the
    server's port, naming the user's endpoint picker."""
    picker = spec.gateway.endpoint_picker
    obj = child_object("inference.networking.k8s.io/v1", "InferencePool", meta.name, meta)
    obj["spec"] = {"selector": {"matchLabels": selector_labels(meta)},
                   "targetPorts": [{"number": spec.server.port}],
                   "endpointPickerRef": {"name": picker.name, "group": "", "kind": "Service",
                                         "port": {"number": picker.port}, "failureMode": picker.failure_mode}}
    return obj


def selects_pods_of(pool: dict[str, Any], meta: Meta) -> bool:
    """Whether an InferencePool's selector matches this server's pods (their labels: ownership.labels)."""
    wanted = ((pool.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    have = labels(meta)
    return bool(wanted) and all(have.get(k) == v for k, v in wanted.items())
