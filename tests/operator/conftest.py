"""Fixtures for the operator's integration tests: the CRD installed and the operator running against the
local control plane (`cluster` fixture from tests/cluster/plugin.py), and a fresh namespace per test."""

from __future__ import annotations

import uuid

import pytest

from gemma_operator.kube import Kube

from .harness import (create_namespace, install_crd, least_privilege_kubeconfig, refused_pods, start_operator,
                      stop_operator, wait_for)


@pytest.fixture(scope="session")
def kube(cluster) -> Kube:
    return Kube(cluster.api)


@pytest.fixture(scope="session")
def operator(cluster, kube, tmp_path_factory):
    install_crd(cluster)
    # So that the garbage collector knows GemmaRustServer now, not up to 30 s later (see restart()).
    cluster.cp.restart("kube-controller-manager")
    d = tmp_path_factory.mktemp("operator")
    op = start_operator(least_privilege_kubeconfig(cluster, kube, d / "kubeconfig"), d / "operator.log")
    yield op
    assert op.alive(), f"the operator died during the tests\n{op.tail()}"
    stop_operator(op)


@pytest.fixture
def ns(cluster, kube, operator):
    """A fresh namespace enforcing the restricted Pod Security level. At the end no ReplicaSet in it may have
    been refused a pod by PodSecurity admission (the refusal shows only there), then its GemmaRustServers
    are deleted and their pods waited for."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    create_namespace(kube, name)
    yield name
    refused = {rs: why for rs, why in refused_pods(kube, name).items() if "violates PodSecurity" in why}
    assert not refused, f"PodSecurity admission refused pods in {name}: {refused}"
    cluster.kubectl("delete", "grs", "--all", "-n", name, "--wait=true", "--timeout=60s")
    wait_for(lambda: not kube.request("GET", f"/api/v1/namespaces/{name}/pods")["items"], timeout=60,
             what=f"pods in {name} to go", diagnose=operator.tail)
    kube.request("DELETE", f"/api/v1/namespaces/{name}")


