"""The chart's optional ClusterRole for a read-only assistant (templates/mcp-readonly-role.yaml), rendered by the
real helm: get/list/watch on GemmaRustServers, pods, Services and Events, nothing else, and bound only to the
subjects named. tests/operator/test_mcp_cluster.py runs `python -m gemma_operator.mcp --read-only` with exactly
these rules on the local control plane."""

from __future__ import annotations

import pytest

from .conftest import CHART, find

ROLE = "grs-gemma-rust-operator-mcp-read-only"
ON = "mcp.readOnlyRole.create=true"
GROUP = ("mcp.readOnlyRole.subjects[0].kind=Group", "mcp.readOnlyRole.subjects[0].name=ml-assistants",
         "mcp.readOnlyRole.subjects[0].apiGroup=rbac.authorization.k8s.io")


def granted(role: dict) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) for every grant of a role."""
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


def test_off_by_default(helm):
    assert not [d for d in helm.render() if "mcp" in d["metadata"]["name"]]


def test_the_role_reads_servers_pods_services_and_events_and_nothing_else(helm):
    docs = helm.render(ON)
    role = find(docs, "ClusterRole", ROLE)
    expected = {(group, resource, verb) for group, resource in [("gemmarust.dev", "gemmarustservers"), ("", "events"),
                                                                ("", "pods"), ("", "services")]
                for verb in ("get", "list", "watch")}
    assert granted(role) == expected
    assert not any(rule.get("resourceNames") or rule.get("nonResourceURLs") for rule in role["rules"])
    assert role["metadata"]["labels"]["app.kubernetes.io/instance"] == "grs"
    # No subjects, no binding: the role alone.
    assert not [d for d in docs if d["kind"] in ("ClusterRoleBinding", "RoleBinding")
                and "mcp" in d["metadata"]["name"]]


def test_subjects_get_a_cluster_role_binding(helm):
    binding = find(helm.render(ON, *GROUP), "ClusterRoleBinding", ROLE)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ROLE}
    assert binding["subjects"] == [{"kind": "Group", "name": "ml-assistants", "apiGroup": "rbac.authorization.k8s.io"}]


def test_with_watch_namespaces_the_binding_is_per_namespace(helm):
    docs = helm.render(ON, *GROUP, "watchNamespaces={models,staging}")
    bindings = [d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["name"] == ROLE]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["models", "staging"]
    assert all(b["roleRef"]["kind"] == "ClusterRole" and b["roleRef"]["name"] == ROLE for b in bindings)
    assert not [d for d in docs if d["kind"] == "ClusterRoleBinding" and d["metadata"]["name"] == ROLE]


@pytest.mark.parametrize("bad, why", [
    ("mcp.readOnlyRole.verbs=create", "additional properties 'verbs' not allowed"),
    ("mcp.readOnlyRole.subjects[0].kind=Robot", "/mcp/readOnlyRole/subjects/0/kind': value must be one of"),
])
def test_schema_refuses_what_the_role_does_not_take(helm, bad, why):
    out = helm.template(ON, bad, "mcp.readOnlyRole.subjects[0].name=x", check=False)
    assert out.returncode != 0
    assert why in out.stderr, out.stderr


def test_lint_strict_passes_with_the_role_and_a_binding(helm):
    args = ["lint", "--strict", str(CHART), "--kube-version", "1.37.2", "--set", ON]
    for v in GROUP:
        args += ["--set", v]
    out = helm.run(*args)
    assert "0 chart(s) failed" in out.stdout and "[WARNING]" not in out.stdout, out.stdout
