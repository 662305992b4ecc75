"""The operator's RBAC rules: exactly the API verbs it uses, resource by resource (one source of truth).

The Helm chart's ClusterRole should carry these rules; the integration tests run the operator with a
ServiceAccount token bound to exactly these rules (tests/operator/conftest.py), so a missing verb fails
them. `python -m gemma_operator.rbac` prints the ClusterRole.

Why each verb:
- gemmarustservers: kopf lists/watches them and patches metadata (finalizer, progress annotations);
  /status: the operator merge-patches the status; /finalizers update: owner references with
  blockOwnerDeletion need it where the OwnerReferencesPermissionEnforcement admission plugin is on.
- children (Deployment, Service, PDB, PVC, the endpoint picker's ConfigMap and the optional kinds of
  builders.optional.OPTIONAL_KINDS: PodMonitoring, ServiceMonitor, ScaledObject, HorizontalPodAutoscaler,
  InferencePool, HealthCheckPolicy, GCPBackendPolicy): server-side apply is a PATCH
  that creates when absent (patch + create); Deployments and Services are also watched (list/watch)
  so a deleted one is put back at once; PDB, ConfigMap and optional objects are deleted when no longer asked
  for, and the Deployment when its pods mount a build cache claim that is no longer the server's
  (handlers._build_cache_claim).
  get on each: before its first apply, and before a delete, the operator reads the object of that name
  and leaves it alone unless this GemmaRustServer is its controller (handlers._foreign_child).
- inferencepools list: the Gateway condition names another InferencePool that selects a server's pods
  (handlers._foreign_pools), the second pool the upstream inferencepool chart would make.
- horizontalpodautoscalers get: the ScalingActive condition reads the status conditions of the HPA that
  scales a server (ours, or the one KEDA makes for a ScaledObject). The HPA controller and KEDA scale the
  GemmaRustServer through its scale subresource with their own rights; the operator never writes it.
- pods: listed for status and watched so status follows them; never modified.
- events: create, for the Events posted on each phase transition (and kopf's own warnings); list (core
  group), for the Events of pods that have not started: why a pod cannot start (gemma_operator.events).
- no Secrets: a missing token Secret is the pod's own CreateContainerConfigError, which the status reports;
  the token reaches the pod only through secretKeyRef.
API discovery (/apis/...) needs no rule: every authenticated user may read it.
"""

from __future__ import annotations

import sys

import yaml

RULES = [
    {"apiGroups": ["gemmarust.dev"], "resources": ["gemmarustservers"], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": ["gemmarust.dev"], "resources": ["gemmarustservers/status"], "verbs": ["patch"]},
    {"apiGroups": ["gemmarust.dev"], "resources": ["gemmarustservers/finalizers"], "verbs": ["update"]},
    {"apiGroups": ["apps"], "resources": ["deployments"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "watch", "create", "patch"]},
    {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": ["monitoring.googleapis.com"], "resources": ["podmonitorings"],
     "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": ["monitoring.coreos.com"], "resources": ["servicemonitors"],
     "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": ["keda.sh"], "resources": ["scaledobjects"], "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": ["http.keda.sh"], "resources": ["httpscaledobjects"], "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": ["autoscaling"], "resources": ["horizontalpodautoscalers"],
     "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
     "verbs": ["get", "list", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": ["networking.gke.io"], "resources": ["healthcheckpolicies", "gcpbackendpolicies"],
     "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["list"]},
]


def cluster_role(name: str = "gemma-rust-operator") -> dict:
    """The ClusterRole object holding RULES."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "gemma-rust-operator"}},
            "rules": RULES}


if __name__ == "__main__":
    sys.stdout.write(yaml.safe_dump(cluster_role(), sort_keys=False))
