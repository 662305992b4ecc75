"""The PodDisruptionBudget of a GemmaRustServer with more than one replica (pure)."""

from __future__ import annotations

from typing import Any

from ..spec import GemmaRustServerSpec
from .autoscaler import Autoscaling
from .deployment import replicas
from .ownership import Meta, child_object, selector_labels


def build_pdb(spec: GemmaRustServerSpec, meta: Meta, scaling: Autoscaling | None = None) -> dict[str, Any] | None:
    """A PodDisruptionBudget allowing one voluntary eviction at a time, only when replicas > 1 (the
    Deployment's, within the bounds of the autoscaler chosen, `scaling`: it follows an autoscaler's spec.replicas
    too, so the PDB comes and goes with it)."""
    if replicas(spec, scaling) <= 1:
        return None
    pdb = child_object("policy/v1", "PodDisruptionBudget", meta.name, meta)
    pdb["spec"] = {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(meta)}}
    return pdb
