"""The endpoint picker's config (gemma_operator/builders/endpoint_picker.py): golden dicts, no cluster involved.
tests/operator/test_endpoint_picker_cluster.py starts the real picker with it."""

from __future__ import annotations

import yaml

from gemma_operator.builders.endpoint_picker import build_picker_config, build_picker_configmap

from .specs import LABELS, META, tpu_spec

GATEWAY = {"inferencePool": True, "endpointPicker": {"name": "epp"}}


def test_the_config_names_our_metrics_as_the_default_engine_and_sizes_the_prefix_index():
    spec = tpu_spec(gateway=GATEWAY, engine={"maxNumSeqs": 8, "context": 4096})
    config = build_picker_config(spec)
    assert (config["apiVersion"], config["kind"]) == ("inference.networking.x-k8s.io/v1alpha1", "EndpointPickerConfig")
    plugins = {p["type"]: p.get("parameters") for p in config["plugins"]}
    assert plugins["core-metrics-extractor"] == {
        "engineConfigs": [{"name": "gemma-rust", "queuedRequestsSpec": "gemma_num_requests_waiting",
                           "runningRequestsSpec": "gemma_num_requests_running",
                           "kvUsageSpec": "gemma_kv_cache_usage_perc"}],
        "defaultEngine": "gemma-rust"}
    assert plugins["metrics-data-source"] == {"scheme": "http", "path": "/metrics"}
    # 8 slots of 4096 tokens, in the picker's blocks of 16 tokens.
    assert plugins["prefix-cache-scorer"]["lruCapacityPerServer"] == 8 * 4096 // 16
    assert config["schedulingProfiles"] == [{"name": "default", "plugins": [
        {"pluginRef": "queue-scorer", "weight": 2.0}, {"pluginRef": "kv-cache-utilization-scorer", "weight": 2.0},
        {"pluginRef": "prefix-cache-scorer", "weight": 3.0}]}]
    referenced = {p["pluginRef"] for p in config["schedulingProfiles"][0]["plugins"]}
    referenced |= {s["pluginRef"] for s in config["dataLayer"]["sources"]}
    referenced |= {e["pluginRef"] for s in config["dataLayer"]["sources"] for e in s["extractors"]}
    assert referenced == set(plugins)


def test_the_configmap_holds_the_config_as_yaml_and_exists_only_with_the_pool():
    spec = tpu_spec(gateway=GATEWAY)
    cm = build_picker_configmap(spec, META)
    assert cm["metadata"] == {"name": "gemma-epp", "namespace": "serving", "labels": LABELS,
                              "annotations": {"gemmarust.dev/endpoint-picker-version": "v1.5.0"}}
    assert yaml.safe_load(cm["data"]["config.yaml"]) == build_picker_config(spec)
    assert build_picker_configmap(tpu_spec(), META) is None
