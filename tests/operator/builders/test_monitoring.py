"""PodMonitoring and ServiceMonitor (gemma_operator/builders/monitoring.py): golden dicts, no cluster involved."""

from __future__ import annotations

from gemma_operator.builders.monitoring import build_pod_monitoring, build_service_monitor

from .specs import LABELS, META, SELECTOR, tpu_spec


def test_pod_monitoring_and_service_monitor_match_golden():
    spec = tpu_spec(monitoring={"serviceMonitor": True, "interval": "15s"})
    endpoints = [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert build_pod_monitoring(spec, META) == {
        "apiVersion": "monitoring.googleapis.com/v1", "kind": "PodMonitoring",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {"selector": {"matchLabels": SELECTOR}, "endpoints": endpoints},
    }
    assert build_service_monitor(spec, META) == {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {"selector": {"matchLabels": SELECTOR}, "endpoints": endpoints},
    }
    assert build_service_monitor(tpu_spec(), META) is None
