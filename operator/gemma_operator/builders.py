"""Pure builders: a GemmaRustServer (typed spec + metadata) -> the Kubernetes objects it owns.

Every function here is deterministic: no clock, no uuid, no API call. The handlers (handlers.py) call them,
adopt the results (owner references) and apply them with server-side apply; unit tests compare their output
with golden dicts (tests/operator/test_builders.py).

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

import hashlib
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, NamedTuple

from kubernetes.utils import parse_quantity

from .spec import API_GROUP, API_VERSION, AUTOSCALING_METRICS, KIND, TPU_V5E, GcsFuseSpec, GemmaRustServerSpec, \
    chips

FIELD_MANAGER = "gemma-rust-operator"
CONTAINER = "server"
MANAGED_BY = "gemma-rust-operator"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_SERVER = "gemmarust.dev/server"

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
TMP_SIZE = "1Gi"
GCS_ROOT = "/gcs"  # gemma_server's default --gcs-root: gs://B/P is read at /gcs/B/P
STARTUP_PERIOD_SECONDS = 10
# The file cache's size is the volume attribute fileCacheCapacity (GcsFuseSpec); these only tune it.
GCSFUSE_MOUNT_OPTIONS = "implicit-dirs,file-cache:enable-parallel-downloads:true"


class Meta(NamedTuple):
    """The parts of the custom resource's metadata the builders use, and what the handlers found about them."""

    name: str
    namespace: str
    uid: str = ""  # the build cache claim's name carries it (build_cache_claim_name)
    # The build cache claim is the one an earlier version named <name>-build-cache, and this server is its
    # controller (handlers read it before building): it is kept, so an upgrade does not lose the build.
    legacy_build_cache: bool = False


def selector_labels(meta: Meta) -> dict[str, str]:
    """Labels that select this server's pods; they never change over the object's life."""
    return {LABEL_NAME: "gemma-rust-server", LABEL_INSTANCE: meta.name}


def labels(meta: Meta) -> dict[str, str]:
    """Labels on every child object."""
    return {
        **selector_labels(meta),
        LABEL_COMPONENT: "model-server",
        LABEL_PART_OF: "gemma-rust-operator",
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_SERVER: meta.name,
    }


def selector_string(meta: Meta) -> str:
    """The pod selector as the scale subresource's `status.selector` string."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(meta).items()))


def endpoint(spec: GemmaRustServerSpec, meta: Meta) -> str:
    """The in-cluster OpenAI base URL (what an openai client takes as base_url)."""
    return f"http://{meta.name}.{meta.namespace}.svc.cluster.local:{spec.server.port}/v1"


BUILD_CACHE_SUFFIX = "-build-cache"
UID_CHARS = 8
NAME_LIMIT = 63  # a DNS label, so the claim's name fits wherever an object name must be one


def legacy_build_cache_claim_name(meta: Meta) -> str:
    """The build cache claim's name before it carried the uid: any GemmaRustServer's author could pick it, and
    so name an existing claim of someone else's."""
    return f"{meta.name}{BUILD_CACHE_SUFFIX}"


def build_cache_claim_name(meta: Meta) -> str:
    """The build cache claim: <name>-build-cache-<first 8 characters of the server's uid>, the name cut so the
    whole fits 63 characters. The author of a GemmaRustServer chooses its name but not its uid, which the API
    server assigns, so the name cannot be aimed at an existing claim (handlers also refuse to mount a claim of
    this name that is not the server's own). The legacy name is kept where this server owns that claim.

    Raises:
        ValueError: `meta` has no uid.
    """
    if meta.legacy_build_cache:
        return legacy_build_cache_claim_name(meta)
    if not meta.uid:
        raise ValueError(f"the build cache claim of {meta.name} is named after its uid: Meta.uid is empty")
    suffix = f"{BUILD_CACHE_SUFFIX}-{meta.uid[:UID_CHARS]}"
    return meta.name[:NAME_LIMIT - len(suffix)].rstrip(".-") + suffix


def _object(api_version: str, kind: str, name: str, meta: Meta) -> dict[str, Any]:
    return {"apiVersion": api_version, "kind": kind,
            "metadata": {"name": name, "namespace": meta.namespace, "labels": labels(meta)}}


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


def _model_mounts(spec: GemmaRustServerSpec) -> tuple[ModelMount, ModelMount | None]:
    main = model_mount(spec.model.source, "model", spec.model.gcs_fuse)
    twin = None
    if spec.model.embedding_twin:
        twin = model_mount(spec.model.embedding_twin, "model-emb", spec.model.gcs_fuse)
        # The same bucket or claim is mounted once.
        if twin.volume and main.volume and twin.mount["mountPath"] == main.mount["mountPath"]:
            twin = ModelMount(twin.value, None, None)
    return main, twin


# ---------------------------------------------------------------------------------------------------------
# Deployment


def node_selector(spec: GemmaRustServerSpec) -> dict[str, str]:
    """Node labels the pods require: TPU slice, provisioning model, ComputeClass, then the user's."""
    accel = spec.accelerator
    out: dict[str, str] = {}
    if accel.type == TPU_V5E:
        out[TPU_ACCELERATOR_LABEL] = TPU_V5E
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
    if spec.accelerator.type == TPU_V5E:
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
    return "tpu" if spec.accelerator.type == TPU_V5E else "cpu"


def env(spec: GemmaRustServerSpec, main: ModelMount, twin: ModelMount | None) -> list[dict[str, Any]]:
    """The server's environment (its documented GEMMA_* variables); the token and API key only via secretKeyRef."""
    e, srv, n_chips = spec.engine, spec.server, chips(spec.accelerator)
    out = [
        {"name": "GEMMA_MODEL", "value": main.value},
        *([{"name": "GEMMA_EMB", "value": twin.value}] if twin else []),
        {"name": "GEMMA_DEVICE", "value": device(spec)},
        # One engine per chip of the slice; unset on CPU (the server's default, one engine).
        *([{"name": "GEMMA_DEVICES", "value": str(n_chips)}] if n_chips else []),
        {"name": "GEMMA_CONTEXT", "value": str(e.context)},
        {"name": "GEMMA_MAX_NUM_SEQS", "value": str(e.max_num_seqs)},
        {"name": "GEMMA_PREFILL_CHUNK", "value": str(e.prefill_chunk)},
        {"name": "GEMMA_READ_EVERY", "value": str(e.read_every)},
        {"name": "GEMMA_DTYPE", "value": e.dtype},
        *([{"name": "GEMMA_SERVED_MODEL_NAME", "value": srv.served_model_name}] if srv.served_model_name else []),
        {"name": "GEMMA_PORT", "value": str(srv.port)},
        {"name": "GEMMA_PROBE_PORT", "value": str(srv.probe_port)},
        {"name": "GEMMA_QUEUE_LIMIT", "value": str(srv.queue_limit)},
        {"name": "GEMMA_SHUTDOWN_TIMEOUT", "value": str(shutdown_plan(spec).drain)},
        {"name": "GEMMA_BUILD_CACHE", "value": f"{CACHE_MOUNT}/build"},
        # torch_tpu's persistent compilation cache on the same volume, so a restart loads the compiled
        # programs instead of compiling them again (the server sets TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT).
        *([{"name": "GEMMA_TPU_COMPILE_CACHE", "value": TPU_COMPILE_CACHE}] if device(spec) == "tpu" else []),
        *([{"name": "GEMMA_GCS_ROOT", "value": GCS_ROOT}] if any(
            m and m.value.startswith("gs://") for m in (main, twin)) else []),
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


def build_cache_volume(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any]:
    bc = spec.build_cache
    if bc.type == "pvc":
        return {"name": "build-cache", "persistentVolumeClaim": {"claimName": build_cache_claim_name(meta)}}
    return {"name": "build-cache", "emptyDir": {"sizeLimit": bc.size}}


def _gcsfuse(main: ModelMount, twin: ModelMount | None) -> bool:
    """Whether the pod mounts a bucket through the GCS FUSE CSI driver."""
    return any(m and m.volume and "csi" in m.volume for m in (main, twin))


def pod_annotations(spec: GemmaRustServerSpec, main: ModelMount, twin: ModelMount | None) -> dict[str, str]:
    out = dict(spec.pod_annotations)
    if _gcsfuse(main, twin):
        out[GCSFUSE_ANNOTATION] = "true"
    return out


def extra_volumes(spec: GemmaRustServerSpec, main: ModelMount,
                  twin: ModelMount | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The GCS FUSE cache volume (for gs:// sources) and /dev/shm (TPU): (volumes, server mounts)."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if _gcsfuse(main, twin):
        volumes.append(gcsfuse_cache_volume(spec.model.gcs_fuse))  # the sidecar mounts it, not the server
    if spec.accelerator.type == TPU_V5E:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


def build_deployment(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any]:
    """The Deployment running the server pods.

    Args:
        spec: the typed spec.
        meta: the custom resource's name and namespace.
    Returns:
        A Deployment manifest (dict), without owner references (handlers.adopt adds them).
    """
    main, twin = _model_mounts(spec)
    plan = shutdown_plan(spec)
    more_volumes, more_mounts = extra_volumes(spec, main, twin)
    # The root filesystem is read-only; the compilers of the boot build (g++, rustc) get a scratch /tmp.
    tmp = {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}}
    volumes = ([build_cache_volume(spec, meta), tmp] + [m.volume for m in (main, twin) if m and m.volume]
               + more_volumes)
    mounts = ([{"name": "build-cache", "mountPath": CACHE_MOUNT}, {"name": "tmp", "mountPath": "/tmp"}]
              + [m.mount for m in (main, twin) if m and m.mount] + more_mounts)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "command": ["python", "-m", "gemma_server"],
        "env": env(spec, main, twin),
        "ports": [{"name": "http", "containerPort": spec.server.port, "protocol": "TCP"},
                  {"name": "probes", "containerPort": spec.server.probe_port, "protocol": "TCP"}],
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
    tpu = spec.accelerator.type == TPU_V5E
    # Recreate where a new pod cannot start beside the old one: the only TPU chips, or a build cache
    # volume that attaches to one node at a time.
    recreate = tpu or (spec.build_cache.type == "pvc" and spec.build_cache.access_mode == "ReadWriteOnce")
    dep = _object("apps/v1", "Deployment", meta.name, meta)
    dep["spec"] = {
        "replicas": replicas(spec),
        "selector": {"matchLabels": selector_labels(meta)},
        "strategy": {"type": "Recreate"} if recreate else
                    {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "revisionHistoryLimit": 3,
        # Booting can take the whole startup budget; do not let the Deployment call it stalled earlier.
        "progressDeadlineSeconds": spec.server.startup_timeout_seconds + 600,
        "template": {
            "metadata": {"labels": labels(meta), "annotations": pod_annotations(spec, main, twin)},
            "spec": pod_spec,
        },
    }
    return dep


# ---------------------------------------------------------------------------------------------------------
# Other children


def build_service(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any]:
    """ClusterIP Service in front of the pods; its DNS name is the OpenAI base URL's host."""
    svc = _object("v1", "Service", meta.name, meta)
    svc["spec"] = {"type": "ClusterIP", "selector": selector_labels(meta),
                   "ports": [{"name": "http", "port": spec.server.port, "targetPort": "http", "protocol": "TCP"}]}
    return svc


def build_pdb(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any] | None:
    """A PodDisruptionBudget allowing one voluntary eviction at a time, only when replicas > 1 (the
    Deployment's: it follows an autoscaler's spec.replicas too, so the PDB comes and goes with it)."""
    if replicas(spec) <= 1:
        return None
    pdb = _object("policy/v1", "PodDisruptionBudget", meta.name, meta)
    pdb["spec"] = {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(meta)}}
    return pdb


def build_pod_monitoring(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any] | None:
    """GKE managed Prometheus PodMonitoring scraping /metrics, when asked for."""
    if not spec.monitoring.pod_monitoring:
        return None
    return _scrape_monitor("monitoring.googleapis.com/v1", "PodMonitoring", spec, meta)


def build_service_monitor(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any] | None:
    """Prometheus Operator ServiceMonitor scraping /metrics through the Service, when asked for."""
    if not spec.monitoring.service_monitor:
        return None
    return _scrape_monitor("monitoring.coreos.com/v1", "ServiceMonitor", spec, meta)


def _scrape_monitor(api_version: str, kind: str, spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any]:
    """PodMonitoring and ServiceMonitor share this spec shape: a selector and one /metrics endpoint."""
    monitor = _object(api_version, kind, meta.name, meta)
    monitor["spec"] = {"selector": {"matchLabels": selector_labels(meta)},
                       "endpoints": [{"port": "http", "path": "/metrics", "interval": spec.monitoring.interval}]}
    return monitor


def build_build_cache_pvc(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any] | None:
    """The build cache PersistentVolumeClaim, for buildCache.type pvc."""
    bc = spec.build_cache
    if bc.type != "pvc":
        return None
    pvc = _object("v1", "PersistentVolumeClaim", build_cache_claim_name(meta), meta)
    pvc["spec"] = {"accessModes": [bc.access_mode], "resources": {"requests": {"storage": bc.size}}}
    if bc.storage_class_name:
        pvc["spec"]["storageClassName"] = bc.storage_class_name
    return pvc


# ---------------------------------------------------------------------------------------------------------
# Autoscaling and the Gateway API inference extension


def replicas(spec: GemmaRustServerSpec) -> int:
    """The Deployment's replicas: spec.replicas, which the scale subresource exposes and, while
    spec.autoscaling is set, the autoscaler writes. Clamped into minReplicas..maxReplicas, as the
    autoscaler itself would, so the Deployment never leaves that range before the autoscaler's first act."""
    scaling = spec.autoscaling
    if scaling is None:
        return spec.replicas
    return min(max(spec.replicas, scaling.min_replicas), scaling.max_replicas)


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
    are named <deployment>-<replicaset hash>-<suffix>."""
    name = AUTOSCALING_METRICS[spec.autoscaling.metric]
    return f'sum({name}{{namespace="{meta.namespace}",pod=~"{meta.name}-[a-z0-9]+-[a-z0-9]+"}})'


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
    obj = _object("keda.sh/v1alpha1", "ScaledObject", meta.name, meta)
    obj["spec"] = {"scaleTargetRef": _scale_target(meta), "minReplicaCount": scaling.min_replicas,
                   "maxReplicaCount": scaling.max_replicas, "triggers": [trigger]}
    return obj


def build_hpa(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any]:
    """An autoscaling/v2 HorizontalPodAutoscaler on the GemmaRustServer's scale subresource, holding the
    per-pod average of the chosen gauge (a Pods metric, served by a custom-metrics adapter) at target."""
    scaling = spec.autoscaling
    obj = _object("autoscaling/v2", "HorizontalPodAutoscaler", meta.name, meta)
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


def build_inference_pool(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any]:
    """An InferencePool (inference.networking.k8s.io/v1, gateway-api-inference-extension v1.2.0
    config/crd/bases/inference.networking.k8s.io_inferencepools.yaml) selecting this server's pods on the
    server's port, naming the user's endpoint picker."""
    picker = spec.gateway.endpoint_picker
    obj = _object("inference.networking.k8s.io/v1", "InferencePool", meta.name, meta)
    obj["spec"] = {"selector": {"matchLabels": selector_labels(meta)},
                   "targetPorts": [{"number": spec.server.port}],
                   "endpointPickerRef": {"name": picker.name, "group": "", "kind": "Service",
                                         "port": {"number": picker.port}, "failureMode": picker.failure_mode}}
    return obj


# ---------------------------------------------------------------------------------------------------------
# The optional kinds: one table that discovery, building, pruning and conditions read


def _monitoring_on(field: str) -> Callable[[GemmaRustServerSpec], bool]:
    return lambda spec: getattr(spec.monitoring, field)


def _keda_wanted(spec: GemmaRustServerSpec) -> bool:
    scaling = spec.autoscaling
    return scaling is not None and scaling.provider != "HPA" and (
        scaling.provider == "KEDA" or scaling.prometheus.server_address is not None)


def _hpa_wanted(spec: GemmaRustServerSpec) -> bool:
    return spec.autoscaling is not None and spec.autoscaling.provider != "KEDA"


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
    OptionalKind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers", build_hpa,
                 _hpa_wanted, None, "Kubernetes 1.23 or later", SCALING, fallback_for="ScaledObject"),
    OptionalKind("inference.networking.k8s.io/v1", "InferencePool", "inferencepools", build_inference_pool,
                 lambda spec: spec.gateway.inference_pool, "inferencepools.inference.networking.k8s.io",
                 "the Gateway API inference extension", GATEWAY),
)
OPTIONAL_BY_KIND = {row.kind: row for row in OPTIONAL_KINDS}


class Children(NamedTuple):
    apply: list[dict[str, Any]]          # objects to server-side apply, in order
    absent: list[tuple[str, str, str]]   # (apiVersion, kind, name) that must not exist
    skipped: list[tuple[str, str]]       # (kind, why) optional children asked for but not created
    optional: dict[str, list[str]] = {}  # condition -> kinds asked for (created or skipped)
    # (apiVersion, kind, name) of a fallback whose primary kind is now built (an HPA once KEDA's
    # ScaledObject is): deleted on every sync, not only when the spec changes, since both would drive replicas
    replaced: list[tuple[str, str, str]] = []


def build_children(spec: GemmaRustServerSpec, meta: Meta, available: frozenset[str]) -> Children:
    """Everything the custom resource owns, given which optional API groups the cluster serves.

    Args:
        spec: the typed spec.
        meta: name and namespace of the custom resource.
        available: apiVersions (e.g. "monitoring.googleapis.com/v1") the cluster serves, among those in
            OPTIONAL_KINDS.
    Returns:
        Children: what to apply, what to delete if present (`absent` when the spec changes, `replaced`
        always), what was skipped (with why), and which optional kinds each condition reports on.
    """
    apply: list[dict[str, Any]] = []
    absent: list[tuple[str, str, str]] = []
    skipped: list[tuple[str, str]] = []
    optional: dict[str, list[str]] = {}
    pvc = build_build_cache_pvc(spec, meta)
    if pvc:
        apply.append(pvc)
    apply += [build_deployment(spec, meta), build_service(spec, meta)]
    pdb = build_pdb(spec, meta)
    apply.append(pdb) if pdb else absent.append(("policy/v1", "PodDisruptionBudget", meta.name))
    replaced: list[tuple[str, str, str]] = []
    built: set[str] = set()
    for row in OPTIONAL_KINDS:
        stood_in = bool(row.fallback_for and row.fallback_for in built)
        if not row.wanted(spec) or stood_in:
            if row.api_version in available:
                (replaced if stood_in else absent).append((row.api_version, row.kind, meta.name))
            continue
        if row.api_version in available:
            apply.append(row.builder(spec, meta))
            built.add(row.kind)
            optional.setdefault(row.condition, []).append(row.kind)
        elif not any(alt.fallback_for == row.kind and alt.wanted(spec) for alt in OPTIONAL_KINDS):
            skipped.append((row.kind, row.missing()))
            optional.setdefault(row.condition, []).append(row.kind)
    return Children(apply, absent, skipped, optional, replaced)


# ---------------------------------------------------------------------------------------------------------
# Events


def build_event(body: dict[str, Any], type_: str, reason: str, message: str, now: datetime,
                instance: str) -> dict[str, Any]:
    """A core/v1 Event about the custom resource `body`, posted by the operator (pure: the caller gives the
    time and the reporting instance).

    Args:
        body: the custom resource (apiVersion, kind, metadata name/namespace/uid).
        type_: Normal or Warning.
        reason: CamelCase reason.
        message: what happened (cut to the API's 1024 characters).
        now: when, in UTC.
        instance: reportingInstance (the operator pod's name).
    """
    meta = body["metadata"]
    micro = now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    digest = hashlib.sha1(f"{meta.get('uid')}{reason}{message}{micro}".encode()).hexdigest()[:10]
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{digest}", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": body.get("apiVersion", f"{API_GROUP}/{API_VERSION}"),
                           "kind": body.get("kind", KIND), "name": meta["name"],
                           "namespace": meta["namespace"], "uid": meta.get("uid")},
        "type": type_, "reason": reason, "message": message[:1024],
        "source": {"component": MANAGED_BY}, "reportingComponent": MANAGED_BY, "reportingInstance": instance,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }


def foreign(existing: dict[str, Any] | None, owner_uid: str) -> str | None:
    """Why an object that already has a child's name is not that child, or None when it is (or none exists).

    The operator applies with force and prunes by name, so without this check a GemmaRustServer named after
    someone else's Deployment, Service or PVC would take it over, or delete it.
    """
    if existing is None:
        return None
    refs = existing.get("metadata", {}).get("ownerReferences") or []
    controller = next((r for r in refs if r.get("controller")), None)
    if controller is None:
        return "it has no controller"
    if controller.get("uid") != owner_uid:
        return f"its controller is {controller.get('kind', '?')} {controller.get('name', '?')}"
    return None


def claims(deployment: dict[str, Any]) -> set[str]:
    """The PersistentVolumeClaims a Deployment's pods mount."""
    volumes = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("volumes") or []
    return {v["persistentVolumeClaim"].get("claimName") for v in volumes if v.get("persistentVolumeClaim")}


def adopt(child: dict[str, Any], owner: dict[str, Any]) -> dict[str, Any]:
    """Return `child` with a controller owner reference to `owner` (so garbage collection deletes it).

    Args:
        child: a manifest from a builder.
        owner: the custom resource (apiVersion, kind, metadata.name, metadata.uid).
    Returns:
        A new manifest; `child` is not modified.
    """
    ref = {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
           "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
    metadata = {**child["metadata"], "ownerReferences": [ref]}
    return {**child, "metadata": metadata}
