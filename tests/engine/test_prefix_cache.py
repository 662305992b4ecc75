"""Prefix caching across requests (rust/src/engine/prefix.rs) through the real `Engine.run` loop, on the
tiny float32 checkpoints (sliding window 12, context 128).

Every hit must leave the tokens exactly those of a read of the whole prompt: greedy tokens equal
Transformers' `generate` on the whole prompt (tests/checkpoints/parity.py `greedy_reference`), seeded sampled
tokens equal the same engine's with caching off. The scenarios: chat turns that extend their history,
identical prompts again, matches that end inside the previous reply or prompt, histories around the
window length over an earlier occupant's stale entries, stop tokens between read points, a cancel
mid-prompt, n > 1 followers, a shared system prompt with a marked boundary, tenants with different
salts, and what drops a history (`Engine.logits`, a failed request).
"""

from dataclasses import dataclass, field

import pytest
import torch

import gemma_engine
from tests.checkpoints.parity import greedy_reference
from tests.engine.test_batching import KIND_PARAMS, PROMPTS, SAMPLED

CONTEXT = 128
W = 12  # the tiny config's sliding window (tests/checkpoints/text.py)
END = 4  # a "turn end" id the test chats put after each reply, as a chat template does



@pytest.fixture(scope="module")
def engines(checkpoint_dirs):
    """engines(kind, caching, **kwargs) -> a float32 engine of that checkpoint."""

    def make(kind, caching=True, **kwargs):
        model_dir, emb_dir = checkpoint_dirs[kind]
        kwargs = {"context": CONTEXT, "dtype": "float32", "like": torch.zeros(1), "max_batch": 2, **kwargs}
        return gemma_engine.Engine(str(model_dir), str(emb_dir) if emb_dir else None, prefix_caching=caching,
                                   **kwargs)

    return make


@pytest.fixture(scope="module")
def reference(reference_model):
    """reference(kind, prompt, max_new) -> (tokens, finish): Transformers' greedy run on the whole
    prompt, cut as the engine cuts it (an eos id ends it "stop" and is not returned)."""
    cache = {}

    def get(kind, prompt, max_new, stop_ids=()):
        key = (kind, tuple(prompt), max_new)
        if key not in cache:
            cache[key], _ = greedy_reference(reference_model(kind), list(prompt), max_new)
        stops = set(reference_model(kind).config.eos_token_id) | set(stop_ids)
        tokens = cache[key]
        for i, t in enumerate(tokens):
            if t in stops:
                return tokens[:i], "stop"
        return tokens, "length"

    return get


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    cached: set[int] = field(default_factory=set)


@dataclass
class Served:
    results: dict[int, Result]
    prompt_tokens_read: int
    cache_queries: int
    cache_hits: int


def serve(engine, requests, read_every=1, cancel_at=None) -> Served:
    """Run `requests` through `Engine.run` (all handed in at the first poll, queued while no slot is
    free); `cancel_at` = (poll call, id) cancels that request there."""
    queue, results, stats, calls = list(requests), {}, [], [0]

    def poll(free, idle):
        calls[0] += 1
        if not queue and all(r.finish for r in results.values()):
            return None
        new, queue[:] = queue[:free], queue[free:]
        for r in new:
            results[r.id] = Result()
        cancels = [cancel_at[1]] if cancel_at and calls[0] == cancel_at[0] else []
        return new, cancels

    def on_events(events, s):
        stats.append(s)
        for e in events:
            r = results[e.id]
            r.tokens += e.tokens
            r.cached.add(e.cached_tokens)
            if e.finish:
                r.finish, r.error = e.finish, e.error

    engine.run(poll, on_events, read_every)
    total = lambda key: sum(s.get(key, 0) for s in stats)  # noqa: E731
    return Served(results, total("prompt_tokens"), total("cache_queries"), total("cache_hits"))


def one(engine, rid, prompt, max_new, read_every=1, **kwargs) -> tuple[Result, Served]:
    served = serve(engine, [gemma_engine.Request(rid, prompt, max_new, **kwargs)], read_every)
    return served.results[rid], served


def cached(result: Result) -> int:
    (value,) = result.cached  # the same on every event of a request
    return value


def user_message(turn: int, length: int = 5) -> list[int]:
    return [3] + [(37 * turn + 11 * i) % 480 + 10 for i in range(length)]


def held(prompt: list[int], reply: Result) -> int:
    """Positions a finished request's rings hold: its prompt and every reply token fed back (a
    length-cut reply's last token was drawn, never fed; a stop token is not fed either)."""
    return len(prompt) + len(reply.tokens) - (1 if reply.finish == "length" else 0)


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_chat_turns_extend_their_history_and_match_transformers_on_the_whole_prompt(engines, reference, kind):
    """Each turn's prompt is the last prompt, the reply, a turn end and a new message: the turn reads
    only what its slot's rings do not hold (the whole history: the slot stopped at the reply's end),
    and its tokens are Transformers' on the whole prompt; caching off reads everything, same tokens."""
    on, off = engines(kind), engines(kind, caching=False)
    prompt, history = PROMPTS["parity"], 0
    for turn in range(4):
        max_new = 6
        got, served = one(on, turn, prompt, max_new)
        plain, _ = one(off, turn, prompt, max_new)
        assert (got.tokens, got.finish) == reference(kind, prompt, max_new) == (plain.tokens, plain.finish), turn
        assert cached(got) == history and cached(plain) == 0, turn
        assert served.prompt_tokens_read == len(prompt) - history
        assert (served.cache_queries, served.cache_hits) == (len(prompt), history)
        history = held(prompt, got)
        prompt = prompt + got.tokens + [END] + user_message(turn)
        assert len(prompt) < CONTEXT - max_new


def test_seeded_sampled_chat_draws_the_same_tokens_with_caching_on_and_off(engines):
    on, off = engines("dense"), engines("dense", caching=False)
    prompt = PROMPTS["other"]
    for turn in range(3):
        params = gemma_engine.SamplingParams(seed=100 + turn, **SAMPLED)
        got, _ = one(on, turn, prompt, 8, sampling=params)
        plain, _ = one(off, turn, prompt, 8, sampling=params)
        assert got.tokens == plain.tokens and len(got.tokens) == 8, turn
        assert (cached(got) > 0) == (turn > 0)
        prompt = prompt + got.tokens + [END] + user_message(turn)


@pytest.mark.parametrize("read_every", [3, 5])
def test_a_stop_token_between_read_points_ends_the_history_at_the_reply(engines, reference, read_every):
    """The slot stops on the device at its stop token, so nothing past the reply is written while it
    waits for the read point: the next turn reuses the whole reply."""
    engine = engines("dense")
    prompt = PROMPTS["parity"]
    full, _ = reference("dense", prompt, 20)
    assert len(full) == 20
    stop = full[7]
    cut = full.index(stop)
    got, _ = one(engine, 1, prompt, 20, read_every=read_every, stop_ids=[stop])
    assert (got.tokens, got.finish) == (full[:cut], "stop")
    following = prompt + got.tokens + [stop] + user_message(1)
    again, _ = one(engine, 2, following, 6, read_every=read_every)
    assert (again.tokens, again.finish) == reference("dense", following, 6)
    assert cached(again) == len(prompt) + cut


def test_the_same_prompt_again_resumes_one_token_before_its_end_from_the_snapshot(engines, reference):
    engine = engines("dense")
    prompt = PROMPTS["repeat"]  # 42 tokens: its sliding rings wrapped three times
    first, _ = one(engine, 1, prompt, 10)
    second, served = one(engine, 2, prompt, 10)
    assert first.tokens == second.tokens and (second.tokens, second.finish) == reference("dense", prompt, 10)
    assert cached(second) == len(prompt) - 1 and served.prompt_tokens_read == 1


def test_reset_prefix_cache_forgets_every_history_and_fills_the_lowest_slots(engines, reference):
    """vLLM's reset_prefix_cache: the same prompt again after a reset is read whole, and gives the same tokens."""
    engine = engines("dense")
    prompt = PROMPTS["repeat"]
    first, _ = one(engine, 1, prompt, 10)
    engine.reset_prefix_cache()
    again, served = one(engine, 2, prompt, 10)
    assert cached(again) == 0 and served.prompt_tokens_read == len(prompt)
    assert again.tokens == first.tokens and (again.tokens, again.finish) == reference("dense", prompt, 10)


def test_a_match_ending_inside_the_previous_reply_resumes_at_the_prompt_end(engines, reference):
    engine = engines("dense", max_batch=1)
    prompt = PROMPTS["other"]
    first, _ = one(engine, 1, prompt, 12)
    assert len(first.tokens) == 12
    diverged = prompt + first.tokens[:5] + [END, 7, 8]
    second, _ = one(engine, 2, diverged, 6)
    assert (second.tokens, second.finish) == reference("dense", diverged, 6)
    # The rings wrote the whole reply, so at prompt + 5 they hold the wrong window: only the snapshot
    # taken at the prompt's end serves.
    assert cached(second) == len(prompt)


def test_a_match_ending_inside_the_previous_prompt_reuses_nothing_sliding_without_a_snapshot(engines, reference):
    engine = engines("dense", max_batch=1)
    prompt = PROMPTS["long"][:60]
    one(engine, 1, prompt, 4)
    diverged = prompt[:40] + [499, 499, 499]
    second, _ = one(engine, 2, diverged, 6)
    assert (second.tokens, second.finish) == reference("dense", diverged, 6)
    assert cached(second) == 0
    # With a boundary marked at 30, a later request diverging after it resumes there.
    one(engine, 3, prompt, 4, cache_boundary=30)
    third, _ = one(engine, 4, diverged, 6)
    assert (third.tokens, third.finish) == reference("dense", diverged, 6)
    assert cached(third) == 30


def test_an_unwrapped_history_resumes_anywhere_inside_it(engines, reference):
    engine = engines("dense", max_batch=1)
    prompt = PROMPTS["parity"][:8]
    one(engine, 1, prompt, 3)  # 8 + 2 positions written, below the 12-entry ring
    diverged = prompt[:5] + [499, 499]
    second, _ = one(engine, 2, diverged, 6)
    assert (second.tokens, second.finish) == reference("dense", diverged, 6)
    assert cached(second) == 5


@pytest.mark.parametrize("chunk", [4, 5, 13, 256])
def test_histories_around_the_window_resume_exactly_where_the_rule_allows(engines, reference, chunk):
    """A slot that held a longer history (its stale entries stay in the rings) then a history of H
    positions (a prompt of H, max_new 1: the drawn token is never fed); the next prompt shares P of
    them. A wrapped ring (H > W) resumes only at H or H - 1 (or from its prompt-end snapshot at H, the
    same points); below the window anywhere."""
    engine = engines("dense", max_batch=1, prefill_chunk=chunk)
    base = PROMPTS["long"]
    rid = iter(range(1000))
    for h in (W - 1, W, W + 1, 2 * W - 1, 2 * W, 2 * W + 1):
        for p in (h - 2, h - 1, h):
            one(engine, next(rid), PROMPTS["other"], 8)  # the earlier occupant: 48 positions
            one(engine, next(rid), base[:h], 1)
            nxt = {h - 2: base[:h - 2] + [499, 498, 497], h - 1: base[:h], h: base[:h] + [499, 498]}[p]
            assert min(common(nxt, base[:h]), len(nxt) - 1) == p
            got, _ = one(engine, next(rid), nxt, 5)
            assert (got.tokens, got.finish) == reference("dense", nxt, 5), (h, p)
            assert cached(got) == (p if p >= h - 1 or h <= W else 0), (h, p)


def test_a_prompt_cancelled_mid_read_is_resumed_where_it_stopped(engines, reference):
    engine = engines("dense", max_batch=1, prefill_chunk=16)
    prompt = PROMPTS["long"]
    served = serve(engine, [gemma_engine.Request(1, prompt, 5)], cancel_at=(3, 1))
    assert served.results[1].finish == "cancelled"
    read = served.prompt_tokens_read
    assert 0 < read < len(prompt) and read % 16 == 0
    again, _ = one(engine, 2, prompt, 5)
    assert (again.tokens, again.finish) == reference("dense", prompt, 5)
    assert cached(again) == read


def test_followers_of_a_cached_prompt_and_their_histories_stay_exact(engines):
    """Two sampled choices of one prompt that extends an earlier history: the leader resumes from the
    cache, the follower copies its rings; a later turn extends the follower's own reply."""
    on, off = engines("dense", max_batch=3), engines("dense", max_batch=3, caching=False)
    first = PROMPTS["parity"]

    def run(engine):
        a, _ = one(engine, 1, first, 6)
        prompt = first + a.tokens + [END] + user_message(1)
        params = [gemma_engine.SamplingParams(seed=s, **SAMPLED) for s in (7, 8)]
        both = serve(engine, [gemma_engine.Request(10 + i, prompt, 6, sampling=p) for i, p in enumerate(params)])
        b = both.results[11]
        later = prompt + b.tokens + [END] + user_message(2)
        c, _ = one(engine, 20, later, 6)
        expected = [held(first, a), held(prompt, b)]
        return [both.results[10].tokens, b.tokens, c.tokens], [cached(both.results[10]), cached(c)], expected

    tokens_on, cached_on, expected = run(on)
    tokens_off, cached_off, _ = run(off)
    assert tokens_on == tokens_off
    # The leader resumed after the first turn; the last turn after the follower's own reply.
    assert cached_off == [0, 0] and cached_on == expected


def test_a_shared_system_prompt_is_reused_at_its_boundary_and_each_user_keeps_a_slot(engines, reference):
    engine = engines("dense", max_batch=2)
    system = PROMPTS["long"][:50]
    users = {u: system + user_message(u, 6) for u in (1, 2)}
    first, _ = one(engine, 1, users[1], 5, cache_boundary=len(system))
    second, _ = one(engine, 2, users[2], 5, cache_boundary=len(system))
    assert cached(first) == 0 and cached(second) == len(system)
    assert (second.tokens, second.finish) == reference("dense", users[2], 5)
    # User 2 resumed in the other slot: user 1's whole history is still there for its next turn.
    nxt = users[1] + first.tokens + [END] + user_message(3)
    third, _ = one(engine, 3, nxt, 5, cache_boundary=len(system))
    assert (third.tokens, third.finish) == reference("dense", nxt, 5)
    assert cached(third) == held(users[1], first)


def test_tenants_with_different_salts_never_share_keys(engines):
    engine = engines("dense", max_batch=3)
    prompt = PROMPTS["parity"]
    one(engine, 1, prompt, 4, cache_salt="tenant-a")
    other, _ = one(engine, 2, prompt, 4, cache_salt="tenant-b")
    unsalted, _ = one(engine, 3, prompt, 4)
    same, _ = one(engine, 4, prompt, 4, cache_salt="tenant-a")
    assert (cached(other), cached(unsalted), cached(same)) == (0, 0, len(prompt) - 1)
    assert other.tokens == unsalted.tokens == same.tokens


def test_logits_and_a_failed_request_drop_what_a_slot_held(engines, reference):
    engine = engines("dense", max_batch=1)
    prompt = PROMPTS["parity"]
    one(engine, 1, prompt, 4)
    engine.logits(PROMPTS["other"])  # writes slot 0 outside the loop
    after_logits, _ = one(engine, 2, prompt, 4)
    assert cached(after_logits) == 0
    engine.inject_fault_for_tests("decode", 3)
    failed, _ = one(engine, 3, prompt, 4)
    assert failed.finish == "failed"
    after_failure, _ = one(engine, 4, prompt, 4)
    assert cached(after_failure) == 0
    assert (after_failure.tokens, after_failure.finish) == reference("dense", prompt, 4)


def test_a_request_scoring_its_prompt_takes_no_hit(engines):
    engine = engines("dense")
    prompt = PROMPTS["parity"]
    one(engine, 1, prompt, 4)
    scored, _ = one(engine, 2, prompt, 0, prompt_logprobs=1)
    assert scored.finish == "length" and cached(scored) == 0


@pytest.mark.parametrize("field", ["cache_boundary", "next_turn"])
@pytest.mark.parametrize("boundary", [0, len(PROMPTS["parity"])])
def test_a_cache_mark_outside_the_prompt_is_refused_naming_it(engines, boundary, field):
    engine = engines("dense")
    got, _ = one(engine, 1, PROMPTS["parity"], 4, **{field: boundary})
    assert got.finish == "error" and field in got.error


# What a chat template's generation prompt may end with that its rendering of the reply drops (Gemma 4's
# empty thought channel with thinking off: `<|channel>thought\n<channel|>`).
SUFFIX = [9, 8, 7, 6]


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_a_turn_that_drops_the_prompts_last_tokens_resumes_where_next_turn_says(engines, reference, kind):
    """Each prompt ends with SUFFIX, which the next turn does not repeat: the next turn shares the prompt up
    to the suffix, the reply, then goes on. The prompt is longer than the sliding window, so its rings wrapped:
    only a snapshot at `next_turn` serves that point, and every later turn resumes exactly there, with the
    tokens of a read of the whole prompt (Transformers'). Without the mark nothing past the prompt's start is
    reused."""
    marked, unmarked = engines(kind), engines(kind)
    head = PROMPTS["parity"]
    for turn in range(3):
        prompt = head + SUFFIX
        got, served = one(marked, turn, prompt, 6, next_turn=len(head))
        plain, _ = one(unmarked, turn, prompt, 6)
        assert (got.tokens, got.finish) == reference(kind, prompt, 6) == (plain.tokens, plain.finish), turn
        if turn:
            assert cached(got) == len(shared) and served.prompt_tokens_read == len(prompt) - len(shared), turn
            assert cached(plain) == 0, turn
        shared = head
        head = head + got.tokens + [END] + user_message(turn)
        assert len(head) + len(SUFFIX) < CONTEXT - 6 and len(shared) > W


def test_the_same_prompt_again_with_next_turn_resumes_there(engines, reference):
    """With `next_turn` no snapshot is kept at the prompt's end: a regenerated reply reads the prompt's last
    few tokens again, and its tokens are the first's."""
    engine = engines("dense")
    prompt = PROMPTS["repeat"]
    first, _ = one(engine, 1, prompt, 10, next_turn=len(prompt) - len(SUFFIX))
    second, served = one(engine, 2, prompt, 10, next_turn=len(prompt) - len(SUFFIX))
    assert first.tokens == second.tokens and (second.tokens, second.finish) == reference("dense", prompt, 10)
    assert cached(second) == len(prompt) - len(SUFFIX) and served.prompt_tokens_read == len(SUFFIX)


def test_both_marks_are_kept_a_shared_system_prompt_and_the_next_turn(engines, reference):
    """A prompt with both marks is read in chunks ending at each: another user reuses the system prompt, the
    same conversation's next turn reuses everything before the suffix."""
    engine = engines("dense", max_batch=2)
    system = PROMPTS["long"][:30]
    user = system + user_message(1, 8)
    first, _ = one(engine, 1, user + SUFFIX, 5, cache_boundary=len(system), next_turn=len(user))
    other, _ = one(engine, 2, system + user_message(2, 8) + SUFFIX, 5, cache_boundary=len(system),
                   next_turn=len(system) + 9)
    nxt = user + first.tokens + [END] + user_message(3) + SUFFIX
    again, _ = one(engine, 3, nxt, 5, cache_boundary=len(system), next_turn=len(nxt) - len(SUFFIX))
    assert cached(first) == 0 and cached(other) == len(system) and cached(again) == len(user)
    for result, prompt in ((other, system + user_message(2, 8) + SUFFIX), (again, nxt)):
        assert (result.tokens, result.finish) == reference("dense", prompt, 5)


@pytest.mark.parametrize("read_every, chunk", [(1, 5), (3, 16)])
def test_random_overlapping_sessions_draw_the_same_tokens_with_caching_on_and_off(engines, read_every, chunk):
    """Sessions drawn from a fixed seed: each step continues, forks (inside the last reply or prompt), or
    repeats one of the earlier prompts, in batches of up to four requests over three slots, greedy and
    seeded, some salted, some with a boundary, some with a next-turn mark. Every request's tokens must equal
    caching off's."""
    import random

    rng = random.Random(1234 + read_every)
    on = engines("dense", max_batch=3, prefill_chunk=chunk)
    off = engines("dense", max_batch=3, prefill_chunk=chunk, caching=False)
    past: list[list[int]] = [PROMPTS["parity"], PROMPTS["other"][:20]]
    rid, hits = 0, 0
    for _ in range(12):
        batch = []
        for _ in range(rng.randint(1, 4)):
            base = rng.choice(past)
            cut = rng.randint(1, len(base))
            kind = rng.random()
            prompt = base if kind < 0.2 else base[:cut] + user_message(rng.randint(0, 99), rng.randint(1, 6))
            prompt = prompt[: CONTEXT - 20]
            sampling = gemma_engine.SamplingParams(seed=rid, **SAMPLED) if rng.random() < 0.5 else None
            extra = {"cache_salt": rng.choice([None, None, "t"])}
            if len(prompt) > 10 and rng.random() < 0.3:
                extra["cache_boundary"] = rng.randint(1, len(prompt) - 1)
            if len(prompt) > 10 and rng.random() < 0.3:
                extra["next_turn"] = rng.randint(1, len(prompt) - 1)
            batch.append(dict(id=rid, ids=prompt, max_new=rng.randint(1, 8), sampling=sampling, **extra))
            rid += 1
        got = serve(on, [gemma_engine.Request(**r) for r in batch], read_every).results
        want = serve(off, [gemma_engine.Request(**r) for r in batch], read_every).results
        for r in batch:
            assert (got[r["id"]].tokens, got[r["id"]].finish) == (want[r["id"]].tokens, want[r["id"]].finish), r
            hits += cached(got[r["id"]]) > 0
            past.append(r["ids"] + got[r["id"]].tokens + [END])
    assert hits >= 5  # the sessions did reuse keys (deterministic: the draws are seeded)
