"""Load and soak: concurrent streaming clients against the real server for minutes, then its invariants.

    .venv/bin/python -m bench.soak [--clients 8] [--minutes 3] [--warmup 30] [--model DIR] [--seed 1]

Starts `python -m gemma_server` on the CPU (the tiny demo checkpoint of bench/demo.py unless --model or
MODEL names one) with 4 sequence slots, a queue of 8 and one torch thread, then runs `--clients` streaming clients (the
openai SDK's AsyncOpenAI over loopback) plus a burster, first for `--warmup` seconds, then for `--minutes`:

- each client sends one chat completion after another: prompts of 1 to 200 words, 1 to 48 new tokens,
  greedy or sampled (temperature, top_p, seed), now and then n = 2;
- about one request in eight disconnects after a few chunks (closes its stream), one in eight is
  cancelled after a random delay (its task is cancelled, often while it waits in the queue);
- every few seconds the burster sends slots + queue + 4 short requests at once, past the queue limit.

Every request must end as completed (each choice finished with stop or length, the usage chunk's tokens
within n x max_tokens and equal to it when every choice ran to length), refused (429), or
cancelled by its own client; anything else, or a request still open past its deadline, is a failure.
Afterwards, with the server idle: `gemma_num_requests_running` and `gemma_num_requests_waiting` (from
/metrics) are 0, every engine's slots are free (/v1/engine), and the server's RSS (/proc/<pid>/status) is
within 10 % of its RSS after the warmup (measured idle too). Prints sent / completed / refused / cancelled
/ failed, the p50 / p99 latency and time to first token of completed requests, and the RSS; exits 1 when
an invariant does not hold. tests/server/test_soak.py runs the same load for under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

SLOTS = 4
QUEUE_LIMIT = 8
DEADLINE_S = 180.0  # no request may stay open longer (queue wait included)
BURST_EVERY_S = 6.0
RSS_TOLERANCE = 0.10
WORDS = ("the ocean covers most of the earth and its water moves in long currents while a model server "
         "answers questions one token at a time").split()


@dataclass
class Tally:
    """What became of the requests. `failed` holds one line per request that ended any other way."""

    sent: int = 0
    completed: int = 0
    refused: int = 0
    cancelled: int = 0
    disconnected: int = 0  # of `cancelled`: closed their stream mid-reply
    failed: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)  # completed: sent -> last event, seconds
    ttfts: list[float] = field(default_factory=list)  # completed: sent -> first content, seconds

    def summary(self) -> str:
        return (f"sent {self.sent} · completed {self.completed} · refused (429) {self.refused} · cancelled "
                f"{self.cancelled} (of which disconnected mid-stream {self.disconnected}) · failed {len(self.failed)}\n"
                f"latency p50 {pct(self.latencies, 50):.2f} s, p99 {pct(self.latencies, 99):.2f} s · "
                f"time to first token p50 {pct(self.ttfts, 50):.2f} s, p99 {pct(self.ttfts, 99):.2f} s")


def pct(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank), NaN of nothing."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


@dataclass(frozen=True)
class Plan:
    """One request and what its client does with it."""

    words: int
    max_tokens: int
    sampling: tuple[tuple[str, object], ...]
    n: int = 1
    disconnect_after: int | None = None  # close the stream after this many content chunks
    cancel_after: float | None = None  # cancel the request task after this many seconds


def plan_request(rng: random.Random) -> Plan:
    """A client's next request: mixed lengths, sampling on or off, sometimes n = 2, a disconnect or a cancel."""
    sampling: tuple = (("temperature", 0.0),)
    if rng.random() < 0.5:
        sampling = (("temperature", 0.9), ("top_p", 0.95), ("seed", rng.randrange(2**31)))
    action = rng.random()
    return Plan(words=rng.choice((1, 5, 20, 60, 200)), max_tokens=rng.randint(1, 48), sampling=sampling,
                n=2 if rng.random() < 0.1 else 1,
                disconnect_after=rng.randint(1, 6) if action < 0.125 else None,
                cancel_after=rng.uniform(0.05, 3.0) if 0.125 <= action < 0.25 else None)


def burst_plan(rng: random.Random) -> Plan:
    return Plan(words=rng.choice((1, 5)), max_tokens=rng.randint(1, 8), sampling=(("temperature", 0.0),))


async def stream_reply(client: openai.AsyncOpenAI, model: str, plan: Plan, rng: random.Random) -> tuple[str, str]:
    """Send `plan` and read its stream. Returns (outcome, detail); outcome is completed, refused,
    disconnected or failed."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(plan.words))
    t0 = time.monotonic()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=plan.max_tokens, n=plan.n,
            stream=True, stream_options={"include_usage": True}, **dict(plan.sampling))
    except openai.RateLimitError:
        return "refused", ""
    finished: dict[int, str] = {}
    usage = None
    chunks = 0
    first = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.monotonic()
                chunks += 1
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
        if plan.disconnect_after is not None and chunks >= plan.disconnect_after:
            await stream.close()
            return "disconnected", ""
    end = time.monotonic()
    if sorted(finished) != list(range(plan.n)) or not set(finished.values()) <= {"stop", "length"}:
        return "failed", f"choices ended {finished}, expected {plan.n} stop/length"
    # A reply may be empty (the model's first token can be an end of turn); one cut by length is whole.
    most = plan.n * plan.max_tokens
    if usage is None or not 0 <= usage.completion_tokens <= most:
        return "failed", f"usage {usage} for {plan.n} x {plan.max_tokens} tokens"
    if set(finished.values()) == {"length"} and usage.completion_tokens != most:
        return "failed", f"every choice ended by length, but usage {usage} for {plan.n} x {plan.max_tokens} tokens"
    return "completed", f"{end - t0} {(first or end) - t0}"


async def run_one(client: openai.AsyncOpenAI, model: str, plan: Plan, rng: random.Random, tally: Tally) -> None:
    """One request to its end, counted in `tally`."""
    tally.sent += 1
    task = asyncio.ensure_future(stream_reply(client, model, plan, rng))
    try:
        if plan.cancel_after is not None:
            done, _ = await asyncio.wait({task}, timeout=plan.cancel_after)
            if not done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                tally.cancelled += 1
                return
        outcome, detail = await asyncio.wait_for(task, DEADLINE_S)
    except asyncio.TimeoutError:
        tally.failed.append(f"still open after {DEADLINE_S:.0f} s: {plan}")
        return
    except (openai.APIError, httpx.HTTPError) as e:
        tally.failed.append(f"{type(e).__name__}: {e} ({plan})")
        return
    if outcome == "completed":
        latency, ttft = map(float, detail.split())
        tally.completed += 1
        tally.latencies.append(latency)
        tally.ttfts.append(ttft)
    elif outcome == "refused":
        tally.refused += 1
    elif outcome == "disconnected":
        tally.cancelled += 1
        tally.disconnected += 1
    else:
        tally.failed.append(f"{detail} ({plan})")


async def load(base: str, model: str, clients: int, seconds: float, seed: int) -> Tally:
    """`clients` streaming clients and the burster against `base` for `seconds`; every request started
    before the end is followed to its end."""
    tally = Tally()
    until = time.monotonic() + seconds
    rng = random.Random(seed)
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S + 30)

    async def one_client(crng: random.Random) -> None:
        while time.monotonic() < until:
            await run_one(client, model, plan_request(crng), crng, tally)

    async def burster(brng: random.Random) -> None:
        while time.monotonic() + BURST_EVERY_S < until:
            await asyncio.sleep(BURST_EVERY_S)
            plans = [burst_plan(brng) for _ in range(SLOTS + QUEUE_LIMIT + 4)]
            await asyncio.gather(*(run_one(client, model, p, brng, tally) for p in plans))

    try:
        await asyncio.gather(*(one_client(random.Random(rng.random())) for _ in range(clients)),
                             burster(random.Random(rng.random())))
    finally:
        await client.close()
    return tally


# ---- the server's side -----------------------------------------------------------------------------


@dataclass
class Idle:
    """The server once the load is gone."""

    running: float
    waiting: float
    slots: int
    free_slots: int
    rss_mb: float


def gauges(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in ("gemma_num_requests_running", "gemma_num_requests_waiting")}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def idle(base: str, pid: int, timeout: float = 60.0) -> Idle:
    """Wait (up to `timeout` s) until nothing runs or waits and every slot is free; the state then, or at
    the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        g = gauges(base)
        engines = httpx.get(base + "/v1/engine", timeout=10).json()["engines"]
        state = Idle(g["gemma_num_requests_running"], g["gemma_num_requests_waiting"],
                     sum(e["max_batch"] for e in engines), sum(e["max_batch"] - e["active"] for e in engines),
                     rss_mb(pid))
        if (state.running == state.waiting == 0 and state.free_slots == state.slots) or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


def problems(tally: Tally, after: Idle, warm_rss_mb: float) -> list[str]:
    """Every invariant the run broke, in words (none: it held)."""
    out = list(tally.failed)
    if after.running or after.waiting:
        out.append(f"after the load: {after.running:g} running, {after.waiting:g} waiting")
    if after.free_slots != after.slots:
        out.append(f"after the load: {after.free_slots} of {after.slots} slots free")
    if abs(after.rss_mb - warm_rss_mb) > RSS_TOLERANCE * warm_rss_mb:
        out.append(f"RSS {after.rss_mb:.0f} MB after the load, {warm_rss_mb:.0f} MB after warmup")
    return out


# One torch thread: the clients need the other core of a small machine.
SERVER_ENV = {"OMP_NUM_THREADS": "1"}


def server_args(model: str) -> list[str]:
    """The server under test: 4 slots and a queue of 8 (so bursts pass it), float32 on the CPU."""
    return ["--model", model, "--device", "cpu", "--dtype", "float32", "--context", "1024",
            "--max-num-seqs", str(SLOTS), "--queue-limit", str(QUEUE_LIMIT)]


def soak(base: str, pid: int, model: str, clients: int, warmup_s: float, seconds: float, seed: int,
         say: Callable[[str], None] = print) -> tuple[Tally, Idle, float, list[str]]:
    """Warm up, measure the idle RSS, run the load, wait for idle; (tally, idle state, warm RSS, problems)."""
    say(f"warmup: {clients} clients for {warmup_s:.0f} s")
    warm = asyncio.run(load(base, model, clients, warmup_s, seed))
    warm_state = idle(base, pid)
    say(f"  {warm.summary()}\n  idle RSS {warm_state.rss_mb:.0f} MB")
    say(f"soak: {clients} clients for {seconds:.0f} s")
    t0 = time.monotonic()
    tally = asyncio.run(load(base, model, clients, seconds, seed + 1))
    after = idle(base, pid)
    say(f"  {tally.summary()}\n  ran {time.monotonic() - t0:.0f} s · after: running {after.running:g}, waiting "
        f"{after.waiting:g}, free slots {after.free_slots}/{after.slots}, RSS {after.rss_mb:.0f} MB "
        f"({(after.rss_mb / warm_state.rss_mb - 1) * 100:+.1f} % of {warm_state.rss_mb:.0f} MB after warmup)")
    return tally, after, warm_state.rss_mb, problems(tally, after, warm_state.rss_mb) + warm.failed


def main(argv: list[str] | None = None) -> int:
    from bench.demo import ensure_demo_checkpoint, pick_port, stop_server, wait_until_ready

    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--warmup", type=float, default=30.0, help="seconds of the same load before the RSS baseline")
    p.add_argument("--model", default=os.environ.get("MODEL"))
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    model = args.model or str(ensure_demo_checkpoint())
    port = pick_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "gemma_server", *server_args(model), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "soak", "--termination-log", os.devnull]
    proc = subprocess.Popen(cmd, env={**os.environ, **SERVER_ENV, "GEMMA_LOG_LEVEL": "warning"})
    try:
        wait_until_ready(base, proc, show_stages=False)
        tally, _, _, broken = soak(base, proc.pid, "soak", args.clients, args.warmup, args.minutes * 60, args.seed)
    finally:
        stop_server(proc)
    for line in broken:
        print("BROKEN:", line)
    print("all invariants held" if not broken else f"{len(broken)} invariant(s) broken")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
