"""The Deployment that runs a GemmaRustServer's pods: scheduling, the server's environment, probes, volumes
and the shutdown plan (pure).

Where the choices come from:
- TPU scheduling: GKE's node labels `cloud.google.com/gke-tpu-accelerator` / `-topology`, the
  `google.com/tpu` extended resource (requests = limits = the slice's chips) and the `google.com/tpu=present:
  NoSchedule` taint GKE puts on TPU nodes; spot / flex-start / ComputeClass node selectors.
- Strategy Recreate on TPU: a rolling update's new pod waits for chips the old pod holds, forever
  (sglang-jax's GKE guide, production-stack PR #103).
- Probe budget: startupProbe failureThreshold = ceil(startupTimeout / period) rather than a large
  initialDelay (tt-inference-server#4870), so liveness cannot kill a pod that is still compiling.
- GCS FUSE: the CSI driver `gcsfuse.csi.storage.gke.io` plus the pod annotation `gke-gcsfuse/volumes`, with a
  bounded file cache on the sidecar's `gke-gcsfuse-cache` volume (GcsFuseSpec in spec.py says where from).
- Capacity classes: `standard` pods require nodes that are neither spot, flex-start nor preemptible
  (node_affinity); on spot and flex-start the preStop and drain fit the grace GKE gives a reclaimed node's
  pods (shutdown_plan).
- /dev/shm: TPU pods mount an in-memory emptyDir there, as Google's TPU serving samples do
  (GoogleCloudPlatform/kubernetes-engine-samples, ai-ml/gke-ray/rayserve/llm/tpu/ray-cluster.tpu-v6e-multihost.yaml).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from kubernetes.utils import parse_quantity

from ..memory import placement
from ..spec import TPU_METRICS_PORT, GcsFuseSpec, GemmaRustServerSpec, MediaSpec, SpeculativeSpec, chips, is_tpu
from .autoscaler import Autoscaling, chosen_where_all_served
from .build_cache import build_cache_volume
from .ownership import Meta, child_object, labels, selector_labels
from .service import service_host

CONTAINER = "server"  # the server container's name, by which gemma_operator.pods finds its status

TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"
# Node labels of reclaimable capacity, each "true" on such nodes: Spot VMs
# (https://cloud.google.com/kubernetes-engine/docs/how-to/autopilot-spot-pods, "cloud.google.com/gke-spot=true"),
# flex-start VMs (https://cloud.google.com/kubernetes-engine/docs/how-to/dws-flex-start-training-tpu, the
# workload's nodeSelector "cloud.google.com/gke-flex-start: true") and legacy preemptible VMs (the Spot Pods
# page: the "cloud.google.com/gke-preemptible" selector).
SPOT_LABEL = "cloud.google.com/gke-spot"
FLEX_START_LABEL = "cloud.google.com/gke-flex-start"
PREEMPTIBLE_LABEL = "cloud.google.com/gke-preemptible"
RECLAIMABLE_LABELS = (SPOT_LABEL, FLEX_START_LABEL, PREEMPTIBLE_LABEL)
COMPUTE_CLASS_LABEL = "cloud.google.com/compute-class"
GCSFUSE_ANNOTATION = "gke-gcsfuse/volumes"
# The GCS FUSE sidecar caches files on a volume of this name when the pod has one
# (https://cloud.google.com/kubernetes-engine/docs/how-to/cloud-storage-fuse-csi-driver-sidecar).
GCSFUSE_CACHE_VOLUME = "gke-gcsfuse-cache"

CACHE_MOUNT = "/var/cache/gemma"
TPU_COMPILE_CACHE = f"{CACHE_MOUNT}/tpu-compile"
# With a PVC build cache, several pods (replicas, or an old and a new pod during a rollout) share it: each
# pod's torch_tpu then writes a directory of its own on this emptyDir, and the server copies complete entries
# between it and the shared one (gemma_server/compile_cache.py).
TPU_COMPILE_LOCAL_MOUNT = "/var/cache/gemma-local"
TPU_COMPILE_LOCAL_SIZE = "10Gi"
TMP_SIZE = "1Gi"
GCS_ROOT = "/gcs"  # gemma_server's default --gcs-root: gs://B/P is read at /gcs/B/P
STARTUP_PERIOD_SECONDS = 10
# Cloud Storage FUSE options for reading a checkpoint once and serving it. The file cache's size is the
# volume attribute fileCacheCapacity (GcsFuseSpec), never unbounded here; the parallel-download tuning is that
# of Google's GKE TPU serving manifests (GoogleCloudPlatform/kubernetes-engine-samples, the ai-ml vLLM-on-TPU
# samples: 100 parallel downloads per file, no overall cap, 10 MB chunks), and the metadata caches never
# expire, as for read-only data (GoogleCloudPlatform/gcs-fuse-csi-driver, test/e2e's mount options): a
# running pod does not see a checkpoint rewritten in place; a new pod does.
GCSFUSE_MOUNT_OPTIONS = ",".join([
    "implicit-dirs",
    "file-cache:enable-parallel-downloads:true",
    "file-cache:parallel-downloads-per-file:100",
    "file-cache:max-parallel-downloads:-1",
    "file-cache:download-chunk-size-mb:10",
    "metadata-cache:ttl-secs:-1",
    "metadata-cache:stat-cache-max-size-mb:-1",
    "metadata-cache:type-cache-max-size-mb:-1",
])


# ---------------------------------------------------------------------------------------------------------
# Model sources -> volumes, mounts and the local path the server reads


class ModelMount(NamedTuple):
    value: str  # what GEMMA_MODEL / GEMMA_EMB receive
    volume: dict[str, Any] | None
    mount: dict[str, Any] | None


def model_mount(source: str, volume_name: str, gcs: GcsFuseSpec = GcsFuseSpec()) -> ModelMount:
    """Map a model URL to what the server container sees (pure).

    hf:// goes to the server as is (it downloads with the token). gs:// also goes as is, and the bucket is
    mounted by the GCS FUSE CSI driver where gemma_server looks for it (`GEMMA_GCS_ROOT`/<bucket>; the
    server waits for the mount). pvc:// is mounted read-only and the server gets the local path.
    """
    scheme, rest = source.split("://", 1)
    if scheme == "hf":
        return ModelMount(source, None, None)
    root, _, path = rest.partition("/")
    if scheme == "gs":
        mount_path = f"{GCS_ROOT}/{root}"
        volume = {"name": volume_name, "csi": {"driver": "gcsfuse.csi.storage.gke.io", "readOnly": True,
                                               "volumeAttributes": {"bucketName": root,
                                                                    "mountOptions": GCSFUSE_MOUNT_OPTIONS,
                                                                    "fileCacheCapacity": file_cache_capacity(gcs)}}}
        value = source
    elif scheme == "pvc":
        mount_path = f"/models/pvc/{root}"
        volume = {"name": volume_name, "persistentVolumeClaim": {"claimName": root, "readOnly": True}}
        value = f"{mount_path}/{path}".rstrip("/")
    else:  # the CRD's CEL rule admits only the three schemes
        raise ValueError(f"unsupported model source scheme {scheme!r} in {source!r}")
    return ModelMount(value, volume, {"name": volume_name, "mountPath": mount_path, "readOnly": True})


def file_cache_capacity(gcs: GcsFuseSpec) -> str:
    """The driver's fileCacheCapacity: a tenth below the cache volume's size, so the cache's own bookkeeping
    never pushes the emptyDir over its sizeLimit (which would evict the pod)."""
    mib = int(parse_quantity(gcs.file_cache_size) * 9 / 10 / 2**20)
    return f"{mib}Mi"


def gcsfuse_cache_volume(gcs: GcsFuseSpec) -> dict[str, Any]:
    empty_dir: dict[str, Any] = {"sizeLimit": gcs.file_cache_size}
    if gcs.file_cache_medium == "Memory":
        empty_dir["medium"] = "Memory"
    return {"name": GCSFUSE_CACHE_VOLUME, "emptyDir": empty_dir}


class Sources(NamedTuple):
    """What the pod reads models from: the checkpoint, its embedding twin, the speculative drafter."""

    main: ModelMount
    twin: ModelMount | None = None
    drafter: ModelMount | None = None

    def present(self) -> list[ModelMount]:
        return [m for m in self if m]


def _model_mounts(spec: GemmaRustServerSpec) -> Sources:
    main = model_mount(spec.model.source, "model", spec.model.gcs_fuse)
    mounted = [main]

    def other(source: str | None, volume_name: str) -> ModelMount | None:
        if source is None:
            return None
        m = model_mount(source, volume_name, spec.model.gcs_fuse)
        # The same bucket or claim is mounted once.
        if m.volume and any(o.volume and o.mount["mountPath"] == m.mount["mountPath"] for o in mounted):
            return ModelMount(m.value, None, None)
        mounted.append(m)
        return m

    speculative = spec.engine.speculative
    twin = other(spec.model.embedding_twin, "model-emb")
    return Sources(main, twin, other(speculative.source if speculative else None, "model-drafter"))


# ---------------------------------------------------------------------------------------------------------
# The pod


def node_selector(spec: GemmaRustServerSpec) -> dict[str, str]:
    """Node labels the pods require: TPU slice, provisioning model, ComputeClass, then the user's."""
    accel = spec.accelerator
    out: dict[str, str] = {}
    if is_tpu(accel):
        out[TPU_ACCELERATOR_LABEL] = accel.type
        out[TPU_TOPOLOGY_LABEL] = accel.topology or "1x1"
    if accel.provisioning == "spot":
        out[SPOT_LABEL] = "true"
    elif accel.provisioning == "flex-start":
        out[FLEX_START_LABEL] = "true"
    if accel.compute_class:
        out[COMPUTE_CLASS_LABEL] = accel.compute_class
    out.update(spec.node_selector)
    return out


def node_affinity(spec: GemmaRustServerSpec) -> dict[str, Any] | None:
    """For `standard` capacity: nodes that are not spot, flex-start or preemptible. Without it a standard pod
    also fits a reclaimable node of the same topology, and is then preempted, or ends with the flex-start VM.
    NotIn also matches a node without the label, which is how GKE's on-demand nodes look. A ComputeClass
    decides provisioning itself, so it gets no affinity."""
    accel = spec.accelerator
    if accel.provisioning != "standard" or accel.compute_class:
        return None
    expressions = [{"key": key, "operator": "NotIn", "values": ["true"]} for key in RECLAIMABLE_LABELS]
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": expressions}]}}}


def sourced_tolerations(spec: GemmaRustServerSpec) -> list[tuple[str, dict[str, Any]]]:
    """Each toleration the pods get, with the spec field it comes from (the operator's allowlist judges these)."""
    out: list[tuple[str, dict[str, Any]]] = []
    if is_tpu(spec.accelerator):
        out.append(("spec.accelerator.type", {"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}))
    if spec.accelerator.provisioning == "spot":
        # Only needed where the spot pool is tainted; harmless elsewhere.
        out.append(("spec.accelerator.provisioning",
                    {"key": SPOT_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"}))
    return out + [(f"spec.tolerations[{i}]", dict(t)) for i, t in enumerate(spec.tolerations)]


def tolerations(spec: GemmaRustServerSpec) -> list[dict[str, Any]]:
    return [t for _, t in sourced_tolerations(spec)]


def container_resources(spec: GemmaRustServerSpec) -> dict[str, Any]:
    requests = {k: str(v) for k, v in (spec.resources.requests or {}).items()}
    limits = {k: str(v) for k, v in (spec.resources.limits or {}).items()}
    n = chips(spec.accelerator)
    if n:
        requests[TPU_RESOURCE] = str(n)
        limits[TPU_RESOURCE] = str(n)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def device(spec: GemmaRustServerSpec) -> str:
    return "tpu" if is_tpu(spec.accelerator) else "cpu"


def mcp_hosts(meta: Meta) -> str:
    """The Host names the server's /mcp answers (its DNS-rebinding protection): loopback, and the Service's
    in-cluster names (Kubernetes' DNS for Services: <service>, <service>.<namespace>, ...svc, ...svc.cluster.local)."""
    svc = f"{meta.name}.{meta.namespace}"
    return ",".join(["localhost", "127.0.0.1", meta.name, svc, f"{svc}.svc", service_host(meta)])


def media_env(media: MediaSpec) -> list[dict[str, str]]:
    """The server's media limits that the spec sets (the rest keep the server's defaults, gemma_server/config.py)."""
    values = {
        "GEMMA_MAX_IMAGES_PER_REQUEST": media.max_images_per_request,
        "GEMMA_MAX_IMAGE_PIXELS": media.max_image_pixels,
        "GEMMA_MAX_AUDIO_SECONDS": media.max_audio_seconds,
        "GEMMA_MAX_MEDIA_BYTES": media.max_media_bytes,
        "GEMMA_MEDIA_FETCH_HOSTS": ",".join(media.fetch_hosts) or None,
        "GEMMA_MEDIA_FETCH_TIMEOUT": media.fetch_timeout_seconds,
    }
    return [{"name": k, "value": str(v)} for k, v in values.items() if v is not None]


def speculative_env(s: SpeculativeSpec | None, drafter: ModelMount | None = None) -> list[dict[str, str]]:
    """spec.engine.speculative as the server's GEMMA_SPECULATIVE_* variables (the drafter as `drafter` mounts
    it); none when it is off, and an unset maxBatch leaves the server's default."""
    if s is None:
        return []
    values = {"GEMMA_SPECULATIVE_METHOD": s.method, "GEMMA_NUM_SPECULATIVE_TOKENS": s.num_speculative_tokens,
              "GEMMA_SPECULATIVE_MAX_BATCH": s.max_batch, "GEMMA_SPECULATIVE_MODEL": drafter and drafter.value}
    return [{"name": k, "value": str(v)} for k, v in values.items() if v is not None]


def env(spec: GemmaRustServerSpec, meta: Meta, sources: Sources) -> list[dict[str, Any]]:
    """The server's environment (its documented GEMMA_* variables); the token and API key only via secretKeyRef."""
    e, srv, n_chips = spec.engine, spec.server, chips(spec.accelerator)
    out = [
        {"name": "GEMMA_MODEL", "value": sources.main.value},
        *([{"name": "GEMMA_EMB", "value": sources.twin.value}] if sources.twin else []),
        {"name": "GEMMA_DEVICE", "value": device(spec)},
        # The slice's chips, over which the server runs chips / GEMMA_TENSOR_PARALLEL_SIZE engines of that many
        # chips each (gemma_operator.memory picks the size); both unset on CPU (the server's default, one engine).
        *([{"name": "GEMMA_DEVICES", "value": str(n_chips)},
           {"name": "GEMMA_TENSOR_PARALLEL_SIZE", "value": str(placement(spec).tensor_parallel_size)}]
          if n_chips else []),
        {"name": "GEMMA_CONTEXT", "value": str(e.context)},
        {"name": "GEMMA_MAX_NUM_SEQS", "value": str(e.max_num_seqs)},
        {"name": "GEMMA_PREFILL_CHUNK", "value": str(e.prefill_chunk)},
        {"name": "GEMMA_READ_EVERY", "value": str(e.read_every)},
        {"name": "GEMMA_DTYPE", "value": e.dtype},
        {"name": "GEMMA_COMPILE", "value": e.compile},
        *speculative_env(e.speculative, sources.drafter),
        # Inductor's caches (its FX graphs and AOTAutograd's, keyed by the graph) on the build-cache volume, so a
        # restart with --compile loads the compiled steps instead of compiling them again.
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{CACHE_MOUNT}/inductor"},
        *([{"name": "GEMMA_SERVED_MODEL_NAME", "value": srv.served_model_name}] if srv.served_model_name else []),
        {"name": "GEMMA_PORT", "value": str(srv.port)},
        {"name": "GEMMA_PROBE_PORT", "value": str(srv.probe_port)},
        {"name": "GEMMA_MCP_ALLOWED_HOSTS", "value": mcp_hosts(meta)},
        # Unset: the server's own default (gemma_server/config.py), declared there once.
        *([{"name": "GEMMA_QUEUE_LIMIT", "value": str(srv.queue_limit)}] if srv.queue_limit is not None else []),
        *media_env(srv.media),
        {"name": "GEMMA_SHUTDOWN_TIMEOUT", "value": str(shutdown_plan(spec).drain)},
        {"name": "GEMMA_BUILD_CACHE", "value": f"{CACHE_MOUNT}/build"},
        # torch_tpu's persistent compilation cache on the same volume, so a restart loads the compiled
        # programs instead of compiling them again (the server sets TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT).
        *([{"name": "GEMMA_TPU_COMPILE_CACHE", "value": TPU_COMPILE_CACHE}] if device(spec) == "tpu" else []),
        *([{"name": "GEMMA_TPU_COMPILE_CACHE_LOCAL", "value": f"{TPU_COMPILE_LOCAL_MOUNT}/tpu-compile"}]
          if _shared_compile_cache(spec) else []),
        *([{"name": "GEMMA_GCS_ROOT", "value": GCS_ROOT}] if any(
            m.value.startswith("gs://") for m in sources.present()) else []),
        # Downloaded hf:// weights live next to the build, so a restarted pod on a PVC skips both.
        {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/hf"},
        {"name": "TORCH_TPU_DEFER_AND_FUSE", "value": "1" if e.defer_and_fuse else "0"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if spec.model.token_secret:
        ref = spec.model.token_secret
        out.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    if srv.api_key_secret:
        ref = srv.api_key_secret
        out.append({"name": "GEMMA_API_KEY", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return out


def probes(spec: GemmaRustServerSpec) -> dict[str, Any]:
    """startup (covers build, smoke test, weights, warmup), readiness on /health, liveness on /live, all on
    the server's probe listener (GEMMA_PROBE_PORT), where no client's load reaches them."""
    def get(path: str) -> dict[str, Any]:
        return {"path": path, "port": "probes"}

    return {
        "startupProbe": {"httpGet": get("/health"), "periodSeconds": STARTUP_PERIOD_SECONDS,
                         "timeoutSeconds": 5,
                         "failureThreshold": math.ceil(spec.server.startup_timeout_seconds / STARTUP_PERIOD_SECONDS)},
        "readinessProbe": {"httpGet": get("/health"), "periodSeconds": 5, "timeoutSeconds": 3,
                           "failureThreshold": 3},
        "livenessProbe": {"httpGet": get("/live"), "periodSeconds": 10, "timeoutSeconds": 5,
                          "failureThreshold": 6},
    }


# After a Spot VM's preemption notice GKE gives pods 15 s to shut down, best effort (the first half of 30 s;
# the second is for system pods): https://cloud.google.com/kubernetes-engine/docs/concepts/spot-vms,
# "Termination and graceful shutdown of Spot VMs". Flex-start VMs are reclaimed too (at the latest after
# seven days, https://cloud.google.com/kubernetes-engine/docs/concepts/dws); they get the same budget here.
RECLAIM_GRACE_SECONDS = 15


class ShutdownPlan(NamedTuple):
    prestop: int  # seconds the preStop hook sleeps, so endpoints drop the pod before SIGTERM
    drain: int    # the server's --shutdown-timeout
    grace: int    # terminationGracePeriodSeconds: preStop + drain + time to exit


def reclaimable(spec: GemmaRustServerSpec) -> bool:
    return spec.accelerator.provisioning in ("spot", "flex-start")


def shutdown_plan(spec: GemmaRustServerSpec) -> ShutdownPlan:
    """preStop, drain and grace for the capacity class. On spot and flex-start the defaults fit the
    RECLAIM_GRACE_SECONDS a reclaimed node gives (2 + 10 + 3 = 15); elsewhere the drain is unhurried and the
    grace is longer than preStop + drain, so SIGKILL never cuts a drain short."""
    if reclaimable(spec):
        prestop, default_drain, margin = 2, 10, 3
    else:
        prestop, default_drain, margin = 5, 30, 15
    drain = spec.server.shutdown_timeout_seconds or default_drain
    return ShutdownPlan(prestop, drain, prestop + drain + margin)


def spec_warnings(spec: GemmaRustServerSpec) -> list[tuple[str, str]]:
    """(reason, message) for a spec that works but will not do what its author likely expects (pure)."""
    if not reclaimable(spec):
        return []
    kind = spec.accelerator.provisioning
    out = []
    plan = shutdown_plan(spec)
    if plan.grace > RECLAIM_GRACE_SECONDS:
        out.append(("DrainExceedsReclaimGrace",
                    f"spec.server.shutdownTimeoutSeconds {plan.drain} s plus the {plan.prestop} s preStop does not "
                    f"fit the {RECLAIM_GRACE_SECONDS} s GKE gives pods on a {kind} node that is reclaimed: "
                    f"requests still running then are cut; set it to {RECLAIM_GRACE_SECONDS - plan.prestop - 3} or "
                    "less (it only bounds the drain of a reclaimed pod; rollouts honour it)"))
    if spec.build_cache.type == "emptyDir":
        also = " and torch_tpu's programs (boot stage warmup)" if device(spec) == "tpu" else ""
        out.append(("EphemeralBuildCache",
                    f"spec.buildCache.type emptyDir on {kind} capacity: every reclaimed or restarted pod compiles "
                    f"the engine again (boot stage build){also}; set spec.buildCache.type: pvc to keep the build"))
    return out


def _gcsfuse(sources: Sources) -> bool:
    """Whether the pod mounts a bucket through the GCS FUSE CSI driver."""
    return any(m.volume and "csi" in m.volume for m in sources.present())


def pod_annotations(spec: GemmaRustServerSpec, sources: Sources) -> dict[str, str]:
    out = dict(spec.pod_annotations)
    if _gcsfuse(sources):
        out[GCSFUSE_ANNOTATION] = "true"
    return out


def _shared_compile_cache(spec: GemmaRustServerSpec) -> bool:
    """Whether pods share torch_tpu's compilation cache: a TPU pod whose build cache is a PVC."""
    return device(spec) == "tpu" and spec.build_cache.type == "pvc"


def extra_volumes(spec: GemmaRustServerSpec, sources: Sources) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The GCS FUSE cache volume (for gs:// sources), /dev/shm (TPU) and the pod's own compilation cache
    (`_shared_compile_cache`): (volumes, server mounts)."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if _gcsfuse(sources):
        volumes.append(gcsfuse_cache_volume(spec.model.gcs_fuse))  # the sidecar mounts it, not the server
    if is_tpu(spec.accelerator):
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if _shared_compile_cache(spec):
        volumes.append({"name": "tpu-compile-local", "emptyDir": {"sizeLimit": TPU_COMPILE_LOCAL_SIZE}})
        mounts.append({"name": "tpu-compile-local", "mountPath": TPU_COMPILE_LOCAL_MOUNT})
    return volumes, mounts


def build_deployment(spec: GemmaRustServerSpec, meta: Meta, scaling: Autoscaling | None = None) -> dict[str, Any]:
    """The Deployment running the server pods.

    Args:
        spec: the typed spec.
        meta: the custom resource's name and namespace.
        scaling: the autoscaler chosen (builders.autoscaler.choose), whose bounds hold the replicas; by default the
            one a cluster that serves every optional kind gives.
    Returns:
        A Deployment manifest (dict), without owner references (ownership.adopt adds them).
    """
    sources = _model_mounts(spec)
    plan = shutdown_plan(spec)
    more_volumes, more_mounts = extra_volumes(spec, sources)
    # The root filesystem is read-only; the compilers of the boot build (g++, rustc) get a scratch /tmp.
    tmp = {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}}
    volumes = ([build_cache_volume(spec, meta), tmp] + [m.volume for m in sources.present() if m.volume]
               + more_volumes)
    mounts = ([{"name": "build-cache", "mountPath": CACHE_MOUNT}, {"name": "tmp", "mountPath": "/tmp"}]
              + [m.mount for m in sources.present() if m.mount] + more_mounts)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "command": ["python", "-m", "gemma_server"],
        "env": env(spec, meta, sources),
        "ports": [{"name": "http", "containerPort": spec.server.port, "protocol": "TCP"},
                  {"name": "probes", "containerPort": spec.server.probe_port, "protocol": "TCP"},
                  # GKE exports TPU duty cycle and HBM usage only for a container that declares this port.
                  *([{"name": "tpu-metrics", "containerPort": TPU_METRICS_PORT, "protocol": "TCP"}]
                    if device(spec) == "tpu" else [])],
        **probes(spec),
        "lifecycle": {"preStop": {"sleep": {"seconds": plan.prestop}}},
        "resources": container_resources(spec),
        "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "nodeSelector": node_selector(spec),
        "tolerations": tolerations(spec),
        "volumes": volumes,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "terminationGracePeriodSeconds": plan.grace,
        "enableServiceLinks": False,
    }
    affinity = node_affinity(spec)
    if affinity:
        pod_spec["affinity"] = affinity
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    tpu = is_tpu(spec.accelerator)
    # Recreate where a new pod cannot start beside the old one: the only TPU chips, or a build cache
    # volume that attaches to one node at a time.
    recreate = tpu or (spec.build_cache.type == "pvc" and spec.build_cache.access_mode == "ReadWriteOnce")
    dep = child_object("apps/v1", "Deployment", meta.name, meta)
    dep["spec"] = {
        "replicas": replicas(spec, scaling),
        "selector": {"matchLabels": selector_labels(meta)},
        "strategy": {"type": "Recreate"} if recreate else
                    {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "revisionHistoryLimit": 3,
        # Booting can take the whole startup budget; do not let the Deployment call it stalled earlier.
        "progressDeadlineSeconds": spec.server.startup_timeout_seconds + 600,
        "template": {
            "metadata": {"labels": labels(meta), "annotations": pod_annotations(spec, sources)},
            "spec": pod_spec,
        },
    }
    return dep


def replicas(spec: GemmaRustServerSpec, scaling: Autoscaling | None = None) -> int:
    """The Deployment's replicas: spec.replicas, which the scale subresource exposes and, while spec.autoscaling
    is set, the autoscaler writes, within the bounds of the autoscaler chosen (`scaling`, as in build_deployment;
    Autoscaling.replicas)."""
    return (scaling or chosen_where_all_served(spec)).replicas(spec.replicas)


def claims(deployment: dict[str, Any]) -> set[str]:
    """The PersistentVolumeClaims a Deployment's pods mount."""
    volumes = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("volumes") or []
    return {v["persistentVolumeClaim"].get("claimName") for v in volumes if v.get("persistentVolumeClaim")}
