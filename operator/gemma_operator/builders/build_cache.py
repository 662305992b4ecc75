"""The build cache: the PersistentVolumeClaim a pvc build cache is, its name, and the volume the pods mount
it from (an emptyDir otherwise) (pure)."""

from __future__ import annotations

from typing import Any

from ..spec import GemmaRustServerSpec
from .ownership import Meta, child_object

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


def build_cache_volume(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any]:
    bc = spec.build_cache
    if bc.type == "pvc":
        return {"name": "build-cache", "persistentVolumeClaim": {"claimName": build_cache_claim_name(meta)}}
    return {"name": "build-cache", "emptyDir": {"sizeLimit": bc.size}}


def build_build_cache_pvc(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any] | None:
    """The build cache PersistentVolumeClaim, for buildCache.type pvc."""
    bc = spec.build_cache
    if bc.type != "pvc":
        return None
    pvc = child_object("v1", "PersistentVolumeClaim", build_cache_claim_name(meta), meta)
    pvc["spec"] = {"accessModes": [bc.access_mode], "resources": {"requests": {"storage": bc.size}}}
    if bc.storage_class_name:
        pvc["spec"]["storageClassName"] = bc.storage_class_name
    return pvc
