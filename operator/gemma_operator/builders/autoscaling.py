"""Autoscaling a GemmaRustServer through its scale subresource: KEDA's ScaledObject on a Prometheus query, or
an autoscaling/v2 HorizontalPodAutoscaler on a Pods metric; both optional kinds (builders.optional) (pure). Which
of them a server gets, its fewest replicas and its triggers are the autoscaler chosen for it
(builders.autoscaler.choose), which every builder here reads.

Scale to zero (spec.autoscaling.minReplicas 0) is KEDA's: its operator alone moves a workload between 0 and 1
replicas (an HPA never goes below 1, and at zero there is no pod to give a Pods metric). What wakes it is a
request, held while a pod boots:
- through the Service, by the KEDA HTTP add-on's interceptor. The operator makes an HTTPScaledObject that routes
  this server's Service host names to it, marked `httpscaledobject.keda.sh/skip-scaledobject-creation` so the
  add-on makes no ScaledObject of its own, and puts the add-on's `external-push` trigger in ours beside the
  Prometheus one (kedacore/http-add-on v0.12.0, docs/walkthrough.md, "Integrating HTTP Add-On Scaler with other
  KEDA scalers"). The interceptor counts requests in flight, holds those for a server with no ready endpoint
  (interceptor/forward_wait_func.go) and the add-on's scaler reports them to KEDA, which wakes the server;
- through the Gateway, by the endpoint picker's flow control (builders.endpoint_picker), which queues requests
  while the pool has no ready pod; its queue gauge (GIE v1.5.0 pkg/epp/metrics/metrics.go,
  inference_extension_flow_control_queue_size, labelled inference_pool) is a Prometheus trigger of ours, held to
  this server's namespace (and cluster) as the server's own query is (`series_scope`).
After idleSeconds with no request in flight and no queue, KEDA scales the server back to zero (cooldownPeriod).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..spec import API_GROUP, API_VERSION, AUTOSCALING_METRICS, KIND, AutoscalingSpec, GemmaRustServerSpec
from .ownership import Meta, child_object

if TYPE_CHECKING:  # builders.autoscaler reads the optional kinds' table, which names the builders here
    from .autoscaler import Autoscaling

# What scales a server, as the autoscaler chosen names it (Autoscaling.triggers), each a trigger of the
# ScaledObject: the spec's gauge per pod, the requests the KEDA HTTP add-on counts, the requests the endpoint
# picker queues for the server's InferencePool.
METRIC, REQUESTS, PICKER_QUEUE = "metric", "requests", "pickerQueue"


def quantity(value: float) -> str:
    """A resource.Quantity string for a target: whole numbers as they are, others in milli-units."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


def series_scope(spec: GemmaRustServerSpec, meta: Meta) -> str:
    """The PromQL label matchers that hold a query to series scraped in this server's namespace, and with
    `prometheus.cluster` in this cluster: the scope every query of this server's ScaledObject starts with, so
    none of them can reach beyond it. `namespace` is the target label both GKE Managed Prometheus
    (PodMonitoring) and the Prometheus Operator (ServiceMonitor) attach: the namespace of the scraped pod.
    `cluster` is the target label that Managed Service for Prometheus attaches (prometheus-engine, its
    protected target labels: project_id, location, cluster, namespace, job, instance); it keeps the series of
    another cluster of the project out, since monitoring.googleapis.com's query endpoint reads them all."""
    prometheus = spec.autoscaling.prometheus
    cluster = f'cluster="{prometheus.cluster}",' if prometheus and prometheus.cluster else ""
    return f'{cluster}namespace="{meta.namespace}"'


def metric_query(spec: GemmaRustServerSpec, meta: Meta) -> str:
    """PromQL for KEDA: the metric summed over this server's pods. KEDA's Prometheus trigger targets an
    AverageValue by default (kedacore/keda v2.21.0, pkg/scalers/prometheus_scaler.go), so the HPA it makes
    divides this sum by the replicas. Within `series_scope`, a Deployment's pods are named
    <deployment>-<replicaset hash>-<suffix>."""
    name = AUTOSCALING_METRICS[spec.autoscaling.metric]
    return f'sum({name}{{{series_scope(spec, meta)},pod=~"{meta.name}-[a-z0-9]+-[a-z0-9]+"}})'


# The endpoint picker's flow-control queue gauge (GIE v1.5.0 pkg/epp/metrics/metrics.go, subsystem
# inference_extension; llm-d-router keeps GIE's metrics package).
PICKER_QUEUE_METRIC = "inference_extension_flow_control_queue_size"


def picker_queue_query(spec: GemmaRustServerSpec, meta: Meta) -> str:
    """PromQL for KEDA: the requests the endpoint picker holds for this server's InferencePool, which wake it
    from zero. The gauge's own labels are fairness_id, priority, inference_pool, model_name and target_model_name
    (GIE v1.5.0 pkg/epp/metrics/metrics.go, flowControlQueueSize), and inference_pool is the bare pool name the
    picker was started with (cmd/epp/runner/runner.go, --pool-name): alone it matches a same-named pool of any
    namespace or cluster, and any scraped series that carries such a label, which would wake this server and
    drive it to maxReplicas. So the query takes `series_scope` too. The series' `namespace` is the picker pod's,
    the namespace of this server: the InferencePool's endpointPickerRef names a Service with no namespace of its
    own (GIE v1.5.0 api/v1/inferencepool_types.go, EndpointPickerRef), so the picker's Service, and the pods it
    selects, are in the pool's namespace."""
    return f'sum({PICKER_QUEUE_METRIC}{{{series_scope(spec, meta)},inference_pool="{meta.name}"}})'


def hpa_metric_name(spec: GemmaRustServerSpec) -> str:
    """The Pods metric's name as the custom-metrics adapter serves it: prometheus-adapter keeps a gauge's
    name (kubernetes-sigs/prometheus-adapter docs/config.md, `name.as` defaults to the series name); GKE's
    Custom Metrics Stackdriver Adapter names Managed Prometheus series prometheus.googleapis.com|NAME|gauge
    (https://cloud.google.com/kubernetes-engine/docs/tutorials/autoscaling-metrics, "Prometheus")."""
    name = AUTOSCALING_METRICS[spec.autoscaling.metric]
    if spec.autoscaling.metrics_adapter == "GKE":
        return f"prometheus.googleapis.com|{name}|gauge"
    return name


# The interceptor's per-object timeouts (HTTPScaledObject spec.timeouts): how long to wait for the response
# headers once a request is sent. A completion that is not streamed sends its headers when it is done.
RESPONSE_HEADER_TIMEOUT = "3600s"
SKIP_SCALED_OBJECT = "httpscaledobject.keda.sh/skip-scaledobject-creation"


def service_hosts(meta: Meta) -> list[str]:
    """The Host header values the interceptor routes to this server: the Service's DNS names with its namespace
    (Kubernetes DNS for Services: <service>.<namespace>, .svc, .svc.cluster.local). Not the bare name, which a
    server of the same name in another namespace would claim too: the interceptor's routing table is the
    cluster's, and every name here is one only this namespace's Service has. That holds because neither part
    has a dot: a namespace name is a DNS-1123 label, and the CRD admits only a DNS-1035 label as a server's
    name (spec.NAME_RULES). A server named `a.b` in namespace `svc` would otherwise claim `a.b.svc`, the host
    of server `a` in namespace `b`."""
    short = f"{meta.name}.{meta.namespace}"
    return [short, f"{short}.svc", f"{short}.svc.cluster.local"]


def _scale_target(meta: Meta) -> dict[str, str]:
    return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "name": meta.name}


def _prometheus_trigger(scaling: AutoscalingSpec, query: str, threshold: str) -> dict[str, Any]:
    """KEDA's Prometheus trigger for `query` at `threshold`, with the spec's address and authentication."""
    trigger: dict[str, Any] = {"type": "prometheus", "metadata": {
        "serverAddress": scaling.prometheus.server_address, "query": query, "threshold": threshold}}
    if scaling.prometheus.authentication_ref:
        trigger["authenticationRef"] = {"name": scaling.prometheus.authentication_ref}
        if scaling.prometheus.authentication_kind != "TriggerAuthentication":
            trigger["authenticationRef"]["kind"] = scaling.prometheus.authentication_kind
    return trigger


def _trigger(trigger: str, spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any]:
    """One trigger of the ScaledObject: the chosen gauge from Prometheus (with its address), the HTTP add-on's
    requests (its scaler, at the operator's address, reads them for this server's HTTPScaledObject) or the
    picker's queue, which one queued request tips."""
    scaling = spec.autoscaling
    if trigger == METRIC:
        return _prometheus_trigger(scaling, metric_query(spec, meta), f"{scaling.target:g}")
    if trigger == REQUESTS:
        return {"type": "external-push", "metadata": {"scalerAddress": meta.keda_http_scaler,
                                                      "httpScaledObject": meta.name}}
    return _prometheus_trigger(scaling, picker_queue_query(spec, meta), "1")


def build_scaled_object(spec: GemmaRustServerSpec, meta: Meta, scaling: Autoscaling) -> dict[str, Any]:
    """A KEDA ScaledObject (keda.sh/v1alpha1) scaling the GemmaRustServer through its scale subresource from the
    autoscaler chosen (`scaling`): its fewest replicas and its triggers. KEDA then owns an HPA named
    keda-hpa-<name>."""
    obj = child_object("keda.sh/v1alpha1", "ScaledObject", meta.name, meta)
    obj["spec"] = {"scaleTargetRef": _scale_target(meta), "minReplicaCount": scaling.floor,
                   "maxReplicaCount": scaling.ceiling,
                   "triggers": [_trigger(trigger, spec, meta) for trigger in scaling.triggers]}
    if scaling.scales_to_zero:
        # initialCooldownPeriod: a new server stays up for the idle window too, rather than going to zero at once
        # (KEDA's default 0 scales an inactive new ScaledObject down on its first check).
        idle = spec.autoscaling.idle_seconds
        obj["spec"].update(cooldownPeriod=idle, initialCooldownPeriod=idle)
    return obj


def build_http_scaled_object(spec: GemmaRustServerSpec, meta: Meta, scaling: Autoscaling) -> dict[str, Any]:
    """The KEDA HTTP add-on's HTTPScaledObject (http.keda.sh/v1alpha1) for a server that scales to zero: the
    interceptor routes the Service's host names to the Service, holds requests for up to wakeTimeoutSeconds while
    no pod is ready, and its scaler reports requests in flight to our ScaledObject's external-push trigger
    (the add-on makes no ScaledObject: SKIP_SCALED_OBJECT). A replica's share is its sequence slots; the replicas
    are those of the autoscaler chosen (`scaling`)."""
    obj = child_object("http.keda.sh/v1alpha1", "HTTPScaledObject", meta.name, meta)
    obj["metadata"]["annotations"] = {SKIP_SCALED_OBJECT: "true"}
    obj["spec"] = {
        "hosts": service_hosts(meta),
        "scaleTargetRef": {**_scale_target(meta), "service": meta.name, "port": spec.server.port},
        "replicas": {"min": scaling.floor, "max": scaling.ceiling},
        "scaledownPeriod": spec.autoscaling.idle_seconds,
        "scalingMetric": {"concurrency": {"targetValue": spec.engine.max_num_seqs}},
        "timeouts": {"conditionWait": f"{spec.autoscaling.wake_timeout_seconds}s",
                     "responseHeader": RESPONSE_HEADER_TIMEOUT},
    }
    return obj


def build_hpa(spec: GemmaRustServerSpec, meta: Meta, scaling: Autoscaling) -> dict[str, Any]:
    """An autoscaling/v2 HorizontalPodAutoscaler on the GemmaRustServer's scale subresource, holding the
    per-pod average of the chosen gauge (a Pods metric, served by a custom-metrics adapter) at target, within the
    replicas of the autoscaler chosen (`scaling`)."""
    obj = child_object("autoscaling/v2", "HorizontalPodAutoscaler", meta.name, meta)
    obj["spec"] = {"scaleTargetRef": _scale_target(meta), "minReplicas": scaling.floor,
                   "maxReplicas": scaling.ceiling,
                   "metrics": [{"type": "Pods", "pods": {
                       "metric": {"name": hpa_metric_name(spec)},
                       "target": {"type": "AverageValue", "averageValue": quantity(spec.autoscaling.target)}}}]}
    return obj


def scaling_hpa_name(kind: str, meta: Meta) -> str:
    """The HPA that acts for the autoscaling object of `kind`: ours, or the one KEDA makes for a ScaledObject
    (kedacore/keda v2.21.0, controllers/keda/hpa.go, getDefaultHpaName)."""
    return f"keda-hpa-{meta.name}" if kind == "ScaledObject" else meta.name
