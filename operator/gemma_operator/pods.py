"""Facts about one Pod object as the API server returns it (core/v1 PodStatus), each computed here once (pure).

status.py, events.py and poller.py read pods through these, so "is it Ready", "is it gone for good" and
"which container status is the server's" mean the same thing everywhere. The field meanings are the
Kubernetes API's: a pod's `Ready` condition, its phase (Failed and Succeeded are terminal: the pod's
containers will not run again, https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#pod-phase),
and one containerStatuses entry per container, named after it.
"""

from __future__ import annotations

from typing import Any

from .builders.deployment import CONTAINER


def meta(pod: dict[str, Any]) -> dict[str, Any]:
    return pod.get("metadata") or {}


def pod_status(pod: dict[str, Any]) -> dict[str, Any]:
    return pod.get("status") or {}


def deleting(pod: dict[str, Any]) -> bool:
    """The pod is being deleted (it has a deletionTimestamp)."""
    return bool(meta(pod).get("deletionTimestamp"))


def terminal(pod: dict[str, Any]) -> bool:
    """Phase Failed or Succeeded: gone for good (evicted, shut down with its node)."""
    return pod_status(pod).get("phase") in ("Failed", "Succeeded")


def running_phase(pod: dict[str, Any]) -> bool:
    """Phase Running: bound to a node, and its containers were created."""
    return pod_status(pod).get("phase") == "Running"


def ready(pod: dict[str, Any]) -> bool:
    """The pod's Ready condition is True (its readiness probe passes)."""
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod_status(pod).get("conditions") or [])


def container_statuses(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """Every container's status, init containers (the GCS FUSE sidecar among them) first."""
    st = pod_status(pod)
    return (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or [])


def container_status(pod: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The status of the container `name` (a regular or an init container), or None before it has one."""
    st = pod_status(pod)
    return next((cs for cs in (st.get("containerStatuses") or []) + (st.get("initContainerStatuses") or [])
                 if cs.get("name") == name), None)


def server_status(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The server container's status (builders.deployment.CONTAINER), or None before it has one."""
    return container_status(pod, CONTAINER)


def server_running(pod: dict[str, Any]) -> bool:
    """The server container has started and not exited."""
    return "running" in ((server_status(pod) or {}).get("state") or {})
