"""FakeEngineEndpoint: a loopback HTTP server answering like a booting gemma_server pod, or like a hostile one.

Why a fake: pods on the local control plane are kwok pods with no process and no network, so the operator
cannot reach a real server at their IP. This stub serves the same JSON documents as gemma_server's
`GET /v1/engine`, `GET /v1/models`, `/health` and `/live` (shapes from issue 3: `stage`, `stages` =
[{stage, status, seconds}], `data` = [{id, max_model_len}]), and the test changes them as the "boot"
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
    """Serve mutable JSON for /v1/engine and /v1/models on 127.0.0.1:<free port>; records request paths."""

    def __init__(self) -> None:
        self.engine: dict[str, Any] = {"stage": "build", "stages": [{"stage": "build", "status": "running",
                                                                     "seconds": 0.0}]}
        self.models: dict[str, Any] | None = None
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
                elif self.path == "/v1/models" and fake.models is not None:
                    body, code = fake.models, 200
                elif self.path == "/health":
                    ready = fake.models is not None
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
