"""The MCP server's Kubernetes side: small functions over `gemma_operator.kube.Kube`, one per question a tool
asks, each returning the tool's result model or raising `ClusterError` with a sentence a model can act on.

No MCP here (`gemma_operator.mcp.server` wires these to tools), so a test can call each with a `Kube` on the
local control plane. Reads and writes go through the same raw-JSON edge the operator uses (kube.py), with
the caller's credentials: server-side apply of the custom resource under its own field manager
(`FIELD_MANAGER`, so `kubectl get grs -o yaml --show-managed-fields` tells the assistant's writes apart from
the operator's), replicas through the CRD's scale subresource (the endpoint `kubectl scale` and
kubernetes-client's `CustomObjectsApi.patch_namespaced_custom_object_scale` use), deletion by name.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field

from ..builders.ownership import Meta
from ..builders.service import service_host
from ..events import event_time
from ..kube import GRS_API_VERSION, UNREACHABLE, ApiError, Kube, collection_path
from ..redact import redact
from ..spec import API_GROUP, API_VERSION, KIND, PLURAL, GemmaRustServerSpec
from ..status import DEGRADED, FAILED, IDLE, READY, STOPPED

FIELD_MANAGER = "gemma-operator-mcp"
MAX_EVENTS = 100


class ClusterError(Exception):
    """What went wrong, worded for the caller (the tool error's text)."""


def explain(e: ApiError, what: str) -> ClusterError:
    """An API error as a sentence naming `what` and the API server's own message, verbatim (pure)."""
    if e.status == UNREACHABLE:
        return ClusterError(f"{what}: {e.message}")
    meaning = {400: "bad request", 403: "forbidden", 404: "not found", 409: "conflict", 422: "invalid"}
    return ClusterError(f"{what}: {meaning.get(e.status, 'API error')} (HTTP {e.status}): {e.message}")


def _call(k: Kube, what: str, method: str, path: str, body: Any = None, **kw: Any) -> dict[str, Any]:
    try:
        return k.request(method, path, body, **kw)
    except ApiError as e:
        raise explain(e, what) from e


def _grs_path(namespace: str, name: str = "") -> str:
    base = collection_path(GRS_API_VERSION, KIND, namespace)
    return f"{base}/{name}" if name else base


# ---------------------------------------------------------------------------------------------------------
# Result models (the tools' output schemas)


class ServerSummary(BaseModel):
    name: str
    namespace: str
    phase: str = Field(description="Pending, Scheduling, Building, SmokeTesting, LoadingWeights, WarmingUp, Ready, "
                       "Degraded, Failed or Stopped; empty before the operator's first status.")
    ready: int = Field(description="Pods ready.")
    replicas: int = Field(description="Pods asked for (spec.replicas).")
    model: str = Field(description="spec.model.source.")


class ServerList(BaseModel):
    servers: list[ServerSummary]


class StageTime(BaseModel):
    stage: str = Field(description="gemma_server boot stage: build, import, smoke, weights, warmup, serving.")
    status: str = Field(description="ok, running, or failed.")
    seconds: float | None = None


class PodState(BaseModel):
    name: str
    node: str = ""
    ready: bool = False
    stage: str = Field(description="Where the pod is: a phase of the boot (Scheduling .. Ready) or Failed.")
    engine_stage: str = Field("", description="The server's own /v1/engine stage, when it reported one.")
    reason: str = ""
    message: str = ""
    restarts: int = 0
    stages: list[StageTime] = Field(default_factory=list, description="Each boot stage with its seconds.")


class Condition(BaseModel):
    type: str
    status: str
    reason: str = ""
    message: str = ""
    last_transition_time: str = ""


class LastFailure(BaseModel):
    pod: str = ""
    reason: str = ""
    exit_code: int | None = None
    message: str = ""


class ServerState(BaseModel):
    name: str
    namespace: str
    phase: str
    reason: str = ""
    message: str = ""
    ready: int
    replicas: int
    model: str
    autoscaled: bool = Field(description="spec.autoscaling is set: an autoscaler owns the replicas.")
    endpoint: str = Field("", description="In-cluster OpenAI base URL.")
    generation: int = 0
    observed_generation: int = 0
    conditions: list[Condition]
    pods: list[PodState]
    last_failure: LastFailure | None = None


class EventItem(BaseModel):
    type: str = Field(description="Normal or Warning.")
    reason: str
    message: str
    object: str = Field(description="kind/name of the object the event is about.")
    count: int = 1
    last_seen: str = ""
    source: str = ""


class EventList(BaseModel):
    events: list[EventItem] = Field(description="Newest first.")


class DeployResult(BaseModel):
    name: str
    namespace: str
    dry_run: bool
    generation: int = Field(0, description="metadata.generation the API server returned (on a dry run, what it "
                            "would be).")
    spec: dict[str, Any] = Field(description="The spec as the API server stored it (or would), defaults filled in.")


class ScaleResult(BaseModel):
    name: str
    namespace: str
    previous: int
    replicas: int


class DeleteResult(BaseModel):
    name: str
    namespace: str
    deleted: bool


class Endpoint(BaseModel):
    service: str
    namespace: str
    cluster_ip: str = ""
    urls: list[str] = Field(description="http://<service>.<namespace>.svc.cluster.local:<port> for each port.")
    openai_base_url: str = Field(description="What an OpenAI client takes as base_url (the http port, /v1).")


# ---------------------------------------------------------------------------------------------------------
# Reading


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def summary(obj: dict[str, Any]) -> ServerSummary:
    """One line of `list_servers` from a stored GemmaRustServer (pure)."""
    spec, st = obj.get("spec") or {}, obj.get("status") or {}
    return ServerSummary(name=obj["metadata"]["name"], namespace=obj["metadata"]["namespace"],
                         phase=st.get("phase", ""), ready=_int(st.get("readyReplicas")),
                         replicas=_int(spec.get("replicas"), 1), model=(spec.get("model") or {}).get("source", ""))


def state(obj: dict[str, Any]) -> ServerState:
    """`get_server`'s view of a stored GemmaRustServer: what the operator wrote into its status (pure).

    The pod entries are `status.pods[]` as gemma_operator.status.compute_status writes them (`stage` the pod's
    phase, `engineStage` and `stages` from the server's /v1/engine report); `lastFailure` is the last crash's
    termination message, already redacted by the operator.
    """
    meta, spec, st = obj["metadata"], obj.get("spec") or {}, obj.get("status") or {}
    pods = [PodState(name=p.get("name", ""), node=p.get("node", ""), ready=bool(p.get("ready")),
                     stage=p.get("stage", ""), engine_stage=p.get("engineStage", ""),
                     reason=p.get("reason", ""), message=p.get("message", ""), restarts=_int(p.get("restarts")),
                     stages=[StageTime(stage=s.get("stage", ""), status=s.get("status", ""),
                                       seconds=s.get("seconds")) for s in p.get("stages") or []])
            for p in st.get("pods") or []]
    failure = st.get("lastFailure")
    return ServerState(
        name=meta["name"], namespace=meta["namespace"], phase=st.get("phase", ""), reason=st.get("reason", ""),
        message=st.get("message", ""), ready=_int(st.get("readyReplicas")), replicas=_int(spec.get("replicas"), 1),
        model=(spec.get("model") or {}).get("source", ""), autoscaled=bool(spec.get("autoscaling")),
        endpoint=st.get("endpoint", ""), generation=_int(meta.get("generation")),
        observed_generation=_int(st.get("observedGeneration")),
        conditions=[Condition(type=c.get("type", ""), status=c.get("status", ""), reason=c.get("reason", ""),
                              message=c.get("message", ""), last_transition_time=c.get("lastTransitionTime", ""))
                    for c in st.get("conditions") or []],
        pods=pods,
        last_failure=LastFailure(pod=failure.get("pod", ""), reason=failure.get("reason", ""),
                                 exit_code=failure.get("exitCode"), message=failure.get("message", ""))
        if failure else None)


def read_server(k: Kube, namespace: str, name: str) -> dict[str, Any]:
    """The stored GemmaRustServer `namespace/name`."""
    return _call(k, f"GemmaRustServer {namespace}/{name}", "GET", _grs_path(namespace, name))


def list_servers(k: Kube, namespace: str | None) -> ServerList:
    """The GemmaRustServers of `namespace`, or of every namespace when it is None."""
    path = _grs_path(namespace) if namespace else f"/apis/{API_GROUP}/{API_VERSION}/{PLURAL}"
    where = f"namespace {namespace}" if namespace else "all namespaces"
    try:
        items = k.request("GET", path).get("items") or []
    except ApiError as e:
        if e.status == 404:
            raise ClusterError(f"GemmaRustServers in {where}: the API server does not serve {API_GROUP}/"
                               f"{API_VERSION}: is the GemmaRustServer CRD installed?") from e
        raise explain(e, f"GemmaRustServers in {where}") from e
    return ServerList(servers=sorted((summary(o) for o in items), key=lambda s: (s.namespace, s.name)))


def get_server(k: Kube, namespace: str, name: str) -> ServerState:
    return state(read_server(k, namespace, name))


def _pod_name_re(name: str) -> re.Pattern[str]:
    # A Deployment's ReplicaSets are <deployment>-<pod-template-hash>, its pods <replicaset>-<suffix>
    # (kubernetes pkg/controller/deployment/sync.go, pkg/controller/controller_utils.go); the operator names
    # the Deployment after the server (builders/deployment.py).
    return re.compile(rf"^{re.escape(name)}-[a-z0-9]+(-[a-z0-9]+)?$")


def server_events(k: Kube, namespace: str, name: str, limit: int = 20) -> EventList:
    """The Events about a GemmaRustServer, its Deployment, ReplicaSets and pods, newest first, at most `limit`;
    messages redacted as the operator redacts what a pod writes (gemma_operator.redact)."""
    obj = read_server(k, namespace, name)
    uid = obj["metadata"].get("uid", "")
    owned = _pod_name_re(name)
    items = _call(k, f"Events in namespace {namespace}", "GET",
                  collection_path("v1", "Event", namespace)).get("items") or []

    def about(e: dict[str, Any]) -> bool:
        inv = e.get("involvedObject") or {}
        kind, obj_name = inv.get("kind"), inv.get("name", "")
        if kind == KIND:
            return inv.get("uid") == uid or (not inv.get("uid") and obj_name == name)
        if kind == "Deployment":
            return obj_name == name
        if kind == "ReplicaSet":
            return bool(owned.match(obj_name)) and obj_name.count("-") == name.count("-") + 1
        return kind == "Pod" and bool(owned.match(obj_name)) and obj_name.count("-") == name.count("-") + 2

    mine = sorted((e for e in items if about(e)), key=event_time, reverse=True)[:max(1, min(limit, MAX_EVENTS))]
    return EventList(events=[EventItem(
        type=e.get("type", ""), reason=e.get("reason", ""), message=redact(e.get("message") or ""),
        object=f"{(e.get('involvedObject') or {}).get('kind', '')}/{(e.get('involvedObject') or {}).get('name', '')}",
        count=_int(e.get("count"), 1), last_seen=event_time(e),
        source=(e.get("source") or {}).get("component") or e.get("reportingComponent") or "") for e in mine])


def server_endpoint(k: Kube, namespace: str, name: str) -> Endpoint:
    """The in-cluster URLs of the server's Service (named after the server, port `http`: builders/service.py)."""
    read_server(k, namespace, name)  # a clear "GemmaRustServer not found" before "Service not found"
    svc = _call(k, f"Service {namespace}/{name} (the operator creates it with the server's Deployment)", "GET",
                f"{collection_path('v1', 'Service', namespace)}/{name}")
    host = service_host(Meta(name, namespace))
    ports = (svc.get("spec") or {}).get("ports") or []
    urls = [f"http://{host}:{p['port']}" for p in ports if "port" in p]
    http = next((p for p in ports if p.get("name") == "http"), ports[0] if ports else None)
    return Endpoint(service=name, namespace=namespace, cluster_ip=(svc.get("spec") or {}).get("clusterIP", ""),
                    urls=urls, openai_base_url=f"http://{host}:{http['port']}/v1" if http else "")


# ---------------------------------------------------------------------------------------------------------
# Waiting (the pure parts; the loop is in server.py, where progress is reported)

Outcome = Literal["ready", "failed", "degraded", "stopped", "idle", "timeout"]


def outcome(obj: dict[str, Any]) -> Outcome | None:
    """Whether waiting on this server is over: its status is of the current generation and says Ready, Failed,
    Degraded (a condition names why), Stopped, or Idle (scaled to zero: it boots at its next request); None while
    it boots (pure)."""
    meta, st = obj["metadata"], obj.get("status") or {}
    if _int(st.get("observedGeneration")) < _int(meta.get("generation"), 1):
        return None  # the operator has not written a status for this spec yet
    return {READY: "ready", FAILED: "failed", DEGRADED: "degraded", STOPPED: "stopped", IDLE: "idle"}.get(
        st.get("phase", ""))


def stage_marks(obj: dict[str, Any]) -> dict[str, str]:
    """Each pod's boot stage as one comparable line ("" key: the server's phase), for noticing a change (pure)."""
    st = obj.get("status") or {}
    marks = {"": f"phase {st.get('phase') or 'not reported yet'}"}
    for p in st.get("pods") or []:
        engine = f", engine stage {p['engineStage']}" if p.get("engineStage") else ""
        marks[p.get("name", "")] = f"pod {p.get('name', '')}: {p.get('stage', '')}{engine}"
    return marks


def stage_message(obj: dict[str, Any], changed: list[str]) -> str:
    """The progress message for the pods (and phase) whose stage changed, with the seconds of finished stages."""
    st = obj.get("status") or {}
    pods = {p.get("name", ""): p for p in st.get("pods") or []}
    parts = []
    for key in changed:
        line = stage_marks(obj)[key]
        done = [f"{s['stage']} {s['seconds']:g} s" for s in (pods.get(key) or {}).get("stages") or []
                if s.get("status") == "ok" and isinstance(s.get("seconds"), (int, float))]
        parts.append(line + (f" (done: {', '.join(done)})" if done else ""))
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------------------
# Writing


def manifest(name: str, namespace: str, spec: GemmaRustServerSpec) -> dict[str, Any]:
    """The object `deploy_server` applies: only the fields the caller set (unset ones are left to the CRD's
    defaults, so this field manager does not own them) (pure)."""
    return {"apiVersion": GRS_API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": namespace},
            "spec": spec.model_dump(mode="json", by_alias=True, exclude_unset=True)}


def deploy_server(k: Kube, namespace: str, name: str, spec: GemmaRustServerSpec, *, dry_run: bool = False,
                  force_conflicts: bool = False) -> DeployResult:
    """Server-side apply a GemmaRustServer as FIELD_MANAGER (dryRun=All with `dry_run`); admission's refusal (the
    CRD's schema and CEL rules, a ValidatingAdmissionPolicy) comes back as the API server worded it."""
    query = {"fieldManager": FIELD_MANAGER, "force": "true" if force_conflicts else "false"}
    if dry_run:
        query["dryRun"] = "All"
    out = _call(k, f"apply GemmaRustServer {namespace}/{name}{' (dry run)' if dry_run else ''}", "PATCH",
                _grs_path(namespace, name), manifest(name, namespace, spec), query=query,
                content_type="application/apply-patch+yaml")
    return DeployResult(name=name, namespace=namespace, dry_run=dry_run,
                        generation=_int(out["metadata"].get("generation")), spec=out.get("spec") or {})


def scale_refusal(obj: dict[str, Any]) -> str | None:
    """Why `scale_server` must not touch this server's replicas, or None (pure): with spec.autoscaling set, the
    autoscaler writes spec.replicas through the same scale subresource (spec.py, AutoscalingSpec), so a
    replica count set by hand lasts until its next decision."""
    scaling = (obj.get("spec") or {}).get("autoscaling")
    if not scaling:
        return None
    name = obj["metadata"]["name"]
    return (f"GemmaRustServer {obj['metadata']['namespace']}/{name} is autoscaled: spec.autoscaling owns its "
            f"replicas ({scaling.get('minReplicas', 1)}..{scaling.get('maxReplicas', '?')}); change "
            f"spec.autoscaling.minReplicas/maxReplicas with deploy_server, or remove spec.autoscaling to set "
            f"replicas by hand")


def scale_server(k: Kube, namespace: str, name: str, replicas: int) -> ScaleResult:
    """Set spec.replicas through the scale subresource, unless spec.autoscaling owns it."""
    obj = read_server(k, namespace, name)
    if why := scale_refusal(obj):
        raise ClusterError(why)
    what = f"scale GemmaRustServer {namespace}/{name}"
    path = f"{_grs_path(namespace, name)}/scale"
    before = _call(k, what, "GET", path)
    after = _call(k, what, "PATCH", path, {"spec": {"replicas": replicas}},
                  query={"fieldManager": FIELD_MANAGER}, content_type="application/merge-patch+json")
    return ScaleResult(name=name, namespace=namespace, previous=_int((before.get("spec") or {}).get("replicas")),
                       replicas=_int((after.get("spec") or {}).get("replicas")))


def delete_refusal(name: str, confirm: str) -> str | None:
    """Why `delete_server` refuses, or None (pure): the name must be repeated as `confirm`."""
    if confirm == name:
        return None
    return (f"refused: deleting GemmaRustServer {name} deletes its Deployment, pods and Service; repeat the name "
            f"as confirm (confirm={name!r}) to delete it")


def delete_server(k: Kube, namespace: str, name: str, confirm: str) -> DeleteResult:
    if why := delete_refusal(name, confirm):
        raise ClusterError(why)
    _call(k, f"delete GemmaRustServer {namespace}/{name}", "DELETE", _grs_path(namespace, name))
    return DeleteResult(name=name, namespace=namespace, deleted=True)
