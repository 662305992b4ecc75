"""The specs and metadata the builder tests share."""

from __future__ import annotations

from typing import Any

from gemma_operator.builders.autoscaler import Autoscaling, choose
from gemma_operator.builders.deployment import build_deployment
from gemma_operator.builders.optional import OPTIONAL_KINDS
from gemma_operator.builders.ownership import Meta
from gemma_operator.spec import GemmaRustServerSpec, parse_spec

META = Meta("gemma", "serving", "0d9b6a3c-5f1e-4c2a-9b7e-2f4c1a8e6d10")
LABELS = {
    "app.kubernetes.io/name": "gemma-rust-server",
    "app.kubernetes.io/instance": "gemma",
    "app.kubernetes.io/component": "model-server",
    "app.kubernetes.io/part-of": "gemma-rust-operator",
    "app.kubernetes.io/managed-by": "gemma-rust-operator",
    "gemmarust.dev/server": "gemma",
}
SELECTOR = {"app.kubernetes.io/name": "gemma-rust-server", "app.kubernetes.io/instance": "gemma"}
SCALE_TARGET = {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer", "name": "gemma"}
EVERYTHING = frozenset(row.api_version for row in OPTIONAL_KINDS)  # a cluster that serves every optional kind


def tpu_spec(**overrides: Any) -> GemmaRustServerSpec:
    spec = {
        "model": {"source": "gs://weights-bucket/gemma-4-e2b", "embeddingTwin": "gs://weights-bucket/emb-int4",
                  "tokenSecret": {"name": "hf-token"}},
        "accelerator": {"topology": "2x2", "provisioning": "spot"},
        "image": "example.com/gemma-server:1.2.3",
        "engine": {"context": 4096},
        "server": {"servedModelName": "gemma-4", "shutdownTimeoutSeconds": 20, "startupTimeoutSeconds": 1800},
        "resources": {"requests": {"cpu": 8, "memory": "64Gi"}},
        "podAnnotations": {"team": "search"},
    }
    spec.update(overrides)
    return parse_spec(spec)


def pod_of(**spec: Any) -> dict[str, Any]:
    """The pod spec of the Deployment for an hf:// model and `spec`."""
    return build_deployment(parse_spec({"model": {"source": "hf://o/m"}, **spec}), META)["spec"]["template"]["spec"]


def env_of(spec: GemmaRustServerSpec) -> dict[str, str | None]:
    """The server container's environment, name -> value."""
    (container,) = build_deployment(spec, META)["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in container["env"]}


def scaling(**autoscaling: Any) -> GemmaRustServerSpec:
    return tpu_spec(accelerator={"type": "cpu"}, autoscaling={"maxReplicas": 4, "target": 4, **autoscaling},
                    monitoring={"podMonitoring": False})


def autoscaler_for(spec: GemmaRustServerSpec, available: frozenset[str] = EVERYTHING) -> Autoscaling:
    """The autoscaler `spec` gets on a cluster that serves `available` (every optional kind unless told)."""
    return choose(spec, available)
