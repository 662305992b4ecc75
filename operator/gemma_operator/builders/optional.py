"""The optional kinds: one table that discovery, building, pruning and conditions read.

A child kind is optional when the spec switches it on and a cluster may not serve it (a CRD that is not
installed): monitoring, autoscaling, the gateway's InferencePool and GKE's policies for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..spec import GemmaRustServerSpec
from .autoscaling import build_hpa, build_http_scaled_object, build_scaled_object, scales_to_zero
from .gke_gateway import build_backend_policy, build_health_check_policy
from .inference_pool import build_inference_pool
from .monitoring import build_pod_monitoring, build_service_monitor
from .ownership import Meta


def _monitoring_on(field: str) -> Callable[[GemmaRustServerSpec], bool]:
    return lambda spec: getattr(spec.monitoring, field)


def _keda_wanted(spec: GemmaRustServerSpec) -> bool:
    scaling = spec.autoscaling
    return scaling is not None and scaling.provider != "HPA" and (
        scaling.provider == "KEDA" or scaling.prometheus.server_address is not None or scales_to_zero(spec))


# Where GKE's policy CRDs come from (a CRDMissing condition names it).
_GKE_GATEWAY_CONTROLLER = "GKE's Gateway controller: gcloud container clusters update --gateway-api=standard"


def _gke_policies_wanted(spec: GemmaRustServerSpec) -> bool:
    return spec.gateway.inference_pool and spec.gateway.provider == "GKE"


def _hpa_wanted(spec: GemmaRustServerSpec) -> bool:
    # Not for a server scaling to zero: an HPA would hold it at one replica (and never wake it).
    return spec.autoscaling is not None and spec.autoscaling.provider != "KEDA" and not scales_to_zero(spec)


@dataclass(frozen=True)
class OptionalKind:
    """A child kind the spec switches on and a cluster may not serve.

    api_version, kind, plural: what to apply and where. builder: spec, meta -> the object. wanted: the spec
    switch. crd: the CustomResourceDefinition that serves it (None: built into Kubernetes). provider: what
    to install for it. condition: the status condition that reports it. fallback_for: a kind this one
    stands in for; it is built only when that kind is not (the HPA when KEDA's ScaledObject is not).
    """

    api_version: str
    kind: str
    plural: str
    builder: Callable[[GemmaRustServerSpec, Meta], dict[str, Any]]
    wanted: Callable[[GemmaRustServerSpec], bool]
    crd: str | None
    provider: str
    condition: str
    fallback_for: str | None = None

    def missing(self) -> str:
        """Why it was not created, when its apiVersion is not served."""
        crd = f": CRD {self.crd} is not installed" if self.crd else ""
        return f"{self.api_version} is not served by this cluster{crd} (install {self.provider})"


MONITORING, SCALING, GATEWAY = "Monitoring", "ScalingActive", "Gateway"

OPTIONAL_KINDS = (
    OptionalKind("monitoring.googleapis.com/v1", "PodMonitoring", "podmonitorings", build_pod_monitoring,
                 _monitoring_on("pod_monitoring"), "podmonitorings.monitoring.googleapis.com",
                 "GKE managed Prometheus", MONITORING),
    OptionalKind("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors", build_service_monitor,
                 _monitoring_on("service_monitor"), "servicemonitors.monitoring.coreos.com",
                 "the Prometheus Operator", MONITORING),
    OptionalKind("keda.sh/v1alpha1", "ScaledObject", "scaledobjects", build_scaled_object, _keda_wanted,
                 "scaledobjects.keda.sh", "KEDA", SCALING),
    OptionalKind("http.keda.sh/v1alpha1", "HTTPScaledObject", "httpscaledobjects", build_http_scaled_object,
                 scales_to_zero, "httpscaledobjects.http.keda.sh", "the KEDA HTTP add-on", SCALING),
    OptionalKind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers", build_hpa,
                 _hpa_wanted, None, "Kubernetes 1.23 or later", SCALING, fallback_for="ScaledObject"),
    OptionalKind("inference.networking.k8s.io/v1", "InferencePool", "inferencepools", build_inference_pool,
                 lambda spec: spec.gateway.inference_pool, "inferencepools.inference.networking.k8s.io",
                 "the Gateway API inference extension", GATEWAY),
    OptionalKind("networking.gke.io/v1", "HealthCheckPolicy", "healthcheckpolicies", build_health_check_policy,
                 _gke_policies_wanted, "healthcheckpolicies.networking.gke.io",
                 _GKE_GATEWAY_CONTROLLER, GATEWAY),
    OptionalKind("networking.gke.io/v1", "GCPBackendPolicy", "gcpbackendpolicies", build_backend_policy,
                 _gke_policies_wanted, "gcpbackendpolicies.networking.gke.io",
                 _GKE_GATEWAY_CONTROLLER, GATEWAY),
)
OPTIONAL_BY_KIND = {row.kind: row for row in OPTIONAL_KINDS}
