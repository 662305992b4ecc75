"""Pod-level powers (operator/gemma_operator/admission.py): the generated admission policy is current and
covers every power the builders turn into a pod field, and the operator's own allowlists. The policy itself
is exercised on a real API server in test_admission_cluster.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from gemma_operator import admission, builders
from gemma_operator.settings import Settings, allowed, describe
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


# One spec fragment per power, each setting only that power.
ONE_POWER = {
    "spec.image": {"image": "example.com/mine:1"},
    "spec.serviceAccountName": {"serviceAccountName": "admin"},
    "spec.model.tokenSecret": {"model": {"source": "hf://o/m", "tokenSecret": {"name": "hf"}}},
    "spec.server.apiKeySecret": {"server": {"apiKeySecret": {"name": "key"}}},
    "spec.model.source": {"model": {"source": "pvc://weights/gemma"}},
    "spec.model.embeddingTwin": {"model": {"source": "hf://o/m", "embeddingTwin": "pvc://emb/x"}},
    "spec.tolerations": {"tolerations": [{"operator": "Exists"}]},
    "spec.nodeSelector": {"nodeSelector": {"a": "b"}},
    "spec.podAnnotations": {"podAnnotations": {"x": "y"}},
}
# Powers that reach another object than the pod: the KEDA ScaledObject's trigger.
KEDA = {"maxReplicas": 2, "target": 1, "prometheus": {"serverAddress": "http://p:9090"}}
OTHER_POWER = {
    "spec.autoscaling.prometheus.authenticationRef": (
        {"autoscaling": KEDA}, {"autoscaling": {**KEDA, "prometheus": {**KEDA["prometheus"], "authenticationRef": "a"}}},
        builders.build_scaled_object),
}


@pytest.mark.parametrize("field", ONE_POWER)
def test_each_guarded_power_reaches_the_pod(field):
    assert {p.field for p in admission.POWERS} == set(ONE_POWER) | set(OTHER_POWER)
    meta = builders.Meta("g", "ns")
    base = builders.build_deployment(parse_spec({"model": {"source": "hf://o/m"}}), meta)["spec"]["template"]
    spec = parse_spec({"model": {"source": "hf://o/m"}, **ONE_POWER[field]})
    assert builders.build_deployment(spec, meta)["spec"]["template"] != base
    assert DEFAULT_IMAGE in admission.render()  # the one image that needs no pod rights


@pytest.mark.parametrize("field", OTHER_POWER)
def test_each_guarded_power_beyond_the_pod_reaches_the_object_it_names(field):
    without, with_power, builder = OTHER_POWER[field]
    meta = builders.Meta("g", "ns")
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


def test_settings_come_from_the_environment_with_one_declared_default_each():
    got = Settings.from_env({"GEMMA_OPERATOR_ALLOWED_TOLERATIONS": "dedicated, team/*",
                             "GEMMA_OPERATOR_RESYNC_SECONDS": "2", "GEMMA_OPERATOR_TEST_ENGINE_URLS": "1"})
    assert got.allowed_tolerations == ("dedicated", "team/*") and got.resync_seconds == 2.0
    assert got.test_engine_urls is True and got.allowed_pod_annotations == Settings().allowed_pod_annotations
    with pytest.raises(ValueError, match="GEMMA_OPERATOR_WORKERS='many'"):
        Settings.from_env({"GEMMA_OPERATOR_WORKERS": "many"})
    assert [env for env, _, _ in describe()] == [
        "GEMMA_OPERATOR_RESYNC_SECONDS", "GEMMA_OPERATOR_WORKERS", "GEMMA_OPERATOR_DISCOVERY_TTL_SECONDS",
        "GEMMA_OPERATOR_ALLOWED_POD_ANNOTATIONS", "GEMMA_OPERATOR_ALLOWED_TOLERATIONS", "GEMMA_OPERATOR_TEST_ENGINE_URLS"]


def test_allowlist_entries_are_keys_or_prefixes():
    assert allowed("gke-gcsfuse/cpu-limit", ("gke-gcsfuse/*",))
    assert not allowed("gke-gcsfuse", ("gke-gcsfuse/*",))
    assert allowed("a", ("a",)) and not allowed("ab", ("a",))
