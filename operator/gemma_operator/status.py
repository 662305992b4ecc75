"""Pure status logic: observed pods, engine reports and spec problems -> `status` of a GemmaRustServer.

No I/O and no clock here: the caller passes the time (`now`) and what it observed; unit tests feed dicts
and compare the result with golden dicts (tests/operator/test_status.py).

Phases (one per custom resource, the least advanced of its booting pods):
    Pending -> Scheduling -> Building -> SmokeTesting -> LoadingWeights -> Compiling -> WarmingUp -> Ready
    plus Degraded (something is wrong but pods may serve), Failed (nothing serves and it will not by itself),
    Stopped (replicas: 0).
A server that scales to zero (spec.autoscaling.minReplicas 0) is `Idle` at zero instead of Stopped, and
`Waking` from the first status written after its autoscaler asked for a replica until one is ready (each pod
still shows its boot stage); `status.wake` keeps when the last wake began, when it ended and how long it took
(`with_wake`).
`Scheduling` covers a pod waiting for a node (the scheduler's own message is shown, e.g.
"0/4 nodes are available: 2 Insufficient google.com/tpu") and a scheduled pod whose container is not
running yet. The boot stages come from the server's `GET /v1/engine` (`stage`: build, import, smoke,
weights, compile, warmup, serving), as the poller kept each report (poller.keep_engine_fields bounds and redacts it
once, where it is read; nothing here normalises it again).

Conditions follow the Kubernetes API conventions and KServe's LLMInferenceService: `Ready` (False carries
the blocking reason), `Progressing`, `Degraded`, and `Monitoring` when scraping was asked for; each has
reason, message, lastTransitionTime and observedGeneration. The optional kinds
(builders.optional.OPTIONAL_KINDS) report through the condition their row names: `Monitoring`, `Gateway`
(True when created, False naming the CRD that is missing) and `ScalingActive`, which says which object drives
the replicas and, from the status conditions of the HPA that acts (ours, or the one KEDA makes), whether it
can read its metric. The last crash's termination message reaches `status.lastFailure` (KServe's
lastFailureInfo), like a boot stage's failure reason only after `gemma_operator.redact` (the pod writes that
text, and anyone who may read the custom resource reads it).

Why a pod cannot start (a failed mount, a missing Secret, an image pull, an OOM kill) comes from its Events
and container statuses, read by gemma_operator.events: such a pod is Failed with that reason. An evicted or
reclaimed pod is gone, and the reason it went stays on the phase while its replacement waits. A `Warning`
condition (True, never Degraded) carries spec advice such as a build cache that every preemption loses.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, NamedTuple

from . import pods
from .redact import redact

PENDING, SCHEDULING, BUILDING, SMOKE_TESTING, LOADING_WEIGHTS, COMPILING, WARMING_UP, READY = (
    "Pending", "Scheduling", "Building", "SmokeTesting", "LoadingWeights", "Compiling", "WarmingUp", "Ready")
DEGRADED, FAILED, STOPPED = "Degraded", "Failed", "Stopped"
IDLE, WAKING = "Idle", "Waking"  # a server that scales to zero: at zero, and booting from zero
BOOT_ORDER = [PENDING, SCHEDULING, BUILDING, SMOKE_TESTING, LOADING_WEIGHTS, COMPILING, WARMING_UP, READY]

# gemma_server's /v1/engine stage names -> our phase.
ENGINE_STAGE_PHASE = {
    "build": BUILDING, "import": BUILDING, "smoke": SMOKE_TESTING, "weights": LOADING_WEIGHTS,
    "compile": COMPILING, "warmup": WARMING_UP, "serving": WARMING_UP,  # serving but the readiness probe has not passed yet
}

# Container waiting reasons that will not clear by waiting.
BAD_WAITING = {"CrashLoopBackOff", "CreateContainerConfigError", "CreateContainerError", "ImagePullBackOff",
               "ErrImagePull", "InvalidImageName", "RunContainerError"}

MAX_PODS_IN_STATUS = 16
# Copied error text (an HPA condition's message, which carries what KEDA's metrics server or a metrics
# adapter got back, e.g. a Prometheus error body) is cut to this many characters in the status.
MAX_COPIED_MESSAGE = 256


def excerpt(text: str, limit: int = MAX_COPIED_MESSAGE) -> str:
    """Another component's message as the status shows it: redacted (`redact`) and cut to `limit` characters,
    its head kept (where such a message says what failed) and "…" marking the cut (pure)."""
    # Redacted before the final cut, on a head 16 times `limit` long: a credential cut in half at its end lies
    # far beyond the final cut.
    out = redact(text[:16 * limit], max_bytes=64 * limit)
    return out if len(out) <= limit else out[:limit - 1].rstrip() + "…"


class Problem(NamedTuple):
    """A spec the schema accepted but that cannot work as is."""

    reason: str   # CamelCase, e.g. SecretNotFound
    message: str  # says what to do
    fatal: bool   # True: nothing can run until the spec changes (phase Failed)


class ApplyFailure(NamedTuple):
    """What one failed server-side apply means (classify_apply_error)."""

    skipped: tuple[str, str] | None  # (kind, why): an optional kind no longer served; go on without it
    problem: Problem | None          # the API server refused the object: a Degraded condition
    # both None: transient trouble, worth a retry


def classify_apply_error(obj: dict[str, Any], http_status: int, message: str, *,
                         missing: str | None) -> ApplyFailure:
    """Turn an apply's HTTP error into a skip, a problem, or neither (retry) (pure).

    Args:
        obj: the object that was applied.
        http_status: the API server's status code.
        message: its message.
        missing: for an optional kind (builders.optional.OPTIONAL_KINDS), why it is skipped when its API is not
            served (OptionalKind.missing()); None for the kinds every cluster serves.
    """
    if http_status in (404, 405) and missing:
        # Its CRD went away (or is being deleted) since discovery was cached.
        return ApplyFailure((obj["kind"], missing), None)
    if http_status in (400, 403, 422):
        return ApplyFailure(None, Problem("ApplyRejected", f"{obj['kind']} {obj['metadata']['name']}: {message}",
                                          fatal=False))
    return ApplyFailure(None, None)


class PodView(NamedTuple):
    name: str
    node: str
    deleting: bool
    scheduled: bool
    schedule_message: str
    running: bool
    ready: bool
    waiting_reason: str
    waiting_message: str
    restarts: int
    last_failure: dict[str, Any] | None
    terminal: bool = False  # phase Failed or Succeeded: gone for good (evicted, shut down with its node)


def pod_view(pod: dict[str, Any]) -> PodView:
    """Extract what the status needs from a Pod object (as returned by the API)."""
    spec = pod.get("spec") or {}
    sched = next((c for c in pods.pod_status(pod).get("conditions") or [] if c.get("type") == "PodScheduled"), {})
    scheduled = bool(spec.get("nodeName")) or sched.get("status") == "True"
    cs = pods.server_status(pod) or {}
    state = cs.get("state") or {}
    waiting = state.get("waiting") or {}
    last = None
    for term in ((cs.get("lastState") or {}).get("terminated"), state.get("terminated")):
        if term and (term.get("exitCode", 0) != 0 or term.get("reason") not in (None, "Completed")):
            last = {"reason": term.get("reason") or "Error", "exitCode": term.get("exitCode"),
                    "message": redact(term.get("message") or "")}
    return PodView(
        name=pods.meta(pod).get("name", ""),
        node=spec.get("nodeName") or "",
        deleting=pods.deleting(pod),
        scheduled=scheduled,
        schedule_message=sched.get("message", "") if sched.get("status") == "False" else "",
        running=pods.server_running(pod),
        ready=pods.ready(pod),
        waiting_reason=waiting.get("reason", ""),
        waiting_message=waiting.get("message", ""),
        restarts=int(cs.get("restartCount") or 0),
        last_failure=last,
        terminal=pods.terminal(pod),
    )


class PodStage(NamedTuple):
    phase: str         # one of BOOT_ORDER, or FAILED for a pod that is crashing or cannot start
    reason: str
    message: str


def pod_stage(view: PodView, engine: dict[str, Any] | None, poll_error: str = "") -> PodStage:
    """Where one pod is, from its Kubernetes status and (when it answered) its /v1/engine report; `poll_error`
    says why the last poll of the pod got no report."""
    if view.ready:
        return PodStage(READY, "Ready", "")
    if not view.scheduled:
        return PodStage(SCHEDULING, "Unschedulable" if view.schedule_message else "WaitingForScheduler",
                        view.schedule_message)
    if view.waiting_reason in BAD_WAITING:
        msg = view.waiting_message
        if view.last_failure and view.last_failure["message"]:
            msg = view.last_failure["message"]
        return PodStage(FAILED, view.waiting_reason, msg)
    if not view.running:
        return PodStage(SCHEDULING, view.waiting_reason or "ContainerCreating", view.waiting_message)
    stage = (engine or {}).get("stage")
    if (engine or {}).get("failed"):
        # gemma_server reports the failing stage's reason here just before it exits non-zero (the poller
        # redacted it when it kept the report).
        return PodStage(FAILED, "BootStageFailed", f"stage {stage}: {engine['failed']}")
    if stage in ENGINE_STAGE_PHASE:
        phase = ENGINE_STAGE_PHASE[stage]
        return PodStage(phase, phase, f"engine stage {stage}")
    # Running, not ready, no report (yet): the server builds the engine first.
    why = f" (last poll: {poll_error})" if poll_error else ""
    return PodStage(BUILDING, BUILDING, f"waiting for the server's /v1/engine report{why}")


class Observed(NamedTuple):
    """Everything the handlers observed for one custom resource."""

    generation: int
    replicas: int                         # spec.replicas
    pods: list[dict[str, Any]]            # Pod objects selected by the server's labels
    engine: dict[str, dict[str, Any]]     # pod name -> its /v1/engine report as poller.keep_engine_fields kept it
    served_models: dict[str, str]         # pod name -> the model id its /v1/engine names (ready pods)
    problems: list[Problem]               # spec problems found by the handlers
    optional: dict[str, list[str]]        # condition -> optional kinds asked for (builders.children.Children.optional)
    skipped: list[tuple[str, str]]        # (kind, why) optional kinds asked for but not created
    poll_errors: dict[str, str] = {}      # pod name -> why its last poll got no report
    blockers: dict[str, tuple[str, str]] = {}  # pod name -> (reason, message): why it cannot start (events.py)
    disruption: tuple[str, str] | None = None  # (reason, message) of the pod evicted or reclaimed (events.py)
    warnings: list[tuple[str, str]] = []       # (reason, message) of spec advice (builders.deployment.spec_warnings)
    scaling: "ScalingView | None" = None       # the autoscaler's side, when spec.autoscaling is set
    foreign_pools: list[str] = []              # InferencePools not this server's that select its pods
    scales_to_zero: bool = False               # the autoscaler chosen goes to zero: at zero it is Idle


class ScalingView(NamedTuple):
    """What the ScalingActive condition is made of."""

    name: str                    # the autoscaling object's name
    summary: str                 # e.g. "1..4 replicas, gemma_num_requests_waiting 4 per pod"
    metric: str                  # the metric's name as the autoscaler asks for it
    hpa_name: str                # the HPA that acts (ours, or keda-hpa-<name>)
    hpa: dict[str, Any] | None   # that HPA as read (None: not there yet)


def _cond(type_: str, ok: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


# The reason of a False optional-kind condition whose CRD is missing; Monitoring keeps its older name.
CRD_MISSING = {"Monitoring": "MonitoringCRDMissing"}

# What an HPA's ScalingActive=False reasons (kubernetes pkg/controller/podautoscaler/horizontal.go) mean here.
_METRIC_NOT_SERVED = {
    "FailedGetPodsMetric": "no custom-metrics adapter serves the Pods metric {metric} (install prometheus-adapter "
                           "or, on GKE, the Custom Metrics Stackdriver Adapter, and scrape the pods)",
    "FailedGetExternalMetric": "KEDA's metrics server cannot answer its Prometheus query for {metric} (is "
                               "spec.autoscaling.prometheus.serverAddress reachable, and are the pods scraped?)",
}


def optional_conditions(obs: Observed) -> list[dict[str, str]]:
    """One condition per group of optional kinds asked for: created, or skipped naming what to install."""
    out = []
    for group, kinds in obs.optional.items():
        missing = [(k, why) for k, why in obs.skipped if k in kinds]
        if group == "ScalingActive":
            out.append(scaling_condition(kinds[0], missing, obs.scaling))
        elif missing:
            out.append(_cond(group, False, CRD_MISSING.get(group, "CRDMissing"),
                             "; ".join(f"{k} skipped: {w}" for k, w in missing)))
        elif group == "Gateway" and obs.foreign_pools:
            out.append(_cond(group, False, "ForeignInferencePool", foreign_pools_message(obs.foreign_pools)))
        else:
            out.append(_cond(group, True, "Configured", "created " + ", ".join(kinds)))
    return out


def foreign_pools_message(names: list[str]) -> str:
    """Why a second InferencePool over the same pods is a mistake, and what to do."""
    listed = ", ".join(sorted(names))
    return (f"InferencePool {listed} (not this server's) also selects its pods: a route through it bypasses this "
            "server's pool, its endpoint picker config and GKE policies. The upstream inferencepool Helm chart "
            "makes such a pool; delete it and route to this server's InferencePool, with the picker of "
            "charts/gemma-rust-operator/examples/endpoint-picker.yaml")


def scaling_condition(kind: str, missing: list[tuple[str, str]], view: ScalingView | None) -> dict[str, str]:
    """ScalingActive: which object drives the replicas, and whether its HPA can read the metric (pure).

    Args:
        kind: ScaledObject or HorizontalPodAutoscaler.
        missing: (kind, why) when it could not be created.
        view: the autoscaler's side (None only when it was not created).
    """
    if missing or view is None:
        why = "; ".join(f"{k} skipped: {w}" for k, w in missing)
        return {"type": "ScalingActive", "status": "False", "reason": "CRDMissing",
                "message": f"{why}; spec.replicas drives the replicas"}
    drives = f"{kind} {view.name} drives the replicas ({view.summary})"
    conds = {c.get("type"): c for c in ((view.hpa or {}).get("status") or {}).get("conditions") or []}
    active = conds.get("ScalingActive")
    if not active:
        return {"type": "ScalingActive", "status": "Unknown", "reason": "WaitingForAutoscaler",
                "message": f"{drives}; HorizontalPodAutoscaler {view.hpa_name} has not reported yet"}
    if active.get("status") != "True":
        reason = active.get("reason") or "ScalingInactive"
        meaning = _METRIC_NOT_SERVED.get(reason, "the autoscaler is not scaling").format(metric=view.metric)
        return {"type": "ScalingActive", "status": "False", "reason": reason,
                "message": f"{drives}, but {meaning}; replicas stay where they are. HorizontalPodAutoscaler "
                           f"{view.hpa_name}: {excerpt(str(active.get('message', '')))}"}
    hpa_status = view.hpa.get("status") or {}
    return {"type": "ScalingActive", "status": "True", "reason": kind,
            "message": f"{drives}; desired {hpa_status.get('desiredReplicas', '?')}, "
                       f"current {hpa_status.get('currentReplicas', '?')}"}


def compute_status(obs: Observed, *, accelerator: str, endpoint: str, selector: str) -> dict[str, Any]:
    """The status (without timestamps; see `with_transitions`) for what was observed.

    Args:
        obs: the observation.
        accelerator: text for the Accelerator column (spec.accelerator_text).
        endpoint: the in-cluster OpenAI base URL.
        selector: the pod label selector string (scale subresource).
    Returns:
        A dict with phase, reason, message, conditions (no lastTransitionTime), replicas, readyReplicas,
        readyText, selector, accelerator, endpoint, servedModel, pods and lastFailure.
    """
    views = [pod_view(p) for p in obs.pods]
    active = [v for v in views if not v.deleting and not v.terminal]
    stages = {v.name: PodStage(FAILED, *obs.blockers[v.name]) if v.name in obs.blockers
              else pod_stage(v, obs.engine.get(v.name), obs.poll_errors.get(v.name, "")) for v in active}
    ready = sum(1 for v in active if v.ready)
    failing = [(v, stages[v.name]) for v in active if stages[v.name].phase == FAILED]
    booting = [(v, stages[v.name]) for v in active if stages[v.name].phase not in (READY, FAILED)]
    fatal = [p for p in obs.problems if p.fatal]
    last_failure = next(({"pod": v.name, **v.last_failure} for v in active if v.last_failure), None)

    degraded: tuple[str, str] | None = None
    if fatal:
        phase, reason, message = FAILED, fatal[0].reason, fatal[0].message
        degraded = (reason, message)
    elif failing:
        v, stage = failing[0]
        phase = DEGRADED if ready else FAILED
        reason = stage.reason
        message = f"pod {v.name}: {stage.message}" if stage.message else f"pod {v.name}: {stage.reason}"
        degraded = (reason, message)
    elif obs.problems:
        phase, reason, message = DEGRADED, obs.problems[0].reason, obs.problems[0].message
        degraded = (reason, message)
    elif obs.replicas == 0 and obs.scales_to_zero:
        phase, reason, message = IDLE, "ScaledToZero", (
            "no request within spec.autoscaling.idleSeconds; the next request is held and wakes it")
    elif obs.replicas == 0:
        phase, reason, message = STOPPED, "ScaledToZero", "spec.replicas is 0"
    elif ready >= obs.replicas and not booting:
        phase, reason, message = READY, "AllReplicasReady", f"{ready}/{obs.replicas} replicas ready"
    elif booting:
        v, stage = min(booting, key=lambda booted: BOOT_ORDER.index(booted[1].phase))
        phase, reason = stage.phase, stage.reason
        message = f"pod {v.name}: {stage.message}" if stage.message else f"pod {v.name}: {stage.reason}"
    else:
        phase, reason, message = PENDING, "WaitingForPods", f"{len(active)}/{obs.replicas} pods created"
    if obs.disruption and phase in (PENDING, SCHEDULING):
        # The replacement's own wait (e.g. the scheduler's message) follows why its predecessor went.
        reason, message = obs.disruption[0], f"{obs.disruption[1]}; now {message}"

    is_ready = obs.replicas > 0 and ready >= obs.replicas and not fatal
    progressing = phase in BOOT_ORDER[:-1]
    conditions = [
        _cond("Ready", is_ready, "AllReplicasReady" if is_ready else reason,
              f"{ready}/{obs.replicas} replicas ready" if is_ready else message),
        _cond("Progressing", progressing, reason if progressing else ("RolloutComplete" if phase == READY else reason),
              message),
        _cond("Degraded", degraded is not None, degraded[0] if degraded else "AsExpected",
              degraded[1] if degraded else ""),
    ]
    conditions += optional_conditions(obs)
    if obs.warnings:
        conditions.append(_cond("Warning", True, obs.warnings[0][0], "; ".join(m for _, m in obs.warnings)))

    entries = []
    for v in sorted(active, key=lambda v: v.name)[:MAX_PODS_IN_STATUS]:
        stage = stages[v.name]
        entry: dict[str, Any] = {"name": v.name, "node": v.node, "ready": v.ready, "stage": stage.phase,
                                 "restarts": v.restarts}
        if stage.reason not in (stage.phase,):
            entry["reason"] = stage.reason
        if stage.message:
            entry["message"] = stage.message
        engine = obs.engine.get(v.name)
        if engine:
            entry["engineStage"] = engine.get("stage", "")
            entry["stages"] = engine.get("stages", [])
            if "engines" in engine:
                entry["engines"] = len(engine["engines"])  # engines in the pod, one per tensorParallelSize chips
        model = obs.served_models.get(v.name, "")
        if model:
            entry["servedModel"] = model
        entries.append(entry)

    models = [p["servedModel"] for p in entries if p.get("servedModel")]
    return {
        "phase": phase,
        "reason": reason,  # the phase's reason (Degraded shows why it is degraded)
        "message": message,
        "observedGeneration": obs.generation,
        "replicas": len(active),
        "readyReplicas": ready,
        "readyText": f"{ready}/{obs.replicas}",
        "selector": selector,
        "accelerator": accelerator,
        "endpoint": endpoint,
        "servedModel": models[0] if models else "",
        "conditions": conditions,
        "pods": entries,
        "lastFailure": last_failure,
    }


def with_transitions(new: dict[str, Any], old: dict[str, Any] | None, now: str) -> dict[str, Any]:
    """Stamp conditions with lastTransitionTime (kept when the status did not flip) and observedGeneration.

    Args:
        new: output of compute_status.
        old: the status currently stored on the object (or None).
        now: RFC 3339 time, e.g. "2026-01-01T00:00:00Z".
    Returns:
        `new` with stamped conditions (a new dict).
    """
    before = {c.get("type"): c for c in (old or {}).get("conditions") or []}
    conds = []
    for c in new["conditions"]:
        prev = before.get(c["type"])
        when = prev.get("lastTransitionTime") if prev and prev.get("status") == c["status"] else None
        conds.append({**c, "lastTransitionTime": when or now, "observedGeneration": new["observedGeneration"]})
    return {**new, "conditions": conds}


def with_wake(new: dict[str, Any], old: dict[str, Any] | None, now: str) -> dict[str, Any]:
    """Track a wake from zero (pure): `wake` {startedAt} when the stored phase was Idle and the new one is not,
    {startedAt, readyAt, seconds} once a replica is ready, kept until the next wake. While it lasts, a booting
    phase reads `Waking`, its reason and message still the booting pod's.

    Args:
        new: output of compute_status (or with_transitions).
        old: the status currently stored (or None).
        now: RFC 3339 time, e.g. "2026-01-01T00:00:00Z".
    """
    old = old or {}
    wake = dict(old.get("wake") or {})
    if old.get("phase") == IDLE and new["phase"] != IDLE:
        wake = {"startedAt": now}
    if wake and "readyAt" not in wake and new["readyReplicas"] > 0:
        wake.update(readyAt=now, seconds=_seconds_between(wake["startedAt"], now))
    out = {**new, "wake": wake or None}
    if wake and "readyAt" not in wake and new["phase"] in BOOT_ORDER[:-1]:
        out.update(phase=WAKING, message=f"waking from zero since {wake['startedAt']}: {new['message']}")
    return out


def _seconds_between(start: str, end: str) -> int:
    def parse(t: str) -> datetime:
        return datetime.fromisoformat(t.replace("Z", "+00:00"))
    return max(0, round((parse(end) - parse(start)).total_seconds()))


def status_changed(new: dict[str, Any], old: dict[str, Any] | None) -> bool:
    """True when writing `new` would change what is stored (only the keys we own are compared)."""
    old = old or {}
    return any(old.get(k) != v for k, v in new.items())


def transition_events(new: dict[str, Any], old: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """Events to post for a status change: (type Normal|Warning, reason, message).

    One event per phase change, and one when the Degraded reason changes within the same phase.
    """
    old = old or {}
    events = []
    warn = new["phase"] in (FAILED, DEGRADED)
    if old.get("phase") != new["phase"]:
        before = old.get("phase") or "none"
        events.append(("Warning" if warn else "Normal", new["phase"],
                       f"phase {before} -> {new['phase']}: {new['message']}".rstrip(": ")))
    else:
        def degraded_reason(status: dict[str, Any]) -> str:
            return next((c.get("reason", "") for c in status.get("conditions") or []
                         if c.get("type") == "Degraded" and c.get("status") == "True"), "")

        if degraded_reason(new) and degraded_reason(new) != degraded_reason(old):
            events.append(("Warning", degraded_reason(new), new["message"]))
    return events
