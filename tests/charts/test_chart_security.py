"""The chart's least-privilege and admission parts, rendered by the real helm: the admission policy (the
generated one), namespaced mode (a Role per watched namespace with exactly rbac.RULES, kopf started with
those namespaces), the operator's allowlists, and its egress NetworkPolicy."""

from __future__ import annotations

import json

import kopf.cli
import pytest
import yaml

from gemma_operator import admission, rbac
from gemma_operator.builders.deployment import build_deployment
from gemma_operator.builders.ownership import Meta
from gemma_operator import spec as grs_spec
from gemma_operator.__main__ import kopf_argv
from gemma_operator.settings import Settings

from .conftest import CHART, ROOT, find

POLICY = "gemmarustservers.gemmarust.dev.admission.yaml"


def kinds(docs):
    return sorted(d["kind"] for d in docs)


# ------------------------------------------------------------------------------------------- admission policy


def test_chart_ships_the_generated_admission_policy(helm):
    assert (CHART / "files" / POLICY).read_bytes() == (ROOT / "crds" / POLICY).read_bytes(), (
        f"charts/gemma-rust-operator/files/{POLICY} differs from crds/{POLICY}; run `make crds`")
    docs = helm.render()
    assert find(docs, "ValidatingAdmissionPolicy") == admission.build_policy()
    assert find(docs, "ValidatingAdmissionPolicyBinding") == admission.build_binding()


def test_admission_policy_can_be_left_out(helm):
    assert not {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} & set(
        kinds(helm.render("admissionPolicy.enabled=false")))


# ------------------------------------------------------------------------------------------- namespaced mode


def test_namespaced_mode_grants_exactly_the_rules_in_each_watched_namespace_and_nothing_cluster_wide(helm):
    docs = helm.render("watchNamespaces={models,staging}")
    assert not {"ClusterRole", "ClusterRoleBinding"} & set(kinds(docs))
    roles = [d for d in docs if d["kind"] == "Role"]
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["models", "staging"]
    for role in roles:
        assert role["rules"] == rbac.RULES
    service_account = find(docs, "ServiceAccount")["metadata"]
    for binding in bindings:
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": roles[0]["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": service_account["name"],
                                        "namespace": service_account["namespace"]}]


def test_namespaced_mode_starts_kopf_on_those_namespaces_only(helm):
    (container,) = find(helm.render("watchNamespaces={models,staging}"), "Deployment")["spec"]["template"][
        "spec"]["containers"]
    argv = kopf_argv(container["args"])
    assert "--all-namespaces" not in argv
    ctx = kopf.cli.main.make_context("kopf", argv)
    run = kopf.cli.main.get_command(ctx, "run").make_context("run", argv[1:])
    assert set(run.params["namespaces"]) == {"models", "staging"} and not run.params["clusterwide"]
    (container,) = find(helm.render(), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "--all-namespaces" in kopf_argv(container["args"])


def test_namespaced_mode_without_rbac_creates_no_roles(helm):
    docs = helm.render("watchNamespaces={models}", "rbac.create=false")
    assert not {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"} & set(kinds(docs))


# ------------------------------------------------------------------------------------------- allowlists


def operator_env(docs):
    (container,) = find(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_allowlists_reach_the_operator_and_default_to_its_own_defaults(helm):
    parsed = Settings.from_env(operator_env(helm.render()))
    assert parsed.allowed_pod_annotations == Settings().allowed_pod_annotations
    assert parsed.allowed_tolerations == Settings().allowed_tolerations
    env = operator_env(helm.render("operator.allowedTolerations={dedicated,team.example.com/*}",
                                   "operator.allowedPodAnnotations={a.example.com/x}"))
    parsed = Settings.from_env(env)
    assert parsed.allowed_tolerations == ("dedicated", "team.example.com/*")
    assert parsed.allowed_pod_annotations == ("a.example.com/x",)


def test_values_yaml_documents_the_allowlist_defaults_the_operator_uses():
    values = yaml.safe_load((CHART / "values.yaml").read_text())["operator"]
    assert tuple(values["allowedPodAnnotations"]) == Settings().allowed_pod_annotations
    assert tuple(values["allowedTolerations"]) == Settings().allowed_tolerations


# ------------------------------------------------------------------------------------------- egress policy


EGRESS_ON = ("operatorNetworkPolicy.enabled=true", "operatorNetworkPolicy.apiServerCIDRs={172.16.0.2/32}")


def test_operator_egress_reaches_the_api_server_and_server_pods_only(helm):
    docs = helm.render(*EGRESS_ON, "operatorNetworkPolicy.apiServerPorts={443,6443}")
    policy = find(docs, "NetworkPolicy", "grs-gemma-rust-operator-egress")
    operator_labels = find(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= operator_labels.items()
    assert policy["spec"]["policyTypes"] == ["Egress"]
    api, pods = policy["spec"]["egress"]
    assert api == {"to": [{"ipBlock": {"cidr": "172.16.0.2/32"}}],
                   "ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}]}
    (peer,) = pods["to"]
    assert peer["namespaceSelector"] == {}
    server = build_deployment(grs_spec.parse_spec({"model": {"source": "hf://o/m"}}),
                              Meta("any", "models"))
    assert peer["podSelector"]["matchLabels"].items() <= server["spec"]["template"]["metadata"]["labels"].items()
    # The operator reads /v1/engine on the API port; the probe port is the kubelet's, the TPU metrics port
    # GKE's node metrics agent's.
    http, probe_port, tpu_metrics = server["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert (probe_port["name"], tpu_metrics["name"]) == ("probes", "tpu-metrics")
    assert pods["ports"] == [{"protocol": "TCP", "port": http["name"]}]


def test_operator_egress_to_server_pods_follows_the_watched_namespaces(helm):
    policy = find(helm.render(*EGRESS_ON, "watchNamespaces={models,staging}"), "NetworkPolicy")
    (peer,) = policy["spec"]["egress"][1]["to"]
    assert peer["namespaceSelector"] == {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["models", "staging"]}]}


def test_operator_egress_needs_the_api_server_address(helm):
    out = helm.template("operatorNetworkPolicy.enabled=true", check=False)
    assert out.returncode != 0
    assert "operatorNetworkPolicy.apiServerCIDRs: set the API server's endpoint addresses" in out.stderr


def test_no_egress_policy_by_default(helm):
    assert not [d for d in helm.render() if d["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("bad", ["watchNamespaces={Not_A_Namespace}", "operatorNetworkPolicy.apiServerCIDRs={10.0.0.1}",
                                 "operatorNetworkPolicy.apiServerPorts={0}", "operator.allowedTolerations={a b}"])
def test_schema_rejects_bad_security_values(helm, bad):
    out = helm.template(bad, check=False)
    assert out.returncode != 0, f"--set {bad} was accepted"
    assert json.dumps(bad.split("=")[0].split(".")[-1])[1:-1] in out.stderr, out.stderr
