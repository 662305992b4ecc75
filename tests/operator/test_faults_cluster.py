"""Faults: the operator (a real `kopf run` process with exactly rbac.RULES) converges to Ready after each, with
one Deployment, one Service and `replicas` pods per GemmaRustServer (no duplicate children) and a complete
status (nothing written before the fault lost).

The faults that stop a control-plane component (kube-apiserver, etcd) or kill the operator run on a control
plane of this module's own (`private`), so the session's cluster and its operator never see them; so does
the burst of 100 GemmaRustServers, whose operator's memory is measured alone. A hand edit of a child and a
deleted token Secret are ordinary events, tried on the session's cluster.

Every wait is for a condition with a deadline: a component is down until the API server's /readyz says so
and the operator has seen the failure, never for a fixed time.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import yaml

from gemma_operator.kube import Kube
from tests.cluster.controlplane import BOOT_ANNOTATION, FAKE_KUBELET
from tests.cluster.plugin import Cluster, running_cluster

from .fakes import FakeKubelet
from .harness import (GRS_PATH, ROOT, Operator, condition, create, create_namespace, dump, get, install_crd,
                      least_privilege_kubeconfig, start_operator, stop_operator, wait_for)

pytestmark = pytest.mark.cluster

CPU = {"type": "cpu"}
SPEC = {"model": {"source": "hf://google/gemma-4-e2b-it"}, "accelerator": CPU}
LABELS = "app.kubernetes.io/name=gemma-rust-server"


class Private(NamedTuple):
    cluster: Cluster
    kube: Kube
    operator: Operator


@pytest.fixture(scope="module")
def private(tmp_path_factory) -> Iterator[Private]:
    """A control plane and an operator of this module's own, for faults the session's cluster must not see."""
    with running_cluster(tmp_path_factory.mktemp("k8s-faults")) as c:
        kube = Kube(c.api)
        install_crd(c)
        c.cp.restart("kube-controller-manager")  # its garbage collector learns the new kind now (see restart())
        d = tmp_path_factory.mktemp("faults-operator")
        op = start_operator(least_privilege_kubeconfig(c, kube, d / "kubeconfig"), d / "operator.log")
        try:
            yield Private(c, kube, op)
        finally:
            stop_operator(op)


@pytest.fixture
def private_ns(private) -> Iterator[str]:
    name = create_namespace(private.kube, f"f-{uuid.uuid4().hex[:8]}")
    yield name
    private.cluster.kubectl("delete", "grs", "--all", "-n", name, "--wait=true", "--timeout=60s")
    private.kube.request("DELETE", f"/api/v1/namespaces/{name}")


# ---------------------------------------------------------------------------------------------------------
# What converged means


def children(kube: Kube, ns: str) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """GemmaRustServer name -> {"Deployment": [...], "Service": [...], "Pod": [...] (live ones)}."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    lists = {"Deployment": f"/apis/apps/v1/namespaces/{ns}/deployments",
             "Service": f"/api/v1/namespaces/{ns}/services", "Pod": f"/api/v1/namespaces/{ns}/pods"}
    for kind, path in lists.items():
        for obj in kube.request("GET", path, query={"labelSelector": LABELS})["items"]:
            if obj["metadata"].get("deletionTimestamp"):
                continue
            owner = obj["metadata"]["labels"]["app.kubernetes.io/instance"]
            out.setdefault(owner, {"Deployment": [], "Service": [], "Pod": []})[kind].append(obj)
    return out


HANDLED = "gemmarust.dev/last-handled-configuration"  # kopf's mark of a spec its handler finished with


def converged(kube: Kube, ns: str, names: list[str], replicas: int = 1) -> dict[str, dict[str, Any]] | None:
    """Each of `names` Ready at its generation with a complete status, exactly its own children, and its
    create/update handler done (kopf's mark, which a handler still waiting for a retry lacks); else None."""
    got = {n: get(kube, ns, n) for n in names}
    kids = children(kube, ns)
    for name, obj in got.items():
        st = obj.get("status") or {}
        mine = kids.get(name, {})
        if (st.get("phase") != "Ready" or st.get("observedGeneration") != obj["metadata"]["generation"]
                or HANDLED not in (obj["metadata"].get("annotations") or {})
                or st.get("readyText") != f"{replicas}/{replicas}" or condition(obj, "Ready").get("status") != "True"
                or [len(mine.get(k, [])) for k in ("Deployment", "Service", "Pod")] != [1, 1, replicas]):
            return None
    return got


def wait_converged(kube: Kube, ns: str, names: list[str], operator: Operator, *, timeout: float = 90,
                   replicas: int = 1) -> dict[str, dict[str, Any]]:
    def diagnose() -> str:
        kids = children(kube, ns)
        rows = [f"{n}: {(get(kube, ns, n).get('status') or {}).get('phase')} children "
                f"{ {k: len(v) for k, v in kids.get(n, {}).items()} }" for n in names]
        return "\n".join(rows) + "\n" + operator.tail(30)
    return wait_for(lambda: converged(kube, ns, names, replicas), timeout=timeout,
                    what=f"{', '.join(names)} Ready with exactly their children", diagnose=diagnose)


def assert_status_kept(before: dict[str, Any], after: dict[str, Any]) -> None:
    """What the operator wrote before a fault is still there after it: same phase, endpoint and conditions,
    and the Ready condition did not flap (its lastTransitionTime is the one from before)."""
    b, a = before["status"], after["status"]
    assert (a["phase"], a["endpoint"], a["selector"], a["readyText"]) == (
        b["phase"], b["endpoint"], b["selector"], b["readyText"])
    assert [c["type"] for c in a["conditions"]] == [c["type"] for c in b["conditions"]]
    assert condition(after, "Ready")["lastTransitionTime"] == condition(before, "Ready")["lastTransitionTime"]


def logged_since(operator: Operator, mark: int, *needles: str) -> bool:
    """Whether the operator's log, after byte offset `mark`, has a line with any of `needles`."""
    with open(operator.log, "rb") as fh:
        fh.seek(mark)
        text = fh.read().decode(errors="replace")
    return any(n in text for n in needles)


def log_size(operator: Operator) -> int:
    return operator.log.stat().st_size


# The operator's words for an API server it cannot reach (gemma_operator.kube.ApiError for a failed
# connection; kopf's own watcher and its retries). With etcd down the API server takes requests and does not
# answer them: the first sign is urllib3's read timeout (20 s), logged as it retries; the ApiError comes only
# once its retries are spent, more than a minute later.
UNREACHABLE = ("could not reach the API server", "Connection refused", "ServerDisconnectedError",
               "ClientConnectorError", "ReadTimeoutError", "HTTP 500", "HTTP 503", "HTTP 504")


# ---------------------------------------------------------------------------------------------------------
# Control-plane faults (private control plane)


def _converges_across_an_outage(private, ns, component: str, names: list[str], down=None, what="") -> None:
    """Let "before" converge, create `names`, and stop `component` while the operator works on them; wait
    until `down()` holds (when given) and the operator has met the outage, then restart it. Everything
    converges within kopf's default retry delay (60 s: the handlers that failed meanwhile retry in seconds),
    "before" keeps its status and the operator lives."""
    c, kube, op = private
    create(kube, ns, "before", SPEC)
    before = wait_converged(kube, ns, ["before"], op)["before"]
    for n in names:
        create(kube, ns, n, SPEC)
    mark = log_size(op)
    c.cp.stop_component(component)
    try:
        if down is not None:
            wait_for(down, timeout=60, what=f"/readyz to report {component} down")
        wait_for(lambda: logged_since(op, mark, *UNREACHABLE), timeout=60, what=f"the operator to meet {what}",
                 diagnose=op.tail)
    finally:
        c.cp.start_component(component)
        c.cp.wait_ready()
    got = wait_converged(kube, ns, ["before", *names], op, timeout=45)
    assert_status_kept(before, got["before"])
    assert op.alive()


def test_api_server_stopped_and_restarted_mid_reconcile_converges(private, private_ns):
    _converges_across_an_outage(private, private_ns, "kube-apiserver", [f"mid-{i}" for i in range(3)],
                                what="the stopped API server")


def test_etcd_unavailable_for_a_few_seconds_converges(private, private_ns):
    # Down as the API server sees it (its etcd readiness check fails), and met by the operator.
    c = private[0]
    _converges_across_an_outage(private, private_ns, "etcd", ["during-0", "during-1"],
                                down=lambda: c.cp.readyz()[0] not in (0, 200), what="the unavailable store")


def test_operator_killed_mid_reconcile_and_restarted_converges_and_catches_up(private, private_ns):
    c, kube, op = private
    ns = private_ns
    create(kube, ns, "before", SPEC)
    before = wait_converged(kube, ns, ["before"], op)["before"]
    names = [f"k-{i}" for i in range(3)]
    for n in names:
        create(kube, ns, n, SPEC)
    # Mid-reconcile: the first child of the new ones exists, not all of them are Ready.
    wait_for(lambda: any(children(kube, ns).get(n, {}).get("Deployment") for n in names), timeout=60,
             what="a new Deployment", diagnose=op.tail)
    op.proc.send_signal(signal.SIGKILL)
    assert op.proc.wait(timeout=10) == -signal.SIGKILL
    # While it is dead: a spec change and a deleted child, which the restarted operator must catch up on.
    kube.request("PATCH", f"{GRS_PATH.format(ns=ns)}/before", {"spec": {"image": "example.com/server:2"}},
                 content_type="application/merge-patch+json")
    kube.request("DELETE", f"/apis/apps/v1/namespaces/{ns}/deployments/k-0")
    op.start()
    got = wait_converged(kube, ns, ["before", *names], op, timeout=120)
    dep = kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/before")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "example.com/server:2"
    assert got["before"]["status"]["observedGeneration"] == 2
    assert got["before"]["status"]["endpoint"] == before["status"]["endpoint"]


def test_burst_of_100_created_and_deleted_leaves_no_children(private, private_ns):
    c, kube, op = private
    ns = private_ns
    names = [f"b-{i:03d}" for i in range(100)]
    rss_start = op.rss_bytes()
    for n in names:
        create(kube, ns, n, SPEC)
    wait_converged(kube, ns, names, op, timeout=240)
    rss_peak = op.rss_bytes()
    c.kubectl("delete", "grs", "--all", "-n", ns, "--wait=false")

    def gone() -> bool:
        left = [*kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments")["items"],
                *kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/replicasets")["items"],
                *kube.request("GET", f"/api/v1/namespaces/{ns}/services")["items"],
                *kube.request("GET", f"/api/v1/namespaces/{ns}/pods")["items"],
                *kube.request("GET", f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets")["items"],
                *kube.request("GET", GRS_PATH.format(ns=ns))["items"]]
        return not left
    wait_for(gone, timeout=180, interval=1, what="every GemmaRustServer and child to go", diagnose=op.tail)
    rss_end = op.rss_bytes()
    mib = 1 << 20
    print(f"operator RSS: {rss_start / mib:.1f} MiB before, {rss_peak / mib:.1f} MiB with 100 Ready, "
          f"{rss_end / mib:.1f} MiB after deleting them")
    # The chart's values.yaml promises a few hundred GemmaRustServers stay well under its resources.
    request = chart_memory_request()
    assert max(rss_peak, rss_end) < request, f"RSS above the chart's memory request {request / mib:.0f} MiB"
    assert op.alive()


def chart_memory_request() -> int:
    """The operator container's memory request in the chart's values.yaml, in bytes (Mi or Gi)."""
    values = yaml.safe_load((ROOT / "charts" / "gemma-rust-operator" / "values.yaml").read_text())
    text = values["resources"]["requests"]["memory"]
    return int(text[:-2]) << {"Mi": 20, "Gi": 30}[text[-2:]]


# ---------------------------------------------------------------------------------------------------------
# Faults in a namespace (the session's cluster)


def deployment(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    return kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/{name}")


def test_hand_edited_deployment_is_restored_and_deleted_one_recreated(kube, ns, operator):
    create(kube, ns, "d", {**SPEC, "replicas": 2})
    wait_converged(kube, ns, ["d"], operator, replicas=2)
    dep = deployment(kube, ns, "d")
    image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
    # As `kubectl edit` would: another field manager changes fields the operator owns.
    edit = {"spec": {"replicas": 5, "template": {"spec": {"containers": [{"name": "server", "image": "evil:1"}]}}}}
    kube.request("PATCH", f"/apis/apps/v1/namespaces/{ns}/deployments/d", edit,
                 content_type="application/strategic-merge-patch+json")

    def restored() -> bool:
        d = deployment(kube, ns, "d")
        return d["spec"]["replicas"] == 2 and d["spec"]["template"]["spec"]["containers"][0]["image"] == image
    wait_for(restored, what="the edited Deployment put back", diagnose=operator.tail)
    kube.request("DELETE", f"/apis/apps/v1/namespaces/{ns}/deployments/d")
    back = wait_for(lambda: (lambda d: d if d["metadata"]["uid"] != dep["metadata"]["uid"] else None)(
        deployment(kube, ns, "d")), what="the Deployment to come back", diagnose=operator.tail)
    assert back["metadata"]["ownerReferences"][0]["name"] == "d"
    got = wait_converged(kube, ns, ["d"], operator, replicas=2)
    assert {p["spec"]["containers"][0]["image"] for p in children(kube, ns)["d"]["Pod"]} == {image}
    assert got["d"]["status"]["readyReplicas"] == 2


def test_token_secret_deleted_while_serving_degrades_only_when_a_container_restarts(kube, ns, operator):
    """The kubelet resolves a secretKeyRef when it starts a container, so deleting the token Secret leaves
    running servers serving (the token only downloads weights at boot) and the operator, which may not read
    Secrets, has nothing to report. When a container restarts, the kubelet cannot start it again
    (CreateContainerConfigError `secret "hf" not found`): then the status is Degraded with SecretNotFound
    while the other replica serves, and the operator touches no pod."""
    kubelet = FakeKubelet(kube)
    kube.request("POST", f"/api/v1/namespaces/{ns}/secrets",
                 {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf"}, "stringData": {"token": "x"}})
    create(kube, ns, "tok", {"model": {"source": "hf://google/gated", "tokenSecret": {"name": "hf"}},
                             "accelerator": CPU, "replicas": 2, "podAnnotations": {BOOT_ANNOTATION: FAKE_KUBELET}})
    pods = wait_for(lambda: (lambda ps: ps if len(ps) == 2 and all(p["spec"].get("nodeName") for p in ps) else None)(
        children(kube, ns).get("tok", {}).get("Pod", [])), what="two bound pods", diagnose=operator.tail)
    for p in pods:
        kubelet.start(p)
    ready = wait_converged(kube, ns, ["tok"], operator, replicas=2)["tok"]
    generation = deployment(kube, ns, "tok")["metadata"]["generation"]
    kube.request("DELETE", f"/api/v1/namespaces/{ns}/secrets/hf")
    restarted, serving = sorted(pods, key=lambda p: p["metadata"]["name"])
    kubelet.fail_config(restarted, 'secret "hf" not found')

    def degraded():
        obj = get(kube, ns, "tok")
        return obj if condition(obj, "Degraded").get("reason") == "SecretNotFound" else None
    obj = wait_for(degraded, what="Degraded with SecretNotFound",
                   diagnose=lambda: dump(get(kube, ns, "tok").get("status")) + "\n" + operator.tail(20))
    st = obj["status"]
    assert (st["phase"], st["reason"], st["readyText"]) == ("Degraded", "SecretNotFound", "1/2")
    assert condition(obj, "Degraded")["message"].startswith(
        f'pod {restarted["metadata"]["name"]}: Secret "hf" not found in namespace {ns}')
    assert condition(obj, "Ready")["status"] == "False" and ready["status"]["endpoint"] == st["endpoint"]
    # Untouched: the same two pods, the serving one still Ready, the Deployment not rolled.
    now = {p["metadata"]["name"]: p for p in children(kube, ns)["tok"]["Pod"]}
    assert {p["metadata"]["uid"] for p in now.values()} == {p["metadata"]["uid"] for p in pods}
    assert any(c["type"] == "Ready" and c["status"] == "True"
               for c in now[serving["metadata"]["name"]]["status"]["conditions"])
    assert deployment(kube, ns, "tok")["metadata"]["generation"] == generation
