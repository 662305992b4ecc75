"""Scrape configuration for the server's /metrics: GKE managed Prometheus' PodMonitoring and the Prometheus
Operator's ServiceMonitor, both optional kinds (builders.optional) (pure)."""

from __future__ import annotations

from typing import Any

from ..spec import GemmaRustServerSpec
from .ownership import Meta, child_object, selector_labels


def build_pod_monitoring(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any] | None:
    """GKE managed Prometheus PodMonitoring scraping /metrics, when asked for."""
    if not spec.monitoring.pod_monitoring:
        return None
    return _scrape_monitor("monitoring.googleapis.com/v1", "PodMonitoring", spec, meta)


def build_service_monitor(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any] | None:
    """Prometheus Operator ServiceMonitor scraping /metrics through the Service, when asked for."""
    if not spec.monitoring.service_monitor:
        return None
    return _scrape_monitor("monitoring.coreos.com/v1", "ServiceMonitor", spec, meta)


def _scrape_monitor(api_version: str, kind: str, spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any]:
    """PodMonitoring and ServiceMonitor share this spec shape: a selector and one /metrics endpoint."""
    monitor = child_object(api_version, kind, meta.name, meta)
    monitor["spec"] = {"selector": {"matchLabels": selector_labels(meta)},
                       "endpoints": [{"port": "http", "path": "/metrics", "interval": spec.monitoring.interval}]}
    return monitor
