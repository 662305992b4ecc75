"""Everything one GemmaRustServer owns, given which optional kinds the cluster serves: what to apply, what to
delete, what was skipped, and the autoscaler chosen for it (builders.autoscaler.choose), which every child that
scales or counts replicas reads (pure)."""

from __future__ import annotations

from typing import Any, NamedTuple

from ..spec import GemmaRustServerSpec
from .autoscaler import Autoscaling, choose
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
    # other way round; Autoscaling.replaces): deleted on every sync, not only when the spec changes, since both
    # would drive replicas
    replaced: list[tuple[str, str, str]] = []
    scaling: Autoscaling = Autoscaling()  # the autoscaler chosen (builders.autoscaler.choose)


def build_children(spec: GemmaRustServerSpec, meta: Meta, available: frozenset[str]) -> Children:
    """Everything the custom resource owns, given which optional API groups the cluster serves.

    Args:
        spec: the typed spec.
        meta: name and namespace of the custom resource.
        available: apiVersions (e.g. "monitoring.googleapis.com/v1") the cluster serves, among those in
            OPTIONAL_KINDS.
    Returns:
        Children: what to apply, what to delete if present (`absent` when the spec changes, `replaced`
        always), what was skipped (with why), which optional kinds each condition reports on, and the autoscaler
        chosen.
    """
    scaling = choose(spec, available)
    apply: list[dict[str, Any]] = []
    absent: list[tuple[str, str, str]] = []
    skipped: list[tuple[str, str]] = []
    optional: dict[str, list[str]] = {}
    pvc = build_build_cache_pvc(spec, meta)
    if pvc:
        apply.append(pvc)
    apply += [build_deployment(spec, meta, scaling), build_service(spec, meta)]
    pdb = build_pdb(spec, meta, scaling)
    apply.append(pdb) if pdb else absent.append(("policy/v1", "PodDisruptionBudget", meta.name))
    picker = build_picker_configmap(spec, meta, scaling)
    if picker:
        apply.append(picker)
    elif not spec.gateway.inference_pool:
        absent.append(("v1", "ConfigMap", picker_config_name(meta)))
    # else a picker release with no config here (UnsupportedEndpointPicker): the ConfigMap stays as it is
    replaced: list[tuple[str, str, str]] = []
    for row in OPTIONAL_KINDS:
        served = row.api_version in available
        if not row.asked(spec, scaling):
            if served:
                (replaced if row.kind in scaling.replaces else absent).append((row.api_version, row.kind, meta.name))
            continue
        if served:
            apply.append(row.build(spec, meta, scaling))
        else:
            skipped.append((row.kind, row.missing()))
        optional.setdefault(row.condition, []).append(row.kind)
    return Children(apply, absent, skipped, optional, replaced, scaling)
