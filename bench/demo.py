"""`make demo`: serve a model on this machine's CPU and talk to it once.

1. Model: `MODEL=...` (a directory, hf://org/repo[@rev] or gs://bucket/path) or, without it, the tiny
   random Gemma 4 chat checkpoint (tests/checkpoints/chat.py), made once in
   ~/.cache/gemma-rust-operator/demo-model. Its replies are gibberish: the weights are random.
2. Starts `python -m gemma_server` through its real boot stages (build -> import -> smoke -> weights ->
   warmup -> serving; the build is cached in ~/.cache/gemma-rust-operator/engine-builds) and prints
   each stage as it finishes.
3. Sends a streamed chat completion with the openai SDK, then the chat's next turn, and prints each with
   its time to first token, tokens/s, and the prompt tokens the server took from its prefix cache
   (`usage.prompt_tokens_details.cached_tokens`: the second turn reuses the first's keys).
4. Leaves the server running and prints its URLs. Ctrl+C stops it (it drains first).

Environment: MODEL, PORT (default 8000), and any GEMMA_* variable of the server (GEMMA_CONTEXT, ...).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

CACHE = Path(os.environ.get("GEMMA_CACHE", Path.home() / ".cache" / "gemma-rust-operator"))
DEMO_MODEL = CACHE / "demo-model"
QUESTION = "Write a short paragraph about the ocean."
FOLLOW_UP = "Now one about the mountains."


def ensure_demo_checkpoint() -> Path:
    """The tiny chat checkpoint in the cache, made on first use (written aside, then renamed)."""
    if (DEMO_MODEL / "config.json").is_file() and (DEMO_MODEL / "tokenizer.json").is_file():
        return DEMO_MODEL
    from tests.checkpoints.chat import save_chat

    print(f"making the tiny demo checkpoint in {DEMO_MODEL} ...", flush=True)
    DEMO_MODEL.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=DEMO_MODEL.parent, prefix=".demo-model."))
    save_chat(tmp)
    if DEMO_MODEL.exists():
        shutil.rmtree(DEMO_MODEL)
    tmp.rename(DEMO_MODEL)
    return DEMO_MODEL


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def pick_port() -> int:
    port = int(os.environ.get("PORT", "8000"))
    if port_is_free(port):
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    print(f"port {port} is busy; using {free}")
    return free


def wait_until_ready(base: str, proc: subprocess.Popen, timeout: float = 1800, show_stages: bool = True) -> dict:
    """Poll /v1/engine and /health until /health is 200, printing each boot stage as it ends when
    `show_stages`. Returns the final /v1/engine; exits if the server dies or the deadline passes."""
    shown: set[str] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with status {proc.returncode} during boot (see its log above)")
        try:
            info = httpx.get(base + "/v1/engine", timeout=5).json()
            for s in info["stages"]:
                if show_stages and s["status"] != "running" and s["stage"] not in shown:
                    shown.add(s["stage"])
                    print(f"  stage {s['stage']:<8} {s['status']:<8} {s['seconds']:>8.2f}s  {s['message']}", flush=True)
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return info
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    sys.exit(f"the server was not ready after {timeout:.0f}s")


def stop_server(proc: subprocess.Popen) -> int:
    """SIGTERM (the server drains), then wait; kill if it does not end within 60 s. Returns its exit status."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def chat_turn(client: openai.OpenAI, model: str, messages: list[dict]) -> str:
    """One streamed chat completion through the openai SDK, printed as it arrives; returns the reply."""
    print(f"\nuser> {messages[-1]['content']}\nassistant> ", end="", flush=True)
    t0 = time.perf_counter()
    first = None
    usage = None
    reply = []
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=64, stream=True, stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                reply.append(choice.delta.content)
                print(choice.delta.content, end="", flush=True)
    end = time.perf_counter()
    n = usage.completion_tokens if usage else 0
    details = usage.prompt_tokens_details if usage else None
    cached = details.cached_tokens if details and details.cached_tokens is not None else 0
    ttft = (first - t0) * 1000 if first else float("nan")
    rate = (n - 1) / (end - first) if first and n > 1 and end > first else float("nan")
    prompt = usage.prompt_tokens if usage else 0
    print(f"\n\n{n} tokens · time to first token {ttft:.0f} ms · {rate:.1f} tokens/s · "
          f"prompt {prompt} tokens, {cached} from the prefix cache")
    return "".join(reply)


def chat(base: str, model: str) -> None:
    """A first question and the chat's next turn."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="not-needed")
    messages = [{"role": "user", "content": QUESTION}]
    messages.append({"role": "assistant", "content": chat_turn(client, model, messages)})
    messages.append({"role": "user", "content": FOLLOW_UP})
    chat_turn(client, model, messages)


def main() -> int:
    model_src = os.environ.get("MODEL") or str(ensure_demo_checkpoint())
    port = pick_port()
    args = [sys.executable, "-m", "gemma_server", "--model", model_src, "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(port), "--termination-log", str(CACHE / "demo-termination.log")]
    if "MODEL" not in os.environ:
        # The tiny model: 1024 positions; float32 is the fast dtype on a CPU.
        args += ["--context", os.environ.get("GEMMA_CONTEXT", "1024"), "--dtype", os.environ.get("GEMMA_DTYPE", "float32"),
                 "--served-model-name", os.environ.get("GEMMA_SERVED_MODEL_NAME", "tiny-gemma4-demo")]
    print(f"starting: {' '.join(args[1:])}", flush=True)
    proc = subprocess.Popen(args, env={**os.environ, "GEMMA_LOG_LEVEL": os.environ.get("GEMMA_LOG_LEVEL", "warning")})
    base = f"http://127.0.0.1:{port}"
    try:
        info = wait_until_ready(base, proc)
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        print(f"ready: {model} on {info['device']} (load {info['load_seconds']}s, warmup {info['warmup_seconds']}s)")
        chat(base, model)
        print(f"""
The server keeps running (Ctrl+C stops it):
  chat page   {base}/
  OpenAI API  {base}/v1          (model "{model}")
  health      {base}/health      live {base}/live
  engine      {base}/v1/engine
  metrics     {base}/metrics

  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 32}}'
""", flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        return stop_server(proc)
    finally:
        if proc.poll() is None:
            stop_server(proc)


if __name__ == "__main__":
    sys.exit(main())
