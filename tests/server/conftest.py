"""Fixtures for the server tests: the tiny chat checkpoint, servers on free loopback ports, a direct engine.

Two ways to run the server, both real:
- `server`: uvicorn serving `create_app` in a thread of the test process (fast to reach into: the app's
  state and metrics are at hand);
- `spawn`: `python -m gemma_server` as a subprocess, for what only a process has: boot from the first
  second, SIGTERM, exit status, the termination message, the build cache.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from gemma_server.app import create_app
from gemma_server.config import parse_config
from tests.checkpoints.fixtures import agent_checkpoint, chat_checkpoint, gemma4_checkpoint, multimodal_checkpoint  # noqa: F401 - session fixtures

REPO = Path(__file__).resolve().parents[2]
CONTEXT = 1024  # the tiny checkpoint's max_position_embeddings
# A completion prompt the chat checkpoint answers with 284 tokens before an eos (greedy, seed CHAT_SEED):
# long enough to disconnect or send SIGTERM mid-decode.
LONG_PROMPT = "model server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.02):
    """Poll until `predicate()` is truthy; return its value. Fails the test with `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def sample(server: "InProcessServer", name: str, **labels: str) -> float:
    """One sample of an in-process server's own registry, read with prometheus_client's public
    `get_sample_value` (every series carries the served model's name). Fails on a series that does not exist,
    so a misspelt name cannot read as 0."""
    value = server.state.metrics.registry.get_sample_value(name, {"model_name": server.state.config.model_name,
                                                                  **labels})
    assert value is not None, f"no sample {name} {labels}"
    return value


def get_status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.TransportError:
        return None


@dataclass
class InProcessServer:
    base: str
    app: object
    uvicorn: uvicorn.Server
    thread: threading.Thread

    @property
    def state(self):
        return self.app.state.server

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(30)


def start_in_process(model_dir: Path, *extra: str, boot_class=None, wait_ready: bool = True) -> InProcessServer:
    """create_app + uvicorn in a daemon thread on a free loopback port."""
    port = free_port()
    config = parse_config(["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                           "--context", str(CONTEXT), "--dtype", "float32", "--use-installed-engine", *extra], {})
    app = create_app(config, boot_class) if boot_class else create_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    app.state.server.request_exit = lambda: setattr(server, "should_exit", True)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    s = InProcessServer(f"http://127.0.0.1:{port}", app, server, thread)
    if wait_ready:
        wait_for(lambda: s.state.boot.state.failed or get_status(s.base + "/health") == 200, 300, "/health 200")
        assert not s.state.boot.state.failed, s.state.boot.state.failed
    return s


@pytest.fixture(scope="session")
def server(chat_checkpoint) -> Iterator[InProcessServer]:  # noqa: F811
    """The real engine on the chat checkpoint, served in-process, four sequence slots. Requests that set no
    temperature are greedy here (`--default-temperature 0`), so replies can be compared with the engine's
    greedy decode; the sampling tests set their temperature."""
    s = start_in_process(chat_checkpoint, "--queue-limit", "8", "--max-num-seqs", "4", "--default-temperature", "0")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def agent_server(agent_checkpoint) -> Iterator[InProcessServer]:  # noqa: F811
    """The real engine on the agent checkpoint (Gemma 4's tool and thinking markers), served in-process,
    greedy by default, as `server` is."""
    s = start_in_process(agent_checkpoint, "--queue-limit", "16", "--max-num-seqs", "4", "--default-temperature", "0")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def gemma4_server(gemma4_checkpoint) -> Iterator[InProcessServer]:  # noqa: F811
    """The real engine on the agent weights with Google's own Gemma 4 chat template (tool results read from
    the model turn), served in-process, greedy by default, as `agent_server` is."""
    s = start_in_process(gemma4_checkpoint, "--queue-limit", "16", "--max-num-seqs", "4", "--default-temperature", "0")
    yield s
    s.stop()


# The media server's limits, low enough that a test crosses each with a small file.
MEDIA_LIMITS = {"--max-images-per-request": 2, "--max-image-pixels": 200 * 150, "--max-audio-seconds": 4,
                "--max-media-bytes": 300_000}


@pytest.fixture(scope="session")
def media_server(multimodal_checkpoint) -> Iterator[InProcessServer]:  # noqa: F811
    """The real engine and media encoder on the checkpoint with both towers (Google's Gemma 4 template and
    Transformers' processor config), served in-process in float32, greedy by default, with MEDIA_LIMITS."""
    limits = [str(x) for item in MEDIA_LIMITS.items() for x in item]
    s = start_in_process(multimodal_checkpoint, "--queue-limit", "16", "--max-num-seqs", "4",
                         "--default-temperature", "0", *limits)
    yield s
    s.stop()


def openai_client(server: InProcessServer) -> openai.OpenAI:
    """The openai SDK pointed at `server`, without retries (a refusal is the test's to see)."""
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


def prompt_tokens(server: InProcessServer, messages: list[dict], tools: list[dict] | None = None, **extra) -> int:
    """The chat prompt's length in tokens (/tokenize renders it as /v1/chat/completions does)."""
    r = httpx.post(server.base + "/tokenize", json={"messages": messages, "tools": tools, **extra}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["count"]


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    """The openai SDK pointed at the session's server."""
    return openai_client(server)


@pytest.fixture(scope="session")
def model(server) -> str:
    """The session server's served model name."""
    return server.state.config.model_name


@pytest.fixture(scope="session")
def tokenizer(chat_checkpoint):  # noqa: F811
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chat_checkpoint))


@pytest.fixture(scope="session")
def direct_engine(chat_checkpoint):  # noqa: F811
    """A second engine on the same checkpoint, called directly from the test thread (the reference)."""
    import gemma_engine
    import torch

    return gemma_engine.Engine(str(chat_checkpoint), None, torch.zeros(1), context=CONTEXT, dtype="float32")


@dataclass
class Spawned:
    proc: subprocess.Popen
    base: str
    log: Path
    termination_log: Path

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def sigterm(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"server did not exit within {timeout}s; log:\n{self.logs()[-3000:]}")


def spawn_server(log_dir: Path, *args: str, env: dict[str, str] | None = None, name: str = "server") -> Spawned:
    """Start `python -m gemma_server ARGS` on a free loopback port, its output in `log_dir/<name>.log`."""
    port = free_port()
    log = log_dir / f"{name}.log"
    term = log_dir / f"{name}.termination.log"
    cmd = [sys.executable, "-m", "gemma_server", "--host", "127.0.0.1", "--port", str(port),
           "--termination-log", str(term), *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env, cwd=REPO)
    return Spawned(proc, f"http://127.0.0.1:{port}", log, term)


@pytest.fixture
def spawn(tmp_path) -> Iterator[Callable[..., Spawned]]:
    """Start `python -m gemma_server ARGS` on a free port; every process is killed at teardown."""
    procs: list[subprocess.Popen] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Spawned:
        s = spawn_server(tmp_path, *args, env=env, name=f"server{len(procs)}")
        procs.append(s.proc)
        return s

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
