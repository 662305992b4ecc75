"""The optional kinds: one table that discovery, building, pruning and conditions read.

A child kind is optional when the spec switches it on and a cluster may not serve it (a CRD that is not
installed): monitoring, autoscaling, the gateway's InferencePool and GKE's policies for it. Which autoscaling kinds
a server gets is not a row's switch but the autoscaler chosen for it (builders.autoscaler.choose), which also
decides the stand-ins: the rows only say what each kind is and where it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..spec import GemmaRustServerSpec
from .autoscaling import build_hpa, build_http_scaled_object, build_scaled_object
from .gke_gateway import build_backend_policy, build_health_check_policy
from .inference_pool import build_inference_pool
from .monitoring import build_pod_monitoring, build_service_monitor
from .ownership import Meta

if TYPE_CHECKING:  # builders.autoscaler reads this table
    from .autoscaler import Autoscaling


def _monitoring_on(field: str) -> Callable[[GemmaRustServerSpec], bool]:
    return lambda spec: getattr(spec.monitoring, field)


# Where GKE's policy CRDs come from (a CRDMissing condition names it).
_GKE_GATEWAY_CONTROLLER = "GKE's Gateway controller: gcloud container clusters update --gateway-api=standard"


def _gke_policies_wanted(spec: GemmaRustServerSpec) -> bool:
    return spec.gateway.inference_pool and spec.gateway.provider == "GKE"


@dataclass(frozen=True)
class OptionalKind:
    """A child kind the spec switches on and a cluster may not serve.

    api_version, kind, plural: what to apply and where. builder: spec, meta -> the object (an autoscaling kind's
    builder also reads the Autoscaling chosen). wanted: the spec switch; None for an autoscaling kind, which the
    autoscaler chosen asks for (builders.autoscaler.choose). crd: the CustomResourceDefinition that serves it
    (None: built into Kubernetes). provider: what to install for it. condition: the status condition that
    reports it.
    """

    api_version: str
    kind: str
    plural: str
    builder: Callable[..., dict[str, Any]]
    wanted: Callable[[GemmaRustServerSpec], bool] | None
    crd: str | None
    provider: str
    condition: str

    def asked(self, spec: GemmaRustServerSpec, scaling: Autoscaling) -> bool:
        """Whether the server asks for this kind: its spec switch, or the autoscaler chosen (`scaling`)."""
        return self.kind in scaling.kinds if self.wanted is None else self.wanted(spec)

    def build(self, spec: GemmaRustServerSpec, meta: Meta, scaling: Autoscaling) -> dict[str, Any]:
        """The object, from its builder (an autoscaling kind's reads the autoscaler chosen, `scaling`)."""
        return self.builder(spec, meta, scaling) if self.wanted is None else self.builder(spec, meta)

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
    OptionalKind("keda.sh/v1alpha1", "ScaledObject", "scaledobjects", build_scaled_object, None,
                 "scaledobjects.keda.sh", "KEDA", SCALING),
    OptionalKind("http.keda.sh/v1alpha1", "HTTPScaledObject", "httpscaledobjects", build_http_scaled_object,
                 None, "httpscaledobjects.http.keda.sh", "the KEDA HTTP add-on", SCALING),
    OptionalKind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers", build_hpa,
                 None, None, "Kubernetes 1.23 or later", SCALING),
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
