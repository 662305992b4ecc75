"""What a GemmaRustServer owns, given what the cluster serves
(gemma_operator/builders/children.py): golden dicts, no cluster involved."""

from __future__ import annotations

from gemma_operator.builders.children import build_children

from .specs import EVERYTHING, META, scaling, tpu_spec


def test_children_skip_monitoring_kinds_the_cluster_does_not_serve():
    spec = tpu_spec(monitoring={"serviceMonitor": True}, replicas=1)
    kids = build_children(spec, META, frozenset({"monitoring.coreos.com/v1"}))
    assert [o["kind"] for o in kids.apply] == ["Deployment", "Service", "ServiceMonitor"]
    assert kids.absent == [("policy/v1", "PodDisruptionBudget", "gemma"), ("v1", "ConfigMap", "gemma-epp")]
    assert kids.skipped == [("PodMonitoring", "monitoring.googleapis.com/v1 is not served by this cluster: CRD "
                                              "podmonitorings.monitoring.googleapis.com is not installed (install "
                                              "GKE managed Prometheus)")]
    assert kids.optional == {"Monitoring": ["PodMonitoring", "ServiceMonitor"]}


def test_children_mark_switched_off_monitoring_for_deletion():
    spec = tpu_spec(monitoring={"podMonitoring": False}, replicas=2)
    kids = build_children(spec, META, frozenset({"monitoring.googleapis.com/v1", "monitoring.coreos.com/v1"}))
    assert [o["kind"] for o in kids.apply] == ["Deployment", "Service", "PodDisruptionBudget"]
    assert kids.absent == [("v1", "ConfigMap", "gemma-epp"),
                           ("monitoring.googleapis.com/v1", "PodMonitoring", "gemma"),
                           ("monitoring.coreos.com/v1", "ServiceMonitor", "gemma")]
    assert kids.skipped == []


def kinds(children):
    return [o["kind"] for o in children.apply]


def test_keda_is_chosen_when_served_and_given_an_address_and_our_hpa_is_pruned():
    spec = scaling(prometheus={"serverAddress": "http://p:9090"})
    kids = build_children(spec, META, EVERYTHING)
    assert kinds(kids)[-1] == "ScaledObject"
    # Replaced, not merely absent: deleted on every sync, since an HPA left from before KEDA's CRD appeared
    # would drive the replicas beside KEDA's own.
    assert kids.replaced == [("autoscaling/v2", "HorizontalPodAutoscaler", "gemma")]
    assert ("autoscaling/v2", "HorizontalPodAutoscaler", "gemma") not in kids.absent
    assert kids.optional == {"ScalingActive": ["ScaledObject"]} and kids.skipped == []


def test_without_kedas_crd_auto_falls_back_to_an_hpa_and_skips_nothing():
    spec = scaling(prometheus={"serverAddress": "http://p:9090"})
    kids = build_children(spec, META, frozenset({"autoscaling/v2"}))
    assert kinds(kids)[-1] == "HorizontalPodAutoscaler"
    assert kids.optional == {"ScalingActive": ["HorizontalPodAutoscaler"]} and kids.skipped == []


def test_auto_without_a_prometheus_address_uses_an_hpa_even_with_keda():
    kids = build_children(scaling(), META, EVERYTHING)
    assert kinds(kids)[-1] == "HorizontalPodAutoscaler"
    # Replaced, not merely absent: a ScaledObject left from an earlier state (e.g. scaling to zero before the HTTP
    # add-on's CRD went away) would drive the replicas beside the HPA.
    assert kids.replaced == [("keda.sh/v1alpha1", "ScaledObject", "gemma")]
    assert ("keda.sh/v1alpha1", "ScaledObject", "gemma") not in kids.absent


def test_provider_keda_without_its_crd_is_skipped_naming_the_crd():
    spec = scaling(provider="KEDA", prometheus={"serverAddress": "http://p:9090"})
    kids = build_children(spec, META, frozenset({"autoscaling/v2"}))
    assert "HorizontalPodAutoscaler" not in kinds(kids) and "ScaledObject" not in kinds(kids)
    assert kids.skipped == [("ScaledObject", "keda.sh/v1alpha1 is not served by this cluster: CRD "
                                             "scaledobjects.keda.sh is not installed (install KEDA)")]
    assert ("autoscaling/v2", "HorizontalPodAutoscaler", "gemma") in kids.absent


def test_removing_autoscaling_and_the_pool_prunes_their_objects():
    kids = build_children(tpu_spec(monitoring={"podMonitoring": False}), META, EVERYTHING)
    assert {("keda.sh/v1alpha1", "ScaledObject", "gemma"), ("autoscaling/v2", "HorizontalPodAutoscaler", "gemma"),
            ("inference.networking.k8s.io/v1", "InferencePool", "gemma"), ("v1", "ConfigMap", "gemma-epp"),
            ("networking.gke.io/v1", "HealthCheckPolicy", "gemma"),
            ("networking.gke.io/v1", "GCPBackendPolicy", "gemma")} <= set(kids.absent)
    assert kids.optional == {}


def test_inference_pool_without_its_crd_is_skipped_naming_the_crd():
    spec = tpu_spec(gateway={"inferencePool": True, "endpointPicker": {"name": "epp"}})
    kids = build_children(spec, META, frozenset())
    assert ("InferencePool", "inference.networking.k8s.io/v1 is not served by this cluster: CRD "
            "inferencepools.inference.networking.k8s.io is not installed (install the Gateway API inference "
            "extension)") in kids.skipped


def test_the_pool_comes_with_the_pickers_config_and_gkes_policies_on_gke():
    spec = tpu_spec(gateway={"inferencePool": True, "endpointPicker": {"name": "epp"}})
    kids = build_children(spec, META, EVERYTHING)
    assert [(o["kind"], o["metadata"]["name"]) for o in kids.apply if o["kind"] not in ("Deployment", "Service")] == [
        ("ConfigMap", "gemma-epp"), ("PodMonitoring", "gemma"), ("InferencePool", "gemma"),
        ("HealthCheckPolicy", "gemma"), ("GCPBackendPolicy", "gemma")]
    assert kids.optional["Gateway"] == ["InferencePool", "HealthCheckPolicy", "GCPBackendPolicy"]


def test_a_picker_release_without_a_config_leaves_the_pickers_configmap_alone_and_the_pool_still_made():
    spec = tpu_spec(gateway={"inferencePool": True, "endpointPicker": {"name": "epp", "release": "llm-d-router/v0.9.0"}})
    kids = build_children(spec, META, EVERYTHING)
    assert "ConfigMap" not in kinds(kids) and "InferencePool" in kinds(kids)
    assert ("v1", "ConfigMap", "gemma-epp") not in kids.absent  # not deleted either: handlers report the release


def test_gkes_policies_without_their_crds_are_skipped_naming_them_and_the_pool_still_made():
    spec = tpu_spec(gateway={"inferencePool": True, "endpointPicker": {"name": "epp"}})
    kids = build_children(spec, META, frozenset({"inference.networking.k8s.io/v1"}))
    assert "InferencePool" in kinds(kids)
    assert [kind for kind, _ in kids.skipped] == ["PodMonitoring", "HealthCheckPolicy", "GCPBackendPolicy"]
    assert dict(kids.skipped)["GCPBackendPolicy"] == (
        "networking.gke.io/v1 is not served by this cluster: CRD gcpbackendpolicies.networking.gke.io is not "
        "installed (install GKE's Gateway controller: gcloud container clusters update --gateway-api=standard)")


def test_provider_none_makes_no_gke_policy_and_prunes_them():
    spec = tpu_spec(gateway={"inferencePool": True, "endpointPicker": {"name": "epp"}, "provider": "None"})
    kids = build_children(spec, META, EVERYTHING)
    assert "HealthCheckPolicy" not in kinds(kids) and "GCPBackendPolicy" not in kinds(kids)
    assert {("networking.gke.io/v1", "HealthCheckPolicy", "gemma"),
            ("networking.gke.io/v1", "GCPBackendPolicy", "gemma")} <= set(kids.absent)


def test_a_server_at_zero_gets_keda_and_the_http_add_on_and_never_an_hpa():
    kids = build_children(scaling(minReplicas=0), META, EVERYTHING)
    assert kinds(kids)[-2:] == ["ScaledObject", "HTTPScaledObject"]
    assert kids.optional == {"ScalingActive": ["ScaledObject", "HTTPScaledObject"]} and kids.skipped == []
    assert kids.replaced == [("autoscaling/v2", "HorizontalPodAutoscaler", "gemma")]


def test_without_the_http_add_on_a_server_at_zero_is_held_at_one_replica():
    """Nothing would hold or count the requests sent at zero: the autoscaler chosen is that of any server of
    minReplicas 1 (builders.autoscaler.choose), and the spec is built as it is."""
    keda = scaling(minReplicas=0, prometheus={"serverAddress": "http://p:9090"})
    kids = build_children(keda, META, EVERYTHING - {"http.keda.sh/v1alpha1"})
    (scaled,) = [o for o in kids.apply if o["kind"] == "ScaledObject"]
    assert scaled["spec"]["minReplicaCount"] == 1 and "cooldownPeriod" not in scaled["spec"]
    assert [t["type"] for t in scaled["spec"]["triggers"]] == ["prometheus"]
    assert "HTTPScaledObject" not in kinds(kids)
    # Without Prometheus for KEDA: an HPA on the Pods metric, as for any server that does not scale to zero.
    plain = scaling(minReplicas=0, provider="KEDA")
    assert kinds(build_children(plain, META, EVERYTHING - {"http.keda.sh/v1alpha1"}))[-1] == "HorizontalPodAutoscaler"
