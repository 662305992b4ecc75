"""FakeEngineEndpoint: a loopback HTTP server answering like a booting gemma_server pod, or like a hostile one.

Why a fake: pods on the local control plane are kwok pods with no process and no network, so the operator
cannot reach a real server at their IP. This stub serves the same JSON documents as gemma_server's
`GET /v1/engine`, `/health` and `/live` (shapes from server/gemma_server/state.py `engine_report`: `stage`, `stages` =
[{stage, status, seconds}], and once serving `served_model_name`), and the test changes them as the "boot"
advances. Pods point the operator at it with the test-only annotation `gemmarust.dev/engine-url-for-tests`
(honoured only when the operator runs with GEMMA_OPERATOR_TEST_ENGINE_URLS=1).

`mode` makes it misbehave as a tenant's pod can, for the operator's poller: "trickle" sends a 200 header and
then one byte every `trickle_seconds`, forever; "redirect" answers 302 to `redirect_to`; "huge" sends a
valid JSON document of `huge_bytes` (10 MiB by default); "raw" answers 200 with the bytes `raw`.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeEngineEndpoint:
    """Serve mutable JSON for /v1/engine on 127.0.0.1:<free port>; records request paths."""

    def __init__(self) -> None:
        self.engine: dict[str, Any] = {"stage": "build", "stages": [{"stage": "build", "status": "running",
                                                                     "seconds": 0.0}]}
        self.requests: list[str] = []
        self.mode = "json"
        self.trickle_seconds = 0.2
        self.redirect_to = ""
        self.huge_bytes = 10 * 1024 * 1024
        self.raw = b""
        self.bytes_sent = 0
        self.stopping = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                fake.requests.append(self.path)
                if fake.mode != "json" and self.path.startswith("/v1/"):
                    return getattr(self, f"misbehave_{fake.mode}")()
                body, code = None, 404
                if self.path == "/v1/engine":
                    body, code = fake.engine, 200
                elif self.path == "/health":
                    ready = fake.engine.get("stage") == "serving"
                    body, code = ({"status": "ok"}, 200) if ready else ({"error": {"message": "booting"}}, 503)
                elif self.path == "/live":
                    body, code = {"status": "alive"}, 200
                data = json.dumps(body or {"error": {"message": "not found"}}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def misbehave_trickle(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"stage": "build", "pad": "')
                while not fake.stopping.wait(fake.trickle_seconds):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    fake.bytes_sent += 1

            def misbehave_redirect(self) -> None:
                self.send_response(302)
                self.send_header("Location", fake.redirect_to + self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def misbehave_huge(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                chunk = b"x" * 65536
                self.wfile.write(b'{"stage": "build", "pad": "')
                for _ in range(fake.huge_bytes // len(chunk)):
                    self.wfile.write(chunk)
                    fake.bytes_sent += len(chunk)
                self.wfile.write(b'"}')

            def misbehave_raw(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(fake.raw)))
                self.end_headers()
                self.wfile.write(fake.raw)

            def handle_one_request(self) -> None:
                try:
                    super().handle_one_request()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on us, as it should

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FakeEngineEndpoint":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()

    def boot_to(self, stage: str, done: dict[str, float]) -> None:
        """Report `stage` as running after the stages in `done` (name -> seconds) finished."""
        stages = [{"stage": s, "status": "ok", "seconds": secs} for s, secs in done.items()]
        stages.append({"stage": stage, "status": "running", "seconds": 0.5})
        self.engine = {"stage": stage, "stages": stages}

    def serve(self, model_id: str) -> None:
        """Report a finished boot that serves `model_id`."""
        done = [{"stage": s, "status": "ok", "seconds": 1.0} for s in ("build", "import", "smoke", "weights", "warmup")]
        self.engine = {"stage": "serving", "stages": done, "served_model_name": model_id}


class FakeKubelet:
    """Writes, for chosen pods, what the kubelet on their node would: the pod's status and its Events.

    Why a fake: the local control plane's nodes are kwok's, which move a pod to Running and Ready and never
    fail a mount, a pull or a sandbox, run out of memory, evict a pod or shut down with their node. A pod
    annotated `fake.gemmarust.dev/boot: fake-kubelet` (tests.cluster.controlplane.FAKE_KUBELET) is left as
    the scheduler bound it; this class then plays its kubelet, through the same API the kubelet uses
    (pods/status, core/v1 Events with source kubelet). Statuses and messages are shaped as the kubelet
    writes them (kubernetes pkg/kubelet/status, pkg/kubelet/images, pkg/kubelet/nodeshutdown) and the GCS
    FUSE CSI driver words its mount errors (GoogleCloudPlatform/gcs-fuse-csi-driver, docs/troubleshooting.md).
    The operator that reads them is the real one.
    """

    def __init__(self, kube) -> None:
        self.kube = kube

    @staticmethod
    def _now() -> str:
        import datetime

        return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    def event(self, pod: dict[str, Any], reason: str, message: str, *, container: str | None = None,
              type_: str = "Warning") -> None:
        import uuid

        meta, now = pod["metadata"], self._now()
        involved = {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "namespace": meta["namespace"],
                    "uid": meta["uid"]}
        if container:
            involved["fieldPath"] = f"spec.containers{{{container}}}"
        node = pod["spec"].get("nodeName", "")
        self.kube.request("POST", f"/api/v1/namespaces/{meta['namespace']}/events", {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": meta["namespace"]},
            "involvedObject": involved, "reason": reason, "message": message, "type": type_,
            "source": {"component": "kubelet", "host": node}, "reportingComponent": "kubelet",
            "reportingInstance": node, "firstTimestamp": now, "lastTimestamp": now, "count": 1})

    def status(self, pod: dict[str, Any], *, phase: str = "Pending", ready: bool = False,
               server: dict[str, Any] | None = None, restarts: int = 0, last: dict[str, Any] | None = None,
               **extra: Any) -> None:
        """Merge-patch pods/status: the server container's state (waiting ContainerCreating by default)."""
        meta, now = pod["metadata"], self._now()
        cs: dict[str, Any] = {"name": "server", "image": pod["spec"]["containers"][0]["image"], "ready": ready,
                              "restartCount": restarts, "started": "running" in (server or {}),
                              "state": server or {"waiting": {"reason": "ContainerCreating"}}}
        if last:
            cs["lastState"] = {"terminated": last}
        conditions = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": now}]
        conditions += [{"type": t, "status": "True" if ready else "False", "lastTransitionTime": now}
                       for t in ("Initialized", "ContainersReady", "Ready")]
        # No podIP: the operator's poller has nothing to fetch from a pod no process runs in.
        status = {"phase": phase, "conditions": conditions, "containerStatuses": [cs], "startTime": now, **extra}
        self.kube.request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                          {"status": status}, content_type="application/merge-patch+json")

    def fail_mount(self, pod: dict[str, Any], message: str) -> None:
        self.status(pod)
        self.event(pod, "FailedMount", message)

    def fail_sandbox(self, pod: dict[str, Any], message: str) -> None:
        self.status(pod)
        self.event(pod, "FailedCreatePodSandBox", message)

    def fail_pull(self, pod: dict[str, Any], error: str) -> None:
        image = pod["spec"]["containers"][0]["image"]
        self.event(pod, "Failed", f'Failed to pull image "{image}": {error}', container="server")
        self.event(pod, "Failed", "Error: ErrImagePull", container="server")
        self.status(pod, server={"waiting": {"reason": "ImagePullBackOff", "message": f'Back-off pulling image "{image}"'}})

    def fail_config(self, pod: dict[str, Any], message: str) -> None:
        self.event(pod, "Failed", f"Error: {message}", container="server")
        self.status(pod, server={"waiting": {"reason": "CreateContainerConfigError", "message": message}})

    def oom_kill(self, pod: dict[str, Any], restarts: int = 2) -> None:
        now = self._now()
        self.status(pod, phase="Running", restarts=restarts,
                    server={"waiting": {"reason": "CrashLoopBackOff",
                                        "message": "back-off 40s restarting failed container=server"}},
                    last={"reason": "OOMKilled", "exitCode": 137, "startedAt": now, "finishedAt": now})

    def start(self, pod: dict[str, Any]) -> None:
        self.status(pod, phase="Running", ready=True, server={"running": {"startedAt": self._now()}})

    def shut_down_node(self, pod: dict[str, Any]) -> None:
        """Graceful node shutdown (the node is reclaimed): the pod fails with a DisruptionTarget condition."""
        message = "Pod was terminated in response to imminent node shutdown."
        self._end(pod, "Terminated", message, "TerminationByKubelet")

    def evict(self, pod: dict[str, Any], message: str) -> None:
        """Node-pressure eviction: the pod fails with reason Evicted, and an Event says so."""
        self.event(pod, "Evicted", message)
        self._end(pod, "Evicted", message, None)

    def _end(self, pod: dict[str, Any], reason: str, message: str, disruption: str | None) -> None:
        meta, now = pod["metadata"], self._now()
        conditions = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                      {"type": "Ready", "status": "False", "lastTransitionTime": now}]
        if disruption:
            conditions.append({"type": "DisruptionTarget", "status": "True", "reason": disruption,
                               "message": message, "lastTransitionTime": now})
        cs = {"name": "server", "image": pod["spec"]["containers"][0]["image"], "ready": False, "restartCount": 0,
              "state": {"terminated": {"exitCode": 137, "reason": "Error", "startedAt": now, "finishedAt": now}}}
        self.kube.request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                          {"status": {"phase": "Failed", "reason": reason, "message": message,
                                      "conditions": conditions, "containerStatuses": [cs], "startTime": now}},
                          content_type="application/merge-patch+json")
