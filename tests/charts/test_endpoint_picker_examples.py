"""The example endpoint pickers (charts/gemma-rust-operator/examples/): one per picker release the operator writes a
config for, each mounting the operator's ConfigMap where its --config-file reads it, with the release's image.

llm-d-router's example is checked against that release's flags and its charts' RBAC
(tests/operator/llm_d_router_v0_10_config.py); GIE v1.5.0's is run for real by
tests/operator/test_endpoint_picker_cluster.py.
"""

from __future__ import annotations

import pytest
import yaml

from gemma_operator.builders.endpoint_picker import CONFIG_KEY, picker_config_name
from gemma_operator.builders.ownership import Meta
from gemma_operator.spec import ENDPOINT_PICKER_RELEASES, GIE_V1_5, LLM_D_ROUTER_V0_10, EndpointPickerRef
from tests.operator import llm_d_router_v0_10_config as router

from .conftest import CHART

EXAMPLES = {LLM_D_ROUTER_V0_10: CHART / "examples" / "endpoint-picker.yaml",
            GIE_V1_5: CHART / "examples" / "endpoint-picker-gie-v1.5.0.yaml"}
IMAGES = {LLM_D_ROUTER_V0_10: "ghcr.io/llm-d/llm-d-router-endpoint-picker",
          GIE_V1_5: "registry.k8s.io/gateway-api-inference-extension/epp"}
SERVER = Meta("gemma", "serving")  # the examples are written for a server of this name


def docs(release: str) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(EXAMPLES[release].read_text()) if d}


def args(container: dict) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in container["args"])


def test_there_is_an_example_for_each_release_the_operator_writes_a_config_for():
    assert tuple(EXAMPLES) == ENDPOINT_PICKER_RELEASES


@pytest.mark.parametrize("release", ENDPOINT_PICKER_RELEASES)
def test_each_example_runs_its_releases_image_on_the_operators_config_behind_the_service_the_spec_names(release):
    objects = docs(release)
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"{IMAGES[release]}:{release.rsplit('/', 1)[1]}"
    (mount,) = container["volumeMounts"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == picker_config_name(SERVER)
    assert args(container)["config-file"] == f"{mount['mountPath']}/{CONFIG_KEY}"
    assert args(container)["pool-name"] == SERVER.name
    service = objects["Service"]
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc-ext-proc")
    assert grpc["port"] == EndpointPickerRef(name=service["metadata"]["name"]).port
    assert pod["serviceAccountName"] == objects["RoleBinding"]["subjects"][0]["name"]


def test_the_llm_d_router_example_passes_only_flags_the_router_has_and_none_it_refuses():
    (container,) = docs(LLM_D_ROUTER_V0_10)["Deployment"]["spec"]["template"]["spec"]["containers"]
    given = set(args(container))
    assert given <= router.FLAGS, given - router.FLAGS
    assert not given & router.REFUSED_FLAGS
    # Our config's plugin types are all Beta (the schema checks it): no experimental switch.
    assert "allow-experimental-plugins" not in given


def test_the_llm_d_router_example_may_read_what_the_router_watches_in_both_api_groups_as_its_chart_grants():
    rules = docs(LLM_D_ROUTER_V0_10)["Role"]["rules"]
    granted = {(group, resource) for r in rules if set(r["verbs"]) == {"get", "watch", "list"}
               for group in r["apiGroups"] for resource in r["resources"]}
    # llm-d-router v0.10.0, config/charts/llm-d-router-gateway/templates/rbac.yaml and routerlib/templates/_rbac.yaml
    assert granted == {("", "pods"), ("inference.networking.k8s.io", "inferencepools"),
                       ("inference.networking.x-k8s.io", "inferenceobjectives"),
                       ("inference.networking.x-k8s.io", "inferencemodelrewrites"),
                       ("llm-d.ai", "inferenceobjectives"), ("llm-d.ai", "inferencemodelrewrites")}
