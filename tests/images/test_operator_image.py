"""The operator image, built from images/Dockerfile.operator, run as the chart's Deployment runs it, against a
local control plane of its own (tests/cluster/; its own, because the operator tests' `kopf run` process
serves every namespace of the session's control plane).

The container gets what the chart renders (helm template of charts/gemma-rust-operator): the image's
entrypoint with the chart's args, its env, uid 10001, read-only root filesystem, dropped capabilities, the
scratch /tmp; and what the kubelet adds for `automountServiceAccountToken`: the ServiceAccount's token, CA
and namespace under /var/run/secrets/kubernetes.io/serviceaccount and the KUBERNETES_SERVICE_* variables.
The ServiceAccount is bound to exactly gemma_operator.rbac.RULES, which the chart's ClusterRole copies.
"""

from __future__ import annotations

import json
import shutil
import tomllib
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from gemma_operator.kube import Kube
from tests.charts.conftest import Helm, find, helm_binary
from tests.cluster.controlplane import BOOT_ANNOTATION, free_port
from tests.cluster.plugin import Cluster, running_cluster
from tests.images.conftest import BUILD_TIMEOUT, OPERATOR_TAG
from tests.images.containers import ROOT, TMPFS, Container, docker, run_args
from tests.images.test_dockerfiles import lock_pins
from tests.operator.harness import (create, create_namespace, dump, get, install_crd, least_privilege_kubeconfig,
                                    wait_for)

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(BUILD_TIMEOUT + 900)]

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("k8s-operator-image")) as c:
        yield c


def chart_pod(tmp_path_factory, liveness_port: int) -> dict:
    """The operator pod spec the chart renders for this image. The operator's pod-annotation allowlist also
    admits the local control plane's kwok boot annotation, which the test's server uses."""
    repository, tag = OPERATOR_TAG.rsplit(":", 1)
    helm = Helm(helm_binary(), tmp_path_factory.mktemp("helm-home"))
    docs = helm.render(f"image.repository={repository}", f"image.tag={tag}",
                       f"operator.livenessPort={liveness_port}",
                       f"operator.allowedPodAnnotations={{gke-gcsfuse/*,{BOOT_ANNOTATION}}}")
    return find(docs, "Deployment")["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def operator_container(own_cluster, operator_image, tmp_path_factory) -> Iterator[tuple[Container, Kube]]:
    kube = Kube(own_cluster.api)
    install_crd(own_cluster)
    d = tmp_path_factory.mktemp("operator-image")
    kubeconfig = yaml.safe_load(least_privilege_kubeconfig(own_cluster, kube, d / "kubeconfig").read_text())
    sa = d / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text(kubeconfig["users"][0]["user"]["token"])
    shutil.copy(kubeconfig["clusters"][0]["cluster"]["certificate-authority"], sa / "ca.crt")
    (sa / "namespace").write_text("gemma-system")
    for p in [sa, *sa.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    api = urlsplit(own_cluster.cp.server)
    port = free_port()
    pod = chart_pod(tmp_path_factory, port)
    c = Container.run(run_args(
        pod, name=f"gemma-operator-test-{uuid.uuid4().hex[:8]}", image=OPERATOR_TAG, volumes={"tmp": TMPFS},
        kubelet=["--mount", f"type=bind,source={sa},destination={SERVICE_ACCOUNT_DIR},readonly",
                 "-e", f"KUBERNETES_SERVICE_HOST={api.hostname}", "-e", f"KUBERNETES_SERVICE_PORT={api.port}"]))

    def live() -> bool:
        assert c.running(), f"the operator container exited\n{c.tail()}"
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(live, timeout=120, what="the operator container's liveness endpoint", diagnose=c.tail)
        yield c, kube
        assert c.running(), f"the operator container died during the test\n{c.tail()}"
        assert c.stop(pod.get("terminationGracePeriodSeconds", 30)) == 0, c.tail()
    finally:
        c.remove()


# Runs in the image: the installed distributions that gemma-rust-operator needs, transitively.
CLOSURE = """
import json, re
from importlib.metadata import PackageNotFoundError, distribution
seen, todo = {}, ["gemma-rust-operator"]
while todo:
    try:
        d = distribution(todo.pop())
    except PackageNotFoundError:
        continue  # a requirement whose marker does not hold here
    name = re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower()
    if name not in seen:
        seen[name] = d.version
        todo += [re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in d.requires or [] if "extra ==" not in r]
print(json.dumps(seen))
"""


def test_operator_image_installs_the_operator_with_the_locks_versions_and_no_torch(operator_image):
    closure = json.loads(docker("run", "--rm", "--network", "none", "--entrypoint", "python", OPERATOR_TAG,
                                "-c", CLOSURE).stdout)
    lock = lock_pins()
    project = tomllib.loads((ROOT / "operator" / "pyproject.toml").read_text())["project"]
    assert closure.pop("gemma-rust-operator") == project["version"]
    assert len(closure) >= len(project["dependencies"])
    assert {name: (v, lock.get(name)) for name, v in closure.items() if lock.get(name) != v} == {}
    assert not {"torch", "transformers", "gemma-server"} & set(closure)


def test_operator_image_reconciles_a_gemmarustserver_to_its_first_phases(operator_container):
    c, kube = operator_container
    ns = f"img-{uuid.uuid4().hex[:8]}"
    create_namespace(kube, ns)
    # kwok runs the pod but holds it unready, as a server that is still building its engine.
    obj = create(kube, ns, "g", {"model": {"source": "hf://google/gemma-4-e2b-it"}, "accelerator": {"topology": "1x1"},
                                 "podAnnotations": {BOOT_ANNOTATION: "hold-unready"}})

    def phase(wanted: str):
        def check():
            o = get(kube, ns, "g")
            return o if (o.get("status") or {}).get("phase") == wanted else None
        return check

    diagnose = lambda: dump(get(kube, ns, "g").get("status")) + "\n" + c.tail()  # noqa: E731
    dep = wait_for(lambda: kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/g"), timeout=60,
                   what="the Deployment", diagnose=diagnose)
    assert dep["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    assert dep["spec"]["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "1x1"
    building = wait_for(phase("Building"), timeout=60, what="phase Building", diagnose=diagnose)
    (pod,) = building["status"]["pods"]
    assert pod["node"].startswith("v5e-1x1"), pod
    progressing = next(x for x in building["status"]["conditions"] if x["type"] == "Progressing")
    assert progressing["status"] == "True" and progressing["reason"] == "Building"
