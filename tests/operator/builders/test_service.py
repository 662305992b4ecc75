"""The Service and the endpoint it gives (gemma_operator/builders/service.py): golden dicts, no cluster involved."""

from __future__ import annotations

from gemma_operator.builders.service import build_service, endpoint

from .specs import LABELS, META, SELECTOR, tpu_spec


def test_service_matches_golden():
    assert build_service(tpu_spec(server={"port": 9000}), META) == {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {"type": "ClusterIP", "selector": SELECTOR,
                 "ports": [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]},
    }


def test_endpoint_is_the_services_dns_name():
    assert endpoint(tpu_spec(), META) == "http://gemma.serving.svc.cluster.local:8000/v1"
