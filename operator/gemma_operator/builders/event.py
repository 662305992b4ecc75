"""The core/v1 Event the operator posts about a GemmaRustServer (pure: the caller gives the time)."""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any

from ..spec import API_GROUP, API_VERSION, KIND
from .ownership import MANAGED_BY


def build_event(body: dict[str, Any], type_: str, reason: str, message: str, now: datetime,
                instance: str) -> dict[str, Any]:
    """A core/v1 Event about the custom resource `body`, posted by the operator (pure: the caller gives the
    time and the reporting instance).

    Args:
        body: the custom resource (apiVersion, kind, metadata name/namespace/uid).
        type_: Normal or Warning.
        reason: CamelCase reason.
        message: what happened (cut to the API's 1024 characters).
        now: when, in UTC.
        instance: reportingInstance (the operator pod's name).
    """
    meta = body["metadata"]
    micro = now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    digest = hashlib.sha1(f"{meta.get('uid')}{reason}{message}{micro}".encode()).hexdigest()[:10]
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{digest}", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": body.get("apiVersion", f"{API_GROUP}/{API_VERSION}"),
                           "kind": body.get("kind", KIND), "name": meta["name"],
                           "namespace": meta["namespace"], "uid": meta.get("uid")},
        "type": type_, "reason": reason, "message": message[:1024],
        "source": {"component": MANAGED_BY}, "reportingComponent": MANAGED_BY, "reportingInstance": instance,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }
