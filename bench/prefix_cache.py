"""Prefix-caching benchmark: the engine with cross-request prefix caching (`Engine(prefix_caching=True)`)
against the same engine without it, on multi-turn chat, in one run.

    python -m bench.prefix_cache [--rounds 3] [--users 8] [--turns 10] [--system-tokens 1000] [--max-new 64]
                                 [--sampled-rounds 1] [--b-users 32] [--b-turns 3] [--quick]

On the CPU in float32, one torch thread, a random checkpoint of bench/engine.py's "small" config (written
once with `save_pretrained` to a temporary directory; no eos id, so every reply is `--max-new` tokens), an
`Engine` of `--slots` (8) slots, context 4096, `prefill_chunk` 256 and tokens read back every step (the
server's defaults). Prompts are token ids built as a chat template renders them, without a tokenizer:

* the system turn: `--system-tokens` ids, BOS, a turn-start marker, seeded pseudo-random ids and a turn-end
  marker, the same for every user; every request passes `cache_boundary` = its end, so a request that
  shares it can hit there whatever else the slots hold;
* a user turn: turn-start, ~100 seeded pseudo-random ids (different for each user and turn), turn-end, and
  the turn-start that opens the model's reply (the generation prompt);
* the next turn's prompt: the previous prompt + the reply the engine generated + turn-end + the next user
  turn: the whole history, as a template that does not re-render earlier replies gives it.

Workload A: `--users` (8) users x `--turns` (10) turns, all starting together; each user sends its next
turn the moment its reply ends (the script drives `Engine.run(poll, on_events)` itself: `poll` hands a user
its next request as soon as `on_events` has seen its reply end). Arms alternate (off, on, off, on, ...) for
`--rounds` rounds, each on a fresh engine (an empty cache), so machine load hits both alike; the figures
are medians over the rounds. Greedy for `--rounds` rounds, then a sampled arm (temperature 0.8, a seed per
user) for `--sampled-rounds`. Per arm:

* prompt tokens read: the sum of `stats["prompt_tokens"]` (what the engine actually read);
* cache hits / queries: sums of `stats["cache_hits"]` / `stats["cache_queries"]` (tokens, vLLM's
  `prefix_cache_hits` / `prefix_cache_queries`), set against the sum of `Event.cached_tokens`;
* TTFT: from `poll` handing the request over to the `on_events` call carrying its first token; p50 and p99
  over the users at each turn index, and p50 over every request from turn 2 on;
* aggregate tokens/s: generated tokens / wall time of the arm;
* decode tokens/s per request, (tokens - 1) / `Event.decode_s`, median over requests. It includes the turns
  in which the engine also read other requests' prompt chunks, so it rises when caching reads less; the
  decode step alone is the median `stats["seconds"]` of the turns that read no prompt, at the number of
  rows both arms ran most often, compared round by round (on / off of each round, then the median);
* whether every reply of every user is the same token for token in both arms. It must be: the run prints
  the first difference and exits with status 1 otherwise.

Goals (greedy, medians): prompt tokens read with caching <= 15 % of without; TTFT p50 from turn 2 on
<= 40 %; the decode step alone within +-5 % (and decode tokens/s per request not below 95 %).

Workload B: `--b-users` (32) users x `--b-turns` (3) turns over the same slots, one turn at a time and
cycling round-robin (user 0..31, then each one's next turn), so the slots cannot hold the histories: by a
user's next turn its slot has served other users. This is the pattern under which vLLM's prefix reuse for
Gemma 4 collapses to nothing (vllm-project/vllm issue 48435: sliding-window blocks recycled between a
session's turns). Here the shared system prompt must still hit (its snapshot at `cache_boundary`); it prints
the hit rate, the share the system prompt makes of the prompt tokens, and prompt tokens read against off.

`--quick` is a smoke run (4 slots, 4 users x 3 turns, a 256-token system prompt, 16 new tokens, one round;
B with 12 users x 2 turns): about a minute; its goal lines are not the full workload's.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.engine import make_config, random_model

# Marker ids below FIRST_ID, as a tokenizer keeps control tokens apart from text (Gemma's <bos> is 2,
# <start_of_turn> 105 and <end_of_turn> 106); text ids are drawn from [FIRST_ID, vocab).
BOS, TURN_START, TURN_END = 2, 105, 106
FIRST_ID = 256
MESSAGE_TOKENS = (90, 110)  # a user message's text ids, drawn uniformly per user and turn
SAMPLED_TEMPERATURE = 0.8


# --- the workload: pure builders ------------------------------------------------------------------------


def system_turn(n: int, seed: int, vocab: int) -> list[int]:
    """The shared system turn: n ids, BOS and turn-start, seeded text ids, turn-end."""
    rng = random.Random(f"system:{seed}")
    return [BOS, TURN_START] + [rng.randrange(FIRST_ID, vocab) for _ in range(n - 3)] + [TURN_END]


def user_turn(user: int, turn: int, seed: int, vocab: int) -> list[int]:
    """User `user`'s message at `turn`: turn-start, ~100 seeded text ids, turn-end, and the turn-start of the
    model's reply (the generation prompt)."""
    rng = random.Random(f"user:{seed}:{user}:{turn}")
    n = rng.randint(*MESSAGE_TOKENS)
    return [TURN_START] + [rng.randrange(FIRST_ID, vocab) for _ in range(n)] + [TURN_END, TURN_START]


def next_prompt(previous: list[int] | None, reply: list[int], system: list[int], message: list[int]) -> list[int]:
    """A turn's prompt: the system turn and the first message, or the previous prompt, its reply closed by
    turn-end, and the next message (the whole history, the reply as the engine generated it)."""
    if previous is None:
        return system + message
    return previous + reply + [TURN_END] + message


def longest_prompt(system_tokens: int, turns: int, max_new: int) -> int:
    """The most tokens a last turn's prompt can hold (every message at its longest)."""
    message = MESSAGE_TOKENS[1] + 3
    return system_tokens + turns * message + (turns - 1) * (max_new + 1)


def chat_order(users: int, turns: int) -> list[tuple[int, int]]:
    """(user, turn) in the order requests are handed over when all are ready: round-robin over users."""
    return [(u, t) for t in range(turns) for u in range(users)]


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) of xs, linearly interpolated between order statistics (numpy's
    default)."""
    s = sorted(xs)
    if not s:
        return math.nan
    at = (len(s) - 1) * q / 100
    lo, hi = math.floor(at), math.ceil(at)
    return s[lo] + (s[hi] - s[lo]) * (at - lo)


def first_difference(a: dict, b: dict) -> str | None:
    """None when the replies of `a` and `b` ({(user, turn): tokens}) are equal, else where they first differ."""
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if x != y:
            if x is None or y is None:
                return f"user {key[0]} turn {key[1] + 1}: only one arm has it"
            i = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return f"user {key[0]} turn {key[1] + 1}, token {i}: off {x[i:i + 4]} on {y[i:i + 4]}"
    return None


# --- one arm: the engine driven as a chat server would --------------------------------------------------


@dataclass
class Arm:
    """What one run of a workload on one engine recorded."""

    replies: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    prompt_lens: dict[tuple[int, int], int] = field(default_factory=dict)
    cached: dict[tuple[int, int], int] = field(default_factory=dict)
    ttft: dict[tuple[int, int], float] = field(default_factory=dict)
    decode_rate: dict[tuple[int, int], float] = field(default_factory=dict)
    steps: dict[int, list[float]] = field(default_factory=dict)  # rows -> seconds of turns that read no prompt
    prompt_read: int = 0
    cache_hits: int = 0
    cache_queries: int = 0
    wall: float = 0.0


def cached_tokens(event) -> int:
    """Prompt tokens the event's request took from the prefix cache."""
    return event.cached_tokens


def run_chat(engine, system: list[int], users: int, turns: int, max_new: int, seed: int, sampled: bool,
             strict: bool) -> Arm:
    """Run `users` x `turns` chat requests through `engine.run` and record them.

    A user's next turn is ready the moment its reply ends. `strict`: hand requests over in `chat_order`
    only (the head waits for its user's previous turn: workload B's round-robin), else any ready user's,
    lowest user first (workload A's users, each at its own pace).
    """
    import gemma_engine

    vocab = engine.vocab_size
    pending = chat_order(users, turns)
    prompts: dict[int, list[int]] = {}  # user -> its latest prompt
    ids: dict[int, tuple[int, int]] = {}
    admitted: dict[tuple[int, int], float] = {}
    done: set[tuple[int, int]] = set()
    arm = Arm()

    def request(u: int, t: int):
        prompt = next_prompt(prompts.get(u), arm.replies.get((u, t - 1), []), system, user_turn(u, t, seed, vocab))
        prompts[u] = prompt
        arm.prompt_lens[u, t] = len(prompt)
        sampling = None
        if sampled:
            sampling = gemma_engine.SamplingParams(temperature=SAMPLED_TEMPERATURE, seed=1000 * seed + u)
        rid = len(ids)
        ids[rid] = (u, t)
        arm.replies[u, t] = []
        return gemma_engine.Request(rid, prompt, max_new, sampling=sampling, cache_boundary=len(system))

    def poll(free: int, idle: bool):
        if len(done) == users * turns:
            return None
        take = []
        for key in list(pending):
            if len(take) == free:
                break
            if key[1] == 0 or (key[0], key[1] - 1) in done:
                pending.remove(key)
                take.append(request(*key))
                admitted[key] = time.perf_counter()
            elif strict:
                break
        return take, []

    def on_events(events, stats) -> None:
        now = time.perf_counter()
        arm.prompt_read += stats["prompt_tokens"]
        arm.cache_hits += stats["cache_hits"]
        arm.cache_queries += stats["cache_queries"]
        if not stats["prompt_tokens"] and len(stats["batch_sizes"]) == 1:
            arm.steps.setdefault(stats["batch_sizes"][0], []).append(stats["seconds"])
        for e in events:
            key = ids[e.id]
            arm.cached[key] = cached_tokens(e)
            if e.tokens and key not in arm.ttft:
                arm.ttft[key] = now - admitted[key]
            arm.replies[key].extend(e.tokens)
            if e.finish:
                if e.finish != "length":
                    raise RuntimeError(f"user {key[0]} turn {key[1] + 1} ended {e.finish}: {e.error}")
                arm.decode_rate[key] = (len(arm.replies[key]) - 1) / max(e.decode_s, 1e-9)
                done.add(key)

    t0 = time.perf_counter()
    engine.run(poll, on_events, 1)
    arm.wall = time.perf_counter() - t0
    return arm


def new_engine(model_dir: Path, slots: int, context: int, caching: bool):
    """A fresh engine (an empty cache), warmed up on a short prompt that shares no prefix with the chats."""
    import gemma_engine

    engine = gemma_engine.Engine(str(model_dir), like=torch.zeros(1), context=context, dtype="float32",
                                 max_batch=slots, prefix_caching=caching)
    engine.decode([FIRST_ID + i for i in range(300)], 4)
    return engine


# --- figures ---------------------------------------------------------------------------------------------


def summarize(arm: Arm, turns: int) -> dict:
    """The scalar figures of one arm (TTFT in seconds)."""
    by_turn = [[s for (u, t), s in arm.ttft.items() if t == i] for i in range(turns)]
    tokens = sum(len(r) for r in arm.replies.values())
    return {
        "prompt_read": arm.prompt_read,
        "prompt_tokens": sum(arm.prompt_lens.values()),
        "hits": arm.cache_hits,
        "queries": arm.cache_queries,
        "event_cached": sum(arm.cached.values()),
        "ttft_p50": [percentile(x, 50) for x in by_turn],
        "ttft_p99": [percentile(x, 99) for x in by_turn],
        "ttft_later_p50": percentile([s for (u, t), s in arm.ttft.items() if t >= 1], 50),
        "agg": tokens / arm.wall,
        "decode": statistics.median(arm.decode_rate.values()),
        "wall": arm.wall,
    }


def median_of(summaries: list[dict]) -> dict:
    """Per figure, the median over rounds (per turn index for the per-turn lists)."""
    out = {}
    for k, v in summaries[0].items():
        if isinstance(v, list):
            out[k] = [statistics.median(s[k][i] for s in summaries) for i in range(len(v))]
        else:
            out[k] = statistics.median(s[k] for s in summaries)
    return out


@dataclass
class DecodeStep:
    """The turns that read no prompt, at `rows` decoding rows: per round each arm's median seconds."""

    rows: int
    off: list[float]
    on: list[float]
    fewest: int  # the fewest such turns an arm had in a round

    @property
    def ratios(self) -> list[float]:
        """on / off per round (the two arms of a round run back to back, so they share its machine load)."""
        return [b / a for a, b in zip(self.off, self.on)]


def decode_step(off: list[Arm], on: list[Arm]) -> DecodeStep | None:
    """The decode step alone, at the row count both arms ran most often in every round (a step's time
    grows with its rows), or None when no row count is in every arm."""
    arms = off + on
    common = set.intersection(*(set(a.steps) for a in arms))
    if not common:
        return None
    rows = max(common, key=lambda r: min(len(a.steps[r]) for a in arms))
    return DecodeStep(rows, [statistics.median(a.steps[rows]) for a in off],
                      [statistics.median(a.steps[rows]) for a in on], min(len(a.steps[rows]) for a in arms))


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report_a(title: str, off: dict, on: dict, step, rounds: int) -> None:
    """Print workload A's table and goal lines for one sampling mode (`off`/`on`: `median_of` figures)."""
    ms = 1e3
    print(f"\n{title}, medians of {rounds} round(s):")
    print(f"{'':<34} {'off':>10} {'on':>10} {'on/off':>8}")
    rows = [
        ("prompt tokens read", off["prompt_read"], on["prompt_read"], "{:>10,.0f}"),
        ("TTFT p50, turn 1, ms", off["ttft_p50"][0] * ms, on["ttft_p50"][0] * ms, "{:>10.0f}"),
        ("TTFT p50, turns 2 on, ms", off["ttft_later_p50"] * ms, on["ttft_later_p50"] * ms, "{:>10.0f}"),
        ("aggregate tokens/s", off["agg"], on["agg"], "{:>10.1f}"),
        ("decode tokens/s per request", off["decode"], on["decode"], "{:>10.1f}"),
        ("wall s", off["wall"], on["wall"], "{:>10.1f}"),
    ]
    if step:
        rows.append((f"decode step alone, {step.rows} rows, ms", statistics.median(step.off) * ms,
                     statistics.median(step.on) * ms, "{:>10.2f}"))
    for name, a, b, fmt in rows:
        print(f"{name:<34} {fmt.format(a)} {fmt.format(b)} {b / a:>8.3f}")
    print(f"{'cache hits / queries (tokens)':<34} {off['hits'] / max(off['queries'], 1):>10.1%} "
          f"{on['hits'] / max(on['queries'], 1):>10.1%}   ({on['hits']:,.0f} of {on['queries']:,.0f}; the sum of "
          f"Event.cached_tokens {'equals it' if on['event_cached'] == on['hits'] else 'DIFFERS: '}"
          f"{'' if on['event_cached'] == on['hits'] else format(on['event_cached'], ',.0f')})")
    print(f"prompt tokens sent {off['prompt_tokens']:,.0f} (off read {off['prompt_read']:,.0f})")
    print(f"{'turn':>4} {'off p50':>9} {'p99 ms':>7} {'on p50':>8} {'p99 ms':>7} {'on/off p50':>11}")
    for i, (a50, a99, b50, b99) in enumerate(zip(off["ttft_p50"], off["ttft_p99"], on["ttft_p50"], on["ttft_p99"])):
        print(f"{i + 1:>4} {a50 * ms:>9.0f} {a99 * ms:>7.0f} {b50 * ms:>8.0f} {b99 * ms:>7.0f} {b50 / a50:>11.3f}")
    read = on["prompt_read"] / off["prompt_read"]
    later = on["ttft_later_p50"] / off["ttft_later_p50"]
    decode = on["decode"] / off["decode"]
    print(f"{verdict(read <= 0.15)} prompt tokens read with caching: {read:.1%} of off (goal <= 15 %)")
    print(f"{verdict(later <= 0.40)} TTFT p50 from turn 2 on: {later:.1%} of off (goal <= 40 %)")
    if step:
        s = statistics.median(step.ratios) - 1
        print(f"{verdict(abs(s) <= 0.05)} decode step alone at {step.rows} rows: {s:+.1%} on against off, median "
              f"of the rounds' {', '.join(f'{r - 1:+.1%}' for r in step.ratios)} (goal within +-5 %; "
              f"{step.fewest} steps or more an arm a round)")
    else:
        print("FAIL decode step alone: no turn without a prompt at a row count both arms ran")
    print(f"{verdict(decode >= 0.95)} decode tokens/s per request (median): {decode - 1:+.1%} on against off "
          f"(goal: not below -5 %; it includes other requests' prompt chunks, which caching shrinks)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="greedy rounds of workload A (off, on each)")
    parser.add_argument("--sampled-rounds", type=int, default=1, help="sampled rounds of workload A (0: none)")
    parser.add_argument("--users", type=int, default=8, help="workload A's users")
    parser.add_argument("--turns", type=int, default=10, help="workload A's turns per user")
    parser.add_argument("--system-tokens", type=int, default=1000, help="the shared system turn's length")
    parser.add_argument("--max-new", type=int, default=64, help="tokens of each reply")
    parser.add_argument("--b-users", type=int, default=32, help="workload B's users (0: skip B)")
    parser.add_argument("--b-turns", type=int, default=3, help="workload B's turns per user")
    parser.add_argument("--slots", type=int, default=8, help="the engine's max_batch")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1, as the other CPU benches)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run of about a minute")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.sampled_rounds, args.users, args.turns = 1, 1, 4, 3
        args.system_tokens, args.max_new, args.b_users, args.b_turns = 256, 16, 12, 2
        args.slots, args.context = 4, 1024
    longest = longest_prompt(args.system_tokens, max(args.turns, args.b_turns), args.max_new) + args.max_new
    if longest > args.context:
        parser.error(f"the last turn can reach {longest} tokens, past --context {args.context}")
    if args.b_users and args.b_users <= args.slots:
        parser.error("--b-users must exceed --slots: workload B is more users than slots")
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    import gemma_engine

    config = make_config("small")
    system = system_turn(args.system_tokens, args.seed, config.vocab_size)
    print(f"small config: hidden {config.hidden_size}, layers {config.num_hidden_layers}, sliding window "
          f"{config.sliding_window}, vocab {config.vocab_size}; CPU float32, {torch.get_num_threads()} torch "
          f"thread(s); {args.slots} slots, context {args.context}, prefill_chunk 256, read_every 1")
    print(f"torch {torch.__version__}, gemma_engine {gemma_engine.__version__}", flush=True)
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-prefix.") as tmp:
        model_dir = Path(tmp)
        random_model(config, "cpu").save_pretrained(model_dir)
        layout = new_engine(model_dir, args.slots, args.context, True).layout()
        print(f"with caching: kv_bytes {layout['kv_bytes'] / 2**20:.1f} MiB, snapshots "
              f"{layout['snapshot_bytes_per_slot'] / 2**20:.2f} MiB a slot", flush=True)

        def arms(users: int, turns: int, sampled: bool, strict: bool, rounds: int, label: str):
            got: tuple[list[Arm], list[Arm]] = ([], [])
            for r in range(rounds):
                for side, caching in zip(got, (False, True)):
                    engine = new_engine(model_dir, args.slots, args.context, caching)
                    side.append(run_chat(engine, system, users, turns, args.max_new, args.seed, sampled, strict))
                    del engine
                    a = side[-1]
                    print(f"  [{time.perf_counter() - t_start:.0f} s] {label} round {r + 1} "
                          f"{'on ' if caching else 'off'}: read {a.prompt_read:,} prompt tokens, "
                          f"{a.wall:.1f} s", flush=True)
                diff = first_difference(got[0][-1].replies, got[1][-1].replies)
                if diff:
                    failures.append(f"{label} round {r + 1}: {diff}")
            return got

        header = (f"workload A: {args.users} users x {args.turns} turns, system turn {args.system_tokens} tokens, "
                  f"~100-token messages, {args.max_new} new tokens")
        for sampled, rounds in ((False, args.rounds), (True, args.sampled_rounds)):
            if not rounds:
                continue
            mode = f"sampled (temperature {SAMPLED_TEMPERATURE}, a seed per user)" if sampled else "greedy"
            off, on = arms(args.users, args.turns, sampled, False, rounds, "A " + mode.split()[0])
            report_a(f"{header}, {mode}", median_of([summarize(a, args.turns) for a in off]),
                     median_of([summarize(a, args.turns) for a in on]), decode_step(off, on), rounds)

        if args.b_users:
            (off_b,), (on_b,) = arms(args.b_users, args.b_turns, False, True, 1, "B")
            off, on = summarize(off_b, args.b_turns), summarize(on_b, args.b_turns)
            share = len(on_b.prompt_lens) * len(system) / on["prompt_tokens"]
            print(f"\nworkload B: {args.b_users} users x {args.b_turns} turns round-robin over {args.slots} "
                  f"slots, greedy, one round:")
            read = on["prompt_read"] / off["prompt_read"]
            print(f"hit rate {on['hits'] / max(on['queries'], 1):.1%} ({on['hits']:,} of {on['queries']:,} "
                  f"prompt tokens; the shared system turn is {share:.1%} of them); prompt tokens read "
                  f"{on['prompt_read']:,} against {off['prompt_read']:,} off ({read:.1%}); "
                  f"TTFT p50 from turn 2 on {on['ttft_later_p50'] * 1e3:.0f} against "
                  f"{off['ttft_later_p50'] * 1e3:.0f} ms")

    print(f"\noutputs identical with and without caching: {'NO' if failures else 'yes'}")
    for f in failures:
        print(f"  first difference, {f}")
    print(f"whole run: {time.perf_counter() - t_start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
