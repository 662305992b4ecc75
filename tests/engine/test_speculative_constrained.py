"""Speculative decoding for requests whose choice reads more than the logits (rust/src/engine/speculative.rs,
`Sampler::choose_ahead`): penalties, log-probabilities and grammars, and a request that opts out.

A verify step's position j counts the drafts before it into the penalties' histories, computes its own
log-probabilities, and takes a grammar-constrained row's mask after the drafts before it, computed on the host on a
clone of the request's matcher, the drafts cut at the first the grammar refuses. So these requests draw the tokens
(and report the log-probabilities) they draw without speculation. The "two-token" checkpoints (test_speculative.py)
keep drafts; under a grammar the two-token chat checkpoint picks, at each step, the allowed token its one feature
scores highest, so a JSON array of enum items repeats itself and its drafts are kept.
"""

import json

import jsonschema
import pytest
from tokenizers import Tokenizer

import gemma_engine
from tests import assistants
from tests.checkpoints.chat import CHAT_VOCAB_SIZE, chat_text_config
from tests.checkpoints.text import save_two_token
from tests.engine.test_batching import LOGPROB_TOLERANCE, Script
from tests.engine.test_speculative import PROMPTS, SPEC, engine, run, seeded_runs_agree

EOS = [1, 4]  # the chat checkpoint's <eos> and <end_of_turn>
# Nine items of three words, no free whitespace: every reply ends within a bound.
ARRAY = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 9, "maxItems": 9,
         "x-guidance": {"whitespace_flexible": False}}
OBJECT = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
PENALIZED = [dict(repetition_penalty=1.3), dict(temperature=0.8, presence_penalty=0.5),
             dict(temperature=1.0, frequency_penalty=0.7, top_k=8), dict(frequency_penalty=0.4),
             dict(temperature=0.6, repetition_penalty=1.2, presence_penalty=0.3, top_p=0.9)]


@pytest.fixture(scope="module")
def two_token(dense_checkpoint, tmp_path_factory):
    return save_two_token(dense_checkpoint, tmp_path_factory.mktemp("constrained_two_token") / "model")


@pytest.fixture(scope="module")
def chats(chat_checkpoint, tmp_path_factory):
    """The chat checkpoint and its two-token copy, with Grammars over the chat tokenizer."""
    two = save_two_token(chat_checkpoint, tmp_path_factory.mktemp("chat_two_token") / "model")
    grammars = gemma_engine.Grammars(str(chat_checkpoint / "tokenizer.json"), EOS, CHAT_VOCAB_SIZE)
    return {"random": chat_checkpoint, "two_token": two}, grammars


@pytest.fixture(scope="module")
def prompt(chat_checkpoint):
    tok = Tokenizer.from_file(str(chat_checkpoint / "tokenizer.json"))
    return tok.encode("<start_of_turn>user\nList colours in JSON.<end_of_turn>\n<start_of_turn>model\n").ids


def test_penalized_requests_speculate_and_draw_the_tokens_of_no_speculation(dense_checkpoint, two_token):
    """Repetition, presence and frequency penalties, greedy and seeded: the counts at a verify step's position j
    hold the drafts before it."""
    for model_dir in (dense_checkpoint, two_token):
        _, stats = seeded_runs_agree(model_dir, SPEC, 20, 500, flips=1, samplings=PENALIZED)
        assert stats["spec_drafts"] > 10, model_dir
    assert stats["spec_accepted_tokens"] >= 5, "the two-token target keeps drafts of penalized requests"


@pytest.mark.parametrize("sampling", [dict(logprobs=3), dict(temperature=0.02, seed=11, logprobs=0)],
                         ids=["greedy", "seeded"])
def test_log_probabilities_under_speculation_are_those_without(dense_checkpoint, two_token, sampling):
    """Each position's own: the same top tokens, the values within the float32 tolerance of other kernels (a verify
    step's logits come from a forward of more rows; the largest difference measured 3.3e-4, greedy on the dense
    checkpoint)."""
    for model_dir in (dense_checkpoint, two_token):
        def requests():
            return {0: [gemma_engine.Request(i, p, 32, sampling=gemma_engine.SamplingParams(**sampling))
                        for i, p in enumerate(PROMPTS)]}
        plain = Script(requests()).run(engine(model_dir))
        script = Script(requests())
        spec = script.run(engine(model_dir, **SPEC))
        drafted, kept = (sum(s.get(k, 0) for s in script.stats) for k in ("spec_draft_tokens", "spec_accepted_tokens"))
        assert drafted > 0 and (model_dir == dense_checkpoint or kept > 20), (drafted, kept)
        for i in plain:
            assert spec[i].tokens == plain[i].tokens and spec[i].finish == plain[i].finish, (model_dir, i)
            assert len(spec[i].logprobs) == len(spec[i].tokens) > 0
            for (lp, top), (want, want_top) in zip(spec[i].logprobs, plain[i].logprobs):
                assert lp == pytest.approx(want, abs=LOGPROB_TOLERANCE)
                assert len(top) == len(want_top) == sampling["logprobs"]
                assert [t for t, _ in top] == [t for t, _ in want_top]
                assert [v for _, v in top] == pytest.approx([v for _, v in want_top], abs=LOGPROB_TOLERANCE)


def _constrained(rid, prompt, schema, **sampling):
    params = gemma_engine.SamplingParams(**sampling) if sampling else None
    return gemma_engine.Request(rid, prompt, 80, sampling=params, grammar="start: %json" + json.dumps(schema))


def _json(chat_checkpoint, outcome, schema):
    assert outcome.finish == "stop", (outcome.finish, outcome.error)
    value = json.loads(Tokenizer.from_file(str(chat_checkpoint / "tokenizer.json")).decode(outcome.tokens))
    jsonschema.validate(value, schema)
    return value


def _grammar_script(prompt):
    seeded = dict(temperature=1.0, top_k=20, seed=5)
    no_eos = gemma_engine.SamplingParams(logit_bias={eos: -100.0 for eos in EOS})  # random weights stop at once
    return {0: [_constrained(0, prompt, ARRAY), _constrained(1, prompt, OBJECT, **seeded),
                gemma_engine.Request(2, prompt, 24, sampling=no_eos)],
            3: [_constrained(3, prompt[2:], ARRAY, **seeded)]}


@pytest.mark.parametrize("kind", ["random", "two_token"])
def test_grammar_constrained_requests_speculate_and_stay_valid(chats, prompt, kind):
    """Constrained requests beside an unconstrained one, greedy and seeded: the tokens of no speculation, valid
    JSON, and on the two-token checkpoint most drafts of the repeating array kept."""
    (models, grammars), model_dir = chats, chats[0][kind]
    plain = Script(_grammar_script(prompt)).run(engine(model_dir, grammars=grammars, context=256))
    script = Script(_grammar_script(prompt))
    spec = script.run(engine(model_dir, grammars=grammars, context=256, **SPEC))
    for i in plain:
        assert spec[i].tokens == plain[i].tokens and spec[i].finish == plain[i].finish, i
    for i, schema in [(0, ARRAY), (1, OBJECT), (3, ARRAY)]:
        _json(models["random"], spec[i], schema)
    stats = {k: sum(s.get(k, 0) for s in script.stats) for k in ("spec_draft_tokens", "spec_accepted_tokens")}
    assert stats["spec_draft_tokens"] > 0
    if kind == "two_token":
        assert len(set(_json(models["random"], spec[0], ARRAY)[1:])) == 1, "the array repeats its items"
        assert stats["spec_accepted_tokens"] > stats["spec_draft_tokens"] / 2


@pytest.mark.parametrize("kind", ["random", "two_token"])
def test_an_assistant_drafts_under_the_grammar(chats, prompt, tmp_path, kind):
    """With an MTP drafter each draft of a constrained row is chosen under its grammar's mask after the drafts
    before it (each comes back to the host to advance the look-ahead), so every draft offered is one the grammar
    allows and the rows are offered all their drafts; where the grammar leaves few choices (JSON's punctuation and
    keys) the target keeps them (measured: 50 of 69 with the random assistant, 39 of 65 with the two-token one; cut
    at the first refused draft, as prompt lookup's are, none of the random assistant's drafts was offered)."""
    (models, grammars), target = chats, chats[0][kind]
    drafter = assistants.save_assistant(tmp_path / "assistant", target=chat_text_config())
    if kind == "two_token":
        drafter = assistants.save_two_token_assistant(drafter, target, tmp_path / "two_token_assistant")
    mtp = {"speculative_method": "mtp", "num_speculative_tokens": 3, "speculative_model": str(drafter),
           "speculative_max_batch": 4}
    script = {0: [_constrained(0, prompt, ARRAY), _constrained(1, prompt, OBJECT, temperature=1.0, top_k=20, seed=5)]}
    plain = Script(script).run(engine(target, grammars=grammars, context=256))
    run = Script(script)
    spec = run.run(engine(target, grammars=grammars, context=256, **mtp))
    assert {i: o.tokens for i, o in spec.items()} == {i: o.tokens for i, o in plain.items()}
    _json(models["random"], spec[0], ARRAY)
    _json(models["random"], spec[1], OBJECT)
    keys = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")
    stats = {k: sum(s.get(k, 0) for s in run.stats) for k in keys}
    assert stats["spec_draft_tokens"] >= 0.8 * 3 * stats["spec_drafts"] > 0, stats
    assert stats["spec_accepted_tokens"] > 0.4 * stats["spec_draft_tokens"], stats


def test_a_request_that_opts_out_gets_no_drafts(two_token):
    """Two requests with the same prompt write the same tokens and are offered the same drafts; with one opted out,
    half as many."""
    R = gemma_engine.Request
    alone, stats = run(engine(two_token, **SPEC), {1: [R(0, PROMPTS[0], 32, speculative=False)]})
    assert stats["spec_drafts"] == 0
    both_in, stats_in = run(engine(two_token, **SPEC), {1: [R(0, PROMPTS[0], 32), R(1, PROMPTS[0], 32)]})
    one_out, stats_out = run(engine(two_token, **SPEC),
                             {1: [R(0, PROMPTS[0], 32, speculative=False), R(1, PROMPTS[0], 32)]})
    plain, _ = run(engine(two_token), {1: [R(0, PROMPTS[0], 32), R(1, PROMPTS[0], 32)]})
    assert one_out == both_in == plain and alone[0] == plain[0]
    assert stats_out["spec_drafts"] > 0 and stats_in["spec_drafts"] == 2 * stats_out["spec_drafts"]
    assert R(0, [2, 3], 4, speculative=False).__reduce__()[1][-1] is False
