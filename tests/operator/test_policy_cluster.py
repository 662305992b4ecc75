"""The operator's own side of the pod-level powers (gemma_operator/admission.py `allowlist_problems`, the build
cache claim of handlers._build_cache_claim) against the local control plane, with the operator a real
`kopf run` process holding exactly rbac.RULES.

The build cache claim: a spec names its server, not its claim, so no GemmaRustServer can mount a claim it
does not own; a claim under its own claim's name that is not its own is fatal, and takes the Deployment
whose pods would mount it away. The allowlists: with the operator's defaults (an operator of its own,
started while the session's is paused), a spot server's toleration and a Prometheus address are refused
and a TPU server is not.
"""

from __future__ import annotations

import pytest

from gemma_operator.builders.build_cache import build_build_cache_pvc, build_cache_claim_name
from gemma_operator.builders.deployment import claims
from gemma_operator.builders.ownership import Meta, adopt
from gemma_operator.kube import ApiError
from gemma_operator.spec import parse_spec

from .harness import (GRS_PATH, PROMETHEUS, condition, create, dump, get, least_privilege_kubeconfig, start_operator,
                      stop_operator, wait_for)

pytestmark = pytest.mark.cluster

PVC_CACHE = {"model": {"source": "hf://google/gemma-4-e2b-it"}, "accelerator": {"type": "cpu"},
             "buildCache": {"type": "pvc"}}
CLAIMS = "/api/v1/namespaces/{ns}/persistentvolumeclaims"


def deployment(kube, ns, name):
    return kube.get_if_present("apps/v1", "Deployment", ns, name)


def claim(kube, ns, name):
    return kube.get_if_present("v1", "PersistentVolumeClaim", ns, name)


def someone_elses_claim(kube, ns, name):
    """A claim made by another user of the namespace: no owner, data the server must never see."""
    return kube.request("POST", CLAIMS.format(ns=ns), {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "labels": {"team": "ci"}},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})


def remove_claim(kube, ns, name):
    """Delete a claim now, past the pvc-protection finalizer (no volume is bound here)."""
    path = f"{CLAIMS.format(ns=ns)}/{name}"
    kube.delete_if_present("v1", "PersistentVolumeClaim", ns, name)
    try:
        kube.request("PATCH", path, {"metadata": {"finalizers": None}}, content_type="application/merge-patch+json")
    except ApiError as err:
        if err.status != 404:  # the controller manager may drop the finalizer, and the claim, first
            raise
    wait_for(lambda: claim(kube, ns, name) is None, what=f"claim {name} gone")


def mounted_claims(kube, ns, name):
    dep = deployment(kube, ns, name)
    return claims(dep) if dep else set()


def failed_with(kube, ns, name, reason, operator, timeout=45):
    def check():
        obj = get(kube, ns, name)
        return obj if (obj.get("status") or {}).get("phase") == "Failed" and \
            condition(obj, "Degraded").get("reason") == reason else None
    return wait_for(check, timeout=timeout, what=f"{name} Failed with {reason}",
                    diagnose=lambda: dump(get(kube, ns, name).get("status")) + "\n" + operator.tail(30))


def test_a_server_named_after_someone_elses_claim_never_mounts_it(kube, ns, operator):
    # The review's case: ci-build-cache is another team's claim; a server named ci asks for a pvc build cache.
    theirs = someone_elses_claim(kube, ns, "ci-build-cache")
    obj = create(kube, ns, "ci", PVC_CACHE)
    own = f"ci-build-cache-{obj['metadata']['uid'][:8]}"
    wait_for(lambda: mounted_claims(kube, ns, "ci") == {own}, what=f"the Deployment mounting {own}",
             diagnose=operator.tail)
    made = claim(kube, ns, own)
    assert made["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    after = claim(kube, ns, "ci-build-cache")
    assert after["metadata"]["resourceVersion"] == theirs["metadata"]["resourceVersion"], dump(after)
    assert "ownerReferences" not in after["metadata"]
    assert condition(get(kube, ns, "ci"), "Degraded").get("status") != "True", dump(get(kube, ns, "ci")["status"])


def test_a_foreign_claim_under_the_servers_claim_name_is_fatal_and_no_deployment_mounts_it(kube, ns, operator):
    obj = create(kube, ns, "swap", PVC_CACHE)
    own = f"swap-build-cache-{obj['metadata']['uid'][:8]}"
    wait_for(lambda: mounted_claims(kube, ns, "swap") == {own}, what="the Deployment", diagnose=operator.tail)
    # While the operator is down, the server's claim goes and another user's claim takes its name.
    with operator.paused():
        remove_claim(kube, ns, own)
        theirs = someone_elses_claim(kube, ns, own)
    obj = failed_with(kube, ns, "swap", "BuildCacheClaimNotOwned", operator)
    assert condition(obj, "Degraded")["message"].startswith(
        f"PersistentVolumeClaim {own} (spec.buildCache) already exists and is not this GemmaRustServer's (it has no "
        "controller): no pod of this server mounts it"), condition(obj, "Degraded")
    wait_for(lambda: deployment(kube, ns, "swap") is None, what="the Deployment that mounted it to go",
             diagnose=operator.tail)
    wait_for(lambda: not [p for p in kube.list_pods(ns, "app.kubernetes.io/instance=swap")
                          if not p["metadata"].get("deletionTimestamp")], what="its pods to go")
    after = claim(kube, ns, own)
    assert after["metadata"]["uid"] == theirs["metadata"]["uid"] and "ownerReferences" not in after["metadata"]
    # Once that claim is gone the server makes its own again.
    remove_claim(kube, ns, own)
    wait_for(lambda: mounted_claims(kube, ns, "swap") == {own}, what="the Deployment back", diagnose=operator.tail)
    assert claim(kube, ns, own)["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    wait_for(lambda: (get(kube, ns, "swap").get("status") or {}).get("phase") != "Failed", what="no longer Failed")


def test_a_server_keeps_the_build_cache_claim_an_earlier_version_named_and_it_owns(kube, ns, operator):
    # An earlier operator named the claim <name>-build-cache and made this server its controller.
    obj = create(kube, ns, "old", {**PVC_CACHE, "buildCache": {"type": "emptyDir"}})
    meta = Meta("old", ns, obj["metadata"]["uid"], legacy_build_cache=True)
    legacy = adopt(build_build_cache_pvc(parse_spec(PVC_CACHE), meta), obj)
    kube.request("POST", CLAIMS.format(ns=ns), legacy)
    kube.request("PATCH", f"{GRS_PATH.format(ns=ns)}/old", {"spec": {"buildCache": {"type": "pvc"}}},
                 content_type="application/merge-patch+json")
    wait_for(lambda: mounted_claims(kube, ns, "old") == {"old-build-cache"}, what="the legacy claim mounted",
             diagnose=operator.tail)
    assert claim(kube, ns, build_cache_claim_name(meta._replace(legacy_build_cache=False))) is None
    assert (get(kube, ns, "old").get("status") or {}).get("phase") != "Failed"


# ---------------------------------------------------------------------------------------------------------
# The allowlists at the operator's defaults


@pytest.fixture
def default_operator(cluster, kube, operator, tmp_path):
    """An operator with the allowlists at their defaults (the harness widens them), the session's paused."""
    with operator.paused():
        op = start_operator(least_privilege_kubeconfig(cluster, kube, tmp_path / "kubeconfig"), tmp_path / "op.log",
                            extra_env={"GEMMA_OPERATOR_ALLOWED_TOLERATIONS": "",
                                       "GEMMA_OPERATOR_ALLOWED_PROMETHEUS_ADDRESSES": ""})
        try:
            yield op
        finally:
            stop_operator(op)


def test_at_the_defaults_spot_and_a_prometheus_address_are_refused_and_tpu_is_not(kube, ns, default_operator):
    create(kube, ns, "spot", {"model": {"source": "hf://o/m"}, "accelerator": {"topology": "2x2",
                                                                               "provisioning": "spot"}})
    create(kube, ns, "keda", {"model": {"source": "hf://o/m"}, "accelerator": {"type": "cpu"},
                              "autoscaling": {"maxReplicas": 2, "target": 1, "provider": "KEDA",
                                              "prometheus": {"serverAddress": PROMETHEUS}}})
    create(kube, ns, "tpu", {"model": {"source": "hf://o/m"}, "accelerator": {"topology": "1x1"}})
    spot = failed_with(kube, ns, "spot", "TolerationNotAllowed", default_operator)
    assert condition(spot, "Degraded")["message"].startswith(
        "spec.accelerator.provisioning (spot, whose pods tolerate the taint key 'cloud.google.com/gke-spot') not "
        "allowed by this operator"), condition(spot, "Degraded")
    keda = failed_with(kube, ns, "keda", "PrometheusAddressNotAllowed", default_operator)
    assert "operator.allowedPrometheusAddresses: none" in condition(keda, "Degraded")["message"]
    assert deployment(kube, ns, "spot") is None and deployment(kube, ns, "keda") is None
    # The TPU taint's toleration and google.com/tpu are what the operator itself needs: allowed by default.
    dep = wait_for(lambda: deployment(kube, ns, "tpu"), what="the TPU server's Deployment", diagnose=default_operator.tail)
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"] == "1"
