"""The pod spec -> `docker run` translation the image tests run containers with (pure; no Docker needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.images.containers import TMPFS, run_args

POD = {
    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000},
    "volumes": [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}},
                {"name": "model", "persistentVolumeClaim": {"claimName": "m", "readOnly": True}}],
    "containers": [{
        "name": "server",
        "command": ["python", "-m", "gemma_server"],
        "args": ["--log-level=debug"],
        "env": [{"name": "GEMMA_PORT", "value": "8123"},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "volumeMounts": [{"name": "cache", "mountPath": "/var/cache/gemma"}, {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "model", "mountPath": "/models/pvc/m", "readOnly": True}],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
        "terminationMessagePath": "/dev/termination-log",
    }],
}


def test_a_pod_spec_becomes_docker_run_arguments():
    args = run_args(POD, name="c1", image="img:test", termination_log=Path("/host/term"),
                    volumes={"cache": "vol1", "tmp": TMPFS, "model": "/host/models"},
                    kubelet=["-e", "KUBERNETES_SERVICE_HOST=127.0.0.1"])
    assert args == [
        "run", "-d", "--name", "c1", "--network", "host",
        "--user", "1000:1000", "--group-add", "1000", "--read-only", "--security-opt", "no-new-privileges",
        "--cap-drop", "ALL",
        "-e", "GEMMA_PORT=8123", "-e", "POD_NAME=c1",
        "--mount", "type=volume,source=vol1,destination=/var/cache/gemma",
        "--mount", "type=tmpfs,destination=/tmp",
        "--mount", "type=bind,source=/host/models,destination=/models/pvc/m,readonly",
        "--mount", "type=bind,source=/host/term,destination=/dev/termination-log",
        "-e", "KUBERNETES_SERVICE_HOST=127.0.0.1",
        "--entrypoint", "python", "img:test", "-m", "gemma_server", "--log-level=debug",
    ]


def test_without_a_command_the_image_entrypoint_runs_with_the_args():
    pod = {"containers": [{"name": "op", "args": ["--liveness=http://0.0.0.0:8080/healthz"]}]}
    assert run_args(pod, name="c", image="img", volumes={}) == [
        "run", "-d", "--name", "c", "--network", "host", "img", "--liveness=http://0.0.0.0:8080/healthz"]


@pytest.mark.parametrize("change,message", [
    ({"volumes": []}, "volumeMount 'cache' names no volume of the pod"),
    ({"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]},
     "env T: only values and the pod name are supported here"),
])
def test_what_the_translation_cannot_honour_is_refused_by_name(change, message):
    pod = {**POD, "containers": [{**POD["containers"][0], **{k: v for k, v in change.items() if k != "volumes"}}]}
    if "volumes" in change:
        pod["volumes"] = change["volumes"]
    with pytest.raises(ValueError, match=message):
        run_args(pod, name="c", image="img", volumes={"cache": "v", "tmp": TMPFS, "model": "/m"})
