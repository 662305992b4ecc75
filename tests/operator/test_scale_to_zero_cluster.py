"""Scale to zero that holds requests, end to end: KEDA's operator (github.com/kedacore/keda/v2, cmd/operator) and
the KEDA HTTP add-on's interceptor and external scaler (github.com/kedacore/http-add-on, interceptor/, scaler/),
all built from their Go modules (tests/cluster/build_binaries.sh), on the local control plane, in front of a real
`python -m gemma_server` answering for a kwok pod, and the real `openai` SDK as the client.

The operator makes the ScaledObject (its external-push trigger naming the add-on's scaler at the operator's
default address) and the HTTPScaledObject. The add-on's own operator is not run: with the
skip-scaledobject-creation annotation the objects it would make are ours, and the interceptor and scaler read the
HTTPScaledObject themselves. All three run with the control plane's admin credentials: their RBAC is not what is
tested here.

What a cluster gives these processes and this machine does not, the test stands in for, and nothing else:
- cluster DNS: the interceptor sends a request to <service>.<namespace>:<port> (interceptor/middleware/
  routing.go) and KEDA dials the scaler at keda-add-ons-http-external-scaler.keda:9090. Each runs in a mount
  namespace of its own (`unshare --mount`) whose /etc/hosts names those hosts with this machine's address;
- pod networking and a boot: the server's kwok pod turns Ready BOOT_SECONDS after it is made
  (fake.gemmarust.dev/ready-after), at this machine's non-loopback address, where the real server listens (EndpointSlices refuse loopback addresses, and the interceptor waits for a ready endpoint of the
  Service, interceptor/forward_wait_func.go); the interceptor's admin Service, which the scaler reads the
  request counts through (scaler/queue_pinger.go), gets an EndpointSlice with that address by hand.
- KEDA's metrics API server is not run: it serves the HPA that scales from 1 replica up, and this test is about
  0 and 1, which KEDA's operator does itself.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import ipaddress
import json
import socket
import struct
import time
import urllib.request

import pytest

from tests.cluster.controlplane import BIN_DIR, KEDA, KEDA_HTTP_INTERCEPTOR, KEDA_HTTP_SCALER, POD_IP_ANNOTATION, \
    READY_AFTER_ANNOTATION, free_port
from tests.cluster.crds import HTTP_SCALED_OBJECTS, KEDA_OPERATOR_CRDS, installed

from .harness import Binary, create, gemma_server, get, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SERVER = "gemma"
KEDA_NS = "keda"
SCALER_HOST, SCALER_PORT = "keda-add-ons-http-external-scaler.keda", 9090  # the operator's default
ADMIN_SERVICE = "keda-add-ons-http-interceptor-admin"
IDLE_SECONDS = 30
SIOCGIFADDR = 0x8915
BOOT_SECONDS = 8  # the kwok pod turns Ready this long after it is made: a server booting
REQUESTS_AT_ZERO = 3


def host_address() -> str:
    """This machine's first IPv4 address that an EndpointSlice takes: not loopback, not link-local (each
    interface's address as the kernel reports it, SIOCGIFADDR from linux/sockios.h)."""
    found = []
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
        address = ipaddress.IPv4Address(packed[20:24])
        found.append(f"{name} {address}")
        if not (address.is_loopback or address.is_link_local):
            return str(address)
    raise AssertionError(f"no non-loopback IPv4 address on this machine ({found}): the kwok pod's EndpointSlice "
                         "needs one")


@pytest.fixture(scope="module")
def address():
    return host_address()


@pytest.fixture(scope="module")
def real_server_port(chat_checkpoint, tmp_path_factory, address):  # chat_checkpoint: tests/checkpoints/fixtures.py
    with gemma_server(chat_checkpoint, tmp_path_factory.mktemp("gemma_server"), host=address) as url:
        yield int(url.rsplit(":", 1)[1])


def _admin_service(cluster, address: str, port: int) -> None:
    """The interceptor's admin Service in namespace keda, its one endpoint this machine (no pod: the
    EndpointSlice is written by hand, labelled with its Service as the EndpointSlice controller would)."""
    objects = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KEDA_NS}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": ADMIN_SERVICE, "namespace": KEDA_NS},
         "spec": {"ports": [{"name": "admin", "port": port}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": ADMIN_SERVICE, "namespace": KEDA_NS,
                      "labels": {"kubernetes.io/service-name": ADMIN_SERVICE}},
         "addressType": "IPv4", "ports": [{"name": "admin", "port": port}],
         "endpoints": [{"addresses": [address], "conditions": {"ready": True}}]},
    ]
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": objects}))


@pytest.fixture
def keda(cluster, ns, address, tmp_path):
    """KEDA's operator, the add-on's interceptor and scaler, running and ready; yields the interceptor's proxy
    port and the three processes (interceptor, scaler, KEDA)."""
    for crd in (*KEDA_OPERATOR_CRDS, HTTP_SCALED_OBJECTS):
        installed(cluster, crd)
    proxy, admin = free_port(), free_port()
    _admin_service(cluster, address, admin)
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{address} {SCALER_HOST} {SERVER}.{ns}\n")
    kubeconfig = str(cluster.cp.kubeconfig)
    certs = tmp_path / "keda-certs"  # KEDA's gRPC metrics service reads ca.crt, tls.crt, tls.key from --cert-dir
    certs.mkdir()
    for src, dst in (("ca.crt", "ca.crt"), ("apiserver.crt", "tls.crt"), ("apiserver.key", "tls.key")):
        (certs / dst).write_bytes((cluster.cp.workdir / src).read_bytes())
    common = {"KUBECONFIG": kubeconfig}
    keda_probe = free_port()
    procs = [
        Binary("interceptor", [str(BIN_DIR / KEDA_HTTP_INTERCEPTOR)], {
            **common, "KEDA_HTTP_CURRENT_NAMESPACE": KEDA_NS, "KEDA_HTTP_PROXY_PORT": str(proxy),
            "KEDA_HTTP_ADMIN_PORT": str(admin), "OTEL_PROM_EXPORTER_PORT": str(free_port())},
            tmp_path / "interceptor.log", hosts=hosts),
        Binary("scaler", [str(BIN_DIR / KEDA_HTTP_SCALER)], {
            **common, "KEDA_HTTP_SCALER_PORT": str(SCALER_PORT), "KEDA_HTTP_SCALER_TARGET_ADMIN_NAMESPACE": KEDA_NS,
            "KEDA_HTTP_SCALER_TARGET_ADMIN_SERVICE": ADMIN_SERVICE,
            "KEDA_HTTP_SCALER_TARGET_ADMIN_DEPLOYMENT": "keda-add-ons-http-interceptor",
            "KEDA_HTTP_SCALER_TARGET_ADMIN_PORT": str(admin)},
            tmp_path / "scaler.log", hosts=hosts),
        Binary("keda", [str(BIN_DIR / KEDA), "--leader-elect=false", f"--cert-dir={certs}",
                         f"--metrics-bind-address=127.0.0.1:{free_port()}",
                         f"--health-probe-bind-address=127.0.0.1:{keda_probe}",
                         f"--metrics-service-bind-address=127.0.0.1:{free_port()}", f"--ca-dir={certs}"], {
            **common, "WATCH_NAMESPACE": "", "POD_NAMESPACE": KEDA_NS, "KEDA_CLUSTER_OBJECT_NAMESPACE": KEDA_NS},
            tmp_path / "keda.log", hosts=hosts),
    ]
    try:
        # Ready: the interceptor answers a kubelet's probe (its User-Agent) with 200 once its routing table has
        # synced (interceptor/middleware/routing.go isProbe, handler/probe.go); KEDA's manager its /readyz.
        for url, headers, p in ((f"http://127.0.0.1:{proxy}/", {"User-Agent": "kube-probe/1.37"}, procs[0]),
                                (f"http://127.0.0.1:{keda_probe}/readyz", {}, procs[2])):
            wait_for(lambda: _answers(url, headers, p), timeout=60, what=f"{p.name} ready", diagnose=p.tail)
        yield proxy, procs
    finally:
        for p in procs:
            p.stop()


def _answers(url: str, headers: dict[str, str], proc: Binary) -> bool:
    proc.check()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _diagnose(operator, procs):
    return lambda: "\n".join([operator.tail(30), *(p.tail() for p in procs)])


def _pods(kube, ns: str) -> list[dict]:
    return [p for p in kube.request("GET", f"/api/v1/namespaces/{ns}/pods")["items"]
            if not p["metadata"].get("deletionTimestamp")]


def _replicas(kube, ns: str) -> int:
    dep = kube.get_if_present("apps/v1", "Deployment", ns, SERVER)
    return (dep or {}).get("spec", {}).get("replicas", -1)


def test_a_request_at_zero_wakes_the_server_is_answered_and_the_server_goes_back_to_zero(
        cluster, kube, ns, operator, keda, address, real_server_port):
    import openai

    proxy, procs = keda
    diagnose = _diagnose(operator, procs)
    create(kube, ns, SERVER, {
        "model": {"source": "hf://google/gemma-4-e2b-it"}, "accelerator": {"type": "cpu"},
        "server": {"port": real_server_port},
        "podAnnotations": {POD_IP_ANNOTATION: address, READY_AFTER_ANNOTATION: f"{BOOT_SECONDS}s"},
        "autoscaling": {"minReplicas": 0, "maxReplicas": 1, "target": 4, "idleSeconds": IDLE_SECONDS,
                        "wakeTimeoutSeconds": 300}})

    def phase() -> str:
        for p in procs:
            p.check()
        return (get(kube, ns, SERVER).get("status") or {}).get("phase", "")

    # Up first (spec.replicas 1), then, with no request, KEDA takes it to zero after the idle window.
    wait_for(lambda: phase() == "Ready", timeout=120 + BOOT_SECONDS, what="the server Ready", diagnose=diagnose)
    wait_for(lambda: phase() == "Idle", timeout=IDLE_SECONDS + 150, what="KEDA to scale the idle server to zero",
             diagnose=diagnose)
    assert _replicas(kube, ns) == 0
    wait_for(lambda: not _pods(kube, ns), timeout=60, what="the last pod to go", diagnose=diagnose)

    # Requests sent at zero, through the interceptor, with the Service's name as their host.
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy}/v1", api_key="none", timeout=300, max_retries=0,
                           default_headers={"Host": f"{SERVER}.{ns}"})

    def ask(i: int) -> str:
        reply = client.chat.completions.create(model="gemma-tiny", max_tokens=4, temperature=0,
                                               messages=[{"role": "user", "content": f"hello {i}"}])
        assert reply.choices[0].finish_reason in ("length", "stop")
        return reply.choices[0].message.content

    sent = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(REQUESTS_AT_ZERO) as pool:
        futures = [pool.submit(ask, i) for i in range(REQUESTS_AT_ZERO)]
        answers = [f.result(timeout=360) for f in futures]
    waited = time.monotonic() - sent
    assert len(answers) == REQUESTS_AT_ZERO and all(isinstance(a, str) for a in answers), answers
    # Held while the pod booted, not refused: none came back before the pod could be Ready.
    assert waited >= BOOT_SECONDS, waited
    print(f"{REQUESTS_AT_ZERO} requests sent at zero answered after {waited:.1f} s (pod Ready after {BOOT_SECONDS} s)")

    # The status went Idle -> Waking -> Ready and kept the wake: when it began, when a replica was ready, how long.
    wait_for(lambda: phase() == "Ready", timeout=60, what="the woken server Ready", diagnose=diagnose)
    wake = get(kube, ns, SERVER)["status"]["wake"]
    assert set(wake) == {"startedAt", "readyAt", "seconds"}, wake
    assert BOOT_SECONDS - 2 <= wake["seconds"] <= waited + 5, (wake, waited)
    phases = [e["reason"] for e in kube.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
              if e["involvedObject"].get("kind") == "GemmaRustServer"]
    assert "Idle" in phases and "Waking" in phases, phases

    # And back to zero once the idle window passes without a request.
    wait_for(lambda: phase() == "Idle", timeout=IDLE_SECONDS + 150, what="the server back to zero",
             diagnose=diagnose)
    assert _replicas(kube, ns) == 0
