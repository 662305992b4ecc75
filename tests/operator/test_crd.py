"""The CRD in crds/ is generated from the pydantic spec and must be up to date; its schema is structural."""

from __future__ import annotations

from pathlib import Path

import yaml

from gemma_operator import crd

CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "gemmarustservers.gemmarust.dev.yaml"


def test_checked_in_crd_is_regenerated_from_the_spec():
    assert CRD_FILE.read_text() == crd.render(), (
        "crds/ is stale: run `python -m gemma_operator.crd > crds/gemmarustservers.gemmarust.dev.yaml`")


def _walk(node, path="spec"):
    yield path, node
    for key, sub in (node.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_spec_schema_is_structural():
    for path, node in _walk(crd.spec_schema()):
        assert not {"$ref", "anyOf", "oneOf", "allOf", "title"} & set(node), path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        assert not ("properties" in node and "additionalProperties" in node), path


def test_crd_names_subresources_and_columns():
    doc = yaml.safe_load(CRD_FILE.read_text())
    spec = doc["spec"]
    assert doc["metadata"]["name"] == "gemmarustservers.gemmarust.dev"
    assert spec["names"]["shortNames"] == ["grs"] and spec["names"]["kind"] == "GemmaRustServer"
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1"
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Ready", "Phase", "Ready/Replicas", "Model", "Accelerator", "Reason", "Age", "Message"]
    # The message is for `kubectl get grs -o wide`; the default columns stay narrow.
    assert [c.get("priority", 0) for c in version["additionalPrinterColumns"]] == [0] * 7 + [1]


def test_defaults_reach_nested_objects():
    spec = crd.spec_schema()["properties"]
    assert spec["accelerator"]["default"] == {}
    assert spec["accelerator"]["properties"]["type"]["default"] == "tpu-v5-lite-podslice"
    assert spec["server"]["properties"]["port"]["default"] == 8000
    assert "default" not in spec["model"]["properties"]["tokenSecret"]  # optional: stays absent
    gcs = spec["model"]["properties"]["gcsFuse"]
    assert gcs["default"] == {} and gcs["properties"]["fileCacheSize"]["default"] == "16Gi"
    # Follows the capacity class (builders.deployment.shutdown_plan), so the API server must not fill it in.
    assert "default" not in spec["server"]["properties"]["shutdownTimeoutSeconds"]


def test_cross_field_rules_are_cel():
    spec = crd.spec_schema()
    rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
    rules += [r["rule"] for r in spec["properties"]["accelerator"]["x-kubernetes-validations"]]
    assert any("buildCache" in r and "replicas" in r for r in rules)
    assert any("topology" in r and "cpu" in r for r in rules)
    assert any("computeClass" in r and "provisioning" in r for r in rules)


def test_cel_rules_of_a_defaulted_object_hold_for_its_default():
    # The API server checks an object's CEL rules against the object's `default` ({}) before nested
    # defaults apply, and refuses the CRD when a rule reads a field that is then absent.
    from gemma_operator.spec import CEL_RULES, GatewaySpec

    (rule,) = CEL_RULES[GatewaySpec]
    assert rule["rule"].startswith("!has(self.inferencePool) ||")


def test_a_servers_name_must_be_a_dns_1035_label_by_a_rule_at_the_schemas_root():
    """The rule sits at the root, the one place a CRD's CEL may read metadata.name; its pattern and bound are those
    of a Service name, so a name with a dot (which would claim another namespace's host in the KEDA HTTP add-on's
    routing table) is refused. tests/operator/test_crd_cluster.py runs it on the real API server."""
    import re

    root = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    (rule,) = root["x-kubernetes-validations"]
    assert rule["message"].startswith("metadata.name must be a DNS-1035 label")
    assert "e.g. gemma-4-e2b" in rule["message"]
    bound, pattern = re.fullmatch(
        r"size\(self\.metadata\.name\) <= (\d+) && self\.metadata\.name\.matches\(r'(.+)'\)", rule["rule"]).groups()

    def admitted(name: str) -> bool:
        return len(name) <= int(bound) and re.search(pattern, name) is not None

    assert [n for n in ("gemma", "gemma-4-e2b", "a", "a" * 63, "g9") if not admitted(n)] == []
    assert [n for n in ("a.b", "gemma.svc", "a.b.svc.cluster", "1gemma", "-a", "a-", "Gemma", "a_b", "a" * 64)
            if admitted(n)] == []
