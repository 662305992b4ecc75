"""Polls each server pod's own HTTP endpoints: `GET /v1/engine` while it boots, `GET /v1/models` once ready.

The operator calls `EnginePoller.poll(pods)` at every status refresh. A pod that does not answer (not
listening yet, network policy, a kwok pod with a made-up IP) is simply left without a report and retried
later with back-off; nothing here raises for an unreachable pod. The last report of each pod is kept, so a
ready pod still shows how long each boot stage took.

Test-only override: a local control plane's pods (kwok) have no network, so tests point the poller at a
loopback HTTP server that serves the same JSON. When the operator runs with
GEMMA_OPERATOR_TEST_ENGINE_URLS=1, a pod annotated `gemmarust.dev/engine-url-for-tests: http://127.0.0.1:PORT`
is polled there instead of at its pod IP. Without that setting the annotation is ignored, so a user who can
edit pod annotations cannot make the operator fetch arbitrary URLs.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

TEST_URL_ANNOTATION = "gemmarust.dev/engine-url-for-tests"
TEST_URL_SETTING = "GEMMA_OPERATOR_TEST_ENGINE_URLS"


def test_urls_allowed() -> bool:
    return os.environ.get(TEST_URL_SETTING, "") == "1"


def base_url(pod: dict[str, Any], port: int, allow_test_override: bool) -> str | None:
    """Where a pod's server answers (pure); None when the pod has no IP yet."""
    if allow_test_override:
        override = (pod.get("metadata", {}).get("annotations") or {}).get(TEST_URL_ANNOTATION)
        if override:
            return override.rstrip("/")
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"


def fetch_json(url: str, timeout: float) -> dict[str, Any] | None:
    """GET a JSON document; None on any network, HTTP or decoding failure."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - http only, built above
            if resp.status != 200:
                return None
            doc = json.loads(resp.read(1 << 20))
            return doc if isinstance(doc, dict) else None
    except (OSError, ValueError, urllib.error.URLError):
        return None


class _Seen(NamedTuple):
    engine: dict[str, Any] | None
    models: dict[str, Any] | None
    next_try: float
    failures: int
    last_seen: float


class Reports(NamedTuple):
    engine: dict[str, dict[str, Any]]  # pod name -> /v1/engine
    models: dict[str, dict[str, Any]]  # pod name -> /v1/models


class EnginePoller:
    """Per-pod report cache with back-off; safe to call from several handler threads.

    Args:
        timeout: seconds per HTTP request.
        min_interval: seconds between two polls of the same booting pod.
        max_backoff: longest wait after repeated failures.
        fetch: the HTTP GET function (tests may pass a recording wrapper).
    """

    def __init__(self, timeout: float = 1.0, min_interval: float = 1.0, max_backoff: float = 30.0,
                 fetch: Callable[[str, float], dict[str, Any] | None] = fetch_json):
        self.timeout, self.min_interval, self.max_backoff, self.fetch = timeout, min_interval, max_backoff, fetch
        self._seen: dict[str, _Seen] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="engine-poll")

    def poll(self, pods: list[dict[str, Any]], port: int) -> Reports:
        """Poll the pods that are due and return the latest report of each pod."""
        now = time.monotonic()
        allow = test_urls_allowed()
        jobs = []
        for pod in pods:
            uid = pod.get("metadata", {}).get("uid", "")
            st = pod.get("status") or {}
            if pod.get("metadata", {}).get("deletionTimestamp") or st.get("phase") != "Running":
                continue
            ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
            with self._lock:
                seen = self._seen.get(uid)
            if seen and now < seen.next_try:
                continue
            if ready and seen and seen.models:
                continue  # the served model does not change while the pod lives
            url = base_url(pod, port, allow)
            if url:
                jobs.append((uid, url + ("/v1/models" if ready else "/v1/engine"), ready))
        results = list(self._pool.map(lambda j: (j, self.fetch(j[1], self.timeout)), jobs))
        with self._lock:
            for (uid, _, ready), doc in results:
                old = self._seen.get(uid) or _Seen(None, None, 0.0, 0, now)
                if doc is None:
                    failures = old.failures + 1
                    wait = min(self.max_backoff, self.min_interval * 2 ** min(failures, 6))
                    self._seen[uid] = old._replace(next_try=now + wait, failures=failures, last_seen=now)
                elif ready:
                    self._seen[uid] = old._replace(models=doc, next_try=now + self.min_interval, failures=0,
                                                   last_seen=now)
                else:
                    self._seen[uid] = old._replace(engine=doc, next_try=now + self.min_interval, failures=0,
                                                   last_seen=now)
            for pod in pods:
                uid = pod.get("metadata", {}).get("uid", "")
                if uid in self._seen:
                    self._seen[uid] = self._seen[uid]._replace(last_seen=now)
            # Forget pods not seen for ten minutes.
            for uid in [u for u, v in self._seen.items() if now - v.last_seen > 600]:
                del self._seen[uid]
            engine, models = {}, {}
            for pod in pods:
                meta = pod.get("metadata", {})
                seen = self._seen.get(meta.get("uid", ""))
                if seen and seen.engine:
                    engine[meta.get("name", "")] = seen.engine
                if seen and seen.models:
                    models[meta.get("name", "")] = seen.models
        return Reports(engine, models)
