"""Docker for the image tests: build an image from an unmodified Dockerfile, and run a container the way the
kubelet runs a pod's container.

`run_args` turns a pod spec (the Deployment the operator builds, or the one the chart renders) into
`docker run` arguments: the pod's and container's securityContext (user, groups, read-only root
filesystem, dropped capabilities, no privilege escalation), the container's command, args and env, its
volume mounts (each volume given a Docker source by the caller: a named volume for an emptyDir that
must outlive a container restart, a host directory for a PVC, tmpfs for a scratch emptyDir) and the
termination message file, which Kubernetes bind-mounts at `terminationMessagePath`. Containers use the
host's network (the Docker engine of the tests has no bridge).

The client is `$DOCKER` (tests/images/docker_engine.sh exports one that builds with BuildKit).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TMPFS = "tmpfs"  # a volume source: a tmpfs, for a scratch emptyDir


class DockerError(AssertionError):
    """A docker command failed; the message holds its output's tail."""


def client() -> str:
    return os.environ.get("DOCKER", "docker")


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([client(), *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "DOCKER_BUILDKIT": "1"})
    if check and p.returncode != 0:
        raise DockerError(f"{client()} {' '.join(args[:3])} ... failed ({p.returncode}):\n{p.stdout[-3000:]}\n"
                          f"{p.stderr[-3000:]}")
    return p


def engine_answers() -> str | None:
    """None when a Docker engine answers, else why not."""
    try:
        p = docker("version", "--format", "{{.Server.Version}}", timeout=30, check=False)
    except FileNotFoundError:
        return f"no docker client {client()!r} on PATH"
    return None if p.returncode == 0 else (p.stderr.strip() or p.stdout.strip())


@dataclass(frozen=True)
class Build:
    """One `docker build` of a Dockerfile: the image id and how long it took."""

    image: str
    seconds: float
    log: str


def build(dockerfile: Path, tag: str, timeout: float) -> Build:
    """`docker build -f <dockerfile> -t <tag> .` from the repository root, on the host's network."""
    t0 = time.monotonic()
    p = docker("build", "--network", "host", "-f", str(dockerfile.relative_to(ROOT)), "-t", tag, ".",
               timeout=timeout, check=False)
    seconds = time.monotonic() - t0
    if p.returncode != 0:
        raise DockerError(f"docker build -f {dockerfile.relative_to(ROOT)} failed ({p.returncode}):\n"
                          f"{p.stderr[-6000:]}")
    image = docker("image", "inspect", "--format", "{{.Id}}", tag).stdout.strip()
    return Build(image, seconds, p.stderr)


def image_size(image: str) -> int:
    return int(docker("image", "inspect", "--format", "{{.Size}}", image).stdout)


def _env_args(env: list[dict[str, Any]], pod_name: str) -> list[str]:
    out = []
    for e in env:
        if "value" in e:
            out += ["-e", f"{e['name']}={e['value']}"]
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            out += ["-e", f"{e['name']}={pod_name}"]
        else:
            raise ValueError(f"env {e['name']}: only values and the pod name are supported here, got {e}")
    return out


def _security_args(pod: Mapping[str, Any], container: Mapping[str, Any]) -> list[str]:
    psc, csc = pod.get("securityContext", {}), container.get("securityContext", {})
    uid, gid = csc.get("runAsUser", psc.get("runAsUser")), csc.get("runAsGroup", psc.get("runAsGroup"))
    out = []
    if uid is not None:
        out += ["--user", f"{uid}:{gid}" if gid is not None else str(uid)]
    for group in [psc["fsGroup"]] if "fsGroup" in psc else []:
        out += ["--group-add", str(group)]
    for group in psc.get("supplementalGroups", []):
        out += ["--group-add", str(group)]
    if csc.get("readOnlyRootFilesystem"):
        out.append("--read-only")
    if csc.get("allowPrivilegeEscalation") is False:
        out += ["--security-opt", "no-new-privileges"]
    caps = csc.get("capabilities", {})
    out += [a for c in caps.get("drop", []) for a in ("--cap-drop", c)]
    out += [a for c in caps.get("add", []) for a in ("--cap-add", c)]
    return out


def _mount_args(pod: Mapping[str, Any], container: Mapping[str, Any], sources: Mapping[str, str]) -> list[str]:
    declared = {v["name"] for v in pod.get("volumes", [])}
    out = []
    for m in container.get("volumeMounts", []):
        name, target = m["name"], m["mountPath"]
        if name not in declared:
            raise ValueError(f"volumeMount {name!r} names no volume of the pod")
        if name not in sources:
            raise ValueError(f"no Docker source given for the pod's volume {name!r}")
        src = sources[name]
        if src == TMPFS:
            out += ["--mount", f"type=tmpfs,destination={target}"]
        else:
            kind = "bind" if src.startswith("/") else "volume"
            ro = ",readonly" if m.get("readOnly") else ""
            out += ["--mount", f"type={kind},source={src},destination={target}{ro}"]
    return out


def run_args(pod: Mapping[str, Any], *, name: str, image: str, volumes: Mapping[str, str],
             termination_log: Path | None = None, kubelet: Sequence[str] = ()) -> list[str]:
    """`docker run -d` arguments that run the pod's only container as the kubelet would (pure).

    Args:
        pod: a pod spec (a Deployment's `spec.template.spec`) with one container.
        name: the container's name; also what a `metadata.name` field reference gets.
        image: the image to run (instead of the container's `image`, which names a registry).
        volumes: for each volume of the pod that the container mounts: a named Docker volume, an absolute
            host path (bind mount), or TMPFS.
        termination_log: the host file mounted at the container's terminationMessagePath.
        kubelet: more `docker run` options, for what the kubelet adds that the pod spec does not spell out
            (a ServiceAccount token's mount, the KUBERNETES_SERVICE_* variables).
    Returns:
        The arguments after `docker`.
    Raises:
        ValueError: the pod has more than one container, or uses something this translation lacks.
    """
    (container,) = pod["containers"]
    args = ["run", "-d", "--name", name, "--network", "host", *_security_args(pod, container),
            *_env_args(container.get("env", []), name), *_mount_args(pod, container, volumes)]
    if termination_log is not None:
        path = container.get("terminationMessagePath", "/dev/termination-log")
        args += ["--mount", f"type=bind,source={termination_log},destination={path}"]
    args += kubelet
    command = container.get("command")
    if command:
        args += ["--entrypoint", command[0]]
    args.append(image)
    return args + list(command[1:] if command else []) + list(container.get("args", []))


class Container:
    """A container started by `docker run -d`; removed by `remove()`."""

    def __init__(self, name: str):
        self.name = name

    @classmethod
    def run(cls, args: list[str]) -> "Container":
        docker(*args)
        return cls(args[args.index("--name") + 1])

    def state(self) -> dict[str, Any]:
        return json.loads(docker("inspect", "--format", "{{json .State}}", self.name).stdout)

    def running(self) -> bool:
        return bool(self.state()["Running"])

    def logs(self) -> str:
        p = docker("logs", self.name, check=False)
        return p.stdout + p.stderr

    def tail(self, n: int = 40) -> str:
        return f"container {self.name} log (tail):\n" + "\n".join(self.logs().splitlines()[-n:])

    def stop(self, grace_seconds: int) -> int:
        """SIGTERM, then SIGKILL after `grace_seconds` (the kubelet's terminationGracePeriodSeconds); the exit
        code."""
        docker("stop", "--time", str(grace_seconds), self.name, timeout=grace_seconds + 60)
        return self.wait(30)

    def wait(self, timeout: float) -> int:
        """The exit code, once the container has exited (DockerError if it runs past `timeout`)."""
        try:
            return int(docker("wait", self.name, timeout=timeout).stdout.strip())
        except subprocess.TimeoutExpired:
            raise DockerError(f"container {self.name} still runs after {timeout:.0f}s\n{self.tail()}") from None

    def remove(self) -> None:
        docker("rm", "--force", "--volumes", self.name, check=False)
