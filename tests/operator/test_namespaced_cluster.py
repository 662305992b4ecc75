"""Namespaced mode (the chart's watchNamespaces): the operator with a Role holding rbac.RULES in one namespace
and no cluster-wide rights, started with --namespace for it, serves the GemmaRustServers there and leaves
those of other namespaces alone. The session's cluster-wide operator is paused meanwhile."""

from __future__ import annotations

import re
import uuid

import pytest

from .harness import (create, create_namespace, get, least_privilege_kubeconfig, start_operator, stop_operator,
                      wait_for)

pytestmark = pytest.mark.cluster

SPEC = {"model": {"source": "hf://google/gemma-4-e2b-it"}, "accelerator": {"type": "cpu"}}


def handled_and_ready(obj: dict) -> bool:
    return ((obj.get("status") or {}).get("phase") == "Ready"
            and "gemmarust.dev/last-handled-configuration" in (obj["metadata"].get("annotations") or {}))


@pytest.fixture
def other_ns(kube, operator):
    name = f"t-{uuid.uuid4().hex[:8]}"
    create_namespace(kube, name)
    yield name
    kube.request("DELETE", f"/api/v1/namespaces/{name}")


def test_namespaced_operator_serves_its_namespace_with_a_role_and_nothing_else(cluster, kube, ns, other_ns,
                                                                                operator, tmp_path):
    kubeconfig = least_privilege_kubeconfig(cluster, kube, tmp_path / "kubeconfig", namespaces=(ns,),
                                            name="gemma-rust-operator-namespaced")
    with operator.paused():
        scoped = start_operator(kubeconfig, tmp_path / "operator.log", args=(f"--namespace={ns}",))
        try:
            # Theirs first: by the time mine is Ready, an operator watching every namespace would have
            # handled theirs too (kopf marks what it handled with its annotations).
            create(kube, other_ns, "theirs", SPEC)
            create(kube, ns, "mine", SPEC)
            # kopf writes its annotation in a patch of its own after the handler's status patch, so wait
            # for both.
            obj = wait_for(lambda: o if handled_and_ready(o := get(kube, ns, "mine")) else None,
                           timeout=60, what="mine Ready and marked handled", diagnose=scoped.tail)
            assert obj["status"]["readyText"] == "1/1"
            theirs = get(kube, other_ns, "theirs")
            assert not theirs.get("status") and not (theirs["metadata"].get("annotations") or {})
            assert kube.request("GET", f"/apis/apps/v1/namespaces/{other_ns}/deployments")["items"] == []
            forbidden = [ln for ln in scoped.log.read_text().splitlines() if re.search(r"HTTP 403|[Ff]orbidden", ln)]
            assert not forbidden, "the Role refused the operator:\n" + "\n".join(forbidden[:10])
        finally:
            stop_operator(scoped)
            kube.request("DELETE", f"/apis/gemmarust.dev/v1alpha1/namespaces/{other_ns}/gemmarustservers/theirs")
