"""Polls each server pod's boot report, `GET /v1/engine`, for the status: every `min_interval` while the pod
boots, and once when it is ready, for the model id it serves (`served_model_name`). /v1/engine needs no API
key (gemma_server's app.py), so this works with `spec.server.apiKeySecret` too, and the operator needs no
Secret.

A pod runs a tenant's code, so whatever it answers is untrusted, and no pod may stall or bloat the operator:
- every fetch has a total deadline (`FETCH_DEADLINE_SECONDS`, connect + headers + body: aiohttp's
  `ClientTimeout(total=)`), not a per-read timeout, so a pod that trickles one byte at a time costs that
  long and no longer;
- a reply is read up to `MAX_REPLY_BYTES` (64 KiB) and refused beyond, headers are capped too, and a
  compressed reply is refused (it could inflate far beyond its size);
- redirects are refused (a 3xx is a failed fetch) and no proxy from the environment is used, so the
  operator fetches nothing but the pod's own address;
- only the fields the status shows are kept, each bounded (`keep_engine_fields`, `served_model_of`), and
  the `failed` reason is redacted (`gemma_operator.redact`): a pod holds a few KiB of the operator's memory,
  whatever it sends.

Polling runs apart from the handlers: one asyncio loop in its own thread performs the fetches, on its own
schedule (each booting pod every `min_interval`), and `PodPoller.observe` (called by `sync`) only records
which pods a server has and returns the reports cached so far, without waiting. Each server has its own
cap on concurrent fetches, so one server's slow pods hold up none of another's. When a pod's report
reaches a new stage, `on_change(server)` is called (the handlers then refresh that server's status). A pod
that does not answer (not listening yet, a network policy, a kwok pod with a made-up IP) is retried later
with back-off; nothing here raises for a pod. A server's pods are polled until `forget(server)`, or until
no `observe` has named them for FORGET_AFTER_SECONDS.

Test-only override: a local control plane's pods (kwok) have no network, so tests point the poller at a
loopback HTTP server that serves the same JSON. When the operator runs with
GEMMA_OPERATOR_TEST_ENGINE_URLS=1, a pod annotated `gemmarust.dev/engine-url-for-tests: http://127.0.0.1:PORT`
is polled there instead of at its pod IP. Without that setting the annotation is ignored, so a user who can
set pod annotations cannot make the operator fetch arbitrary URLs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from typing import Any, Awaitable, Callable, NamedTuple

import aiohttp

from .pods import deleting, meta, ready, running_phase
from .redact import redact

TEST_URL_ANNOTATION = "gemmarust.dev/engine-url-for-tests"

FETCH_DEADLINE_SECONDS = 2.0
MAX_REPLY_BYTES = 64 * 1024
PER_SERVER_FETCHES = 4       # concurrent fetches of one server's pods
MAX_FETCHES = 64             # concurrent fetches in all
FORGET_AFTER_SECONDS = 600   # a pod not observed for this long is forgotten

# What is kept of a report (gemma_server's GET /v1/engine): bounds on each field.
MAX_NAME = 32        # stage names and statuses, device names
MAX_STAGES = 16
MAX_ENGINES = 64
MAX_MODEL_ID = 256


class Fetched(NamedTuple):
    doc: dict[str, Any] | None
    error: str  # why doc is None; "" when it is not


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


# ---------------------------------------------------------------------------------------------------------
# What is kept of a reply (pure)


def _text(value: Any, limit: int) -> str | None:
    return value[:limit] if isinstance(value, str) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31 else None


def keep_engine_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """The parts of a `/v1/engine` report that the status shows, each bounded; the rest is dropped.

    Kept: `stage`; `failed` (redacted, at most 1 KiB); `stages` (at most 16 of {stage, status, seconds});
    `engines` (at most 64 of {index, device, max_batch, active}, when the server runs several engines).
    """
    out: dict[str, Any] = {}
    if (stage := _text(doc.get("stage"), MAX_NAME)) is not None:
        out["stage"] = stage
    if isinstance(doc.get("failed"), str) and doc["failed"]:
        out["failed"] = redact(doc["failed"])
    stages = []
    for item in doc["stages"] if isinstance(doc.get("stages"), list) else []:
        if len(stages) == MAX_STAGES:
            break
        if isinstance(item, dict) and (name := _text(item.get("stage"), MAX_NAME)) is not None:
            entry: dict[str, Any] = {"stage": name, "status": _text(item.get("status"), MAX_NAME) or ""}
            seconds = item.get("seconds")
            if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds):
                entry["seconds"] = round(float(seconds), 3)
            stages.append(entry)
    if stages or "stages" in doc:
        out["stages"] = stages
    if isinstance(doc.get("engines"), list):
        engines = []
        for item in doc["engines"][:MAX_ENGINES]:
            if isinstance(item, dict) and _count(item.get("index")) is not None:
                engines.append({"index": item["index"], "device": _text(item.get("device"), MAX_NAME) or "",
                                "max_batch": _count(item.get("max_batch")) or 0,
                                "active": _count(item.get("active")) or 0})
        out["engines"] = engines
    return out


def served_model_of(doc: dict[str, Any]) -> str:
    """The model id a ready pod's `/v1/engine` report names (`served_model_name`, at most 256 characters), or
    "" when it names none."""
    return _text(doc.get("served_model_name"), MAX_MODEL_ID) or ""


# ---------------------------------------------------------------------------------------------------------
# One fetch (the only place bytes from a pod are read)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON a status can hold")


async def fetch_json(session: aiohttp.ClientSession, url: str, max_bytes: int = MAX_REPLY_BYTES) -> Fetched:
    """GET a JSON object from a pod, within the session's total deadline and `max_bytes`; never raises.

    Returns:
        Fetched(doc, ""), or Fetched(None, why) for a network failure, a deadline, a status other than 200
        (a redirect included), a compressed or oversized reply, or a body that is not a JSON object.
    """
    try:
        async with session.get(url, allow_redirects=False, headers={"Accept-Encoding": "identity"}) as resp:
            if 300 <= resp.status < 400:
                return Fetched(None, f"redirect refused (HTTP {resp.status})")
            if resp.status != 200:
                return Fetched(None, f"HTTP {resp.status}")
            if resp.headers.get("Content-Encoding", "identity") != "identity":
                return Fetched(None, "compressed reply refused")
            if (resp.content_length or 0) > max_bytes:
                return Fetched(None, f"reply over {max_bytes} bytes refused")
            body = bytearray()
            async for chunk in resp.content.iter_any():
                body += chunk
                if len(body) > max_bytes:
                    return Fetched(None, f"reply over {max_bytes} bytes refused")
        doc = json.loads(body, parse_constant=_refuse_constant)
    except asyncio.TimeoutError:
        return Fetched(None, f"no complete reply within {session.timeout.total:g} s")
    except (aiohttp.ClientError, OSError) as e:
        return Fetched(None, f"unreachable: {type(e).__name__}")
    except (ValueError, RecursionError):
        return Fetched(None, "reply is not JSON")
    if not isinstance(doc, dict):
        return Fetched(None, "reply is not a JSON object")
    return Fetched(doc, "")


def new_session(deadline: float = FETCH_DEADLINE_SECONDS, max_bytes: int = MAX_REPLY_BYTES) -> aiohttp.ClientSession:
    """The HTTP session for pods: a total deadline per request, small header limits, no decompression, no
    proxies from the environment, no connection kept to any pod. Call inside the event loop that uses it."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=deadline),
        connector=aiohttp.TCPConnector(limit=MAX_FETCHES, force_close=True),
        auto_decompress=False, trust_env=False, read_bufsize=max_bytes,
        max_line_size=4096, max_field_size=4096, max_headers=32)


# ---------------------------------------------------------------------------------------------------------
# The per-pod cache and the polling loop


class _Pod(NamedTuple):
    engine: dict[str, Any] | None  # last kept /v1/engine report
    served_model: str | None       # the model id a ready pod's report named
    error: str                     # why the last fetch failed ("" after a success)
    next_try: float
    failures: int
    last_seen: float


class _Target(NamedTuple):
    """A pod worth polling, as the last `observe` saw it."""

    uid: str
    base: str    # http://ip:port (or the test override)
    ready: bool  # a Ready pod is polled once, for its model id; a booting one until it is ready


class _Job(NamedTuple):
    uid: str
    url: str
    ready: bool


class Reports(NamedTuple):
    engine: dict[str, dict[str, Any]]  # pod name -> kept /v1/engine report
    served_models: dict[str, str]      # pod name -> the model id its ready report named
    errors: dict[str, str]             # pod name -> why its last fetch failed


Fetch = Callable[[aiohttp.ClientSession, str], Awaitable[Fetched]]


class PodPoller:
    """Per-pod report cache, filled by a polling loop in its own thread; `observe` never waits for a pod.

    Args:
        on_change: called with the server key (whatever `observe` was given) when a pod's report reached a
            new stage, failed differently, or named its model; it runs on the polling thread, so it must
            only hand the work off.
        allow_test_urls: honour the test-only URL annotation (GEMMA_OPERATOR_TEST_ENGINE_URLS).
        min_interval: seconds between two polls of the same booting pod.
        max_backoff: longest wait after repeated failures.
        deadline: total seconds per fetch.
        fetch: the fetch coroutine (tests may wrap `fetch_json`).
    """

    def __init__(self, on_change: Callable[[str], None] | None = None, *, allow_test_urls: bool = False,
                 min_interval: float = 1.0, max_backoff: float = 30.0, deadline: float = FETCH_DEADLINE_SECONDS,
                 fetch: Fetch = fetch_json):
        self.on_change, self.allow_test_urls = on_change, allow_test_urls
        self.min_interval, self.max_backoff, self.deadline, self.fetch = min_interval, max_backoff, deadline, fetch
        self._pods: dict[str, _Pod] = {}
        self._targets: dict[str, tuple[list[_Target], float]] = {}  # server -> (its pods, when observed)
        self._inflight: set[str] = set()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        # server -> (its fetch cap, fetches holding or waiting for it); used on the loop's thread only.
        self._limits: dict[str, tuple[asyncio.Semaphore, int]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pod-poller", daemon=True)
        self._thread.start()
        self._scheduler = asyncio.run_coroutine_threadsafe(self._schedule(), self._loop)

    def observe(self, server: str, pods: list[dict[str, Any]], port: int) -> Reports:
        """Start the fetches that are due for `pods` (not waiting for them) and return their cached reports.

        Args:
            server: a key for the pods' GemmaRustServer (e.g. "namespace/name"), for the concurrency cap and
                `on_change`.
            pods: the server's Pod objects.
            port: the server's HTTP port (spec.server.port).
        """
        now = time.monotonic()
        targets = [target for pod in pods if (target := self._target(pod, port))]
        with self._lock:
            self._targets[server] = (targets, now)
            jobs = self._due(targets, now)
            reports = self._reports(pods, now)
        for job in jobs:
            self._loop.call_soon_threadsafe(self._start, server, job)
        return reports

    def forget(self, server: str) -> None:
        """Stop polling `server`'s pods (it was deleted)."""
        with self._lock:
            self._targets.pop(server, None)

    def in_flight(self) -> frozenset[str]:
        """The uids of the pods being fetched now."""
        with self._lock:
            return frozenset(self._inflight)

    def close(self) -> None:
        """Stop the polling loop (fetches in flight are abandoned)."""
        async def shutdown() -> None:
            self._scheduler.cancel()
            for task in list(self._tasks):
                task.cancel()
            if self._session:
                await self._session.close()
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    # -- under the lock ---------------------------------------------------------------------------------

    def _target(self, pod: dict[str, Any], port: int) -> _Target | None:
        if deleting(pod) or not running_phase(pod):
            return None
        url = base_url(pod, port, self.allow_test_urls)
        return _Target(meta(pod).get("uid", ""), url, ready(pod)) if url else None

    def _due(self, targets: list[_Target], now: float) -> list[_Job]:
        """The fetches to start now for `targets`, marked in flight."""
        jobs = []
        for target in targets:
            seen = self._pods.get(target.uid)
            if target.uid in self._inflight or (seen and now < seen.next_try):
                continue
            if target.ready and seen and seen.served_model is not None:
                continue  # the served model does not change while the pod lives
            self._inflight.add(target.uid)
            jobs.append(_Job(target.uid, target.base + "/v1/engine", target.ready))
        return jobs

    def _prune(self, now: float) -> None:
        for uid in [u for u, p in self._pods.items() if now - p.last_seen > FORGET_AFTER_SECONDS]:
            del self._pods[uid]
        for server in [s for s, (_, seen) in self._targets.items() if now - seen > FORGET_AFTER_SECONDS]:
            del self._targets[server]

    def _reports(self, pods: list[dict[str, Any]], now: float) -> Reports:
        for pod in pods:
            uid = meta(pod).get("uid", "")
            if uid in self._pods:
                self._pods[uid] = self._pods[uid]._replace(last_seen=now)
        engine, served, errors = {}, {}, {}
        for pod in pods:
            seen, name = self._pods.get(meta(pod).get("uid", "")), meta(pod).get("name", "")
            if seen and seen.engine is not None:
                engine[name] = seen.engine
            if seen and seen.served_model is not None:
                served[name] = seen.served_model
            if seen and seen.error:
                errors[name] = seen.error
        return Reports(engine, served, errors)

    def _record(self, job: _Job, result: Fetched) -> bool:
        """Store one fetch's outcome; True when what the status shows of this pod changed."""
        now = time.monotonic()
        with self._lock:
            self._inflight.discard(job.uid)
            old = self._pods.get(job.uid) or _Pod(None, None, "", 0.0, 0, now)
            if result.doc is None:
                failures = old.failures + 1
                wait = min(self.max_backoff, self.min_interval * 2 ** min(failures, 6))
                new = old._replace(error=result.error, next_try=now + wait, failures=failures, last_seen=now)
            else:
                new = old._replace(engine=keep_engine_fields(result.doc), error="",
                                   next_try=now + self.min_interval, failures=0, last_seen=now)
                if job.ready:
                    new = new._replace(served_model=served_model_of(result.doc))
            self._pods[job.uid] = new
            return _milestones(new) != _milestones(old)

    # -- on the polling loop ----------------------------------------------------------------------------

    def _start(self, server: str, job: _Job) -> None:
        task = self._loop.create_task(self._poll(server, job))
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    async def _schedule(self) -> None:
        """Start the fetches that came due, every quarter of `min_interval` (at most 4 times a second)."""
        while True:
            await asyncio.sleep(max(self.min_interval / 4, 0.25))
            try:
                now = time.monotonic()
                with self._lock:
                    self._prune(now)
                    due = [(server, job) for server, (targets, _) in self._targets.items()
                           for job in self._due(targets, now)]
                for server, job in due:
                    self._start(server, job)
            except Exception:  # noqa: BLE001 - polling must outlive any one bad tick
                logging.getLogger(__name__).exception("pod poller tick failed")

    async def _poll(self, server: str, job: _Job) -> None:
        if self._session is None:
            self._session = new_session(self.deadline)
        limit, users = self._limits.get(server, (asyncio.Semaphore(PER_SERVER_FETCHES), 0))
        self._limits[server] = (limit, users + 1)
        try:
            async with limit:
                result = await self.fetch(self._session, job.url)
        except Exception as e:  # noqa: BLE001 - a fetch wrapper's bug must not leave the pod in flight forever
            result = Fetched(None, f"poll failed: {type(e).__name__}")
        finally:
            limit, users = self._limits[server]
            if users == 1:
                del self._limits[server]
            else:
                self._limits[server] = (limit, users - 1)
        if self._record(job, result) and self.on_change:
            self.on_change(server)


def _milestones(pod: _Pod) -> tuple[Any, ...]:
    """What of a pod's reports moves its phase or its status entry's shape: a change calls `on_change`.
    The running stage's seconds grow at every poll; the periodic resync shows those."""
    engine = pod.engine or {}
    return (engine.get("stage"), engine.get("failed"), len(engine.get("stages") or []),
            len(engine.get("engines") or []), pod.served_model, pod.error)
