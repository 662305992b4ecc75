"""Harness for running the operator against the local control plane (used by tests/operator/conftest.py
and bench/operator.py): start it as a real `python -m gemma_operator` process (i.e. `kopf run`) with a
least-privilege ServiceAccount token, wait with deadlines (never fixed sleeps), small API helpers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from gemma_operator.builders.deployment import SPOT_LABEL
from gemma_operator.kube import ApiError, Kube
from gemma_operator.poller import TEST_URL_ANNOTATION
from gemma_operator.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "gemmarustservers.gemmarust.dev.yaml"
POLICY_FILE = ROOT / "crds" / "gemmarustservers.gemmarust.dev.admission.yaml"
GRS_PATH = "/apis/gemmarust.dev/v1alpha1/namespaces/{ns}/gemmarustservers"
# The Prometheus the operator under test lets KEDA's trigger query (GEMMA_OPERATOR_ALLOWED_PROMETHEUS_ADDRESSES).
PROMETHEUS = "http://prometheus.monitoring.svc:9090"


def wait_for(fn: Callable[[], Any], *, timeout: float = 45.0, what: str = "condition", interval: float = 0.2,
             diagnose: Callable[[], str] | None = None) -> Any:
    """Poll `fn` until it returns something truthy; fail with the last value (and a diagnosis) at the deadline."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except ApiError as e:  # e.g. 404 before the object exists
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    extra = f"\n{diagnose()}" if diagnose else ""
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last value: {last!r}{extra}")


class Operator:
    """The operator process and what tests need from it."""

    def __init__(self, proc: subprocess.Popen, log: Path, liveness: str, argv: list[str], env: dict[str, str]):
        self.proc, self.log, self.liveness, self.argv, self.env = proc, log, liveness, argv, env

    def tail(self, n: int = 60) -> str:
        return "operator log (tail):\n" + "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_bytes(self) -> int:
        """The process's resident memory (Linux /proc)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS in /proc status")

    def start(self) -> None:
        """(Re)start the process with the same command line, environment and log (appended)."""
        fh = open(self.log, "a")
        self.proc = subprocess.Popen(self.argv, stdout=fh, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                                     start_new_session=True)

        def live() -> bool:
            if not self.alive():
                raise AssertionError(f"operator exited with {self.proc.returncode}\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.liveness, timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(live, timeout=60, what="the operator's liveness endpoint", diagnose=self.tail)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Stop the operator for the duration of the block (e.g. while another operator runs), then start it."""
        stop_operator(self)
        try:
            yield
        finally:
            self.start()


def start_operator(kubeconfig: Path, log: Path, *, resync: str = "2", extra_env: dict[str, str] | None = None,
                   args: tuple[str, ...] = ()) -> Operator:
    """Start `python -m gemma_operator` (kopf run --standalone -A) and wait for kopf's liveness endpoint."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    liveness = f"http://127.0.0.1:{port}/healthz"
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "GEMMA_OPERATOR_RESYNC_SECONDS": resync,
           "GEMMA_OPERATOR_TEST_ENGINE_URLS": "1", "GEMMA_OPERATOR_DISCOVERY_TTL_SECONDS": "3",
           # The fake kubelet's boot annotations and the test-only poll URL, besides the defaults.
           "GEMMA_OPERATOR_ALLOWED_POD_ANNOTATIONS": ",".join(
               [*Settings().allowed_pod_annotations, "fake.gemmarust.dev/*", TEST_URL_ANNOTATION]),
           # Spot servers (their toleration) and KEDA's trigger on the Prometheus the tests name.
           "GEMMA_OPERATOR_ALLOWED_TOLERATIONS": SPOT_LABEL,
           "GEMMA_OPERATOR_ALLOWED_PROMETHEUS_ADDRESSES": PROMETHEUS,
           **(extra_env or {})}
    log.write_text("")
    op = Operator(None, log, liveness, [sys.executable, "-m", "gemma_operator", f"--liveness={liveness}", *args], env)
    op.start()
    return op


def stop_operator(op: Operator) -> int:
    if op.alive():
        op.proc.send_signal(signal.SIGTERM)
        try:
            op.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            op.proc.kill()
            op.proc.wait(timeout=5)
    return op.proc.returncode


# Pod Security Admission's restricted level, enforced: the API server refuses any pod (at creation, so a
# Deployment's ReplicaSet reports FailedCreate) that runs as root, keeps capabilities, may escalate
# privileges or has no RuntimeDefault seccomp profile (kubernetes.io/docs/concepts/security/pod-security-standards).
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}


def create_namespace(kube: Kube, name: str) -> str:
    """Create namespace `name` with the restricted Pod Security level enforced (what the tests deploy into)."""
    kube.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                "metadata": {"name": name, "labels": RESTRICTED}})
    return name


def refused_pods(kube: Kube, namespace: str) -> dict[str, str]:
    """ReplicaSet name -> message, for each ReplicaSet in `namespace` whose pods the API server refused (its
    ReplicaFailure condition, reason FailedCreate: how a Deployment's pod that admission forbids shows)."""
    out = {}
    for rs in kube.request("GET", f"/apis/apps/v1/namespaces/{namespace}/replicasets")["items"]:
        for c in (rs.get("status") or {}).get("conditions") or []:
            if c.get("type") == "ReplicaFailure" and c.get("status") == "True":
                out[rs["metadata"]["name"]] = c.get("message", "")
    return out


def ensure(kube: Kube, path: str, obj: dict) -> None:
    """Create `obj` at `path` unless it exists."""
    try:
        kube.request("POST", path, obj)
    except ApiError as e:
        if e.status != 409:
            raise


def least_privilege_kubeconfig(cluster, kube: Kube, path: Path, *, namespaces: tuple[str, ...] = (),
                               name: str = "gemma-rust-operator") -> Path:
    """A kubeconfig holding a ServiceAccount token bound to exactly gemma_operator.rbac.RULES.

    The operator under test runs with it, so a verb missing from the rules (which the Helm chart copies)
    fails the integration tests instead of a user's first install. With `namespaces`, the rules are a Role
    in each of them (the chart's watchNamespaces mode) instead of a ClusterRole.
    """
    from gemma_operator import rbac

    ns = "gemma-system"
    ensure(kube, "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    ensure(kube, f"/api/v1/namespaces/{ns}/serviceaccounts",
           {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}})
    subjects = [{"kind": "ServiceAccount", "name": name, "namespace": ns}]
    rbac_api = "/apis/rbac.authorization.k8s.io/v1"
    if not namespaces:
        ensure(kube, f"{rbac_api}/clusterroles", rbac.cluster_role(name))
        ensure(kube, f"{rbac_api}/clusterrolebindings", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": subjects})
    for watched in namespaces:
        ensure(kube, f"{rbac_api}/namespaces/{watched}/roles", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": name},
            "rules": rbac.RULES})
        ensure(kube, f"{rbac_api}/namespaces/{watched}/rolebindings", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": subjects})
    return token_kubeconfig(cluster, kube, path, ns, name)


def token_kubeconfig(cluster, kube: Kube, path: Path, namespace: str, service_account: str) -> Path:
    """A kubeconfig with a day-long token of `service_account` (TokenRequest API)."""
    from tests.cluster.controlplane import kubeconfig_text

    name, ns = service_account, namespace
    token = kube.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{name}/token", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"expirationSeconds": 86400}})["status"]["token"]
    path.write_text(kubeconfig_text(cluster.cp.server, cluster.cp.workdir, token=token, user=name))
    return path


class Binary:
    """A binary the tests run beside the control plane (the endpoint picker, KEDA, the KEDA HTTP add-on), its
    output kept in `log`. With `hosts`, it runs in a mount namespace of its own (`unshare --mount`) whose
    /etc/hosts is that file: the names cluster DNS would give it."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path, *, hosts: Path | None = None):
        self.name, self.log = name, log
        if hosts is not None:
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts), *argv]
        with open(log, "w") as fh:
            self.proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT,
                                         env={"PATH": "/usr/bin:/bin", "HOME": str(log.parent), **env})

    def tail(self) -> str:
        return f"{self.name} log (tail):\n" + "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])

    def check(self) -> None:
        """Raise, with the log's tail, if it has exited."""
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited {self.proc.returncode}\n{self.tail()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


@contextmanager
def gemma_server(checkpoint: Path, workdir: Path, *, api_key: str | None = None,
                 host: str = "127.0.0.1") -> Iterator[str]:
    """A real `python -m gemma_server` (the real engine, on CPU) on a free port of `host` (loopback unless
    told); yields its URL once /health answers 200, and stops it afterwards. kwok pods have no process, so
    tests point the operator (or the endpoint picker) at this one."""
    from tests.cluster.controlplane import free_port

    port = free_port()
    log = workdir / "server.log"
    cmd = [sys.executable, "-m", "gemma_server", "--model", str(checkpoint), "--host", host,
           "--port", str(port), "--context", "1024", "--dtype", "float32", "--use-installed-engine",
           "--served-model-name", "gemma-tiny", "--termination-log", str(workdir / "termination.log")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"GEMMA_API_KEY": api_key} if api_key else {})}
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    url = f"http://{host}:{port}"

    def healthy():
        if proc.poll() is not None:
            raise AssertionError(f"gemma_server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_for(healthy, timeout=300, what="gemma_server /health 200", diagnose=lambda: log.read_text()[-3000:])
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def install_crd(cluster) -> None:
    cluster.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/gemmarustservers.gemmarust.dev")


def grs(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer", "metadata": {"name": name},
            "spec": spec}


def create(kube: Kube, ns: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return kube.request("POST", GRS_PATH.format(ns=ns), grs(name, spec))


def get(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    return kube.request("GET", f"{GRS_PATH.format(ns=ns)}/{name}")


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1)[:4000]
