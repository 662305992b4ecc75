"""The optional kinds against the real API server: KEDA's ScaledObject and the inference extension's
InferencePool under their projects' own CRDs (tests/cluster/crds.py, fetched from their Go modules), and
the autoscaling/v2 HPA acted on by kube-controller-manager's own HPA controller.

Each test states whether it needs a CRD installed or absent (`installed`/`absent`), so the order in which
the tests run does not matter."""

from __future__ import annotations

import pytest

from gemma_operator.builders.autoscaler import chosen_where_all_served
from gemma_operator.builders.autoscaling import build_hpa, build_scaled_object
from gemma_operator.builders.gke_gateway import build_backend_policy, build_health_check_policy
from gemma_operator.builders.inference_pool import build_inference_pool
from gemma_operator.builders.optional import OPTIONAL_KINDS
from gemma_operator.builders.ownership import Meta
from gemma_operator.spec import parse_spec
from gemma_operator.builders.autoscaling import build_http_scaled_object
from tests.cluster.crds import (FAKE_GKE_BACKEND_POLICIES, FAKE_GKE_HEALTH_CHECK_POLICIES, HTTP_SCALED_OBJECTS,
                                INFERENCE_POOLS, SCALED_OBJECTS, absent, crd_names, installed)

from .harness import GRS_PATH, PROMETHEUS, condition, create, dump, get, wait_for

pytestmark = pytest.mark.cluster

BASE = {"model": {"source": "hf://google/gemma-4-e2b-it"}, "accelerator": {"type": "cpu"}}
PICKER = {"name": "gemma-epp"}
POOL_ONLY = {"inferencePool": True, "endpointPicker": PICKER, "provider": "None"}  # no GKE policies
GKE_POLICIES = (("networking.gke.io/v1", "HealthCheckPolicy"), ("networking.gke.io/v1", "GCPBackendPolicy"))




def as_built(builder, spec, name, ns):
    """`builder`'s object for the spec `spec` of server `name`, as on a cluster that serves every optional kind."""
    parsed = parse_spec(spec)
    return builder(parsed, Meta(name, ns), chosen_where_all_served(parsed))


def get_child(kube, api_version, kind, ns, name):
    return kube.get_if_present(api_version, kind, ns, name)


def patch_spec(kube, ns, name, spec):
    kube.request("PATCH", f"{GRS_PATH.format(ns=ns)}/{name}", {"spec": spec},
                 content_type="application/merge-patch+json")


def cond_is(kube, ns, name, type_, status, reason=None):
    def check():
        obj = get(kube, ns, name)
        c = condition(obj, type_)
        return obj if c.get("status") == status and (reason is None or c.get("reason") == reason) else None
    return check


def wait_cond(kube, ns, name, type_, status, operator, reason=None, timeout=60):
    return wait_for(cond_is(kube, ns, name, type_, status, reason), timeout=timeout,
                    what=f"{name} condition {type_}={status} {reason or ''}",
                    diagnose=lambda: dump(get(kube, ns, name).get("status")) + "\n" + operator.tail(30))


def gone(kube, api_version, kind, ns, name):
    return lambda: get_child(kube, api_version, kind, ns, name) is None


def test_the_table_agrees_with_the_upstream_crds():
    for crd in (SCALED_OBJECTS, HTTP_SCALED_OBJECTS, INFERENCE_POOLS, FAKE_GKE_HEALTH_CHECK_POLICIES,
                FAKE_GKE_BACKEND_POLICIES):
        row = next(r for r in OPTIONAL_KINDS if r.crd == crd.name)
        names = crd_names(crd)
        assert (names["kind"], names["plural"], row.api_version) == (row.kind, row.plural, crd.group_version)


def test_hpa_on_the_scale_subresource_is_accepted_and_says_when_no_adapter_serves_the_metric(
        cluster, kube, ns, operator):
    spec = {**BASE, "autoscaling": {"provider": "HPA", "minReplicas": 2, "maxReplicas": 3, "target": 4}}
    create(kube, ns, "hpa", spec)
    hpa = wait_for(lambda: get_child(kube, "autoscaling/v2", "HorizontalPodAutoscaler", ns, "hpa"),
                   what="the HPA", diagnose=operator.tail)
    # Accepted by the real API server, as built.
    assert hpa["spec"] == as_built(build_hpa, spec, "hpa", ns)["spec"]
    # Before the HPA acts, the Deployment already runs minReplicas (spec.replicas is 1).
    assert kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/hpa")["spec"]["replicas"] == 2
    # kube-controller-manager's HPA controller reads the GemmaRustServer's scale subresource (two pods) and
    # asks custom.metrics.k8s.io for the Pods metric, which nothing serves here; the operator says so.
    obj = wait_cond(kube, ns, "hpa", "ScalingActive", "False", operator, reason="FailedGetPodsMetric", timeout=120)
    message = condition(obj, "ScalingActive")["message"]
    assert message.startswith("HorizontalPodAutoscaler hpa drives the replicas (2..3 replicas, "
                              "gemma_num_requests_waiting 4 per pod), but no custom-metrics adapter serves "
                              "the Pods metric gemma_num_requests_waiting"), message
    wait_for(lambda: (lambda st: st.get("phase") == "Ready" and st.get("readyText") == "2/2")(
        get(kube, ns, "hpa").get("status") or {}), what="two ready replicas", diagnose=operator.tail)
    # Removing spec.autoscaling removes the HPA.
    kube.request("PATCH", f"{GRS_PATH.format(ns=ns)}/hpa", [{"op": "remove", "path": "/spec/autoscaling"}],
                 content_type="application/json-patch+json")
    wait_for(gone(kube, "autoscaling/v2", "HorizontalPodAutoscaler", ns, "hpa"), what="the HPA to be deleted",
             diagnose=operator.tail)
    wait_for(lambda: not condition(get(kube, ns, "hpa"), "ScalingActive"), what="ScalingActive to go")


def test_a_server_at_zero_gets_objects_the_keda_crds_accept_and_without_the_http_add_on_keeps_a_replica(
        cluster, kube, ns, operator):
    installed(cluster, SCALED_OBJECTS)
    absent(cluster, HTTP_SCALED_OBJECTS)
    spec = {**BASE, "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "target": 4, "idleSeconds": 120}}
    create(kube, ns, "zero", spec)
    obj = wait_cond(kube, ns, "zero", "Warning", "True", operator, reason="ScaleToZeroUnavailable")
    assert "CRD httpscaledobjects.http.keda.sh is not installed (install the KEDA HTTP add-on)" in \
        condition(obj, "Warning")["message"]
    # Held at one replica by an HPA (no Prometheus for KEDA), not by a ScaledObject that would go to zero: one made
    # while the operator's discovery still listed the add-on's CRD (it caches for a few seconds) is deleted.
    wait_for(lambda: get_child(kube, "autoscaling/v2", "HorizontalPodAutoscaler", ns, "zero"), what="the HPA",
             diagnose=operator.tail)
    wait_for(gone(kube, "keda.sh/v1alpha1", "ScaledObject", ns, "zero"), what="no ScaledObject",
             diagnose=operator.tail)
    assert kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/zero")["spec"]["replicas"] == 1
    # With the add-on's CRD: the HTTPScaledObject as built, the ScaledObject at zero, the HPA gone.
    installed(cluster, HTTP_SCALED_OBJECTS)
    httpso = wait_for(lambda: get_child(kube, "http.keda.sh/v1alpha1", "HTTPScaledObject", ns, "zero"),
                      timeout=60, what="the HTTPScaledObject", diagnose=operator.tail)
    assert httpso["spec"] == as_built(build_http_scaled_object, spec, "zero", ns)["spec"]
    so = wait_for(lambda: get_child(kube, "keda.sh/v1alpha1", "ScaledObject", ns, "zero"), what="the ScaledObject",
                  diagnose=operator.tail)
    assert so["spec"] == as_built(build_scaled_object, spec, "zero", ns)["spec"]
    wait_for(gone(kube, "autoscaling/v2", "HorizontalPodAutoscaler", ns, "zero"), what="the HPA to be deleted",
             diagnose=operator.tail)
    wait_for(lambda: not condition(get(kube, ns, "zero"), "Warning"), what="the Warning condition to go",
             diagnose=operator.tail)


def test_scaled_object_is_accepted_by_kedas_crd_updated_with_the_spec_and_deleted_with_the_server(
        cluster, kube, ns, operator):
    installed(cluster, SCALED_OBJECTS)
    spec = {**BASE, "autoscaling": {"maxReplicas": 4, "target": 4, "prometheus": {"serverAddress": PROMETHEUS}}}
    create(kube, ns, "keda", spec)
    so = wait_for(lambda: get_child(kube, "keda.sh/v1alpha1", "ScaledObject", ns, "keda"),
                  what="the ScaledObject", diagnose=operator.tail)
    assert so["spec"] == as_built(build_scaled_object, spec, "keda", ns)["spec"]
    # An HPA made while discovery had not yet seen KEDA's CRD goes once the ScaledObject is made.
    wait_for(gone(kube, "autoscaling/v2", "HorizontalPodAutoscaler", ns, "keda"), what="no HPA of our own beside KEDA",
             diagnose=operator.tail)
    # No KEDA operator runs here, so no keda-hpa-keda reports: the condition says which object drives, and waits.
    obj = wait_cond(kube, ns, "keda", "ScalingActive", "Unknown", operator, reason="WaitingForAutoscaler")
    assert condition(obj, "ScalingActive")["message"].startswith("ScaledObject keda drives the replicas")
    patch_spec(kube, ns, "keda", {"autoscaling": {"metric": "kvCacheUsage", "target": 0.8}})
    so = wait_for(lambda: (lambda o: o if o and o["spec"]["triggers"][0]["metadata"]["threshold"] == "0.8" else None)(
        get_child(kube, "keda.sh/v1alpha1", "ScaledObject", ns, "keda")), what="the ScaledObject updated",
        diagnose=operator.tail)
    assert so["spec"]["triggers"][0]["metadata"]["query"].startswith("sum(gemma_kv_cache_usage_perc{")
    cluster.kubectl("delete", "grs", "keda", "-n", ns, "--wait=true", "--timeout=60s")
    wait_for(gone(kube, "keda.sh/v1alpha1", "ScaledObject", ns, "keda"), timeout=60,
             what="the garbage collector to delete the ScaledObject")


def test_an_autoscalers_long_message_reaches_the_status_redacted_and_cut(cluster, kube, ns, operator):
    # What KEDA's metrics server got back (here a Prometheus error page with a credential in a URL) reaches the
    # HPA's ScalingActive message, and from there the GemmaRustServer's status, readable by more people.
    installed(cluster, SCALED_OBJECTS)
    create(kube, ns, "loud", {**BASE, "autoscaling": {"maxReplicas": 2, "target": 4, "provider": "KEDA",
                                                      "prometheus": {"serverAddress": PROMETHEUS}}})
    wait_for(lambda: get_child(kube, "keda.sh/v1alpha1", "ScaledObject", ns, "loud"), what="the ScaledObject",
             diagnose=operator.tail)
    # The HPA KEDA would make; its scale target does not exist, so the HPA controller reports only that.
    hpas = f"/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers"
    kube.request("POST", hpas, {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "keda-hpa-loud"},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "absent"},
                 "minReplicas": 1, "maxReplicas": 2, "metrics": [{"type": "External", "external": {
                     "metric": {"name": "s0-prometheus"}, "target": {"type": "AverageValue", "averageValue": "4"}}}]}})
    body = ('unable to get external metric: Get "http://keda:hunter2secret@prometheus/api/v1/query": 502 '
            + "<html><body>" + "bad gateway " * 400 + "</body></html>")
    reported = {"type": "ScalingActive", "status": "False", "reason": "FailedGetExternalMetric", "message": body,
                "lastTransitionTime": "2026-01-01T00:00:00Z"}

    def shown():
        hpa = get_child(kube, "autoscaling/v2", "HorizontalPodAutoscaler", ns, "keda-hpa-loud")
        if reported["message"] not in [c.get("message") for c in (hpa.get("status") or {}).get("conditions") or []]:
            # (Again after the HPA controller wrote its own status over it.)
            kube.request("PATCH", f"{hpas}/keda-hpa-loud/status", {"status": {
                "currentReplicas": 0, "desiredReplicas": 0, "conditions": [reported]}},
                content_type="application/merge-patch+json")
        c = condition(get(kube, ns, "loud"), "ScalingActive")
        return c if c.get("reason") == "FailedGetExternalMetric" else None

    message = wait_for(shown, what="the HPA's message in ScalingActive", diagnose=operator.tail)["message"]
    copied = message.split("HorizontalPodAutoscaler keda-hpa-loud: ", 1)[1]
    assert 200 < len(copied) <= 256 and copied.endswith("…"), copied
    assert copied.startswith("unable to get external metric: Get") and "hunter2secret" not in message, message


def test_keda_asked_for_without_its_crd_is_a_condition_naming_it_and_the_pod_still_runs(cluster, kube, ns, operator):
    absent(cluster, SCALED_OBJECTS)
    create(kube, ns, "nokeda", {**BASE, "autoscaling": {"provider": "KEDA", "maxReplicas": 2, "target": 4,
                                                        "prometheus": {"serverAddress": PROMETHEUS}}})
    obj = wait_cond(kube, ns, "nokeda", "ScalingActive", "False", operator, reason="CRDMissing")
    assert "CRD scaledobjects.keda.sh is not installed (install KEDA)" in condition(obj, "ScalingActive")["message"]
    wait_for(lambda: get(kube, ns, "nokeda").get("status", {}).get("phase") == "Ready",
             what="the pod to run anyway", diagnose=operator.tail)
    assert get_child(kube, "autoscaling/v2", "HorizontalPodAutoscaler", ns, "nokeda") is None


def test_inference_pool_is_accepted_by_its_crd_follows_the_port_and_goes_with_the_server(cluster, kube, ns, operator):
    installed(cluster, INFERENCE_POOLS)
    spec = {**BASE, "gateway": POOL_ONLY}
    create(kube, ns, "pool", spec)
    pool = wait_for(lambda: get_child(kube, "inference.networking.k8s.io/v1", "InferencePool", ns, "pool"),
                    what="the InferencePool", diagnose=operator.tail)
    # The v1.5.0 CRD defaults appProtocol to http (which the server speaks); the operator leaves it out, so
    # the pool also applies under the v1.2.0 CRD, which has no such field.
    assert pool["spec"] == {**build_inference_pool(parse_spec(spec), Meta("pool", ns))["spec"], "appProtocol": "http"}
    wait_cond(kube, ns, "pool", "Gateway", "True", operator, reason="Configured")
    patch_spec(kube, ns, "pool", {"server": {"port": 9000}})
    wait_for(lambda: get_child(kube, "inference.networking.k8s.io/v1", "InferencePool", ns, "pool")
             ["spec"]["targetPorts"] == [{"number": 9000}], what="the pool on port 9000", diagnose=operator.tail)
    patch_spec(kube, ns, "pool", {"gateway": {"inferencePool": False}})
    wait_for(gone(kube, "inference.networking.k8s.io/v1", "InferencePool", ns, "pool"),
             what="the pool to be deleted when switched off", diagnose=operator.tail)
    wait_for(gone(kube, "v1", "ConfigMap", ns, "pool-epp"), what="the picker's config to go with the pool",
             diagnose=operator.tail)
    patch_spec(kube, ns, "pool", {"gateway": {"inferencePool": True}})
    wait_for(lambda: get_child(kube, "inference.networking.k8s.io/v1", "InferencePool", ns, "pool"),
             what="the pool back", diagnose=operator.tail)
    cluster.kubectl("delete", "grs", "pool", "-n", ns, "--wait=true", "--timeout=60s")
    wait_for(gone(kube, "inference.networking.k8s.io/v1", "InferencePool", ns, "pool"), timeout=60,
             what="the garbage collector to delete the InferencePool")


def test_a_second_pool_over_the_servers_pods_turns_the_gateway_condition_false_until_it_is_gone(
        cluster, kube, ns, operator):
    """The upstream inferencepool chart's pool, as `helm install --set inferencePool.modelServers.matchLabels...`
    renders one beside the server's own."""
    installed(cluster, INFERENCE_POOLS)
    create(kube, ns, "twice", {**BASE, "gateway": POOL_ONLY})
    wait_cond(kube, ns, "twice", "Gateway", "True", operator, reason="Configured")
    upstream = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                "metadata": {"name": "upstream", "namespace": ns},
                "spec": {"selector": {"matchLabels": {"app.kubernetes.io/instance": "twice"}},
                         "targetPorts": [{"number": 8000}],
                         "endpointPickerRef": {"name": "upstream-epp", "port": {"number": 9002}}}}
    kube.request("POST", f"/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools", upstream)
    obj = wait_cond(kube, ns, "twice", "Gateway", "False", operator, reason="ForeignInferencePool")
    assert condition(obj, "Gateway")["message"].startswith("InferencePool upstream (not this server's)")
    kube.delete_if_present("inference.networking.k8s.io/v1", "InferencePool", ns, "upstream")
    wait_cond(kube, ns, "twice", "Gateway", "True", operator, reason="Configured")


def test_inference_pool_without_its_crd_is_a_gateway_condition_naming_it_and_the_pod_still_runs(
        cluster, kube, ns, operator):
    absent(cluster, INFERENCE_POOLS)
    create(kube, ns, "nopool", {**BASE, "gateway": POOL_ONLY})
    obj = wait_cond(kube, ns, "nopool", "Gateway", "False", operator, reason="CRDMissing")
    assert condition(obj, "Gateway")["message"] == (
        "InferencePool skipped: inference.networking.k8s.io/v1 is not served by this cluster: CRD "
        "inferencepools.inference.networking.k8s.io is not installed (install the Gateway API inference extension)")
    wait_for(lambda: get(kube, ns, "nopool").get("status", {}).get("phase") == "Ready", what="the pod to run anyway",
             diagnose=operator.tail)


def test_gke_policies_are_accepted_beside_the_pool_follow_the_spec_and_go_when_switched_off(
        cluster, kube, ns, operator):
    for crd in (INFERENCE_POOLS, FAKE_GKE_HEALTH_CHECK_POLICIES, FAKE_GKE_BACKEND_POLICIES):
        installed(cluster, crd)
    spec = {**BASE, "server": {"port": 9000},
            "gateway": {"inferencePool": True, "endpointPicker": PICKER, "backendTimeoutSeconds": 900}}
    create(kube, ns, "gke", spec)
    parsed, meta = parse_spec(spec), Meta("gke", ns)
    for (api_version, kind), build in zip(GKE_POLICIES, (build_health_check_policy, build_backend_policy)):
        obj = wait_for(lambda: get_child(kube, api_version, kind, ns, "gke"), what=kind, diagnose=operator.tail)
        assert obj["spec"] == build(parsed, meta)["spec"]
    wait_cond(kube, ns, "gke", "Gateway", "True", operator, reason="Configured")
    patch_spec(kube, ns, "gke", {"gateway": {"backendTimeoutSeconds": 7200}})
    wait_for(lambda: get_child(kube, *GKE_POLICIES[1], ns, "gke")["spec"]["default"]["timeoutSec"] == 7200,
             what="the backend timeout to follow the spec", diagnose=operator.tail)
    patch_spec(kube, ns, "gke", {"gateway": {"provider": "None"}})
    for api_version, kind in GKE_POLICIES:
        wait_for(gone(kube, api_version, kind, ns, "gke"), what=f"the {kind} to go with provider None",
                 diagnose=operator.tail)
    assert get_child(kube, "inference.networking.k8s.io/v1", "InferencePool", ns, "gke") is not None


def test_gke_policies_without_their_crds_are_a_gateway_condition_naming_them_and_the_pool_is_made(
        cluster, kube, ns, operator):
    installed(cluster, INFERENCE_POOLS)
    for crd in (FAKE_GKE_HEALTH_CHECK_POLICIES, FAKE_GKE_BACKEND_POLICIES):
        absent(cluster, crd)
    create(kube, ns, "nogke", {**BASE, "gateway": {"inferencePool": True, "endpointPicker": PICKER}})
    obj = wait_cond(kube, ns, "nogke", "Gateway", "False", operator, reason="CRDMissing")
    message = condition(obj, "Gateway")["message"]
    for crd in ("healthcheckpolicies.networking.gke.io", "gcpbackendpolicies.networking.gke.io"):
        assert f"CRD {crd} is not installed (install GKE's Gateway controller" in message, message
    assert get_child(kube, "inference.networking.k8s.io/v1", "InferencePool", ns, "nogke") is not None


@pytest.mark.parametrize("spec,message", [
    ({"gateway": {"inferencePool": True}}, "spec.gateway.inferencePool names an endpoint picker"),
    ({"autoscaling": {"minReplicas": 3, "maxReplicas": 2, "target": 1}}, "minReplicas must not exceed"),
    ({"autoscaling": {"maxReplicas": 2, "target": 2, "metric": "kvCacheUsage"}}, "a fraction of the KV cache"),
    ({"autoscaling": {"maxReplicas": 2, "target": 2, "provider": "KEDA"}},
     "set spec.autoscaling.prometheus.serverAddress"),
    ({"autoscaling": {"minReplicas": 0, "maxReplicas": 2, "target": 2, "provider": "HPA"}},
     "spec.autoscaling.minReplicas 0 needs KEDA"),
    ({"autoscaling": {"minReplicas": 0, "maxReplicas": 2, "target": 2},
      "gateway": {"inferencePool": True, "endpointPicker": {"name": "epp"}}}, "woken by the endpoint picker's queue"),
])
def test_admission_refuses_an_autoscaling_or_gateway_spec_that_cannot_work(cluster, ns, spec, message):
    import json
    import subprocess

    body = {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer", "metadata": {"name": "bad"},
            "spec": {**BASE, **spec}}
    with pytest.raises(subprocess.CalledProcessError) as err:
        cluster.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(body))
    assert message in err.value.stderr
