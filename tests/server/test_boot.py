"""`python -m gemma_server` as a process: boot stages behind an answering port, failing stages, SIGTERM
drain, and the build cache. Real engine on the tiny chat checkpoint throughout."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import CONTEXT, LONG_PROMPT, get_status, wait_for

# Greedy unless a request sets its temperature, so token counts are the checkpoint's known replies.
COMMON = ["--context", str(CONTEXT), "--dtype", "float32", "--served-model-name", "chat", "--default-temperature", "0"]


def engine_info(base: str) -> dict:
    return httpx.get(base + "/v1/engine", timeout=10).json()


def test_health_is_503_until_warmup_then_200(spawn, chat_checkpoint, tmp_path):
    # gs:// checkpoint whose bucket is not mounted yet: the weights stage waits for it, so the test can
    # look at a booting server for as long as it likes, then "mount" the bucket.
    gcs = tmp_path / "gcs"
    gcs.mkdir()
    s = spawn("--model", "gs://bucket/chat", "--gcs-root", str(gcs), "--use-installed-engine", "--expose-paths",
              *COMMON)
    wait_for(lambda: get_status(s.base + "/live") == 200, 60, "the port to answer")
    wait_for(lambda: engine_info(s.base)["stage"] == "weights", 120, "the weights stage")
    r = httpx.get(s.base + "/health")
    assert r.status_code == 503
    assert r.json()["error"] == {"message": "Loading model (stage: weights).", "type": "unavailable_error",
                                 "param": None, "code": 503}
    r = httpx.post(s.base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    info = engine_info(s.base)
    assert [(x["stage"], x["status"]) for x in info["stages"]] == [
        ("build", "skipped"), ("import", "ok"), ("smoke", "ok"), ("weights", "running")]

    (gcs / "bucket").mkdir()
    (gcs / "bucket" / "chat").symlink_to(chat_checkpoint)
    wait_for(lambda: get_status(s.base + "/health") == 200, 120, "/health 200 after warmup")
    info = engine_info(s.base)
    assert info["stage"] == "serving"
    assert [x["status"] for x in info["stages"]] == ["skipped", "ok", "ok", "ok", "skipped", "ok", "running"]
    assert info["model_dir"] == str(gcs / "bucket" / "chat")
    metrics = httpx.get(s.base + "/metrics").text
    assert 'gemma_boot_stage_seconds{model_name="chat",stage="weights"}' in metrics
    s.sigterm()
    assert s.wait_exit(30) == 0


@pytest.mark.parametrize(
    "args,reason",
    [
        (["--model", "/nonexistent/model", "--use-installed-engine"],
         "weights: FileNotFoundError: /nonexistent/model: not a directory"),
        (["--model", "/nonexistent/model", "--engine-src", "/nonexistent/rust"],
         "build: FileNotFoundError: no Cargo.toml in /nonexistent/rust"),
    ],
    ids=["weights", "build"],
)
def test_a_failing_stage_exits_nonzero_with_the_reason_in_the_termination_message(spawn, tmp_path, args, reason):
    s = spawn(*args, *COMMON, env={"GEMMA_BUILD_CACHE": str(tmp_path / "cache")})
    assert s.wait_exit(120) == 1
    message = s.termination_log.read_text()
    assert message.startswith(reason), message
    assert message.count("\n") == 1
    assert reason in s.logs()


def start_stream(base: str, model: str, prompt: str) -> tuple[httpx.Client, httpx.Response]:
    client = httpx.Client(timeout=60)
    req = client.build_request("POST", base + "/v1/completions",
                               json={"model": model, "prompt": prompt, "max_tokens": 400, "stream": True})
    response = client.send(req, stream=True)
    assert response.status_code == 200
    return client, response


def test_sigterm_drains_running_and_queued_requests_and_refuses_new_ones(spawn, chat_checkpoint):
    # One sequence slot, so the second request waits in the queue while the first decodes.
    s = spawn("--model", str(chat_checkpoint), "--use-installed-engine", "--shutdown-timeout", "120",
              "--max-num-seqs", "1", *COMMON)
    wait_for(lambda: get_status(s.base + "/health") == 200, 120, "/health 200")
    client, stream = start_stream(s.base, "chat", LONG_PROMPT)
    chunks = stream.iter_bytes()
    first = next(chunks)
    queued: dict = {}

    def run_queued() -> None:
        r = httpx.post(s.base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 5}, timeout=120)
        queued.update(status=r.status_code, body=r.json())

    t = threading.Thread(target=run_queued, daemon=True)
    t.start()
    wait_for(lambda: "gemma_num_requests_waiting{model_name=\"chat\"} 1.0" in httpx.get(s.base + "/metrics").text,
             30, "the second request to queue")
    s.sigterm()
    wait_for(lambda: get_status(s.base + "/health") == 503, 30, "/health 503 while draining")
    r = httpx.post(s.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]

    body = first + b"".join(chunks)
    client.close()
    assert body.endswith(b"data: [DONE]\n\n")
    assert b'"error"' not in body
    events = [json.loads(e[6:]) for e in body[:-2].split(b"\n\n")[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    t.join(60)
    assert queued["status"] == 200 and queued["body"]["usage"]["completion_tokens"] == 5
    assert s.wait_exit(60) == 0


def test_sigterm_past_the_shutdown_timeout_ends_the_stream_with_an_error_event(spawn, chat_checkpoint):
    s = spawn("--model", str(chat_checkpoint), "--use-installed-engine", "--shutdown-timeout", "0.2", *COMMON)
    wait_for(lambda: get_status(s.base + "/health") == 200, 120, "/health 200")
    client, stream = start_stream(s.base, "chat", LONG_PROMPT)
    chunks = stream.iter_bytes()
    first = next(chunks)
    s.sigterm()
    body = first + b"".join(chunks)
    client.close()
    events = body[:-2].split(b"\n\n")
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == 503 and "shutdown" in error["message"]
    assert s.wait_exit(30) == 0


def cargo_target_dir() -> str:
    """The Makefile's CARGO_TARGET_DIR (warm after `make engine`), when the test runs outside make."""
    if os.environ.get("CARGO_TARGET_DIR"):
        return os.environ["CARGO_TARGET_DIR"]
    import torch

    v = torch.__version__.split("+")[0]
    py = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return str(Path.home() / ".cache" / "gemma-rust-operator" / "cargo" / f"torch-{v}-{py}")


@pytest.mark.slow
def test_a_restart_with_a_warm_build_cache_skips_the_compile(spawn, chat_checkpoint, tmp_path):
    cache = tmp_path / "builds"
    env = {"GEMMA_BUILD_CACHE": str(cache), "CARGO_TARGET_DIR": cargo_target_dir(), "GEMMA_EXPOSE_PATHS": "1"}
    args = ["--model", str(chat_checkpoint), *COMMON]

    cold = spawn(*args, env=env)
    wait_for(lambda: get_status(cold.base + "/health") == 200, 900, "the cold boot (compiles the engine)")
    build = engine_info(cold.base)["stages"][0]
    assert build["stage"] == "build" and build["status"] == "ok" and build["message"].startswith("compiled ")
    key = build["message"].split()[1]
    assert (cache / key / "BUILD.json").is_file()
    assert engine_info(cold.base)["build"]["module"].startswith(str(cache / key))
    assert "maturin: " in cold.logs()
    cold.sigterm()
    assert cold.wait_exit(60) == 0

    warm = spawn(*args, env=env)
    wait_for(lambda: get_status(warm.base + "/health") == 200, 300, "the warm boot")
    info = engine_info(warm.base)
    assert info["stages"][0]["message"] == f"cached {key}"
    assert info["stages"][0]["seconds"] < build["seconds"]
    assert info["build"]["module"].startswith(str(cache / key))
    assert "maturin" not in warm.logs()
    r = httpx.post(warm.base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    warm.sigterm()
    assert warm.wait_exit(60) == 0


def test_onednn_setting_picks_what_multiplies_the_dense_weights(spawn, chat_checkpoint):
    """On the CPU in float32, auto (the default) multiplies with oneDNN, off with ATen's matmul; both serve
    the same greedy text (they round the products differently, not enough to move the tiny model's greedy
    tokens)."""
    texts = []
    for onednn, linear in (("auto", "onednn"), ("off", "aten")):
        s = spawn("--model", str(chat_checkpoint), "--use-installed-engine", *COMMON, env={"GEMMA_ONEDNN": onednn})
        wait_for(lambda: get_status(s.base + "/health") == 200, 300, "/health 200")
        assert [e["linear"] for e in engine_info(s.base)["engines"]] == [linear]
        body = {"model": "chat", "prompt": "the ocean", "max_tokens": 12}
        texts.append(httpx.post(s.base + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"])
        s.proc.terminate()
        s.proc.wait(60)
    assert texts[0] == texts[1] and texts[0]


@pytest.mark.parametrize("mode, onednn, seqs, chunk", [("on", "auto", 1, 16), ("auto", "off", 2, 32)])
def test_compile_stage_compiles_the_step_and_the_replies_are_the_eager_engines(
        spawn, small_chat_checkpoint, mode, onednn, seqs, chunk):
    """--compile on replays the compiled steps; auto times each bucket both ways and keeps the faster. Either way
    the reply through the openai SDK is the eager engine's, and /v1/engine and /metrics say what compiled. One
    multiplies over oneDNN's packed weights (the CPU default), frozen into each graph, whose compiles Inductor's
    cache does not keep, so it compiles cold every run: one decode bucket and one chunk bucket, 6 shapes. The
    other, on ATen's matmul, 2 decode buckets (auto times each) and 2 chunk buckets, 12 shapes. On the 4-layer
    chat checkpoint, whose shapes compile faster than the 9-layer one's."""
    import gemma_engine
    import openai
    import torch
    from transformers import AutoTokenizer

    s = spawn("--model", str(small_chat_checkpoint), "--use-installed-engine", "--compile", mode, "--max-num-seqs",
              str(seqs), "--prefill-chunk", str(chunk), *COMMON, env={"GEMMA_ONEDNN": onednn})
    wait_for(lambda: get_status(s.base + "/health") == 200, 600, "/health 200 after the compile stage")
    info = engine_info(s.base)
    stages = {x["stage"]: x for x in info["stages"]}
    assert list(stages) == ["build", "import", "smoke", "weights", "compile", "warmup", "serving"]
    message = stages["compile"]["message"]
    assert stages["compile"]["status"] == "ok" and "steps and prompt chunks compiled, 0 fell back" in message
    report = info["compile"]
    assert (report["mode"], report["backend"]) == (mode, "inductor")
    [engine] = report["engines"]
    assert engine["fallbacks"] == []
    assert [e["linear"] for e in info["engines"]] == [{"off": "aten", "auto": "onednn"}[onednn]]
    # Every bucket (1, 2 slots), the first step after a read point and the later ones: their forwards, and their
    # choices greedy and sampled; every prompt-chunk bucket (16, 32 columns), a prompt's first chunk and a later one.
    buckets = [b for b in (1, 2) if b <= seqs]
    steps = {f"decode b={b}{padded} {stages}" for b in buckets for padded in ("", " padded")
             for stages in ("forward", "greedy", "draw")}
    chunks = {f"prompt t={t} {which}" for t in (16, 32) if t <= chunk for which in ("first", "later")}
    assert steps | chunks == {name for name, _ in engine["compiled"]}, engine
    assert engine["active"] is True
    if mode == "auto":  # each bucket timed both ways; the ones measured faster eagerly run eagerly
        timed = engine["ms_per_step"]
        assert [t["bucket"] for t in timed] == buckets and all(t["eager"] > 0 and t["compiled"] > 0 for t in timed)
        assert engine["eager_buckets"] == [t["bucket"] for t in timed if t["compiled"] >= t["eager"]]
    else:
        assert engine["eager_buckets"] == [] and "ms_per_step" not in engine

    prompt = "The ocean covers"
    tokenizer = AutoTokenizer.from_pretrained(str(small_chat_checkpoint))
    eager = gemma_engine.Engine(str(small_chat_checkpoint), None, torch.zeros(1), context=CONTEXT, dtype="float32")
    tokens, _, _, _ = eager.decode(tokenizer.encode(prompt), 10)
    client = openai.OpenAI(base_url=s.base + "/v1", api_key="unused", timeout=120)
    reply = client.completions.create(model="chat", prompt=prompt, max_tokens=10)
    assert reply.choices[0].text == tokenizer.decode(tokens, skip_special_tokens=True)
    metrics = httpx.get(s.base + "/metrics").text
    assert 'gemma_compile_fallbacks_total{model_name="chat"} 0.0' in metrics
    assert 'gemma_boot_stage_seconds{model_name="chat",stage="compile"}' in metrics
    s.sigterm()
    assert s.wait_exit(30) == 0


def _rank_processes(server_pid: int) -> list[int]:
    """The server's children that multiprocessing spawned (its tensor-parallel ranks), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == server_pid and b"spawn_main" in cmdline:
            found.append(int(entry))
    return found


def test_tensor_parallel_ranks_answer_as_the_unsplit_engine_and_lost_ranks_fail_their_engines(
        spawn, chat_checkpoint, direct_engine, tokenizer):
    """--devices 2 --tensor-parallel-size 2 on the cpu: two engines of two ranks, this server rank 0 of both and each
    rank 1 a process of its own (gemma_engine.distributed), every boot stage's engine call made on both ranks.
    Replies through the openai SDK, one constrained by a JSON schema, are the unsplit engine's; /v1/engine says 2
    ranks an engine. One engine's rank 1 killed while idle, that engine is dead at once (a watcher on the rank
    processes) and the other serves; the other's killed too, the server turns unready and a request gets an error,
    not a wait."""
    import signal

    import openai

    s = spawn("--model", str(chat_checkpoint), "--use-installed-engine", "--devices", "2",
              "--tensor-parallel-size", "2", "--max-num-seqs", "2", *COMMON)
    wait_for(lambda: get_status(s.base + "/health") == 200, 600, "/health 200 with two engines of two ranks")
    engines = engine_info(s.base)["engines"]
    assert [e["tensor_parallel_size"] for e in engines] == [2, 2], engines
    client = openai.OpenAI(base_url=s.base + "/v1", api_key="unused", timeout=120, max_retries=0)
    # Four at once: a request goes to the engine with the most free slots, so both engines answer.
    prompts = ["The ocean covers", "Tell me a story", "Rivers run", "Mountains are"]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda p: client.completions.create(model="chat", prompt=p, max_tokens=30), prompts))
    for prompt, reply in zip(prompts, replies):
        tokens, _, _, _ = direct_engine.decode(tokenizer.encode(prompt), 30)
        assert reply.choices[0].text == tokenizer.decode(tokens, skip_special_tokens=True), prompt
    assert all(e["served"] >= 1 for e in engine_info(s.base)["engines"]), engine_info(s.base)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    reply = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "a number"}], max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert set(json.loads(reply.choices[0].message.content)) == {"a"}

    first, second = _rank_processes(s.proc.pid)
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: sum(bool(e["dead"]) for e in engine_info(s.base)["engines"]) == 1, 30, "one engine dead")
    assert get_status(s.base + "/health") == 200
    assert client.completions.create(model="chat", prompt="The ocean covers", max_tokens=10).choices[0].text
    os.kill(second, signal.SIGKILL)
    wait_for(lambda: get_status(s.base + "/health") == 503, 30, "/health 503 once every engine lost a rank")
    with pytest.raises(openai.APIError):
        client.completions.create(model="chat", prompt="The ocean covers", max_tokens=10)


def test_on_a_device_where_storages_do_not_swap_compiled_steps_do_not_donate(caplog):
    """torch_tpu's compiled steps donate the KV rings they write only where `storage_swap_check` passes on the
    device; elsewhere (here: no TPU at all) they compile without donation and a warning says why. Inductor never
    donates."""
    from gemma_server.boot import Boot
    from gemma_server.config import parse_config
    from gemma_server.metrics import Metrics

    boot = Boot(parse_config(["--model", "m"], {}), Metrics("chat", CONTEXT), lambda reason: None, None)
    with caplog.at_level(logging.WARNING, logger="gemma_server.boot"):
        tpu = boot.step_compiler("tpu:0")
    assert (tpu.backend, tpu.donate) == ("tpu", False)
    assert "compiled steps on tpu:0 copy the KV rings they write (no buffer donation): swapping" in caplog.text
    assert boot.step_compiler("cpu").describe()["donate"] is False
