"""End to end: the chart on the local control plane, its operator reconciling the sample, a clean uninstall.

The local control plane (tests/cluster/) has a real kube-apiserver with RBAC, scheduler and controllers, and
kwok in place of kubelets: pods are scheduled and marked Running, but no container runs. So the parts of
the release that are processes run here as local processes, each with its own ServiceAccount's token
(TokenRequest API), so the chart's RBAC is what authorises them and a missing verb shows up as a failure:

- the operator: the operator image's ENTRYPOINT (images/Dockerfile.operator) with the args and env of
  the chart's Deployment, as the chart's ServiceAccount (bound by the chart's ClusterRole);
- the pre-delete cleanup hook: the hook Job's own command, as the hook's ServiceAccount. Its pod is held
  Pending (a node selector no node has, until the command has run), because kwok would otherwise
  "complete" the Job at once without running anything.

Then `helm uninstall` must leave nothing of the release behind except the CRD (Helm never deletes crds/,
as values.yaml documents).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from gemma_operator.kube import Kube
from tests.cluster.controlplane import kubeconfig_text
from tests.images.dockerfile import parse_dockerfile
from tests.operator.harness import RESTRICTED, refused_pods

from .conftest import CHART, ROOT

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RELEASE, NS = "grs-e2e", "grs-chart"
FULLNAME = f"{RELEASE}-gemma-rust-operator"
SAMPLE = "gemma-sample"
# Holds the operator's and the hook's pods Pending until the test lets them schedule (see the docstring).
HOLD_LABEL = "gemmarust.dev/e2e-hold"


def wait_for(fn, timeout: float, what: str, diagnose=lambda: ""):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}\n{diagnose()}")


def kubectl_json(cluster, *args: str) -> dict:
    return json.loads(cluster.kubectl(*args, "-o", "json").stdout)


def token_kubeconfig(cluster, namespace: str, service_account: str, path: Path) -> Path:
    """A kubeconfig with a short-lived token of `service_account` (TokenRequest API)."""
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}}
    out = cluster.kubectl("create", "--raw",
                          f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token",
                          "-f", "-", input=json.dumps(request))
    token = json.loads(out.stdout)["status"]["token"]
    path.write_text(kubeconfig_text(cluster.cp.server, cluster.cp.workdir, token=token, user=service_account))
    return path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_command(container: dict, entrypoint: list[str], kubeconfig: Path) -> tuple[list[str], dict[str, str]]:
    """The container's command line and environment, to run here instead of in a pod."""
    argv = list(container.get("command") or entrypoint) + list(container.get("args", []))
    if argv[0] == "python":
        argv[0] = sys.executable
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)  # never mistake this for a pod
    for e in container.get("env", []):
        env[e["name"]] = e.get("value", "local-e2e")  # valueFrom (pod name) -> a fixed stand-in
    return argv, env


class LocalProcess:
    def __init__(self, argv: list[str], env: dict[str, str], log: Path):
        self.log = log
        with open(log, "w") as fh:
            self.proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                         start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, n: int = 80) -> str:
        return f"{self.log.name} (tail):\n" + "\n".join(self.text().splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def release_leftovers(cluster) -> list[str]:
    """Objects of the release still present (the CRD excepted, by policy)."""
    names = cluster.kubectl("get", "deployments,replicasets,pods,services,serviceaccounts,configmaps,secrets,"
                            "networkpolicies,roles,rolebindings,jobs,gemmarustservers,poddisruptionbudgets",
                            "-n", NS, "-o", "name").stdout.split()
    defaults = {"serviceaccount/default", "configmap/kube-root-ca.crt"}
    left = [n for n in names if n not in defaults]
    for kind in ("clusterrole", "clusterrolebinding"):
        if cluster.kubectl("get", kind, FULLNAME, check=False).returncode == 0:
            left.append(f"{kind}/{FULLNAME}")
    return left


def test_helm_installs_the_operator_which_reconciles_the_sample_and_uninstall_leaves_nothing(
        cluster, helm, tmp_path):
    kc = cluster.kubeconfig
    admin = dict(kubeconfig=kc)
    # The release's namespace enforces the restricted Pod Security level: the API server's PodSecurity
    # admission refuses any pod of the release (operator, hook, sample server) that does not meet it.
    cluster.kubectl("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS, "labels": RESTRICTED}}))
    installed = helm.run("install", RELEASE, str(CHART), "--namespace", NS,
             "--set", "sample.enabled=true", "--set", f"sample.name={SAMPLE}",
             "--set", "networkPolicy.enabled=true", "--set", "dashboards.enabled=true",
             "--set", "cleanupHook.timeoutSeconds=120",
             "--set", f"nodeSelector.{HOLD_LABEL.replace('.', chr(92) + '.')}=go", **admin)
    operator = None
    try:
        # NOTES.txt tells what to do next, with this release's names.
        notes = installed.stdout.split("NOTES:", 1)[1]
        print(notes)
        assert f"kubectl -n {NS} rollout status deployment/{FULLNAME}" in notes
        assert f"kubectl -n {NS} get grs {SAMPLE} -w" in notes
        assert f"{NS}/{FULLNAME}-dashboards" in notes
        # The CRD from crds/ is installed and established; the release's objects exist.
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/gemmarustservers.gemmarust.dev")
        manifest = list(yaml.safe_load_all(helm.run("get", "manifest", RELEASE, "-n", NS, **admin).stdout))
        dep = next(d for d in manifest if d and d["kind"] == "Deployment")
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        assert dep["spec"]["template"]["spec"]["serviceAccountName"] == FULLNAME
        for kind in ("deployment", "serviceaccount", "configmap", "networkpolicy"):
            assert cluster.kubectl("get", kind, "-n", NS, "-o", "name").stdout.strip(), kind
        assert cluster.kubectl("get", "grs", SAMPLE, "-n", NS, "-o", "name").stdout.strip()

        # The operator, as the chart deploys it, but here, with the chart's ServiceAccount token.
        entrypoint = parse_dockerfile(ROOT / "images" / "Dockerfile.operator").final.exec_form("ENTRYPOINT")
        port = free_port()
        container["args"] = [re.sub(r"^--liveness=http://0\.0\.0\.0:\d+/", f"--liveness=http://127.0.0.1:{port}/", a)
                             for a in container["args"]]
        argv, env = local_command(container, entrypoint,
                                  token_kubeconfig(cluster, NS, FULLNAME, tmp_path / "operator.kubeconfig"))
        operator = LocalProcess(argv, env, tmp_path / "operator.log")

        def live():
            assert operator.proc.poll() is None, f"operator exited {operator.proc.returncode}\n{operator.tail()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(live, 60, "the operator's /healthz", operator.tail)
        # Its Deployment's pod was admitted (it exists, held Pending): refused, it would exist nowhere.
        selector = f"app.kubernetes.io/name=gemma-rust-operator,app.kubernetes.io/instance={RELEASE}"
        wait_for(lambda: kubectl_json(cluster, "get", "pods", "-n", NS, "-l", selector)["items"], 60,
                 "the operator's pod admitted", lambda: str(refused_pods(Kube(cluster.api), NS)))

        # It reconciles the sample: children appear, the pod lands on a v5e 1x1 node, status is written.
        wait_for(lambda: cluster.kubectl("get", "deployment,service", SAMPLE, "-n", NS, check=False).returncode == 0,
                 90, "the sample's Deployment and Service", operator.tail)
        sample_dep = kubectl_json(cluster, "get", "deployment", SAMPLE, "-n", NS)
        assert sample_dep["metadata"]["ownerReferences"][0]["kind"] == "GemmaRustServer"
        assert sample_dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"] == "1"

        def ready_status():
            obj = kubectl_json(cluster, "get", "grs", SAMPLE, "-n", NS)
            st = obj.get("status") or {}
            return st if st.get("phase") == "Ready" and st.get("readyReplicas") == 1 else None

        status = wait_for(ready_status, 120, "the sample's status phase Ready", operator.tail)
        assert refused_pods(Kube(cluster.api), NS) == {}
        assert status["observedGeneration"] == 1
        assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"
        assert status["endpoint"] == f"http://{SAMPLE}.{NS}.svc.cluster.local:8000/v1"
        (pod,) = status["pods"]
        node = kubectl_json(cluster, "get", "node", pod["node"])
        assert node["metadata"]["labels"]["cloud.google.com/gke-tpu-topology"] == "1x1"
        print(cluster.kubectl("get", "grs", "-n", NS).stdout)

        # "HTTP 403" is how gemma_operator.kube reports a refusal, "forbidden" how the API server and kopf
        # word it. A bare 403 is not enough: log timestamps carry milliseconds like ",403]".
        forbidden = [ln for ln in operator.text().splitlines() if re.search(r"HTTP 403|[Ff]orbidden", ln)]
        assert not forbidden, "the chart's RBAC refused the operator:\n" + "\n".join(forbidden[:10])

        # Uninstall. helm runs the pre-delete hook and waits for its Job, whose pod is held Pending; the
        # hook's own command runs here with the hook's ServiceAccount, while the operator still works.
        uninstall = subprocess.Popen([str(helm.binary), "uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "4m"],
                                     env={**helm.env, "KUBECONFIG": str(kc)}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        job_name = f"{FULLNAME}-cleanup"
        wait_for(lambda: cluster.kubectl("get", "job", job_name, "-n", NS, check=False).returncode == 0, 60,
                 "the pre-delete hook's Job")
        job = kubectl_json(cluster, "get", "job", job_name, "-n", NS)
        wait_for(lambda: kubectl_json(cluster, "get", "pods", "-n", NS, "-l", f"job-name={job_name}")["items"], 60,
                 "the hook's pod admitted", lambda: json.dumps(kubectl_json(cluster, "get", "job", job_name, "-n",
                                                                             NS).get("status")))
        hook_pod = job["spec"]["template"]["spec"]
        (hook_container,) = hook_pod["containers"]
        hook_argv, hook_env = local_command(
            hook_container, [], token_kubeconfig(cluster, NS, hook_pod["serviceAccountName"], tmp_path / "hook.kubeconfig"))
        hook = subprocess.run(hook_argv, env=hook_env, capture_output=True, text=True, timeout=180)
        assert hook.returncode == 0, f"cleanup hook failed:\n{hook.stdout}\n{hook.stderr}\n{operator.tail()}"
        assert f"GemmaRustServer {NS}/{SAMPLE} deleted" in hook.stdout
        # The sample is gone while the operator still ran; its children go with it (owner references).
        cluster.kubectl("label", "node", "cpu-a", f"{HOLD_LABEL}=go")
        out, _ = uninstall.communicate(timeout=300)
        assert uninstall.returncode == 0, f"helm uninstall failed:\n{out}"

        wait_for(lambda: not release_leftovers(cluster), 90, "the release's objects to be deleted",
                 lambda: "left: " + ", ".join(release_leftovers(cluster)))
        # By policy the CRD stays (values.yaml: Helm never deletes crds/).
        assert cluster.kubectl("get", "crd", "gemmarustservers.gemmarust.dev", check=False).returncode == 0
    finally:
        if operator:
            # After a failure midway: let the operator release the sample's finalizer before it stops.
            cluster.kubectl("delete", "grs", "--all", "-n", NS, "--wait=true", "--timeout=30s", check=False)
            operator.stop()
        cluster.kubectl("label", "node", "cpu-a", f"{HOLD_LABEL}-", check=False)
        if helm.run("status", RELEASE, "-n", NS, check=False, **admin).returncode == 0:
            helm.run("uninstall", RELEASE, "-n", NS, "--no-hooks", check=False, **admin)
        cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)
