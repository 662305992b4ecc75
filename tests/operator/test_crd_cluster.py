"""The CRD's rule on a server's name (spec.NAME_RULES), on a real kube-apiserver: the CRD from crds/ is accepted with
its root rule (the API server compiles it and estimates its cost when the CRD is applied), and creates, dry runs
so that nothing is stored, are admitted or refused by it. No operator runs: admission alone decides."""

from __future__ import annotations

import uuid

import pytest

from gemma_operator.kube import ApiError
from gemma_operator.spec import NAME_MESSAGE

from .harness import GRS_PATH, create_namespace, install_crd

pytestmark = pytest.mark.cluster

PLAIN = {"model": {"source": "hf://google/gemma-4-e2b-it"}, "accelerator": {"type": "cpu"}}


@pytest.fixture(scope="module")
def crd_ns(cluster, kube):
    install_crd(cluster)
    name = create_namespace(kube, f"t-{uuid.uuid4().hex[:8]}")
    yield name
    kube.request("DELETE", f"/api/v1/namespaces/{name}")


def dry_run_create(kube, ns: str, metadata: dict) -> dict:
    body = {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer", "metadata": metadata, "spec": PLAIN}
    return kube.request("POST", GRS_PATH.format(ns=ns), body, query={"dryRun": "All"})


@pytest.mark.parametrize("name", ["gemma", "gemma-4-e2b", "g", "a" * 63])
def test_a_dns_1035_label_is_admitted_as_a_servers_name(kube, crd_ns, name):
    assert dry_run_create(kube, crd_ns, {"name": name})["metadata"]["name"] == name


@pytest.mark.parametrize("name", [
    "a.b",               # in namespace svc: claims a.b.svc, the interceptor's host of server a in namespace b
    "a.b.svc.cluster",   # in namespace local: claims a.b.svc.cluster.local
    "gemma.serving",
    "4-gemma",           # a DNS-1123 label (the API server's own check admits it), not a DNS-1035 one
    "a" * 64,
])
def test_a_name_that_is_not_a_dns_1035_label_is_refused_with_what_to_use(kube, crd_ns, name):
    with pytest.raises(ApiError) as refused:
        dry_run_create(kube, crd_ns, {"name": name})
    assert refused.value.status == 422, refused.value
    assert NAME_MESSAGE in refused.value.message, refused.value.message


def test_a_generated_name_is_checked_as_the_name_it_becomes(kube, crd_ns):
    made = dry_run_create(kube, crd_ns, {"generateName": "gemma-"})
    assert made["metadata"]["name"].startswith("gemma-") and len(made["metadata"]["name"]) > len("gemma-")
    with pytest.raises(ApiError) as refused:
        dry_run_create(kube, crd_ns, {"generateName": "a.b-"})
    assert refused.value.status == 422 and NAME_MESSAGE in refused.value.message
