"""What the HTTP server costs, and what batching concurrent requests gives.

    .venv/bin/python -m bench.server [--runs 9] [--max-tokens 64] [--model DIR]
    .venv/bin/python -m bench.server --concurrency 1,2,4,8,16 [--rounds 5] [--gap-chunks 4096,256,64]

With `--concurrency` it runs the batching benchmark of bench/concurrency.py (its docstring says what it
measures): aggregate tokens/s, TTFT and inter-token p50/p99 at each concurrency through the openai SDK,
Transformers' batching beside it, the matrix-product floor, and the longest gap a running stream sees while
a long prompt is read, on a random checkpoint of the small config. Without it (the default), one stream:
streamed tokens/s and time to first token through the server vs the engine called directly, same
checkpoint, same prompt, same tokens, in one run.

Without --model (or MODEL) it uses the tiny demo checkpoint (bench/demo.py). The two ways alternate run by
run, so load on the machine hits both alike; figures are medians.

- direct: `Engine.decode` in this process, read_every=1; TTFT = call -> first `on_tokens`; tokens/s =
  (n - 1) / (last token - first token).
- HTTP: `python -m gemma_server` in a subprocess, a streamed /v1/completions over one keep-alive httpx
  connection, with the same token-id prompt; TTFT = request sent -> first content chunk received;
  tokens/s likewise from the chunks' arrival times; n from the usage chunk.

Goal: HTTP/direct tokens/s >= 0.95 and TTFT overhead <= 5 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import httpx

from bench.demo import ensure_demo_checkpoint, pick_port, stop_server, wait_until_ready

PROMPT = "Hello"


def direct_run(engine, ids: list[int], max_new: int) -> tuple[float, float, int]:
    """(ttft_s, tokens_per_s, n) of one direct decode."""
    times: list[float] = []

    def on_tokens(batch: list[int]) -> bool:
        now = time.perf_counter()
        times.extend([now] * len(batch))
        return True

    t0 = time.perf_counter()
    tokens, _, _, _ = engine.decode(ids, max_new, (), 1, on_tokens)
    n = len(tokens)
    return times[0] - t0, (n - 1) / (times[-1] - times[0]), n


def http_run(client: httpx.Client, base: str, model: str, ids: list[int], max_new: int) -> tuple[float, float, int]:
    """(ttft_s, tokens_per_s, n) of one streamed completion through the server."""
    body = {"model": model, "prompt": ids, "max_tokens": max_new, "stream": True,
            "stream_options": {"include_usage": True}}
    first = last = None
    n = 0
    t0 = time.perf_counter()
    with client.stream("POST", base + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event["choices"] and event["choices"][0]["text"]:
                now = time.perf_counter()
                first = first or now
                last = now
            if event.get("usage"):
                n = event["usage"]["completion_tokens"]
    return first - t0, (n - 1) / (last - first), n


def server_means(metrics_text: str) -> dict[str, float]:
    """Mean seconds of the server's own TTFT, queue and prefill histograms (over warm-up and runs)."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            sums[s.name] = s.value
    out = {}
    for name in ("time_to_first_token", "request_queue_time", "request_prefill_time"):
        count = sums.get(f"gemma_{name}_seconds_count", 0)
        out[name] = sums.get(f"gemma_{name}_seconds_sum", 0) / count if count else float("nan")
    return out


def start_server(model_dir: str, port: int, threads: int, args: list[str],
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m gemma_server` on `model_dir` in a subprocess, on `threads` torch threads, with extra `args` and
    extra environment `env`. Prefix caching is off: the benchmarks send the same prompts round after round, and
    measure reading them (bench/prefix_cache.py measures the cache)."""
    return subprocess.Popen(
        [sys.executable, "-m", "gemma_server", "--model", model_dir, "--use-installed-engine", "--device", "cpu",
         "--no-enable-prefix-caching",
         "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port),
         "--termination-log", os.devnull, "--log-level", "warning", *args],
        env={**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {})})


def wait_healthy(base: str, server: subprocess.Popen) -> None:
    """Until /health is 200 (bench/demo.py `wait_until_ready`, its boot stages not printed)."""
    wait_until_ready(base, server, timeout=600, show_stages=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.environ.get("MODEL"))
    p.add_argument("--runs", type=int, default=9, help="single-stream runs of each way")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--context", type=int, default=1024, help="single stream only (--concurrency: prompt + max_tokens)")
    batching = p.add_argument_group("batching (--concurrency)")
    batching.add_argument("--concurrency", help="comma-separated concurrent streams, e.g. 1,2,4,8,16: run the "
                          "batching benchmark instead of the single-stream one")
    batching.add_argument("--rounds", type=int, default=5)
    batching.add_argument("--compare-at", default="1,8",
                          help="concurrencies at which the engine in-process and Transformers also run")
    batching.add_argument("--prompt-tokens", type=int, default=32, help="prompt length of every stream")
    batching.add_argument("--long-prompt", type=int, default=2000, help="the prompt read while a stream runs")
    batching.add_argument("--gap-chunks", default="4096,256,64",
                          help="--prefill-chunk values for the long-prompt gap; empty to skip it")
    batching.add_argument("--gap-context", type=int, default=4096)
    batching.add_argument("--gap-rounds", type=int, default=3,
                          help="rounds of the gap measurement for each --gap-chunks value (0 skips it)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="torch threads for both engines (default: cores - 1, leaving a core for the server's "
                        "event loop and this client, so the comparison measures serving, not a CPU fight)")
    a = p.parse_args()
    if a.concurrency:
        from bench.concurrency import main as batching_main

        return batching_main(a)
    model_dir = a.model or str(ensure_demo_checkpoint())

    import gemma_engine
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(a.threads)
    ids = AutoTokenizer.from_pretrained(model_dir).encode(PROMPT)
    engine = gemma_engine.Engine(model_dir, None, torch.zeros(1), context=a.context, dtype=a.dtype,
                                 prefix_caching=False)  # as the server runs here (start_server)
    port = pick_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(model_dir, port, a.threads, ["--context", str(a.context), "--dtype", a.dtype])
    try:
        wait_healthy(base, server)
        client = httpx.Client(timeout=600)
        direct_run(engine, ids, a.max_tokens)  # warm both once
        http_run(client, base, "bench", ids, a.max_tokens)
        d_runs, h_runs = [], []
        for _ in range(a.runs):
            d_runs.append(direct_run(engine, ids, a.max_tokens))
            h_runs.append(http_run(client, base, "bench", ids, a.max_tokens))
        server_side = server_means(client.get(base + "/metrics").text)
        client.close()
    finally:
        stop_server(server)

    n_d, n_h = {r[2] for r in d_runs}, {r[2] for r in h_runs}
    if n_d != n_h:
        print(f"warning: token counts differ: direct {n_d}, HTTP {n_h}")
    med = lambda runs, i: statistics.median(r[i] for r in runs)  # noqa: E731
    ttft_d, ttft_h = med(d_runs, 0) * 1000, med(h_runs, 0) * 1000
    tps_d, tps_h = med(d_runs, 1), med(h_runs, 1)
    ratio, overhead = tps_h / tps_d, ttft_h - ttft_d
    print(f"checkpoint {model_dir}, prompt {len(ids)} tokens, {sorted(n_d)[0]} generated, {a.runs} runs each, "
          f"medians, CPU {a.dtype}, {a.threads} torch thread(s) of {os.cpu_count()} cores")
    print(f"{'':10} {'TTFT ms':>10} {'tokens/s':>10}")
    print(f"{'direct':10} {ttft_d:10.2f} {tps_d:10.2f}")
    print(f"{'HTTP':10} {ttft_h:10.2f} {tps_h:10.2f}")
    print(f"tokens/s ratio HTTP/direct {ratio:.3f} (goal >= 0.95: {'met' if ratio >= 0.95 else 'MISSED'}); "
          f"TTFT overhead {overhead:+.2f} ms (goal <= 5 ms: {'met' if overhead <= 5 else 'MISSED'})")
    print("inside the server (its /metrics, means): TTFT {:.2f} ms = queue {:.2f} ms + prefill {:.2f} ms".format(
        *(server_side[k] * 1000 for k in ("time_to_first_token", "request_queue_time", "request_prefill_time"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
