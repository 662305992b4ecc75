"""FakeEngineEndpoint: a loopback HTTP server answering like a booting gemma_server pod.

Why a fake: pods on the local control plane are kwok pods with no process and no network, so the operator
cannot reach a real server at their IP. This stub serves the same JSON documents as gemma_server's
`GET /v1/engine`, `GET /v1/models`, `/health` and `/live` (shapes from issue 3: `stage`, `stages` =
[{stage, status, seconds}], `data` = [{id, max_model_len}]), and the test changes them as the "boot"
advances. Pods point the operator at it with the test-only annotation `gemmarust.dev/engine-url-for-tests`
(honoured only when the operator runs with GEMMA_OPERATOR_TEST_ENGINE_URLS=1).
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
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                fake.requests.append(self.path)
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
        self.server.shutdown()
        self.server.server_close()

    def boot_to(self, stage: str, done: dict[str, float]) -> None:
        """Report `stage` as running after the stages in `done` (name -> seconds) finished."""
        stages = [{"stage": s, "status": "ok", "seconds": secs} for s, secs in done.items()]
        stages.append({"stage": stage, "status": "running", "seconds": 0.5})
        self.engine = {"stage": stage, "stages": stages}
