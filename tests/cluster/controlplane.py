"""A local Kubernetes control plane for tests and for trying the operator without a cloud.

Real etcd, kube-apiserver (RBAC on, TLS with certificates made here by openssl), kube-controller-manager
(garbage collector, Deployment/ReplicaSet, namespace controllers...) and kube-scheduler, all on loopback
ports picked free at start, plus kwok, which plays the kubelets: it keeps fake nodes Ready and moves the
pods the real scheduler binds to them through their lifecycle. The nodes mirror a GKE cluster with TPU v5e
node pools (GKE's labels, `google.com/tpu` capacity and the `google.com/tpu=present:NoSchedule` taint), so
the scheduler places or refuses the operator's pods exactly as it would on GKE.

The binaries come from tests/cluster/build_binaries.sh (built once into ~/.cache/gemma-rust-operator).

Fake kubelet behaviours (kwok stages), selected by pod annotations the tests put on their servers:
    fake.gemmarust.dev/boot: hold-unready   -> the container runs but never turns Ready (a server booting)
    fake.gemmarust.dev/boot: crash          -> the container crash-loops; its termination message is the
                                               annotation fake.gemmarust.dev/termination-message
    fake.gemmarust.dev/boot: fake-kubelet   -> left as the scheduler bound it (no stage matches): a test's
                                               FakeKubelet (tests/operator/fakes.py) writes its status and Events
    fake.gemmarust.dev/pod-ip: ADDRESS      -> Running and Ready with that pod IP (e.g. 127.0.0.1, where the
                                               test runs a real server for a client that reads pod IPs)
    fake.gemmarust.dev/ready-after: 8s      -> with pod-ip: Pending that long first (a server booting)
Every other pod becomes Running and Ready at once (kwok's own pod-ready stage).

Faults: `stop_component` / `start_component` stop one component (kube-apiserver, etcd) and bring it back with
its data, `wait_ready` waits for /readyz; tests/operator/test_faults_cluster.py uses them on a control
plane of its own, so the session's cluster never sees them.

Command line (keeps running until Ctrl-C):
    .venv/bin/python -m tests.cluster.controlplane up [--dir DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

K8S_VERSION = os.environ.get("K8S_VERSION", "1.37.2")
CACHE = Path(os.environ.get("GEMMA_CACHE", Path.home() / ".cache" / "gemma-rust-operator"))
BIN_DIR = Path(os.environ.get("GEMMA_K8S_CACHE", CACHE / f"k8s-v{K8S_VERSION}" / "bin"))
STAGES_DIR = BIN_DIR.parent / "kwok-stages"
BUILD_SCRIPT = Path(__file__).with_name("build_binaries.sh")
GIE_VERSION = os.environ.get("GIE_VERSION", "v1.5.0")  # the endpoint picker's release (tests/cluster/crds.py)
EPP = f"epp-{GIE_VERSION}"
KEDA_VERSION = os.environ.get("KEDA_VERSION", "v2.21.0")  # KEDA's operator and CRDs (tests/cluster/crds.py)
KEDA_HTTP_VERSION = os.environ.get("KEDA_HTTP_VERSION", "v0.12.0")  # the KEDA HTTP add-on
KEDA = f"keda-{KEDA_VERSION}"
KEDA_HTTP_INTERCEPTOR = f"keda-http-interceptor-{KEDA_HTTP_VERSION}"
KEDA_HTTP_SCALER = f"keda-http-scaler-{KEDA_HTTP_VERSION}"
BINARIES = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok", "helm", EPP,
            KEDA, KEDA_HTTP_INTERCEPTOR, KEDA_HTTP_SCALER]

BOOT_ANNOTATION = "fake.gemmarust.dev/boot"
TERMINATION_ANNOTATION = "fake.gemmarust.dev/termination-message"
POD_IP_ANNOTATION = "fake.gemmarust.dev/pod-ip"  # a Ready pod at this address (_pod_ip_stage)
READY_AFTER_ANNOTATION = "fake.gemmarust.dev/ready-after"  # with pod-ip: Ready only after this long (e.g. "8s")
FAKE_KUBELET = "fake-kubelet"  # BOOT_ANNOTATION value: no kwok stage, a FakeKubelet plays the kubelet
SERVICE_CIDR = "10.96.0.0/16"


class ControlPlaneError(RuntimeError):
    """The control plane could not be built or started; the message says which part and where its log is."""


def ensure_binaries(log: Path | None = None, *, helm_only: bool = False) -> Path:
    """Build the binaries once (slow: many minutes on two cores); later calls find them in the cache.

    Args:
        log: where the build's output goes (default: beside the cache).
        helm_only: build only helm (a minute or two), for the chart's static tests.
    Raises:
        ControlPlaneError: the build failed (the log's tail is in the message).
    """
    wanted = ["helm"] if helm_only else BINARIES
    if all((BIN_DIR / b).is_file() for b in wanted) and (helm_only or (STAGES_DIR / "pod-ready.yaml").is_file()):
        return BIN_DIR
    log = log or (CACHE / f"k8s-v{K8S_VERSION}-build{'-helm' if helm_only else ''}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log, "w") as fh:
        rc = subprocess.call(["bash", str(BUILD_SCRIPT), *(["helm"] if helm_only else [])], stdout=fh,
                             stderr=subprocess.STDOUT,
                             env={**os.environ, "K8S_VERSION": K8S_VERSION, "GIE_VERSION": GIE_VERSION,
                                  "KEDA_VERSION": KEDA_VERSION, "KEDA_HTTP_VERSION": KEDA_HTTP_VERSION})
    if rc != 0 or not all((BIN_DIR / b).is_file() for b in wanted):
        tail = log.read_text()[-3000:]
        raise ControlPlaneError(f"building {' '.join(wanted)} failed (exit {rc}); log {log}:\n{tail}")
    print(f"{' '.join(wanted)} built in {time.monotonic() - start:.0f}s into {BIN_DIR}", file=sys.stderr)
    return BIN_DIR


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path) -> None:
    """CA, API server serving cert, an admin client cert (system:masters) and the service-account key pair."""
    _openssl("genrsa", "-out", "ca.key", "2048", cwd=d)
    _openssl("req", "-x509", "-new", "-nodes", "-key", "ca.key", "-subj", "/CN=gemma-local-ca", "-days", "3650",
             "-out", "ca.crt", cwd=d)
    sans = ("subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
            "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:10.96.0.1")
    for name, subj, ext in (
            ("apiserver", "/CN=kube-apiserver", f"{sans}\nextendedKeyUsage=serverAuth\n"),
            ("admin", "/O=system:masters/CN=admin", "extendedKeyUsage=clientAuth\n")):
        (d / f"{name}.ext").write_text(ext)
        _openssl("genrsa", "-out", f"{name}.key", "2048", cwd=d)
        _openssl("req", "-new", "-key", f"{name}.key", "-subj", subj, "-out", f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "3650", "-out", f"{name}.crt", "-extfile", f"{name}.ext", cwd=d)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


def kubeconfig_text(server: str, d: Path, *, token: str | None = None, user: str = "admin") -> str:
    """A kubeconfig for `server`: the admin client certificate, or a bearer token when given."""
    creds: dict[str, Any] = {"token": token} if token else {
        "client-certificate": str(d / "admin.crt"), "client-key": str(d / "admin.key")}
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "local",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(d / "ca.crt")}}],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user, "namespace": "default"}}],
    })


def kwok_stages() -> str:
    """kwok's own stages for this release, with pod-ready skipping our fake boot behaviours, plus those."""
    docs = []
    for f in sorted(STAGES_DIR.glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(f.read_text()) if doc]
    ready = next(doc for doc in docs if doc["metadata"]["name"] == "pod-ready")
    ready["spec"]["selector"]["matchExpressions"].append(
        {"key": f'.metadata.annotations["{BOOT_ANNOTATION}"]', "operator": "DoesNotExist"})
    ready["spec"]["selector"]["matchExpressions"].append(
        {"key": f'.metadata.annotations["{POD_IP_ANNOTATION}"]', "operator": "DoesNotExist"})
    at_address = _pod_ip_stage(ready)
    docs += [_fake_stage("hold-unready"), _fake_stage("crash"), *_ready_after_variants(at_address)]
    return yaml.safe_dump_all(docs, sort_keys=False)


def _ready_after_variants(stage: dict[str, Any]) -> list[dict[str, Any]]:
    """`stage` for pods without fake.gemmarust.dev/ready-after, and a copy for pods with it that waits that long
    (a Go duration, e.g. "8s": kwok's Stage delay.durationFrom) before turning Ready: a server that boots."""
    now = copy.deepcopy(stage)
    now["spec"]["selector"]["matchExpressions"].append(
        {"key": f'.metadata.annotations["{READY_AFTER_ANNOTATION}"]', "operator": "DoesNotExist"})
    later = copy.deepcopy(stage)
    later["metadata"]["name"] += "-ready-after"
    later["spec"]["selector"]["matchExpressions"].append(
        {"key": f'.metadata.annotations["{READY_AFTER_ANNOTATION}"]', "operator": "Exists"})
    later["spec"]["delay"] = {"durationMilliseconds": 0, "durationFrom": {
        "jq": {"expression": f'.metadata.annotations["{READY_AFTER_ANNOTATION}"]'}}}
    return [now, later]


def _pod_ip_stage(ready: dict[str, Any]) -> dict[str, Any]:
    """kwok's pod-ready for pods annotated fake.gemmarust.dev/pod-ip=<address>: Ready at that address, so a
    client that reads pod IPs (the endpoint picker) reaches a process the test runs there, e.g. on loopback."""
    stage = copy.deepcopy(ready)
    stage["metadata"]["name"] = "fake-gemmarust-pod-ip"
    exprs = stage["spec"]["selector"]["matchExpressions"]
    exprs[-1] = {"key": f'.metadata.annotations["{POD_IP_ANNOTATION}"]', "operator": "Exists"}
    ip = f'{{{{ index .metadata.annotations "{POD_IP_ANNOTATION}" | Quote }}}}'
    template, n = re.subn(r"\{\{ \$podIPs :=.*?\{\{ end \}\}\s*\{\{ end \}\}",
                          f"podIP: {ip}\npodIPs:\n- ip: {ip}", stage["spec"]["next"]["statusTemplate"], flags=re.S)
    if n != 1:
        raise ControlPlaneError("kwok's pod-ready stage no longer sets podIP as this fake expects")
    stage["spec"]["next"]["statusTemplate"] = template
    return stage


_FAKE_STATUS = """\
{{ $now := Now }}
conditions:
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: Initialized
- lastTransitionTime: {{ $now | Quote }}
  status: "False"
  reason: ContainersNotReady
  type: Ready
- lastTransitionTime: {{ $now | Quote }}
  status: "False"
  reason: ContainersNotReady
  type: ContainersReady
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: false
  restartCount: RESTARTS
  STATE
{{ end }}
phase: Running
startTime: {{ $now | Quote }}
"""

_FAKE_STATES = {
    # A server booting: the process runs, /health is 503, so the pod is never Ready.
    "hold-unready": ("0", "started: true\n  state:\n    running:\n      startedAt: {{ $now | Quote }}"),
    # A server whose boot stage failed: exit 1 with the reason in the termination message, then back-off.
    "crash": ("3", "started: false\n  lastState:\n    terminated:\n      exitCode: 1\n      reason: Error\n"
                   f'      message: {{{{ index $.metadata.annotations "{TERMINATION_ANNOTATION}" | Quote }}}}\n'
                   "      startedAt: {{ $now | Quote }}\n      finishedAt: {{ $now | Quote }}\n"
                   "  state:\n    waiting:\n      reason: CrashLoopBackOff\n"
                   "      message: back-off 40s restarting failed container"),
}


def _fake_stage(mode: str) -> dict[str, Any]:
    """A kwok stage for pods annotated fake.gemmarust.dev/boot=<mode> (see the module docstring)."""
    restarts, state = _FAKE_STATES[mode]
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage",
        "metadata": {"name": f"fake-gemmarust-{mode}"},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {"matchExpressions": [
                {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
                {"key": ".status.phase", "operator": "In", "values": ["Pending"]},
                {"key": f'.metadata.annotations["{BOOT_ANNOTATION}"]', "operator": "In", "values": [mode]},
            ]},
            "next": {"statusTemplate": _FAKE_STATUS.replace("RESTARTS", restarts).replace("STATE", state)},
        },
    }


# ---------------------------------------------------------------------------------------------------------
# Nodes


def _node(name: str, labels: dict[str, str], capacity: dict[str, str], taints: list[dict[str, str]]) -> dict:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                     "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                "kubernetes.io/arch": "amd64", "type": "kwok", **labels}},
        "spec": {"taints": taints},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


TPU_TAINT = {"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}


# Per TPU type: its GKE accelerator label, machine type per chip count and (CPU, memory) per chip count. v5e's
# are Cloud TPU's ct5lp-hightpu-1t/4t/8t (24/112/224 vCPU, 48/192/384 GB); v6e's machine types are Cloud TPU's
# ct6e-standard-1t/4t/8t (cloud.google.com/tpu/docs/v6e), with capacities sized here only to hold the tests' pods.
TPU_NODE_TYPES = {
    "v5e": ("tpu-v5-lite-podslice", "ct5lp-hightpu-{}t", {1: ("24", "48Gi"), 4: ("112", "192Gi"), 8: ("224", "384Gi")}),
    "v6e": ("tpu-v6e-slice", "ct6e-standard-{}t", {1: ("44", "176Gi"), 4: ("180", "720Gi"), 8: ("180", "1440Gi")}),
}


def tpu_node(name: str, topology: str, *, provisioning: str = "standard", tpu: str = "v5e") -> dict:
    """A GKE TPU node (v5e or v6e) of a single-host topology."""
    accelerator, machine, sizes = TPU_NODE_TYPES[tpu]
    chips = {"1x1": 1, "2x2": 4, "2x4": 8}[topology]
    cpu, mem = sizes[chips]
    labels = {"cloud.google.com/gke-tpu-accelerator": accelerator,
              "cloud.google.com/gke-tpu-topology": topology,
              "cloud.google.com/gke-nodepool": f"{tpu}-{topology}-{provisioning}",
              "node.kubernetes.io/instance-type": machine.format(chips)}
    if provisioning == "spot":
        labels["cloud.google.com/gke-spot"] = "true"
    if provisioning == "flex-start":
        labels["cloud.google.com/gke-flex-start"] = "true"
    return _node(name, labels, {"cpu": cpu, "memory": mem, "pods": "110", "google.com/tpu": str(chips)},
                 [TPU_TAINT])


def cpu_node(name: str) -> dict:
    return _node(name, {"cloud.google.com/gke-nodepool": "default-pool",
                        "node.kubernetes.io/instance-type": "n2-standard-32"},
                 {"cpu": "32", "memory": "128Gi", "pods": "500"}, [])


def default_nodes() -> list[dict]:
    """Two v5e 1x1, one v5e 2x2, a spot 2x2, a flex-start 1x1 (no v5e 2x4: tests rely on that), a v6e 1x1
    and a v6e 2x4, and a CPU node."""
    return [
        tpu_node("v5e-1x1-a", "1x1"), tpu_node("v5e-1x1-b", "1x1"), tpu_node("v5e-2x2-a", "2x2"),
        tpu_node("v5e-2x2-spot-a", "2x2", provisioning="spot"),
        tpu_node("v5e-1x1-flex-a", "1x1", provisioning="flex-start"),
        tpu_node("v6e-1x1-a", "1x1", tpu="v6e"), tpu_node("v6e-2x4-a", "2x4", tpu="v6e"),
        cpu_node("cpu-a"),
    ]


# ---------------------------------------------------------------------------------------------------------
# The control plane


@dataclass
class ControlPlane:
    """Start/stop the local control plane in `workdir`; `kubeconfig` is usable once `start()` returns."""

    workdir: Path
    nodes: list[dict] = field(default_factory=default_nodes)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    args: dict[str, list[str]] = field(default_factory=dict)
    server: str = ""

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def bin(self) -> Path:
        return BIN_DIR

    def log(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    def _spawn(self, name: str, args: list[str]) -> None:
        self.args[name] = args
        self.log(name).parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.log(name), "a")
        self.procs[name] = subprocess.Popen([str(BIN_DIR / name), *args], stdout=fh, stderr=subprocess.STDOUT,
                                            start_new_session=True, cwd=self.workdir)

    def _check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                tail = self.log(name).read_text()[-3000:]
                raise ControlPlaneError(f"{name} exited with {p.returncode}; log {self.log(name)}:\n{tail}")

    def _wait(self, what: str, ok, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if ok():
                    return
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
            time.sleep(0.2)
        raise ControlPlaneError(f"timed out after {timeout:.0f}s waiting for {what}; logs in {self.workdir / 'logs'}")

    def _https_get(self, path: str) -> tuple[int, bytes]:
        ctx = ssl.create_default_context(cafile=str(self.workdir / "ca.crt"))
        ctx.load_cert_chain(str(self.workdir / "admin.crt"), str(self.workdir / "admin.key"))
        try:
            with urllib.request.urlopen(self.server + path, context=ctx, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def start(self) -> "ControlPlane":
        ensure_binaries()
        d = self.workdir
        d.mkdir(parents=True, exist_ok=True)
        make_certs(d)
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        self.server = f"https://127.0.0.1:{api_port}"
        self.kubeconfig.write_text(kubeconfig_text(self.server, d))
        self._spawn("etcd", [
            "--name=local", f"--data-dir={d / 'etcd'}", f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
            f"--advertise-client-urls=http://127.0.0.1:{etcd_port}", f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-cluster=local=http://127.0.0.1:{peer_port}", "--listen-metrics-urls=",
            "--unsafe-no-fsync=true", "--quota-backend-bytes=2147483648", "--log-level=warn"])
        self._spawn("kube-apiserver", [
            f"--etcd-servers=http://127.0.0.1:{etcd_port}", "--bind-address=127.0.0.1",
            f"--secure-port={api_port}", "--advertise-address=127.0.0.1",
            f"--tls-cert-file={d / 'apiserver.crt'}", f"--tls-private-key-file={d / 'apiserver.key'}",
            f"--client-ca-file={d / 'ca.crt'}", f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={d / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--authorization-mode=Node,RBAC",
            "--allow-privileged=true", "--endpoint-reconciler-type=none", f"--cert-dir={d / 'apiserver-certs'}",
            "--profiling=false", "--v=1"])
        self._wait("kube-apiserver /readyz", lambda: self._https_get("/readyz")[0] == 200, timeout=120)
        kc = str(self.kubeconfig)
        self._spawn("kube-controller-manager", [
            f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            f"--service-account-private-key-file={d / 'sa.key'}", f"--root-ca-file={d / 'ca.crt'}",
            "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
            "--use-service-account-credentials=false", "--controllers=*,-nodeipam",
            "--concurrent-deployment-syncs=10", "--concurrent-replicaset-syncs=10", "--concurrent-gc-syncs=20",
            "--kube-api-qps=200", "--kube-api-burst=400", "--v=1"])
        self._spawn("kube-scheduler", [
            f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
            "--kube-api-qps=200", "--kube-api-burst=400", "--v=1"])
        (d / "kwok.yaml").write_text(kwok_stages())
        self._spawn("kwok", [
            f"--kubeconfig={kc}", f"--config={d / 'kwok.yaml'}", "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake", "--cidr=10.244.0.1/16",
            "--node-ip=10.128.0.1", f"--server-address=127.0.0.1:{free_port()}",
            "--node-lease-duration-seconds=40"])
        for node in self.nodes:
            self.kubectl("create", "-f", "-", input=json.dumps(node))
        self._wait("fake nodes Ready", self._nodes_ready, timeout=60)
        self._wait("default service account", lambda: self.kubectl(
            "get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0, timeout=60)
        return self

    def restart(self, name: str) -> None:
        """Restart one component with its arguments (e.g. kube-controller-manager after installing CRDs:
        its garbage collector looks for new resource types only every 30 s, a hard-coded period, so until
        then the children of a new kind's objects are not collected)."""
        self.stop_component(name)
        self.start_component(name)

    def stop_component(self, name: str) -> None:
        """Stop one component (SIGTERM, then SIGKILL after 10 s), leaving the others running: a fault for
        tests. Its data stays (etcd's data dir), so `start_component` brings it back as it was."""
        p = self.procs.pop(name)
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)

    def start_component(self, name: str) -> None:
        """Start a stopped component again with the arguments it was first started with."""
        self._spawn(name, self.args[name])

    def readyz(self) -> tuple[int, str]:
        """kube-apiserver's /readyz?verbose (status, text); (0, why) when it does not answer."""
        try:
            status, body = self._https_get("/readyz?verbose")
            return status, body.decode(errors="replace")
        except OSError as e:
            return 0, str(e)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Wait until kube-apiserver answers /readyz with 200 (every check passes, etcd's included)."""
        self._wait("kube-apiserver /readyz", lambda: self.readyz()[0] == 200, timeout=timeout)

    def _nodes_ready(self) -> bool:
        out = json.loads(self.kubectl("get", "nodes", "-o", "json").stdout)
        ready = [n for n in out["items"] if any(c["type"] == "Ready" and c["status"] == "True"
                                               for c in n.get("status", {}).get("conditions", []))]
        return len(ready) == len(self.nodes)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        """Run kubectl against this control plane; raises CalledProcessError (with stderr) when check fails."""
        p = subprocess.run([str(BIN_DIR / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args], input=input,
                           capture_output=True, text=True, timeout=60)
        if check and p.returncode != 0:
            raise subprocess.CalledProcessError(p.returncode, p.args, p.stdout, p.stderr)
        return p

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            try:
                # The cluster is disposable: do not wait out kube-apiserver's graceful drain of watches.
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.procs.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["up", "build"])
    ap.add_argument("--dir", type=Path, default=None, help="working directory (default: a new temp dir)")
    args = ap.parse_args()
    if args.command == "build":
        print(ensure_binaries())
        return
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="gemma-k8s-"))
    cp = ControlPlane(workdir)
    try:
        cp.start()
        print(f"control plane up; logs in {workdir / 'logs'}\n"
              f"  export KUBECONFIG={cp.kubeconfig}\n  export PATH={BIN_DIR}:$PATH\n"
              f"  kubectl apply -f crds/ && python -m gemma_operator   # then kubectl apply a GemmaRustServer\n"
              "Ctrl-C stops it.", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        # A shell starts background jobs with SIGINT ignored; Ctrl-C / kill -INT should still stop us.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        cp.stop()
        if args.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
