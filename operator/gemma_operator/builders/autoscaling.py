"""Autoscaling a GemmaRustServer through its scale subresource: KEDA's ScaledObject on a Prometheus query, or
an autoscaling/v2 HorizontalPodAutoscaler on a Pods metric; both optional kinds (builders.optional) (pure)."""

from __future__ import annotations

from typing import Any

from ..spec import API_GROUP, API_VERSION, AUTOSCALING_METRICS, KIND, GemmaRustServerSpec
from .ownership import Meta, child_object


def quantity(value: float) -> str:
    """A resource.Quantity string for a target: whole numbers as they are, others in milli-units."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


def metric_query(spec: GemmaRustServerSpec, meta: Meta) -> str:
    """PromQL for KEDA: the metric summed over this server's pods. KEDA's Prometheus trigger targets an
    AverageValue by default (kedacore/keda v2.21.0, pkg/scalers/prometheus_scaler.go), so the HPA it makes
    divides this sum by the replicas. `namespace` and `pod` are the target labels both GKE Managed
    Prometheus (PodMonitoring) and the Prometheus Operator (ServiceMonitor) attach; a Deployment's pods
    are named <deployment>-<replicaset hash>-<suffix>. With `prometheus.cluster`, the `cluster` target label
    that Managed Service for Prometheus attaches (prometheus-engine, its protected target labels: project_id,
    location, cluster, namespace, job, instance) keeps a same-named server of another cluster of the project
    out of the sum."""
    name = AUTOSCALING_METRICS[spec.autoscaling.metric]
    prometheus = spec.autoscaling.prometheus
    cluster = f'cluster="{prometheus.cluster}",' if prometheus and prometheus.cluster else ""
    return f'sum({name}{{{cluster}namespace="{meta.namespace}",pod=~"{meta.name}-[a-z0-9]+-[a-z0-9]+"}})'


def hpa_metric_name(spec: GemmaRustServerSpec) -> str:
    """The Pods metric's name as the custom-metrics adapter serves it: prometheus-adapter keeps a gauge's
    name (kubernetes-sigs/prometheus-adapter docs/config.md, `name.as` defaults to the series name); GKE's
    Custom Metrics Stackdriver Adapter names Managed Prometheus series prometheus.googleapis.com|NAME|gauge
    (https://cloud.google.com/kubernetes-engine/docs/tutorials/autoscaling-metrics, "Prometheus")."""
    name = AUTOSCALING_METRICS[spec.autoscaling.metric]
    if spec.autoscaling.metrics_adapter == "GKE":
        return f"prometheus.googleapis.com|{name}|gauge"
    return name


def _scale_target(meta: Meta) -> dict[str, str]:
    return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "name": meta.name}


def build_scaled_object(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any]:
    """A KEDA ScaledObject (keda.sh/v1alpha1) scaling the GemmaRustServer through its scale subresource on a
    Prometheus query of the chosen gauge. KEDA then owns an HPA named keda-hpa-<name>."""
    scaling = spec.autoscaling
    trigger: dict[str, Any] = {"type": "prometheus", "metadata": {
        "serverAddress": scaling.prometheus.server_address, "query": metric_query(spec, meta),
        "threshold": f"{scaling.target:g}"}}
    if scaling.prometheus.authentication_ref:
        trigger["authenticationRef"] = {"name": scaling.prometheus.authentication_ref}
        if scaling.prometheus.authentication_kind != "TriggerAuthentication":
            trigger["authenticationRef"]["kind"] = scaling.prometheus.authentication_kind
    obj = child_object("keda.sh/v1alpha1", "ScaledObject", meta.name, meta)
    obj["spec"] = {"scaleTargetRef": _scale_target(meta), "minReplicaCount": scaling.min_replicas,
                   "maxReplicaCount": scaling.max_replicas, "triggers": [trigger]}
    return obj


def build_hpa(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any]:
    """An autoscaling/v2 HorizontalPodAutoscaler on the GemmaRustServer's scale subresource, holding the
    per-pod average of the chosen gauge (a Pods metric, served by a custom-metrics adapter) at target."""
    scaling = spec.autoscaling
    obj = child_object("autoscaling/v2", "HorizontalPodAutoscaler", meta.name, meta)
    obj["spec"] = {"scaleTargetRef": _scale_target(meta), "minReplicas": scaling.min_replicas,
                   "maxReplicas": scaling.max_replicas,
                   "metrics": [{"type": "Pods", "pods": {
                       "metric": {"name": hpa_metric_name(spec)},
                       "target": {"type": "AverageValue", "averageValue": quantity(scaling.target)}}}]}
    return obj


def scaling_hpa_name(kind: str, meta: Meta) -> str:
    """The HPA that acts for the autoscaling object of `kind`: ours, or the one KEDA makes for a ScaledObject
    (kedacore/keda v2.21.0, controllers/keda/hpa.go, getDefaultHpaName)."""
    return f"keda-hpa-{meta.name}" if kind == "ScaledObject" else meta.name
