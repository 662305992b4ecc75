"""Continuous batching through the real `Engine.run(poll, on_events, read_every)` loop
(rust/src/engine/) with several sequence slots, on the three tiny float32 checkpoints.

Every token is checked against Transformers: greedy requests against `generate` on their prompt
alone (tests/checkpoints/parity.py `greedy_reference`), log-probabilities against `log_softmax` of
Transformers' forward over the prompt and the tokens so far, sampled requests against Transformers'
logits processors with the engine's documented draw (tests/engine/test_sampling.py checks the
sampler itself). The
scenarios: requests of different lengths arriving at different read points, more requests than
slots, cancels mid-decode and mid-prompt, a long prompt read in chunks while other streams decode,
seeded sampling whatever the batch around it, refusals beside normal requests, and callback errors.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

import gemma_engine
from gemma_engine import testing
from tests.checkpoints.parity import PARITY_PROMPT, greedy_reference
from tests.engine.test_sampling import inverse_cdf_draw, transformers_scores

# The quantized checkpoints repeat the dense runs on other weights: the long suite only.
KIND_PARAMS = ["dense", pytest.param("w4a16", marks=pytest.mark.slow), pytest.param("emb4", marks=pytest.mark.slow)]
CONTEXT = 128
VOCAB = 512

# Prompts from the parity prompt and variations: below, at and above the 12-token sliding window.
PROMPTS = {
    "parity": PARITY_PROMPT,  # 28
    "short": PARITY_PROMPT[:9],
    "other": [2] + [(53 * i + 7) % 500 + 3 for i in range(40)],  # 41
    "repeat": PARITY_PROMPT + PARITY_PROMPT[1:15],  # 42
    "tiny": [2, 5],
    "long": [2] + [(29 * i + 3) % 500 + 3 for i in range(99)],  # 100
    "one": [7],
}
# Tokens of each Transformers greedy reference: enough for every request below.
REFERENCE_TOKENS = {"parity": 60, "short": 48, "other": 40, "repeat": 40, "tiny": 48, "long": 20, "one": 16}

SAMPLED = dict(
    temperature=0.9,
    top_k=40,
    top_p=0.95,
    min_p=0.02,
    presence_penalty=0.3,
    frequency_penalty=0.2,
    repetition_penalty=1.1,
    # The eos ids (1, 50, 106) biased away, so a sampled stream runs its full length whatever the weights.
    logit_bias={1: -100.0, 5: 1.0, 50: -100.0, 106: -100.0, 291: -2.0},
)



def _engine(checkpoint_dirs, kind, **kwargs) -> gemma_engine.Engine:
    """An engine without prefix caching: these tests pin which prompts each forward reads, and a
    re-sent prompt would be read as a later chunk after a hit (test_prefix_cache.py tests that)."""
    model_dir, emb_dir = checkpoint_dirs[kind]
    kwargs = {"context": CONTEXT, "dtype": "float32", "like": torch.zeros(1), "prefix_caching": False, **kwargs}
    return gemma_engine.Engine(str(model_dir), str(emb_dir) if emb_dir else None, **kwargs)


@pytest.fixture(scope="module")
def greedy(reference_model):
    """greedy(kind, prompt_name, max_new) -> (tokens, finish): Transformers' greedy run on that
    prompt alone, cut as the engine cuts it (an eos id ends it with "stop" and is not returned)."""
    cache = {}

    def get(kind, name, max_new):
        if (kind, name) not in cache:
            tokens, _ = greedy_reference(reference_model(kind), PROMPTS[name], REFERENCE_TOKENS[name])
            cache[kind, name] = tokens
        tokens = cache[kind, name][:max_new]
        eos = set(reference_model(kind).config.eos_token_id)
        for i, t in enumerate(tokens):
            if t in eos:
                return tokens[:i], "stop"
        assert len(tokens) == max_new, "the reference run is shorter than the request"
        return tokens, "length"

    return get


def _forward_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Transformers' float32 logits for each generated token, each from its own forward over the
    prompt and the tokens before it: [len(tokens), vocab].

    One forward per step, not one over the whole sequence: this random model amplifies float32
    rounding, so the logits at one position move by up to ~1e-3 with the attention kernel's shapes
    (Transformers' eager and sdpa attention differ by 9e-4 on the parity prompt, and one sdpa forward
    over 32 or more tokens moves position 27 by 6e-4). Step by step, the engine and Transformers
    agree within ~1e-5 (measured on the dense checkpoint).
    """
    rows = []
    with torch.no_grad():  # on one thread, as every test here (`_one_thread`)
        for step in range(len(tokens)):
            rows.append(model(torch.tensor([prompt + tokens[:step]])).logits[0, -1].float())
    return torch.stack(rows)


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    finish: str | None = None
    error: str | None = None


@dataclass
class Script:
    """Drives `Engine.run`: requests arrive at chosen `poll` calls and wait in a FIFO queue until a
    slot is free; `cancel(call, script)` names ids to cancel at a call. Records every event and
    the loop's stats; `poll` ends the loop once every request has finished."""

    arrivals: dict[int, list[gemma_engine.Request]]
    cancel: Callable[[int, "Script"], list[int]] = lambda call, script: []
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    queue: list = field(default_factory=list)
    calls: int = 0
    admitted: dict[int, int] = field(default_factory=dict)  # id -> poll call that handed it in
    finished_at: dict[int, int] = field(default_factory=dict)  # id -> poll calls made before its end
    stats: list[dict] = field(default_factory=list)
    free_seen: list[int] = field(default_factory=list)

    def poll(self, free, idle):
        call = self.calls
        self.calls += 1
        assert call < 10_000, "the loop does not end"
        self.free_seen.append(free)
        self.queue += self.arrivals.get(call, [])
        done = all(o.finish for o in self.outcomes.values())
        if not self.queue and done and call >= max(self.arrivals, default=0):
            return None
        new, self.queue = self.queue[:free], self.queue[free:]
        for r in new:
            self.admitted[r.id] = call
            self.outcomes[r.id] = Outcome()
        return new, self.cancel(call, self)

    def on_events(self, events, stats):
        self.stats.append({**stats, "call": self.calls})
        for e in events:
            o = self.outcomes[e.id]
            assert o.finish is None, f"request {e.id} got an event after it ended {o.finish}"
            o.tokens += e.tokens
            o.logprobs += e.logprobs
            o.prompt_logprobs = o.prompt_logprobs or e.prompt_logprobs
            assert len(e.logprobs) in (0, len(e.tokens))
            if e.finish is not None:
                o.finish, o.error = e.finish, e.error
                self.finished_at[e.id] = self.calls

    def run(self, engine, read_every=1) -> dict[int, Outcome]:
        engine.run(self.poll, self.on_events, read_every)
        return self.outcomes

    def batch_sizes(self) -> list[int]:
        return [b for s in self.stats for b in s["batch_sizes"]]


def _request(rid, name, max_new, **kwargs) -> gemma_engine.Request:
    return gemma_engine.Request(rid, PROMPTS[name], max_new, **kwargs)


# ----------------------------------------------------------------------------- greedy batches

# (id, prompt, max_new, the poll call it arrives at)
STAGGERED = [(0, "parity", 40, 0), (1, "short", 24, 0), (2, "other", 32, 2), (3, "repeat", 20, 4), (4, "tiny", 48, 7)]


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_staggered_greedy_requests_in_one_batch_each_match_transformers_alone(checkpoint_dirs, greedy, kind):
    engine = _engine(checkpoint_dirs, kind, max_batch=4, prefill_chunk=5)
    arrivals = {}
    for rid, name, max_new, call in STAGGERED:
        arrivals.setdefault(call, []).append(_request(rid, name, max_new))
    script = Script(arrivals)
    outcomes = script.run(engine, read_every=3)
    for rid, name, max_new, _ in STAGGERED:
        tokens, finish = greedy(kind, name, max_new)
        assert (outcomes[rid].tokens, outcomes[rid].finish) == (tokens, finish), f"request {rid} ({name})"
    # Batched for real: decode steps ran several requests at once, never more than the slots.
    sizes = script.batch_sizes()
    assert max(sizes) == 4 and sum(s >= 3 for s in sizes) >= 10
    # Every prompt was read exactly once.
    assert sum(s["prompt_tokens"] for s in script.stats) == sum(len(PROMPTS[n]) for _, n, _, _ in STAGGERED)


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_a_burst_of_short_prompts_is_read_in_one_forward_and_each_gets_its_tokens_alone(
        checkpoint_dirs, greedy, kind):
    """Five prompts of 41, 28, 9, 2 and 1 tokens arrive at once: 5 rows x 41 fit the 256-token
    budget, so one forward reads them all, left-padded. A seeded sampled request among them draws
    what it draws alone."""
    burst = [(0, "other", 20), (1, "parity", 30), (2, "short", 24), (3, "tiny", 16)]
    alone = Script({0: [_sampled(4, "one", 16)]}).run(_engine(checkpoint_dirs, kind, max_batch=1))[4]
    script = Script({0: [_request(rid, name, n) for rid, name, n in burst] + [_sampled(4, "one", 16)]})
    outcomes = script.run(_engine(checkpoint_dirs, kind, max_batch=5, prefill_chunk=256))
    for rid, name, max_new in burst:
        assert (outcomes[rid].tokens, outcomes[rid].finish) == greedy(kind, name, max_new), f"request {rid} ({name})"
    assert outcomes[4].tokens == alone.tokens and len(alone.tokens) == 16
    assert [r for s in script.stats for r in s["prompt_reads"]] == [5]
    assert sum(s["prompt_tokens"] for s in script.stats) == 41 + 28 + 9 + 2 + 1


def test_a_prompt_read_in_a_group_hands_its_keys_to_its_followers(checkpoint_dirs, greedy):
    """The n choices of a request whose prompt is read with others in one forward: the follower copies
    the leader's keys from the grouped read and draws its own tokens."""
    alone = Script({0: [_sampled(1, seed=9)]}).run(_engine(checkpoint_dirs, "dense", max_batch=1))[1]
    script = Script({0: [_request(0, "parity", 20), _sampled(1, seed=9), _request(2, "short", 12),
                         _request(3, "tiny", 12)]})
    outcomes = script.run(_engine(checkpoint_dirs, "dense", max_batch=4, prefill_chunk=256))
    for rid, name in [(0, "parity"), (2, "short"), (3, "tiny")]:
        assert (outcomes[rid].tokens, outcomes[rid].finish) == greedy("dense", name, 12 if rid else 20), rid
    assert outcomes[1].tokens == alone.tokens and len(alone.tokens) == 40
    assert [r for s in script.stats for r in s["prompt_reads"]] == [3]
    assert sum(s["prompt_tokens"] for s in script.stats) == 28 + 9 + 2


def test_prompts_read_together_across_a_decoding_slot_leave_its_tokens_exact(checkpoint_dirs, greedy):
    """Three prompts fill the 3 x 28 budget and are read together; the two short requests end, and
    two new ones take slots 0 and 2 while slot 1 decodes. They too are read in one forward, over
    slots 0..2, where slot 1's row is padding that writes only its never-visible entry."""
    engine = _engine(checkpoint_dirs, "dense", max_batch=3, prefill_chunk=84)
    first = [(0, "tiny", 2), (1, "parity", 50), (2, "short", 2)]
    later = [(3, "short", 30), (4, "tiny", 20)]
    script = Script({0: [_request(*r) for r in first], 6: [_request(*r) for r in later]})
    outcomes = script.run(engine, read_every=1)
    for rid, name, max_new in first + later:
        assert (outcomes[rid].tokens, outcomes[rid].finish) == greedy("dense", name, max_new), rid
    assert [r for s in script.stats for r in s["prompt_reads"]] == [3, 2]
    assert script.finished_at[0] <= 6 and script.finished_at[2] <= 6 and script.finished_at[1] > 6


def test_a_one_token_prompt_beside_a_chunked_one_matches_transformers(checkpoint_dirs, greedy):
    """A one-token forward of a first chunk (the prompt [7]) and of a later one (the 9-token prompt
    in chunks of 4 ends with one token), both through the decode step's buffers."""
    engine = _engine(checkpoint_dirs, "dense", max_batch=2, prefill_chunk=4)
    outcomes = Script({0: [_request(0, "one", 16), _request(1, "short", 12)]}).run(engine)
    assert (outcomes[0].tokens, outcomes[0].finish) == greedy("dense", "one", 16)
    assert (outcomes[1].tokens, outcomes[1].finish) == greedy("dense", "short", 12)


def test_cancelled_and_finished_slots_are_reused(checkpoint_dirs, greedy):
    # Two slots, five requests: 1 is cancelled mid-decode, 2 while its prompt is still being read
    # (42 tokens in chunks of 4, two chunks a read point), and 3 and 4 run in the freed slots.
    engine = _engine(checkpoint_dirs, "dense", max_batch=2, prefill_chunk=4)
    requests = [_request(0, "parity", 30), _request(1, "other", 40), _request(2, "repeat", 40),
                _request(3, "short", 24), _request(4, "tiny", 20)]
    cancelled = set()

    def cancel(call, script):
        ids = []
        if 1 not in cancelled and len(script.outcomes[1].tokens) >= 3:
            ids.append(1)
        if 2 not in cancelled and script.admitted.get(2, call) < call:
            ids.append(2)
        cancelled.update(ids)
        return ids

    script = Script({0: requests}, cancel)
    outcomes = script.run(engine, read_every=2)
    ref1, _ = greedy("dense", "other", 40)
    assert outcomes[1].finish == "cancelled"
    assert 3 <= len(outcomes[1].tokens) < 40 and outcomes[1].tokens == ref1[: len(outcomes[1].tokens)]
    assert (outcomes[2].finish, outcomes[2].tokens) == ("cancelled", [])
    for rid, name, max_new in [(0, "parity", 30), (3, "short", 24), (4, "tiny", 20)]:
        assert (outcomes[rid].tokens, outcomes[rid].finish) == greedy("dense", name, max_new), rid
    # Requests 2-4 waited for a slot that another request left.
    assert script.admitted[2] >= script.finished_at[1]
    assert script.admitted[3] >= min(script.finished_at[0], script.finished_at[2])
    assert max(script.batch_sizes()) == 2 and max(script.free_seen) == 2


def test_long_prompt_read_in_chunks_while_others_decode_leaves_their_tokens_exact(checkpoint_dirs, greedy):
    engine = _engine(checkpoint_dirs, "dense", max_batch=4, prefill_chunk=8)
    script = Script({0: [_request(0, "parity", 60), _request(1, "short", 48)], 6: [_request(2, "long", 20)]})
    outcomes = script.run(engine, read_every=1)
    for rid, name, max_new in [(0, "parity", 60), (1, "short", 48), (2, "long", 20)]:
        assert (outcomes[rid].tokens, outcomes[rid].finish) == greedy("dense", name, max_new), rid
    # Interleaved: while the 100-token prompt was read (13 chunks), both streams took a decode step
    # at every turn (read_every=1: one turn per read point).
    reading = [s for s in script.stats if s["call"] > script.admitted[2] and s["prompt_tokens"] > 0]
    assert [s["prompt_tokens"] for s in reading] == [8] * 12 + [4]
    assert all(s["batch_sizes"] == [2] for s in reading)


def test_requests_with_one_prompt_read_it_once_and_each_draws_its_own_tokens(checkpoint_dirs, greedy):
    """The n choices of one OpenAI request reach the engine as requests with the same prompt: the
    first reads it, the others (one arriving while it is still read) copy its keys."""
    def alone(request):
        return Script({0: [request]}).run(_engine(checkpoint_dirs, "dense", max_batch=1))[request.id]

    seeds = {1: 5, 2: 6, 4: 7}
    engine = _engine(checkpoint_dirs, "dense", max_batch=5, prefill_chunk=5)
    script = Script({
        0: [_request(0, "parity", 30), _sampled(1, seed=5), _sampled(2, seed=6), _request(3, "other", 20)],
        2: [_sampled(4, seed=7)],
    })
    outcomes = script.run(engine, read_every=1)
    assert (outcomes[0].tokens, outcomes[0].finish) == greedy("dense", "parity", 30)
    assert (outcomes[3].tokens, outcomes[3].finish) == greedy("dense", "other", 20)
    for rid, seed in seeds.items():
        assert outcomes[rid].tokens == alone(_sampled(rid, seed=seed)).tokens, rid
    assert len({tuple(outcomes[rid].tokens) for rid in seeds}) == 3  # three seeds, three draws
    # 28 + 41 tokens: each prompt read once, the late follower included (it came while 10 of 28
    # tokens were read).
    assert sum(s["prompt_tokens"] for s in script.stats) == len(PROMPTS["parity"]) + len(PROMPTS["other"])


def test_a_follower_reads_the_prompt_when_its_leader_is_cancelled_first(checkpoint_dirs, greedy):
    engine = _engine(checkpoint_dirs, "dense", max_batch=3, prefill_chunk=4)
    requests = [_request(0, "parity", 20), _request(1, "parity", 20), _request(2, "parity", 12)]
    script = Script({0: requests}, lambda call, script: [0] if call == 2 else [])
    outcomes = script.run(engine, read_every=1)
    assert outcomes[0].finish == "cancelled"
    assert (outcomes[1].tokens, outcomes[1].finish) == greedy("dense", "parity", 20)
    assert (outcomes[2].tokens, outcomes[2].finish) == greedy("dense", "parity", 12)
    # Request 0 read 2 chunks before it went; request 1 read the whole prompt again, once for both.
    assert sum(s["prompt_tokens"] for s in script.stats) == 8 + len(PROMPTS["parity"])


# ----------------------------------------------------------------------------- seeded sampling


def _sampled(rid, name="parity", max_new=40, seed=1234, **kwargs):
    params = gemma_engine.SamplingParams(seed=seed, **{**SAMPLED, **kwargs})
    return gemma_engine.Request(rid, PROMPTS[name], max_new, sampling=params)


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_seeded_request_draws_the_same_tokens_alone_and_in_any_busy_batch(checkpoint_dirs, kind):
    alone = Script({0: [_sampled(7)]}).run(_engine(checkpoint_dirs, kind, max_batch=1, prefill_chunk=256))[7]
    assert alone.finish == "length" and len(alone.tokens) == 40

    # Busy: greedy and other sampled requests (one with the same seed on another prompt), the
    # seeded request arriving second, read in chunks of 7, tokens read every 3 turns.
    busy = Script({
        0: [_request(1, "other", 30), _sampled(2, "short", 40, seed=99)],
        1: [_sampled(7)],
        3: [_request(3, "repeat", 20), _sampled(4, "tiny", 30, seed=1234)],
    }).run(_engine(checkpoint_dirs, kind, max_batch=4, prefill_chunk=7), read_every=3)
    # Another order, other slots, chunks of 3, reads every 5 turns, and a queue.
    reordered = Script({
        0: [_sampled(7), _sampled(4, "tiny", 30, seed=1234)],
        1: [_sampled(2, "short", 40, seed=99)],
        2: [_request(1, "other", 30), _request(3, "repeat", 20)],
    }).run(_engine(checkpoint_dirs, kind, max_batch=3, prefill_chunk=3), read_every=5)
    decoded, finish, _, _ = _engine(checkpoint_dirs, kind, prefill_chunk=13).decode(
        PROMPTS["parity"], 40, read_every=2, sampling=gemma_engine.SamplingParams(seed=1234, **SAMPLED)
    )
    assert busy[7].tokens == alone.tokens
    assert reordered[7].tokens == alone.tokens
    assert (decoded, finish) == (alone.tokens, "length")
    for rid in (1, 2, 3, 4):
        assert busy[rid].tokens == reordered[rid].tokens, rid


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_sampled_tokens_are_transformers_processors_with_the_engine_uniform_draws(
    checkpoint_dirs, reference_model, kind
):
    # Each token of a seeded request is the inverse-CDF draw, with gemma_engine.testing.uniform(seed, step),
    # from the distribution Transformers' processors give at that step: Transformers' logits on the
    # prompt and the tokens so far, penalties over those tokens (tests/engine/test_sampling.py).
    engine = _engine(checkpoint_dirs, kind, max_batch=2, prefill_chunk=6)
    script = Script({0: [_sampled(0), _request(1, "other", 30)]})
    tokens = script.run(engine, read_every=4)[0].tokens
    assert len(tokens) == 40
    prompt = PROMPTS["parity"]
    logits = _forward_logits(reference_model(kind), prompt, tokens)
    uniforms = testing.uniform([1234] * len(tokens), list(range(len(tokens))))
    for step, (token, u) in enumerate(zip(tokens, uniforms)):
        scores = transformers_scores(logits[step], SAMPLED, prompt, tokens[:step])
        assert token == inverse_cdf_draw(scores, u), f"step {step}"
    greedy_tokens = engine.decode(prompt, len(tokens))[0]
    assert tokens != greedy_tokens


# ----------------------------------------------------------------------------- logprobs


# Float32 tolerance of a log-probability on these random models: the engine's decode steps and
# Transformers' step-by-step forwards differ by up to 3e-4 among the top 20 on the dense checkpoint
# and 1.1e-3 on the W4A16 one (measured on an AMD EPYC; the CPU's kernels move it); different
# attention kernels within Transformers differ by as much (`_forward_logits`).
LOGPROB_TOLERANCE = 2e-3


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_logprobs_equal_log_softmax_of_transformers_logits(checkpoint_dirs, reference_model, greedy, kind):
    engine = _engine(checkpoint_dirs, kind, max_batch=4, prefill_chunk=16)
    requests = [
        gemma_engine.Request(0, PROMPTS["parity"], 24, sampling=gemma_engine.SamplingParams(logprobs=5)),
        gemma_engine.Request(1, PROMPTS["other"], 16, sampling=gemma_engine.SamplingParams(logprobs=20)),
        gemma_engine.Request(2, PROMPTS["short"], 16, sampling=gemma_engine.SamplingParams(logprobs=0)),
        gemma_engine.Request(3, PROMPTS["tiny"], 16),
        _sampled(4, "repeat", 16, logprobs=3),
    ]
    outcomes = Script({0: requests[:3], 2: requests[3:]}).run(engine, read_every=3)
    model = reference_model(kind)
    for rid, name, k in [(0, "parity", 5), (1, "other", 20), (2, "short", 0), (4, "repeat", 3)]:
        o = outcomes[rid]
        if rid != 4:
            assert (o.tokens, o.finish) == greedy(kind, name, 24 if rid == 0 else 16)
        assert len(o.logprobs) == len(o.tokens) > 0
        expected = torch.log_softmax(_forward_logits(model, PROMPTS[name], o.tokens).double(), -1)
        for step, (token, (chosen, top)) in enumerate(zip(o.tokens, o.logprobs)):
            assert chosen == pytest.approx(float(expected[step, token]), abs=LOGPROB_TOLERANCE), (rid, step)
            assert len(top) == k and len({t for t, _ in top}) == k
            # The k best values, in order, and each id really has its value (ids of near-equal
            # values may swap places).
            best = expected[step].topk(k).values.tolist() if k else []
            assert [lp for _, lp in top] == pytest.approx(best, abs=LOGPROB_TOLERANCE), (rid, step)
            for t, lp in top:
                assert lp == pytest.approx(float(expected[step, t]), abs=LOGPROB_TOLERANCE), (rid, step, t)
    assert outcomes[3].logprobs == [] and (outcomes[3].tokens, outcomes[3].finish) == greedy(kind, "tiny", 16)


# ----------------------------------------------------------------------------- refusals


def test_refused_requests_end_with_error_while_the_others_finish(checkpoint_dirs, greedy):
    engine = _engine(checkpoint_dirs, "dense", max_batch=2)
    bad = {
        10: (gemma_engine.Request(10, [2] * CONTEXT, 4), rf"the prompt has {CONTEXT} tokens; the context holds {CONTEXT}"),
        11: (gemma_engine.Request(11, PROMPTS["parity"] + [VOCAB], 4),
             rf"token id {VOCAB} at position 28 is outside the vocabulary \[0, {VOCAB}\)"),
        12: (gemma_engine.Request(12, [2, -3], 4), r"token id -3 at position 1 is outside the vocabulary"),
        13: (gemma_engine.Request(13, PROMPTS["tiny"], 4, sampling=gemma_engine.SamplingParams(logit_bias={VOCAB: 1.0})),
             rf"logit_bias: token id {VOCAB} is outside the vocabulary"),
        14: (gemma_engine.Request(14, PROMPTS["tiny"], 0), r"max_new must be >= 1"),
        15: (gemma_engine.Request(15, [], 4), r"the prompt is empty"),
    }
    good = [_request(0, "parity", 20), _request(1, "short", 20), _request(2, "tiny", 20)]
    arrivals = {0: [good[0], bad[10][0], bad[11][0]], 1: [bad[12][0], good[1], bad[13][0]], 3: [bad[14][0], bad[15][0], good[2]]}
    outcomes = Script(arrivals).run(engine, read_every=2)
    for rid, (_, message) in bad.items():
        assert outcomes[rid].finish == "error" and outcomes[rid].tokens == [], rid
        assert re.search(message, outcomes[rid].error or ""), (rid, outcomes[rid].error)
    for r, name in zip(good, ("parity", "short", "tiny")):
        assert (outcomes[r.id].tokens, outcomes[r.id].finish, outcomes[r.id].error) == (*greedy("dense", name, 20), None)


def test_more_requests_than_free_slots_are_refused_as_busy(checkpoint_dirs, greedy):
    engine = _engine(checkpoint_dirs, "dense", max_batch=2)
    outcomes: dict[int, list] = {}
    handed = False

    def poll(free, idle):
        nonlocal handed
        if not handed:
            handed = True
            return [_request(i, "tiny", 8) for i in range(3)], []
        return None if all(v[1] for v in outcomes.values()) else ([], [])

    def on_events(events, stats):
        for e in events:
            entry = outcomes.setdefault(e.id, [[], None, None])
            entry[0] += e.tokens
            if e.finish:
                entry[1], entry[2] = e.finish, e.error

    engine.run(poll, on_events)
    assert outcomes[2][1:] == ["error", "all 2 slots are busy"]
    for i in (0, 1):
        assert (outcomes[i][0], outcomes[i][1]) == greedy("dense", "tiny", 8)


def test_max_batch_below_one_is_value_error(dense_checkpoint):
    with pytest.raises(ValueError, match="max_batch must be >= 1, got 0"):
        gemma_engine.Engine(str(dense_checkpoint), max_batch=0)


@pytest.mark.parametrize("kind", ["dense", "w4a16"])
def test_weights_that_cannot_fit_are_refused_before_loading_naming_the_sizes(checkpoint_dirs, kind, monkeypatch):
    """The engine reads the free memory through gemma_engine._free_bytes (torch.cuda.mem_get_info, or the host's
    MemAvailable); a smaller device is stood in for by replacing that function. The estimate it checks is within
    10% of what the load really puts on the device: a device with 0.9x of it refuses, one with 1.1x (and room
    for the cache) loads."""
    dtype = "bfloat16" if kind == "w4a16" else "float32"  # W4A16 in bfloat16: int4 kept packed on the CPU
    loaded = _engine(checkpoint_dirs, kind, dtype=dtype).weights()["bytes"]
    monkeypatch.setattr(gemma_engine, "_free_bytes", lambda like: int(0.9 * loaded))
    with pytest.raises(ValueError, match=r"the weights need about [\d.]+ MiB on this device .* but it has "
                                         r"[\d.]+ MiB free; split the model over more devices"):
        _engine(checkpoint_dirs, kind, dtype=dtype)
    monkeypatch.setattr(gemma_engine, "_free_bytes", lambda like: int(1.1 * loaded) + (64 << 20))
    assert _engine(checkpoint_dirs, kind, dtype=dtype).weights()["bytes"] == loaded


def test_kv_cache_that_cannot_fit_is_value_error_naming_max_batch_and_sizes(dense_checkpoint):
    # 2**20 slots of an 8192-token context: ~16 TiB of KV cache, more than any host has free.
    max_batch, context = 2**20, 8192
    small = _engine({"dense": (dense_checkpoint, None)}, "dense", context=context)
    per_slot = small.layout()["kv_bytes_per_slot"]
    mib = 2**20
    message = (
        rf"max_batch {max_batch} x context {context} needs a KV cache of {max_batch * per_slot / mib:.1f} MiB "
        rf"\({per_slot / mib:.2f} MiB per slot, of which 0.00 MiB are the prefix cache's snapshots of the sliding "
        rf"rings\), but the device has [\d.]+ MiB free after the weights; lower max_batch or context, turn prefix "
        rf"caching off, or split the model over more devices \(tensor_parallel_size\)"
    )
    with pytest.raises(ValueError, match=message):
        _engine({"dense": (dense_checkpoint, None)}, "dense", context=context, max_batch=max_batch)


# ----------------------------------------------------------------------------- failed requests


@pytest.mark.parametrize("at", ["admit", "prompt", "decode"])
def test_an_engine_error_fails_its_requests_alone_and_the_loop_serves_on(checkpoint_dirs, greedy, at):
    """A device error while admitting, reading or decoding one request (injected: the real engine makes
    none on demand) ends that request "failed" with the error, frees its slot, leaves the other streams'
    tokens exact, and the loop takes the next requests into the freed slot."""
    engine = _engine(checkpoint_dirs, "dense", max_batch=3, prefill_chunk=16)
    engine.inject_fault_for_tests(at, 5)
    victim = _sampled(5, "other", 30) if at != "prompt" else _request(5, "other", 30)
    # Greedy streams beside it (one reading its prompt in the same chunks, one already decoding), then
    # a seeded request and a greedy one that arrive after it failed, in the slot it freed.
    arrivals = {0: [_request(0, "parity", 40)], 2: [victim, _request(1, "short", 30)],
                12: [_sampled(9, "long", 20), _request(2, "tiny", 24)]}
    outcomes = Script(arrivals).run(engine, read_every=2)
    assert outcomes[5].finish == "failed", outcomes[5]
    assert f"a fault injected for tests ({at.capitalize()}, request 5)" in outcomes[5].error
    alone = Script({0: [_sampled(9, "long", 20)]}).run(_engine(checkpoint_dirs, "dense", max_batch=1))[9].tokens
    assert outcomes[9].tokens == alone and outcomes[9].finish == "length"
    for rid, name, n in [(0, "parity", 40), (1, "short", 30), (2, "tiny", 24)]:
        o = outcomes[rid]
        if at == "decode" and rid in (0, 1) and o.finish == "failed":
            continue  # a decode step is one forward of every decoding row: the rows it ran fail with it
        assert (o.tokens, o.finish) == greedy("dense", name, n), rid


def test_inject_fault_names_where_it_may_fail(dense_checkpoint):
    engine = _engine({"dense": (dense_checkpoint, None)}, "dense")
    with pytest.raises(ValueError, match="at must be admit, prompt or decode"):
        engine.inject_fault_for_tests("weights", 1)


# ----------------------------------------------------------------------------- callback errors


class Boom(Exception):
    pass


def test_exception_in_poll_or_on_events_propagates_and_the_engine_serves_on(checkpoint_dirs, greedy):
    engine = _engine(checkpoint_dirs, "dense", max_batch=4, prefill_chunk=16)
    four = [_request(i, name, 40) for i, name in enumerate(("parity", "other", "repeat", "short"))]

    def failing_poll(call, script):
        if call == 12:
            raise Boom("from poll")
        return []

    with pytest.raises(Boom, match="from poll"):
        Script({0: four}, failing_poll).run(engine)

    script = Script({0: four})
    inner = script.on_events

    def failing_on_events(events, stats):
        inner(events, stats)
        if script.calls == 12:
            raise Boom("from on_events")

    with pytest.raises(Boom, match="from on_events"):
        engine.run(script.poll, failing_on_events, 1)

    # Both loops ended mid-decode with every slot busy; the next run starts from free slots. A
    # seeded request with a long prompt in the highest slot, read in chunks while three streams
    # decode, draws exactly what it draws alone, and the greedy streams are exact.
    alone = Script({0: [_sampled(9, "long", 20)]}).run(_engine(checkpoint_dirs, "dense", max_batch=1))[9].tokens
    after = Script({0: [_request(0, "tiny", 30), _request(1, "tiny", 30), _request(2, "short", 30),
                        _sampled(9, "long", 20)]}).run(engine)
    assert after[9].tokens == alone
    for rid, name, n in [(0, "tiny", 30), (1, "tiny", 30), (2, "short", 30)]:
        assert (after[rid].tokens, after[rid].finish) == greedy("dense", name, n), rid


@pytest.mark.gpu
def test_captured_cuda_graph_steps_give_the_eager_tokens(checkpoint_dirs):
    """On CUDA each decode-step shape is captured once and replayed; greedy, seeded and logprob
    requests arriving at different steps get exactly the tokens (and log-probabilities) of the same
    run without graphs."""

    def run(cuda_graphs: bool):
        engine = _engine(checkpoint_dirs, "dense", max_batch=4, prefill_chunk=5,
                         like=torch.zeros(1, device="cuda"), cuda_graphs=cuda_graphs)
        arrivals = {
            0: [_request(0, "parity", 40), _sampled(1, "short", 24)],
            2: [_request(2, "other", 32, sampling=gemma_engine.SamplingParams(logprobs=3))],
            4: [_sampled(3, "repeat", 20, seed=7)],
        }
        return engine, Script(arrivals).run(engine, read_every=3)

    eager_engine, eager = run(False)
    graph_engine, graphs = run(True)
    assert eager_engine.captured_steps == 0
    assert graph_engine.captured_steps > 0
    for rid, want in eager.items():
        got = graphs[rid]
        assert (got.tokens, got.finish, got.logprobs) == (want.tokens, want.finish, want.logprobs), rid


def test_a_float32_decode_step_makes_at_most_26_aten_calls_a_layer_with_its_own_keys_24_a_shared_one_and_27_outside(
    checkpoint_dirs,
):
    """The decode step's ATen calls (README "The decode step's ATen calls"): a deterministic count,
    453 a step of the small config (54 and 33 a layer, 84 outside the layers) before the cuts. Counted
    with ATen's matmul, the path of every device but the CPU, where each call costs a launch; with
    oneDNN (the CPU's float32 default) each layer adds the copies of its two projections that have
    buffers (oneDNN's linear has no `_out` form). Outside the layers, 23 before the step stopped rows at
    their stop tokens on the device (slots.rs): that check is 4 more (a reshape, a gather of the slots'
    stop tables, an and, a copy into `live`)."""
    config = json.loads((checkpoint_dirs["dense"][0] / "config.json").read_text())
    own = config["num_hidden_layers"] - config["num_kv_shared_layers"]

    def counts(onednn: bool) -> tuple[float, list[int]]:
        engine = _engine(checkpoint_dirs, "dense", onednn=onednn)

        def calls_of(new: int) -> int:
            before = testing.aten_calls()
            engine.decode(PROMPTS["parity"], new)
            return testing.aten_calls() - before

        calls_of(2)  # the first decode step makes the step's buffers
        steps, prompt_only = 16, calls_of(1)
        per_step = (calls_of(1 + steps) - prompt_only) / steps
        return per_step, engine.layer_calls  # the last forward was a decode step

    per_step, calls = counts(onednn=False)
    assert len(calls) == config["num_hidden_layers"] and 0 < own < len(calls)
    assert max(calls[:own]) <= 26, calls
    assert max(calls[own:]) <= 24, calls
    assert per_step - sum(calls) <= 27, (per_step, calls)
    per_step_onednn, calls_onednn = counts(onednn=True)
    assert [a - b for a, b in zip(calls_onednn, calls)] == [2] * len(calls)
    assert per_step_onednn - sum(calls_onednn) == per_step - sum(calls)
