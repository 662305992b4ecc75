"""The endpoint picker of gateway-api-inference-extension v1.5.0, built from its Go module
(tests/cluster/build_binaries.sh), started with the config the operator writes for that release (the server's
spec.gateway.endpointPicker.release) and the arguments and RBAC of
charts/gemma-rust-operator/examples/endpoint-picker-gie-v1.5.0.yaml, against the local control plane and a real
`python -m gemma_server`. (The operator's default release, llm-d-router v0.10.0, is not on the Go module proxy;
tests/operator/builders/test_endpoint_picker.py checks its config against a schema written from its source.)

kwok pods have no process, so the server's pod is made Ready at 127.0.0.1 (tests/cluster/controlplane.py,
fake.gemmarust.dev/pod-ip) and the server runs there on the port the GemmaRustServer names: the picker finds
the pod through the InferencePool and scrapes the real server's /metrics.

What the picker reports: `inference_pool_ready_pods` counts the pods whose metrics it refreshed within the
staleness threshold (pkg/epp/datalayer/logger/logger.go), and a refresh happens only when at least one of the
engine's metric names was found in the scrape (pkg/epp/framework/plugins/datalayer/extractor/metrics/
extractor.go). So 1 means the picker found the pod and read our metric names from the server; with the
picker's built-in vLLM names it stays 0, which the test checks too.
"""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from gemma_operator.builders.endpoint_picker import CONFIG_KEY, VERSION_ANNOTATION
from gemma_operator.spec import GIE_V1_5
from tests.cluster.controlplane import BIN_DIR, EPP, GIE_VERSION, POD_IP_ANNOTATION, free_port
from tests.cluster.crds import HTTP_SCALED_OBJECTS, INFERENCE_MODEL_REWRITES, INFERENCE_OBJECTIVES, INFERENCE_POOLS, \
    SCALED_OBJECTS, installed

from .harness import PROMETHEUS, ROOT, Binary, create, gemma_server, token_kubeconfig, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

EXAMPLE = ROOT / "charts" / "gemma-rust-operator" / "examples" / "endpoint-picker-gie-v1.5.0.yaml"
SERVER = "gemma"  # the example is written for a server of this name


@pytest.fixture(scope="module")
def real_server_port(chat_checkpoint, tmp_path_factory):  # chat_checkpoint: tests/checkpoints/fixtures.py
    with gemma_server(chat_checkpoint, tmp_path_factory.mktemp("gemma_server")) as url:
        yield int(url.rsplit(":", 1)[1])


def example_docs() -> list[dict]:
    return [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]


def picker_container() -> dict:
    deployment = next(d for d in example_docs() if d["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]


def picker_args(namespace: str, config: Path) -> list[str]:
    """The example's arguments as the kubelet would pass them: $(NAMESPACE) expanded from the container's
    fieldRef env, the config file where this test wrote it."""
    container = picker_container()
    env = {e["name"]: {"metadata.namespace": namespace, "metadata.name": "gemma-epp-test"}[
        e["valueFrom"]["fieldRef"]["fieldPath"]] for e in container["env"]}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    return [a.replace("/config/config.yaml", str(config)) for a in args]


class Picker(Binary):
    def __init__(self, args: list[str], kubeconfig: Path, log: Path):
        self.metrics_port = free_port()
        ports = [f"--grpc-port={free_port()}", f"--grpc-health-port={free_port()}",
                 f"--metrics-port={self.metrics_port}", "--refresh-prometheus-metrics-interval=1s"]
        super().__init__("the picker", [str(BIN_DIR / EPP), *args, *ports], {"KUBECONFIG": str(kubeconfig)}, log)

    def metric(self, name: str, pool: str) -> float | None:
        self.check()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return None
        m = re.search(rf'^{name}{{name="{pool}"}} (\S+)$', text, re.M)
        return float(m.group(1)) if m else None


def setup_pool(cluster, kube, ns, operator, port, tmp_path, *, spec=None, crds=(),
               wanted=lambda config: True) -> tuple[Path, Path]:
    """The pool's server (Ready at 127.0.0.1 on the real server's `port`, `spec` added to its spec), the
    operator's picker config on disk once `wanted(config)` holds (the operator's discovery caches for a few
    seconds what the cluster serves), and a kubeconfig holding a token of the example's ServiceAccount, bound by
    the example's Role. `crds`: installed besides the inference extension's."""
    for crd in (INFERENCE_POOLS, INFERENCE_OBJECTIVES, INFERENCE_MODEL_REWRITES, *crds):
        installed(cluster, crd)
    rbac = [d for d in example_docs() if d["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(rbac))
    create(kube, ns, SERVER, {
        "model": {"source": "hf://google/gemma-4-e2b-it"}, "accelerator": {"type": "cpu"},
        "server": {"port": port},
        "gateway": {"inferencePool": True, "endpointPicker": {"name": "gemma-epp", "release": GIE_V1_5},
                    "provider": "None"},
        "podAnnotations": {POD_IP_ANNOTATION: "127.0.0.1"}, **(spec or {})})

    def config_map():
        cm = kube.get_if_present("v1", "ConfigMap", ns, f"{SERVER}-epp")
        return cm if cm and wanted(yaml.safe_load(cm["data"][CONFIG_KEY])) else None
    cm = wait_for(config_map, what="the picker's ConfigMap", diagnose=operator.tail)
    assert cm["metadata"]["annotations"][VERSION_ANNOTATION] == GIE_V1_5
    config = tmp_path / "config.yaml"
    config.write_text(cm["data"][CONFIG_KEY])
    wait_for(lambda: kube.get_if_present("inference.networking.k8s.io/v1", "InferencePool", ns, SERVER),
             what="the InferencePool", diagnose=operator.tail)
    return config, token_kubeconfig(cluster, kube, tmp_path / "kubeconfig", ns, "gemma-epp")


@pytest.fixture
def picker_setup(cluster, kube, ns, operator, real_server_port, tmp_path):
    return ns, *setup_pool(cluster, kube, ns, operator, real_server_port, tmp_path)


def test_the_picker_starts_with_the_generated_config_finds_the_pod_and_reads_its_metrics(picker_setup, tmp_path):
    ns, config, kubeconfig = picker_setup
    picker = Picker(picker_args(ns, config), kubeconfig, tmp_path / "picker.log")
    try:
        wait_for(lambda: picker.metric("inference_pool_ready_pods", SERVER) == 1, timeout=60,
                 what="the picker to count the server's pod as ready (its metrics read)", diagnose=picker.tail)
        # The values it read: the idle server's KV-cache usage (gemma_kv_cache_usage_perc), 0.
        assert picker.metric("inference_pool_average_kv_cache_utilization", SERVER) == 0.0, picker.tail()
        assert picker.proc.poll() is None, picker.tail()
    finally:
        picker.stop()


def test_with_vllms_metric_names_the_picker_reads_nothing_from_the_server(picker_setup, tmp_path):
    """The control: the same picker, pool and server, but the config without our engine (the picker's
    built-in default engine is vLLM's names) never counts the pod."""
    ns, config, kubeconfig = picker_setup
    doc = yaml.safe_load(config.read_text())
    for plugin in doc["plugins"]:
        if plugin["type"] == "core-metrics-extractor":
            del plugin["parameters"]
    vllm = tmp_path / "vllm.yaml"
    vllm.write_text(yaml.safe_dump(doc))
    picker = Picker(picker_args(ns, vllm), kubeconfig, tmp_path / "picker.log")
    try:
        wait_for(lambda: picker.metric("inference_pool_ready_pods", SERVER) is not None, timeout=60,
                 what="the picker's pool gauge", diagnose=picker.tail)
        time.sleep(5)
        assert picker.metric("inference_pool_ready_pods", SERVER) == 0, picker.tail()
    finally:
        picker.stop()


def test_the_picker_built_here_the_example_and_the_operators_config_are_one_release():
    assert GIE_V1_5 == f"gateway-api-inference-extension/{GIE_VERSION}"
    assert picker_container()["image"] == f"registry.k8s.io/gateway-api-inference-extension/epp:{GIE_VERSION}"


def test_the_old_metric_flags_stop_this_picker_at_start(picker_setup, tmp_path):
    """GIE v1.2-v1.4's flags (the fallback for old pickers) are refused by v1.5.0: it exits naming the flag."""
    ns, config, kubeconfig = picker_setup
    args = picker_args(ns, config) + ["--total-queued-requests-metric=gemma_num_requests_waiting"]
    picker = Picker(args, kubeconfig, tmp_path / "picker.log")
    assert picker.proc.wait(timeout=60) != 0
    # The log is JSON (--zap-encoder=json): the flag's quotes are escaped.
    assert r'flag \"total-queued-requests-metric\" is deprecated and cannot be used' in picker.log.read_text()


def test_the_picker_runs_the_flow_control_config_of_a_server_that_scales_to_zero(
        cluster, kube, ns, operator, real_server_port, tmp_path):
    """With minReplicas 0 the config turns on flow control, which holds requests while the pool has no ready pod;
    the real picker starts with it and reads the pool. (KEDA's and the HTTP add-on's CRDs are installed: without
    the add-on the server is held at one replica, with no flow control.)"""
    config, kubeconfig = setup_pool(
        cluster, kube, ns, operator, real_server_port, tmp_path, crds=(SCALED_OBJECTS, HTTP_SCALED_OBJECTS),
        spec={"autoscaling": {"minReplicas": 0, "maxReplicas": 1, "target": 4,
                              "prometheus": {"serverAddress": PROMETHEUS}}},
        wanted=lambda config: "featureGates" in config)
    assert yaml.safe_load(config.read_text())["featureGates"] == ["flowControl"]
    picker = Picker(picker_args(ns, config), kubeconfig, tmp_path / "picker.log")
    try:
        wait_for(lambda: picker.metric("inference_pool_ready_pods", SERVER) == 1, timeout=60,
                 what="the picker with flow control to count the server's pod", diagnose=picker.tail)
        picker.check()
        # The config as the picker loaded it: flow control holding a request for wakeTimeoutSeconds (1200).
        assert "FlowControl: {MaxBytes: unlimited, MaxRequests: unlimited, DefaultRequestTTL: 20m0s}" in \
            picker.log.read_text()
    finally:
        picker.stop()
