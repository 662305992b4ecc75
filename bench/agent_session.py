"""Prefix caching on an agent-shaped session through the server, on Google's Gemma 4 chat template, with and
without caching, thinking off and on, in one run.

    python -m bench.agent_session [--users 8] [--turns 10] [--tools 7] [--rounds 1] [--thinking both] [--quick]

The server (`python -m gemma_server` in a subprocess, CPU, float32, one torch thread, `--max-num-seqs`
= `--users`) serves a random checkpoint of bench/engine.py's "small" config (hidden 512, 8 layers, sliding
window 64) with the tests' byte-level tokenizer that holds Gemma 4's control tokens (tests/checkpoints/agent.py
`build_gemma4_tokenizer`, 512 ids) and Google's own Gemma 4 template, the first revision the E-series
checkpoints ship (llama-cpp-python 0.3.36's vendored copy, tests/fetch_chat_templates.py).

A session (one user, `--turns` turns, through the openai SDK, each user on a thread of its own, all starting
together):
* every request declares the same `--tools` tools (about 2,000 tokens of declarations) after a shared system
  message;
* a turn is a user message, a call the model is made to write (`tool_choice` naming a tool whose argument is
  an enum, so the call ends within its token budget), the call's result (a JSON object of about 60 tokens) and
  the model's answer to it (`tool_choice: "none"`, `--answer-tokens`): two requests a turn, each streamed;
* the next turn sends the whole conversation: the calls and answers as the server returned them.

Per arm (caching off, caching on; thinking off, thinking on), over every request:
* prompt tokens read: the sum of `prompt_tokens - cached_tokens` from each stream's usage;
* TTFT: request sent to the stream's first chunk (the server opens a stream at the first token), p50 over
  the requests of turns 2 on;
* whether every reply is the same in both arms (greedy): the run prints the first difference and exits 1.

Goals (the issue's): with caching, prompt tokens read <= 15 % of without, and TTFT p50 from turn 2 on <= 40 %,
with thinking off (the template's default) and on. `--quick`: 2 users x 3 turns, 3 tools.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai

from bench.demo import pick_port, stop_server, wait_until_ready

CITIES = ["Paris", "Oslo", "Rome", "Lima", "Pune", "Kyiv", "Baku", "Doha"]
SYSTEM = ("You are the operations assistant of a weather service. Use the tools to look things up before you "
          "answer, and answer in one short paragraph.")


# --- the workload: pure builders ------------------------------------------------------------------------


def tools(n: int) -> list[dict]:
    """`n` tool declarations of about 300 tokens each on the bench tokenizer: a description and three
    parameters, one an enum of cities (the forced calls name it, so a call is short)."""
    out = []
    for i in range(n):
        out.append({"type": "function", "function": {
            "name": f"lookup_{i}",
            "description": (f"Look up record set {i} of the weather archive for a city: hourly readings, "
                            f"station notes and the forecast issued for the next {i % 5 + 2} days."),
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "enum": CITIES, "description": "The city to look up."},
                "days": {"type": "integer", "minimum": 1, "maximum": 7, "description": "How many days."},
                "units": {"type": "string", "enum": ["metric", "imperial"], "description": "Units to report."}},
                "required": ["city"]}}})
    return out


def user_message(user: int, turn: int) -> str:
    city = CITIES[(user + turn) % len(CITIES)]
    return (f"User {user}, turn {turn + 1}: what did the archive record for {city} this week, and how does it "
            f"compare with the forecast that was issued before it?")


def tool_result(user: int, turn: int) -> str:
    return json.dumps({"city": CITIES[(user + turn) % len(CITIES)], "readings": [12 + turn, 14, 9 + user, 11],
                       "notes": f"station {user * 10 + turn} reported light rain in the afternoon",
                       "forecast": {"high": 15, "low": 7, "rain": 0.4}})


# --- one session, one arm -------------------------------------------------------------------------------


@dataclass
class Record:
    """One streamed request: its turn, its usage and time to first token, and what it returned."""

    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = float("nan")
    reply: str = ""


@dataclass
class Arm:
    records: list[Record] = field(default_factory=list)
    replies: dict[tuple[int, int, int], str] = field(default_factory=dict)
    wall: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


def stream(client: openai.OpenAI, model: str, record: Record, **kwargs) -> dict:
    """One streamed chat completion; fills `record`; returns the assistant message as the next request
    sends it back (content and tool calls)."""
    t0 = time.perf_counter()
    content, calls = [], {}
    for chunk in client.chat.completions.create(model=model, stream=True, stream_options={"include_usage": True},
                                                **kwargs):
        if chunk.usage is not None:
            record.prompt_tokens = chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            record.cached_tokens = (details.cached_tokens or 0) if details else 0
        if chunk.choices and record.ttft != record.ttft:  # the server opens the stream at the first token
            record.ttft = time.perf_counter() - t0
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content.append(delta.content)
            for call in delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"id": "", "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["function"]["name"] += call.function.name or ""
                    entry["function"]["arguments"] += call.function.arguments or ""
    message = {"role": "assistant", "content": "".join(content)}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    # What the model wrote (a call's id is the server's random name for it).
    record.reply = json.dumps([message["content"], [c["function"] for c in message.get("tool_calls", ())]])
    return message


def session(client: openai.OpenAI, model: str, user: int, a, arm: Arm, extra: dict) -> None:
    """One user's `a.turns` turns: a forced call, its result, the answer; the history grows."""
    declared = tools(a.tools)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    for turn in range(a.turns):
        messages.append({"role": "user", "content": user_message(user, turn)})
        for step in range(2):
            record = Record(turn)
            if step == 0:
                name = f"lookup_{(user * 7 + turn) % a.tools}"
                message = stream(client, model, record, messages=messages, tools=declared, max_tokens=96,
                                 tool_choice={"type": "function", "function": {"name": name}}, extra_body=extra)
                messages.append(message)
                for call in message.get("tool_calls", ()):
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": tool_result(user, turn)})
            else:
                message = stream(client, model, record, messages=messages, tools=declared,
                                 max_tokens=a.answer_tokens, tool_choice="none", extra_body=extra)
                messages.append(message)
            with arm.lock:
                arm.records.append(record)
                arm.replies[user, turn, step] = record.reply


def run_arm(base: str, a, thinking: bool) -> Arm:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    extra = {"chat_template_kwargs": {"enable_thinking": True}} if thinking else {}
    arm = Arm()
    errors: list[BaseException] = []

    def run(user: int) -> None:
        try:
            session(client, "bench", user, a, arm, extra)
        except BaseException as e:  # noqa: BLE001 - reported after the join
            errors.append(e)

    threads = [threading.Thread(target=run, args=(u,)) for u in range(a.users)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    arm.wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return arm


# --- the server and its checkpoint ----------------------------------------------------------------------


def write_checkpoint(out_dir: Path) -> Path:
    """bench/engine.py's "small" config (vocabulary cut to the tokenizer's 512 ids; the agent checkpoint's eos
    ids, which a grammar needs) with random weights, the Gemma 4 test tokenizer and Google's template."""
    from bench.engine import make_config, random_model
    from tests.checkpoints.agent import AGENT_EOS_IDS, AGENT_VOCAB_SIZE, GEMMA4_SPECIAL_TOKENS, build_gemma4_tokenizer
    from tests.checkpoints.shared import save_tokenizer
    from tests.fetch_chat_templates import INTERLEAVED, template_path

    config = make_config("small")
    config.vocab_size = config.vocab_size_per_layer_input = AGENT_VOCAB_SIZE
    config.eos_token_id = AGENT_EOS_IDS
    random_model(config, "cpu").save_pretrained(out_dir)
    extra = [t for t in GEMMA4_SPECIAL_TOKENS if t not in ("<pad>", "<bos>", "<turn|>")]
    return save_tokenizer(out_dir, build_gemma4_tokenizer(), AGENT_VOCAB_SIZE, "<turn|>", extra,
                          template_path(INTERLEAVED).read_text())


def start(model_dir: Path, port: int, a, caching: bool) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gemma_server", "--model", str(model_dir), "--use-installed-engine", "--device", "cpu",
         "--dtype", "float32", "--context", str(a.context), "--max-num-seqs", str(a.users),
         "--queue-limit", str(4 * a.users), "--default-temperature", "0", "--served-model-name", "bench",
         *([] if caching else ["--no-enable-prefix-caching"]),
         "--host", "127.0.0.1", "--port", str(port), "--termination-log", os.devnull, "--log-level", "warning"],
        env={**os.environ, "OMP_NUM_THREADS": str(a.threads)})


# --- figures ---------------------------------------------------------------------------------------------


def figures(arm: Arm) -> dict:
    later = [r.ttft for r in arm.records if r.turn >= 1]
    return {"read": sum(r.prompt_tokens - r.cached_tokens for r in arm.records),
            "sent": sum(r.prompt_tokens for r in arm.records),
            "cached": sum(r.cached_tokens for r in arm.records),
            "ttft": statistics.median(later) if later else float("nan"),
            "longest": max(r.prompt_tokens for r in arm.records), "wall": arm.wall}


def first_difference(off: Arm, on: Arm) -> str | None:
    for key in sorted(set(off.replies) | set(on.replies)):
        if off.replies.get(key) != on.replies.get(key):
            return f"user {key[0]} turn {key[1] + 1} request {key[2] + 1}: {off.replies.get(key)!r:.120} against " \
                   f"{on.replies.get(key)!r:.120}"
    return None


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.agent_session", description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--tools", type=int, default=7, help="tools declared (about 300 tokens each on this tokenizer)")
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1, help="rounds of the four arms (medians over rounds)")
    p.add_argument("--context", type=int, default=6144)
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--thinking", choices=("off", "on", "both"), default="both",
                   help="the template's enable_thinking arms to run")
    p.add_argument("--quick", action="store_true", help="2 users x 3 turns, 3 tools")
    a = p.parse_args(argv)
    if a.quick:
        a.users, a.turns, a.tools, a.context = 2, 3, 3, 4096
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[a.thinking]
    t_start = time.perf_counter()
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-agent.") as tmp:
        model_dir = write_checkpoint(Path(tmp))
        results: dict[tuple[bool, bool], list[dict]] = {}
        for r in range(a.rounds):
            for thinking in modes:
                arms = {}
                for caching in (False, True):
                    port = pick_port()
                    server = start(model_dir, port, a, caching)
                    try:
                        wait_until_ready(f"http://127.0.0.1:{port}", server, timeout=600, show_stages=False)
                        arms[caching] = run_arm(f"http://127.0.0.1:{port}", a, thinking)
                    finally:
                        stop_server(server)
                    f = figures(arms[caching])
                    results.setdefault((thinking, caching), []).append(f)
                    print(f"  [{time.perf_counter() - t_start:.0f} s] round {r + 1} thinking "
                          f"{'on ' if thinking else 'off'} caching {'on ' if caching else 'off'}: read "
                          f"{f['read']:,} of {f['sent']:,} prompt tokens, longest prompt {f['longest']:,}, "
                          f"{f['wall']:.1f} s", flush=True)
                diff = first_difference(arms[False], arms[True])
                if diff:
                    failures.append(f"round {r + 1}, thinking {'on' if thinking else 'off'}: {diff}")
    print(f"\n{a.users} users x {a.turns} turns (a forced call, its result, the answer: {2 * a.turns} requests a "
          f"user), {a.tools} tools declared, Google's Gemma 4 template; medians of {a.rounds} round(s)")
    print(f"{'':<30} {'off':>10} {'on':>10} {'on/off':>8}")
    for thinking in modes:
        off = {k: statistics.median(f[k] for f in results[thinking, False]) for k in results[thinking, False][0]}
        on = {k: statistics.median(f[k] for f in results[thinking, True]) for k in results[thinking, True][0]}
        label = "thinking on" if thinking else "thinking off"
        print(f"{label + ', prompt tokens read':<30} {off['read']:>10,.0f} {on['read']:>10,.0f} "
              f"{on['read'] / off['read']:>8.3f}")
        print(f"{label + ', TTFT p50 turns 2+, ms':<30} {off['ttft'] * 1e3:>10.0f} {on['ttft'] * 1e3:>10.0f} "
              f"{on['ttft'] / off['ttft']:>8.3f}")
        print(f"{verdict(on['read'] <= 0.15 * off['read'])} {label}: prompt tokens read with caching "
              f"{on['read'] / off['read']:.1%} of without (goal <= 15 %); cached {on['cached']:,} of {on['sent']:,}")
        print(f"{verdict(on['ttft'] <= 0.40 * off['ttft'])} {label}: TTFT p50 from turn 2 on "
              f"{on['ttft'] / off['ttft']:.1%} of without (goal <= 40 %)")
    print(f"\nreplies identical with and without caching: {'NO' if failures else 'yes'}")
    for f in failures:
        print(f"  first difference, {f}")
    print(f"whole run: {time.perf_counter() - t_start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
