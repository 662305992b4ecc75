"""Pod-level powers of a GemmaRustServer: who may set them (a ValidatingAdmissionPolicy) and which values
this operator passes on at all (its allowlists).

Creating a GemmaRustServer makes the operator create pods, with the operator's rights. So a spec field that
gives those pods a power (an image of the user's choosing, a ServiceAccount, a Secret in the environment,
a volume claim, a bucket, placement on tainted or chosen nodes, pod annotations) must not be settable by
someone who could not create such a pod. `build_policy` is a ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1,
GA in Kubernetes 1.30) whose CEL asks the API server's authorizer about the requesting user: each power
is admitted when the user may create pods in the namespace, or, for a power that names one object, may use
that object (`use` the ServiceAccount, `get` the Secret, `get` the PersistentVolumeClaim). On UPDATE only a
power whose value changes is checked, so a user who may edit GemmaRustServers can still scale one that an
administrator gave a ServiceAccount. The operator's own writes (metadata, status) change no power.

Some powers are the pod fields the builders derive from other spec fields, checked as those fields:
- a gs:// bucket (spec.model.source, spec.model.embeddingTwin, spec.engine.speculative.source): the GCS FUSE
  driver mounts it with the pods' ServiceAccount, the namespace's default one when spec.serviceAccountName is unset, so whatever buckets that
  account may read are a power of every GemmaRustServer author unless the bucket is checked;
- the model source of a server that runs with spec.serviceAccountName or spec.model.tokenSecret: the pods
  read it with those credentials, so on UPDATE a change of the source (or of the embedding twin, or of the
  speculative drafter's source) is checked even when the credentials stay (on CREATE, the checks of the ServiceAccount and the Secret cover it);
- spec.accelerator.provisioning spot or flex-start and spec.accelerator.computeClass: a node selector
  (cloud.google.com/gke-spot, cloud.google.com/gke-flex-start, cloud.google.com/compute-class) and, for
  spot, a toleration of the spot taint (builders.deployment.node_selector, builders.deployment.tolerations).

`python -m gemma_operator.admission > crds/gemmarustservers.gemmarust.dev.admission.yaml` writes the policy
and its binding (`make crds`); the chart ships the same file (files/, templates/admission-policy.yaml) and
tests fail when either copy is stale.

spec.autoscaling and spec.gateway otherwise give no such power: the HPA, ScaledObject and InferencePool made
for them act on this server's own pods in its namespace, and whoever may edit a GemmaRustServer may set
its replicas anyway. Their one exception, a KEDA TriggerAuthentication or ClusterTriggerAuthentication named
by the spec, is a power above. Scale to zero (spec.autoscaling.minReplicas 0, idleSeconds, wakeTimeoutSeconds)
adds none: the KEDA HTTP add-on's interceptor routes for the whole cluster, but the HTTPScaledObject's hosts are
derived, never taken from the spec, and each names the server's namespace (builders.autoscaling.service_hosts),
while the CRD admits no dot in a server's name (spec.NAME_RULES), so no server can draw another's requests;
the add-on's scaler address is the operator's setting (GEMMA_OPERATOR_KEDA_HTTP_SCALER), not a spec field, so a
spec cannot point KEDA at an address of its choosing.
The CRD's CEL refuses what cannot work (minReplicas 0 with provider HPA; behind an InferencePool, without the
Prometheus that reads the picker's queue).

The operator also refuses, on its own side, what falls outside the allowlists of its settings
(`allowlist_problems`), so an administrator decides what any GemmaRustServer may carry: pod annotations;
tolerations, judged on the pods the builders make (the spot toleration included; the TPU taint's, which the
operator itself needs, excepted); extended resources the containers request (google.com/tpu by default;
GKE adds a toleration for some, e.g. nvidia.com/gpu); and the Prometheus address KEDA queries, which
otherwise may be any in-cluster URL.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NamedTuple

import yaml

from .builders import deployment
from . import spec as grs_spec
from .settings import Settings, allowed, allowed_address
from .status import Problem

POLICY_NAME = f"pod-powers.{grs_spec.API_GROUP}"


class Power(NamedTuple):
    """One pod-level power of the spec, as CEL over a spec `$s` (the placeholder is replaced)."""

    name: str               # CEL variable name
    field: str              # the spec field, as messages name it
    value: str              # CEL: the power's value in S, `unset` when the field is not set
    unset: str              # CEL literal of "not set"
    grant: tuple[str, str] | None  # (resource, verb) on the object `value` names that also allows it
    why: str                # what the power does, for the message
    group: str = ""         # API group of the grant's resource
    fix: str = ""           # what to do without the right (default: leave the field unset)
    on_create: bool = True  # False: checked on UPDATE only (other powers cover it on CREATE)
    namespaced: bool = True  # False: the grant's resource is cluster-scoped


def _has(path: str) -> str:
    """CEL: every object on `path` (e.g. "engine.speculative.source", under `$s`) is set."""
    parts = path.split(".")
    return " && ".join(f"has($s.{'.'.join(parts[:i + 1])})" for i in range(len(parts)))


def _claim(path: str) -> str:
    return f"{_has(path)} && $s.{path}.startsWith('pvc://') ? $s.{path}.substring(6).split('/')[0] : ''"


def _bucket(path: str) -> str:
    return f"{_has(path)} && $s.{path}.startsWith('gs://') ? $s.{path}.substring(5).split('/')[0] : ''"


def _optional(path: str) -> str:
    return f"{_has(path)} ? $s.{path} : ''"


_DRAFTER = "engine.speculative.source"


def _authentication(kind: str) -> str:
    """The name authenticationRef gives when authenticationKind is `kind` (the CRD defaults the kind)."""
    prometheus = "$s.autoscaling.prometheus"
    return (f"has($s.autoscaling) && has({prometheus}) && has({prometheus}.authenticationRef) && "
            f"(has({prometheus}.authenticationKind) ? {prometheus}.authenticationKind : 'TriggerAuthentication')"
            f" == '{kind}' ? {prometheus}.authenticationRef : ''")


_CREDENTIALS = "has($s.serviceAccountName) || has($s.model.tokenSecret)"
_PROVISIONING = "has($s.accelerator) && has($s.accelerator.provisioning) ? $s.accelerator.provisioning : 'standard'"

POWERS = [
    Power("image", "spec.image", f"has($s.image) ? $s.image : {json.dumps(grs_spec.DEFAULT_IMAGE)}",
          json.dumps(grs_spec.DEFAULT_IMAGE), None, "the pods run this image instead of the default one"),
    Power("serviceAccountName", "spec.serviceAccountName",
          "has($s.serviceAccountName) ? $s.serviceAccountName : ''", "''", ("serviceaccounts", "use"),
          "the pods run as this ServiceAccount"),
    Power("tokenSecret", "spec.model.tokenSecret", "has($s.model.tokenSecret) ? $s.model.tokenSecret.name : ''",
          "''", ("secrets", "get"), "the pods get this Secret's value in their environment"),
    Power("apiKeySecret", "spec.server.apiKeySecret",
          "has($s.server) && has($s.server.apiKeySecret) ? $s.server.apiKeySecret.name : ''", "''",
          ("secrets", "get"), "the pods get this Secret's value in their environment"),
    Power("sourceClaim", "spec.model.source", _claim("model.source"), "''", ("persistentvolumeclaims", "get"),
          "the pods mount this PersistentVolumeClaim"),
    Power("embeddingTwinClaim", "spec.model.embeddingTwin", _claim("model.embeddingTwin"), "''",
          ("persistentvolumeclaims", "get"), "the pods mount this PersistentVolumeClaim"),
    Power("drafterClaim", "spec.engine.speculative.source", _claim(_DRAFTER), "''",
          ("persistentvolumeclaims", "get"), "the pods mount this PersistentVolumeClaim"),
    Power("sourceBucket", "spec.model.source", _bucket("model.source"), "''", None,
          "the pods mount this gs:// bucket with their ServiceAccount's rights, the namespace's default "
          "ServiceAccount's when spec.serviceAccountName is unset",
          fix="keep the bucket as it is, or use an hf:// or pvc:// source"),
    Power("embeddingTwinBucket", "spec.model.embeddingTwin", _bucket("model.embeddingTwin"), "''", None,
          "the pods mount this gs:// bucket with their ServiceAccount's rights, the namespace's default "
          "ServiceAccount's when spec.serviceAccountName is unset",
          fix="keep the bucket as it is, or use an hf:// or pvc:// embedding twin"),
    Power("drafterBucket", "spec.engine.speculative.source", _bucket(_DRAFTER), "''", None,
          "the pods mount this gs:// bucket with their ServiceAccount's rights, the namespace's default "
          "ServiceAccount's when spec.serviceAccountName is unset",
          fix="keep the bucket as it is, or use an hf:// or pvc:// drafter"),
    Power("credentialedSource",
          "a change of spec.model.source, spec.model.embeddingTwin or spec.engine.speculative.source",
          f"{_CREDENTIALS} ? [$s.model.source, {_optional('model.embeddingTwin')}, {_optional(_DRAFTER)}] : []",
          "[]", None, "the pods read the model with the credentials of spec.serviceAccountName or "
          "spec.model.tokenSecret", fix="keep the model source as it is", on_create=False),
    Power("provisioning", "spec.accelerator.provisioning",
          _PROVISIONING, "'standard'", None,
          f"spot selects nodes labelled {deployment.SPOT_LABEL}=true and tolerates their taint, flex-start selects "
          f"nodes labelled {deployment.FLEX_START_LABEL}=true", fix="leave it at standard"),
    Power("computeClass", "spec.accelerator.computeClass",
          "has($s.accelerator) && has($s.accelerator.computeClass) ? $s.accelerator.computeClass : ''", "''", None,
          f"the pods select nodes labelled {deployment.COMPUTE_CLASS_LABEL} with this ComputeClass"),
    Power("tolerations", "spec.tolerations", "has($s.tolerations) ? $s.tolerations : []", "[]", None,
          "the pods tolerate these taints"),
    Power("nodeSelector", "spec.nodeSelector", "has($s.nodeSelector) ? $s.nodeSelector : {}", "{}", None,
          "the pods select these nodes"),
    Power("podAnnotations", "spec.podAnnotations", "has($s.podAnnotations) ? $s.podAnnotations : {}", "{}", None,
          "the pods carry these annotations"),
    # The server fetches image URLs on these hosts for any client of its API (gemma_server/media.py `fetch`): a
    # GET from inside the cluster's network, on the author's choice of host.
    Power("mediaFetchHosts", "spec.server.media.fetchHosts",
          "has($s.server) && has($s.server.media) && has($s.server.media.fetchHosts) ? $s.server.media.fetchHosts "
          ": []", "[]", None, "the pods fetch http(s) URLs on these hosts for any client of the API",
          fix="leave it empty: clients then send images as data URLs"),
    # Not a pod's power but the same shape: KEDA (kedacore/keda v2.21.0, pkg/scalers/prometheus_scaler.go)
    # sends the credentials a TriggerAuthentication resolves to spec.autoscaling.prometheus.serverAddress,
    # which the author of the GemmaRustServer chooses.
    Power("prometheusAuthentication", "spec.autoscaling.prometheus.authenticationRef",
          _authentication("TriggerAuthentication"), "''", ("triggerauthentications", "get"),
          "KEDA sends the credentials of this TriggerAuthentication to spec.autoscaling.prometheus.serverAddress",
          group="keda.sh"),
    Power("prometheusClusterAuthentication", "spec.autoscaling.prometheus.authenticationRef",
          _authentication("ClusterTriggerAuthentication"), "''", ("clustertriggerauthentications", "get"),
          "KEDA sends the credentials of this ClusterTriggerAuthentication to "
          "spec.autoscaling.prometheus.serverAddress", group="keda.sh", namespaced=False),
]

_MAY_CREATE_PODS = "authorizer.group('').resource('pods').namespace(request.namespace).check('create').allowed()"


def _old(p: Power) -> str:
    return "old" + p.name[0].upper() + p.name[1:]


def _validation(p: Power) -> dict[str, Any]:
    new, old = f"variables.{p.name}", f"variables.{_old(p)}"
    ok = [f"{new} == {p.unset}", f"{new} == {old}", "variables.mayCreatePods"]
    if not p.on_create:
        ok.insert(0, "oldObject == null")
    pods = 'needs RBAC permission to create pods in namespace " + request.namespace'
    if p.grant:
        resource, verb = p.grant
        scope = ".namespace(request.namespace)" if p.namespaced else ""
        ok.append(f"authorizer.group('{p.group}').resource('{resource}'){scope}.name({new})"
                  f".check('{verb}').allowed()")
        where = "there" if p.namespaced else "(cluster-wide)"
        message = (f'"{p.field} naming " + {new} + " {pods} + ", or to {verb} {resource}/" + {new} + '
                   f'" {where} ({p.why})"')
    else:
        message = f'"{p.field} {pods} + " ({p.why}); without it, {p.fix or f"leave {p.field} unset"}"'
    return {"expression": " || ".join(ok), "messageExpression": message, "reason": "Forbidden",
            "message": f"{p.field} needs RBAC permission to create pods in this namespace ({p.why})"}


def build_policy() -> dict[str, Any]:
    """The ValidatingAdmissionPolicy (pure)."""
    variables = [{"name": "mayCreatePods", "expression": _MAY_CREATE_PODS}]
    for p in POWERS:
        variables.append({"name": p.name, "expression": p.value.replace("$s.", "object.spec.")})
        variables.append({"name": _old(p), "expression":
                          f"oldObject == null ? {p.unset} : ({p.value.replace('$s.', 'oldObject.spec.')})"})
    return {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": POLICY_NAME, "labels": {"app.kubernetes.io/part-of": "gemma-rust-operator"}},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [grs_spec.API_GROUP], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE"],
                "resources": [grs_spec.PLURAL]}]},
            "variables": variables,
            "validations": [_validation(p) for p in POWERS],
        },
    }


def build_binding() -> dict[str, Any]:
    """The binding that puts the policy in force in every namespace (pure)."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": POLICY_NAME, "labels": {"app.kubernetes.io/part-of": "gemma-rust-operator"}},
        "spec": {"policyName": POLICY_NAME, "validationActions": ["Deny"]},
    }


def render() -> str:
    """The policy and its binding as the YAML text kept in crds/."""
    header = ("# Generated by `python -m gemma_operator.admission` from operator/gemma_operator/admission.py: "
              "do not edit.\n")
    return header + yaml.safe_dump_all([build_policy(), build_binding()], sort_keys=False, width=120)


# ---------------------------------------------------------------------------------------------------------
# The operator's own allowlists


# Container resources that are not extended resources (Kubernetes pkg/apis/core/helper/helpers.go,
# IsStandardContainerResourceName, v1.30): anything else is a device plugin's, and GKE adds a toleration
# for some of them (its ExtendedResourceToleration admission, e.g. nvidia.com/gpu).
STANDARD_RESOURCES = ("cpu", "memory", "ephemeral-storage", "hugepages-*")


def _refused(what: str, setting: str, chart: str, entries: tuple[str, ...], fix: str) -> str:
    return (f"{what} not allowed by this operator ({setting}, chart value operator.{chart}: "
            f"{', '.join(entries) or 'none'}): {fix}, or ask its administrator to allow it")


def allowlist_problems(spec: grs_spec.GemmaRustServerSpec, settings: Settings) -> list[Problem]:
    """What `spec` gives its pods (and KEDA) outside the operator's allowlists, as fatal problems (pure).

    Tolerations and resources are judged as the builders produce them, so the spot toleration that
    spec.accelerator.provisioning adds, and google.com/tpu, which spec.accelerator sets, are judged too.
    """
    problems = []
    refused = [k for k in spec.pod_annotations if not allowed(k, settings.allowed_pod_annotations)]
    if refused:
        problems.append(Problem(
            "PodAnnotationNotAllowed",
            f"spec.podAnnotations {', '.join(map(repr, refused))} not allowed by this operator "
            f"(GEMMA_OPERATOR_ALLOWED_POD_ANNOTATIONS, chart value operator.allowedPodAnnotations: "
            f"{', '.join(settings.allowed_pod_annotations) or 'none'}): remove them, or ask its administrator "
            f"to allow them", fatal=True))
    for source, toleration in deployment.sourced_tolerations(spec):
        key = toleration.get("key") or ""
        if source == "spec.accelerator.type":
            continue  # the TPU taint's, which every TPU pod needs
        if not allowed(key, settings.allowed_tolerations) or (not key and "*" not in settings.allowed_tolerations):
            what = f"key {key!r}" if key else "no key, so it tolerates every taint"
            if source == "spec.accelerator.provisioning":
                what = f"spot, whose pods tolerate the taint {what}"
            problems.append(Problem("TolerationNotAllowed", _refused(
                f"{source} ({what})", "GEMMA_OPERATOR_ALLOWED_TOLERATIONS", "allowedTolerations",
                settings.allowed_tolerations, "remove it" if source.startswith("spec.tolerations") else
                "use provisioning standard"), fatal=True))
            break
    resources = deployment.container_resources(spec)
    extended = {name: "spec.accelerator (TPU chips)" if name == deployment.TPU_RESOURCE else f"spec.resources.{kind}"
                for kind in ("limits", "requests") for name in resources.get(kind, {})
                if not allowed(name, STANDARD_RESOURCES) and not allowed(name, settings.allowed_extended_resources)}
    if extended:
        problems.append(Problem("ExtendedResourceNotAllowed", _refused(
            "extended resource " + ", ".join(f"{name!r} ({source})" for name, source in extended.items()),
            "GEMMA_OPERATOR_ALLOWED_EXTENDED_RESOURCES", "allowedExtendedResources",
            settings.allowed_extended_resources, "remove it"), fatal=True))
    scaling = spec.autoscaling
    address = scaling.prometheus.server_address if scaling and scaling.provider != "HPA" else None
    if address and not allowed_address(address, settings.allowed_prometheus_addresses):
        problems.append(Problem("PrometheusAddressNotAllowed", _refused(
            f"spec.autoscaling.prometheus.serverAddress {address!r}", "GEMMA_OPERATOR_ALLOWED_PROMETHEUS_ADDRESSES",
            "allowedPrometheusAddresses", settings.allowed_prometheus_addresses,
            "use an allowed address, or spec.autoscaling.provider HPA"), fatal=True))
    return problems


if __name__ == "__main__":
    sys.stdout.write(render())
