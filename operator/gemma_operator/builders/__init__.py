"""Pure builders: a GemmaRustServer (typed spec + metadata) -> the Kubernetes objects it owns, one module
per child kind, as KServe's reconcilers are split (kserve/kserve pkg/controller/v1beta1/inferenceservice/
reconcilers/: deployment/, service/, hpa/, keda/ ...):

    deployment       the Deployment and its pod template (scheduling, env, probes, volumes, shutdown)
    service          the Service, and the OpenAI base URL it gives the server
    disruption_budget  the PodDisruptionBudget
    build_cache      the build cache PersistentVolumeClaim, its name and its volume
    monitoring       PodMonitoring and ServiceMonitor (optional kinds)
    autoscaler       which autoscaler a server gets (`choose`): the one decision the others read
    autoscaling      KEDA's ScaledObject, its HTTP add-on's HTTPScaledObject and the HorizontalPodAutoscaler
                     (optional kinds)
    inference_pool   the Gateway API inference extension's InferencePool (optional kind)
    endpoint_picker  the endpoint picker's EndpointPickerConfig, in a ConfigMap beside the pool
    gke_gateway      GKE's HealthCheckPolicy and GCPBackendPolicy on the pool (optional kinds)
    optional         the table of optional kinds that discovery, building, pruning and conditions read
    children         everything one GemmaRustServer owns, given what the cluster serves
    ownership        labels, the metadata the builders use, owner references (adopt) and foreign objects
    event            the core/v1 Event the operator posts about a GemmaRustServer

Every function here is deterministic: no clock, no uuid, no API call. The handlers (handlers.py) call them,
adopt the results (owner references) and apply them with server-side apply; unit tests compare their output
with golden dicts (tests/operator/builders/). Callers import from the module that builds the thing; this
package re-exports nothing.
"""
