"""Restricted Pod Security, checked by the API server itself: kube-apiserver's PodSecurity admission plugin
(enabled by default since Kubernetes 1.25) judges every pod created in a namespace labelled
`pod-security.kubernetes.io/enforce: restricted` (the `ns` fixture's namespaces; the levels are defined in
kubernetes.io/docs/concepts/security/pod-security-standards).

Admission happens when the ReplicaSet controller creates a pod, so "admitted" means the pod exists; a refused
one exists nowhere and shows only as the ReplicaSet's ReplicaFailure condition (reason FailedCreate), which
the `ns` fixture checks for after every test. The last test shows that the label bites: the same server pod
without its security context is refused.
"""

from __future__ import annotations

import uuid

import pytest

from gemma_operator.builders.deployment import CONTAINER, build_deployment
from gemma_operator.builders.ownership import Meta
from gemma_operator.kube import ApiError
from gemma_operator.spec import parse_spec

from .harness import RESTRICTED, create, create_namespace, refused_pods, wait_for

pytestmark = pytest.mark.cluster

# The shapes of server pod the builders make: a TPU pod (in-memory /dev/shm), a gs:// model (the GCS FUSE
# CSI volume and its cache), a PVC model and a PVC build cache.
SHAPES = {
    "tpu": {"model": {"source": "hf://google/gemma-4-e2b-it"}, "accelerator": {"topology": "1x1"}},
    "gcs": {"model": {"source": "gs://weights/gemma-4-e2b-it"}, "accelerator": {"type": "cpu"}},
    "pvc": {"model": {"source": "pvc://weights/gemma-4-e2b-it"}, "accelerator": {"type": "cpu"},
            "buildCache": {"type": "pvc"}},
}


def pods(kube, ns: str, name: str) -> list[dict]:
    return kube.list_pods(ns, f"app.kubernetes.io/instance={name},app.kubernetes.io/name=gemma-rust-server")


def test_server_pods_of_every_shape_are_admitted_in_a_restricted_namespace(kube, ns, operator):
    labels = kube.request("GET", f"/api/v1/namespaces/{ns}")["metadata"]["labels"]
    assert RESTRICTED.items() <= labels.items()
    for name, spec in SHAPES.items():
        create(kube, ns, name, spec)
    for name in SHAPES:
        (pod,) = wait_for(lambda: pods(kube, ns, name), what=f"the pod of {name} admitted",
                          diagnose=lambda: f"refused: {refused_pods(kube, ns)}\n{operator.tail(20)}")
        sc = pod["spec"]["securityContext"]
        (container,) = [c for c in pod["spec"]["containers"] if c["name"] == CONTAINER]
        assert sc["runAsNonRoot"] is True and sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                "capabilities": {"drop": ["ALL"]}}
    assert refused_pods(kube, ns) == {}


@pytest.fixture
def restricted_ns(kube):
    """A restricted namespace of the test's own (the `ns` fixture fails a test that has a refused pod)."""
    name = create_namespace(kube, f"psa-{uuid.uuid4().hex[:8]}")
    yield name
    kube.request("DELETE", f"/api/v1/namespaces/{name}")


def test_the_server_pod_without_its_security_context_is_refused_in_a_restricted_namespace(kube, restricted_ns):
    ns = restricted_ns
    dep = build_deployment(parse_spec({"model": {"source": "hf://google/gemma-4-e2b-it"},
                                                "accelerator": {"type": "cpu"}}), Meta("bare", ns))
    pod_spec = dep["spec"]["template"]["spec"]
    del pod_spec["securityContext"]
    del pod_spec["containers"][0]["securityContext"]
    # A pod created directly is refused with the policy's reasons...
    bare_pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bare"}, "spec": pod_spec}
    with pytest.raises(ApiError) as refused:
        kube.request("POST", f"/api/v1/namespaces/{ns}/pods", bare_pod)
    assert refused.value.status == 403, refused.value
    assert 'violates PodSecurity "restricted:latest"' in str(refused.value)
    # ...and a Deployment's is refused when its ReplicaSet creates it: no pod, a FailedCreate condition.
    kube.request("POST", f"/apis/apps/v1/namespaces/{ns}/deployments", dep)
    failures = wait_for(lambda: refused_pods(kube, ns), what="the ReplicaSet's FailedCreate")
    (message,) = failures.values()
    assert 'violates PodSecurity "restricted:latest"' in message
    for rule in ("allowPrivilegeEscalation != false", "unrestricted capabilities", "runAsNonRoot != true",
                 "seccompProfile"):
        assert rule in message, (rule, message)
    assert kube.request("GET", f"/api/v1/namespaces/{ns}/pods")["items"] == []
