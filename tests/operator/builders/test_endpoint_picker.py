"""The endpoint picker's config (gemma_operator/builders/endpoint_picker.py): golden dicts, no cluster involved.

llm-d-router v0.10.0 cannot be built here (the Go module proxy does not serve it), so its config is checked
against a schema written from its source (tests/operator/llm_d_router_v0_10_config.py), which refuses the
GIE-era shape as the router's loader does. GIE v1.5.0's config is run by the real picker in
tests/operator/test_endpoint_picker_cluster.py.
"""

from __future__ import annotations

import pytest
import yaml

from gemma_operator.builders.endpoint_picker import RELEASE_CONFIGS, build_gie_v1_5_config, \
    build_llm_d_router_v0_10_config, build_picker_config, build_picker_configmap
from gemma_operator.spec import ENDPOINT_PICKER_RELEASES, GIE_V1_5, LLM_D_ROUTER_V0_10

from .. import llm_d_router_v0_10_config as router
from .specs import LABELS, META, tpu_spec

GATEWAY = {"inferencePool": True, "endpointPicker": {"name": "epp"}}
EXTRACTOR = {"engineConfigs": [{"name": "gemma-rust", "queuedRequestsSpec": "gemma_num_requests_waiting",
                                "runningRequestsSpec": "gemma_num_requests_running",
                                "kvUsageSpec": "gemma_kv_cache_usage_perc"}],
             "defaultEngine": "gemma-rust"}
PROFILES = [{"name": "default", "plugins": [
    {"pluginRef": "queue-scorer", "weight": 2.0}, {"pluginRef": "kv-cache-utilization-scorer", "weight": 2.0},
    {"pluginRef": "prefix-cache-scorer", "weight": 3.0}]}]
DATA_LAYER = {"sources": [{"pluginRef": "metrics-data-source", "extractors": [{"pluginRef": "core-metrics-extractor"}]}]}


def with_release(release: str | None = None, **overrides):
    picker = {"name": "epp", **({"release": release} if release else {})}
    return tpu_spec(gateway={"inferencePool": True, "endpointPicker": picker}, **overrides)


def test_every_release_the_spec_names_has_a_config_and_llm_d_router_is_the_default():
    assert tuple(RELEASE_CONFIGS) == ENDPOINT_PICKER_RELEASES
    assert ENDPOINT_PICKER_RELEASES[0] == LLM_D_ROUTER_V0_10
    assert build_picker_config(with_release()) == build_llm_d_router_v0_10_config(with_release())


def test_llm_d_routers_config_puts_the_prefix_index_on_its_producer_and_the_scorer_names_it():
    spec = with_release(LLM_D_ROUTER_V0_10, engine={"maxNumSeqs": 8, "context": 4096})
    assert build_picker_config(spec) == {
        "apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "metrics-data-source", "parameters": {"scheme": "http", "path": "/metrics"}},
            {"type": "core-metrics-extractor", "parameters": EXTRACTOR},
            # 8 slots of 4096 tokens in the router's smallest blocks, 64 tokens; a prompt matched up to a context.
            {"type": "approx-prefix-cache-producer", "parameters": {
                "blockSizeTokens": 64, "maxPrefixTokensToMatch": 4096, "lruCapacityPerServer": 8 * 4096 // 64,
                "autoTune": False}},
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "prefix-cache-scorer", "parameters": {"prefixMatchInfoProducerName": "approx-prefix-cache-producer"}},
        ],
        "schedulingProfiles": PROFILES, "dataLayer": DATA_LAYER}


def test_gie_v1_5s_config_keeps_the_prefix_parameters_on_the_scorer_whose_loader_passes_them_on():
    spec = with_release(GIE_V1_5, engine={"maxNumSeqs": 8, "context": 4096})
    assert build_picker_config(spec) == {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1", "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "metrics-data-source", "parameters": {"scheme": "http", "path": "/metrics"}},
            {"type": "core-metrics-extractor", "parameters": EXTRACTOR},
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            # 8 slots of 4096 tokens, in v1.5.0's blocks of 16 tokens.
            {"type": "prefix-cache-scorer", "parameters": {
                "blockSizeTokens": 16, "maxPrefixBlocksToMatch": 256, "lruCapacityPerServer": 8 * 4096 // 16,
                "autoTune": False}},
        ],
        "schedulingProfiles": PROFILES, "dataLayer": DATA_LAYER}


@pytest.mark.parametrize("release", ENDPOINT_PICKER_RELEASES)
def test_the_configmap_holds_the_config_as_yaml_and_names_the_release_it_is_for(release):
    spec = with_release(release)
    cm = build_picker_configmap(spec, META)
    assert cm["metadata"] == {"name": "gemma-epp", "namespace": "serving", "labels": LABELS,
                              "annotations": {"gemmarust.dev/endpoint-picker-version": release}}
    assert yaml.safe_load(cm["data"]["config.yaml"]) == RELEASE_CONFIGS[release](spec)


def test_no_configmap_without_a_pool_nor_for_a_release_without_a_config():
    assert build_picker_configmap(tpu_spec(), META) is None
    assert build_picker_configmap(with_release("llm-d-router/v0.9.0"), META) is None


# --------------------------------------------------------------------- llm-d-router v0.10.0's loader rules


@pytest.mark.parametrize("engine", [{}, {"maxNumSeqs": 1, "context": 256}, {"maxNumSeqs": 64, "context": 131072}])
def test_llm_d_router_v0_10_loads_our_config_without_a_refusal_or_a_deprecation(engine):
    text = build_picker_configmap(with_release(LLM_D_ROUTER_V0_10, engine=engine), META)["data"]["config.yaml"]
    config = yaml.safe_load(text)
    assert router.refusals(config) == []
    assert router.deprecations(config) == []


def test_llm_d_router_v0_10_refuses_the_gie_config_because_the_prefix_scorer_takes_no_index_parameters():
    config = build_gie_v1_5_config(with_release(GIE_V1_5))
    assert router.deprecations(config) == [
        "apiVersion inference.networking.x-k8s.io/v1alpha1/EndpointPickerConfig is deprecated; "
        "replacement llm-d.ai/v1alpha1/EndpointPickerConfig"]
    assert router.refusals(config) == [
        f'plugins[4] (prefix-cache-scorer).parameters: json: unknown field "{key}"'
        for key in ("blockSizeTokens", "maxPrefixBlocksToMatch", "lruCapacityPerServer", "autoTune")]
    # The same parameters on the producer load.
    moved = dict(config, plugins=[p for p in config["plugins"] if p["type"] != "prefix-cache-scorer"] + [
        {"type": "approx-prefix-cache-producer", "parameters": config["plugins"][4]["parameters"]},
        {"type": "prefix-cache-scorer"}])
    assert router.refusals(moved) == []


def test_the_schema_refuses_what_the_router_refuses_beyond_unknown_parameters():
    ours = build_llm_d_router_v0_10_config(with_release())

    def changed(**top):
        return router.refusals({**ours, **top})

    def plugin(type_, parameters):
        return changed(plugins=[p if p["type"] != type_ else {**p, "parameters": parameters} for p in ours["plugins"]])

    assert changed(metricsInterval="1s") == ['config: json: unknown field "metricsInterval"']
    assert changed(apiVersion="llm-d.ai/v1") != []
    assert changed(schedulingProfiles=[{"name": "default", "plugins": [{"pluginRef": "session-affinity"}]}]) == [
        "schedulingProfiles[default] references undefined plugin 'session-affinity'"]
    assert plugin("prefix-cache-scorer", {"prefixMatchInfoProducerName": "gpu-prefix"}) != []
    assert plugin("approx-prefix-cache-producer", {"autoTune": False, "blockSizeTokens": 0}) != []
    assert plugin("approx-prefix-cache-producer", {"lruCapacityPerServer": "8192"}) != []
    assert plugin("core-metrics-extractor", {**EXTRACTOR, "defaultEngine": "gemma"}) != []
    assert plugin("core-metrics-extractor", {**EXTRACTOR, "engineConfigs": [
        {**EXTRACTOR["engineConfigs"][0], "kvUsageSpec": "gemma kv"}]}) != []
    assert plugin("metrics-data-source", {"scheme": "grpc"}) != []
    # Stricter than the router, which would ignore them: a factory that never reads its parameters gets none.
    assert plugin("queue-scorer", {"weight": 2}) != []
    assert changed(plugins=[*ours["plugins"], {"type": "queue-scorer"}]) == [
        "plugins[6] (queue-scorer): duplicate plugin name 'queue-scorer'"]


# --------------------------------------------------------------------------------------------- scale to zero

ZERO = {"minReplicas": 0, "maxReplicas": 2, "target": 4, "wakeTimeoutSeconds": 900,
        "prometheus": {"serverAddress": "http://p:9090"}}


@pytest.mark.parametrize("release", ENDPOINT_PICKER_RELEASES)
def test_a_server_at_zero_gets_flow_control_holding_requests_for_the_wake_timeout(release):
    config = build_picker_config(with_release(release, autoscaling=ZERO))
    assert config["featureGates"] == ["flowControl"]
    assert config["flowControl"] == {"defaultRequestTTL": "900s"}
    assert "flowControl" not in build_picker_config(with_release(release, autoscaling={**ZERO, "minReplicas": 1}))


def test_llm_d_router_v0_10_loads_the_flow_control_config():
    config = build_picker_config(with_release(LLM_D_ROUTER_V0_10, autoscaling=ZERO))
    assert router.refusals(config) == [] and router.deprecations(config) == []
