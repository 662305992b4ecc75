"""A strict schema of llm-d-router v0.10.0's EndpointPickerConfig, written from its source, to check the config
the operator writes without running the router: the Go module proxy does not serve github.com/llm-d/llm-d-router,
so the router cannot be built here as tests/cluster/build_binaries.sh builds GIE v1.5.0's picker.

`refusals(config)` lists what the router's loader would refuse at start (it then exits); `deprecations(config)`
the deprecation lines it would log. Each rule below names the file of llm-d/llm-d-router, tag v0.10.0, it is
written from:

- The document: apix/config/v1alpha1/endpointpickerconfig_types.go (`EndpointPickerConfig` and the types under it:
  their JSON keys and Go types), decoded by pkg/epp/config/loader/configloader.go `decodeRawConfig` with
  `serializer.EnableStrict`, which refuses an unknown key. The apiVersion is `llm-d.ai/v1alpha1`
  (apix/config/v1alpha1/zz_generated.register.go `GroupName`, doc.go) or the deprecated
  `inference.networking.x-k8s.io/v1alpha1` (configloader.go `deprecatedSchemeGroupVersion`, logged as
  DEPRECATION); the kind `EndpointPickerConfig`.
- Plugins: a plugin's name defaults to its type (pkg/epp/config/loader/defaults.go `applyStaticDefaults`), names
  are unique and a type must be registered (loader/validation.go `validatePlugins`); a profile's `pluginRef`
  must name a plugin (validation.go `validateSchedulingProfiles`), and so must a data layer source and its
  extractors (configloader.go `buildDataLayerConfig`).
- Parameters: every factory is handed `fwkplugin.StrictDecoder(spec.Parameters)` (configloader.go
  `instantiatePlugins`), a json.Decoder with DisallowUnknownFields (pkg/epp/framework/interface/plugin/
  registry.go), so a key its parameter struct lacks is an error, nested structs included. `PLUGINS` holds, for
  each type mirrored here, its stability as cmd/epp/runner/runner.go registers it (Alpha types need
  --allow-experimental-plugins: registry.go `ValidatePluginStability`), its role, its parameter struct and the
  checks its factory makes:
  - `metrics-data-source`: pkg/epp/framework/plugins/datalayer/source/metrics/datasource.go
    (`metricsDatasourceParams`; port 1-65535) and datalayer/source/http/datasource.go (`NewHTTPDataSource`: scheme
    http or https);
  - `core-metrics-extractor`: pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go
    (`modelServerExtractorParams`, `engineConfigParams`, `customMetricConfigParams`; an engine needs a name that is
    not `default`, and `defaultEngine`, `vllm` when unset, must be an engine, its own or a built-in one), metric
    specs as extractor/metrics/spec.go `parseStringToSpec` reads them;
  - `approx-prefix-cache-producer`: pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/
    types.go (`config`, `defaultConfig`) and plugin.go (`newDataProducer`: blockSizeTokens > 0 when autoTune is
    off, maxPrefixTokensToMatch >= 0);
  - `prefix-cache-scorer`: pkg/epp/framework/plugins/scheduling/scorer/prefix/plugin.go (`Config`; matchLengthWeight
    in [0, 1]); the producer it names must exist, because the data key it reads is then that producer's and
    pkg/epp/datalayer/data_graph.go `CreateMissingDataProducers` can create only the default one;
  - `queue-scorer`, `kv-cache-utilization-scorer`: scheduling/scorer/queuedepth/queue.go and
    scheduling/scorer/kvcacheutilization/kvcache_utilization.go, whose factories never read their parameters.

`FLAGS` are the command-line flags of the router's `epp` (pkg/epp/server/options.go `AddFlags`, with the logging
flags of pkg/common/observability/logging/options.go: `v` and controller-runtime's zap flags); `REFUSED_FLAGS` those
it exits on when given (options.go `Validate`, `deprecatedMetricFlags`).

Where this is stricter than the router it says so: keys must match exactly (Go's encoding/json also takes a key
that differs only in case); parameters given to a factory that never reads them are refused (the router would
ignore them silently); and a plugin type not mirrored here is refused as unmirrored, not passed unchecked.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

API_VERSION = "llm-d.ai/v1alpha1"
DEPRECATED_API_VERSION = "inference.networking.x-k8s.io/v1alpha1"
KIND = "EndpointPickerConfig"

# Go types as encoding/json decodes them. A JSON null leaves any Go field at its zero value, so it always decodes.
INT, FLOAT, BOOL, STR = "int", "float64", "bool", "string"
RAW = "json.RawMessage"            # taken as is (PluginSpec.Parameters; decoded later by the plugin's factory)
QUANTITY = "resource.Quantity"     # a string or a number
DURATION = "metav1.Duration"       # a string Go's time.ParseDuration reads

# apix/config/v1alpha1/endpointpickerconfig_types.go, JSON key -> Go type; a dict is a struct, a list a slice.
PLUGIN_REF = {"pluginRef": STR}
PRIORITY_BAND = {"priority": INT, "maxBytes": QUANTITY, "maxRequests": QUANTITY, "fairnessPolicyRef": STR,
                 "orderingPolicyRef": STR}
DOCUMENT = {
    "apiVersion": STR, "kind": STR,  # metav1.TypeMeta, inline
    "featureGates": [STR],
    "plugins": [{"name": STR, "type": STR, "parameters": RAW}],
    "schedulingProfiles": [{"name": STR, "plugins": [{"pluginRef": STR, "weight": FLOAT}]}],
    "dataLayer": {"injectDefaults": BOOL, "sources": [{"pluginRef": STR, "extractors": [PLUGIN_REF]}],
                  "discovery": PLUGIN_REF, "crossReplicaSyncerPluginRef": STR, "crossReplicaSyncInterval": DURATION},
    "flowControl": {"maxBytes": QUANTITY, "maxRequests": QUANTITY, "defaultRequestTTL": DURATION,
                    "defaultPriorityBand": PRIORITY_BAND, "defaultNegativePriorityBand": PRIORITY_BAND,
                    "priorityBands": [PRIORITY_BAND], "usageLimitPolicyPluginRef": STR,
                    "saturationDetector": PLUGIN_REF, "enableEviction": BOOL},
    "requestHandler": {"parsers": [PLUGIN_REF]},
    "saturationDetector": PLUGIN_REF,  # deprecated: flowControl.saturationDetector
    "parser": PLUGIN_REF,              # deprecated: requestHandler.parsers
}

# extractor/metrics/factories.go
ENGINE_CONFIG = {"name": STR, "queuedRequestsSpec": STR, "runningRequestsSpec": STR, "kvUsageSpec": STR,
                 "loraSpec": STR, "cacheInfoSpec": STR, "cacheBlockSizeLabelName": STR, "cacheNumBlocksLabelName": STR,
                 "cacheBlockSizeSpec": STR, "cacheNumBlocksSpec": STR,
                 "customMetrics": [{"attributeKey": STR, "metricSpec": STR}]}
BUILT_IN_ENGINES = ("vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm", "triton")  # `defaultEngineConfigs`
METRIC_SPECS = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec", "cacheBlockSizeSpec",
                "cacheNumBlocksSpec")


class Plugin(NamedTuple):
    stability: str                        # as cmd/epp/runner/runner.go registers the type
    role: str                             # source, extractor, producer or scorer
    parameters: dict[str, Any] | None     # the factory's parameter struct; None: the factory never reads them
    defaults: dict[str, Any] = {}         # the factory's values for keys left out


PLUGINS = {
    "metrics-data-source": Plugin("Beta", "source", {
        "scheme": STR, "path": STR, "port": INT, "insecureSkipVerify": BOOL, "caCertPath": STR,
        "clientCertPath": STR, "clientKeyPath": STR, "interval": STR}, {"scheme": "http", "path": "/metrics"}),
    "core-metrics-extractor": Plugin("Beta", "extractor", {
        "engineLabelKey": STR, "defaultEngine": STR, "engineConfigs": [ENGINE_CONFIG]}),
    "approx-prefix-cache-producer": Plugin("Beta", "producer", {
        "autoTune": BOOL, "blockSizeTokens": INT, "blockSize": INT, "maxPrefixBlocksToMatch": INT,
        "maxPrefixTokensToMatch": INT, "lruCapacityPerServer": INT},
        {"autoTune": True, "blockSizeTokens": 16, "maxPrefixTokensToMatch": 131072}),
    "prefix-cache-scorer": Plugin("Beta", "scorer", {
        "prefixMatchInfoProducerName": STR, "matchLengthWeight": FLOAT, "matchLengthScaleTokens": INT},
        {"matchLengthWeight": 0.0, "matchLengthScaleTokens": 8192}),
    "queue-scorer": Plugin("Beta", "scorer", None),
    "kv-cache-utilization-scorer": Plugin("Beta", "scorer", None),
}

FLAGS = frozenset({
    "grpc-port", "ha-enable-leader-election", "drain-timeout", "grpc-max-recv-msg-size", "grpc-max-send-msg-size",
    "pool-group", "pool-namespace", "pool-name", "endpoint-selector", "endpoint-target-ports",
    "disable-endpoint-subset-filter", "emit-endpoint-scores", "refresh-metrics-interval",
    "refresh-prometheus-metrics-interval", "metrics-staleness-threshold", "total-queued-requests-metric",
    "total-running-requests-metric", "kv-cache-usage-percentage-metric", "lora-info-metric", "cache-info-metric",
    "tracing", "health-checking", "metrics-port", "grpc-health-port", "enable-pprof", "cert-path",
    "enable-cert-reload", "enable-grpc-stream-metrics", "secure-serving", "tls-min-version", "tls-cipher-suites",
    "metrics-endpoint-auth", "metrics-client-ca-file", "metrics-cert-dir", "config-file", "config-text",
    "allow-experimental-plugins",
    "v", "zap-devel", "zap-encoder", "zap-log-level", "zap-stacktrace-level", "zap-time-encoding",
})
REFUSED_FLAGS = frozenset({"total-queued-requests-metric", "total-running-requests-metric",
                           "kv-cache-usage-percentage-metric", "lora-info-metric", "cache-info-metric"})

# model.LegacyValidation (prometheus/common/model), which parseStringToSpec applies to names and label names.
METRIC_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
LABEL_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
GO_DURATION_RE = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)(\d+(\.\d*)?(ns|us|µs|ms|s|m|h))*$|^0$")


def decode(value: Any, kind: Any, where: str) -> list[str]:
    """Decode `value` into the Go type `kind` as a strict decoder does; the errors, each naming where."""
    if value is None:
        return []
    if isinstance(kind, dict):
        if not isinstance(value, dict):
            return [f"{where}: cannot unmarshal {type(value).__name__} into a struct"]
        errors = [f'{where}: json: unknown field "{key}"' for key in value if key not in kind]
        for key, sub in value.items():
            if key in kind:
                errors += decode(sub, kind[key], f"{where}.{key}")
        return errors
    if isinstance(kind, list):
        if not isinstance(value, list):
            return [f"{where}: cannot unmarshal {type(value).__name__} into a slice"]
        return [e for i, item in enumerate(value) for e in decode(item, kind[0], f"{where}[{i}]")]
    ok = {INT: isinstance(value, int) and not isinstance(value, bool),
          FLOAT: isinstance(value, (int, float)) and not isinstance(value, bool),
          BOOL: isinstance(value, bool),
          STR: isinstance(value, str),
          RAW: True,
          QUANTITY: isinstance(value, (str, int, float)) and not isinstance(value, bool),
          DURATION: isinstance(value, str) and bool(GO_DURATION_RE.match(value))}[kind]
    return [] if ok else [f"{where}: cannot unmarshal {value!r} into Go type {kind}"]


def metric_spec_errors(spec: str, where: str) -> list[str]:
    """extractor/metrics/spec.go `parseStringToSpec`: `name` or `name{label=value,...}`, "" for none."""
    if spec == "":
        return []
    m = re.match(r"^\s*(\S+?)\s*(?:\{([^}]*)\})?\s*$", spec)
    if not m or not METRIC_NAME_RE.match(m.group(1)):
        return [f"{where}: not a valid metric specification: {spec!r}"]
    for pair in filter(None, (p.strip() for p in (m.group(2) or "").split(","))):
        label = pair.split("=", 1)
        if len(label) != 2 or not LABEL_NAME_RE.match(label[0].strip()):
            return [f"{where}: invalid label pair {pair!r} in specification: {spec!r}"]
    return []


def factory_errors(type_: str, params: dict[str, Any], where: str, plugins: dict[str, str]) -> list[str]:
    """What the type's factory refuses among decoded parameters (`params`: the factory's defaults overlaid with
    the configured values); `plugins` maps each configured plugin's name to its type."""
    errors = []
    if type_ == "metrics-data-source":
        if params["scheme"] not in ("http", "https"):
            errors.append(f"{where}: unsupported scheme: {params['scheme']}")
        if params.get("port") is not None and not 1 <= params["port"] <= 65535:
            errors.append(f"{where}: invalid port {params['port']}: must be between 1 and 65535")
        if params.get("interval") and not GO_DURATION_RE.match(params["interval"]):
            errors.append(f"{where}: invalid interval {params['interval']!r}")
    elif type_ == "core-metrics-extractor":
        engines = params.get("engineConfigs") or []
        names = [e.get("name") or "" for e in engines]
        for i, engine in enumerate(engines):
            if not names[i]:
                errors.append(f"{where}.engineConfigs[{i}]: engine config name cannot be empty")
            elif names[i] == "default":
                errors.append(f'{where}.engineConfigs[{i}]: engine config name cannot be "default" (reserved)')
            for key in METRIC_SPECS:
                errors += metric_spec_errors(engine.get(key) or "", f"{where}.engineConfigs[{i}].{key}")
            for j, custom in enumerate(engine.get("customMetrics") or []):
                errors += metric_spec_errors(custom.get("metricSpec") or "",
                                             f"{where}.engineConfigs[{i}].customMetrics[{j}].metricSpec")
        for name in sorted({n for n in names if n and names.count(n) > 1}):
            errors.append(f'{where}: mapping for engine type "{name}" already exists')
        default = params.get("defaultEngine") or "vllm"
        if default not in set(names) | set(BUILT_IN_ENGINES):
            errors.append(f'{where}: defaultEngine "{default}" not found in engineConfigs')
    elif type_ == "approx-prefix-cache-producer":
        if not params["autoTune"] and (params["blockSizeTokens"] or 0) <= 0:
            errors.append(f"{where}: BlockSizeTokens must be > 0 when AutoTune is disabled")
        if (params["maxPrefixTokensToMatch"] or 0) < 0:
            errors.append(f"{where}: MaxPrefixTokensToMatch must be >= 0")
    elif type_ == "prefix-cache-scorer":
        weight = params["matchLengthWeight"] or 0.0
        if not 0.0 <= weight <= 1.0:
            errors.append(f"{where}: matchLengthWeight must be between 0.0 and 1.0, got {weight}")
        if weight > 0.0 and (params["matchLengthScaleTokens"] or 0) <= 0:
            errors.append(f"{where}: matchLengthScaleTokens must be greater than 0 when matchLengthWeight > 0")
        producer = params.get("prefixMatchInfoProducerName") or ""
        if producer and plugins.get(producer) != "approx-prefix-cache-producer":
            errors.append(f"{where}: prefixMatchInfoProducerName {producer!r} names no approx-prefix-cache-producer "
                          "of this config, and only the default producer is created by itself")
    return errors


def refusals(config: Any, *, allow_experimental_plugins: bool = False) -> list[str]:
    """What llm-d-router v0.10.0 refuses in `config` (a parsed EndpointPickerConfig) at start; [] when it loads.

    Args:
        config: the config as yaml.safe_load reads the ConfigMap's text.
        allow_experimental_plugins: the router's --allow-experimental-plugins flag.
    Returns:
        One line per refusal, naming where in the config.
    """
    if not isinstance(config, dict):
        return ["the config is not a YAML mapping"]
    errors = decode(config, DOCUMENT, "config")
    if config.get("apiVersion") not in (API_VERSION, DEPRECATED_API_VERSION) or config.get("kind") != KIND:
        errors.append(f"config: no kind {config.get('kind')!r} is registered for version {config.get('apiVersion')!r}"
                      f" (the loader knows {KIND} of {API_VERSION} and of {DEPRECATED_API_VERSION})")
    if errors:
        return errors  # the document did not decode: the loader stops here
    specs = config.get("plugins") or []
    named = {(p.get("name") or p["type"]): p["type"] for p in specs if p.get("type")}
    seen: set[str] = set()
    for i, p in enumerate(specs):
        type_, name = p.get("type") or "", p.get("name") or p.get("type") or ""
        where = f"plugins[{i}] ({name})"
        if not type_:
            errors.append(f"{where}: plugin '{name}' is missing a type")
            continue
        if name in seen:
            errors.append(f"{where}: duplicate plugin name '{name}'")
        seen.add(name)
        plugin = PLUGINS.get(type_)
        if plugin is None:
            errors.append(f"{where}: plugin type '{type_}' is not mirrored from llm-d-router v0.10.0 here "
                          "(add its parameter struct from its source to check it)")
            continue
        if plugin.stability == "Alpha" and not allow_experimental_plugins:
            errors.append(f"{where}: has Alpha stability level, but --allow-experimental-plugins is not set")
        given = p.get("parameters")
        if plugin.parameters is None:
            if given:
                errors.append(f"{where}: its factory never reads parameters, so {sorted(given)} would be ignored "
                              "(stricter than the router, which ignores them silently)")
            continue
        decoded = decode(given, plugin.parameters, f"{where}.parameters")
        errors += decoded
        if not decoded:
            errors += factory_errors(type_, {**plugin.defaults, **(given or {})}, f"{where}.parameters", named)
    for profile in config.get("schedulingProfiles") or []:
        for ref in profile.get("plugins") or []:
            if ref.get("pluginRef") not in named:
                errors.append(f"schedulingProfiles[{profile.get('name')}] references undefined plugin "
                              f"'{ref.get('pluginRef')}'")
    for i, source in enumerate((config.get("dataLayer") or {}).get("sources") or []):
        if PLUGINS.get(named.get(source.get("pluginRef"), ""), Plugin("", "", None)).role != "source":
            errors.append(f"dataLayer.sources[{i}]: the plugin {source.get('pluginRef')} is not a DataSource")
        for extractor in source.get("extractors") or []:
            if extractor.get("pluginRef") not in named:
                errors.append(f"dataLayer.sources[{i}]: the plugin {extractor.get('pluginRef')} is not registered")
    return errors


def deprecations(config: dict[str, Any]) -> list[str]:
    """The deprecation lines llm-d-router v0.10.0 logs for `config` while loading it (configloader.go
    `LoadRawConfig`, and the deprecated `blockSize` of the prefix producer: approximateprefix/plugin.go
    `ApproxPrefixCacheFactory`)."""
    out = []
    if config.get("apiVersion") == DEPRECATED_API_VERSION:
        out.append(f"apiVersion {DEPRECATED_API_VERSION}/{KIND} is deprecated; replacement {API_VERSION}/{KIND}")
    for key, replacement in (("saturationDetector", "flowControl.saturationDetector"),
                             ("parser", "requestHandler.parsers")):
        if config.get(key) is not None:
            out.append(f"top-level {key} is deprecated, use {replacement} instead")
    for p in config.get("plugins") or []:
        if p.get("type") == "approx-prefix-cache-producer" and ((p.get("parameters") or {}).get("blockSize") or 0) > 0:
            out.append("'blockSize' is deprecated; use 'blockSizeTokens' instead")
    return out
