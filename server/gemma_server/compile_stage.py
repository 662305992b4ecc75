"""The compile stage's requests: what each engine runs so that the step shapes it will serve are captured and
compiled before the pod is ready (rust/src/engine/compiled.rs: a shape is captured at its second step).

Decode steps: each bucket filled with that many requests, greedy and sampled (`compile_buckets`: each bucket's
forwards, and its choices greedy and sampled; a choice with other stages compiles while serving); prompt chunks:
each chunk bucket as a prompt's first chunk and a later one (`compile_chunks`); with `--compile auto`, each
bucket's decode steps timed both ways (`choose_per_bucket`); with speculative decoding, at warmup, the verify steps
of the buckets that speculate (`compile_verify_steps`). None of these requests speculates (their steps are the
decode steps they are there for), and the server forgets what they leave in the prefix cache (boot.py).
"""

from __future__ import annotations

from typing import Any

COMPILE_TOKENS = 6  # tokens of each compile-stage request: 5 steps, read every other one
COMPILE_ATTEMPTS = 4  # sampled batches tried per bucket until one decodes all its tokens
TIMED_TOKENS = 32  # --compile auto: tokens each request decodes, each way, twice, to choose per bucket


def compile_buckets(gemma_engine, engine, vocab: int) -> int:
    """Every decode bucket's steps, greedy and sampled (`compile_batch`). Returns the first prompt index not
    used."""
    return each_bucket(gemma_engine, engine.buckets,
                       lambda b, sampling, first: compile_batch(gemma_engine, engine, b, sampling, vocab, first))


def compile_verify_steps(gemma_engine, engine, buckets: list[int], vocab: int) -> None:
    """The verify steps of each of `buckets`, greedy and sampled (`Engine.compile_verify`, rust/src/engine/
    tuning.rs). Raises ValueError when the engine cannot run them (its context too short)."""
    each_bucket(gemma_engine, buckets, lambda b, sampling, first: engine.compile_verify(
        [compile_prompt(first + k, vocab) for k in range(b)], sampling))


def each_bucket(gemma_engine, buckets: list[int], run) -> int:
    """`run(b, sampling, first)` for each bucket `b`, greedy and then sampled, `first` the index of the first of the
    `b` prompts it may use; again with the next prompts while it returns False (a request drew an eos before its
    steps ran twice), COMPILE_ATTEMPTS times at most. Returns the first prompt index not used."""
    first = 0
    for b in buckets:
        for sampled in (False, True):
            for _ in range(COMPILE_ATTEMPTS):
                sampling = gemma_engine.SamplingParams(temperature=0.7, seed=first) if sampled else None
                full = run(b, sampling, first)
                first += b
                if full:
                    break
    return first


def compile_prompt(k: int, vocab: int, length: int = 8) -> list[int]:
    """The k-th compile-stage prompt: `length` ids whose first differs from the others' (no prefix-cache hit among
    the requests of one batch, which would move one to another slot and bucket)."""
    return [(k * 7919 + i * 104729 + 3) % vocab for i in range(length)]


def compile_chunks(gemma_engine, engine, vocab: int, first: int) -> None:
    """Capture every prompt-chunk bucket (`engine.chunk_buckets`; rust/src/engine/chunks.rs) as a prompt's first
    chunk and as a later one: a prompt of t tokens is a first chunk of t, one of prefill_chunk + t tokens a first
    chunk of prefill_chunk and then a later one of t. Each is read twice by one request alone (a shape's second
    run is captured); prompts of `first` on, none past the context (such chunks never run)."""
    buckets = engine.chunk_buckets
    lengths = [n for t in buckets for n in (t, buckets[-1] + t) if n < engine.context]
    for k, n in enumerate(n for n in lengths for _ in range(2)):
        run_in_slots(engine, [gemma_engine.Request(k, compile_prompt(first + k, vocab, n), 1, speculative=False)], 2)


def compile_batch(gemma_engine, engine, b: int, sampling, vocab: int, first: int) -> bool:
    """`b` requests decoding COMPILE_TOKENS together in slots 0..b-1 (bucket b), tokens read every other step, so
    each bucket's first step after a read point and the next one each run twice, and so are captured. Their
    prompts are compile_prompt(first), compile_prompt(first + 1), ...: a caller passes a `first` no earlier
    batch used. Returns whether every request decoded all its tokens (none drew an eos first)."""
    requests = [gemma_engine.Request(k, compile_prompt(first + k, vocab), COMPILE_TOKENS, sampling=sampling,
                                     speculative=False)
                for k in range(b)]
    ended, _ = run_in_slots(engine, requests, 2)
    return all(f == "length" for f in ended.values())


def choose_per_bucket(gemma_engine, engine, b: int, vocab: int, read_every: int) -> dict[str, Any]:
    """Time bucket `b`'s decode steps eagerly and compiled, twice each, alternating; keep the faster way for that
    bucket (`use_compiled(on, b)`). Returns {"bucket", "eager", "compiled"} in ms a step (the better of two): `b`
    greedy requests decoding TIMED_TOKENS together, timed by the engine (the turns that ran decode steps alone)."""
    timed: dict[str, list[float]] = {"eager": [], "compiled": []}
    for on in (False, True, False, True):
        engine.use_compiled(on, b)
        requests = [gemma_engine.Request(k, compile_prompt(k, vocab), TIMED_TOKENS, speculative=False)
                    for k in range(b)]
        _, (seconds, steps) = run_in_slots(engine, requests, read_every)
        timed["compiled" if on else "eager"].append(seconds * 1000 / max(steps, 1))
    best = {k: min(v) for k, v in timed.items()}
    engine.use_compiled(best["compiled"] < best["eager"], b)
    return {"bucket": b, **{k: round(v, 3) for k, v in best.items()}}


def run_in_slots(engine, requests: list, read_every: int) -> tuple[dict[int, str], tuple[float, int]]:
    """Run `requests` together from slot 0 up (the prefix cache reset first: a free slot's history would send one
    elsewhere) until each ends. Returns each one's finish, and the seconds and count of the decode steps of the
    turns that ran no prompt. A request that ends other than "length" or "stop" raises, naming why."""
    engine.reset_prefix_cache()
    pending, ended, decode = list(requests), {}, [0.0, 0]

    def poll(free: int, idle: bool):
        nonlocal pending
        if not pending and len(ended) == len(requests):
            return None
        handed, pending = pending, []
        return handed, []

    def on_events(events, stats) -> None:
        for e in events:
            if e.finish is not None:
                if e.finish not in ("length", "stop"):
                    raise RuntimeError(f"a {e.finish} end of a boot-stage request: {e.error}")
                ended[e.id] = e.finish
        if stats.get("batch_sizes") and not stats.get("prompt_tokens"):
            decode[0] += stats["seconds"]
            decode[1] += len(stats["batch_sizes"])

    engine.run(poll, on_events, read_every)
    return ended, (decode[0], decode[1])
