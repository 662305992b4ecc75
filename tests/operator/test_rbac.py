"""The RBAC rules cover every child kind the builders produce (the integration tests then run the operator
with exactly these rules, which checks the verbs against real API calls)."""

from __future__ import annotations

from gemma_operator.builders.children import build_children
from gemma_operator.builders.optional import OPTIONAL_KINDS
from gemma_operator.builders.ownership import Meta
from gemma_operator import rbac
from gemma_operator.kube import RESOURCES
from gemma_operator.spec import parse_spec


def verbs(group: str, resource: str) -> set[str]:
    return {v for r in rbac.RULES if group in r["apiGroups"] and resource in r["resources"] for v in r["verbs"]}


def test_every_child_kind_can_be_server_side_applied():
    spec = parse_spec({"model": {"source": "hf://a/b"}, "replicas": 2, "buildCache": {"type": "pvc",
                       "accessMode": "ReadWriteMany"}, "monitoring": {"serviceMonitor": True}})
    everything = frozenset(row.api_version for row in OPTIONAL_KINDS)
    kids = build_children(spec, Meta("g", "ns", "uid"), everything)
    assert {o["kind"] for o in kids.apply} == {"PersistentVolumeClaim", "Deployment", "Service",
                                               "PodDisruptionBudget", "PodMonitoring", "ServiceMonitor"}
    for obj in kids.apply:
        group = obj["apiVersion"].rpartition("/")[0]
        assert {"create", "patch"} <= verbs(group, RESOURCES[(obj["apiVersion"], obj["kind"])]), obj["kind"]


def test_children_the_operator_prunes_can_be_deleted():
    for api_version, kind in [("policy/v1", "PodDisruptionBudget"), *((r.api_version, r.kind) for r in OPTIONAL_KINDS)]:
        assert "delete" in verbs(api_version.rpartition("/")[0], RESOURCES[(api_version, kind)]), kind


def test_a_deployment_mounting_a_claim_that_is_not_the_servers_can_be_deleted():
    assert "delete" in verbs("apps", "deployments")


def test_no_rule_reads_secrets():
    # A missing token Secret shows as the pod's CreateContainerConfigError (events.py), not by reading it.
    assert not [r for r in rbac.RULES if "secrets" in r["resources"] or "*" in r["resources"]]


def test_pod_events_are_listed_not_watched():
    assert verbs("", "events") == {"create", "list"}
    assert verbs("events.k8s.io", "events") == {"create"}
