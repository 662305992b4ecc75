"""kopf handlers: the operator's event loop. Run with

    kopf run --standalone --all-namespaces -m gemma_operator.handlers

Every handler funnels into `sync`, which has the same shape each time (kopf's examples/02-children,
dask-kubernetes' controller):

    parse spec -> check problems -> build children (pure) -> adopt -> server-side apply -> observe pods
    and the Events of those still starting -> read the cached /v1/engine reports
    -> compute status (pure) -> patch status -> post transition Events

Triggers:
- create / update / resume of a GemmaRustServer: full sync, and children the spec no longer asks for
  (PodDisruptionBudget at one replica, an optional object of builders.OPTIONAL_KINDS turned off) are
  deleted;
- a resync pass every GEMMA_OPERATOR_RESYNC_SECONDS (default 15) over every GemmaRustServer: full sync,
  which also puts back a child deleted or edited by hand (server-side apply with forced conflicts) and
  polls booting pods. It is a plain thread, not a kopf timer, so no finalizer is needed: a
  GemmaRustServer can be deleted while the operator is not running (garbage collection takes the
  children through their owner references);
- events of the Deployments and Pods the operator owns: a deleted Deployment or Service is re-applied at
  once; any other change refreshes the status, so `kubectl get grs` follows pods without waiting;
- a pod's report changing stage (the poller, `gemma_operator.poller`, polls pods apart from `sync` and
  never makes it wait): the status is refreshed.

The operator never crash-loops on a custom resource: a spec it cannot act on becomes a condition with a
reason (Problem); only transient API trouble raises `kopf.TemporaryError`, which kopf retries.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import kopf
import pydantic

from . import builders, events, status
from .admission import allowlist_problems
from .kube import ApiError, Kube
from .poller import PodPoller
from .settings import Settings
from .spec import API_GROUP, API_VERSION, AUTOSCALING_METRICS, KNOWN_ACCELERATORS, PLURAL, GemmaRustServerSpec, \
    accelerator_text, parse_spec

GRS = (API_GROUP, API_VERSION, PLURAL)
CHILD_LABELS = {builders.LABEL_MANAGED_BY: builders.MANAGED_BY}

_state: dict[str, Any] = {}
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()
_written: dict[str, dict[str, Any]] = {}  # uid -> last status written (we are its only writer)
_known: dict[str, tuple[str, str]] = {}  # uid -> (namespace, name) of every GemmaRustServer seen


def settings() -> Settings:
    if "settings" not in _state:
        _state["settings"] = Settings.from_env()
    return _state["settings"]


def kube() -> Kube:
    if "kube" not in _state:
        _state["kube"] = Kube(discovery_ttl=settings().discovery_ttl_seconds)
    return _state["kube"]


def poller() -> PodPoller:
    if "poller" not in _state:
        _state["poller"] = PodPoller(on_change=_report_changed, allow_test_urls=settings().test_engine_urls)
    return _state["poller"]


def _lock(uid: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(uid, threading.Lock())


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    """Operator settings: our own finalizer and annotation names, no CRD scanning (less RBAC)."""
    ours = _state["settings"] = Settings.from_env()
    # No handler needs a finalizer (no timers/daemons, no blocking delete handler); should one ever be
    # added, it gets our name.
    settings.persistence.finalizer = "gemmarust.dev/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="gemmarust.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="gemmarust.dev", key="last-handled-configuration")
    # The CRD is installed before the operator; watching CRDs and namespaces would need more RBAC.
    settings.scanning.disabled = True
    # kopf's own per-handler Events would duplicate ours; keep warnings and errors.
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = ours.workers
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    _state["logger"] = logger
    kube()
    poller()
    # Level-based resync in a plain thread rather than a kopf timer: kopf timers need a finalizer on every
    # object, which would leave GemmaRustServers undeletable whenever the operator is not running.
    stop = _state["stop"] = threading.Event()
    threading.Thread(target=_resync_loop, args=(stop, ours.resync_seconds, logger), name="resync",
                     daemon=True).start()


# ---------------------------------------------------------------------------------------------------------
# Problems a schema-valid spec can still have


def find_problems(spec: GemmaRustServerSpec) -> list[status.Problem]:
    """Check what admission cannot: a known accelerator and the operator's allowlists. (A missing token
    Secret is the kubelet's to find: the pod's CreateContainerConfigError, which events.py reports, so the
    operator never reads Secrets.)"""
    problems = []
    if spec.accelerator.type not in KNOWN_ACCELERATORS:
        problems.append(status.Problem(
            "UnknownAccelerator",
            f"spec.accelerator.type {spec.accelerator.type!r} is not supported; set one of: "
            + ", ".join(KNOWN_ACCELERATORS), fatal=True))
    problems += allowlist_problems(spec, settings())
    return problems


def _available(k: Kube) -> frozenset[str]:
    """The optional kinds' apiVersions the cluster serves (discovery, cached): those asked for, to create
    them, and those switched off, to delete what an earlier spec created."""
    return frozenset(row.api_version for row in builders.OPTIONAL_KINDS if k.serves(row.api_version))


def _scaling(spec: GemmaRustServerSpec, meta: builders.Meta, children: builders.Children,
             k: Kube) -> status.ScalingView | None:
    """The autoscaler's side for the ScalingActive condition: the HPA that acts for the autoscaling object
    created (ours, or the one KEDA made), read afresh."""
    skipped = {kind for kind, _ in children.skipped}
    kind = next((kind for kind in children.optional.get(builders.SCALING, []) if kind not in skipped), None)
    if kind is None or spec.autoscaling is None:
        return None
    scaling = spec.autoscaling
    metric = builders.hpa_metric_name(spec) if kind == "HorizontalPodAutoscaler" else \
        builders.metric_query(spec, meta)
    hpa_name = builders.scaling_hpa_name(kind, meta)
    hpa = k.get_if_present("autoscaling/v2", "HorizontalPodAutoscaler", meta.namespace, hpa_name)
    summary = (f"{scaling.min_replicas}..{scaling.max_replicas} replicas, "
               f"{AUTOSCALING_METRICS[scaling.metric]} {scaling.target:g} per pod")
    return status.ScalingView(meta.name, summary, metric, hpa_name, hpa)


# ---------------------------------------------------------------------------------------------------------
# The one reconcile path


def sync(body: dict[str, Any], logger: logging.Logger, *, apply: bool = True, prune: bool = False) -> dict[str, Any]:
    """Reconcile one GemmaRustServer and write its status.

    Args:
        body: the custom resource as kopf (or a GET) delivered it.
        logger: where to log.
        apply: apply the children (False: only observe and write status).
        prune: delete children the spec no longer asks for.
    Returns:
        The status written (or that was already stored).
    Raises:
        kopf.TemporaryError: the API server failed in a way worth retrying.
    """
    meta_d = body["metadata"]
    uid = meta_d.get("uid", "")
    meta = builders.Meta(meta_d["name"], meta_d["namespace"], uid)
    k = kube()
    with _lock(uid):
        try:
            return _sync_locked(body, meta, uid, k, logger, apply=apply, prune=prune)
        except ServerGone:
            return {}  # garbage collection takes the children
        except ApiError as e:
            raise kopf.TemporaryError(str(e), delay=5) from e


class ServerGone(Exception):
    """The custom resource was deleted while it was being synced (its status subresource answered 404)."""


# (server uid, kind, name) of children seen to be this server's: checked once per process, not every sync.
_own_children: set[tuple[str, str, str]] = set()


def _foreign_child(k: Kube, obj: dict[str, Any], uid: str) -> status.Problem | None:
    """A ChildConflict problem when an object that is not this server's child already has `obj`'s name (a
    forced apply would take it over), else None."""
    meta = obj["metadata"]
    key = (uid, obj["kind"], meta["name"])
    if key in _own_children:
        return None
    why = builders.foreign(k.get_if_present(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]), uid)
    if why is None:
        _own_children.add(key)
        return None
    return status.Problem("ChildConflict", f"{obj['kind']} {meta['name']} already exists and is not this "
                          f"GemmaRustServer's ({why}): rename the GemmaRustServer, or delete that object",
                          fatal=False)


def _build_cache_claim(k: Kube, meta: builders.Meta) -> tuple[builders.Meta, list[status.Problem]]:
    """Which claim a pvc build cache is, read afresh on every sync (a claim can be replaced between two).

    The claim an earlier version named <name>-build-cache stays the build cache where this server is its
    controller (an upgrade keeps the build); otherwise it is the uid-named claim, and a claim of that name
    that is not this server's is a fatal problem: a forced apply would take it over, and the pods would mount
    someone else's volume read-write (and run the engine built on it).

    Returns:
        `meta`, marked when the legacy claim is kept, and the problem, if any.
    """
    legacy = k.get_if_present("v1", "PersistentVolumeClaim", meta.namespace,
                              builders.legacy_build_cache_claim_name(meta))
    if legacy is not None and builders.foreign(legacy, meta.uid) is None:
        return meta._replace(legacy_build_cache=True), []
    name = builders.build_cache_claim_name(meta)
    why = builders.foreign(k.get_if_present("v1", "PersistentVolumeClaim", meta.namespace, name), meta.uid)
    if why is None:
        return meta, []
    return meta, [status.Problem(
        "BuildCacheClaimNotOwned", f"PersistentVolumeClaim {name} (spec.buildCache) already exists and is not this "
        f"GemmaRustServer's ({why}): no pod of this server mounts it; delete that claim, or set "
        f"spec.buildCache.type to emptyDir", fatal=True)]


def _withdraw_deployment(k: Kube, meta: builders.Meta, claim: str, logger: logging.Logger) -> None:
    """Delete this server's Deployment if its pods mount `claim`, a claim that is no longer the server's."""
    dep = k.get_if_present("apps/v1", "Deployment", meta.namespace, meta.name)
    if dep is not None and claim in builders.claims(dep) and \
            _delete_own(k, "apps/v1", "Deployment", meta.namespace, meta.name, meta.uid):
        logger.warning("deleted Deployment %s: its pods mount PersistentVolumeClaim %s, which is not this "
                       "GemmaRustServer's", meta.name, claim)


def _delete_own(k: Kube, api_version: str, kind: str, namespace: str, name: str, uid: str) -> bool:
    """Delete a child this server no longer asks for, if it is this server's; True when one was deleted."""
    existing = k.get_if_present(api_version, kind, namespace, name)
    if existing is None or builders.foreign(existing, uid):
        return False
    _own_children.discard((uid, kind, name))
    return k.delete_if_present(api_version, kind, namespace, name, uid=existing["metadata"]["uid"])


def _sync_locked(body: dict[str, Any], meta: builders.Meta, uid: str, k: Kube, logger: logging.Logger, *,
                 apply: bool, prune: bool) -> dict[str, Any]:
    generation = int(body["metadata"].get("generation") or 0)
    problems: list[status.Problem] = []
    try:
        spec = parse_spec(body.get("spec") or {})
    except pydantic.ValidationError as e:
        # Only reachable for objects stored before a schema change: admission applies the same schema.
        spec = None
        problems.append(status.Problem("InvalidSpec", "spec does not fit the schema: " + "; ".join(
            f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()), fatal=True))
    skipped: list[tuple[str, str]] = []
    optional: dict[str, list[str]] = {}
    scaling = None
    if spec is not None:
        problems += find_problems(spec)
        if spec.build_cache.type == "pvc":
            meta, claim_problems = _build_cache_claim(k, meta)
            problems += claim_problems
            if apply and claim_problems:
                _withdraw_deployment(k, meta, builders.build_cache_claim_name(meta), logger)
        children = builders.build_children(spec, meta, _available(k))
        skipped, optional = list(children.skipped), children.optional
        if apply and not any(p.fatal for p in problems):
            for obj in children.apply:
                if conflict := _foreign_child(k, obj, uid):
                    problems.append(conflict)
                    continue
                try:
                    k.apply(builders.adopt(obj, body))
                except ApiError as e:
                    row = builders.OPTIONAL_BY_KIND.get(obj["kind"])
                    failure = status.classify_apply_error(obj, e.status, e.message,
                                                          missing=row.missing() if row else None)
                    if failure.skipped:
                        k.forget(obj["apiVersion"])
                        skipped.append(failure.skipped)
                    elif failure.problem:
                        problems.append(failure.problem)
                    else:
                        raise
            for api_version, kind, name in children.replaced + (children.absent if prune else []):
                if _delete_own(k, api_version, kind, meta.namespace, name, uid):
                    logger.info("deleted %s %s: no longer asked for", kind, name)
    pods = k.list_pods(meta.namespace, builders.selector_string(meta))
    pod_events = [e for p in events.pods_to_explain(pods) for e in k.pod_events(meta.namespace, p["metadata"]["uid"])]
    port = spec.server.port if spec else 8000
    reports = poller().observe(f"{meta.namespace}/{meta.name}", pods, port)
    if spec is not None:
        scaling = _scaling(spec, meta, children, k)
    obs = status.Observed(generation=generation, replicas=builders.replicas(spec) if spec else 0, pods=pods,
                          engine=reports.engine, served_models=reports.served_models, problems=problems,
                          optional=optional, skipped=skipped, scaling=scaling, poll_errors=reports.errors,
                          blockers=events.blockers(pods, pod_events), disruption=events.disruption(pods),
                          warnings=builders.spec_warnings(spec) if spec else [])
    new = status.compute_status(
        obs, accelerator=accelerator_text(spec.accelerator) if spec else "",
        endpoint=builders.endpoint(spec, meta) if spec else "", selector=builders.selector_string(meta))
    old = _written.get(uid) or body.get("status") or {}
    new = status.with_transitions(new, old, _now())
    if status.status_changed(new, old):
        try:
            k.patch_status(meta.namespace, meta.name, new)
        except ApiError as e:
            if e.status == 404:
                raise ServerGone from e
            raise
        for type_, reason, message in status.transition_events(new, old):
            post_event(k, body, type_, reason, message)
            logger.info("%s: %s", reason, message)
    _written[uid] = new
    return new


def post_event(k: Kube, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
    """Post a core/v1 Event on the custom resource (best effort: an Event is never worth a retry)."""
    event = builders.build_event(body, type_, reason, message, datetime.now(timezone.utc),
                                 os.environ.get("HOSTNAME", "gemma-rust-operator"))
    try:
        k.request("POST", f"/api/v1/namespaces/{body['metadata']['namespace']}/events", event)
    except ApiError as e:
        logging.getLogger(__name__).warning("could not post event %s: %s", reason, e)


# ---------------------------------------------------------------------------------------------------------
# Handlers


@kopf.on.resume(*GRS)
@kopf.on.create(*GRS)
@kopf.on.update(*GRS)
def reconcile(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """A GemmaRustServer appeared or its spec changed: apply children, prune the unwanted, write status."""
    sync(dict(body), logger, prune=True)


@kopf.on.event(*GRS)
def track(event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
    """Remember which GemmaRustServers exist, for the resync loop; forget deleted ones."""
    uid = body.metadata.uid or ""
    if event.get("type") == "DELETED":
        _known.pop(uid, None)
        _written.pop(uid, None)
        _own_children.difference_update({key for key in _own_children if key[0] == uid})
        poller().forget(f"{body.metadata.namespace}/{body.metadata.name}")
        with _locks_guard:
            _locks.pop(uid, None)
    else:
        _known[uid] = (body.metadata.namespace, body.metadata.name)


def resync_one(namespace: str, name: str, logger: logging.Logger, *, apply: bool = True) -> None:
    """Sync one GemmaRustServer read afresh; errors are logged (the next pass retries), never raised."""
    try:
        body = kube().get_server(namespace, name)
        if body and not body["metadata"].get("deletionTimestamp"):
            sync(body, logger, apply=apply)
    except Exception as e:  # noqa: BLE001 - never let one object stop a resync pass or the poller
        logger.warning("resync of %s/%s failed: %s", namespace, name, e)


def resync_all(logger: logging.Logger) -> None:
    """One level-based pass over every known GemmaRustServer: put back children edited or deleted by
    hand, refresh status. Errors of one object are logged and do not stop the pass."""
    list(_resync_pool().map(lambda ref: resync_one(*ref, logger), list(_known.values())))


def _report_changed(server: str) -> None:
    """The poller saw a pod of `server` ("namespace/name") change stage: refresh its status (on the resync
    pool, not on the poller's thread)."""
    namespace, name = server.split("/", 1)
    logger = _state.get("logger") or logging.getLogger(__name__)
    _resync_pool().submit(resync_one, namespace, name, logger, apply=False)


def _resync_pool() -> ThreadPoolExecutor:
    if "pool" not in _state:
        _state["pool"] = ThreadPoolExecutor(max_workers=4, thread_name_prefix="resync")
    return _state["pool"]


def _resync_loop(stop: threading.Event, period: float, logger: logging.Logger) -> None:
    while not stop.wait(period):
        resync_all(logger)


@kopf.on.cleanup()
def stop_resync(**_: Any) -> None:
    stop = _state.get("stop")
    if stop:
        stop.set()
    if "poller" in _state:
        _state.pop("poller").close()


def _owner(labels: dict[str, str], namespace: str) -> dict[str, Any] | None:
    name = labels.get(builders.LABEL_SERVER)
    return kube().get_server(namespace, name) if name else None


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
@kopf.on.event("", "v1", "services", labels=CHILD_LABELS)
@kopf.on.event("", "v1", "pods", labels=CHILD_LABELS)
def child_changed(event: dict[str, Any], body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """A child or a pod changed: re-apply at once if a Deployment or Service was deleted, else refresh status."""
    owner = _owner(dict(body.metadata.labels or {}), body.metadata.namespace)
    if owner is None or owner["metadata"].get("deletionTimestamp"):
        return
    deleted = event.get("type") == "DELETED" and body.get("kind") in ("Deployment", "Service")
    if deleted:
        logger.info("%s %s was deleted; putting it back", body.get("kind"), body.metadata.name)
    sync(owner, logger, apply=deleted)
