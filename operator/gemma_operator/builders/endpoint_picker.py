"""What the Gateway API inference extension's endpoint picker needs to route to a GemmaRustServer's pods: its
EndpointPickerConfig, in a ConfigMap beside the InferencePool (pure).

The picker is the user's Deployment (charts/gemma-rust-operator/examples/endpoint-picker.yaml) and reads this
config at start with `--config-file`. The format is gateway-api-inference-extension v1.5.0's
(apix/config/v1alpha1/endpointpickerconfig_types.go), the first release whose picker refuses the metric flags
of v1.2-v1.4 (`--total-queued-requests-metric` and the rest: pkg/epp/server/options.go, "flag ... is deprecated
and cannot be used"); llm-d-router, where the picker moved after v1.6.0, reads the same format.

Our metric names reach the picker as an engine of its `core-metrics-extractor` plugin
(pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go: `engineConfigs`, `defaultEngine`), so
every pod of the pool is read as a gemma-rust server without a pod label. The scorers and weights are the
release's own defaults (pkg/epp/config/loader/defaults.go: queue 2, KV-cache utilisation 2, prefix cache 3),
with the prefix-cache index sized to what a server can hold: the engine keeps each finished slot's tokens
(a whole context per slot), so one server holds at most slots x context tokens of reusable prefix.
"""

from __future__ import annotations

from typing import Any

import yaml

from ..spec import GemmaRustServerSpec
from .ownership import Meta, child_object

PICKER_VERSION = "v1.5.0"  # gateway-api-inference-extension release the config is written for
VERSION_ANNOTATION = "gemmarust.dev/endpoint-picker-version"  # on the ConfigMap: the picker release it is for
CONFIG_KEY = "config.yaml"
ENGINE = "gemma-rust"

# The server's gauges (gemma_server/metrics.py) in the roles the picker reads.
QUEUED_METRIC = "gemma_num_requests_waiting"
RUNNING_METRIC = "gemma_num_requests_running"
KV_USAGE_METRIC = "gemma_kv_cache_usage_perc"

# The picker hashes prompts in blocks of this many tokens (its default, approximateprefix/types.go) and
# matches up to MAX_PREFIX_BLOCKS of them.
PREFIX_BLOCK_TOKENS = 16
MAX_PREFIX_BLOCKS = 256
SCORER_WEIGHTS = {"queue-scorer": 2.0, "kv-cache-utilization-scorer": 2.0, "prefix-cache-scorer": 3.0}


def picker_config_name(meta: Meta) -> str:
    """The ConfigMap holding the picker's config; the example picker Deployment mounts it by this name."""
    return f"{meta.name}-epp"


def prefix_index_blocks(spec: GemmaRustServerSpec) -> int:
    """Entries of the picker's prefix index per server: the prefix blocks one server can hold."""
    return spec.engine.max_num_seqs * spec.engine.context // PREFIX_BLOCK_TOKENS


def build_picker_config(spec: GemmaRustServerSpec) -> dict[str, Any]:
    """The EndpointPickerConfig (inference.networking.x-k8s.io/v1alpha1) for this server's pool."""
    prefix = {"blockSizeTokens": PREFIX_BLOCK_TOKENS, "maxPrefixBlocksToMatch": MAX_PREFIX_BLOCKS,
              "lruCapacityPerServer": prefix_index_blocks(spec), "autoTune": False}
    extractor = {"engineConfigs": [{"name": ENGINE, "queuedRequestsSpec": QUEUED_METRIC,
                                    "runningRequestsSpec": RUNNING_METRIC, "kvUsageSpec": KV_USAGE_METRIC}],
                 "defaultEngine": ENGINE}
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1", "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "metrics-data-source", "parameters": {"scheme": "http", "path": "/metrics"}},
            {"type": "core-metrics-extractor", "parameters": extractor},
            *({"type": name, **({"parameters": prefix} if name == "prefix-cache-scorer" else {})}
              for name in SCORER_WEIGHTS),
        ],
        "schedulingProfiles": [{"name": "default", "plugins": [
            {"pluginRef": name, "weight": weight} for name, weight in SCORER_WEIGHTS.items()]}],
        "dataLayer": {"sources": [{"pluginRef": "metrics-data-source",
                                   "extractors": [{"pluginRef": "core-metrics-extractor"}]}]},
    }


def build_picker_configmap(spec: GemmaRustServerSpec, meta: Meta) -> dict[str, Any] | None:
    """The ConfigMap `<name>-epp` with the picker's config under `config.yaml`, while the spec asks for an
    InferencePool."""
    if not spec.gateway.inference_pool:
        return None
    obj = child_object("v1", "ConfigMap", picker_config_name(meta), meta)
    obj["metadata"]["annotations"] = {VERSION_ANNOTATION: PICKER_VERSION}
    obj["data"] = {CONFIG_KEY: yaml.safe_dump(build_picker_config(spec), sort_keys=False)}
    return obj
