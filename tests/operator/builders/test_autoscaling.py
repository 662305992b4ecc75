"""The HorizontalPodAutoscaler and KEDA's ScaledObject
(gemma_operator/builders/autoscaling.py): golden dicts, no cluster involved."""

from __future__ import annotations

import pytest

from gemma_operator.builders.autoscaling import build_hpa, build_scaled_object, metric_query, picker_queue_query
from gemma_operator.spec import GemmaRustServerSpec

from tests.charts.promql_check import parse_promql, promql_check, selects  # noqa: F401 - the fixture

from .specs import LABELS, META, SCALE_TARGET, autoscaler_for, scaling, tpu_spec


def test_hpa_scales_the_server_on_the_pods_metric_prometheus_adapter_serves():
    spec = scaling(minReplicas=2)
    assert build_hpa(spec, META, autoscaler_for(spec)) == {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {"scaleTargetRef": SCALE_TARGET, "minReplicas": 2, "maxReplicas": 4,
                 "metrics": [{"type": "Pods", "pods": {"metric": {"name": "gemma_num_requests_waiting"},
                                                       "target": {"type": "AverageValue", "averageValue": "4"}}}]},
    }


def test_hpa_names_the_metric_as_gkes_adapter_does_and_a_fraction_in_milli_units():
    spec = scaling(metric="kvCacheUsage", target=0.75, metricsAdapter="GKE")
    hpa = build_hpa(spec, META, autoscaler_for(spec))
    assert hpa["spec"]["metrics"][0]["pods"] == {
        "metric": {"name": "prometheus.googleapis.com|gemma_kv_cache_usage_perc|gauge"},
        "target": {"type": "AverageValue", "averageValue": "750m"}}


def test_scaled_object_queries_prometheus_for_the_servers_pods():
    spec = scaling(metric="requestsRunning", target=8,
                   prometheus={"serverAddress": "http://prometheus.monitoring.svc:9090", "authenticationRef": "gmp"})
    assert build_scaled_object(spec, META, autoscaler_for(spec)) == {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {"scaleTargetRef": SCALE_TARGET, "minReplicaCount": 1, "maxReplicaCount": 4,
                 "triggers": [{"type": "prometheus", "metadata": {
                     "serverAddress": "http://prometheus.monitoring.svc:9090",
                     "query": 'sum(gemma_num_requests_running{namespace="serving",pod=~"gemma-[a-z0-9]+-[a-z0-9]+"})',
                     "threshold": "8"}, "authenticationRef": {"name": "gmp"}}]},
    }


def test_scaled_object_names_a_cluster_trigger_authentication_by_its_kind():
    """KEDA's authenticationRef has a kind (TriggerAuthentication when unset); KEDA's own Managed Prometheus
    example (keda-docs 2.21, scalers/prometheus.md) names a ClusterTriggerAuthentication."""
    spec = scaling(prometheus={"serverAddress": "http://p:9090", "authenticationRef": "gmp",
                               "authenticationKind": "ClusterTriggerAuthentication"})
    (trigger,) = build_scaled_object(spec, META, autoscaler_for(spec))["spec"]["triggers"]
    assert trigger["authenticationRef"] == {"name": "gmp", "kind": "ClusterTriggerAuthentication"}


@pytest.mark.parametrize("autoscaling,message", [
    ({"minReplicas": 5, "maxReplicas": 4, "target": 1}, "minReplicas must not exceed"),
    ({"maxReplicas": 4, "target": 1, "provider": "KEDA"}, "set spec.autoscaling.prometheus.serverAddress"),
    ({"maxReplicas": 4, "target": 2, "metric": "kvCacheUsage"}, "a fraction of the KV cache"),
])
def test_autoscaling_rules_are_cel_in_the_crd(autoscaling, message):
    from gemma_operator import crd

    rules = crd.spec_schema()["properties"]["autoscaling"]["x-kubernetes-validations"]
    assert any(message in r["message"] for r in rules)


GMP = "https://monitoring.googleapis.com/v1/projects/p/location/global/prometheus"


def test_the_keda_query_selects_only_this_clusters_pods(promql_check):
    """Parsed by Prometheus's own parser; its matchers applied to the series Managed Prometheus holds for two
    clusters of one project that both run `gemma` in `serving`, and to another server's pod."""
    spec = scaling(prometheus={"serverAddress": GMP, "cluster": "prod-us"})
    query = build_scaled_object(spec, META, autoscaler_for(spec))["spec"]["triggers"][0]["metadata"]["query"]
    (parsed,) = parse_promql(promql_check, [query])
    (selector,) = parsed["selectors"]
    assert selector["metric"] == "gemma_num_requests_waiting"
    series = {
        "this cluster": {"cluster": "prod-us", "namespace": "serving", "pod": "gemma-5d9f8b7c4-x2x9q"},
        "a staging cluster of the project": {"cluster": "staging-us", "namespace": "serving",
                                             "pod": "gemma-5d9f8b7c4-x2x9q"},
        "another server": {"cluster": "prod-us", "namespace": "serving", "pod": "gemma-big-7c4d9f8b5-q9x2x"},
    }
    chosen = {where for where, labels in series.items() if selects(selector["matchers"], labels)}
    assert chosen == {"this cluster"}
    # Without a cluster name the query sums the staging cluster's pod in too: what the matcher is for.
    spec = scaling(prometheus={"serverAddress": GMP})
    unscoped = build_scaled_object(spec, META, autoscaler_for(spec))["spec"]["triggers"][0]
    (parsed,) = parse_promql(promql_check, [unscoped["metadata"]["query"]])
    assert {w for w, labels in series.items() if selects(parsed["selectors"][0]["matchers"], labels)} == {
        "this cluster", "a staging cluster of the project"}


def test_the_operators_cluster_name_is_the_default_and_the_spec_wins():
    from gemma_operator.handlers import with_defaults
    from gemma_operator.settings import Settings

    named = Settings(cluster_name="prod-us")
    spec = with_defaults(scaling(prometheus={"serverAddress": GMP}), named)
    assert spec.autoscaling.prometheus.cluster == "prod-us"
    (trigger,) = build_scaled_object(spec, META, autoscaler_for(spec))["spec"]["triggers"]
    assert 'cluster="prod-us"' in trigger["metadata"]["query"]
    own = with_defaults(scaling(prometheus={"serverAddress": GMP, "cluster": "eu-west"}), named)
    assert own.autoscaling.prometheus.cluster == "eu-west"
    assert with_defaults(scaling(prometheus={"serverAddress": GMP}), Settings()).autoscaling.prometheus.cluster is None
    plain = tpu_spec()
    assert plain.autoscaling is None and with_defaults(plain, named) == plain


# --------------------------------------------------------------------------------------------- scale to zero

ZERO = {"minReplicas": 0, "idleSeconds": 300, "wakeTimeoutSeconds": 900}
EXTERNAL_PUSH = {"type": "external-push", "metadata": {
    "scalerAddress": "keda-add-ons-http-external-scaler.keda:9090", "httpScaledObject": "gemma"}}


def test_at_zero_without_prometheus_keda_scales_on_the_http_add_ons_requests_alone():
    spec = scaling(**ZERO)
    assert build_scaled_object(spec, META, autoscaler_for(spec))["spec"] == {
        "scaleTargetRef": SCALE_TARGET, "minReplicaCount": 0, "maxReplicaCount": 4, "cooldownPeriod": 300,
        "initialCooldownPeriod": 300,
        "triggers": [EXTERNAL_PUSH]}
    assert "ScaledObject" in autoscaler_for(spec).kinds
    assert "HorizontalPodAutoscaler" not in autoscaler_for(spec).kinds  # it would hold one replica


def test_at_zero_with_prometheus_the_metric_trigger_stays_beside_the_add_ons():
    spec = scaling(prometheus={"serverAddress": "http://p:9090"}, **ZERO)
    kinds = [t["type"] for t in build_scaled_object(spec, META, autoscaler_for(spec))["spec"]["triggers"]]
    assert kinds == ["prometheus", "external-push"]


def test_the_operators_scaler_address_reaches_the_trigger():
    meta = META._replace(keda_http_scaler="keda-http-scaler.autoscaling:9091")
    spec = scaling(**ZERO)
    (trigger,) = build_scaled_object(spec, meta, autoscaler_for(spec))["spec"]["triggers"]
    assert trigger["metadata"]["scalerAddress"] == "keda-http-scaler.autoscaling:9091"


def test_the_http_scaled_object_routes_the_services_names_and_holds_requests_while_it_wakes():
    from gemma_operator.builders.autoscaling import build_http_scaled_object

    spec = scaling(**ZERO)
    assert build_http_scaled_object(spec, META, autoscaler_for(spec)) == {
        "apiVersion": "http.keda.sh/v1alpha1", "kind": "HTTPScaledObject",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS,
                     "annotations": {"httpscaledobject.keda.sh/skip-scaledobject-creation": "true"}},
        "spec": {"hosts": ["gemma.serving", "gemma.serving.svc", "gemma.serving.svc.cluster.local"],
                 "scaleTargetRef": {**SCALE_TARGET, "service": "gemma", "port": 8000},
                 "replicas": {"min": 0, "max": 4}, "scaledownPeriod": 300,
                 "scalingMetric": {"concurrency": {"targetValue": 8}},
                 "timeouts": {"conditionWait": "900s", "responseHeader": "3600s"}}}


def behind_a_gateway(**prometheus) -> GemmaRustServerSpec:
    return tpu_spec(accelerator={"type": "cpu"}, gateway={"inferencePool": True, "endpointPicker": {"name": "epp"}},
                    autoscaling={"maxReplicas": 2, "target": 4,
                                 "prometheus": {"serverAddress": "http://p:9090", **prometheus}, **ZERO})


def test_behind_a_gateway_the_pickers_queue_wakes_it_too():
    spec = behind_a_gateway()
    triggers = build_scaled_object(spec, META, autoscaler_for(spec))["spec"]["triggers"]
    assert [t["type"] for t in triggers] == ["prometheus", "external-push", "prometheus"]
    assert triggers[2]["metadata"] == {
        "serverAddress": "http://p:9090", "threshold": "1",
        "query": 'sum(inference_extension_flow_control_queue_size{namespace="serving",inference_pool="gemma"})'}
    spec = behind_a_gateway(cluster="prod-us")
    with_cluster = build_scaled_object(spec, META, autoscaler_for(spec))["spec"]["triggers"]
    assert with_cluster[2]["metadata"]["query"] == (
        'sum(inference_extension_flow_control_queue_size{cluster="prod-us",namespace="serving",'
        'inference_pool="gemma"})')


def test_the_wake_query_has_the_server_querys_scope(promql_check):
    """Parsed by Prometheus's own parser: the picker's queue selects only this namespace's (and cluster's) series
    of this pool, the same namespace and cluster matchers as the server's own query (one helper makes both). The
    picker runs in the server's namespace, and its gauge has no namespace label of its own, so `namespace` is the
    picker pod's target label."""
    spec = behind_a_gateway(cluster="prod-us")
    (queue, server) = parse_promql(promql_check, [picker_queue_query(spec, META), metric_query(spec, META)])
    (selector,) = queue["selectors"]
    assert selector["metric"] == "inference_extension_flow_control_queue_size"

    def scope(matchers):
        return sorted((m["name"], m["type"], m["value"]) for m in matchers if m["name"] in ("cluster", "namespace"))

    assert scope(selector["matchers"]) == scope(server["selectors"][0]["matchers"]) == [
        ("cluster", "=", "prod-us"), ("namespace", "=", "serving")]
    series = {
        "this pool's picker": {"cluster": "prod-us", "namespace": "serving", "inference_pool": "gemma"},
        "a same-named pool of another tenant": {"cluster": "prod-us", "namespace": "tenant-b",
                                                "inference_pool": "gemma"},
        "a same-named pool of another cluster": {"cluster": "staging-us", "namespace": "serving",
                                                 "inference_pool": "gemma"},
        "another pool here": {"cluster": "prod-us", "namespace": "serving", "inference_pool": "other"},
    }
    assert {w for w, labels in series.items() if selects(selector["matchers"], labels)} == {"this pool's picker"}


@pytest.mark.parametrize("autoscaling,message", [
    ({"minReplicas": 0, "maxReplicas": 4, "target": 1, "provider": "HPA"}, "minReplicas 0 needs KEDA"),
])
def test_scale_to_zero_rules_are_cel_in_the_crd(autoscaling, message):
    test_autoscaling_rules_are_cel_in_the_crd(autoscaling, message)


def test_a_gateway_server_at_zero_needs_prometheus_for_the_pickers_queue():
    from gemma_operator import crd

    rules = crd.spec_schema()["x-kubernetes-validations"]
    assert any("woken by the endpoint picker's queue" in r["message"] for r in rules)


def test_two_servers_of_one_name_in_two_namespaces_claim_no_common_host():
    """The interceptor's routing table spans the cluster: a host both claimed would send one's requests to the
    other."""
    from gemma_operator.builders.autoscaling import service_hosts

    assert not set(service_hosts(META)) & set(service_hosts(META._replace(namespace="other")))


def test_no_two_servers_with_names_the_crd_admits_claim_a_common_host():
    """With dots, `a.b` in namespace `svc` claims `a.b.svc`, the host of `a` in `b`, and `a.b.svc.cluster` in
    namespace `local` claims `a.b.svc.cluster.local`: the CRD's name rule (spec.NAME_RULES) refuses those names.
    Among the names it admits and the namespaces Kubernetes admits (DNS-1123 labels), none collides."""
    import itertools
    import re

    from gemma_operator.builders.autoscaling import service_hosts
    from gemma_operator.spec import DNS_1035_LABEL_RE, DNS_LABEL_RE

    dotted = {(n, ns): set(service_hosts(META._replace(name=n, namespace=ns)))
              for n, ns in (("a", "b"), ("a.b", "svc"), ("a.b.svc.cluster", "local"))}
    assert dotted[("a", "b")] & dotted[("a.b", "svc")] == {"a.b.svc"}
    assert dotted[("a", "b")] & dotted[("a.b.svc.cluster", "local")] == {"a.b.svc.cluster.local"}
    assert not re.search(DNS_1035_LABEL_RE, "a.b") and not re.search(DNS_1035_LABEL_RE, "a.b.svc.cluster")

    words = ("a", "b", "svc", "local", "cluster", "a-b", "svc-cluster")
    servers = [(n, ns) for n, ns in itertools.product(words, repeat=2)
               if re.search(DNS_1035_LABEL_RE, n) and re.search(DNS_LABEL_RE, ns)]
    owners: dict[str, tuple[str, str]] = {}
    for server in servers:
        for host in service_hosts(META._replace(name=server[0], namespace=server[1])):
            assert owners.setdefault(host, server) == server, (host, owners[host], server)
    assert len(owners) == 3 * len(servers) == 3 * 49
