"""Kubernetes operator for GemmaRustServer."""
