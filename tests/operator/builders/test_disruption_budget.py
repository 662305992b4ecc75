"""The PodDisruptionBudget (gemma_operator/builders/disruption_budget.py): golden dicts, no cluster involved."""

from __future__ import annotations

from gemma_operator.builders.disruption_budget import build_pdb

from .specs import LABELS, META, SELECTOR, tpu_spec


def test_pdb_only_above_one_replica():
    assert build_pdb(tpu_spec(), META) is None
    assert build_pdb(tpu_spec(replicas=3), META) == {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": SELECTOR}},
    }
