"""The facts of one Pod object (operator/gemma_operator/pods.py), from pods shaped as the API server returns
them."""

from __future__ import annotations

import pytest

from gemma_operator import pods


def pod(*, phase="Running", ready=None, statuses=(), init_statuses=(), deleting=False):
    meta = {"name": "g-1", "uid": "u-1", **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    status = {"phase": phase, "containerStatuses": list(statuses), "initContainerStatuses": list(init_statuses)}
    if ready is not None:
        status["conditions"] = [{"type": "PodScheduled", "status": "True"},
                                {"type": "Ready", "status": "True" if ready else "False"}]
    return {"metadata": meta, "status": status}


SIDECAR = {"name": "gke-gcsfuse-sidecar", "state": {"running": {"startedAt": "t"}}}
SERVER_WAITING = {"name": "server", "state": {"waiting": {"reason": "ContainerCreating"}}}
SERVER_RUNNING = {"name": "server", "state": {"running": {"startedAt": "t"}}}


def test_ready_is_the_ready_condition():
    assert pods.ready(pod(ready=True)) and not pods.ready(pod(ready=False)) and not pods.ready(pod())


@pytest.mark.parametrize("phase,terminal", [("Pending", False), ("Running", False), ("Failed", True),
                                            ("Succeeded", True)])
def test_failed_and_succeeded_pods_are_terminal(phase, terminal):
    assert pods.terminal(pod(phase=phase)) is terminal
    assert pods.running_phase(pod(phase=phase)) is (phase == "Running")


def test_the_server_status_is_the_server_containers_not_a_sidecars():
    p = pod(statuses=[SIDECAR, SERVER_WAITING])
    assert pods.server_status(p) == SERVER_WAITING and not pods.server_running(p)
    assert pods.server_running(pod(statuses=[SERVER_RUNNING]))
    assert pods.server_status(pod(statuses=[SIDECAR])) is None  # the server has no status yet
    native = pod(statuses=[SERVER_RUNNING], init_statuses=[SIDECAR])  # the sidecar as a native init container
    assert pods.container_status(native, "gke-gcsfuse-sidecar") == SIDECAR
    assert pods.container_statuses(native) == [SIDECAR, SERVER_RUNNING]


def test_deleting_is_a_deletion_timestamp():
    assert pods.deleting(pod(deleting=True)) and not pods.deleting(pod())
