"""Why a server pod is stuck: its Events and container statuses -> a condition reason and message (pure).

Much of what keeps a pod from serving is visible only to the kubelet, which reports it as Events on the pod
(FailedMount, FailedCreatePodSandBox, image pulls) or in the pod's status (a container OOM-killed, a pod
evicted or shut down with its node). status.compute_status shows the scheduler's own message already; this
module turns the rest into a (reason, message) the custom resource carries, so `kubectl get grs` says why:

    blockers(pods, events)   -> {pod name: Blocker} for pods that cannot start or keep crashing
    disruption(pods)         -> Blocker for the newest evicted or reclaimed pod, while its replacement waits

Wording of the messages matched here, and where it comes from:
- the GCS FUSE CSI driver's mount errors, "MountVolume.SetUp failed for volume ... rpc error: code =
  PermissionDenied | NotFound | Unauthenticated desc = failed to get GCS bucket ..."
  (GoogleCloudPlatform/gcs-fuse-csi-driver, docs/troubleshooting.md, "Pod event warnings");
- the kubelet's container waiting reasons CreateContainerConfigError (message `secret "NAME" not found`, or
  `couldn't find key KEY in Secret NS/NAME`), ErrImagePull and ImagePullBackOff with an Event of reason
  "Failed" and message "Failed to pull image ..." (kubernetes pkg/kubelet/images, pkg/kubelet/kubelet_pods.go);
- pod disruption conditions: DisruptionTarget with reason TerminationByKubelet (graceful node shutdown),
  DeletionByPodGC, DeletionByTaintManager, EvictionByEvictionAPI, PreemptionByScheduler
  (https://kubernetes.io/docs/concepts/workloads/pods/disruptions/#pod-disruption-conditions), and the
  status reason "Evicted" of a pod the kubelet evicted under node pressure.

No I/O: handlers.py reads the Events (Kube.pod_events) of the pods `pods_to_explain` names.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from .builders.deployment import CONTAINER as SERVER
from .builders.deployment import FLEX_START_LABEL, SPOT_LABEL
from .pods import (container_status, container_statuses, deleting, meta, pod_status, ready, server_running,
                   server_status, terminal)
from .status import MAX_PODS_IN_STATUS as MAX_PODS_EXPLAINED  # a pod that is not shown is not explained

GCSFUSE_SIDECAR = "gke-gcsfuse-sidecar"  # the container the GCS FUSE CSI driver injects
MAX_MESSAGE = 1024
# Container waiting reasons of a failed image pull, explained by the kubelet's "Failed" Event.
IMAGE_PULL_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName")

# DisruptionTarget reasons that mean the node went away under the pod.
NODE_GONE = {"TerminationByKubelet", "DeletionByPodGC", "DeletionByTaintManager"}


class Blocker(NamedTuple):
    reason: str   # CamelCase condition reason
    message: str  # what happened, and what to do where that is known


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 3] + "..."


def service_account(pod: dict[str, Any]) -> str:
    """The pod's ServiceAccount as NAMESPACE/NAME (Kubernetes' default when the spec names none)."""
    return f"{meta(pod).get('namespace', '')}/{(pod.get('spec') or {}).get('serviceAccountName') or 'default'}"


def _pulling(pod: dict[str, Any]) -> bool:
    return any(((cs.get("state") or {}).get("waiting") or {}).get("reason") in IMAGE_PULL_REASONS
               for cs in container_statuses(pod))


def pods_to_explain(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pods whose Events `pod_blocker` reads, at most MAX_PODS_EXPLAINED of them: alive, not ready, and
    not started or failing an image pull. (A server that started and boots reads none, so a pod that
    compiles its engine for minutes costs no Events request per sync.)"""
    alive = [p for p in pods if not deleting(p) and not terminal(p) and not ready(p)
             and (not server_running(p) or _pulling(p))]
    return sorted(alive, key=lambda p: meta(p).get("name", ""))[:MAX_PODS_EXPLAINED]


# ---------------------------------------------------------------------------------------------------------
# Events


def event_time(event: dict[str, Any]) -> str:
    """Sortable time of an Event's last occurrence (core/v1 lastTimestamp, or events.k8s.io eventTime)."""
    for key in ("lastTimestamp", "eventTime", "firstTimestamp"):
        if event.get(key):
            return str(event[key])[:19]
    return str((event.get("metadata") or {}).get("creationTimestamp") or "")[:19]


def _events_of(pod: dict[str, Any], events: list[dict[str, Any]], reason: str) -> list[dict[str, Any]]:
    """Warning Events of `reason` about this pod (matched by uid), oldest first."""
    uid = meta(pod).get("uid")
    mine = [e for e in events if (e.get("involvedObject") or {}).get("uid") == uid
            and e.get("reason") == reason and e.get("type", "Warning") == "Warning"]
    return sorted(mine, key=event_time)


def _container_of(event: dict[str, Any]) -> str:
    """The container an Event is about, from involvedObject.fieldPath `spec.containers{NAME}`."""
    m = re.search(r"\{(.+)\}", (event.get("involvedObject") or {}).get("fieldPath") or "")
    return m.group(1) if m else ""


def _mount_blocker(pod: dict[str, Any], event: dict[str, Any]) -> Blocker:
    msg = event.get("message") or ""
    gcs = "gcsfuse" in msg or "GCS bucket" in msg
    code = re.search(r"code = (\w+)", msg)
    code = code.group(1) if code else ""
    if gcs and code in ("PermissionDenied", "Unauthenticated"):
        reason = "GcsFusePermissionDenied"
        hint = ("grant it roles/storage.objectViewer on the bucket through Workload Identity (chart README, "
                "\"Workload Identity for gs:// models\")")
    elif gcs and code == "NotFound":
        reason = "GcsFuseBucketNotFound"
        hint = "check the bucket name in spec.model.source"
    else:
        reason = "FailedMount"
        hint = "the kubelet retries the mount"
    return Blocker(reason, _clip(f"{msg} (the pod runs as ServiceAccount {service_account(pod)}; {hint})"))


def _sidecar_blocker(pod: dict[str, Any]) -> Blocker | None:
    cs = container_status(pod, GCSFUSE_SIDECAR)
    if not cs:
        return None
    state = cs.get("state") or {}
    term = state.get("terminated") or (cs.get("lastState") or {}).get("terminated")
    crashing = (state.get("waiting") or {}).get("reason") == "CrashLoopBackOff" or (
        state.get("terminated") and state["terminated"].get("exitCode", 0) != 0)
    if not crashing or not term:
        return None
    why = term.get("reason") or "Error"
    text = (term.get("message") or "").strip()
    hint = "raise the pod annotation gke-gcsfuse/memory-limit" if why == "OOMKilled" else \
        "see `kubectl logs POD -c gke-gcsfuse-sidecar`"
    return Blocker("GcsFuseSidecarFailed", _clip(
        f"container {GCSFUSE_SIDECAR} {why} (exit code {term.get('exitCode')})"
        f"{': ' + text if text else ''}; {hint} (the pod runs as ServiceAccount {service_account(pod)})"))


def _oom_blocker(pod: dict[str, Any]) -> Blocker | None:
    cs = server_status(pod)
    if not cs:
        return None
    state = cs.get("state") or {}
    down = (state.get("waiting") or {}).get("reason") == "CrashLoopBackOff" or state.get("terminated")
    term = state.get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
    if not down or term.get("reason") != "OOMKilled":
        return None
    server = next((c for c in (pod.get("spec") or {}).get("containers") or [] if c.get("name") == SERVER), {})
    limit = ((server.get("resources") or {}).get("limits") or {}).get("memory")
    bound = f"its memory limit {limit}" if limit else "the node's memory (no limit is set)"
    return Blocker("OOMKilled", _clip(
        f"container {SERVER} was killed for exceeding {bound} (exit code {term.get('exitCode', 137)}, "
        f"{cs.get('restartCount', 0)} restarts); raise spec.resources.limits.memory, or use a topology with "
        "more host memory"))


def _config_blocker(pod: dict[str, Any]) -> Blocker | None:
    for cs in container_statuses(pod):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") != "CreateContainerConfigError":
            continue
        msg = waiting.get("message") or ""
        ns = meta(pod).get("namespace", "")
        missing = re.search(r'secret "([^"]+)" not found', msg)
        no_key = re.search(r"couldn't find key (\S+) in Secret (\S+)", msg)
        if missing:
            return Blocker("SecretNotFound", _clip(
                f'Secret "{missing.group(1)}" not found in namespace {ns}: container {cs.get("name")} reads it '
                "through secretKeyRef (spec.model.tokenSecret); create it with the Hugging Face token"))
        if no_key:
            return Blocker("SecretKeyNotFound", _clip(
                f"Secret {no_key.group(2)} has no key {no_key.group(1)}: container {cs.get('name')} reads it "
                "through secretKeyRef (spec.model.tokenSecret.key)"))
        return Blocker("CreateContainerConfigError", _clip(f"container {cs.get('name')}: {msg}"))
    return None


def _image_blocker(pod: dict[str, Any], events: list[dict[str, Any]]) -> Blocker | None:
    for cs in container_statuses(pod):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") not in IMAGE_PULL_REASONS:
            continue
        pulls = [e for e in _events_of(pod, events, "Failed") if (e.get("message") or "").startswith(
            "Failed to pull image") and _container_of(e) in ("", cs.get("name"))]
        detail = pulls[-1]["message"] if pulls else (waiting.get("message") or waiting["reason"])
        return Blocker(waiting["reason"], _clip(f"container {cs.get('name')}: {detail}"))
    return None


def pod_blocker(pod: dict[str, Any], events: list[dict[str, Any]]) -> Blocker | None:
    """Why this pod cannot start or keeps crashing, or None (it is booting, serving, or only waiting for
    the scheduler, whose message status.py shows already). The first that applies, most specific first."""
    if deleting(pod) or terminal(pod) or ready(pod):
        return None
    for found in (_oom_blocker(pod), _sidecar_blocker(pod), _config_blocker(pod), _image_blocker(pod, events)):
        if found:
            return found
    if server_running(pod):
        return None  # started: a mount or sandbox Event is from before and no longer blocks
    mounts = _events_of(pod, events, "FailedMount")
    if mounts:
        return _mount_blocker(pod, mounts[-1])
    sandbox = _events_of(pod, events, "FailedCreatePodSandBox")
    if sandbox:
        return Blocker("FailedCreatePodSandBox", _clip(sandbox[-1].get("message") or ""))
    return None


def blockers(pods: list[dict[str, Any]], events: list[dict[str, Any]]) -> dict[str, Blocker]:
    """{pod name: Blocker} for every pod `pod_blocker` explains."""
    out = {}
    for pod in pods:
        found = pod_blocker(pod, events)
        if found:
            out[meta(pod).get("name", "")] = found
    return out


# ---------------------------------------------------------------------------------------------------------
# Disruptions: pods that are gone (or going) because of their node, not because of what they run


def _disruption_of(pod: dict[str, Any]) -> tuple[str, Blocker] | None:
    """(when, Blocker) for an evicted or node-lost pod, else None."""
    st = pod_status(pod)
    name, node = meta(pod).get("name", ""), (pod.get("spec") or {}).get("nodeName") or "its node"
    cond = next((c for c in st.get("conditions") or [] if c.get("type") == "DisruptionTarget"
                 and c.get("status") == "True"), None)
    when = str((cond or {}).get("lastTransitionTime") or meta(pod).get("deletionTimestamp")
               or st.get("startTime") or "")[:19]
    selector = (pod.get("spec") or {}).get("nodeSelector") or {}
    capacity = "spot" if selector.get(SPOT_LABEL) == "true" else (
        "flex-start" if selector.get(FLEX_START_LABEL) == "true" else "")
    shutdown = st.get("reason") == "Terminated" and "shutdown" in (st.get("message") or "")
    if (cond and cond.get("reason") in NODE_GONE) or shutdown:
        text = (cond or {}).get("message") or st.get("message") or "the node went away"
        if capacity:
            return when, Blocker("NodePreempted", _clip(
                f"pod {name} on {capacity} node {node}: {text} (GKE reclaimed the node; a replacement waits "
                f"for {capacity} capacity)"))
        return when, Blocker("NodeShutdown", _clip(f"pod {name} on node {node}: {text}"))
    if st.get("reason") == "Evicted" or (cond and cond.get("reason") == "EvictionByEvictionAPI"):
        text = st.get("message") or (cond or {}).get("message") or "evicted"
        return when, Blocker("Evicted", _clip(f"pod {name} on node {node}: {text}"))
    return None


def disruption(pods: list[dict[str, Any]]) -> Blocker | None:
    """The newest disruption, while it is still what keeps the server down: no pod is ready, and every live
    pod was created at or after it and has not started (so it is the replacement, still waiting)."""
    found = sorted((d for d in map(_disruption_of, pods) if d), key=lambda d: d[0])
    if not found:
        return None
    when, blocker = found[-1]
    live = [p for p in pods if not deleting(p) and not terminal(p)]
    for p in live:
        started = any({"running", "terminated"} & set(cs.get("state") or {})
                      for cs in pod_status(p).get("containerStatuses") or [])
        if ready(p) or started or str(meta(p).get("creationTimestamp") or "")[:19] < when:
            return None
    return blocker
