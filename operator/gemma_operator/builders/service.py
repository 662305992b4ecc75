"""The ClusterIP Service in front of a GemmaRustServer's pods, and the OpenAI base URL it gives (pure)."""

from __future__ import annotations

from typing import Any

from ..spec import GemmaRustServerSpec
from .ownership import Meta, child_object, selector_labels


def build_service(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any]:
    """ClusterIP Service in front of the pods; its DNS name is the OpenAI base URL's host."""
    svc = child_object("v1", "Service", meta.name, meta)
    svc["spec"] = {"type": "ClusterIP", "selector": selector_labels(meta),
                   "ports": [{"name": "http", "port": spec.server.port, "targetPort": "http", "protocol": "TCP"}]}
    return svc


def service_host(meta: Meta) -> str:
    """The Service's in-cluster DNS name (Kubernetes' DNS for Services: <service>.<namespace>.svc.<domain>)."""
    return f"{meta.name}.{meta.namespace}.svc.cluster.local"


def endpoint(spec: GemmaRustServerSpec, meta: Meta) -> str:
    """The in-cluster OpenAI base URL (what an openai client takes as base_url)."""
    return f"http://{service_host(meta)}:{spec.server.port}/v1"
