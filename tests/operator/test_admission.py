"""Pod-level powers (operator/gemma_operator/admission.py): the generated admission policy is current and
covers every power the builders turn into a pod field, and the operator's own allowlists. The policy itself
is exercised on a real API server in test_admission_cluster.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from gemma_operator import admission
from gemma_operator.builders import deployment
from gemma_operator.builders.autoscaler import chosen_where_all_served
from gemma_operator.builders.autoscaling import build_scaled_object
from gemma_operator.builders.ownership import Meta
from gemma_operator.settings import Settings, allowed, allowed_address, describe
from gemma_operator.spec import DEFAULT_IMAGE, parse_spec

POLICY_FILE = Path(__file__).resolve().parents[2] / "crds" / "gemmarustservers.gemmarust.dev.admission.yaml"


def test_checked_in_policy_is_regenerated():
    assert POLICY_FILE.read_text() == admission.render(), (
        "crds/ is stale: run `python -m gemma_operator.admission > crds/gemmarustservers.gemmarust.dev.admission.yaml`")


def test_every_power_has_a_validation_and_a_variable_for_its_old_value():
    policy = admission.build_policy()
    names = {v["name"] for v in policy["spec"]["variables"]}
    assert len(policy["spec"]["validations"]) == len(admission.POWERS)
    for power in admission.POWERS:
        assert {power.name, "old" + power.name[0].upper() + power.name[1:]} <= names
    assert policy["spec"]["matchConstraints"]["resourceRules"][0]["operations"] == ["CREATE", "UPDATE"]
    assert admission.build_binding()["spec"] == {"policyName": policy["metadata"]["name"],
                                                 "validationActions": ["Deny"]}


MTP = {"method": "mtp", "numSpeculativeTokens": 2}
DRAFTER_HF = {"engine": {"speculative": {**MTP, "source": "hf://google/gemma-4-E2B-it-assistant"}}}
# Per power (by name): a spec fragment without it and one with it, differing only in that power.
ONE_POWER = {
    "image": ({}, {"image": "example.com/mine:1"}),
    "serviceAccountName": ({}, {"serviceAccountName": "admin"}),
    "tokenSecret": ({}, {"model": {"source": "hf://o/m", "tokenSecret": {"name": "hf"}}}),
    "apiKeySecret": ({}, {"server": {"apiKeySecret": {"name": "key"}}}),
    "sourceClaim": ({}, {"model": {"source": "pvc://weights/gemma"}}),
    "embeddingTwinClaim": ({}, {"model": {"source": "hf://o/m", "embeddingTwin": "pvc://emb/x"}}),
    "drafterClaim": (DRAFTER_HF, {"engine": {"speculative": {**MTP, "source": "pvc://drafts/x"}}}),
    "sourceBucket": ({}, {"model": {"source": "gs://weights/gemma"}}),
    "embeddingTwinBucket": ({}, {"model": {"source": "hf://o/m", "embeddingTwin": "gs://emb/x"}}),
    "drafterBucket": (DRAFTER_HF, {"engine": {"speculative": {**MTP, "source": "gs://drafts/x"}}}),
    # With a ServiceAccount, another source is read with its rights.
    "credentialedSource": ({"serviceAccountName": "admin"},
                           {"serviceAccountName": "admin", "model": {"source": "hf://o/other"}}),
    "provisioning": ({}, {"accelerator": {"provisioning": "spot"}}),
    "computeClass": ({}, {"accelerator": {"computeClass": "tpu-first"}}),
    "tolerations": ({}, {"tolerations": [{"operator": "Exists"}]}),
    "nodeSelector": ({}, {"nodeSelector": {"a": "b"}}),
    "podAnnotations": ({}, {"podAnnotations": {"x": "y"}}),
    "mediaFetchHosts": ({}, {"server": {"media": {"fetchHosts": ["images.example.com"]}}}),
}
# Powers that reach another object than the pod: the KEDA ScaledObject's trigger.
KEDA = {"maxReplicas": 2, "target": 1, "prometheus": {"serverAddress": "http://p:9090"}}
def scaled_object(spec, meta):
    """KEDA's ScaledObject for `spec`, as on a cluster that serves every optional kind."""
    return build_scaled_object(spec, meta, chosen_where_all_served(spec))


OTHER_POWER = {
    "prometheusAuthentication": (
        {"autoscaling": KEDA}, {"autoscaling": {**KEDA, "prometheus": {**KEDA["prometheus"], "authenticationRef": "a"}}},
        scaled_object),
    "prometheusClusterAuthentication": (
        {"autoscaling": KEDA}, {"autoscaling": {**KEDA, "prometheus": {
            **KEDA["prometheus"], "authenticationRef": "a", "authenticationKind": "ClusterTriggerAuthentication"}}},
        scaled_object),
}


def test_every_power_is_covered_here():
    assert [p.name for p in admission.POWERS] == [*ONE_POWER, *OTHER_POWER]


@pytest.mark.parametrize("power", ONE_POWER)
def test_each_guarded_power_reaches_the_pod(power):
    without, with_power = ONE_POWER[power]
    meta = Meta("g", "ns", "uid")

    def template(fragment):
        return deployment.build_deployment(parse_spec({"model": {"source": "hf://o/m"}, **fragment}), meta)["spec"]["template"]

    assert template(with_power) != template(without)
    assert DEFAULT_IMAGE in admission.render()  # the one image that needs no pod rights


def test_spot_and_compute_class_powers_are_the_node_selector_and_toleration_the_builders_produce():
    spot = parse_spec({"model": {"source": "hf://o/m"}, "accelerator": {"provisioning": "spot"}})
    flex = parse_spec({"model": {"source": "hf://o/m"}, "accelerator": {"provisioning": "flex-start"}})
    cc = parse_spec({"model": {"source": "hf://o/m"}, "accelerator": {"computeClass": "tpu-first"}})
    powers = {p.name: p for p in admission.POWERS}
    assert deployment.node_selector(spot)[deployment.SPOT_LABEL] == "true"
    assert any(t["key"] == deployment.SPOT_LABEL for t in deployment.tolerations(spot))
    assert deployment.node_selector(flex)[deployment.FLEX_START_LABEL] == "true"
    assert deployment.node_selector(cc)[deployment.COMPUTE_CLASS_LABEL] == "tpu-first"
    assert deployment.SPOT_LABEL in powers["provisioning"].why and deployment.FLEX_START_LABEL in powers["provisioning"].why
    assert deployment.COMPUTE_CLASS_LABEL in powers["computeClass"].why


def test_a_change_of_a_credentialed_source_is_checked_on_update_only():
    policy = admission.build_policy()
    by_message = {v["message"].split(" needs")[0]: v["expression"] for v in policy["spec"]["validations"]}
    change = "a change of spec.model.source, spec.model.embeddingTwin or spec.engine.speculative.source"
    assert by_message[change].startswith("oldObject == null || ")
    assert not by_message["spec.model.source"].startswith("oldObject == null")  # the bucket: also on create
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert "has(object.spec.serviceAccountName) || has(object.spec.model.tokenSecret)" in variables["credentialedSource"]


@pytest.mark.parametrize("power", OTHER_POWER)
def test_each_guarded_power_beyond_the_pod_reaches_the_object_it_names(power):
    without, with_power, builder = OTHER_POWER[power]
    meta = Meta("g", "ns")
    assert builder(parse_spec({"model": {"source": "hf://o/m"}, **with_power}), meta) != \
        builder(parse_spec({"model": {"source": "hf://o/m"}, **without}), meta)


def allowlist(**settings):
    return admission.allowlist_problems(
        parse_spec({"model": {"source": "hf://o/m"}, **settings.pop("spec", {})}), Settings(**settings))


def test_annotations_outside_the_allowlist_are_refused_by_name():
    (problem,) = allowlist(spec={"podAnnotations": {"gke-gcsfuse/cpu-limit": "1", "evil/x": "1"}})
    assert problem.reason == "PodAnnotationNotAllowed" and problem.fatal
    assert "'evil/x'" in problem.message and "gke-gcsfuse/cpu-limit" not in problem.message.split("(")[0]
    assert allowlist(spec={"podAnnotations": {"evil/x": "1"}}, allowed_pod_annotations=("evil/*",)) == []


@pytest.mark.parametrize("tolerations,allow,refused", [
    ([{"key": "dedicated", "operator": "Exists"}], (), True),
    ([{"key": "dedicated", "operator": "Exists"}], ("dedicated",), False),
    ([{"operator": "Exists"}], ("dedicated",), True),  # no key: tolerates every taint
    ([{"operator": "Exists"}], ("*",), False),
    ([{"key": "team.example.com/gpu", "operator": "Exists"}], ("team.example.com/*",), False),
])
def test_tolerations_outside_the_allowlist_are_refused(tolerations, allow, refused):
    problems = allowlist(spec={"tolerations": tolerations}, allowed_tolerations=allow)
    assert [p.reason for p in problems] == (["TolerationNotAllowed"] if refused else [])


@pytest.mark.parametrize("accelerator,allow,refused", [
    ({"provisioning": "spot"}, (), True),  # the toleration the operator adds for spot is judged too
    ({"provisioning": "spot"}, ("cloud.google.com/gke-spot",), False),
    ({"provisioning": "spot"}, ("cloud.google.com/*",), False),
    ({"provisioning": "flex-start"}, (), False),  # a node selector only, no toleration
    ({"topology": "2x2"}, (), False),  # the TPU taint's toleration needs no entry
])
def test_the_spot_toleration_is_judged_by_the_toleration_allowlist(accelerator, allow, refused):
    problems = allowlist(spec={"accelerator": accelerator}, allowed_tolerations=allow)
    assert [p.reason for p in problems] == (["TolerationNotAllowed"] if refused else [])
    if refused:
        assert problems[0].fatal and problems[0].message.startswith(
            "spec.accelerator.provisioning (spot, whose pods tolerate the taint key 'cloud.google.com/gke-spot') not "
            "allowed by this operator (GEMMA_OPERATOR_ALLOWED_TOLERATIONS")


def test_an_extended_resource_outside_the_allowlist_is_refused_naming_it_and_the_setting():
    (problem,) = allowlist(spec={"accelerator": {"type": "cpu"}, "resources": {
        "limits": {"nvidia.com/gpu": 1, "cpu": 2, "memory": "4Gi"}, "requests": {"ephemeral-storage": "1Gi",
                                                                                "hugepages-2Mi": "1Gi"}}})
    assert problem.reason == "ExtendedResourceNotAllowed" and problem.fatal
    assert problem.message.startswith("extended resource 'nvidia.com/gpu' (spec.resources.limits) not allowed by this "
                                      "operator (GEMMA_OPERATOR_ALLOWED_EXTENDED_RESOURCES, chart value "
                                      "operator.allowedExtendedResources: google.com/tpu)"), problem.message
    assert allowlist(spec={"resources": {"limits": {"nvidia.com/gpu": 1}}},
                     allowed_extended_resources=("google.com/tpu", "nvidia.com/*")) == []


def test_the_tpu_chips_the_operator_requests_are_judged_by_the_same_allowlist():
    assert allowlist(spec={"accelerator": {"topology": "2x2"}}) == []  # the default allows google.com/tpu
    (problem,) = allowlist(spec={"accelerator": {"topology": "2x2"}}, allowed_extended_resources=())
    assert problem.reason == "ExtendedResourceNotAllowed"
    assert "'google.com/tpu' (spec.accelerator (TPU chips))" in problem.message
    assert allowlist(spec={"accelerator": {"type": "cpu"}}, allowed_extended_resources=()) == []


PROM = "http://prometheus-operated.monitoring.svc:9090"


def keda(address, provider="Auto"):
    return {"autoscaling": {"maxReplicas": 2, "target": 1, "provider": provider,
                            "prometheus": {"serverAddress": address}}}


def test_a_prometheus_address_is_refused_by_default_naming_the_setting():
    (problem,) = allowlist(spec=keda(PROM))
    assert problem.reason == "PrometheusAddressNotAllowed" and problem.fatal
    assert problem.message.startswith(f"spec.autoscaling.prometheus.serverAddress '{PROM}' not allowed by this operator "
                                      "(GEMMA_OPERATOR_ALLOWED_PROMETHEUS_ADDRESSES, chart value "
                                      "operator.allowedPrometheusAddresses: none)")
    assert allowlist(spec=keda(PROM), allowed_prometheus_addresses=(PROM,)) == []
    assert allowlist(spec=keda(PROM, provider="HPA")) == []  # an HPA never queries it


@pytest.mark.parametrize("address,ok", [
    (PROM, True), (PROM + "/", True), (PROM + "/sub/path", True),
    ("HTTP://Prometheus-Operated.monitoring.svc:9090", True),
    ("http://prometheus-operated.monitoring.svc:9091", False),
    ("https://prometheus-operated.monitoring.svc:9090", False),
    ("http://prometheus-operated.monitoring.svc", False),  # port 80
    (PROM + ".evil.example", False),
    (PROM + "@evil.example", False),  # user info: the host is evil.example
    (PROM + "/../../api/v1/namespaces", False),
    (PROM + "/%2e%2e/x", False),
    (PROM + "?x=1", False),
    ("http://kubernetes.default.svc", False),
])
def test_prometheus_addresses_match_scheme_host_port_and_path_not_text(address, ok):
    assert allowed_address(address, (PROM,)) is ok


def test_a_prometheus_entry_with_a_path_allows_only_below_it():
    gmp = "https://monitoring.googleapis.com/v1/projects/mine/location/global/prometheus"
    assert allowed_address(gmp, ("https://monitoring.googleapis.com/v1/projects/mine",))
    assert not allowed_address(gmp.replace("mine", "mine2"), ("https://monitoring.googleapis.com/v1/projects/mine",))
    assert allowed_address("http://anything:1", ("*",))


def test_settings_come_from_the_environment_with_one_declared_default_each():
    got = Settings.from_env({"GEMMA_OPERATOR_ALLOWED_TOLERATIONS": "dedicated, team/*",
                             "GEMMA_OPERATOR_RESYNC_SECONDS": "2", "GEMMA_OPERATOR_TEST_ENGINE_URLS": "1",
                             "GEMMA_OPERATOR_ALLOWED_PROMETHEUS_ADDRESSES": f"{PROM},https://m.example/v1"})
    assert got.allowed_tolerations == ("dedicated", "team/*") and got.resync_seconds == 2.0
    assert got.test_engine_urls is True and got.allowed_pod_annotations == Settings().allowed_pod_annotations
    assert got.allowed_prometheus_addresses == (PROM, "https://m.example/v1")
    assert Settings().allowed_extended_resources == ("google.com/tpu",) and Settings().allowed_prometheus_addresses == ()
    with pytest.raises(ValueError, match="GEMMA_OPERATOR_WORKERS='many'"):
        Settings.from_env({"GEMMA_OPERATOR_WORKERS": "many"})
    assert [env for env, _, _ in describe()] == [
        "GEMMA_OPERATOR_RESYNC_SECONDS", "GEMMA_OPERATOR_WORKERS", "GEMMA_OPERATOR_DISCOVERY_TTL_SECONDS",
        "GEMMA_OPERATOR_ALLOWED_POD_ANNOTATIONS", "GEMMA_OPERATOR_ALLOWED_TOLERATIONS",
        "GEMMA_OPERATOR_ALLOWED_EXTENDED_RESOURCES", "GEMMA_OPERATOR_ALLOWED_PROMETHEUS_ADDRESSES",
        "GEMMA_OPERATOR_CLUSTER_NAME", "GEMMA_OPERATOR_KEDA_HTTP_SCALER", "GEMMA_OPERATOR_ENDPOINT_PICKER",
        "GEMMA_OPERATOR_TEST_ENGINE_URLS"]


def test_operator_readme_lists_every_setting_with_its_default():
    readme = (Path(__file__).resolve().parents[2] / "operator" / "README.md").read_text()
    for env, default, _ in describe():
        (row,) = [line for line in readme.splitlines() if line.startswith(f"| `{env}` |")]
        documented = row.split("|")[2].strip().strip("`").replace("(none)", "")
        assert documented == default or documented.replace(".", "", 1).isdigit() and \
            float(documented) == float(default), row


def test_allowlist_entries_are_keys_or_prefixes():
    assert allowed("gke-gcsfuse/cpu-limit", ("gke-gcsfuse/*",))
    assert not allowed("gke-gcsfuse", ("gke-gcsfuse/*",))
    assert allowed("a", ("a",)) and not allowed("ab", ("a",))
