"""The operator's MCP server: GemmaRustServer tools for an assistant, on the official SDK (`mcp` 2.3.0,
`mcp.server.mcpserver.MCPServer`, the renamed FastMCP).

Domain-shaped, not a Kubernetes proxy (containers/kubernetes-mcp-server is the generic one, and its
`--read-only` the precedent for ours): each tool is one question about a GemmaRustServer, its input schema
from a signature and, for `deploy_server`, from the operator's own spec model (spec.GemmaRustServerSpec, the
model the CRD is generated from), its result a pydantic model, so the SDK publishes an outputSchema and
returns structuredContent. The Kubernetes calls are in `gemma_operator.mcp.cluster`; a `ClusterError` there
becomes a tool error (`isError`, the API server's own message) here, never a crash.

`read_only=True` leaves the writing tools (deploy_server, scale_server, delete_server) out of the tool list.
`wait_for_server` polls the custom resource's status once a second (a GET each time, as `kubectl get -w`
would see it without a watch's reconnects) and sends a progress notification at every boot-stage change.
"""

from __future__ import annotations

import time
from typing import Annotated, Callable, TypeVar

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import BaseModel, Field

from ..kube import Kube
from ..spec import GemmaRustServerSpec
from . import cluster
from .cluster import ClusterError

WRITING_TOOLS = ("deploy_server", "scale_server", "delete_server")
POLL_SECONDS = 1.0

Name = Annotated[str, Field(description="The GemmaRustServer's name.", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                            max_length=63)]
Namespace = Annotated[str | None, Field(description="Its namespace; the kubeconfig context's namespace when "
                                        "omitted.", max_length=63)]

T = TypeVar("T")


class WaitResult(BaseModel):
    outcome: cluster.Outcome = Field(description="ready, failed, degraded (a condition says why), stopped "
                                     "(replicas 0), idle (scaled to zero by its autoscaler: the next request "
                                     "wakes it), or timeout.")
    seconds: float = Field(description="How long the wait took.")
    stages_seen: list[str] = Field(description="Each progress message sent, in order.")
    server: cluster.ServerState


def build_server(k: Kube, *, default_namespace: str = "default", read_only: bool = False) -> MCPServer:
    """The MCP server with its tools bound to `k`.

    Args:
        k: the API client (the caller's kubeconfig).
        default_namespace: the namespace of tools called without one.
        read_only: leave the writing tools out.
    """
    mcp = MCPServer("gemma-rust-operator", instructions=(
        "Deploy, watch, scale and delete GemmaRustServers (Gemma 4 model servers run by gemma-rust-operator). "
        "Use wait_for_server after deploy_server to follow the boot stages."))
    read = ToolAnnotations(read_only_hint=True, open_world_hint=False)

    def ns(namespace: str | None) -> str:
        return namespace or default_namespace

    def run(fn: Callable[..., T], *args, **kw) -> T:
        try:
            return fn(k, *args, **kw)
        except ClusterError as e:
            raise ToolError(str(e)) from e

    @mcp.tool(annotations=read)
    def list_servers(namespace: Annotated[str | None, Field(
            description="Only this namespace; every namespace when omitted.", max_length=63)] = None
    ) -> cluster.ServerList:
        """List GemmaRustServers: name, namespace, phase, ready/replicas and model source."""
        return run(cluster.list_servers, namespace)

    @mcp.tool(annotations=read)
    def get_server(name: Name, namespace: Namespace = None) -> cluster.ServerState:
        """One GemmaRustServer's state as the operator reports it: phase, ready/replicas, conditions, each pod's
        boot stage with the seconds each finished stage took, and the last failure's reason."""
        return run(cluster.get_server, ns(namespace), name)

    @mcp.tool(annotations=read)
    def server_events(name: Name, namespace: Namespace = None,
                      limit: Annotated[int, Field(ge=1, le=cluster.MAX_EVENTS, description="At most this many.")] = 20
                      ) -> cluster.EventList:
        """Kubernetes Events about a GemmaRustServer, its Deployment, ReplicaSets and pods, newest first."""
        return run(cluster.server_events, ns(namespace), name, limit)

    @mcp.tool(annotations=read)
    def server_endpoint(name: Name, namespace: Namespace = None) -> cluster.Endpoint:
        """The in-cluster URLs of a GemmaRustServer's Service, and the OpenAI base URL among them."""
        return run(cluster.server_endpoint, ns(namespace), name)

    @mcp.tool(annotations=read)
    async def wait_for_server(
            name: Name, ctx: Context, namespace: Namespace = None,
            timeout_seconds: Annotated[float, Field(gt=0, le=3600, description="Give up after this long.")] = 600,
    ) -> WaitResult:
        """Wait until a GemmaRustServer is Ready, has failed (or is Degraded: a condition says why), is stopped
        or idle (scaled to zero), or the timeout passes; a progress notification names each boot-stage change of
        any pod."""
        where = ns(namespace)
        start = time.monotonic()
        marks: dict[str, str] = {}
        seen: list[str] = []
        while True:
            obj = await anyio.to_thread.run_sync(lambda: run(cluster.read_server, where, name))
            now = cluster.stage_marks(obj)
            changed = [key for key, mark in now.items() if marks.get(key) != mark]
            marks = now
            if changed:
                message = cluster.stage_message(obj, changed)
                seen.append(message)
                await ctx.report_progress(len(seen), None, message)
            done = cluster.outcome(obj)
            elapsed = time.monotonic() - start
            if done or elapsed >= timeout_seconds:
                return WaitResult(outcome=done or "timeout", seconds=round(elapsed, 3), stages_seen=seen,
                                  server=cluster.state(obj))
            await anyio.sleep(min(POLL_SECONDS, timeout_seconds - elapsed))

    if read_only:
        return mcp

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True,
                                          open_world_hint=False))
    def deploy_server(
            name: Name, spec: GemmaRustServerSpec, namespace: Namespace = None,
            dry_run: Annotated[bool, Field(description="Ask the API server to check the object (admission "
                                           "included) without storing it (dryRun=All).")] = False,
            force_conflicts: Annotated[bool, Field(description="Take over fields another manager (e.g. kubectl) "
                                                   "set; without it such a conflict is an error naming them.")] = False,
    ) -> cluster.DeployResult:
        """Create or update a GemmaRustServer by server-side apply (field manager gemma-operator-mcp). `spec` is
        the GemmaRustServer spec; fields left out keep the CRD's defaults. Admission's refusal is returned as
        the API server words it."""
        return run(cluster.deploy_server, ns(namespace), name, spec, dry_run=dry_run,
                   force_conflicts=force_conflicts)

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True,
                                          open_world_hint=False))
    def scale_server(name: Name, replicas: Annotated[int, Field(ge=0, le=256, description="Pods wanted.")],
                     namespace: Namespace = None) -> cluster.ScaleResult:
        """Set a GemmaRustServer's replicas through its scale subresource; refused while spec.autoscaling owns
        them."""
        return run(cluster.scale_server, ns(namespace), name, replicas)

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True,
                                          open_world_hint=False))
    def delete_server(name: Name, confirm: Annotated[str, Field(description="The name again: the deletion happens "
                                                                "only when it equals name.")],
                      namespace: Namespace = None) -> cluster.DeleteResult:
        """Delete a GemmaRustServer (its Deployment, pods and Service go with it). Needs confirm equal to name."""
        return run(cluster.delete_server, ns(namespace), name, confirm)

    return mcp
