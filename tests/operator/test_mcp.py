"""The operator's MCP server (gemma_operator.mcp) in process, with the official `mcp` client (`mcp.Client(server)`,
the SDK's in-process connection): what needs no cluster. The tool list and its schemas, read-only mode, the
refusals that happen before any write, and API errors turned into tool errors. The same tools against the
real API server and the real operator, over stdio, are in test_mcp_cluster.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from mcp import Client

from gemma_operator.kube import ApiError
from gemma_operator.mcp import cluster
from gemma_operator.mcp import server as mcp_server
from gemma_operator.mcp.server import WRITING_TOOLS, build_server
from gemma_operator.spec import GemmaRustServerSpec

READING_TOOLS = ("list_servers", "get_server", "server_events", "server_endpoint", "wait_for_server")
GRS = "/apis/gemmarust.dev/v1alpha1/namespaces/team-a/gemmarustservers"


class FakeKube:
    """Stands in for gemma_operator.kube.Kube where no API server runs: answers GETs from `objects` (path ->
    object, or a list of objects handed out one per GET, the last repeated), raises `errors` (path -> ApiError),
    and records every request, so a test can assert that a refusal sent no write."""

    def __init__(self, objects: dict[str, Any] | None = None, errors: dict[str, ApiError] | None = None):
        self.objects = objects or {}
        self.errors = errors or {}
        self.requests: list[tuple[str, str]] = []

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> dict[str, Any]:
        self.requests.append((method, path))
        if path in self.errors:
            raise self.errors[path]
        if method == "GET" and path in self.objects:
            got = self.objects[path]
            if isinstance(got, list):
                return got.pop(0) if len(got) > 1 else got[0]
            return got
        raise AssertionError(f"FakeKube: unexpected {method} {path}")


def grs(name: str = "g", spec: dict | None = None, status: dict | None = None, generation: int = 1) -> dict:
    return {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer",
            "metadata": {"name": name, "namespace": "team-a", "uid": "u-1", "generation": generation},
            "spec": spec or {"model": {"source": "hf://google/gemma-4-e2b-it"}}, "status": status or {}}


def use(k, fn, read_only: bool = False, mode: str = "auto"):
    """Run `fn(client)` against a fresh in-process server on `k`. `mode` "legacy" connects through the SDK's
    InMemoryTransport (JSON-RPC over memory streams, with the initialize handshake); "auto" dispatches directly."""

    async def go():
        async with Client(build_server(k, default_namespace="team-a", read_only=read_only), mode=mode) as client:
            return await fn(client)

    return asyncio.run(go())


def call(k, name: str, args: dict, **kw):
    return use(k, lambda c: c.call_tool(name, args), **kw)


def tools(read_only: bool = False, mode: str = "auto") -> dict:
    return {t.name: t for t in use(FakeKube(), lambda c: c.list_tools(), read_only=read_only, mode=mode).tools}


def text(result) -> str:
    return result.content[0].text


@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_every_tool_is_listed_with_an_input_and_an_output_schema(mode):
    listed = tools(mode=mode)
    assert set(listed) == set(READING_TOOLS) | set(WRITING_TOOLS)
    for name, tool in listed.items():
        assert tool.input_schema["type"] == "object", name
        assert tool.output_schema and tool.output_schema["type"] == "object", name
    assert all(listed[n].annotations.read_only_hint for n in READING_TOOLS)
    assert listed["delete_server"].annotations.destructive_hint is True
    assert not listed["deploy_server"].annotations.read_only_hint
    assert set(listed["delete_server"].input_schema["required"]) == {"name", "confirm"}
    assert set(listed["get_server"].output_schema["properties"]) >= {
        "phase", "ready", "replicas", "conditions", "pods", "last_failure"}


def test_read_only_leaves_the_writing_tools_out_and_calling_one_is_an_error():
    assert set(tools(read_only=True)) == set(READING_TOOLS)
    k = FakeKube()
    result = call(k, "delete_server", {"name": "g", "confirm": "g"}, read_only=True)
    assert result.is_error and "Unknown tool: delete_server" in text(result)
    assert k.requests == []


def test_deploy_servers_spec_schema_is_the_operators_spec_model():
    schema = tools()["deploy_server"].input_schema
    model = GemmaRustServerSpec.model_json_schema(by_alias=True)
    assert schema["properties"]["spec"] == {"$ref": "#/$defs/GemmaRustServerSpec"}
    assert "spec" in schema["required"] and "name" in schema["required"]
    assert schema["$defs"]["GemmaRustServerSpec"] == {k: v for k, v in model.items() if k != "$defs"}
    for name, sub in model["$defs"].items():
        assert schema["$defs"][name] == sub, name
    # camelCase, as in the CRD: the same names kubectl shows.
    assert {"maxNumSeqs", "prefillChunk"} <= set(model["$defs"]["EngineSpec"]["properties"])


def test_deploy_refuses_a_spec_the_model_rejects_before_any_request():
    k = FakeKube()
    spec = {"model": {"source": "hf://a/b"}, "engine": {"context": 10}}
    result = call(k, "deploy_server", {"name": "g", "spec": spec})
    assert result.is_error and "spec.engine.context" in text(result)
    assert k.requests == []


def test_manifest_carries_only_the_fields_the_caller_set():
    spec = GemmaRustServerSpec.model_validate({"model": {"source": "hf://a/b"}, "accelerator": {"type": "cpu"},
                                               "engine": {"maxNumSeqs": 4}})
    assert cluster.manifest("g", "team-a", spec) == {
        "apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer",
        "metadata": {"name": "g", "namespace": "team-a"},
        "spec": {"model": {"source": "hf://a/b"}, "accelerator": {"type": "cpu"}, "engine": {"maxNumSeqs": 4}}}


@pytest.mark.parametrize("confirm", ["", "other", "G"])
def test_delete_without_the_name_as_confirmation_is_refused_and_sends_nothing(confirm):
    k = FakeKube()
    result = call(k, "delete_server", {"name": "g", "confirm": confirm})
    assert result.is_error
    assert "refused" in text(result) and "confirm='g'" in text(result)
    assert k.requests == []


def test_scale_is_refused_while_autoscaling_owns_the_replicas():
    autoscaled = grs(spec={"model": {"source": "hf://a/b"}, "replicas": 1,
                           "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "target": 4}})
    k = FakeKube({f"{GRS}/g": autoscaled})
    result = call(k, "scale_server", {"name": "g", "replicas": 3})
    assert result.is_error
    assert "spec.autoscaling owns its replicas (1..4)" in text(result)
    assert k.requests == [("GET", f"{GRS}/g")]  # read, never written


@pytest.mark.parametrize("status, body, expected", [
    (404, {"message": 'gemmarustservers.gemmarust.dev "g" not found'},
     'GemmaRustServer team-a/g: not found (HTTP 404): gemmarustservers.gemmarust.dev "g" not found'),
    (403, {"message": 'gemmarustservers.gemmarust.dev "g" is forbidden: User "bob" cannot get resource'},
     'GemmaRustServer team-a/g: forbidden (HTTP 403): gemmarustservers.gemmarust.dev "g" is forbidden: User "bob"'),
])
def test_api_errors_come_back_as_tool_errors_naming_what_is_wrong(status, body, expected):
    k = FakeKube(errors={f"{GRS}/g": ApiError(status, json.dumps(body), f"GET {GRS}/g")})
    result = call(k, "get_server", {"name": "g"})
    assert result.is_error and result.structured_content is None
    assert expected in text(result)
    assert "Traceback" not in text(result)


def test_get_server_returns_the_operators_status_as_structured_content():
    status = {"phase": "LoadingWeights", "reason": "LoadingWeights", "message": "pod g-1: engine stage weights",
              "observedGeneration": 1, "readyReplicas": 0,
              "conditions": [{"type": "Ready", "status": "False", "reason": "LoadingWeights", "message": "m",
                              "lastTransitionTime": "2026-01-01T00:00:00Z"}],
              "pods": [{"name": "g-1", "node": "n", "ready": False, "stage": "LoadingWeights", "restarts": 0,
                        "engineStage": "weights",
                        "stages": [{"stage": "build", "status": "ok", "seconds": 61.2},
                                   {"stage": "weights", "status": "running", "seconds": 0.5}]}],
              "lastFailure": {"pod": "g-1", "reason": "Error", "exitCode": 1, "message": "weights: out of memory"}}
    result = call(FakeKube({f"{GRS}/g": grs(status=status)}), "get_server", {"name": "g"})
    assert not result.is_error, text(result)
    out = result.structured_content
    assert (out["phase"], out["ready"], out["replicas"]) == ("LoadingWeights", 0, 1)
    assert out["pods"][0]["stage"] == "LoadingWeights" and out["pods"][0]["engine_stage"] == "weights"
    assert out["pods"][0]["stages"][0] == {"stage": "build", "status": "ok", "seconds": 61.2}
    assert out["last_failure"] == {"pod": "g-1", "reason": "Error", "exit_code": 1, "message": "weights: out of memory"}
    assert out["conditions"][0]["reason"] == "LoadingWeights"


def test_wait_reports_each_stage_change_and_ignores_a_status_of_an_older_generation(monkeypatch):
    monkeypatch.setattr(mcp_server, "POLL_SECONDS", 0.01)

    def status(phase, pod_stage, engine, generation=2):
        done = [{"stage": "build", "status": "ok", "seconds": 61.2}] if engine != "build" else []
        return {"phase": phase, "observedGeneration": generation, "readyReplicas": int(phase == "Ready"),
                "pods": [{"name": "g-1", "stage": pod_stage, "engineStage": engine, "stages": done}]}
    sequence = [grs(status=status("Ready", "Ready", "serving", generation=1), generation=2),  # stale: not the end
                grs(status=status("Building", "Building", "build"), generation=2),
                grs(status=status("Building", "Building", "build"), generation=2),
                grs(status=status("LoadingWeights", "LoadingWeights", "weights"), generation=2),
                grs(status=status("Ready", "Ready", "serving"), generation=2)]
    seen = []

    async def go(client):
        async def progress(done, total, message):
            seen.append((done, message))
        return await client.call_tool("wait_for_server", {"name": "g", "timeout_seconds": 60},
                                      progress_callback=progress)

    result = use(FakeKube({f"{GRS}/g": sequence}), go)
    assert not result.is_error, text(result)
    assert result.structured_content["outcome"] == "ready"
    messages = [m for _, m in seen]
    assert [d for d, _ in seen] == list(range(1, len(seen) + 1))
    assert messages == result.structured_content["stages_seen"]
    assert any("pod g-1: Building, engine stage build" in m for m in messages)
    assert any("pod g-1: LoadingWeights, engine stage weights (done: build 61.2 s)" in m for m in messages)
    assert messages[-1].startswith("phase Ready; pod g-1: Ready")


def test_wait_ends_at_its_timeout_with_the_last_state(monkeypatch):
    monkeypatch.setattr(mcp_server, "POLL_SECONDS", 0.01)
    booting = grs(status={"phase": "Building", "observedGeneration": 1, "pods": []})
    result = call(FakeKube({f"{GRS}/g": booting}), "wait_for_server", {"name": "g", "timeout_seconds": 0.2})
    assert not result.is_error, text(result)
    assert result.structured_content["outcome"] == "timeout"
    assert result.structured_content["server"]["phase"] == "Building"


@pytest.mark.parametrize("phase, expected", [("Failed", "failed"), ("Degraded", "degraded"), ("Stopped", "stopped"),
                                             ("Idle", "idle"), ("Waking", None), ("WarmingUp", None)])
def test_outcome_of_a_current_status(phase, expected):
    assert cluster.outcome(grs(status={"phase": phase, "observedGeneration": 1})) == expected
