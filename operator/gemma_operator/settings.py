"""The operator's settings, each declared once: its environment variable, default and meaning.

`Settings.from_env()` reads them; the chart's Deployment sets the environment (values.yaml `operator.*`), and
operator/README.md lists them. The pattern is llama-cpp-python's settings classes
(`llama_cpp/server/settings.py`, 0.3): one typed field per setting, the parser derived from the fields.

Lists are comma-separated in the environment. An allowlist entry is a key, or a prefix ending in `*`;
`*` alone allows everything (see `allowed`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, NamedTuple
from urllib.parse import urlsplit

from .builders.ownership import KEDA_HTTP_SCALER
from .spec import ENDPOINT_PICKER_RELEASES


def _setting(env: str, default: Any, help: str) -> Any:
    return field(default=default, metadata={"env": env, "help": help})


@dataclass(frozen=True)
class Settings:
    resync_seconds: float = _setting(
        "GEMMA_OPERATOR_RESYNC_SECONDS", 15.0,
        "Period of the level-based resync of every GemmaRustServer (children put back, status refreshed).")
    workers: int = _setting("GEMMA_OPERATOR_WORKERS", 8, "kopf handler threads.")
    discovery_ttl_seconds: float = _setting(
        "GEMMA_OPERATOR_DISCOVERY_TTL_SECONDS", 60.0,
        "How long the presence of the optional monitoring CRDs is cached.")
    allowed_pod_annotations: tuple[str, ...] = _setting(
        "GEMMA_OPERATOR_ALLOWED_POD_ANNOTATIONS",
        ("gke-gcsfuse/*", "cluster-autoscaler.kubernetes.io/safe-to-evict"),
        "spec.podAnnotations keys the operator passes to pods; any other key is refused "
        "(condition PodAnnotationNotAllowed).")
    allowed_tolerations: tuple[str, ...] = _setting(
        "GEMMA_OPERATOR_ALLOWED_TOLERATIONS", (),
        "Taint keys the pods may tolerate: spec.tolerations, and the spot taint cloud.google.com/gke-spot that "
        "spec.accelerator.provisioning spot adds; any other toleration, and one without a key, is refused "
        "(condition TolerationNotAllowed). The TPU taint google.com/tpu needs no entry.")
    allowed_extended_resources: tuple[str, ...] = _setting(
        "GEMMA_OPERATOR_ALLOWED_EXTENDED_RESOURCES", ("google.com/tpu",),
        "Extended resources the pods may request or be limited to (spec.resources, and google.com/tpu, which the "
        "operator sets from spec.accelerator); any other resource than cpu, memory, ephemeral-storage and "
        "hugepages-* is refused (condition ExtendedResourceNotAllowed).")
    allowed_prometheus_addresses: tuple[str, ...] = _setting(
        "GEMMA_OPERATOR_ALLOWED_PROMETHEUS_ADDRESSES", (),
        "Prometheus HTTP API base URLs that spec.autoscaling.prometheus.serverAddress may name: an address is "
        "allowed when its scheme, host and port equal an entry's and its path is the entry's or below it (`*`: "
        "any). Empty: none, so KEDA's ScaledObject is refused (condition PrometheusAddressNotAllowed) until an "
        "administrator names the cluster's Prometheus.")
    cluster_name: str = _setting(
        "GEMMA_OPERATOR_CLUSTER_NAME", "",
        "This cluster's name as Managed Service for Prometheus labels its series (`cluster`): the default of "
        "spec.autoscaling.prometheus.cluster, so KEDA's query selects only this cluster's pods. Empty: none.")
    keda_http_scaler: str = _setting(
        "GEMMA_OPERATOR_KEDA_HTTP_SCALER", KEDA_HTTP_SCALER,
        "host:port of the KEDA HTTP add-on's external scaler, which the ScaledObject of a server scaling to zero "
        "(spec.autoscaling.minReplicas 0) asks for the requests its interceptor holds. The default is where the "
        "add-on's own manifests and Helm chart put it, in namespace keda.")
    endpoint_picker: str = _setting(
        "GEMMA_OPERATOR_ENDPOINT_PICKER", ENDPOINT_PICKER_RELEASES[0],
        "The endpoint picker release the operator writes each InferencePool's picker config for (ConfigMap "
        "<name>-epp), as project/tag: " + " or ".join(ENDPOINT_PICKER_RELEASES) + ". The default of "
        "spec.gateway.endpointPicker.release; another release is reported per server (condition "
        "UnsupportedEndpointPicker) and gets no config.")
    test_engine_urls: bool = _setting(
        "GEMMA_OPERATOR_TEST_ENGINE_URLS", False,
        "Tests only: honour the pod annotation gemmarust.dev/engine-url-for-tests (poll a loopback URL).")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Read every setting from `environ` (default: os.environ); unset ones keep their default.

        Raises:
            ValueError: a variable does not parse as its type; the message names the variable.
        """
        environ = os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            raw = environ.get(f.metadata["env"])
            if raw is None:
                continue
            try:
                values[f.name] = _parse(type(f.default), raw)
            except ValueError as e:
                raise ValueError(f"{f.metadata['env']}={raw!r}: {e}") from None
        return cls(**values)


def _parse(kind: type, raw: str) -> Any:
    if kind is bool:
        if raw not in ("0", "1", "true", "false"):
            raise ValueError("expected 1 or 0")
        return raw in ("1", "true")
    if kind is tuple:
        return tuple(item.strip() for item in raw.split(",") if item.strip())
    return kind(raw)


def allowed(key: str, patterns: tuple[str, ...]) -> bool:
    """Whether `key` matches an allowlist: an exact entry, or an entry `prefix*` that it starts with."""
    return any(key == p or (p.endswith("*") and key.startswith(p[:-1])) for p in patterns)


class _Address(NamedTuple):
    scheme: str
    host: str
    port: int
    path: str  # without a trailing slash


def _address(url: str) -> _Address | None:
    """`url` split for comparison, or None when it is not a plain http(s) URL: user info (`user@host`, which
    would let `http://allowed@other` pass a text prefix), a query, a fragment, percent-escapes, backslashes,
    or `.`/`..` path segments (which a server may resolve outside the allowed path) are refused."""
    if any(c in url for c in "@?#%\\") or any(c.isspace() for c in url):
        return None
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None
    path = parts.path.rstrip("/")
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None or \
            any(segment in (".", "..") for segment in path.split("/")):
        return None
    return _Address(parts.scheme, parts.hostname.lower(), port, path)


def allowed_address(url: str, entries: tuple[str, ...]) -> bool:
    """Whether `url` is under an allowlist of URL prefixes: the same scheme, host and port as an entry, and the
    entry's path or one below it (`http://prom.monitoring.svc:9090` allows `http://prom.monitoring.svc:9090/x`,
    not `http://prom.monitoring.svc:9091` nor `http://prom.monitoring.svc:9090.evil.example`); `*` allows any."""
    if "*" in entries:
        return True
    got = _address(url)
    if got is None:
        return False
    for entry in entries:
        want = _address(entry)
        if want and got[:3] == want[:3] and (got.path == want.path or got.path.startswith(want.path + "/")):
            return True
    return False


def describe() -> list[tuple[str, str, str]]:
    """(environment variable, default as set in the environment, help) of every setting, for docs and tests."""
    out = []
    for f in fields(Settings):
        default = ",".join(f.default) if isinstance(f.default, tuple) else (
            ("1" if f.default else "0") if isinstance(f.default, bool) else str(f.default))
        out.append((f.metadata["env"], default, f.metadata["help"]))
    return out
