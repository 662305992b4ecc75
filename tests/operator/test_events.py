"""Unit tests of gemma_operator.events: pods and Events shaped as the kubelet and the API server write them ->
why a pod is stuck. The wording of the messages is the upstream one (the module docstring says where from)."""

from __future__ import annotations

from gemma_operator import events as ev

PERMISSION = ('MountVolume.SetUp failed for volume "model" : rpc error: code = PermissionDenied desc = failed to '
              'get GCS bucket "weights": googleapi: Error 403: Caller does not have storage.objects.list access to '
              "the Google Cloud Storage bucket. Permission 'storage.objects.list' denied on resource (or it may not "
              "exist)., forbidden")
NO_BUCKET = ('MountVolume.SetUp failed for volume "model" : rpc error: code = NotFound desc = failed to get GCS '
             'bucket "weights": storage: bucket doesn\'t exist')


def pod(name="g-1", *, uid=None, server_state=None, last=None, restarts=0, sidecar=None, phase="Pending",
        ready=False, sa=None, status_extra=None, created="2026-01-01T00:00:00Z", node_selector=None, limits=None,
        deleting=False):
    container = {"name": "server", "resources": {"limits": limits} if limits else {}}
    spec = {"nodeName": "v5e-1x1-a", "containers": [container], "nodeSelector": node_selector or {}}
    if sa:
        spec["serviceAccountName"] = sa
    cs = {"name": "server", "restartCount": restarts, "state": server_state or {"waiting": {"reason": "ContainerCreating"}}}
    if last:
        cs["lastState"] = {"terminated": last}
    status = {"phase": phase, "containerStatuses": [cs],
              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if sidecar:
        status["initContainerStatuses"] = [{"name": "gke-gcsfuse-sidecar", **sidecar}]
    status.update(status_extra or {})
    meta = {"name": name, "namespace": "models", "uid": uid or f"uid-{name}", "creationTimestamp": created}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T01:00:00Z"
    return {"metadata": meta, "spec": spec, "status": status}


def event(p, reason, message, *, when="2026-01-01T00:00:10Z", field_path=None, type_="Warning"):
    obj = {"kind": "Pod", "name": p["metadata"]["name"], "uid": p["metadata"]["uid"]}
    if field_path:
        obj["fieldPath"] = field_path
    return {"metadata": {"name": "e"}, "involvedObject": obj, "reason": reason, "message": message, "type": type_,
            "lastTimestamp": when, "source": {"component": "kubelet"}}


def test_gcs_permission_denied_mount_names_the_service_account_and_the_role():
    p = pod(sa="gemma-reader")
    b = ev.pod_blocker(p, [event(p, "FailedMount", PERMISSION)])
    assert b.reason == "GcsFusePermissionDenied"
    assert b.message.startswith(PERMISSION)
    assert "the pod runs as ServiceAccount models/gemma-reader" in b.message
    assert "roles/storage.objectViewer" in b.message


def test_a_missing_bucket_and_a_pod_without_a_service_account():
    p = pod()
    b = ev.pod_blocker(p, [event(p, "FailedMount", NO_BUCKET)])
    assert b.reason == "GcsFuseBucketNotFound"
    assert "ServiceAccount models/default" in b.message


def test_the_latest_mount_event_wins_and_other_pods_events_are_ignored():
    p, other = pod(), pod("g-2")
    events = [event(p, "FailedMount", NO_BUCKET, when="2026-01-01T00:00:05Z"),
              event(p, "FailedMount", PERMISSION, when="2026-01-01T00:01:05Z"),
              event(other, "FailedMount", "MountVolume.SetUp failed for volume \"x\" : other")]
    assert ev.pod_blocker(p, events).reason == "GcsFusePermissionDenied"
    assert ev.blockers([p, other], events)["g-2"].reason == "FailedMount"


def test_a_mount_event_from_before_the_container_started_no_longer_blocks():
    p = pod(server_state={"running": {"startedAt": "2026-01-01T00:02:00Z"}}, phase="Running")
    assert ev.pod_blocker(p, [event(p, "FailedMount", PERMISSION)]) is None
    assert ev.pod_blocker(pod(ready=True, phase="Running"), [event(p, "FailedMount", PERMISSION)]) is None


def test_sandbox_failure():
    p = pod()
    msg = 'Failed to create pod sandbox: rpc error: code = Unknown desc = failed to setup network for sandbox "abc"'
    assert ev.pod_blocker(p, [event(p, "FailedCreatePodSandBox", msg)]) == ev.Blocker("FailedCreatePodSandBox", msg)


def test_image_pull_back_off_carries_the_pull_error_from_the_event():
    p = pod(server_state={"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "ex.com/s:9"'}})
    pull = ('Failed to pull image "ex.com/s:9": rpc error: code = NotFound desc = failed to pull and unpack image '
            '"ex.com/s:9": not found')
    events = [event(p, "Failed", pull, field_path="spec.containers{server}"),
              event(p, "Failed", "Error: ErrImagePull", field_path="spec.containers{server}")]
    assert ev.pod_blocker(p, events) == ev.Blocker("ImagePullBackOff", f"container server: {pull}")


def test_a_missing_token_secret_is_the_pods_own_config_error():
    p = pod(server_state={"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "hf" not found'}})
    b = ev.pod_blocker(p, [])
    assert b.reason == "SecretNotFound"
    assert b.message.startswith('Secret "hf" not found in namespace models: container server reads it')
    no_key = pod(server_state={"waiting": {"reason": "CreateContainerConfigError",
                                           "message": "couldn't find key token in Secret models/hf"}})
    assert ev.pod_blocker(no_key, []).reason == "SecretKeyNotFound"


def test_oom_killed_while_down_names_the_memory_limit():
    p = pod(server_state={"waiting": {"reason": "CrashLoopBackOff"}}, restarts=3, phase="Running",
            last={"reason": "OOMKilled", "exitCode": 137}, limits={"memory": "48Gi"})
    b = ev.pod_blocker(p, [])
    assert b.reason == "OOMKilled"
    assert b.message.startswith("container server was killed for exceeding its memory limit 48Gi (exit code 137, "
                                "3 restarts)")
    # Restarted and booting again: the kill is history (status.lastFailure keeps it), not a blocker.
    again = pod(server_state={"running": {}}, restarts=3, phase="Running", last={"reason": "OOMKilled", "exitCode": 137})
    assert ev.pod_blocker(again, []) is None


def test_a_crashing_gcs_fuse_sidecar():
    p = pod(sidecar={"state": {"waiting": {"reason": "CrashLoopBackOff"}},
                     "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}})
    b = ev.pod_blocker(p, [])
    assert b.reason == "GcsFuseSidecarFailed"
    assert b.message.startswith("container gke-gcsfuse-sidecar OOMKilled (exit code 137); raise the pod annotation "
                                "gke-gcsfuse/memory-limit")


def test_pods_to_explain_are_the_live_unready_ones_whose_events_can_say_why():
    booting = pod("e", server_state={"running": {}}, phase="Running")
    pulling = pod("f", server_state={"running": {}}, phase="Running",
                  sidecar={"state": {"waiting": {"reason": "ImagePullBackOff"}}})
    pods = [pod("a"), pod("b", ready=True), pod("c", deleting=True), pod("d", phase="Failed"), booting, pulling]
    assert [p["metadata"]["name"] for p in ev.pods_to_explain(pods)] == ["a", "f"]
    # What pod_blocker makes of a started pod does not depend on its Events.
    p = booting
    assert ev.pod_blocker(p, [event(p, "FailedMount", PERMISSION), event(p, "Failed", "Failed to pull image")]) is None


SHUTDOWN = {"phase": "Failed", "reason": "Terminated", "message": "Pod was terminated in response to imminent node "
            "shutdown.", "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
                                          "message": "Pod was terminated in response to imminent node shutdown.",
                                          "lastTransitionTime": "2026-01-01T00:10:00Z"}]}


def test_a_pod_shut_down_with_its_spot_node_is_preempted_while_its_replacement_waits():
    gone = pod("g-old", node_selector={"cloud.google.com/gke-spot": "true"}, status_extra=SHUTDOWN)
    waiting = pod("g-new", created="2026-01-01T00:10:01Z")
    b = ev.disruption([gone, waiting])
    assert b.reason == "NodePreempted"
    assert b.message.startswith("pod g-old on spot node v5e-1x1-a: Pod was terminated in response to imminent node "
                                "shutdown.")
    # Once the replacement runs, the preemption is history.
    started = pod("g-new", created="2026-01-01T00:10:01Z", server_state={"running": {}}, phase="Running")
    assert ev.disruption([gone, started]) is None
    # A pod older than the disruption is not its replacement.
    assert ev.disruption([gone, pod("g-other", created="2026-01-01T00:00:00Z")]) is None


def test_the_same_shutdown_on_a_standard_node_and_an_eviction():
    gone = pod("g-old", status_extra=SHUTDOWN)
    assert ev.disruption([gone]).reason == "NodeShutdown"
    evicted = pod("g-old", status_extra={"phase": "Failed", "reason": "Evicted", "startTime": "2026-01-01T00:00:00Z",
                                         "message": "The node was low on resource: memory."})
    b = ev.disruption([evicted, pod("g-new", created="2026-01-01T00:05:00Z")])
    assert b == ev.Blocker("Evicted", "pod g-old on node v5e-1x1-a: The node was low on resource: memory.")


def test_a_flex_start_node_that_ends_is_preempted_too():
    gone = pod("g-old", node_selector={"cloud.google.com/gke-flex-start": "true"},
               status_extra={**SHUTDOWN, "conditions": [{**SHUTDOWN["conditions"][0], "reason": "DeletionByPodGC",
                                                         "message": "PodGC: node no longer exists"}]})
    b = ev.disruption([gone])
    assert b == ev.Blocker("NodePreempted", "pod g-old on flex-start node v5e-1x1-a: PodGC: node no longer exists "
                                            "(GKE reclaimed the node; a replacement waits for flex-start capacity)")
