"""The HorizontalPodAutoscaler and KEDA's ScaledObject
(gemma_operator/builders/autoscaling.py): golden dicts, no cluster involved."""

from __future__ import annotations

import pytest

from gemma_operator.builders.autoscaling import build_hpa, build_scaled_object

from .specs import LABELS, META, SCALE_TARGET, scaling


def test_hpa_scales_the_server_on_the_pods_metric_prometheus_adapter_serves():
    assert build_hpa(scaling(minReplicas=2), META) == {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {"scaleTargetRef": SCALE_TARGET, "minReplicas": 2, "maxReplicas": 4,
                 "metrics": [{"type": "Pods", "pods": {"metric": {"name": "gemma_num_requests_waiting"},
                                                       "target": {"type": "AverageValue", "averageValue": "4"}}}]},
    }


def test_hpa_names_the_metric_as_gkes_adapter_does_and_a_fraction_in_milli_units():
    hpa = build_hpa(scaling(metric="kvCacheUsage", target=0.75, metricsAdapter="GKE"), META)
    assert hpa["spec"]["metrics"][0]["pods"] == {
        "metric": {"name": "prometheus.googleapis.com|gemma_kv_cache_usage_perc|gauge"},
        "target": {"type": "AverageValue", "averageValue": "750m"}}


def test_scaled_object_queries_prometheus_for_the_servers_pods():
    spec = scaling(metric="requestsRunning", target=8,
                   prometheus={"serverAddress": "http://prometheus.monitoring.svc:9090", "authenticationRef": "gmp"})
    assert build_scaled_object(spec, META) == {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {"scaleTargetRef": SCALE_TARGET, "minReplicaCount": 1, "maxReplicaCount": 4,
                 "triggers": [{"type": "prometheus", "metadata": {
                     "serverAddress": "http://prometheus.monitoring.svc:9090",
                     "query": 'sum(gemma_num_requests_running{namespace="serving",pod=~"gemma-[a-z0-9]+-[a-z0-9]+"})',
                     "threshold": "8"}, "authenticationRef": {"name": "gmp"}}]},
    }


@pytest.mark.parametrize("autoscaling,message", [
    ({"minReplicas": 5, "maxReplicas": 4, "target": 1}, "minReplicas must not exceed"),
    ({"maxReplicas": 4, "target": 1, "provider": "KEDA"}, "set spec.autoscaling.prometheus.serverAddress"),
    ({"maxReplicas": 4, "target": 2, "metric": "kvCacheUsage"}, "a fraction of the KV cache"),
])
def test_autoscaling_rules_are_cel_in_the_crd(autoscaling, message):
    from gemma_operator import crd

    rules = crd.spec_schema()["properties"]["autoscaling"]["x-kubernetes-validations"]
    assert any(message in r["message"] for r in rules)
