"""The GemmaRustServer spec as pydantic models: the one source of truth for the CRD schema.

`gemma_operator.crd` turns these models into the CRD's OpenAPI v3 schema (defaults, enums, patterns,
bounds) and attaches the CEL rules declared here as `x-kubernetes-validations`, so admission rejects what
the schema can see. The operator parses each custom resource's spec with the same models, so the builders
receive typed, defaulted values.

Design notes:
- Field names are camelCase in the API (Kubernetes convention) and snake_case in Python (aliases).
- Rules that involve two fields are CEL rules (`CEL_RULES` below, attached to the object that holds
  both fields) with a message that says what to set; single-field limits are plain OpenAPI keywords.
- `accelerator.type` is a free DNS label rather than an enum: GKE keeps adding accelerators, and an
  accelerator the operator does not know yet is reported as a Degraded condition (reason
  UnknownAccelerator) instead of needing a CRD upgrade to say so. `KNOWN_ACCELERATORS` lists those the
  builders know.
- Pass-through fields (resources, tolerations) keep the Kubernetes shapes and are validated by the API
  server when the Deployment is applied.
- `gateway.endpointPicker.release` is a free string like `accelerator.type`: the picker is the user's, and a release
  the operator writes no config for is a Degraded condition (UnsupportedEndpointPicker) naming the ones it does
  (`ENDPOINT_PICKER_RELEASES`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

API_GROUP = "gemmarust.dev"
API_VERSION = "v1alpha1"
KIND = "GemmaRustServer"
PLURAL = "gemmarustservers"
SINGULAR = "gemmarustserver"
SHORT_NAMES = ["grs"]

DEFAULT_IMAGE = "ghcr.io/gemma-rust-operator/gemma-server:0.1.0"

TPU_V5E = "tpu-v5-lite-podslice"
TPU_V6E = "tpu-v6e-slice"
CPU = "cpu"
KNOWN_ACCELERATORS = (TPU_V5E, TPU_V6E, CPU)

# The single-host slices of each TPU type the operator knows: topology -> chips on the one host. Cloud TPU's
# "TPU v5e" and "TPU v6e" pages (cloud.google.com/tpu/docs/v5e, /v6e, "Supported configurations"): v5e 1x1,
# 2x2, 2x4 are GKE machine types ct5lp-hightpu-1t/4t/8t; v6e 1x1, 2x2, 2x4 are ct6e-standard-1t/4t/8t (v6e
# serves on one host up to 8 chips; its 2x4 on two ct6e-standard-4t VMs is multi-VM, which one pod cannot use).
SINGLE_HOST_CHIPS = {"1x1": 1, "2x2": 4, "2x4": 8}
TPU_TOPOLOGY_CHIPS = {TPU_V5E: SINGLE_HOST_CHIPS, TPU_V6E: SINGLE_HOST_CHIPS}
TPU_NAMES = {TPU_V5E: "v5e", TPU_V6E: "v6e"}
# HBM per chip, in GiB: "HBM capacity per chip" on Cloud TPU's "TPU v5e" (16) and "TPU v6e" (32) pages
# (cloud.google.com/tpu/docs/v5e, /v6e, "System architecture"). gemma_operator.memory plans with it.
TPU_HBM_GIB = {TPU_V5E: 16, TPU_V6E: 32}

# The Gemma 4 text models the operator can size a slice for (their architectures: gemma_operator.memory), as
# the Hugging Face repositories name them (google/gemma-4-E2B, -E4B, -12B, -26B-A4B, -31B), lower case.
ModelSize = Literal["e2b", "e4b", "12b", "26b-a4b", "31b"]
MODEL_SIZES: tuple[str, ...] = get_args(ModelSize)
# How a checkpoint stores its linear layers: 16-bit, or compressed-tensors pack-quantized int4 (W4A16).
Quantization = Literal["bf16", "w4a16"]
MAX_NUM_SEQS = 1024  # spec.engine.maxNumSeqs's bound

# The endpoint picker releases the operator writes a config for (builders/endpoint_picker.py), as project/tag,
# the default first: llm-d-router, where the picker lives since gateway-api-inference-extension v1.6.0 deleted
# its own, and GIE v1.5.0, the last GIE release with a picker. GEMMA_OPERATOR_ENDPOINT_PICKER chooses for every
# server; spec.gateway.endpointPicker.release for one.
LLM_D_ROUTER_V0_10 = "llm-d-router/v0.10.0"
GIE_V1_5 = "gateway-api-inference-extension/v1.5.0"
ENDPOINT_PICKER_RELEASES = (LLM_D_ROUTER_V0_10, GIE_V1_5)
PICKER_RELEASE_RE = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/v[0-9][-a-z0-9.]*$"

MODEL_SOURCE_RE = (
    r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?"
    r"|gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/[^\s]*)?"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?)$"
)
MODEL_SOURCE_MESSAGE = (
    "model source must be hf://org/repo[@revision], gs://bucket/path (mounted with GCS FUSE) "
    "or pvc://claim/path"
)
# A ".." path segment: the path stays inside the pod's mount either way, but a source is a location, not a
# way to walk out of one.
PARENT_SEGMENT_RE = r"(^|/)\.\.(/|$)"
PARENT_SEGMENT_MESSAGE = "model source must not contain '..' path segments"
DRAFTER_TP_MESSAGE = ("spec.engine.speculative.method mtp runs its drafter without tensor parallelism: leave "
                      "spec.engine.tensorParallelSize unset or 1")
SPECULATIVE_SOURCE_MESSAGE = ("spec.engine.speculative.source is the assistant drafter of method mtp: set it with "
                              "mtp, leave it unset with ngram")
DNS_LABEL_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# A DNS-1035 label (Kubernetes apimachinery pkg/util/validation/validation.go, dns1035LabelFmt and
# DNS1035LabelMaxLength 63): what a Service's name must be (ValidateServiceName), and so a server's.
DNS_1035_LABEL_RE = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
QUANTITY_RE = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"


def _cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    out = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class TokenSecretRef(_Model):
    """A Secret key holding the Hugging Face token; it reaches the pod only through secretKeyRef."""

    name: str = Field(description="Secret name, in the custom resource's namespace.", pattern=DNS_SUBDOMAIN_RE,
                      max_length=253)
    key: str = Field("token", description="Key in the Secret whose value is the token.", min_length=1,
                     max_length=253)


class GcsFuseSpec(_Model):
    """How gs:// sources are mounted: the GCS FUSE file cache, bounded, on its own volume.

    The cache lives on the volume the GCS FUSE CSI driver's sidecar looks for, `gke-gcsfuse-cache`
    (https://cloud.google.com/kubernetes-engine/docs/how-to/cloud-storage-fuse-csi-driver-sidecar, "custom
    read cache volume"), as Google's TPU samples mount it (GoogleCloudPlatform/kubernetes-engine-samples,
    ai-ml/gke-ray/rayserve/llm/tpu/ray-cluster.tpu-v6e-multihost.yaml: an in-memory emptyDir).
    """

    file_cache_size: str = Field(
        "16Gi", description="Size of the GCS FUSE file cache (the gke-gcsfuse-cache volume's sizeLimit; the "
        "driver's fileCacheCapacity is set a tenth below it). Bounded, so a large model cannot fill the node.",
        pattern=QUANTITY_RE, max_length=32)
    file_cache_medium: Literal["Memory", "Disk"] = Field(
        "Memory", description="Where the file cache lives: Memory (tmpfs, counted as the pod's memory; what "
        "Google's TPU samples use, TPU VMs have no local SSD) or Disk (the node's boot disk).")
class ApiKeySecretRef(_Model):
    """A Secret key holding the server's API key; it reaches the pod only through secretKeyRef."""

    name: str = Field(description="Secret name, in the custom resource's namespace.", pattern=DNS_SUBDOMAIN_RE,
                      max_length=253)
    key: str = Field("api-key", description="Key in the Secret whose value is the API key.", min_length=1,
                     max_length=253)


class ModelSpec(_Model):
    source: str = Field(
        description="Where the checkpoint is: hf://org/repo[@revision], gs://bucket/path (GCS FUSE) or "
        "pvc://claim/path.",
        max_length=1024,
    )
    embedding_twin: str | None = Field(
        None, description="Optional int4 embedding twin, same URL forms as source.", max_length=1024)
    token_secret: TokenSecretRef | None = Field(
        None, description="Secret with the Hugging Face token (gated or private hf:// models).")
    gcs_fuse: GcsFuseSpec = Field(default_factory=GcsFuseSpec,
                                  description="GCS FUSE settings, used when a source is gs://.")
    size: ModelSize | None = Field(
        None, description="Which Gemma 4 model the checkpoint is (e2b, e4b, 12b, 26b-a4b, 31b), for the operator's "
        "memory plan: the tensor parallelism it picks, and the ModelDoesNotFit condition of a slice too small. "
        "Unset: read from the source's name (e.g. hf://google/gemma-4-31B-it is 31b); a name without one of "
        "these tags gets no plan.")
    quantization: Quantization | None = Field(
        None, description="How the checkpoint stores its linear layers, for the memory plan: bf16 (16-bit) or "
        "w4a16 (compressed-tensors pack-quantized int4). Unset: w4a16 when the source's name says w4a16 or int4, "
        "else bf16.")

    @field_validator("source", "embedding_twin")
    @classmethod
    def _source_form(cls, v: str | None) -> str | None:
        return _check_source(v)  # (a validator stays out of the schema)


class AcceleratorSpec(_Model):
    type: str = Field(
        TPU_V5E,
        description="GKE accelerator: tpu-v5-lite-podslice (TPU v5e), tpu-v6e-slice (TPU v6e, Trillium), or cpu "
                    "for clusters without TPUs.",
        pattern=DNS_LABEL_RE, max_length=63,
    )
    topology: Literal["1x1", "2x2", "2x4"] | None = Field(
        None, description="TPU slice topology (single host): 1x1 = 1 chip, 2x2 = 4 chips, 2x4 = 8 chips. "
        "Defaults to 1x1 on TPU; not allowed with type cpu.")
    provisioning: Literal["standard", "spot", "flex-start"] = Field(
        "standard", description="Node capacity: standard (on-demand or reserved; never a spot or flex-start "
        "node), spot, or flex-start.")
    compute_class: str | None = Field(
        None, description="Optional GKE ComputeClass (cloud.google.com/compute-class node selector).",
        pattern=DNS_LABEL_RE, max_length=63)


def _check_source(v: str | None) -> str | None:
    """A model source's form (MODEL_SOURCE_RE, no '..' segment), as the CEL rules check it: for objects stored
    before a rule existed, so such a spec becomes a condition rather than a handler that fails on every retry."""
    if v is not None and not re.fullmatch(MODEL_SOURCE_RE, v):
        raise ValueError(MODEL_SOURCE_MESSAGE)
    if v is not None and re.search(PARENT_SEGMENT_RE, v):
        raise ValueError(PARENT_SEGMENT_MESSAGE)
    return v


class SpeculativeSpec(_Model):
    """Speculative decoding (the server's --speculative-method and its settings, gemma_server/config.py)."""

    method: Literal["ngram", "mtp"] = Field(
        "ngram", description="ngram: prompt lookup, drafts copied from what followed the context's last n-gram "
        "earlier in the context, no second model; mtp: Gemma 4's MTP assistant drafter (source), a small model "
        "that drafts from the target's KV cache and last hidden state. The model checks the drafts in one "
        "forward; greedy output is unchanged (GEMMA_SPECULATIVE_METHOD).")
    source: str | None = Field(
        None, description="method mtp: where the assistant drafter is (e.g. hf://google/gemma-4-E2B-it-assistant), "
        "in the URL forms of spec.model.source, mounted and read with the same credentials "
        "(GEMMA_SPECULATIVE_MODEL). Not allowed with ngram.", max_length=1024)
    num_speculative_tokens: int = Field(
        description="Draft tokens per request and step (GEMMA_NUM_SPECULATIVE_TOKENS).", ge=1, le=16)
    max_batch: int | None = Field(
        None, description="Above this many decoding requests an engine's steps do not speculate "
        "(GEMMA_SPECULATIVE_MAX_BATCH). Unset: each server measures at warmup up to which decode bucket a "
        "verify step pays.", ge=1, le=MAX_NUM_SEQS)

    @field_validator("source")
    @classmethod
    def _source_form(cls, v: str | None) -> str | None:
        return _check_source(v)

    @model_validator(mode="after")
    def _source_for_mtp(self) -> SpeculativeSpec:
        if (self.method == "mtp") != (self.source is not None):
            raise ValueError(SPECULATIVE_SOURCE_MESSAGE)
        return self


class EngineSpec(_Model):
    context: int = Field(8192, description="Context length in tokens (prompt + generation).", ge=256,
                         le=131072)
    max_num_seqs: int = Field(
        8, description="Sequence slots per engine (a pod runs one engine per tensorParallelSize chips): requests "
        "decoded together in one batch. Each slot reserves a whole context of KV cache; the server refuses, at "
        "its weights stage, a number whose cache does not fit the chip.", ge=1, le=MAX_NUM_SEQS)
    tensor_parallel_size: int | None = Field(
        None, description="Chips each engine spreads the model over (attention and KV heads, MLP, experts and "
        "vocabulary split that many ways); a pod on a slice of C chips runs C / tensorParallelSize engines. Must "
        "divide the slice's chips; TPU only. Unset: the smallest divisor of the chips whose share of the "
        "model, with maxNumSeqs slots of context, fits a chip's HBM (1 when the model's size is unknown).",
        ge=1, le=8)
    prefill_chunk: int = Field(
        256, description="Prompt tokens read per forward, one chunk per step between the running requests' "
        "decode steps: smaller keeps their token gaps shorter while a long prompt is read.", ge=1, le=131072)
    read_every: int = Field(
        4, description="Tokens decoded between two host reads; 1 streams every token, more amortises the "
        "device sync.", ge=1, le=256)
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="Compute dtype.")
    defer_and_fuse: bool = Field(
        True, description="The TPU backend's defer-and-fuse execution (TORCH_TPU_DEFER_AND_FUSE).")
    compile: Literal["off", "on", "auto"] = Field(
        "off", description="Record each decode-step shape at the dispatcher and compile it (torch_tpu's tpu "
        "backend on a TPU, Inductor on GPU and CPU), in a boot stage of its own (Compiling); auto times both "
        "ways at boot and keeps the faster. Compiled artifacts are cached on the build-cache volume "
        "(GEMMA_COMPILE).")
    speculative: SpeculativeSpec | None = Field(
        None, description="Speculative decoding. Unset: off.")

    @model_validator(mode="after")
    def _drafter_on_one_chip(self) -> EngineSpec:
        if self.speculative and self.speculative.method == "mtp" and (self.tensor_parallel_size or 1) > 1:
            raise ValueError(DRAFTER_TP_MESSAGE)
        return self


class MediaSpec(_Model):
    """The server's limits on images and audio (gemma_server/config.py, the GEMMA_MAX_* and GEMMA_MEDIA_FETCH_*
    variables). Unset fields keep the server's own defaults, declared there once."""

    max_images_per_request: int | None = Field(
        None, description="Images one request may hold; more are a 400. Unset: the server's default (8).", ge=0,
        le=64)
    max_image_pixels: int | None = Field(
        None, description="Width x height of the largest image the server decodes; larger is a 400. Unset: the "
        "server's default (4096 x 4096).", ge=1, le=2**28)
    max_audio_seconds: int | None = Field(
        None, description="Seconds of audio one request may hold, every clip together; more is a 400. Unset: the "
        "server's default (300).", ge=0, le=3600)
    max_media_bytes: int | None = Field(
        None, description="Bytes of one image or audio file as sent; larger is a 400. Unset: the server's default "
        "(4 MiB).", ge=1, le=64 * 2**20)
    fetch_hosts: list[Annotated[str, Field(pattern=DNS_SUBDOMAIN_RE, max_length=253)]] = Field(
        default_factory=list, description="Host names whose http(s) image URLs the server fetches (exact names; "
        "redirects are not followed). Empty: image_url takes data URLs only. Whoever can send requests can make "
        "the pod GET URLs on these hosts, so list only hosts that serve images.", max_length=32)
    fetch_timeout_seconds: int | None = Field(
        None, description="Seconds to fetch one image URL. Unset: the server's default (10).", ge=1, le=300)


class ServerSpec(_Model):
    port: int = Field(8000, description="HTTP port of the OpenAI API, /health, /live, /v1/engine, /metrics.",
                      ge=1024, le=65535)
    probe_port: int = Field(
        8001, description="Port of the server's probe listener (/health, /live on a thread and event loop of "
        "their own): the kubelet's probes go here, so no load on the API port reaches them.", ge=1024, le=65535)
    served_model_name: str | None = Field(
        None, description="Model id reported by /v1/models; the server derives one from the source if unset.",
        max_length=256)
    queue_limit: int | None = Field(
        None, description="Requests waiting beyond this get 429. Unset: the server's own default (64).",
        ge=1, le=100000)
    shutdown_timeout_seconds: int | None = Field(
        None, description="Drain time after SIGTERM before in-flight requests are ended. Unset: 30 on standard "
        "capacity, 10 on spot and flex-start, where GKE gives a reclaimed node's pods about 15 s.", ge=1, le=3600)
    startup_timeout_seconds: int = Field(
        3600, description="Budget for build, smoke test, weights and warmup before the pod is restarted.",
        ge=60, le=86400)
    api_key_secret: ApiKeySecretRef | None = Field(
        None, description="Secret with the API key clients must send (Authorization: Bearer KEY); it reaches "
        "the server as GEMMA_API_KEY. Without it the API is open to whoever reaches the Service.")
    media: MediaSpec = Field(
        default_factory=MediaSpec, description="Limits on the images and audio a request may hold (a checkpoint "
        "with Gemma 4's vision and audio towers takes them).")


class BuildCacheSpec(_Model):
    type: Literal["emptyDir", "pvc"] = Field(
        "emptyDir", description="emptyDir (lost with the pod) or pvc (a PersistentVolumeClaim the operator "
        "creates, so a restarted pod skips the engine compile).")
    size: str = Field("20Gi", description="Size of the cache volume.", pattern=QUANTITY_RE, max_length=32)
    storage_class_name: str | None = Field(None, description="StorageClass for the pvc type.", max_length=253)
    access_mode: Literal["ReadWriteOnce", "ReadWriteMany"] = Field(
        "ReadWriteOnce", description="Access mode of the pvc type; ReadWriteMany lets replicas share it.")


Quantity = int | str


class ResourcesSpec(_Model):
    requests: dict[str, Quantity] | None = Field(
        None, description="Container requests, e.g. {cpu: 8, memory: 64Gi}.", max_length=16)
    limits: dict[str, Quantity] | None = Field(
        None, description="Container limits, e.g. {memory: 64Gi}.", max_length=16)


class MonitoringSpec(_Model):
    pod_monitoring: bool = Field(
        True, description="Create a GKE managed Prometheus PodMonitoring (when its CRD exists).")
    service_monitor: bool = Field(
        False, description="Create a Prometheus Operator ServiceMonitor (when its CRD exists).")
    interval: str = Field("30s", description="Scrape interval.", pattern=r"^[0-9]+(s|m)$", max_length=8)



# The server's gauges an autoscaler can follow (gemma_server/metrics.py exports them, label model_name):
# spec.autoscaling.metric -> metric name.
AUTOSCALING_METRICS = {
    "requestsWaiting": "gemma_num_requests_waiting",
    "requestsRunning": "gemma_num_requests_running",
    "kvCacheUsage": "gemma_kv_cache_usage_perc",
}


class PrometheusSpec(_Model):
    """Where KEDA's Prometheus trigger queries the server's metrics."""

    server_address: str | None = Field(
        None, description="Prometheus HTTP API base URL KEDA queries (it appends /api/v1/query), e.g. "
        "http://prometheus-operated.monitoring.svc:9090, or on GKE Managed Prometheus "
        "https://monitoring.googleapis.com/v1/projects/PROJECT_ID/location/global/prometheus with "
        "authenticationRef. Without it the operator creates an HPA instead of a ScaledObject.",
        pattern=r"^https?://[^\s]+$", max_length=1024)
    authentication_ref: str | None = Field(
        None, description="Name of a KEDA TriggerAuthentication in the namespace, or of a "
        "ClusterTriggerAuthentication with authenticationKind (e.g. GCP Workload Identity for "
        "monitoring.googleapis.com).", pattern=DNS_SUBDOMAIN_RE, max_length=253)
    authentication_kind: Literal["TriggerAuthentication", "ClusterTriggerAuthentication"] = Field(
        "TriggerAuthentication", description="What authenticationRef names: a TriggerAuthentication in the "
        "namespace, or a cluster-wide ClusterTriggerAuthentication (KEDA's own Managed Prometheus example uses "
        "one).")
    cluster: str | None = Field(
        None, description="The cluster's name as Managed Service for Prometheus labels its series (the "
        "`cluster` target label): KEDA's query then selects only this cluster's pods, since "
        "monitoring.googleapis.com's query endpoint reads every cluster of the project. Default: the operator's "
        "GEMMA_OPERATOR_CLUSTER_NAME (chart value operator.clusterName); unset there too, no cluster matcher.",
        pattern=DNS_LABEL_RE, max_length=63)


class AutoscalingSpec(_Model):
    """Replicas driven by the server's queue (or load, or KV-cache use) instead of spec.replicas."""

    min_replicas: int = Field(
        1, description="Fewest replicas the autoscaler keeps. 0: scale to zero after idleSeconds without a "
        "request; requests sent while it is at zero are held, not dropped, until a pod is ready (through the "
        "Service: the KEDA HTTP add-on's interceptor; through the Gateway: the endpoint picker's flow "
        "control). Needs KEDA and the KEDA HTTP add-on.", ge=0, le=256)
    max_replicas: int = Field(description="Most replicas the autoscaler makes.", ge=1, le=256)
    metric: Literal["requestsWaiting", "requestsRunning", "kvCacheUsage"] = Field(
        "requestsWaiting", description="Per-pod gauge to hold at target: requestsWaiting "
        "(gemma_num_requests_waiting), requestsRunning (gemma_num_requests_running) or kvCacheUsage "
        "(gemma_kv_cache_usage_perc, 0 to 1).")
    target: float = Field(description="Average of the metric per pod the autoscaler aims at, e.g. 4 "
                          "(requests waiting) or 0.8 (KV-cache usage).", gt=0, le=100000)
    provider: Literal["Auto", "KEDA", "HPA"] = Field(
        "Auto", description="KEDA: a KEDA ScaledObject with a Prometheus trigger (needs KEDA's CRD and "
        "prometheus.serverAddress). HPA: an autoscaling/v2 HorizontalPodAutoscaler on a Pods metric served "
        "by a custom-metrics adapter. Auto: KEDA when its CRD is installed and serverAddress is set, else HPA.")
    metrics_adapter: Literal["PrometheusAdapter", "GKE"] = Field(
        "PrometheusAdapter", description="How the HPA names the metric: PrometheusAdapter "
        "(gemma_num_requests_waiting) or GKE, the Custom Metrics Stackdriver Adapter over Managed Prometheus "
        "(prometheus.googleapis.com|gemma_num_requests_waiting|gauge).")
    prometheus: PrometheusSpec = Field(default_factory=PrometheusSpec,
                                       description="Prometheus endpoint for KEDA.")
    idle_seconds: int = Field(
        600, description="With minReplicas 0: seconds without a request in flight before the last replica goes "
        "(the ScaledObject's cooldownPeriod and the HTTPScaledObject's scaledownPeriod).", ge=30, le=604800)
    wake_timeout_seconds: int = Field(
        1200, description="With minReplicas 0: how long a request sent at zero is held while a pod boots before "
        "it fails (the HTTPScaledObject's timeouts.conditionWait; the picker's flow-control TTL). A TPU pod's "
        "first boot builds the engine and compiles; see status.wake for how long the last wake took.",
        ge=30, le=86400)


class EndpointPickerRef(_Model):
    """The Gateway API inference extension's endpoint picker (a Service the user deploys)."""

    name: str = Field(description="Service of the endpoint picker, in this namespace.", pattern=DNS_LABEL_RE,
                      max_length=63)
    port: int = Field(9002, description="Its gRPC ext-proc port (the picker's --grpc-port, default 9002).",
                      ge=1, le=65535)
    failure_mode: Literal["FailClose", "FailOpen"] = Field(
        "FailClose", description="What the gateway does when the picker does not answer.")
    release: str | None = Field(
        None, description="The picker's release as project/tag, which decides the format of the config the "
        "operator writes for it (the ConfigMap <name>-epp): " + " or ".join(ENDPOINT_PICKER_RELEASES) + ". "
        "Default: the operator's GEMMA_OPERATOR_ENDPOINT_PICKER (chart value operator.endpointPicker), "
        f"{LLM_D_ROUTER_V0_10} unless set. Another release is reported as UnsupportedEndpointPicker and gets no "
        "config.", pattern=PICKER_RELEASE_RE, max_length=100)


class GatewaySpec(_Model):
    inference_pool: bool = Field(
        False, description="Create an InferencePool (inference.networking.k8s.io/v1) selecting this server's "
        "pods, for the Gateway API inference extension (when its CRD is installed).")
    endpoint_picker: EndpointPickerRef | None = Field(
        None, description="The endpoint picker the InferencePool names; required with inferencePool.")
    provider: Literal["GKE", "None"] = Field(
        "GKE", description="GKE: beside the InferencePool, a HealthCheckPolicy (/health) and a GCPBackendPolicy "
        "(backendTimeoutSeconds) for GKE's Gateway controller (when their CRDs are installed). None: neither.")
    backend_timeout_seconds: int = Field(
        3600, description="The load balancer's backend timeout (GCPBackendPolicy timeoutSec): a response, "
        "a streamed one included, that takes longer is cut. GKE's default without the policy is 30 s.",
        ge=1, le=86400)


# GKE's TPU metrics port: GKE exports a TPU container's duty cycle and HBM usage (kubernetes.io/container/
# accelerator/*) only when the container declares it (GKE docs, "Monitor your TPU nodes": `containerPort:
# 8431`; the TPU manifest of "Configure node auto-provisioning": "Port to export TPU runtime metrics").
# The operator declares it on TPU pods, so the server's own ports must be others.
TPU_METRICS_PORT = 8431

CEL_RULES: dict[type[_Model], list[dict[str, str]]] = {
    ServerSpec: [
        # has(): the API server also checks this rule against the field's default, {}, before defaulting.
        _cel("!has(self.probePort) || !has(self.port) || self.probePort != self.port",
             "spec.server.probePort must differ from spec.server.port", ".probePort"),
        _cel(f"!has(self.port) || self.port != {TPU_METRICS_PORT}",
             f"spec.server.port must not be {TPU_METRICS_PORT}: TPU pods declare it for GKE's TPU metrics", ".port"),
        _cel(f"!has(self.probePort) || self.probePort != {TPU_METRICS_PORT}",
             f"spec.server.probePort must not be {TPU_METRICS_PORT}: TPU pods declare it for GKE's TPU metrics",
             ".probePort"),
    ],
    ModelSpec: [
        _cel(f"self.source.matches(r'{MODEL_SOURCE_RE}')", MODEL_SOURCE_MESSAGE,
             ".source"),
        _cel(f"!has(self.embeddingTwin) || self.embeddingTwin.matches(r'{MODEL_SOURCE_RE}')",
             MODEL_SOURCE_MESSAGE, ".embeddingTwin"),
        _cel(f"!self.source.matches(r'{PARENT_SEGMENT_RE}')", PARENT_SEGMENT_MESSAGE, ".source"),
        _cel(f"!has(self.embeddingTwin) || !self.embeddingTwin.matches(r'{PARENT_SEGMENT_RE}')",
             PARENT_SEGMENT_MESSAGE, ".embeddingTwin"),
    ],
    EngineSpec: [
        _cel("!has(self.speculative) || !has(self.speculative.method) || self.speculative.method != 'mtp' || "
             "!has(self.tensorParallelSize) || self.tensorParallelSize == 1", DRAFTER_TP_MESSAGE,
             ".tensorParallelSize"),
    ],
    SpeculativeSpec: [
        _cel(f"!has(self.source) || self.source.matches(r'{MODEL_SOURCE_RE}')", MODEL_SOURCE_MESSAGE, ".source"),
        _cel(f"!has(self.source) || !self.source.matches(r'{PARENT_SEGMENT_RE}')", PARENT_SEGMENT_MESSAGE,
             ".source"),
        # has(): method has a default, and the rule is also checked before defaulting.
        _cel("(has(self.method) && self.method == 'mtp') == has(self.source)", SPECULATIVE_SOURCE_MESSAGE,
             ".source"),
    ],
    ResourcesSpec: [
        _cel("!has(self.limits) || !('google.com/tpu' in self.limits)",
             "spec.resources.limits must not set google.com/tpu: the operator derives it from "
             "spec.accelerator.topology", ".limits"),
        _cel("!has(self.requests) || !('google.com/tpu' in self.requests)",
             "spec.resources.requests must not set google.com/tpu: the operator derives it from "
             "spec.accelerator.topology", ".requests"),
    ],
    AutoscalingSpec: [
        _cel("self.minReplicas <= self.maxReplicas",
             "spec.autoscaling.minReplicas must not exceed spec.autoscaling.maxReplicas", ".minReplicas"),
        _cel("self.provider != 'KEDA' || self.minReplicas == 0 || "
             "(has(self.prometheus) && has(self.prometheus.serverAddress))",
             "spec.autoscaling.provider KEDA queries Prometheus: set spec.autoscaling.prometheus.serverAddress, "
             "or use provider HPA", ".prometheus"),
        # has(): minReplicas has a default, and the rule is also checked before defaulting.
        _cel("!has(self.minReplicas) || self.minReplicas > 0 || self.provider != 'HPA'",
             "spec.autoscaling.minReplicas 0 needs KEDA (an HPA cannot wake a server from zero: with no pod "
             "there is no Pods metric): set spec.autoscaling.provider to KEDA or Auto", ".minReplicas"),
        _cel("self.metric != 'kvCacheUsage' || self.target <= 1.0",
             "spec.autoscaling.target for kvCacheUsage is a fraction of the KV cache (0 to 1), e.g. 0.8",
             ".target"),
    ],
    GatewaySpec: [
        # has(): the API server also checks this rule against the field's default, {}, before defaulting.
        _cel("!has(self.inferencePool) || !self.inferencePool || has(self.endpointPicker)",
             "spec.gateway.inferencePool names an endpoint picker: set spec.gateway.endpointPicker.name "
             "(the picker's Service)", ".endpointPicker"),
    ],
    AcceleratorSpec: [
        _cel("self.type != 'cpu' || !has(self.topology)",
             "spec.accelerator.topology applies to TPUs only: remove it, or set spec.accelerator.type to "
             "tpu-v5-lite-podslice or tpu-v6e-slice", ".topology"),
        _cel("!has(self.computeClass) || self.provisioning == 'standard'",
             "spec.accelerator.computeClass decides provisioning itself: leave spec.accelerator.provisioning "
             "at standard, or remove computeClass", ".provisioning"),
    ],
}


# spec.engine.tensorParallelSize against the slice (a CEL rule below, and GemmaRustServerSpec's own check).
TP_ON_CPU_MESSAGE = ("spec.engine.tensorParallelSize applies to TPUs only: remove it, or set spec.accelerator.type "
                     "to tpu-v5-lite-podslice or tpu-v6e-slice")
TP_DIVIDES_MESSAGE = ("spec.engine.tensorParallelSize must divide the slice's chips (" + ", ".join(
    f"{t}: {c}" for t, c in SINGLE_HOST_CHIPS.items()) + "): set a divisor of them, or leave it unset for the "
    "operator to choose")
_CEL_CHIPS = "{" + ", ".join(f"'{t}': {c}" for t, c in SINGLE_HOST_CHIPS.items()) + "}"


class GemmaRustServerSpec(_Model):
    """spec of a GemmaRustServer: one model served by `replicas` single-host pods."""

    model: ModelSpec = Field(description="The checkpoint to serve.")
    accelerator: AcceleratorSpec = Field(default_factory=AcceleratorSpec,
                                         description="Where the pods run.")
    replicas: int = Field(1, description="Number of server pods (scale subresource).", ge=0, le=256)
    image: str = Field(DEFAULT_IMAGE, description="Server image (entrypoint: python -m gemma_server).",
                       min_length=1, max_length=512)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        None, description="Image pull policy; the Kubernetes default when unset.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine settings.")
    server: ServerSpec = Field(default_factory=ServerSpec, description="HTTP server settings.")
    build_cache: BuildCacheSpec = Field(default_factory=BuildCacheSpec,
                                        description="Where the compiled engine is cached.")
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec, description="Metrics scraping.")
    autoscaling: AutoscalingSpec | None = Field(
        None, description="Scale on the server's queue; while set, the autoscaler writes spec.replicas (scale "
        "subresource) and the Deployment follows it, within minReplicas..maxReplicas.")
    gateway: GatewaySpec = Field(default_factory=GatewaySpec,
                                 description="Gateway API inference extension.")
    resources: ResourcesSpec = Field(
        default_factory=lambda: ResourcesSpec(),
        description="Container resources, passed through. google.com/tpu is set from the topology.")
    node_selector: dict[str, str] = Field(default_factory=dict,
                                          description="Extra node selector labels, passed through.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list,
                                              description="Extra tolerations, passed through.")
    pod_annotations: dict[str, str] = Field(default_factory=dict,
                                            description="Annotations added to the pods, passed through.")
    service_account_name: str | None = Field(
        None, description="ServiceAccount of the pods; for gs:// sources, the Kubernetes ServiceAccount that "
        "Workload Identity grants roles/storage.objectViewer on the bucket. Unset: the namespace's default.",
        pattern=DNS_SUBDOMAIN_RE, max_length=253)

    @model_validator(mode="after")
    def _tensor_parallel_size_fits_the_slice(self) -> "GemmaRustServerSpec":
        # The CEL rules' check, for objects stored before they existed (see ModelSpec._source_form).
        n = self.engine.tensor_parallel_size
        if n is not None and self.accelerator.type == CPU:
            raise ValueError(TP_ON_CPU_MESSAGE)
        if n is not None and SINGLE_HOST_CHIPS[self.accelerator.topology or "1x1"] % n:
            raise ValueError(TP_DIVIDES_MESSAGE)
        return self


CEL_RULES[GemmaRustServerSpec] = [
    _cel("!has(self.engine.tensorParallelSize) || self.accelerator.type != 'cpu'", TP_ON_CPU_MESSAGE,
         ".engine.tensorParallelSize"),
    _cel("!has(self.engine.tensorParallelSize) || self.accelerator.type == 'cpu' || "
         f"{_CEL_CHIPS}[has(self.accelerator.topology) ? self.accelerator.topology : '1x1'] "
         "% self.engine.tensorParallelSize == 0", TP_DIVIDES_MESSAGE, ".engine.tensorParallelSize"),
    _cel("!has(self.autoscaling) || self.autoscaling.minReplicas > 0 || !self.gateway.inferencePool || "
         "(has(self.autoscaling.prometheus) && has(self.autoscaling.prometheus.serverAddress))",
         "spec.autoscaling.minReplicas 0 behind an InferencePool is woken by the endpoint picker's queue, which "
         "KEDA reads from Prometheus: set spec.autoscaling.prometheus.serverAddress", ".autoscaling.prometheus"),
    _cel("self.buildCache.type != 'pvc' || self.buildCache.accessMode != 'ReadWriteOnce' || self.replicas <= 1",
         "a ReadWriteOnce build cache PVC can serve one replica: set spec.buildCache.accessMode to "
         "ReadWriteMany, spec.buildCache.type to emptyDir, or spec.replicas to 1", ".buildCache.accessMode"),
    _cel("self.buildCache.type != 'pvc' || self.buildCache.accessMode != 'ReadWriteOnce' || "
         "!has(self.autoscaling) || self.autoscaling.maxReplicas <= 1",
         "a ReadWriteOnce build cache PVC can serve one replica: set spec.buildCache.accessMode to "
         "ReadWriteMany, spec.buildCache.type to emptyDir, or spec.autoscaling.maxReplicas to 1",
         ".buildCache.accessMode"),
]


# The server's own name, checked at the root of the CRD's schema: a rule there may read metadata.name (Kubernetes
# docs, "Extend the Kubernetes API with CustomResourceDefinitions", Validation rules: a rule scoped to the root
# may select apiVersion, kind, metadata.name and metadata.generateName). The API server alone holds a custom
# resource's name to a DNS-1123 subdomain, which may have dots; but the name is also the Service's, which must be
# a DNS-1035 label, and with the namespace it makes the host names the KEDA HTTP add-on's interceptor routes for
# the whole cluster (builders.autoscaling.service_hosts), where a dot would let `a.b` in namespace `svc` claim the
# host `a.b.svc` of server `a` in namespace `b`.
NAME_MESSAGE = ("metadata.name must be a DNS-1035 label, as the server's Service name is: at most 63 lower-case "
                "letters, digits and '-', starting with a letter and ending with a letter or digit (no dots), "
                "e.g. gemma-4-e2b")
NAME_RULES = [
    _cel(f"size(self.metadata.name) <= 63 && self.metadata.name.matches(r'{DNS_1035_LABEL_RE}')", NAME_MESSAGE),
]


def parse_spec(spec: dict[str, Any]) -> GemmaRustServerSpec:
    """Parse a custom resource's spec (as stored, camelCase) into the typed model.

    Args:
        spec: the `spec` mapping of a GemmaRustServer.
    Returns:
        The typed spec with defaults filled in.
    Raises:
        pydantic.ValidationError: the spec does not fit the schema (only possible when the stored object
            predates a schema change, since admission applies the same schema).
    """
    return GemmaRustServerSpec.model_validate(dict(spec))


def is_tpu(accel: AcceleratorSpec) -> bool:
    """A TPU type the operator knows (an unknown accelerator is neither TPU nor CPU to the builders)."""
    return accel.type in TPU_TOPOLOGY_CHIPS


def chips(accel: AcceleratorSpec) -> int:
    """TPU chips one pod requests (0 on CPU or on an accelerator the operator does not know)."""
    if not is_tpu(accel):
        return 0
    return TPU_TOPOLOGY_CHIPS[accel.type][accel.topology or "1x1"]


def accelerator_text(accel: AcceleratorSpec) -> str:
    """Short accelerator description for `kubectl get` (e.g. "v5e 2x2", "v6e 2x4", "cpu")."""
    if is_tpu(accel):
        return f"{TPU_NAMES[accel.type]} {accel.topology or '1x1'}"
    return accel.type
