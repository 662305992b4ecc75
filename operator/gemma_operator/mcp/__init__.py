"""The operator's Model Context Protocol server (`python -m gemma_operator.mcp`): GemmaRustServer tools for an
assistant, over stdio with the caller's kubeconfig. `cluster` holds the Kubernetes calls, `server` the MCP
wiring, `__main__` the command line."""
