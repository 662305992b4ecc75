"""Generate the GemmaRustServer CustomResourceDefinition from the pydantic spec (`spec.py`).

Run `python -m gemma_operator.crd > crds/gemmarustservers.gemmarust.dev.yaml`; a unit test regenerates it
and fails when the checked-in file is stale.

The pydantic JSON schema is turned into a Kubernetes *structural* schema: `$ref`s are inlined, `Optional`
unions collapse to the inner type, `int | str` becomes `x-kubernetes-int-or-string`, titles go, and an
object field with nested defaults gets `default: {}` so the API server fills those defaults even when the
user leaves the whole object out. CEL rules from `spec.CEL_RULES` become `x-kubernetes-validations`, and
`spec.NAME_RULES` (on metadata.name) those of the schema's root.
Status is schemaless (`x-kubernetes-preserve-unknown-fields`) apart from the fields the scale subresource
and printer columns read, because the operator alone writes it.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from .spec import (API_GROUP, API_VERSION, CEL_RULES, KIND, NAME_RULES, PLURAL, SHORT_NAMES, SINGULAR,
                   GemmaRustServerSpec)

_KEEP = {"type", "description", "default", "enum", "pattern", "minimum", "maximum", "minLength", "maxLength",
         "minItems", "maxItems", "maxProperties", "properties", "required", "items", "additionalProperties",
         "x-kubernetes-validations", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string"}


def _structural(node: dict[str, Any], defs: dict[str, Any], cel_by_name: dict[str, list]) -> dict[str, Any]:
    """One JSON-schema node -> one structural OpenAPI node (pure)."""
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        inner = _structural(defs[name], defs, cel_by_name)
        if name in cel_by_name:
            inner["x-kubernetes-validations"] = cel_by_name[name]
        for k in ("description", "default"):
            if k in node:
                inner[k] = node[k]
        return inner
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        types = sorted(o.get("type") for o in options)
        if types == ["integer", "string"]:
            out: dict[str, Any] = {"x-kubernetes-int-or-string": True}
        elif len(options) == 1:
            out = _structural(options[0], defs, cel_by_name)
        else:
            raise ValueError(f"union not expressible in a structural schema: {node}")
        for k in ("description",):
            if k in node:
                out[k] = node[k]
        if node.get("default") is not None:
            out["default"] = node["default"]
        return out
    if node.get("type") == "object" and "properties" in node:
        props = {}
        for key, sub in node["properties"].items():
            prop = _structural(sub, defs, cel_by_name)
            # A nested object with defaults of its own: default it to {} so they apply.
            # (Optional fields, `X | None` in pydantic, stay absent instead.)
            if prop.get("type") == "object" and "default" not in prop and key not in node.get("required", []) \
                    and "properties" in prop and "anyOf" not in sub:
                prop["default"] = {}
            props[key] = prop
        out = {"type": "object", "properties": props}
        if node.get("required"):
            out["required"] = list(node["required"])
        # Structural schemas forbid additionalProperties next to properties; unknown fields are pruned
        # (and refused by kubectl's strict field validation).
        return {k: v for k, v in _trim(out, node).items() if k != "additionalProperties"}
    if node.get("type") == "object":
        extra = node.get("additionalProperties")
        out = {"type": "object"}
        if isinstance(extra, dict) and extra:
            out["additionalProperties"] = _structural(extra, defs, cel_by_name)
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
        out = _trim(out, node)
        if out.get("additionalProperties") is True:
            del out["additionalProperties"]
        return out
    if node.get("type") == "array":
        out = {"type": "array", "items": _structural(node.get("items", {"type": "object"}), defs, cel_by_name)}
        return _trim(out, node)
    if "const" in node:
        return _trim({"type": node.get("type", "string"), "enum": [node["const"]]}, node)
    return _trim(dict(node), node)


def _trim(out: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    for k, v in node.items():
        if k in _KEEP and k not in out:
            out[k] = v
    return {k: v for k, v in out.items() if k in _KEEP}


def spec_schema() -> dict[str, Any]:
    """The OpenAPI v3 schema of `spec`, with defaults and CEL rules (pure)."""
    raw = GemmaRustServerSpec.model_json_schema(by_alias=True, mode="validation")
    defs = raw.get("$defs", {})
    cel_by_name = {model.__name__: rules for model, rules in CEL_RULES.items()}
    out = _structural({k: v for k, v in raw.items() if k != "$defs"}, defs, cel_by_name)
    if GemmaRustServerSpec.__name__ in cel_by_name:
        out["x-kubernetes-validations"] = cel_by_name[GemmaRustServerSpec.__name__]
    return out


def status_schema() -> dict[str, Any]:
    """The status schema: the fields other tools read are typed, the rest is preserved as written."""
    return {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "properties": {
            "phase": {"type": "string"},
            "reason": {"type": "string"},
            "message": {"type": "string"},
            "observedGeneration": {"type": "integer"},
            "replicas": {"type": "integer"},
            "readyReplicas": {"type": "integer"},
            "readyText": {"type": "string"},
            "selector": {"type": "string"},
            "accelerator": {"type": "string"},
            "endpoint": {"type": "string"},
            "servedModel": {"type": "string"},
            "conditions": {
                "type": "array",
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
                "items": {
                    "type": "object",
                    "required": ["type", "status"],
                    "properties": {
                        "type": {"type": "string"},
                        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                        "reason": {"type": "string"},
                        "message": {"type": "string"},
                        "lastTransitionTime": {"type": "string", "format": "date-time"},
                        "observedGeneration": {"type": "integer"},
                    },
                },
            },
        },
    }


PRINTER_COLUMNS = [
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Ready/Replicas", "type": "string", "jsonPath": ".status.readyText"},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.source"},
    {"name": "Accelerator", "type": "string", "jsonPath": ".status.accelerator"},
    {"name": "Reason", "type": "string", "jsonPath": ".status.reason"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    # `kubectl get grs -o wide` adds why the server is where it is.
    {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1},
]


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition object (pure)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{API_GROUP}",
            "labels": {"app.kubernetes.io/name": "gemma-rust-operator", "app.kubernetes.io/part-of": "gemma-rust-operator"},
        },
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": SINGULAR,
                      "shortNames": list(SHORT_NAMES), "categories": ["all", "gemmarust"]},
            "versions": [{
                "name": API_VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "GemmaRustServer: a Gemma 4 model served by the Rust engine on GKE TPU v5e or v6e "
                                   "(or CPU).",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema(),
                        "status": status_schema(),
                    },
                    # At the root, where a rule may read metadata.name (spec.NAME_RULES).
                    "x-kubernetes-validations": NAME_RULES,
                }},
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": ".status.selector"},
                },
                "additionalPrinterColumns": PRINTER_COLUMNS,
            }],
        },
    }


def render() -> str:
    """The CRD as the YAML text kept in crds/."""
    header = ("# Generated by `python -m gemma_operator.crd` from operator/gemma_operator/spec.py: do not edit.\n")
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)


if __name__ == "__main__":
    sys.stdout.write(render())
