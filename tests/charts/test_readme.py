"""The chart README's "what the operator asks GKE for" blocks are what gemma_operator.builders produces.

The README documents the exact node selector, tolerations and TPU resources per topology for people
sizing node pools; this keeps that text from drifting away from the builders.
"""

from __future__ import annotations

import re

import pytest
import yaml

from gemma_operator import spec
from gemma_operator.builders.deployment import build_deployment, node_affinity, shutdown_plan
from gemma_operator.builders.ownership import Meta

from .conftest import CHART

README = (CHART / "README.md").read_text()


def pod_fields(grs_spec: dict) -> dict:
    dep = build_deployment(spec.parse_spec(grs_spec), Meta("gemma", "default"))
    pod = dep["spec"]["template"]["spec"]
    return {"nodeSelector": pod["nodeSelector"], "tolerations": pod["tolerations"],
            "resources": pod["containers"][0]["resources"], "strategy": dep["spec"]["strategy"]}


@pytest.mark.parametrize("tpu", [spec.TPU_V5E, spec.TPU_V6E])
@pytest.mark.parametrize("topology", ["1x1", "2x2", "2x4"])
def test_readme_block_for_each_topology_is_what_the_builders_request(topology, tpu):
    m = re.search(rf'`topology: "{topology}"`\n```yaml\n(.*?)```', README, re.S)
    assert m, f"README has no yaml block for topology {topology}"
    documented = yaml.safe_load(m.group(1))
    # The blocks show v5e; the README says a v6e pod's differ only in the accelerator label's value.
    documented["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] = tpu
    built = pod_fields({"model": {"source": "hf://o/m"}, "accelerator": {"type": tpu, "topology": topology}})
    assert documented == {k: built[k] for k in ("nodeSelector", "tolerations", "resources")}
    assert built["strategy"] == {"type": "Recreate"}


def test_readme_spot_flex_start_and_compute_class_selectors_are_the_builders():
    base = pod_fields({"model": {"source": "hf://o/m"}})
    spot = pod_fields({"model": {"source": "hf://o/m"}, "accelerator": {"provisioning": "spot"}})
    flex = pod_fields({"model": {"source": "hf://o/m"}, "accelerator": {"provisioning": "flex-start"}})
    cc = pod_fields({"model": {"source": "hf://o/m"}, "accelerator": {"computeClass": "tpu-any"}})
    assert set(spot["nodeSelector"].items()) - set(base["nodeSelector"].items()) == {("cloud.google.com/gke-spot", "true")}
    assert [t for t in spot["tolerations"] if t not in base["tolerations"]] == [
        {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}]
    assert set(flex["nodeSelector"].items()) - set(base["nodeSelector"].items()) == {
        ("cloud.google.com/gke-flex-start", "true")}
    assert set(cc["nodeSelector"].items()) - set(base["nodeSelector"].items()) == {
        ("cloud.google.com/compute-class", "tpu-any")}
    for text in ('`cloud.google.com/gke-spot: "true"`',
                 '`{key: cloud.google.com/gke-spot, operator: Equal, value: "true", effect: NoSchedule}`',
                 '`cloud.google.com/gke-flex-start: "true"`', "`cloud.google.com/compute-class: NAME`"):
        assert text in README


def test_readme_cpu_rollout_is_the_builders():
    cpu = pod_fields({"model": {"source": "hf://o/m"}, "accelerator": {"type": "cpu"}})
    assert cpu["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert "google.com/tpu" not in str(cpu)
    assert "`RollingUpdate` (maxSurge 1, maxUnavailable 0)" in README


@pytest.mark.parametrize("provisioning", ["standard", "spot", "flex-start"])
def test_readme_capacity_table_is_the_builders(provisioning):
    row = re.search(rf"^\| `{provisioning}` \| (.*) \| (\d+) s \+ (\d+) s, (\d+) s \|$", README, re.M)
    assert row, f"README's capacity table has no row for {provisioning}"
    s = spec.parse_spec({"model": {"source": "hf://o/m"}, "accelerator": {"provisioning": provisioning}})
    assert tuple(int(x) for x in row.groups()[1:]) == tuple(shutdown_plan(s))
    if provisioning == "standard":
        affinity = node_affinity(s)["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        for expr in affinity["nodeSelectorTerms"][0]["matchExpressions"]:
            assert f"`{expr['key']}`" in row.group(1) and expr["operator"] == "NotIn" and expr["values"] == ["true"]
