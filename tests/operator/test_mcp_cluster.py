"""The operator's MCP server as an assistant runs it: `python -m gemma_operator.mcp` as a subprocess, the official
`mcp` client talking to it over stdio, KUBECONFIG pointing at the local control plane (real kube-apiserver with
the CRD's schema and CEL rules, real scheduler, kwok nodes) and the real operator writing the status.

kwok pods run no process, so a pod of the flow is annotated `fake.gemmarust.dev/boot: fake-kubelet` and the test
plays its kubelet (FakeKubelet: running, then ready) and its server's /v1/engine report (FakeEngineEndpoint,
which the operator polls through the test-only annotation); each boot stage is moved on only after the MCP
server has reported the one before as a progress notification, so none can be missed between two polls.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import uuid
from pathlib import Path

import pytest
import yaml
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client

from gemma_operator.mcp.server import WRITING_TOOLS
from gemma_operator.poller import TEST_URL_ANNOTATION
from tests.charts.conftest import CHART, Helm, helm_binary
from tests.cluster.controlplane import BOOT_ANNOTATION, FAKE_KUBELET, TERMINATION_ANNOTATION

from .fakes import FakeEngineEndpoint, FakeKubelet
from .harness import ROOT, dump, ensure, get, token_kubeconfig, wait_for

pytestmark = pytest.mark.cluster

MODEL = {"source": "hf://google/gemma-4-e2b-it"}
CPU = {"type": "cpu"}
SELECTOR = "app.kubernetes.io/instance={name},app.kubernetes.io/name=gemma-rust-server"
TOPOLOGY_ON_CPU = ("spec.accelerator.topology applies to TPUs only: remove it, or set spec.accelerator.type to "
                   "tpu-v5-lite-podslice")


def session(kubeconfig: Path, namespace: str, log: Path, fn, *flags: str):
    """Start `python -m gemma_operator.mcp` (its stderr to `log`), connect the mcp client over stdio, and return
    what `fn(client)` returns."""
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "gemma_operator.mcp", "--namespace", namespace, *flags], cwd=ROOT,
        env={**os.environ, "KUBECONFIG": str(kubeconfig)})

    async def go():
        with open(log, "a") as errlog:
            async with Client(stdio_client(params, errlog=errlog), read_timeout_seconds=120) as client:
                return await fn(client)

    return asyncio.run(go())


@pytest.fixture
def mcp_log(tmp_path):
    return tmp_path / "mcp.log"


def text(result) -> str:
    return result.content[0].text


def ok(result) -> dict:
    assert not result.is_error, text(result)
    return result.structured_content


def live_pods(kube, ns, name):
    return [p for p in kube.list_pods(ns, SELECTOR.format(name=name)) if not p["metadata"].get("deletionTimestamp")]


def test_deploy_wait_scale_and_delete_over_stdio(cluster, kube, ns, operator, mcp_log):
    name = "assistant"
    with FakeEngineEndpoint() as fake:
        spec = {"model": MODEL, "accelerator": CPU,
                "podAnnotations": {BOOT_ANNOTATION: FAKE_KUBELET, TEST_URL_ANNOTATION: fake.url}}
        seen: list[str] = []
        failures: list[BaseException] = []

        def reported(stage: str):
            return lambda: any(f": {stage}" in m for m in seen)

        def boot() -> None:
            """Play the pod's kubelet and server, one stage after the MCP server reported the last."""
            try:
                kubelet = FakeKubelet(kube)
                pod = wait_for(lambda: next((p for p in live_pods(kube, ns, name) if p["spec"].get("nodeName")), None),
                               timeout=90, what="the pod scheduled", diagnose=operator.tail)
                kubelet.status(pod, phase="Running", server={"running": {"startedAt": kubelet._now()}})
                wait_for(reported("Building"), timeout=90, what="Building reported", diagnose=lambda: repr(seen))
                fake.boot_to("weights", {"build": 61.2, "import": 0.8, "smoke": 3.5})
                wait_for(reported("LoadingWeights"), timeout=90, what="LoadingWeights reported",
                         diagnose=lambda: repr(seen))
                fake.boot_to("warmup", {"build": 61.2, "import": 0.8, "smoke": 3.5, "weights": 20.0})
                wait_for(reported("WarmingUp"), timeout=90, what="WarmingUp reported", diagnose=lambda: repr(seen))
                fake.serve("gemma-4-e2b-it")
                kubelet.start(pod)
            except BaseException as e:  # noqa: BLE001 - handed to the test's thread
                failures.append(e)

        async def flow(client):
            dry = ok(await client.call_tool("deploy_server", {"name": name, "spec": spec, "dry_run": True}))
            assert kube.get_server(ns, name) is None, "a dry run created the server"
            real = ok(await client.call_tool("deploy_server", {"name": name, "spec": spec}))

            async def progress(done, total, message):
                seen.append(message)

            driver = threading.Thread(target=boot, daemon=True)
            driver.start()
            waited = await client.call_tool("wait_for_server", {"name": name, "timeout_seconds": 240},
                                            read_timeout_seconds=300, progress_callback=progress)
            await asyncio.to_thread(driver.join, 120)
            scaled = ok(await client.call_tool("scale_server", {"name": name, "replicas": 2}))
            state = ok(await client.call_tool("get_server", {"name": name}))
            listed = ok(await client.call_tool("list_servers", {"namespace": ns}))
            endpoint = ok(await client.call_tool("server_endpoint", {"name": name}))
            events = ok(await client.call_tool("server_events", {"name": name, "limit": 50}))
            refused = await client.call_tool("delete_server", {"name": name, "confirm": "yes"})
            kept = kube.get_server(ns, name)
            deleted = ok(await client.call_tool("delete_server", {"name": name, "confirm": name}))
            return dry, real, waited, scaled, state, listed, endpoint, events, refused, kept, deleted

        dry, real, waited, scaled, state, listed, endpoint, events, refused, kept, deleted = session(
            cluster.kubeconfig, ns, mcp_log, flow)
        assert not failures, failures[0]

    # Dry run: the API server defaulted the spec, stored nothing.
    assert dry["dry_run"] and dry["spec"]["replicas"] == 1 and dry["spec"]["engine"]["context"] == 8192
    assert real["generation"] == 1 and not real["dry_run"]

    # Wait: Ready, with each boot stage a progress notification, finished stages with their seconds.
    result = ok(waited)
    assert result["outcome"] == "ready", dump(result)
    assert result["server"]["ready"] == 1 and result["server"]["phase"] == "Ready"
    first = [next(i for i, m in enumerate(seen) if f": {stage}" in m)
             for stage in ("Building", "LoadingWeights", "WarmingUp", "Ready")]
    assert first == sorted(first) and len(set(seen)) >= 4, seen
    assert result["stages_seen"] == seen
    weights = "LoadingWeights, engine stage weights (done: build 61.2 s, import 0.8 s, smoke 3.5 s)"
    assert any(weights in m for m in seen), seen

    # Scale through the scale subresource: spec.replicas is 2.
    assert (scaled["previous"], scaled["replicas"]) == (1, 2)
    assert kept is not None and kept["spec"]["replicas"] == 2
    assert state["replicas"] == 2
    assert {"name": name, "namespace": ns, "model": MODEL["source"]}.items() <= listed["servers"][0].items()

    assert endpoint["openai_base_url"] == f"http://{name}.{ns}.svc.cluster.local:8000/v1"
    assert endpoint["urls"] == [f"http://{name}.{ns}.svc.cluster.local:8000"]

    # The operator's phase Events on the server, newest first.
    about = [e for e in events["events"] if e["object"] == f"GemmaRustServer/{name}"]
    assert "Ready" in {e["reason"] for e in about}, events
    times = [e["last_seen"] for e in events["events"]]
    assert times == sorted(times, reverse=True)

    assert refused.is_error and "confirm='assistant'" in text(refused)
    assert deleted == {"name": name, "namespace": ns, "deleted": True}
    wait_for(lambda: kube.get_server(ns, name) is None, timeout=60, what="the server gone")


def test_wait_ends_when_the_server_fails_with_the_reason_and_the_last_failure(cluster, ns, operator, mcp_log):
    reason = "smoke: tpu matmul mismatch (max abs err 3.1e-1)"
    spec = {"model": MODEL, "accelerator": CPU,
            "podAnnotations": {BOOT_ANNOTATION: "crash", TERMINATION_ANNOTATION: reason}}
    seen: list[str] = []

    async def flow(client):
        async def progress(done, total, message):
            seen.append(message)

        ok(await client.call_tool("deploy_server", {"name": "crash", "spec": spec}))
        waited = await client.call_tool("wait_for_server", {"name": "crash", "timeout_seconds": 240},
                                        read_timeout_seconds=300, progress_callback=progress)
        events = await client.call_tool("server_events", {"name": "crash"})
        return waited, events

    waited, events = session(cluster.kubeconfig, ns, mcp_log, flow)
    result = ok(waited)
    assert result["outcome"] == "failed", dump(result)
    server = result["server"]
    degraded = next(c for c in server["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "CrashLoopBackOff") and reason in degraded["message"]
    assert server["last_failure"]["message"] == reason and server["last_failure"]["exit_code"] == 1
    assert any(m.startswith("phase Failed") for m in seen) and any(": Failed" in m for m in seen), seen
    assert ("Warning", "Failed") in {(e["type"], e["reason"]) for e in ok(events)["events"]}


def test_admission_refusal_comes_back_verbatim_and_nothing_is_created(cluster, kube, ns, operator, mcp_log):
    spec = {"model": MODEL, "accelerator": {"type": "cpu", "topology": "1x1"}}

    async def flow(client):
        return [await client.call_tool("deploy_server", {"name": "bad", "spec": spec, "dry_run": dry})
                for dry in (True, False)]

    for result in session(cluster.kubeconfig, ns, mcp_log, flow):
        assert result.is_error and result.structured_content is None
        assert "invalid (HTTP 422)" in text(result), text(result)
        assert TOPOLOGY_ON_CPU in text(result)
    assert kube.get_server(ns, "bad") is None


def test_scale_is_refused_while_autoscaling_owns_the_replicas(cluster, kube, ns, operator, mcp_log):
    spec = {"model": MODEL, "accelerator": CPU, "autoscaling": {"maxReplicas": 3, "target": 4, "provider": "HPA"}}

    async def flow(client):
        ok(await client.call_tool("deploy_server", {"name": "auto", "spec": spec}))
        return await client.call_tool("scale_server", {"name": "auto", "replicas": 3})

    result = session(cluster.kubeconfig, ns, mcp_log, flow)
    assert result.is_error and "spec.autoscaling owns its replicas (1..3)" in text(result)
    assert get(kube, ns, "auto")["spec"]["replicas"] == 1


def test_missing_server_is_a_not_found_tool_error(cluster, ns, operator, mcp_log):
    async def flow(client):
        return [await client.call_tool(tool, {"name": "nobody"}) for tool in ("get_server", "server_endpoint")]

    for result in session(cluster.kubeconfig, ns, mcp_log, flow):
        assert result.is_error, text(result)
        assert f"GemmaRustServer {ns}/nobody: not found (HTTP 404)" in text(result)


@pytest.fixture
def read_only_kubeconfig(cluster, kube, ns, tmp_path):
    """A ServiceAccount bound, in `ns` only, to the chart's read-only assistant ClusterRole (as helm renders it
    with mcp.readOnlyRole.create=true), and a kubeconfig with its token."""
    helm = Helm(helm_binary(), tmp_path / "helm")
    docs = [d for d in yaml.safe_load_all(helm.template("mcp.readOnlyRole.create=true").stdout) if d]
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-mcp-read-only"))
    role_name = f"mcp-read-only-{uuid.uuid4().hex[:6]}"
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    kube.request("POST", f"{rbac}/clusterroles", {**role, "metadata": {"name": role_name}})
    ensure(kube, f"/api/v1/namespaces/{ns}/serviceaccounts",
           {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "assistant"}})
    kube.request("POST", f"{rbac}/namespaces/{ns}/rolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "assistant"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
        "subjects": [{"kind": "ServiceAccount", "name": "assistant", "namespace": ns}]})
    yield token_kubeconfig(cluster, kube, tmp_path / "assistant.kubeconfig", ns, "assistant")
    kube.request("DELETE", f"{rbac}/clusterroles/{role_name}")


def test_read_only_lists_no_writing_tool_and_works_with_the_charts_read_only_role(
        cluster, kube, ns, operator, mcp_log, read_only_kubeconfig):
    kube.request("POST", f"/apis/gemmarust.dev/v1alpha1/namespaces/{ns}/gemmarustservers", {
        "apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer", "metadata": {"name": "seen"},
        "spec": {"model": MODEL, "accelerator": CPU}})

    async def flow(client):
        tools = {t.name for t in (await client.list_tools()).tools}
        write = await client.call_tool("delete_server", {"name": "seen", "confirm": "seen"})
        reads = {tool: await client.call_tool(tool, {"name": "seen"})
                 for tool in ("get_server", "server_events", "server_endpoint")}
        waited = await client.call_tool("wait_for_server", {"name": "seen", "timeout_seconds": 120})
        here = await client.call_tool("list_servers", {"namespace": ns})
        everywhere = await client.call_tool("list_servers", {})
        return tools, write, reads, waited, here, everywhere

    tools, write, reads, waited, here, everywhere = session(read_only_kubeconfig, ns, mcp_log, flow, "--read-only")
    assert tools == {"list_servers", "get_server", "server_events", "server_endpoint", "wait_for_server"}
    assert not tools & set(WRITING_TOOLS)
    assert write.is_error and "Unknown tool: delete_server" in text(write)
    assert get(kube, ns, "seen")["metadata"]["name"] == "seen"  # still there
    for tool, result in reads.items():
        assert not result.is_error, f"{tool}: {text(result)}"
    assert ok(waited)["outcome"] == "ready"
    assert [s["name"] for s in ok(here)["servers"]] == ["seen"]
    # The role is bound in this namespace only: listing every namespace is forbidden, and says so.
    assert everywhere.is_error
    assert "forbidden (HTTP 403)" in text(everywhere) and f"system:serviceaccount:{ns}:assistant" in text(everywhere)


def test_a_write_the_credentials_do_not_allow_is_a_forbidden_tool_error(cluster, kube, ns, operator, mcp_log,
                                                                         read_only_kubeconfig):
    async def flow(client):
        return await client.call_tool("deploy_server", {"name": "nope", "spec": {"model": MODEL, "accelerator": CPU}})

    result = session(read_only_kubeconfig, ns, mcp_log, flow)
    assert result.is_error
    assert f"apply GemmaRustServer {ns}/nope: forbidden (HTTP 403)" in text(result)
    assert "cannot patch resource" in text(result), text(result)
    assert kube.get_server(ns, "nope") is None
