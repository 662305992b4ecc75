"""Why a pod is stuck, end to end: a FakeKubelet writes a pod's status and Events as the kubelet would, the real
operator (a `kopf run` process with exactly rbac.RULES, no Secrets rule) reads them, and `kubectl get grs -o wide`
shows the reason and the message. Also: standard capacity never lands on a reclaimable node."""

from __future__ import annotations

import pytest

from tests.cluster.controlplane import BOOT_ANNOTATION, FAKE_KUBELET

from .fakes import FakeKubelet
from .harness import condition, create, dump, get, wait_for

pytestmark = pytest.mark.cluster

CPU = {"type": "cpu"}
FAKE = {BOOT_ANNOTATION: FAKE_KUBELET}
PERMISSION = ('MountVolume.SetUp failed for volume "model" : rpc error: code = PermissionDenied desc = failed to '
              'get GCS bucket "weights": googleapi: Error 403: Caller does not have storage.objects.list access to '
              "the Google Cloud Storage bucket. Permission 'storage.objects.list' denied on resource (or it may not "
              "exist)., forbidden")


@pytest.fixture
def kubelet(kube):
    return FakeKubelet(kube)


def grs_row(cluster, ns: str, name: str) -> dict[str, str]:
    """One row of `kubectl get grs -o wide` as {column: text}, cut at the header's column starts."""
    header, row = cluster.kubectl("get", "grs", name, "-n", ns, "-o", "wide").stdout.splitlines()[:2]
    names = header.split()
    starts = [header.index(n) for n in names]
    return {n: row[a:b].strip() for n, a, b in zip(names, starts, starts[1:] + [len(row)])}


def bound_pod(kube, ns, name, operator, *, after=()):
    """The live pod of `name` the scheduler bound (and not one of `after`)."""
    def find():
        pods = kube.list_pods(ns, f"app.kubernetes.io/instance={name},app.kubernetes.io/name=gemma-rust-server")
        return next((p for p in pods if p["spec"].get("nodeName") and p["metadata"]["name"] not in after
                     and not p["metadata"].get("deletionTimestamp")
                     and (p.get("status") or {}).get("phase") not in ("Failed", "Succeeded")), None)
    return wait_for(find, what=f"a pod of {name} bound to a node", diagnose=operator.tail)


def shows(cluster, kube, ns, name, operator, reason, *, phase=None, message=None, timeout=45):
    """Wait until `kubectl get grs -o wide` shows `reason` (and `phase`, and `message`); return the row."""
    def row():
        r = grs_row(cluster, ns, name)
        wanted = (phase is None or r["PHASE"] == phase) and (message is None or r["MESSAGE"] == message)
        return r if r["REASON"] == reason and wanted else None
    return wait_for(row, timeout=timeout, what=f"{name} to show reason {reason}",
                    diagnose=lambda: str(grs_row(cluster, ns, name)) + "\n" + dump(get(kube, ns, name).get("status"))
                    + "\n" + operator.tail(20))


def test_gcs_permission_denied_mount_shows_the_error_and_the_pods_service_account(cluster, kube, ns, operator,
                                                                                   kubelet):
    kube.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts",
                 {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "gemma-reader"}})
    create(kube, ns, "gcs", {"model": {"source": "gs://weights/gemma-4-e2b"}, "accelerator": CPU,
                             "serviceAccountName": "gemma-reader", "podAnnotations": FAKE})
    pod = bound_pod(kube, ns, "gcs", operator)
    kubelet.fail_mount(pod, PERMISSION)
    row = shows(cluster, kube, ns, "gcs", operator, "GcsFusePermissionDenied", phase="Failed")
    assert row["MESSAGE"].startswith(f"pod {pod['metadata']['name']}: {PERMISSION} (the pod runs as ServiceAccount "
                                     f"{ns}/gemma-reader; grant it roles/storage.objectViewer on the bucket")
    assert condition(get(kube, ns, "gcs"), "Ready")["reason"] == "GcsFusePermissionDenied"
    # The role is granted; the kubelet's next mount attempt succeeds and the container starts.
    kubelet.start(pod)
    shows(cluster, kube, ns, "gcs", operator, "AllReplicasReady", phase="Ready")


def test_sandbox_failure_shows_the_runtimes_message(cluster, kube, ns, operator, kubelet):
    create(kube, ns, "sb", {"model": {"source": "hf://o/m"}, "accelerator": CPU, "podAnnotations": FAKE})
    pod = bound_pod(kube, ns, "sb", operator)
    msg = ('Failed to create pod sandbox: rpc error: code = Unknown desc = failed to setup network for sandbox '
           '"4f1c": plugin type="cilium-cni" failed (add): unable to allocate IP')
    kubelet.fail_sandbox(pod, msg)
    row = shows(cluster, kube, ns, "sb", operator, "FailedCreatePodSandBox", phase="Failed")
    assert row["MESSAGE"] == f"pod {pod['metadata']['name']}: {msg}"


def test_image_pull_back_off_shows_the_pull_error_not_just_back_off(cluster, kube, ns, operator, kubelet):
    create(kube, ns, "img", {"model": {"source": "hf://o/m"}, "accelerator": CPU, "podAnnotations": FAKE,
                             "image": "example.com/gemma-server:9.9"})
    pod = bound_pod(kube, ns, "img", operator)
    error = ('rpc error: code = NotFound desc = failed to pull and unpack image "example.com/gemma-server:9.9": '
             'not found')
    kubelet.fail_pull(pod, error)
    row = shows(cluster, kube, ns, "img", operator, "ImagePullBackOff", phase="Failed")
    assert row["MESSAGE"] == (f"pod {pod['metadata']['name']}: container server: Failed to pull image "
                              f'"example.com/gemma-server:9.9": {error}')


def test_oom_killed_server_shows_its_memory_limit(cluster, kube, ns, operator, kubelet):
    create(kube, ns, "oom", {"model": {"source": "hf://o/m"}, "accelerator": CPU, "podAnnotations": FAKE,
                             "resources": {"limits": {"memory": "8Gi"}}})
    pod = bound_pod(kube, ns, "oom", operator)
    kubelet.oom_kill(pod, restarts=2)
    row = shows(cluster, kube, ns, "oom", operator, "OOMKilled", phase="Failed")
    assert row["MESSAGE"].startswith(f"pod {pod['metadata']['name']}: container server was killed for exceeding its "
                                     "memory limit 8Gi (exit code 137, 2 restarts)")
    assert get(kube, ns, "oom")["status"]["lastFailure"]["reason"] == "OOMKilled"


def test_missing_token_secret_is_reported_from_the_pods_config_error(cluster, kube, ns, operator, kubelet):
    # The operator cannot read Secrets (no rule in rbac.RULES); the kubelet can, and says so.
    create(kube, ns, "tok", {"model": {"source": "hf://google/gated", "tokenSecret": {"name": "hf"}},
                             "accelerator": CPU, "podAnnotations": FAKE})
    pod = bound_pod(kube, ns, "tok", operator)
    env = pod["spec"]["containers"][0]["env"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in env
    kubelet.fail_config(pod, 'secret "hf" not found')
    row = shows(cluster, kube, ns, "tok", operator, "SecretNotFound", phase="Failed")
    assert row["MESSAGE"] == (f'pod {pod["metadata"]["name"]}: Secret "hf" not found in namespace {ns}: container '
                              "server reads it through secretKeyRef (spec.model.tokenSecret); create it with the "
                              "Hugging Face token")
    kube.request("POST", f"/api/v1/namespaces/{ns}/secrets",
                 {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf"}, "stringData": {"token": "x"}})
    kubelet.start(pod)  # the kubelet retries, finds the Secret, starts the container
    shows(cluster, kube, ns, "tok", operator, "AllReplicasReady", phase="Ready")


def test_evicted_pod_leads_while_its_replacement_waits(cluster, kube, ns, operator, kubelet):
    create(kube, ns, "ev", {"model": {"source": "hf://o/m"}, "accelerator": CPU, "podAnnotations": FAKE})
    pod = bound_pod(kube, ns, "ev", operator)
    kubelet.start(pod)
    shows(cluster, kube, ns, "ev", operator, "AllReplicasReady", phase="Ready")
    msg = "The node was low on resource: memory. Threshold quantity: 100Mi, available: 51200Ki."
    kubelet.evict(pod, msg)
    shows(cluster, kube, ns, "ev", operator, "Evicted", phase="Scheduling")
    new = bound_pod(kube, ns, "ev", operator, after=(pod["metadata"]["name"],))
    # Once the replacement is bound (until then the row says it waits for the scheduler), the eviction
    # still leads and the row says where the replacement is.
    row = shows(cluster, kube, ns, "ev", operator, "Evicted", phase="Scheduling", message=(
        f"pod {pod['metadata']['name']} on node cpu-a: {msg}; now pod {new['metadata']['name']}: ContainerCreating"))
    assert row["READY/REPLICAS"] == "0/1"
    kubelet.start(new)
    shows(cluster, kube, ns, "ev", operator, "AllReplicasReady", phase="Ready")


def test_preempted_spot_pod_leads_while_its_replacement_waits_for_spot_capacity(cluster, kube, ns, operator, kubelet):
    create(kube, ns, "spot", {"model": {"source": "hf://o/m"}, "podAnnotations": FAKE,
                              "accelerator": {"topology": "2x2", "provisioning": "spot"}})
    pod = bound_pod(kube, ns, "spot", operator)
    node = pod["spec"]["nodeName"]
    assert node == "v5e-2x2-spot-a"
    kubelet.start(pod)
    shows(cluster, kube, ns, "spot", operator, "AllReplicasReady", phase="Ready")
    # GKE reclaims the node: it stops taking pods, and the kubelet shuts the pod down.
    cluster.kubectl("cordon", node)
    try:
        kubelet.shut_down_node(pod)
        shows(cluster, kube, ns, "spot", operator, "NodePreempted", phase="Scheduling")
        # Then the replacement's own wait follows: the scheduler's message once it has tried.
        row = wait_for(lambda: (lambda r: r if "nodes are available" in r["MESSAGE"] else None)(
            grs_row(cluster, ns, "spot")), what="the scheduler's message after the preemption", diagnose=operator.tail)
        assert (row["PHASE"], row["REASON"]) == ("Scheduling", "NodePreempted")
        assert row["MESSAGE"].startswith(
            f"pod {pod['metadata']['name']} on spot node {node}: Pod was terminated in response to imminent node "
            "shutdown. (GKE reclaimed the node; a replacement waits for spot capacity); now pod ")
    finally:
        cluster.kubectl("uncordon", node)


def test_standard_capacity_never_lands_on_a_spot_or_flex_start_node(cluster, kube, ns, operator):
    # Three 1x1 pods, two standard 1x1 nodes and a flex-start 1x1 node with room: the third pod waits.
    create(kube, ns, "std", {"model": {"source": "hf://o/m"}, "replicas": 3, "accelerator": {"topology": "1x1"}})

    def placed():
        pods = kube.list_pods(ns, "app.kubernetes.io/instance=std,app.kubernetes.io/name=gemma-rust-server")
        bound = sorted(p["spec"].get("nodeName") or "" for p in pods if not p["metadata"].get("deletionTimestamp"))
        return bound if len(bound) == 3 and bound.count("") == 1 else None
    assert wait_for(placed, what="two pods bound, one waiting", diagnose=operator.tail) == ["", "v5e-1x1-a",
                                                                                           "v5e-1x1-b"]
    shows(cluster, kube, ns, "std", operator, "Unschedulable", phase="Scheduling")


def test_spot_with_an_ephemeral_build_cache_warns_but_is_not_degraded(kube, ns, operator):
    create(kube, ns, "warn", {"model": {"source": "hf://o/m"}, "accelerator": {"topology": "2x2", "provisioning": "spot"}})
    obj = wait_for(lambda: (lambda o: o if condition(o, "Warning") and (o.get("status") or {}).get("phase") == "Ready"
                            else None)(get(kube, ns, "warn")), what="Ready with a Warning condition",
                   diagnose=operator.tail)
    warning = condition(obj, "Warning")
    assert (warning["status"], warning["reason"]) == ("True", "EphemeralBuildCache")
    assert "set spec.buildCache.type: pvc" in warning["message"]
    assert condition(obj, "Degraded")["status"] == "False"
