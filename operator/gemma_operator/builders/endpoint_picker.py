"""What the endpoint picker needs to route to a GemmaRustServer's pods: its EndpointPickerConfig, in a ConfigMap
beside the InferencePool (pure), in the format of the picker release it is for.

The picker is the user's Deployment (charts/gemma-rust-operator/examples/endpoint-picker.yaml for llm-d-router,
endpoint-picker-gie-v1.5.0.yaml beside it for GIE v1.5.0) and reads this config once, at start, with
`--config-file`. The release is spec.gateway.endpointPicker.release, which the operator's
GEMMA_OPERATOR_ENDPOINT_PICKER fills when unset (handlers.with_defaults); `RELEASE_CONFIGS` lists those written
here. gateway-api-inference-extension (GIE) deleted its picker and EndpointPickerConfig in v1.6.0; the picker
lives on in llm-d/llm-d-router.

Both configs read our metrics through an engine of the `core-metrics-extractor` plugin (`engineConfigs`,
`defaultEngine`: GIE v1.5.0 and llm-d-router v0.10.0, pkg/epp/framework/plugins/datalayer/extractor/metrics/
factories.go). It is also the default engine, so every pod of the pool is read as a gemma-rust server without a
pod label (llm-d-router's label key is `llm-d.ai/engine-type`, extractor/metrics/mapping_registry.go). The scorers
and weights are the releases' own defaults (pkg/epp/config/loader/defaults.go `loadDefaultConfig`: queue 2,
KV-cache utilisation 2, prefix cache 3), with the prefix index sized to what a server can hold: the engine keeps
each finished slot's tokens (a whole context per slot), so one server holds at most slots x context tokens of
reusable prefix.

GIE v1.5.0 (`gateway-api-inference-extension/v1.5.0`): apiVersion inference.networking.x-k8s.io/v1alpha1; the
prefix index parameters ride on `prefix-cache-scorer`, whose own factory ignores them
(pkg/epp/framework/plugins/scheduling/scorer/prefix/plugin.go) and whose loader hands them to the
`approx-prefix-cache-producer` it creates for the scorer (pkg/epp/config/loader/configloader.go
`instantiatePlugins`). It is the first GIE release whose picker refuses the metric flags of v1.2-v1.4
(pkg/epp/server/options.go, "flag ... is deprecated and cannot be used").

llm-d-router v0.10.0 (`llm-d-router/v0.10.0`, the default), each name checked against its source:
- apiVersion llm-d.ai/v1alpha1 (apix/config/v1alpha1/zz_generated.register.go `GroupName`); the GIE group still
  loads, with a DEPRECATION line (pkg/epp/config/loader/configloader.go `deprecatedSchemeGroupVersion`);
- every plugin's parameters go through a decoder that refuses unknown keys (pkg/epp/framework/interface/plugin/
  registry.go `StrictDecoder`: DisallowUnknownFields), so the GIE v1.5.0 shape, prefix parameters on
  `prefix-cache-scorer`, stops the router at start;
- the prefix index is an `approx-prefix-cache-producer` (pkg/epp/framework/plugins/requestcontrol/dataproducer/
  approximateprefix/types.go `config`: `autoTune`, `blockSizeTokens`, `maxPrefixTokensToMatch`,
  `lruCapacityPerServer`), and `prefix-cache-scorer` names it with `prefixMatchInfoProducerName`
  (scheduling/scorer/prefix/plugin.go `Config`). The producer keeps its default name, its type: the data key
  it writes is then the default one that other plugins read (RELEASE-NOTES.md, v0.9.0). Its blocks are at
  least 64 tokens: a smaller `blockSizeTokens` is raised to 64 at request time (approximateprefix/plugin.go
  `minBlockSizeTokens`, `GetBlockSize`), so the index is sized in 64-token blocks. The tokens are those of the
  tokenizer-free `estimate` backend the router creates for the producer, 4 bytes each (dataproducer/tokenizer/
  estimate.go `bytesPerToken`), about one Gemma token of English text. `autoTune` stays off, as in the GIE
  config: the index is sized here from the spec, and our engine config names no `cacheInfoSpec` to tune from;
- `metrics-data-source` (datalayer/source/metrics/datasource.go `metricsDatasourceParams`), and the types'
  stability, all Beta, so no `--allow-experimental-plugins` (cmd/epp/runner/runner.go).
tests/operator/llm_d_router_v0_10_config.py holds the same rules as a schema, and checks this config with it.
"""

from __future__ import annotations

from typing import Any, Callable

import yaml

from ..spec import ENDPOINT_PICKER_RELEASES, GIE_V1_5, LLM_D_ROUTER_V0_10, GemmaRustServerSpec
from .autoscaler import Autoscaling, chosen_where_all_served
from .ownership import Meta, child_object

VERSION_ANNOTATION = "gemmarust.dev/endpoint-picker-version"  # on the ConfigMap: the picker release it is for
CONFIG_KEY = "config.yaml"
ENGINE = "gemma-rust"
KIND = "EndpointPickerConfig"

# The server's gauges (gemma_server/metrics.py) in the roles the picker reads.
QUEUED_METRIC = "gemma_num_requests_waiting"
RUNNING_METRIC = "gemma_num_requests_running"
KV_USAGE_METRIC = "gemma_kv_cache_usage_perc"

SCORER_WEIGHTS = {"queue-scorer": 2.0, "kv-cache-utilization-scorer": 2.0, "prefix-cache-scorer": 3.0}
PREFIX_PRODUCER = "approx-prefix-cache-producer"

# GIE v1.5.0 hashes prompts in blocks of this many tokens (its default, approximateprefix/types.go) and matches
# up to GIE_MAX_PREFIX_BLOCKS of them.
GIE_PREFIX_BLOCK_TOKENS = 16
GIE_MAX_PREFIX_BLOCKS = 256
# llm-d-router v0.10.0's smallest block (approximateprefix/plugin.go `minBlockSizeTokens`).
LLM_D_PREFIX_BLOCK_TOKENS = 64


def picker_config_name(meta: Meta) -> str:
    """The ConfigMap holding the picker's config; the example picker Deployments mount it by this name."""
    return f"{meta.name}-epp"


def picker_release(spec: GemmaRustServerSpec) -> str | None:
    """The picker release the config is written for: spec.gateway.endpointPicker.release, else the default
    release; None without an InferencePool (no picker, no config)."""
    picker = spec.gateway.endpoint_picker
    if not spec.gateway.inference_pool or picker is None:
        return None
    return picker.release or ENDPOINT_PICKER_RELEASES[0]


def prefix_index_blocks(spec: GemmaRustServerSpec, block_tokens: int) -> int:
    """Entries of the picker's prefix index per server: the prefix blocks one server can hold."""
    return spec.engine.max_num_seqs * spec.engine.context // block_tokens


def _metrics_plugins() -> list[dict[str, Any]]:
    extractor = {"engineConfigs": [{"name": ENGINE, "queuedRequestsSpec": QUEUED_METRIC,
                                    "runningRequestsSpec": RUNNING_METRIC, "kvUsageSpec": KV_USAGE_METRIC}],
                 "defaultEngine": ENGINE}
    return [{"type": "metrics-data-source", "parameters": {"scheme": "http", "path": "/metrics"}},
            {"type": "core-metrics-extractor", "parameters": extractor}]


def _profiles_and_data_layer() -> dict[str, Any]:
    return {
        "schedulingProfiles": [{"name": "default", "plugins": [
            {"pluginRef": name, "weight": weight} for name, weight in SCORER_WEIGHTS.items()]}],
        "dataLayer": {"sources": [{"pluginRef": "metrics-data-source",
                                   "extractors": [{"pluginRef": "core-metrics-extractor"}]}]},
    }


def _flow_control(spec: GemmaRustServerSpec, scaling: Autoscaling) -> dict[str, Any]:
    """For a server that scales to zero (the autoscaler chosen, `scaling`), the picker's flow control, in the same
    keys in both releases: it queues a request while the pool has no ready pod and dispatches it when one turns
    ready (GIE v1.5.0 pkg/epp/flowcontrol/contracts/dependencies.go, "Scale-from-Zero"; the feature gate
    `flowControl`, pkg/epp/flowcontrol/config.go), for up to wakeTimeoutSeconds (`defaultRequestTTL`). Its queue
    gauge wakes the server (builders.autoscaling)."""
    if not scaling.scales_to_zero:
        return {}
    return {"featureGates": ["flowControl"],
            "flowControl": {"defaultRequestTTL": f"{spec.autoscaling.wake_timeout_seconds}s"}}


def build_gie_v1_5_config(spec: GemmaRustServerSpec) -> dict[str, Any]:
    """GIE v1.5.0's EndpointPickerConfig (inference.networking.x-k8s.io/v1alpha1) for this server's pool."""
    prefix = {"blockSizeTokens": GIE_PREFIX_BLOCK_TOKENS, "maxPrefixBlocksToMatch": GIE_MAX_PREFIX_BLOCKS,
              "lruCapacityPerServer": prefix_index_blocks(spec, GIE_PREFIX_BLOCK_TOKENS), "autoTune": False}
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1", "kind": KIND,
        "plugins": [
            *_metrics_plugins(),
            *({"type": name, **({"parameters": prefix} if name == "prefix-cache-scorer" else {})}
              for name in SCORER_WEIGHTS),
        ],
        **_profiles_and_data_layer(),
    }


def build_llm_d_router_v0_10_config(spec: GemmaRustServerSpec) -> dict[str, Any]:
    """llm-d-router v0.10.0's EndpointPickerConfig (llm-d.ai/v1alpha1) for this server's pool: the prefix index
    on its producer, which the prefix scorer names; a prompt is matched up to the server's whole context."""
    producer = {"blockSizeTokens": LLM_D_PREFIX_BLOCK_TOKENS, "maxPrefixTokensToMatch": spec.engine.context,
                "lruCapacityPerServer": prefix_index_blocks(spec, LLM_D_PREFIX_BLOCK_TOKENS), "autoTune": False}
    scorers = {"prefix-cache-scorer": {"prefixMatchInfoProducerName": PREFIX_PRODUCER}}
    return {
        "apiVersion": "llm-d.ai/v1alpha1", "kind": KIND,
        "plugins": [
            *_metrics_plugins(),
            {"type": PREFIX_PRODUCER, "parameters": producer},
            *({"type": name, **({"parameters": scorers[name]} if name in scorers else {})}
              for name in SCORER_WEIGHTS),
        ],
        **_profiles_and_data_layer(),
    }


# The releases the operator writes a config for (spec.ENDPOINT_PICKER_RELEASES), each with its builder.
RELEASE_CONFIGS: dict[str, Callable[[GemmaRustServerSpec], dict[str, Any]]] = {
    LLM_D_ROUTER_V0_10: build_llm_d_router_v0_10_config,
    GIE_V1_5: build_gie_v1_5_config,
}


def build_picker_config(spec: GemmaRustServerSpec, scaling: Autoscaling | None = None) -> dict[str, Any] | None:
    """The EndpointPickerConfig for this server's pool in its picker release's format, with flow control where
    the autoscaler chosen (`scaling`, builders.autoscaler.choose; by default the one a cluster that serves every
    optional kind gives) takes the server to zero; None without a pool or for a release the operator writes no
    config for."""
    builder = RELEASE_CONFIGS.get(picker_release(spec) or "")
    if builder is None:
        return None
    return {**builder(spec), **_flow_control(spec, scaling or chosen_where_all_served(spec))}


def build_picker_configmap(spec: GemmaRustServerSpec, meta: Meta,
                           scaling: Autoscaling | None = None) -> dict[str, Any] | None:
    """The ConfigMap `<name>-epp` with the picker's config under `config.yaml` (build_picker_config), annotated
    with the release it is for, while the spec asks for an InferencePool and names a release the operator writes
    a config for."""
    config = build_picker_config(spec, scaling)
    if config is None:
        return None
    obj = child_object("v1", "ConfigMap", picker_config_name(meta), meta)
    obj["metadata"]["annotations"] = {VERSION_ANNOTATION: picker_release(spec)}
    obj["data"] = {CONFIG_KEY: yaml.safe_dump(config, sort_keys=False)}
    return obj
