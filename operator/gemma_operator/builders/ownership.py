"""What marks an object as a GemmaRustServer's child: its labels (app.kubernetes.io/* as the Kubernetes
recommended labels have them, plus gemmarust.dev/server), the metadata the builders take (`Meta`), the
controller owner reference (`adopt`) and the check that an object of a child's name is not someone else's
(`foreign`). Pure.
"""

from __future__ import annotations

from typing import Any, NamedTuple

FIELD_MANAGER = "gemma-rust-operator"
MANAGED_BY = "gemma-rust-operator"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_SERVER = "gemmarust.dev/server"
# The KEDA HTTP add-on's external scaler as its manifests install it (kedacore/http-add-on v0.12.0,
# config/default/kustomization.yaml: namespace keda, prefix keda-add-ons-http-; config/scaler/service.yaml: port 9090).
KEDA_HTTP_SCALER = "keda-add-ons-http-external-scaler.keda:9090"


class Meta(NamedTuple):
    """The parts of the custom resource's metadata the builders use, and what the handlers found about them."""

    name: str
    namespace: str
    uid: str = ""  # the build cache claim's name carries it (build_cache_claim_name)
    # The build cache claim is the one an earlier version named <name>-build-cache, and this server is its
    # controller (handlers read it before building): it is kept, so an upgrade does not lose the build.
    legacy_build_cache: bool = False
    # The KEDA HTTP add-on's external scaler (host:port) that a ScaledObject of a server scaling to zero asks
    # (the operator's GEMMA_OPERATOR_KEDA_HTTP_SCALER): where the add-on is installed is the cluster's, not a spec's.
    keda_http_scaler: str = KEDA_HTTP_SCALER


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


def child_object(api_version: str, kind: str, name: str, meta: Meta) -> dict[str, Any]:
    """A child's apiVersion, kind and metadata (name, namespace, labels); the builder adds the rest."""
    return {"apiVersion": api_version, "kind": kind,
            "metadata": {"name": name, "namespace": meta.namespace, "labels": labels(meta)}}


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
