"""Everything one GemmaRustServer owns, given which optional kinds the cluster serves: what to apply, what to
delete, and what was skipped (pure)."""

from __future__ import annotations

from typing import Any, NamedTuple

from ..spec import GemmaRustServerSpec
from .build_cache import build_build_cache_pvc
from .deployment import build_deployment
from .disruption_budget import build_pdb
from .endpoint_picker import build_picker_configmap, picker_config_name
from .optional import OPTIONAL_KINDS
from .ownership import Meta
from .service import build_service


class Children(NamedTuple):
    apply: list[dict[str, Any]]          # objects to server-side apply, in order
    absent: list[tuple[str, str, str]]   # (apiVersion, kind, name) that must not exist
    skipped: list[tuple[str, str]]       # (kind, why) optional children asked for but not created
    optional: dict[str, list[str]] = {}  # condition -> kinds asked for (created or skipped)
    # (apiVersion, kind, name) of a kind whose rival is now built (an HPA once KEDA's ScaledObject is, and the
    # other way round): deleted on every sync, not only when the spec changes, since both would drive replicas
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
    picker = build_picker_configmap(spec, meta)
    if picker:
        apply.append(picker)
    elif not spec.gateway.inference_pool:
        absent.append(("v1", "ConfigMap", picker_config_name(meta)))
    # else a picker release with no config here (UnsupportedEndpointPicker): the ConfigMap stays as it is
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
    # A kind and its fallback both drive the replicas: whichever is built, the other goes on every sync (a
    # ScaledObject left from before the HTTP add-on's CRD went away would take the server to zero beside the HPA).
    rivals = {k for row in OPTIONAL_KINDS if row.fallback_for for k in (row.kind, row.fallback_for)}
    if rivals & built:
        replaced += [entry for entry in absent if entry[1] in rivals - built and entry not in replaced]
        absent = [entry for entry in absent if entry not in replaced]
    return Children(apply, absent, skipped, optional, replaced)
