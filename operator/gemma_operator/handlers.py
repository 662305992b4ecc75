"""kopf handlers: the operator's event loop. Run with

    kopf run --standalone --all-namespaces -m gemma_operator.handlers

Every handler funnels into `sync`, which has the same shape each time (kopf's examples/02-children,
dask-kubernetes' controller):

    parse spec -> check problems -> build children (pure) -> adopt -> server-side apply -> observe pods
    and the Events of those still starting -> read the cached /v1/engine reports
    -> compute status (pure) -> patch status -> post transition Events

A stored spec that no longer parses takes a path of its own (`_unparsable_spec_status`): nothing is built,
applied or deleted, and the status says why while still showing the pods. What the operator holds between
syncs (the last status written, the children known to be the server's, a lock per server) lives in
`registry.Registry`, which forgets a server whole when the watch sees it deleted.

Triggers:
- create / update / resume of a GemmaRustServer: full sync, and children the spec no longer asks for
  (PodDisruptionBudget at one replica, an optional object of builders.optional.OPTIONAL_KINDS turned off) are
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
from datetime import datetime, timezone
from typing import Any, NamedTuple

import kopf
import pydantic

from . import events, memory, status
from .admission import allowlist_problems
from .builders.autoscaling import hpa_metric_name, metric_query, scaling_hpa_name
from .builders.build_cache import build_cache_claim_name, legacy_build_cache_claim_name
from .builders.children import Children, build_children
from .builders.deployment import claims, replicas, spec_warnings
from .builders.endpoint_picker import picker_release
from .builders.event import build_event
from .builders.inference_pool import selects_pods_of
from .builders.optional import GATEWAY, OPTIONAL_BY_KIND, OPTIONAL_KINDS
from .builders.ownership import LABEL_MANAGED_BY, LABEL_SERVER, MANAGED_BY, Meta, adopt, foreign, selector_string
from .builders.service import endpoint
from .kube import ApiError, Kube
from .poller import Reports
from .registry import Registry, ServerState
from .settings import Settings
from .spec import API_GROUP, API_VERSION, ENDPOINT_PICKER_RELEASES, KNOWN_ACCELERATORS, PLURAL, \
    GemmaRustServerSpec, ServerSpec, accelerator_text, parse_spec

GRS = (API_GROUP, API_VERSION, PLURAL)
CHILD_LABELS = {LABEL_MANAGED_BY: MANAGED_BY}


def _report_changed(server: str) -> None:
    """The poller saw a pod of `server` ("namespace/name") change stage: refresh its status (on the resync
    pool, not on the poller's thread)."""
    namespace, name = server.split("/", 1)
    REGISTRY.pool.submit(resync_one, namespace, name, REGISTRY.logger, apply=False)


# The operator's state: settings, API client, poller, resync pool, and what is held for each server.
REGISTRY = Registry(on_report_changed=_report_changed)


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    """Operator settings: our own finalizer and annotation names, no CRD scanning (less RBAC)."""
    ours = Settings.from_env()
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
    REGISTRY.start(ours, logger)
    # Level-based resync in a plain thread rather than a kopf timer: kopf timers need a finalizer on every
    # object, which would leave GemmaRustServers undeletable whenever the operator is not running.
    threading.Thread(target=_resync_loop, args=(REGISTRY.stop, ours.resync_seconds, logger), name="resync",
                     daemon=True).start()


# ---------------------------------------------------------------------------------------------------------
# Problems a schema-valid spec can still have


def find_problems(spec: GemmaRustServerSpec) -> list[status.Problem]:
    """Check what admission cannot: a known accelerator, a model that fits its slice (gemma_operator.memory;
    ModelDoesNotFit is fatal, so no pod starts only to fail at its weights stage), an endpoint picker release the
    operator writes a config for (not fatal: the pods serve without it) and the operator's allowlists.
    (A missing token Secret is the kubelet's to find: the pod's CreateContainerConfigError, which events.py
    reports, so the operator never reads Secrets.)"""
    problems = []
    if spec.accelerator.type not in KNOWN_ACCELERATORS:
        problems.append(status.Problem(
            "UnknownAccelerator",
            f"spec.accelerator.type {spec.accelerator.type!r} is not supported; set one of: "
            + ", ".join(KNOWN_ACCELERATORS), fatal=True))
    release = picker_release(spec)
    if release is not None and release not in ENDPOINT_PICKER_RELEASES:
        problems.append(status.Problem(
            "UnsupportedEndpointPicker",
            f"endpoint picker release {release!r} (spec.gateway.endpointPicker.release, or when unset the "
            "operator's GEMMA_OPERATOR_ENDPOINT_PICKER, chart value operator.endpointPicker) is not one this "
            "operator writes a config for, so the picker's ConfigMap is left as it is; set one of: "
            + ", ".join(ENDPOINT_PICKER_RELEASES), fatal=False))
    plan = memory.placement(spec).plan
    if plan is not None and not plan.fits:
        problems.append(status.Problem("ModelDoesNotFit", plan.explanation, fatal=True))
    problems += allowlist_problems(spec, REGISTRY.settings)
    return problems


def with_defaults(spec: GemmaRustServerSpec, settings: Settings) -> GemmaRustServerSpec:
    """The spec with the operator's defaults where it leaves a field to them (pure): the Managed Prometheus
    cluster name of KEDA's query (spec.autoscaling.prometheus.cluster, GEMMA_OPERATOR_CLUSTER_NAME) and the
    endpoint picker's release (spec.gateway.endpointPicker.release, GEMMA_OPERATOR_ENDPOINT_PICKER)."""
    scaling = spec.autoscaling
    if scaling is not None and not scaling.prometheus.cluster and settings.cluster_name:
        prometheus = scaling.prometheus.model_copy(update={"cluster": settings.cluster_name})
        spec = spec.model_copy(update={"autoscaling": scaling.model_copy(update={"prometheus": prometheus})})
    gateway = spec.gateway
    picker = gateway.endpoint_picker
    if picker is not None and picker.release is None:
        picker = picker.model_copy(update={"release": settings.endpoint_picker})
        spec = spec.model_copy(update={"gateway": gateway.model_copy(update={"endpoint_picker": picker})})
    return spec


def invalid_spec(error: pydantic.ValidationError) -> status.Problem:
    """The InvalidSpec problem of a stored spec that does not fit the schema."""
    return status.Problem("InvalidSpec", "spec does not fit the schema: " + "; ".join(
        f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in error.errors()), fatal=True)


def _available(k: Kube) -> frozenset[str]:
    """The optional kinds' apiVersions the cluster serves (discovery, cached): those asked for, to create
    them, and those switched off, to delete what an earlier spec created."""
    return frozenset(row.api_version for row in OPTIONAL_KINDS if k.serves(row.api_version))


def _scaling(spec: GemmaRustServerSpec, meta: Meta, children: Children, skipped: list[tuple[str, str]],
             k: Kube) -> status.ScalingView | None:
    """The autoscaler's side for the ScalingActive condition: the HPA that acts for the driver the autoscaler
    decision chose (its first kind: ours, or the one KEDA made), read afresh, and the decision's summary; None
    without a driver, or where it was skipped (by the plan or at apply)."""
    kinds = children.scaling.kinds
    kind = kinds[0] if kinds else None
    if kind is None or kind in {s for s, _ in skipped}:
        return None
    metric = hpa_metric_name(spec) if kind == "HorizontalPodAutoscaler" else metric_query(spec, meta)
    hpa_name = scaling_hpa_name(kind, meta)
    hpa = k.get_if_present("autoscaling/v2", "HorizontalPodAutoscaler", meta.namespace, hpa_name)
    return status.ScalingView(meta.name, children.scaling.summary, metric, hpa_name, hpa)


def _foreign_pools(meta: Meta, skipped: list[tuple[str, str]], children: Children, k: Kube) -> list[str]:
    """InferencePools in the namespace that select this server's pods and are not its own (e.g. one the
    upstream inferencepool chart made), while the server has its own pool."""
    if "InferencePool" not in children.optional.get(GATEWAY, []) or "InferencePool" in dict(skipped):
        return []
    try:
        pools = k.list_objects("inference.networking.k8s.io/v1", "InferencePool", meta.namespace)
    except ApiError as e:
        if e.status in (403, 404):  # the CRD went away since discovery, or an older ClusterRole without list
            return []
        raise
    return [p["metadata"]["name"] for p in pools
            if foreign(p, meta.uid) is not None and selects_pods_of(p, meta)]


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
    meta = Meta(meta_d["name"], meta_d["namespace"], meta_d.get("uid", ""),
                keda_http_scaler=REGISTRY.settings.keda_http_scaler)
    k = REGISTRY.kube
    server = REGISTRY.server(meta.uid, meta.namespace, meta.name)
    with server.lock:
        try:
            try:
                spec = with_defaults(parse_spec(body.get("spec") or {}), REGISTRY.settings)
            except pydantic.ValidationError as e:
                # Only reachable for objects stored before a schema change: admission applies the same schema.
                new = _unparsable_spec_status(body, meta, k, invalid_spec(e))
            else:
                new = _reconcile(body, spec, meta, server, k, logger, apply=apply, prune=prune)
            return _write_status(k, body, meta, server, new, logger)
        except ServerGone:
            return {}  # garbage collection takes the children
        except ApiError as e:
            raise kopf.TemporaryError(str(e), delay=5) from e


class ServerGone(Exception):
    """The custom resource was deleted while it was being synced (its status subresource answered 404)."""


def _reconcile(body: dict[str, Any], spec: GemmaRustServerSpec, meta: Meta, server: ServerState, k: Kube,
               logger: logging.Logger, *, apply: bool, prune: bool) -> dict[str, Any]:
    """Build the children of a parsed spec, adopt and apply them (unless a fatal problem forbids it), delete
    those no longer asked for, observe the pods; returns the status computed (not yet stamped or written)."""
    problems = find_problems(spec)
    if spec.build_cache.type == "pvc":
        meta, claim_problems = _build_cache_claim(k, meta)
        problems += claim_problems
        if apply and claim_problems:
            _withdraw_deployment(k, meta, server, build_cache_claim_name(meta), logger)
    children = build_children(spec, meta, _available(k))
    scaling = children.scaling  # the autoscaler chosen (builders.autoscaler.choose): its floor, warning, summary
    warnings = spec_warnings(spec) + ([scaling.warning] if scaling.warning else [])
    skipped = list(children.skipped)
    if apply and not any(p.fatal for p in problems):
        applied = _apply_children(k, body, meta, server, children, logger, prune=prune)
        problems += applied.problems
        skipped += applied.skipped
    pods, pod_events, reports = _observe(k, meta, spec.server.port)
    obs = _observed(body, pods, pod_events, reports, replicas=replicas(spec, scaling), problems=problems,
                    optional=children.optional, skipped=skipped,
                    scaling=_scaling(spec, meta, children, skipped, k),
                    warnings=warnings, foreign_pools=_foreign_pools(meta, skipped, children, k),
                    scales_to_zero=scaling.scales_to_zero)
    return status.compute_status(obs, accelerator=accelerator_text(spec.accelerator),
                                 endpoint=endpoint(spec, meta), selector=selector_string(meta))


def _unparsable_spec_status(body: dict[str, Any], meta: Meta, k: Kube, problem: status.Problem) -> dict[str, Any]:
    """The status of a server whose stored spec does not parse: no child is built, applied or deleted (the
    spec says nothing the operator could act on), and the status names the problem and still shows the pods,
    polled on the server's default port."""
    pods, pod_events, reports = _observe(k, meta, ServerSpec().port)
    obs = _observed(body, pods, pod_events, reports, replicas=0, problems=[problem], optional={}, skipped=[],
                    scaling=None, warnings=[])
    return status.compute_status(obs, accelerator="", endpoint="", selector=selector_string(meta))


class Applied(NamedTuple):
    problems: list[status.Problem]  # objects the API server refused, names taken by someone else's objects
    skipped: list[tuple[str, str]]  # (kind, why): optional kinds whose API went away since discovery


def _apply_children(k: Kube, body: dict[str, Any], meta: Meta, server: ServerState, children: Children,
                    logger: logging.Logger, *, prune: bool) -> Applied:
    """Adopt and server-side apply each child, then delete the replaced ones (and, with `prune`, the absent)."""
    problems: list[status.Problem] = []
    skipped: list[tuple[str, str]] = []
    for obj in children.apply:
        if conflict := _foreign_child(k, obj, server, meta.uid):
            problems.append(conflict)
            continue
        try:
            k.apply(adopt(obj, body))
        except ApiError as e:
            row = OPTIONAL_BY_KIND.get(obj["kind"])
            failure = status.classify_apply_error(obj, e.status, e.message, missing=row.missing() if row else None)
            if failure.skipped:
                k.forget(obj["apiVersion"])
                skipped.append(failure.skipped)
            elif failure.problem:
                problems.append(failure.problem)
            else:
                raise
    for api_version, kind, name in children.replaced + (children.absent if prune else []):
        if _delete_own(k, server, api_version, kind, meta.namespace, name, meta.uid):
            logger.info("deleted %s %s: no longer asked for", kind, name)
    return Applied(problems, skipped)


def _observe(k: Kube, meta: Meta, port: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Reports]:
    """The server's pods, the Events of those still starting (events.pods_to_explain), and their cached
    /v1/engine reports (the poller fetches apart; this never waits for a pod)."""
    pods = k.list_pods(meta.namespace, selector_string(meta))
    pod_events = [e for p in events.pods_to_explain(pods) for e in k.pod_events(meta.namespace, p["metadata"]["uid"])]
    return pods, pod_events, REGISTRY.poller.observe(f"{meta.namespace}/{meta.name}", pods, port)


def _observed(body: dict[str, Any], pods: list[dict[str, Any]], pod_events: list[dict[str, Any]], reports: Reports,
              **spec_side: Any) -> status.Observed:
    return status.Observed(generation=int(body["metadata"].get("generation") or 0), pods=pods,
                           engine=reports.engine, served_models=reports.served_models, poll_errors=reports.errors,
                           blockers=events.blockers(pods, pod_events), disruption=events.disruption(pods),
                           **spec_side)


def _write_status(k: Kube, body: dict[str, Any], meta: Meta, server: ServerState, new: dict[str, Any],
                  logger: logging.Logger) -> dict[str, Any]:
    """Stamp the transitions, patch the status if it changed (remembered in `server.written`), and post an
    Event per transition.

    Raises:
        ServerGone: the custom resource was deleted meanwhile.
    """
    old = server.written or body.get("status") or {}
    now = _now()
    new = status.with_wake(status.with_transitions(new, old, now), old, now)
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
    server.written = new
    return new


def _foreign_child(k: Kube, obj: dict[str, Any], server: ServerState, uid: str) -> status.Problem | None:
    """A ChildConflict problem when an object that is not this server's child already has `obj`'s name (a
    forced apply would take it over), else None (and `server` remembers the child as its own)."""
    meta = obj["metadata"]
    if (obj["kind"], meta["name"]) in server.own_children:
        return None
    why = foreign(k.get_if_present(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]), uid)
    if why is None:
        server.own_children.add((obj["kind"], meta["name"]))
        return None
    return status.Problem("ChildConflict", f"{obj['kind']} {meta['name']} already exists and is not this "
                          f"GemmaRustServer's ({why}): rename the GemmaRustServer, or delete that object",
                          fatal=False)


def _build_cache_claim(k: Kube, meta: Meta) -> tuple[Meta, list[status.Problem]]:
    """Which claim a pvc build cache is, read afresh on every sync (a claim can be replaced between two).

    The claim an earlier version named <name>-build-cache stays the build cache where this server is its
    controller (an upgrade keeps the build); otherwise it is the uid-named claim, and a claim of that name
    that is not this server's is a fatal problem: a forced apply would take it over, and the pods would mount
    someone else's volume read-write (and run the engine built on it).

    Returns:
        `meta`, marked when the legacy claim is kept, and the problem, if any.
    """
    legacy = k.get_if_present("v1", "PersistentVolumeClaim", meta.namespace, legacy_build_cache_claim_name(meta))
    if legacy is not None and foreign(legacy, meta.uid) is None:
        return meta._replace(legacy_build_cache=True), []
    name = build_cache_claim_name(meta)
    why = foreign(k.get_if_present("v1", "PersistentVolumeClaim", meta.namespace, name), meta.uid)
    if why is None:
        return meta, []
    return meta, [status.Problem(
        "BuildCacheClaimNotOwned", f"PersistentVolumeClaim {name} (spec.buildCache) already exists and is not this "
        f"GemmaRustServer's ({why}): no pod of this server mounts it; delete that claim, or set "
        f"spec.buildCache.type to emptyDir", fatal=True)]


def _withdraw_deployment(k: Kube, meta: Meta, server: ServerState, claim: str, logger: logging.Logger) -> None:
    """Delete this server's Deployment if its pods mount `claim`, a claim that is no longer the server's."""
    dep = k.get_if_present("apps/v1", "Deployment", meta.namespace, meta.name)
    if dep is not None and claim in claims(dep) and \
            _delete_own(k, server, "apps/v1", "Deployment", meta.namespace, meta.name, meta.uid):
        logger.warning("deleted Deployment %s: its pods mount PersistentVolumeClaim %s, which is not this "
                       "GemmaRustServer's", meta.name, claim)


def _delete_own(k: Kube, server: ServerState, api_version: str, kind: str, namespace: str, name: str,
                uid: str) -> bool:
    """Delete a child this server no longer asks for, if it is this server's; True when one was deleted."""
    existing = k.get_if_present(api_version, kind, namespace, name)
    if existing is None or foreign(existing, uid):
        return False
    server.own_children.discard((kind, name))
    return k.delete_if_present(api_version, kind, namespace, name, uid=existing["metadata"]["uid"])


def post_event(k: Kube, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
    """Post a core/v1 Event on the custom resource (best effort: an Event is never worth a retry)."""
    event = build_event(body, type_, reason, message, datetime.now(timezone.utc),
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
        REGISTRY.forget(uid)
    else:
        REGISTRY.track(uid, body.metadata.namespace, body.metadata.name)


def resync_one(namespace: str, name: str, logger: logging.Logger, *, apply: bool = True) -> None:
    """Sync one GemmaRustServer read afresh; errors are logged (the next pass retries), never raised."""
    try:
        body = REGISTRY.kube.get_server(namespace, name)
        if body and not body["metadata"].get("deletionTimestamp"):
            sync(body, logger, apply=apply)
    except Exception as e:  # noqa: BLE001 - never let one object stop a resync pass or the poller
        logger.warning("resync of %s/%s failed: %s", namespace, name, e)


def resync_all(logger: logging.Logger) -> None:
    """One level-based pass over every known GemmaRustServer: put back children edited or deleted by
    hand, refresh status. Errors of one object are logged and do not stop the pass."""
    list(REGISTRY.pool.map(lambda ref: resync_one(*ref, logger), REGISTRY.known()))


def _resync_loop(stop: threading.Event, period: float, logger: logging.Logger) -> None:
    while not stop.wait(period):
        resync_all(logger)


@kopf.on.cleanup()
def stop_resync(**_: Any) -> None:
    REGISTRY.close()


def _owner(labels: dict[str, str], namespace: str) -> dict[str, Any] | None:
    name = labels.get(LABEL_SERVER)
    return REGISTRY.kube.get_server(namespace, name) if name else None


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
