"""Pod-level powers of a GemmaRustServer: who may set them (a ValidatingAdmissionPolicy) and which values
this operator passes on at all (its allowlists).

Creating a GemmaRustServer makes the operator create pods, with the operator's rights. So a spec field that
gives those pods a power (an image of the user's choosing, a ServiceAccount, a Secret in the environment,
a volume claim, placement on tainted or chosen nodes, pod annotations) must not be settable by someone who
could not create such a pod. `build_policy` is a ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1,
GA in Kubernetes 1.30) whose CEL asks the API server's authorizer about the requesting user: each power
is admitted when the user may create pods in the namespace, or, for a power that names one object, may use
that object (`use` the ServiceAccount, `get` the Secret, `get` the PersistentVolumeClaim). On UPDATE only a
power whose value changes is checked, so a user who may edit GemmaRustServers can still scale one that an
administrator gave a ServiceAccount. The operator's own writes (metadata, status) change no power.

`python -m gemma_operator.admission > crds/gemmarustservers.gemmarust.dev.admission.yaml` writes the policy
and its binding (`make crds`); the chart ships the same file (files/, templates/admission-policy.yaml) and
tests fail when either copy is stale.

spec.autoscaling and spec.gateway otherwise give no such power: the HPA, ScaledObject and InferencePool made
for them act on this server's own pods in its namespace, and whoever may edit a GemmaRustServer may set
its replicas anyway. Their one exception, a KEDA TriggerAuthentication named by the spec, is a power above.

The operator also refuses, on its own side, pod annotations and tolerations outside the allowlists of its
settings (`allowlist_problems`): an administrator decides which of those any GemmaRustServer may carry.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NamedTuple

import yaml

from . import spec as grs_spec
from .settings import Settings, allowed
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


def _claim(field: str) -> str:
    return (f"has($s.model.{field}) && $s.model.{field}.startsWith('pvc://') ? "
            f"$s.model.{field}.substring(6).split('/')[0] : ''")


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
    Power("sourceClaim", "spec.model.source", _claim("source"), "''", ("persistentvolumeclaims", "get"),
          "the pods mount this PersistentVolumeClaim"),
    Power("embeddingTwinClaim", "spec.model.embeddingTwin", _claim("embeddingTwin"), "''",
          ("persistentvolumeclaims", "get"), "the pods mount this PersistentVolumeClaim"),
    Power("tolerations", "spec.tolerations", "has($s.tolerations) ? $s.tolerations : []", "[]", None,
          "the pods tolerate these taints"),
    Power("nodeSelector", "spec.nodeSelector", "has($s.nodeSelector) ? $s.nodeSelector : {}", "{}", None,
          "the pods select these nodes"),
    Power("podAnnotations", "spec.podAnnotations", "has($s.podAnnotations) ? $s.podAnnotations : {}", "{}", None,
          "the pods carry these annotations"),
    # Not a pod's power but the same shape: KEDA (kedacore/keda v2.21.0, pkg/scalers/prometheus_scaler.go)
    # sends the credentials a TriggerAuthentication resolves to spec.autoscaling.prometheus.serverAddress,
    # which the author of the GemmaRustServer chooses.
    Power("prometheusAuthentication", "spec.autoscaling.prometheus.authenticationRef",
          "has($s.autoscaling) && has($s.autoscaling.prometheus) && has($s.autoscaling.prometheus.authenticationRef)"
          " ? $s.autoscaling.prometheus.authenticationRef : ''", "''", ("triggerauthentications", "get"),
          "KEDA sends the credentials of this TriggerAuthentication to spec.autoscaling.prometheus.serverAddress",
          group="keda.sh"),
]

_MAY_CREATE_PODS = "authorizer.group('').resource('pods').namespace(request.namespace).check('create').allowed()"


def _old(p: Power) -> str:
    return "old" + p.name[0].upper() + p.name[1:]


def _validation(p: Power) -> dict[str, Any]:
    new, old = f"variables.{p.name}", f"variables.{_old(p)}"
    ok = [f"{new} == {p.unset}", f"{new} == {old}", "variables.mayCreatePods"]
    pods = 'needs RBAC permission to create pods in namespace " + request.namespace'
    if p.grant:
        resource, verb = p.grant
        ok.append(f"authorizer.group('{p.group}').resource('{resource}').namespace(request.namespace).name({new})"
                  f".check('{verb}').allowed()")
        message = (f'"{p.field} naming " + {new} + " {pods} + ", or to {verb} {resource}/" + {new} + '
                   f'" there ({p.why})"')
    else:
        message = f'"{p.field} {pods} + " ({p.why}); without it, leave {p.field} unset"'
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


def allowlist_problems(spec: grs_spec.GemmaRustServerSpec, settings: Settings) -> list[Problem]:
    """Pod annotations and tolerations of `spec` outside the operator's allowlists, as fatal problems (pure)."""
    problems = []
    refused = [k for k in spec.pod_annotations if not allowed(k, settings.allowed_pod_annotations)]
    if refused:
        problems.append(Problem(
            "PodAnnotationNotAllowed",
            f"spec.podAnnotations {', '.join(map(repr, refused))} not allowed by this operator "
            f"(GEMMA_OPERATOR_ALLOWED_POD_ANNOTATIONS, chart value operator.allowedPodAnnotations: "
            f"{', '.join(settings.allowed_pod_annotations) or 'none'}): remove them, or ask its administrator "
            f"to allow them", fatal=True))
    for i, toleration in enumerate(spec.tolerations):
        key = toleration.get("key") or ""
        if not allowed(key, settings.allowed_tolerations) or (not key and "*" not in settings.allowed_tolerations):
            what = f"key {key!r}" if key else "no key, so it tolerates every taint"
            problems.append(Problem(
                "TolerationNotAllowed",
                f"spec.tolerations[{i}] ({what}) not allowed by this operator (GEMMA_OPERATOR_ALLOWED_TOLERATIONS, "
                f"chart value operator.allowedTolerations: {', '.join(settings.allowed_tolerations) or 'none'}): "
                f"remove it, or ask its administrator to allow that taint key", fatal=True))
            break
    return problems


if __name__ == "__main__":
    sys.stdout.write(render())
