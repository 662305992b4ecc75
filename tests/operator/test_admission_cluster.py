"""The admission policy (crds/gemmarustservers.gemmarust.dev.admission.yaml) on a real kube-apiserver: its
CEL asks the real RBAC authorizer about the requesting user, who is impersonated here (the admin's client
certificate may impersonate any user; the authorizer then sees that user and system:authenticated).

alice may only edit GemmaRustServers; bob may also create pods; carol may also use one ServiceAccount and
get one Secret and one PersistentVolumeClaim by name. The servers an administrator made (with the admin's
client) are what alice then tries to change. Creates are dry runs: admission runs in full, nothing
is stored, so the operator never sees these objects.

The policy is applied from crds/ as a user without the chart would, for this module only: the chart's
end-to-end test installs the chart's own copy with helm, which refuses to adopt an object it did not create.
"""

from __future__ import annotations

import kubernetes
import pytest

from gemma_operator.kube import ApiError, Kube
from gemma_operator.spec import DEFAULT_IMAGE

from .harness import GRS_PATH, POLICY_FILE, create, ensure, get, grs, wait_for

pytestmark = pytest.mark.cluster

RBAC = "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}"
PLAIN = {"model": {"source": "hf://google/gemma-4-e2b-it"}, "accelerator": {"type": "cpu"}}

# One spec per pod-level power: (fragment, the permission the refusal must name besides creating pods).
POWERS = {
    "image": ({"image": "example.com/evil:1"}, None),
    "serviceAccountName": ({"serviceAccountName": "ns-admin"}, "or to use serviceaccounts/ns-admin there"),
    "tokenSecret": ({"model": {"source": "hf://o/m", "tokenSecret": {"name": "prod-db", "key": "password"}}},
                    "or to get secrets/prod-db there"),
    "apiKeySecret": ({"server": {"apiKeySecret": {"name": "prod-db"}}}, "or to get secrets/prod-db there"),
    "pvc source": ({"model": {"source": "pvc://prod-data/x"}}, "or to get persistentvolumeclaims/prod-data there"),
    "pvc embeddingTwin": ({"model": {"source": "hf://o/m", "embeddingTwin": "pvc://prod-data/y"}},
                          "or to get persistentvolumeclaims/prod-data there"),
    "pvc drafter": ({"engine": {"speculative": {"method": "mtp", "numSpeculativeTokens": 2,
                                                "source": "pvc://prod-data/d"}}},
                    "or to get persistentvolumeclaims/prod-data there"),
    "gs source": ({"model": {"source": "gs://prod-weights/gemma"}}, None),
    "gs drafter": ({"engine": {"speculative": {"method": "mtp", "numSpeculativeTokens": 2,
                                               "source": "gs://prod-weights/d"}}}, None),
    "gs embeddingTwin": ({"model": {"source": "hf://o/m", "embeddingTwin": "gs://prod-weights/emb"}}, None),
    "spot": ({"accelerator": {"provisioning": "spot"}}, None),
    "flex-start": ({"accelerator": {"provisioning": "flex-start"}}, None),
    "computeClass": ({"accelerator": {"computeClass": "tpu-first"}}, None),
    "tolerations": ({"tolerations": [{"operator": "Exists"}]}, None),
    "nodeSelector": ({"nodeSelector": {"node-role.kubernetes.io/control-plane": ""}}, None),
    "podAnnotations": ({"podAnnotations": {"container.apparmor.security.beta.kubernetes.io/server": "unconfined"}},
                       None),
    "mediaFetchHosts": ({"server": {"media": {"fetchHosts": ["metadata.google.internal"]}}}, None),
    "prometheusAuthentication": ({"autoscaling": {"maxReplicas": 2, "target": 1, "prometheus": {
        "serverAddress": "http://collector.example.com", "authenticationRef": "prod-auth"}}},
        "or to get triggerauthentications/prod-auth there"),
    "prometheusClusterAuthentication": ({"autoscaling": {"maxReplicas": 2, "target": 1, "prometheus": {
        "serverAddress": "http://collector.example.com", "authenticationRef": "prod-auth",
        "authenticationKind": "ClusterTriggerAuthentication"}}},
        "or to get clustertriggerauthentications/prod-auth (cluster-wide)"),
}


def spec_with(*fragments):
    out = {**PLAIN, "model": dict(PLAIN["model"])}
    for fragment in fragments:
        for key, value in fragment.items():
            out[key] = {**out[key], **value} if key == "model" else value
    return out


def as_user(cluster, user: str) -> Kube:
    api = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
    api.set_default_header("Impersonate-User", user)
    return Kube(api)


def dry_run_create(kube: Kube, ns: str, spec: dict) -> dict:
    return kube.request("POST", GRS_PATH.format(ns=ns), grs("probe", spec), query={"dryRun": "All"})


def refusal(kube: Kube, ns: str, spec: dict) -> ApiError:
    with pytest.raises(ApiError) as caught:
        dry_run_create(kube, ns, spec)
    return caught.value


def role(kube, ns, name, rules, users):
    ensure(kube, RBAC.format(ns=ns) + "/roles",
           {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": name}, "rules": rules})
    ensure(kube, RBAC.format(ns=ns) + "/rolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": u} for u in users]})


@pytest.fixture(scope="module")
def admission_policy(cluster):
    cluster.kubectl("apply", "--server-side", "-f", str(POLICY_FILE))
    yield
    cluster.kubectl("delete", "-f", str(POLICY_FILE), "--wait=true")


@pytest.fixture
def users(cluster, kube, ns, admission_policy):
    """alice, bob and carol with their rights in `ns`, once the policy is in force there."""
    role(kube, ns, "grs-editor", [{"apiGroups": ["gemmarust.dev"], "resources": ["gemmarustservers"],
                                   "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]}],
         ["alice", "bob", "carol"])
    role(kube, ns, "pod-creator", [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]}], ["bob"])
    role(kube, ns, "named-objects", [
        {"apiGroups": [""], "resources": ["serviceaccounts"], "resourceNames": ["ns-admin"], "verbs": ["use"]},
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["prod-db"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "resourceNames": ["prod-data"], "verbs": ["get"]},
        {"apiGroups": ["keda.sh"], "resources": ["triggerauthentications"], "resourceNames": ["prod-auth"],
         "verbs": ["get"]},
    ], ["carol"])
    # Cluster-scoped: a ClusterRole, bound cluster-wide (a RoleBinding cannot grant cluster-scoped objects).
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    ensure(kube, f"{rbac}/clusterroles", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "carol-cta"},
        "rules": [{"apiGroups": ["keda.sh"], "resources": ["clustertriggerauthentications"],
                   "resourceNames": ["prod-auth"], "verbs": ["get"]}]})
    ensure(kube, f"{rbac}/clusterrolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": "carol-cta"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "carol-cta"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "carol"}]})
    alice = as_user(cluster, "alice")

    def in_force():
        try:
            dry_run_create(alice, ns, spec_with(POWERS["image"][0]))
        except ApiError as e:
            return e.status == 403 and "pod-powers.gemmarust.dev" in e.message
        return False
    wait_for(in_force, timeout=30, what="the admission policy and alice's rights in force")
    return {name: as_user(cluster, name) for name in ("alice", "bob", "carol")}


def test_a_user_with_only_grs_rights_may_create_a_server_without_pod_powers(users, ns):
    created = dry_run_create(users["alice"], ns, PLAIN)
    assert created["spec"]["image"] == DEFAULT_IMAGE


def test_scale_to_zero_is_no_power_a_user_with_only_grs_rights_may_set_it(users, ns):
    """Its HTTPScaledObject's hosts are the server's own namespaced names and the add-on's scaler is the
    operator's setting (gemma_operator/admission.py): nothing the pods or the cluster's routing could be given."""
    spec = spec_with({"autoscaling": {"minReplicas": 0, "maxReplicas": 2, "target": 1, "idleSeconds": 300,
                                      "wakeTimeoutSeconds": 900}})
    created = dry_run_create(users["alice"], ns, spec)
    assert created["spec"]["autoscaling"]["minReplicas"] == 0


@pytest.mark.parametrize("power", POWERS)
def test_a_user_with_only_grs_rights_is_refused_each_pod_power_naming_the_missing_permission(users, ns, power):
    fragment, grant = POWERS[power]
    error = refusal(users["alice"], ns, spec_with(fragment))
    assert error.status == 403, error
    assert f"needs RBAC permission to create pods in namespace {ns}" in error.message, error.message
    if grant:
        assert grant in error.message, error.message


def test_a_user_who_may_create_pods_is_admitted_with_every_power(users, ns):
    spec = spec_with(*(fragment for fragment, _ in POWERS.values()))
    assert dry_run_create(users["bob"], ns, spec)["spec"]["serviceAccountName"] == "ns-admin"


def test_rights_on_the_named_objects_admit_just_those_fields(users, ns):
    named = [POWERS[p][0] for p in ("serviceAccountName", "tokenSecret", "apiKeySecret", "pvc source",
                                    "pvc embeddingTwin", "prometheusAuthentication")]
    dry_run_create(users["carol"], ns, spec_with(*named))
    dry_run_create(users["carol"], ns, spec_with(POWERS["prometheusClusterAuthentication"][0]))
    # Rights on the namespaced TriggerAuthentication of that name do not admit the cluster-wide one.
    assert refusal(users["alice"], ns, spec_with(POWERS["prometheusClusterAuthentication"][0])).status == 403
    other = refusal(users["carol"], ns, spec_with({"model": {"source": "hf://o/m", "tokenSecret": {"name": "other"}}}))
    assert "or to get secrets/other there" in other.message
    assert "spec.image" in refusal(users["carol"], ns, spec_with(*named, POWERS["image"][0])).message


def test_on_update_only_a_changed_power_is_checked(kube, users, ns):
    # An administrator gave the server a ServiceAccount; alice may still scale it, not change its powers.
    create(kube, ns, "shared", spec_with(POWERS["serviceAccountName"][0]))
    path = f"{GRS_PATH.format(ns=ns)}/shared"
    alice = users["alice"]

    def patch(body):
        return alice.request("PATCH", path, body, query={"dryRun": "All"}, content_type="application/merge-patch+json")

    assert patch({"spec": {"replicas": 2}})["spec"]["replicas"] == 2
    with pytest.raises(ApiError) as caught:
        patch({"spec": {"serviceAccountName": "other-admin"}})
    assert caught.value.status == 403 and "serviceaccounts/other-admin" in caught.value.message
    with pytest.raises(ApiError) as caught:
        patch({"spec": {"image": "example.com/evil:2"}})
    assert "spec.image needs RBAC permission" in caught.value.message
    # The operator's own writes (kopf's annotations on the object, the status) pass the policy too.
    def handled():
        obj = get(kube, ns, "shared")
        return (obj.get("status") or {}).get("observedGeneration") == 1 and \
            "gemmarust.dev/last-handled-configuration" in (obj["metadata"].get("annotations") or {})
    wait_for(handled, what="the operator's writes to a server under the policy")


def patcher(kube: Kube, ns: str, name: str):
    path = f"{GRS_PATH.format(ns=ns)}/{name}"

    def patch(spec):
        return kube.request("PATCH", path, {"spec": spec}, query={"dryRun": "All"},
                            content_type="application/merge-patch+json")
    return patch


def refused_patch(patch, spec) -> str:
    with pytest.raises(ApiError) as caught:
        patch(spec)
    assert caught.value.status == 403, caught.value
    return caught.value.message


GCS_NEEDS_PODS = "spec.model.source needs RBAC permission to create pods in namespace"
CHANGE_NEEDS_PODS = ("a change of spec.model.source, spec.model.embeddingTwin or spec.engine.speculative.source "
                     "needs RBAC permission to create pods in namespace")


def test_a_tenant_may_not_switch_the_bucket_of_an_admins_server_that_keeps_its_service_account(kube, users, ns):
    # The review's case: the administrator's server reads gs://team-weights as ns-admin; alice may edit it.
    create(kube, ns, "gcs", spec_with(POWERS["serviceAccountName"][0], {"model": {"source": "gs://team-weights/g"}}))
    alice, bob = patcher(users["alice"], ns, "gcs"), patcher(users["bob"], ns, "gcs")
    assert alice({"replicas": 2})["spec"]["replicas"] == 2
    message = refused_patch(alice, {"model": {"source": "gs://other-team/g"}})
    assert GCS_NEEDS_PODS in message and "gs:// bucket" in message, message
    # Even in the same bucket: the source is read with ns-admin's rights.
    assert CHANGE_NEEDS_PODS in refused_patch(alice, {"model": {"source": "gs://team-weights/other"}})
    assert bob({"model": {"source": "gs://other-team/g"}})["spec"]["model"]["source"] == "gs://other-team/g"


def test_a_bucket_is_a_power_without_a_service_account_too(kube, users, ns):
    # Pods without spec.serviceAccountName mount the bucket as the namespace's default ServiceAccount.
    create(kube, ns, "plain-gcs", spec_with({"model": {"source": "gs://team-weights/g"}}))
    alice = patcher(users["alice"], ns, "plain-gcs")
    assert alice({"model": {"source": "gs://team-weights/g2"}})["spec"]["model"]["source"] == "gs://team-weights/g2"
    assert GCS_NEEDS_PODS in refused_patch(alice, {"model": {"source": "gs://other-team/g"}})
    message = refused_patch(alice, {"model": {"embeddingTwin": "gs://other-team/emb"}})
    assert "spec.model.embeddingTwin needs RBAC permission to create pods" in message, message
    assert alice({"model": {"source": "hf://o/m"}})["spec"]["model"]["source"] == "hf://o/m"  # giving it up is free


def test_on_a_server_with_credentials_any_change_of_the_model_source_needs_the_pod_right(kube, users, ns):
    create(kube, ns, "creds", spec_with({"model": {"source": "hf://o/m", "tokenSecret": {"name": "prod-db"}}}))
    alice, carol = patcher(users["alice"], ns, "creds"), patcher(users["carol"], ns, "creds")
    assert alice({"replicas": 3})["spec"]["replicas"] == 3
    assert CHANGE_NEEDS_PODS in refused_patch(alice, {"model": {"source": "hf://o/private"}})
    assert CHANGE_NEEDS_PODS in refused_patch(alice, {"model": {"embeddingTwin": "hf://o/emb"}})
    drafter = {"method": "mtp", "numSpeculativeTokens": 2, "source": "hf://o/private-assistant"}
    assert CHANGE_NEEDS_PODS in refused_patch(alice, {"engine": {"speculative": drafter}})
    # carol may get the Secret, so she may create a server with it and any source; changing this one's source
    # is reading with the administrator's credentials, which takes the right to create pods.
    assert CHANGE_NEEDS_PODS in refused_patch(carol, {"model": {"source": "hf://o/private"}})
    assert patcher(users["bob"], ns, "creds")({"model": {"source": "hf://o/private"}})
    # Without credentials the source is no power: alice changes that of her own server.
    users["alice"].request("POST", GRS_PATH.format(ns=ns), grs("mine", PLAIN))
    assert patcher(users["alice"], ns, "mine")({"model": {"source": "hf://o/other"}})["spec"]["model"]["source"] == \
        "hf://o/other"


def test_spot_and_a_compute_class_are_guarded_on_update_like_a_node_selector(kube, users, ns):
    create(kube, ns, "spot", spec_with({"accelerator": {"provisioning": "spot"}}))
    alice = patcher(users["alice"], ns, "spot")
    assert alice({"replicas": 2})["spec"]["replicas"] == 2
    message = refused_patch(alice, {"accelerator": {"provisioning": "flex-start"}})
    assert "spec.accelerator.provisioning needs RBAC permission to create pods" in message, message
    assert alice({"accelerator": {"provisioning": "standard"}})["spec"]["accelerator"]["provisioning"] == "standard"
    message = refused_patch(alice, {"accelerator": {"provisioning": "standard", "computeClass": "tpu-first"}})
    assert "spec.accelerator.computeClass needs RBAC permission to create pods" in message, message
