"""Golden-dict tests of the pure status logic (operator/gemma_operator/status.py): each phase and condition
transition, from pod objects shaped as the API server returns them."""

from __future__ import annotations

import pytest

from gemma_operator import status as st
from gemma_operator.poller import keep_engine_fields

ACCEL, ENDPOINT, SELECTOR = "v5e 2x2", "http://g.ns.svc.cluster.local:8000/v1", "a=b"


def pod(name="g-1", *, node="v5e-2x2-a", scheduled=True, schedule_message="", running=True, ready=False,
        waiting=None, last_terminated=None, restarts=0, deleting=False):
    conditions = [{"type": "PodScheduled", "status": "True" if scheduled else "False",
                   **({"reason": "Unschedulable", "message": schedule_message} if not scheduled else {})}]
    if scheduled:
        conditions.append({"type": "Ready", "status": "True" if ready else "False"})
    cs = {"name": "server", "restartCount": restarts, "ready": ready, "state": {}}
    if running and not waiting:
        cs["state"] = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
    elif waiting:
        cs["state"] = {"waiting": waiting}
    else:
        cs["state"] = {"waiting": {"reason": "ContainerCreating"}}
    if last_terminated:
        cs["lastState"] = {"terminated": last_terminated}
    meta = {"name": name, "uid": f"uid-{name}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node if scheduled else None},
            "status": {"phase": "Running" if running and scheduled else "Pending", "conditions": conditions,
                       **({"containerStatuses": [cs]} if scheduled else {})}}


def observe(pods=(), *, replicas=1, engine=None, served_models=None, problems=(), requested=(), skipped=(),
            blockers=None, disruption=None, warnings=(), poll_errors=None):
    # Each report as the poller keeps it (status.py reads the kept report as it is).
    engine = {name: keep_engine_fields(doc) for name, doc in (engine or {}).items()}
    return st.Observed(generation=3, replicas=replicas, pods=list(pods), engine=engine,
                       served_models=served_models or {}, problems=list(problems),
                       optional={"Monitoring": list(requested)} if requested else {},
                       skipped=list(skipped), blockers=blockers or {}, disruption=disruption,
                       warnings=list(warnings), poll_errors=poll_errors or {})


def compute(obs):
    return st.compute_status(obs, accelerator=ACCEL, endpoint=ENDPOINT, selector=SELECTOR)


def conds(status):
    return {c["type"]: (c["status"], c["reason"], c["message"]) for c in status["conditions"]}


def test_no_pods_yet_is_pending():
    s = compute(observe())
    assert s == {
        "phase": "Pending", "reason": "WaitingForPods", "message": "0/1 pods created", "observedGeneration": 3,
        "replicas": 0, "readyReplicas": 0, "readyText": "0/1", "selector": SELECTOR, "accelerator": ACCEL,
        "endpoint": ENDPOINT, "servedModel": "", "pods": [], "lastFailure": None,
        "conditions": [
            {"type": "Ready", "status": "False", "reason": "WaitingForPods", "message": "0/1 pods created"},
            {"type": "Progressing", "status": "True", "reason": "WaitingForPods", "message": "0/1 pods created"},
            {"type": "Degraded", "status": "False", "reason": "AsExpected", "message": ""},
        ],
    }


def test_unschedulable_pod_shows_the_schedulers_message():
    msg = "0/6 nodes are available: 6 node(s) didn't match Pod's node affinity/selector."
    s = compute(observe([pod(scheduled=False, schedule_message=msg)]))
    assert s["phase"] == "Scheduling"
    assert conds(s)["Ready"] == ("False", "Unschedulable", f"pod g-1: {msg}")
    assert conds(s)["Progressing"] == ("True", "Unschedulable", f"pod g-1: {msg}")
    assert s["pods"] == [{"name": "g-1", "node": "", "ready": False, "stage": "Scheduling", "restarts": 0,
                          "reason": "Unschedulable", "message": msg}]


def test_scheduled_pod_with_container_starting_is_still_scheduling():
    s = compute(observe([pod(running=False)]))
    assert (s["phase"], s["reason"]) == ("Scheduling", "ContainerCreating")


@pytest.mark.parametrize("stage,phase", [
    ("build", "Building"), ("import", "Building"), ("smoke", "SmokeTesting"), ("weights", "LoadingWeights"),
    ("compile", "Compiling"), ("warmup", "WarmingUp"), ("serving", "WarmingUp"), (None, "Building")])
def test_engine_stage_sets_the_boot_phase(stage, phase):
    engine = {"g-1": {"stage": stage, "stages": [{"stage": "build", "status": "ok", "seconds": 12.3456}]}} \
        if stage else {}
    s = compute(observe([pod()], engine=engine))
    assert s["phase"] == phase
    assert conds(s)["Progressing"][0] == "True"
    if stage:
        assert s["pods"][0]["engineStage"] == stage
        assert s["pods"][0]["stages"] == [{"stage": "build", "status": "ok", "seconds": 12.346}]


def test_engine_reporting_a_failed_stage_fails_the_pod():
    engine = {"g-1": {"stage": "smoke", "failed": "matmul mismatch on tpu", "stages": []}}
    s = compute(observe([pod()], engine=engine))
    assert s["phase"] == "Failed"
    assert conds(s)["Degraded"] == ("True", "BootStageFailed", "pod g-1: stage smoke: matmul mismatch on tpu")


def test_a_pod_running_several_engines_shows_how_many():
    engines = [{"index": i, "device": f"tpu:{i}", "max_batch": 8, "active": 0} for i in range(4)]
    s = compute(observe([pod()], engine={"g-1": {"stage": "serving", "engines": engines}}))
    assert s["pods"][0]["engines"] == 4
    assert "engines" not in compute(observe([pod()], engine={"g-1": {"stage": "serving"}}))["pods"][0]


def test_why_the_last_poll_got_no_report_is_shown_while_waiting_for_one():
    s = compute(observe([pod()], poll_errors={"g-1": "redirect refused (HTTP 302)"}))
    assert s["pods"][0]["message"] == "waiting for the server's /v1/engine report (last poll: redirect refused (HTTP 302))"


def test_least_advanced_booting_pod_sets_the_phase():
    engine = {"g-1": {"stage": "warmup"}, "g-2": {"stage": "smoke"}}
    s = compute(observe([pod("g-1"), pod("g-2")], replicas=2, engine=engine))
    assert s["phase"] == "SmokeTesting"
    assert s["message"] == "pod g-2: engine stage smoke"


def test_all_ready_is_ready_with_served_model():
    s = compute(observe([pod(ready=True)], served_models={"g-1": "gemma-4"}))
    assert s["phase"] == "Ready"
    assert s["servedModel"] == "gemma-4"
    assert s["readyText"] == "1/1"
    assert conds(s) == {"Ready": ("True", "AllReplicasReady", "1/1 replicas ready"),
                        "Progressing": ("False", "RolloutComplete", "1/1 replicas ready"),
                        "Degraded": ("False", "AsExpected", "")}
    assert s["reason"] == "AllReplicasReady"


def test_crashing_container_fails_with_its_termination_message():
    term = {"exitCode": 1, "reason": "Error", "message": "smoke: matmul mismatch on tpu (max abs err 3.1)\n"}
    p = pod(waiting={"reason": "CrashLoopBackOff", "message": "back-off 40s"}, last_terminated=term, restarts=3)
    s = compute(observe([p]))
    assert s["phase"] == "Failed"
    assert conds(s)["Degraded"] == ("True", "CrashLoopBackOff", "pod g-1: smoke: matmul mismatch on tpu (max abs err 3.1)")
    assert conds(s)["Ready"][1] == "CrashLoopBackOff"
    assert conds(s)["Progressing"][0] == "False"
    assert s["lastFailure"] == {"pod": "g-1", "reason": "Error", "exitCode": 1,
                                "message": "smoke: matmul mismatch on tpu (max abs err 3.1)"}


def test_one_ready_one_crashing_is_degraded():
    bad = pod("g-2", waiting={"reason": "CrashLoopBackOff"}, last_terminated={"exitCode": 137, "reason": "OOMKilled"})
    s = compute(observe([pod("g-1", ready=True), bad], replicas=2))
    assert s["phase"] == "Degraded"
    assert conds(s)["Degraded"] == ("True", "CrashLoopBackOff", "pod g-2: CrashLoopBackOff")
    assert s["lastFailure"] == {"pod": "g-2", "reason": "OOMKilled", "exitCode": 137, "message": ""}
    assert conds(s)["Ready"][0] == "False"


def test_a_non_fatal_problem_is_degraded_even_when_pods_run():
    problem = st.Problem("ApplyRejected", "PodDisruptionBudget g: forbidden", fatal=False)
    s = compute(observe([pod(ready=True)], problems=[problem]))
    assert s["phase"] == "Degraded"
    assert conds(s)["Degraded"] == ("True", "ApplyRejected", "PodDisruptionBudget g: forbidden")
    assert conds(s)["Ready"][0] == "True"  # what runs still serves


def test_unknown_accelerator_fails():
    problem = st.Problem("UnknownAccelerator", "spec.accelerator.type 'tpu-v9' is not supported", fatal=True)
    s = compute(observe([], problems=[problem]))
    assert s["phase"] == "Failed"
    assert conds(s) == {
        "Ready": ("False", "UnknownAccelerator", "spec.accelerator.type 'tpu-v9' is not supported"),
        "Progressing": ("False", "UnknownAccelerator", "spec.accelerator.type 'tpu-v9' is not supported"),
        "Degraded": ("True", "UnknownAccelerator", "spec.accelerator.type 'tpu-v9' is not supported")}


def test_zero_replicas_is_stopped():
    s = compute(observe([], replicas=0))
    assert (s["phase"], s["reason"], s["readyText"]) == ("Stopped", "ScaledToZero", "0/0")


def test_a_server_that_scales_to_zero_is_idle_at_zero_not_stopped():
    s = compute(observe([], replicas=0)._replace(scales_to_zero=True))
    assert (s["phase"], s["reason"]) == ("Idle", "ScaledToZero")
    assert "the next request is held and wakes it" in s["message"]


T0, T1, T2 = "2026-01-01T00:00:00Z", "2026-01-01T00:00:05Z", "2026-01-01T00:01:17Z"


def test_a_wake_from_zero_reads_waking_while_it_boots_and_keeps_how_long_it_took():
    idle = st.with_wake(compute(observe([], replicas=0)._replace(scales_to_zero=True)), None, T0)
    assert idle["wake"] is None
    booting = compute(observe([pod(running=False)], replicas=1)._replace(scales_to_zero=True))
    waking = st.with_wake(booting, idle, T1)
    assert waking["phase"] == "Waking" and waking["reason"] == "ContainerCreating"
    assert waking["message"].startswith(f"waking from zero since {T1}: pod g-1")
    assert waking["wake"] == {"startedAt": T1}
    # Still booting at the next status: still Waking, the start kept.
    assert st.with_wake(booting, waking, T2)["wake"] == {"startedAt": T1}
    ready = st.with_wake(compute(observe([pod(ready=True)], replicas=1)._replace(scales_to_zero=True)), waking, T2)
    assert ready["phase"] == "Ready" and ready["wake"] == {"startedAt": T1, "readyAt": T2, "seconds": 72}
    # Kept while it serves, and replaced by the next wake.
    assert st.with_wake(ready, ready, T2)["wake"] == ready["wake"]
    assert st.with_wake(booting, {**ready, "phase": "Idle"}, T0)["wake"] == {"startedAt": T0}


def test_a_wake_that_fails_shows_the_failure_not_waking():
    idle = {"phase": "Idle"}
    crashing = compute(observe([pod(waiting={"reason": "CrashLoopBackOff", "message": "back-off"})],
                               replicas=1)._replace(scales_to_zero=True))
    out = st.with_wake(crashing, idle, T1)
    assert out["phase"] == "Failed" and out["wake"] == {"startedAt": T1}


def test_a_server_never_at_zero_has_no_wake():
    s = st.with_wake(compute(observe([pod(ready=True)])), {"phase": "Ready"}, T1)
    assert s["wake"] is None and s["phase"] == "Ready"


def test_terminating_pods_are_ignored():
    s = compute(observe([pod("old", deleting=True), pod("new", ready=True)]))
    assert s["phase"] == "Ready"
    assert [p["name"] for p in s["pods"]] == ["new"]


def test_monitoring_condition_reports_skipped_kinds():
    s = compute(observe([pod(ready=True)], requested=["PodMonitoring"],
                        skipped=[("PodMonitoring", "monitoring.googleapis.com/v1 is not served")]))
    assert conds(s)["Monitoring"] == ("False", "MonitoringCRDMissing",
                                      "PodMonitoring skipped: monitoring.googleapis.com/v1 is not served")
    ok = compute(observe([pod(ready=True)], requested=["PodMonitoring"]))
    assert conds(ok)["Monitoring"] == ("True", "Configured", "created PodMonitoring")


def test_transition_time_kept_while_status_holds_and_moved_when_it_flips():
    first = st.with_transitions(compute(observe([pod()])), None, "2026-01-01T00:00:00Z")
    assert {c["lastTransitionTime"] for c in first["conditions"]} == {"2026-01-01T00:00:00Z"}
    assert {c["observedGeneration"] for c in first["conditions"]} == {3}
    same = st.with_transitions(compute(observe([pod()], engine={"g-1": {"stage": "weights"}})), first,
                               "2026-01-01T00:01:00Z")
    assert [c["lastTransitionTime"] for c in same["conditions"]] == ["2026-01-01T00:00:00Z"] * 3
    ready = st.with_transitions(compute(observe([pod(ready=True)])), same, "2026-01-01T00:02:00Z")
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times == {"Ready": "2026-01-01T00:02:00Z", "Progressing": "2026-01-01T00:02:00Z",
                     "Degraded": "2026-01-01T00:00:00Z"}
    assert not st.status_changed(ready, ready)
    assert st.status_changed(ready, same)


def test_events_at_each_phase_transition():
    building = compute(observe([pod()]))
    ready = compute(observe([pod(ready=True)]))
    assert st.transition_events(building, None) == [
        ("Normal", "Building", "phase none -> Building: pod g-1: waiting for the server's /v1/engine report")]
    assert st.transition_events(ready, building) == [("Normal", "Ready", "phase Building -> Ready: 1/1 replicas ready")]
    assert st.transition_events(ready, ready) == []
    failed = compute(observe([pod(waiting={"reason": "CrashLoopBackOff"})]))
    assert st.transition_events(failed, ready)[0][:2] == ("Warning", "Failed")


def test_a_pod_that_cannot_start_fails_with_the_reason_events_found():
    why = ("GcsFusePermissionDenied", "MountVolume.SetUp failed ... (the pod runs as ServiceAccount ns/default; ...)")
    s = compute(observe([pod(running=False)], blockers={"g-1": why}))
    assert (s["phase"], s["reason"], s["message"]) == ("Failed", why[0], f"pod g-1: {why[1]}")
    assert conds(s)["Ready"] == ("False", why[0], f"pod g-1: {why[1]}")
    assert conds(s)["Degraded"] == ("True", why[0], f"pod g-1: {why[1]}")
    assert s["pods"][0]["reason"] == why[0] and s["pods"][0]["message"] == why[1]


def test_a_terminal_pod_is_not_a_replica_and_its_disruption_leads_the_wait():
    gone = pod("g-old", running=False)
    gone["status"]["phase"] = "Failed"
    wait = "0/6 nodes are available: 6 Insufficient google.com/tpu."
    why = ("NodePreempted", "pod g-old on spot node v5e-2x2-spot-a: Pod was terminated in response to imminent node "
                            "shutdown.")
    s = compute(observe([gone, pod("g-new", scheduled=False, schedule_message=wait)], disruption=why))
    assert s["replicas"] == 1 and [p["name"] for p in s["pods"]] == ["g-new"]
    assert (s["phase"], s["reason"]) == ("Scheduling", "NodePreempted")
    assert s["message"] == f"{why[1]}; now pod g-new: {wait}"
    # Ready wins over an old disruption.
    assert compute(observe([gone, pod("g-new", ready=True)], disruption=why))["reason"] == "AllReplicasReady"


def test_spec_warnings_are_a_warning_condition_not_degraded():
    warnings = [("EphemeralBuildCache", "spec.buildCache.type emptyDir on spot capacity: ..."),
                ("DrainExceedsReclaimGrace", "spec.server.shutdownTimeoutSeconds 30 s ...")]
    s = compute(observe([pod(ready=True)], warnings=warnings))
    assert s["phase"] == "Ready"
    assert conds(s)["Degraded"][0] == "False"
    assert conds(s)["Warning"] == ("True", "EphemeralBuildCache",
                                   "spec.buildCache.type emptyDir on spot capacity: ...; "
                                   "spec.server.shutdownTimeoutSeconds 30 s ...")
    assert "Warning" not in conds(compute(observe([pod(ready=True)])))


# ---------------------------------------------------------------------------------------------------------
# Optional kinds: Gateway and ScalingActive


def test_a_missing_inference_pool_crd_is_a_gateway_condition_naming_it_and_the_pod_still_serves():
    why = "inference.networking.k8s.io/v1 is not served by this cluster: CRD inferencepools.inference.networking.k8s.io"
    s = compute(st.Observed(generation=1, replicas=1, pods=[pod(ready=True)], engine={}, served_models={},
                            problems=[], optional={"Gateway": ["InferencePool"]}, skipped=[("InferencePool", why)]))
    assert conds(s)["Gateway"] == ("False", "CRDMissing", f"InferencePool skipped: {why}")
    assert s["phase"] == "Ready"


def test_another_pool_over_the_servers_pods_makes_the_gateway_condition_false_naming_it():
    s = compute(st.Observed(generation=1, replicas=1, pods=[pod(ready=True)], engine={}, served_models={},
                            problems=[], optional={"Gateway": ["InferencePool"]}, skipped=[],
                            foreign_pools=["upstream", "another"]))
    status, reason, message = conds(s)["Gateway"]
    assert (status, reason) == ("False", "ForeignInferencePool")
    assert message.startswith("InferencePool another, upstream (not this server's) also selects its pods")
    assert "examples/endpoint-picker.yaml" in message
    assert s["phase"] == "Ready"  # serving is not in question, only the route


def scaled(hpa, kind="HorizontalPodAutoscaler", skipped=()):
    view = st.ScalingView("g", "1..4 replicas, gemma_num_requests_waiting 4 per pod", "gemma_num_requests_waiting",
                          "g" if kind == "HorizontalPodAutoscaler" else "keda-hpa-g", hpa)
    obs = st.Observed(generation=1, replicas=1, pods=[pod(ready=True)], engine={}, served_models={}, problems=[],
                      optional={"ScalingActive": [kind]}, skipped=list(skipped), scaling=None if skipped else view)
    return conds(compute(obs))["ScalingActive"]


def hpa(active, reason="ValidMetricFound", message="the HPA was able to successfully calculate a replica count"):
    return {"status": {"currentReplicas": 1, "desiredReplicas": 2, "conditions": [
        {"type": "AbleToScale", "status": "True", "reason": "SucceededGetScale"},
        {"type": "ScalingActive", "status": active, "reason": reason, "message": message}]}}


def test_scaling_active_names_the_object_that_drives_the_replicas():
    assert scaled(hpa("True")) == (
        "True", "HorizontalPodAutoscaler", "HorizontalPodAutoscaler g drives the replicas (1..4 replicas, "
        "gemma_num_requests_waiting 4 per pod); desired 2, current 1")


def test_an_hpa_that_cannot_get_its_pods_metric_says_no_adapter_serves_it():
    status, reason, message = scaled(hpa("False", "FailedGetPodsMetric",
                                         "the HPA was unable to compute the replica count: unable to get metric "
                                         "gemma_num_requests_waiting: no custom metrics API (custom.metrics.k8s.io) "
                                         "registered"))
    assert (status, reason) == ("False", "FailedGetPodsMetric")
    assert "no custom-metrics adapter serves the Pods metric gemma_num_requests_waiting" in message
    assert message.endswith("no custom metrics API (custom.metrics.k8s.io) registered")


def test_a_keda_hpa_that_cannot_get_its_external_metric_points_at_prometheus():
    status, reason, message = scaled(hpa("False", "FailedGetExternalMetric", "unable to get external metric"),
                                     kind="ScaledObject")
    assert (status, reason) == ("False", "FailedGetExternalMetric")
    assert message.startswith("ScaledObject g drives the replicas") and "serverAddress reachable" in message
    assert "HorizontalPodAutoscaler keda-hpa-g: unable to get external metric" in message


def test_a_long_copied_hpa_message_is_cut_with_an_ellipsis_and_redacted():
    body = "error: " + "x" * 5000 + " tail"
    *_, message = scaled(hpa("False", "FailedGetExternalMetric", body), kind="ScaledObject")
    copied = message.split("HorizontalPodAutoscaler keda-hpa-g: ", 1)[1]
    assert len(copied) == st.MAX_COPIED_MESSAGE and copied.endswith("…") and copied.startswith("error: xxx")
    assert "tail" not in message
    *_, message = scaled(hpa("False", "FailedGetExternalMetric",
                             "Get http://u:hunter2secret@prom:9090/api/v1/query: 401"), kind="ScaledObject")
    assert "hunter2secret" not in message and "[redacted]" in message and message.endswith(": 401")


def test_excerpt_keeps_short_text_and_bounds_long_text():
    assert st.excerpt("short") == "short"
    cut = st.excerpt("y " * 1000, limit=20)
    assert len(cut) <= 20 and cut.endswith("y…")  # the cut drops a trailing space before the mark


def test_before_the_hpa_reports_scaling_is_unknown():
    assert scaled(None)[:2] == ("Unknown", "WaitingForAutoscaler")
    assert scaled({"status": {}})[:2] == ("Unknown", "WaitingForAutoscaler")


def test_a_missing_keda_crd_leaves_spec_replicas_in_charge():
    status, reason, message = scaled(None, kind="ScaledObject", skipped=[("ScaledObject", "CRD scaledobjects.keda.sh")])
    assert (status, reason) == ("False", "CRDMissing")
    assert message == "ScaledObject skipped: CRD scaledobjects.keda.sh; spec.replicas drives the replicas"


@pytest.mark.parametrize("code,optional,outcome", [
    (404, True, "skipped"), (405, True, "skipped"), (404, False, "retry"), (422, False, "problem"),
    (403, True, "problem"), (500, True, "retry"), (409, False, "retry"),
])
def test_apply_errors_are_classified(code, optional, outcome):
    obj = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "g"}}
    failure = st.classify_apply_error(obj, code, "refused", missing="CRD scaledobjects.keda.sh is gone" if optional else None)
    got = "skipped" if failure.skipped else "problem" if failure.problem else "retry"
    assert got == outcome
    if failure.problem:
        assert failure.problem == st.Problem("ApplyRejected", "ScaledObject g: refused", fatal=False)
    if failure.skipped:
        assert failure.skipped == ("ScaledObject", "CRD scaledobjects.keda.sh is gone")
