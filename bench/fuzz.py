"""The long run of requests generated from the server's OpenAPI document (tests/server/test_openapi.py is
the short one).

    .venv/bin/python -m bench.fuzz [--max-examples 600] [--max-time 2400] [--workers 2] [--seed 1] [--model DIR]

Starts `python -m gemma_server` on the CPU as the test does (the tiny demo checkpoint unless --model or
MODEL names one; a 64-token context and 16 slots so that a request for many long choices ends in seconds;
an API key, so that schemathesis's auth checks run), then runs schemathesis with every check and
tests/server/openapi_checks.py's hooks: its coverage phase, then `--max-examples` generated cases per
operation, or as many as `--max-time` seconds allow. Prints the cases sent, the replies the engine generated, and each failure and error; exits 1
when there is any.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.server.openapi_checks import finished_requests, run_schemathesis

API_KEY = "fuzz-key"


def server_args(model: str) -> list[str]:
    """The server the document is checked against (the same as tests/server/test_openapi.py's)."""
    return ["--model", model, "--device", "cpu", "--dtype", "float32", "--context", "64", "--max-num-seqs", "16",
            "--queue-limit", "64"]


def wait_until_healthy(base: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Poll /health until 200 (bench/demo.py's wait reads /v1/engine, which the API key closes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with status {proc.returncode} during boot")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    sys.exit(f"the server was not ready after {timeout:.0f}s")


def main(argv: list[str] | None = None) -> int:
    from bench.demo import ensure_demo_checkpoint, pick_port, stop_server

    p = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--max-examples", type=int, default=600, help="generated cases per operation")
    p.add_argument("--max-time", type=int, default=2400, help="seconds the whole run may take")
    p.add_argument("--workers", type=int, default=2, help="operations tested at once")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", default=os.environ.get("MODEL"))
    args = p.parse_args(argv)
    model = args.model or str(ensure_demo_checkpoint())
    port = pick_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "gemma_server", *server_args(model), "--host", "127.0.0.1", "--port", str(port),
           "--termination-log", os.devnull]
    env = {**os.environ, "GEMMA_API_KEY": API_KEY, "GEMMA_LOG_LEVEL": "error", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env)
    try:
        wait_until_healthy(base, proc)
        with tempfile.TemporaryDirectory() as tmp:
            report = run_schemathesis(base, API_KEY, Path(tmp) / "schemathesis.json", seed=args.seed,
                                      max_examples=args.max_examples, timeout=args.max_time + 600,
                                      workers=args.workers,
                                      extra=("--max-time", str(args.max_time)))
        finished = finished_requests(base)
    finally:
        stop_server(proc)
    print(report["output"][-8000:])
    cases = report["test_cases"]
    print(f"cases sent {cases['generated']} · with failures {cases['with_failures']} · errored {cases['errored']} · "
          f"engine replies {finished.get('stop', 0) + finished.get('length', 0):.0f} (requests by finish: "
          f"{', '.join(f'{k} {v:.0f}' for k, v in sorted(finished.items()))}) · {report['running_time']:.0f} s · "
          f"seed {args.seed}, "
          f"max examples {args.max_examples}")
    for failure in report["failures"]:
        print(f"FAILURE {failure['code']} {failure['title']}: {failure['count']} in {', '.join(failure['operations'])}")
    for error in report["errors"]:
        print(f"ERROR {error}")
    return 1 if report["failures"] or report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
