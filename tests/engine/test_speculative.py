"""Speculative decoding by prompt lookup (`Engine(speculative_method="ngram", num_speculative_tokens=k)`,
rust/src/engine/speculative.rs): drafts copied from n-grams already in the context, checked by the target in one
forward of k + 1 positions a slot.

Greedy output with speculation is the output without it, token for token: on every tiny architecture (the
E-series config, and the 31B K=V, 26B-A4B MoE and 12B shapes of test_architectures.py), alone and in a busy
batch, with stop ids and length limits, and equal to Transformers' own prompt-lookup generation
(`generate(prompt_lookup_num_tokens=k)`). Random weights rarely agree with a draft, so the exactness runs also use a
"two-token" checkpoint: the dense one with its final norm's weight zero but for one feature, so that its logits
are that feature times the tied embeddings' column and it writes runs of the two tokens at that column's ends,
switching with the context; drafts of a run are kept, the switches rejected (a third of the drafts kept, at
every position). Rejected positions must leave no trace in the rings, which resuming the conversation from the
prefix cache shows (its tokens equal a fresh read's). Seeded sampled requests draw the same tokens with and
without speculation (test_speculative_constrained.py: penalties, log-probabilities, grammars). Steps with more
decoding slots than `speculative_max_batch` run as before, and the settings are checked.
"""

import pytest
import torch

import gemma_engine
from gemma_engine import testing
from tests.checkpoints.parity import PARITY_PROMPT, load_hf_reference
from tests.checkpoints.text import save_two_token
from tests.engine.test_architectures import CONFIGS, RUNS, SAVERS
from tests.engine.test_sampling import splitmix64

CONTEXT = 128
K = 5
SPEC = {"speculative_method": "ngram", "num_speculative_tokens": K, "speculative_max_batch": 4}
# Prompts that repeat themselves, as edits and quotes do, so the lookup finds n-grams; then one that does not.
PROMPTS = [[2] + [10, 11, 12, 13, 14] * 4, [2, 50, 60, 70, 80, 50, 60, 70], [2, 7, 8, 9, 7, 8, 9, 7, 8],
           PARITY_PROMPT]


def engine(model_dir, **kwargs) -> gemma_engine.Engine:
    kwargs = {"context": CONTEXT, "dtype": "float32", "like": torch.zeros(1), "max_batch": 4, **kwargs}
    return gemma_engine.Engine(str(model_dir), **kwargs)


def run(e: gemma_engine.Engine, script: dict[int, list], read_every: int = 1):
    """Run `script` ({poll call: requests admitted there}) through `Engine.run`. Returns ({id: (tokens,
    finish)}, summed stats and, under "read_points", each read point's own)."""
    out, stats, calls = {}, [], [0]
    pending = {k: list(v) for k, v in script.items()}

    def poll(free, idle):
        calls[0] += 1
        queue = [r for k in sorted(pending) if k <= calls[0] for r in pending[k]]
        if not queue and not any(pending.values()) and all(f for _, f in out.values()):
            return None
        new = queue[:free]
        for k in pending:
            pending[k] = [r for r in pending[k] if r not in new]
        for r in new:
            out[r.id] = ([], None)
        return new, []

    def on_events(events, s):
        stats.append(s)
        for ev in events:
            tokens, finish = out[ev.id]
            out[ev.id] = (tokens + list(ev.tokens), ev.finish or finish)

    e.run(poll, on_events, read_every)
    keys = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "prompt_tokens", "cache_hits")
    totals = {k: sum(s.get(k, 0) for s in stats) for k in keys}
    per_pos = [s.get("spec_accepted_per_position", []) for s in stats]
    totals["per_position"] = [sum(p[i] for p in per_pos if i < len(p)) for i in range(K)]
    totals["read_points"] = stats
    return out, totals


def busy_script(max_new: int = 48) -> dict[int, list]:
    """Staggered greedy requests: two at once, two joining later with stop ids (28: one of the two-token
    target's), one with a short limit."""
    R = gemma_engine.Request
    return {1: [R(0, PROMPTS[0], max_new), R(1, PROMPTS[1], max_new)],
            4: [R(2, PROMPTS[2], max_new, stop_ids=[459]), R(3, PROMPTS[3], 7)],
            9: [R(4, PROMPTS[0][:9], max_new, stop_ids=[28])]}


@pytest.fixture(scope="module")
def dense(dense_checkpoint):
    return dense_checkpoint


@pytest.fixture(scope="module")
def two_token(dense_checkpoint, tmp_path_factory):
    return save_two_token(dense_checkpoint, tmp_path_factory.mktemp("two_token") / "model")


def test_settings_are_checked_and_reported(dense):
    e = engine(dense, **{**SPEC, "speculative_max_batch": 2}, prompt_lookup_min=2, prompt_lookup_max=3)
    assert e.speculative == {"method": "ngram", "speculative_model": None, "num_speculative_tokens": K,
                             "prompt_lookup_min": 2, "prompt_lookup_max": 3, "speculative_max_batch": 2,
                             "speculative_max_bucket": None}
    assert engine(dense).speculative is None
    bad = [({"speculative_method": "eagle", "num_speculative_tokens": 2}, "speculative_method must be"),
           ({"speculative_method": "ngram"}, "needs num_speculative_tokens"),
           ({"num_speculative_tokens": 2}, "needs a speculative_method"),
           ({**SPEC, "num_speculative_tokens": 0}, "num_speculative_tokens must be in 1..=16"),
           ({**SPEC, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max >= prompt_lookup_min"),
           ({**SPEC, "speculative_max_batch": 0}, "speculative_max_batch must be >= 1")]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            engine(dense, **kwargs)


@pytest.mark.parametrize("read_every", [1, 4])
def test_a_busy_batch_gives_the_tokens_of_no_speculation(dense, two_token, read_every):
    for model_dir in (dense, two_token):
        plain, _ = run(engine(model_dir), busy_script(), read_every)
        spec, stats = run(engine(model_dir, **SPEC), busy_script(), read_every)
        assert spec == plain, model_dir
        assert {f for _, f in plain.values()} == {"length", "stop"}, "the script covers both ends"
        # The dense target rejects nearly every draft, so its requests back off (speculative.rs `Backoff`).
        assert stats["spec_drafts"] > (5 if model_dir == dense else 10)
        assert stats["spec_draft_tokens"] > 2 * stats["spec_drafts"]
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    # The two-token target keeps drafts at every position, and fewer at each later one.
    per = stats["per_position"]
    assert all(n > 0 for n in per) and per == sorted(per, reverse=True)
    assert stats["spec_accepted_tokens"] == sum(per) and stats["spec_accepted_tokens"] > 50


def test_tokens_equal_transformers_prompt_lookup_generation(two_token):
    reference = load_hf_reference(two_token)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            hf = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                    prompt_lookup_num_tokens=K, eos_token_id=None, pad_token_id=0)
        want = hf[0, len(prompt):].tolist()
        tokens, finish, _, _ = engine(two_token, **SPEC).decode(prompt, 40)
        stops = set(reference.config.eos_token_id)
        cut = next((i for i, t in enumerate(want) if t in stops), len(want))
        assert tokens == want[:cut], prompt


@pytest.mark.parametrize("kind", ["dense", "two_token"])
def test_a_conversation_resumed_after_rejected_drafts_reads_as_fresh(kind, request):
    """Turn 2 extends turn 1's prompt and reply, so it resumes from the slot's rings: every draft turn 1
    rejected wrote keys at positions past its reply, and the sliding rings must hold none of them."""
    model_dir = request.getfixturevalue(kind)
    e, fresh = engine(model_dir, **SPEC, max_batch=1), engine(model_dir, max_batch=1, prefix_caching=False)
    out, stats = run(e, {1: [gemma_engine.Request(0, PROMPTS[0], 40)]})
    reply, _ = out[0]
    assert stats["spec_draft_tokens"] - stats["spec_accepted_tokens"] >= 5, "turn 1 rejected drafts"
    second = PROMPTS[0] + reply + [3, 10, 11, 12]
    resumed, stats = run(e, {1: [gemma_engine.Request(1, second, 40)]})
    assert stats["cache_hits"] >= len(PROMPTS[0]) + len(reply) - 1
    read, _ = run(fresh, {1: [gemma_engine.Request(1, second, 40)]})
    assert resumed == read


def test_above_the_batch_limit_steps_run_plain(dense):
    """Above speculative_max_batch decoding slots, no step speculates."""
    R = gemma_engine.Request
    script = {1: [R(i, p, n) for i, (p, n) in enumerate(zip(PROMPTS[:3], (40, 12, 8)))]}
    plain, _ = run(engine(dense), script)
    spec, stats = run(engine(dense, **{**SPEC, "speculative_max_batch": 1}), script)
    assert spec == plain
    assert stats["spec_drafts"] > 0, "the last request left alone speculates"
    # Read every turn: each read point's stats are one turn's. Only turns of one decoding slot speculated.
    turns = [s for s in stats["read_points"] if s.get("batch_sizes")]
    assert max(max(s["batch_sizes"]) for s in turns) == 3
    assert all(s["batch_sizes"] == [1] for s in turns if s["spec_drafts"] > 0)


SAMPLINGS = [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.9),
             dict(temperature=1.0, min_p=0.05), dict(temperature=0.8, logit_bias={28: 2.0}), dict(temperature=0.3),
             dict(temperature=0.5, top_p=0.8)]


def uniform(seed: int, index: int) -> float:
    """The engine's uniform number for draw `index` of a request seeded `seed` (rust/src/engine/sampling.rs)."""
    return (splitmix64(seed, index + 1)[index] >> 40) / 2**24


def a_rounding_flip(model_dir, prompt: list[int], seed: int, params: dict, plain: list[int],
                    spec: list[int]) -> float | None:
    """Where the two runs' tokens first differ, the distance from that draw's uniform number to the CDF boundary
    between the two tokens, when they are the tokens on either side of the boundary nearest to it (None
    otherwise): a draw the logits' float rounding can tip either way (a verify step computes the same logits as
    a plain step with other kernels), not a different draw."""
    j = next(i for i, (a, b) in enumerate(zip(plain, spec)) if a != b)
    logits = engine(model_dir).logits(prompt + plain[:j])
    sampling = gemma_engine.SamplingParams(seed=seed, **params)
    _, probs = testing.sample(logits.unsqueeze(0), [(sampling, prompt, plain[:j], j)])
    probs = probs[0].double()
    order = torch.sort(probs, stable=True).indices
    cdf = torch.cumsum(probs[order], 0)
    u = uniform(seed, j) * float(cdf[-1])
    edge = int(torch.argmin((cdf - u).abs()))
    sides = {int(order[edge]), int(order[edge + 1])}
    return abs(float(cdf[edge]) - u) if sides == {plain[j], spec[j]} else None


def test_seeded_sampling_draws_the_tokens_of_no_speculation(dense, two_token):
    """64 seeded requests a checkpoint (temperatures, top-k, top-p, min-p, logit_bias), four at a time, about
    1,500 draws: each position's draw takes its token's uniform number from the request's stream, so the tokens
    are those without speculation, but for a draw whose uniform number lies within float rounding of a CDF
    boundary (measured: request 26 on the two-token checkpoint, 4.5e-6 from it), after which the two runs'
    contexts differ. A draft is kept exactly when the draw equals it (probability p(draft))."""
    for model_dir in (dense, two_token):
        plain, stats = seeded_runs_agree(model_dir, SPEC, 64, 1000, flips=2)
        assert sum(len(tokens) for tokens, _ in plain.values()) > 1400
        assert stats["spec_drafts"] > 100 and stats["spec_accepted_tokens"] > 0


def seeded_runs_agree(model_dir, spec: dict, n: int, seed: int, flips: int, samplings: list[dict] = SAMPLINGS):
    """Run `n` seeded requests (request i: prompt i, sampling i of `samplings`, seed `seed` + i; 24 tokens, four
    at a time) on `model_dir` with and without the engine arguments `spec`; assert that at most `flips` requests
    differ, each by a rounding flip (`a_rounding_flip`, within 1e-4). Returns the plain outputs and the
    speculating run's stats."""
    prompt, params = (lambda i: PROMPTS[i % len(PROMPTS)]), (lambda i: samplings[i % len(samplings)])
    requests = [gemma_engine.Request(i, prompt(i), 24, sampling=gemma_engine.SamplingParams(seed=seed + i, **params(i)))
                for i in range(n)]
    plain, _ = run(engine(model_dir), {1: requests})
    out, stats = run(engine(model_dir, **spec), {1: requests})
    differ = [i for i in plain if out[i] != plain[i]]
    assert len(differ) <= flips, differ
    for i in differ:
        gap = a_rounding_flip(model_dir, prompt(i), seed + i, params(i), plain[i][0], out[i][0])
        assert gap is not None and gap < 1e-4, (i, gap)
    return plain, stats


@pytest.mark.slow
@pytest.mark.parametrize("run_spec", RUNS, ids=[f"{name}-{kind}" for name, kind, _ in RUNS])
def test_every_architecture_speculates_exactly(run_spec, tmp_path_factory):
    name, kind, seed = run_spec
    model_dir = SAVERS[kind](tmp_path_factory.mktemp(f"spec_{name}_{kind}"), seed, CONFIGS[name][0]())
    two = save_two_token(model_dir, tmp_path_factory.mktemp(f"spec_{name}_{kind}_two") / "model")
    for checkpoint in (model_dir, two):
        plain, _ = run(engine(checkpoint), busy_script(32), read_every=3)
        spec, stats = run(engine(checkpoint, **SPEC), busy_script(32), read_every=3)
        assert spec == plain and stats["spec_draft_tokens"] > 0, checkpoint
    assert stats["spec_accepted_tokens"] > 10, "the two-token target keeps drafts"


def test_the_costs_of_plain_and_verify_steps_are_measured_and_leave_nothing(dense):
    """`speculation_costs` (rust/src/engine/tuning.rs) times both kinds of step in a bucket, then forgets its
    requests: a request of its prompt and salt afterwards finds no cached tokens and draws the tokens of a fresh
    engine. `set_speculative_max_bucket` bounds the buckets that speculate, to 0 none."""
    e = engine(dense, **SPEC)
    for batch, bucket in [(1, 1), (3, 4), (4, 4)]:
        costs = e.speculation_costs(batch, 3)
        assert costs["bucket"] == bucket and costs["drafts"] == K and costs["plain_s"] > 0 and costs["verify_s"] > 0
    made_up = [3, 4, 5, 6, 3, 4, 5, 6]
    R = gemma_engine.Request
    out, stats = run(e, {1: [R(0, made_up, 16, cache_salt="gemma-engine speculation costs"), R(1, PROMPTS[0], 16)]})
    fresh, _ = run(engine(dense, **SPEC), {1: [R(0, made_up, 16), R(1, PROMPTS[0], 16)]})
    assert out == fresh and stats["cache_hits"] == 0
    e.set_speculative_max_bucket(0)
    assert e.speculative["speculative_max_bucket"] == 0
    _, stats = run(e, {1: [R(2, PROMPTS[0], 16)]})
    assert stats["spec_drafts"] == 0
    short = engine(dense, **SPEC, context=24)
    assert short.speculation_turns == (24 - 10) // (K + 2) >= 1, "8 prompt tokens and K + 2 a turn"
    assert short.speculation_costs(1, short.speculation_turns)["bucket"] == 1
    assert engine(dense).speculation_turns == 0
    for call, message in [(lambda: e.speculation_costs(5), "batch must be in 1..=4"),
                          (lambda: e.speculation_costs(1, 0), "turns >= 1"),
                          (lambda: e.set_speculative_max_bucket(-1), "must be >= 0"),
                          (lambda: engine(dense).speculation_costs(1), "speculative decoding is off"),
                          (lambda: short.speculation_costs(1, short.speculation_turns + 1), "too few tokens"),
                          (lambda: e.compile_verify([[3, 4]]), "does not compile its steps"),
                          (lambda: engine(dense).compile_verify([[3, 4]]), "speculative decoding is off")]:
        with pytest.raises(ValueError, match=message):
            call()
