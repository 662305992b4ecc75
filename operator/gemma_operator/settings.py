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
from typing import Any, Mapping


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
        "Taint keys that spec.tolerations may tolerate; any other toleration, and one without a key, is "
        "refused (condition TolerationNotAllowed).")
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


def describe() -> list[tuple[str, str, str]]:
    """(environment variable, default as set in the environment, help) of every setting, for docs and tests."""
    out = []
    for f in fields(Settings):
        default = ",".join(f.default) if isinstance(f.default, tuple) else (
            ("1" if f.default else "0") if isinstance(f.default, bool) else str(f.default))
        out.append((f.metadata["env"], default, f.metadata["help"]))
    return out
