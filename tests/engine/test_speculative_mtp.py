"""Speculative decoding with an MTP assistant drafter (`Engine(speculative_method="mtp", speculative_model=dir,
num_speculative_tokens=k)`, rust/src/gemma4/assistant.rs and rust/src/engine/drafter.rs): Transformers'
`Gemma4AssistantForCausalLM` proposes k drafts a slot from the target's rings and final hidden state, and the
target checks them in one verify step (test_speculative.py covers that step with prompt-lookup drafts).

The drafter's drafts are the reference's: round by round, the drafts offered and kept equal those of
Transformers' drafting loop run on the same context (tests/assistants.py `reference_drafts`). Transformers' own
assisted generation (`generate(assistant_model=...)`) cannot be called in 5.18: its `_get_candidate_generator`
builds `SinglePositionMultiTokenCandidateGenerator` without the `input_ids` and `model_kwargs` its `__init__`
requires (a TypeError), so the greedy tokens are checked against the engine without speculation, itself
Transformers' greedy generation (test_parity.py). A random assistant's drafts are never kept; the "two-token"
assistant drafts the two-token target's tokens, so most are kept and some are not.
"""

import json
import shutil

import pytest

import gemma_engine
from tests import assistants
from tests.checkpoints.parity import load_hf_reference
from tests.checkpoints.text import save_two_token
from tests.engine.test_architectures import CONFIGS, RUNS, SAVERS
from tests.engine.test_speculative import PROMPTS, busy_script, engine, run, seeded_runs_agree

K = 4
LIMIT = 40


def mtp(assistant_dir, **kwargs) -> dict:
    return {"speculative_method": "mtp", "num_speculative_tokens": K, "speculative_model": str(assistant_dir),
            "speculative_max_batch": 4, **kwargs}


@pytest.fixture(scope="module")
def two_token(dense_checkpoint, tmp_path_factory):
    return save_two_token(dense_checkpoint, tmp_path_factory.mktemp("mtp_two_token") / "model")


@pytest.fixture(scope="module")
def drafters(two_token, tmp_path_factory):
    root = tmp_path_factory.mktemp("assistants")
    random = assistants.save_assistant(root / "random")
    return {"random": random, "ordered": assistants.save_assistant(root / "ordered", ordered=True),
            "two_token": assistants.save_two_token_assistant(random, two_token, root / "two_token")}


def test_settings_are_checked_and_reported(dense_checkpoint, drafters):
    e = engine(dense_checkpoint, **mtp(drafters["random"]))
    assert e.speculative == {"method": "mtp", "speculative_model": str(drafters["random"]), "num_speculative_tokens": K,
                             "prompt_lookup_min": 1, "prompt_lookup_max": 4, "speculative_max_batch": 4,
                             "speculative_max_bucket": None}
    assert e.weights()["bytes"] > engine(dense_checkpoint).weights()["bytes"], "the drafter's weights are counted"
    bad = [({"speculative_method": "mtp", "num_speculative_tokens": 2}, "needs speculative_model"),
           ({"speculative_method": "ngram", "num_speculative_tokens": 2, "speculative_model": "x"}, "takes none"),
           ({"speculative_model": str(drafters["random"])}, "needs speculative_method"),
           (mtp(drafters["random"], num_speculative_tokens=None), "needs num_speculative_tokens"),
           (mtp(dense_checkpoint), "is not a Gemma 4 assistant")]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            engine(dense_checkpoint, **kwargs)


def test_an_assistant_for_another_target_is_refused_by_name(dense_checkpoint, drafters, tmp_path):
    for key, value, message in [("backbone_hidden_size", 64, "backbone_hidden_size"),
                                ("num_centroids", 7, "num_centroids")]:
        other = shutil.copytree(drafters["ordered"], tmp_path / key)
        config = json.loads((other / "config.json").read_text())
        config[key] = value
        (other / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            engine(dense_checkpoint, **mtp(other))


@pytest.mark.parametrize("read_every", [1, 4])
def test_a_busy_batch_gives_the_tokens_of_no_speculation(dense_checkpoint, two_token, drafters, read_every):
    for model_dir, drafter in ((dense_checkpoint, "random"), (dense_checkpoint, "ordered"),
                               (two_token, "two_token")):
        plain, _ = run(engine(model_dir), busy_script(), read_every)
        spec, stats = run(engine(model_dir, **mtp(drafters[drafter])), busy_script(), read_every)
        assert spec == plain, drafter
        assert stats["spec_drafts"] > 10 and stats["spec_draft_tokens"] > 2 * stats["spec_drafts"]
    assert 40 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], "the two-token drafter is kept, not always"


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_drafts_are_the_reference_drafters(two_token, drafters, prompt):
    """One request, a read point a step: each verify step's drafts offered and kept equal those of Transformers'
    drafting loop on the same context, kept against the target's greedy tokens. A step offers none when the
    drafter has no hidden state for the slot (the first after the prompt, or after plain steps, engine/drafter.rs)
    or while the slot waits after verify steps that kept none (engine/speculative.rs `Backoff`, mirrored here)."""
    request = {1: [gemma_engine.Request(0, prompt, LIMIT)]}
    (tokens, finish), = run(engine(two_token), request)[0].values()
    _, stats = run(engine(two_token, **mtp(drafters["two_token"])), request)
    got = [(s["spec_draft_tokens"], s["spec_accepted_tokens"]) for s in stats["read_points"]
           if s.get("spec_draft_tokens")]
    target, drafter = load_hf_reference(two_token), assistants.load_assistant(drafters["two_token"])
    want, drawn, ready, misses, wait = [], 1, False, 0, 0
    while (room := min(K, len(tokens) - drawn - 1)) > 0:
        wait = max(wait - 1, 0)
        if wait or not ready:  # a plain step (forgets the state), or one that records it
            drawn, ready = drawn + 1, not wait
            continue
        drafts = assistants.reference_drafts(target, drafter, prompt + tokens[:drawn], room)
        kept = next((j for j, t in enumerate(drafts) if t != tokens[drawn + j]), room)
        misses = 0 if kept else misses + 1
        wait = min(2 << min(misses - 2, 5), 64) if misses >= 2 else 0
        want.append((room, kept))
        drawn += kept + 1
    assert finish == "length" and got == want
    assert any(kept == K for _, kept in want) and any(kept < room for room, kept in want)


def test_a_conversation_resumed_after_rejected_drafts_reads_as_fresh(two_token, drafters):
    e = engine(two_token, **mtp(drafters["random"]), max_batch=1)
    fresh = engine(two_token, max_batch=1, prefix_caching=False)
    out, stats = run(e, {1: [gemma_engine.Request(0, PROMPTS[0], LIMIT)]})
    reply, _ = out[0]
    assert stats["spec_draft_tokens"] - stats["spec_accepted_tokens"] >= 20, "turn 1 rejected drafts"
    second = PROMPTS[0] + reply + [3, 10, 11, 12]
    resumed, stats = run(e, {1: [gemma_engine.Request(1, second, LIMIT)]})
    assert stats["cache_hits"] >= len(PROMPTS[0]) + len(reply) - 1
    assert resumed == run(fresh, {1: [gemma_engine.Request(1, second, LIMIT)]})[0]


def test_seeded_sampling_draws_the_tokens_of_no_speculation(two_token, drafters):
    """16 seeded requests, four at a time: the tokens of no speculation but for at most one draw within float
    rounding of a CDF boundary (test_speculative.py `a_rounding_flip`)."""
    _, stats = seeded_runs_agree(two_token, mtp(drafters["two_token"]), 16, 2000, flips=1)
    assert stats["spec_drafts"] > 20 and stats["spec_accepted_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("run_spec", RUNS, ids=[f"{name}-{kind}" for name, kind, _ in RUNS])
def test_every_architecture_speculates_exactly(run_spec, tmp_path_factory):
    """The E-series, 31B K=V (dense, W4A16), 26B-A4B MoE (dense, W4A16) and 12B shapes, each with an assistant made
    for it (its donors' head geometry): random, and the two-token one of its two-token copy."""
    name, kind, seed = run_spec
    root = tmp_path_factory.mktemp(f"mtp_{name}_{kind}")
    config = CONFIGS[name][0]()
    model_dir = SAVERS[kind](root / "target", seed, config)
    two = save_two_token(model_dir, root / "two_token")
    random = assistants.save_assistant(root / "random", target=config)
    two_drafter = assistants.save_two_token_assistant(random, two, root / "two_drafter")
    for checkpoint, drafter in ((model_dir, random), (two, two_drafter)):
        plain, _ = run(engine(checkpoint), busy_script(32), read_every=3)
        spec, stats = run(engine(checkpoint, **mtp(drafter)), busy_script(32), read_every=3)
        assert spec == plain and stats["spec_draft_tokens"] > 0, checkpoint
    assert stats["spec_accepted_tokens"] > 10, "the two-token drafter is kept"
