"""`python -m gemma_operator.mcp [--read-only] [--context NAME] [--namespace NS]`: the operator's MCP server on
stdio, with the caller's kubeconfig ($KUBECONFIG or ~/.kube/config; in a pod, its ServiceAccount).

Register it with an MCP client, e.g. in `.mcp.json`:
    {"mcpServers": {"gemma-operator": {"command": "python", "args": ["-m", "gemma_operator.mcp", "--read-only"]}}}
"""

from __future__ import annotations

import argparse
from pathlib import Path

import kubernetes

from ..kube import Kube
from .server import build_server

IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def connect(context: str | None) -> tuple[Kube, str]:
    """An API client and the default namespace: the kubeconfig's (its current context, or `context`), or, with no
    kubeconfig inside a pod, the pod's ServiceAccount and namespace."""
    try:
        contexts, current = kubernetes.config.list_kube_config_contexts()
    except kubernetes.config.ConfigException as e:
        if context is None and IN_CLUSTER_NAMESPACE.is_file():
            kubernetes.config.load_incluster_config()
            return Kube(kubernetes.client.ApiClient()), IN_CLUSTER_NAMESPACE.read_text().strip() or "default"
        raise SystemExit(f"gemma_operator.mcp: no usable kubeconfig ($KUBECONFIG or ~/.kube/config): {e}") from e
    chosen = next((c for c in contexts if c["name"] == context), None) if context else current
    if chosen is None:
        raise SystemExit(f"gemma_operator.mcp: no context {context!r} in the kubeconfig; it has: "
                         + ", ".join(c["name"] for c in contexts))
    api = kubernetes.config.new_client_from_config(context=chosen["name"])
    return Kube(api), (chosen.get("context") or {}).get("namespace") or "default"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gemma_operator.mcp",
        description="The operator's MCP server: GemmaRustServer tools on stdio, with the caller's kubeconfig.")
    parser.add_argument("--read-only", action="store_true",
                        help="leave out the writing tools (deploy_server, scale_server, delete_server)")
    parser.add_argument("--context", help="kubeconfig context (default: the current one)")
    parser.add_argument("--namespace", help="namespace of tools called without one (default: the context's)")
    args = parser.parse_args(argv)
    k, namespace = connect(args.context)
    build_server(k, default_namespace=args.namespace or namespace, read_only=args.read_only).run("stdio")


if __name__ == "__main__":
    main()
