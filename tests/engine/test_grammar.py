"""Grammar-constrained sampling (rust/src/engine/grammar.rs, the mask stage of engine/sampling.rs):
`gemma_engine.Grammars` against real tokenizers, and constrained requests through the real
`Engine.run` loop on the tiny chat checkpoint (tests/checkpoints/chat.py `save_chat`, random weights).

The token environments are checked against the tokenizers' own encodings (a byte-level BPE, the chat
tokenizer, and a SentencePiece-style byte-fallback BPE generated here); the engine's constrained
outputs are parsed with `json.loads` and validated with `jsonschema`.
"""

import json
import time

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import gemma_engine
from tests.checkpoints.chat import CHAT_CORPUS, CHAT_VOCAB_SIZE, build_chat_tokenizer
from tests.checkpoints.shared import one_thread
from tests.engine.test_batching import Script

EOS = [1, 4]  # the chat checkpoint's <eos> and <end_of_turn>

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "size": {"enum": [1, 2, 3]},
    },
    "required": ["color", "ok", "count", "size"],
    "additionalProperties": False,
}
GRAMMAR = "start: %json" + json.dumps(SCHEMA)
# The engine tests' grammar: no free whitespace (llguidance's JSON default allows any run of it between
# tokens, which a random model may choose forever), so every constrained reply ends within a bound.
STRICT = "start: %json" + json.dumps({**SCHEMA, "x-guidance": {"whitespace_flexible": False}})
TEXTS = [
    {"color": "green", "ok": True, "count": 42, "size": 3},
    {"color": "red", "ok": False, "count": 0, "size": 1},
]
SENTENCEPIECE_CORPUS = CHAT_CORPUS + "\n".join(json.dumps(t) for t in TEXTS) * 3


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def sentencepiece_tokenizer(decoder: str) -> Tokenizer:
    """A SentencePiece-style BPE: <pad> <eos> <bos>, then the 256 byte tokens <0x00>..<0xFF> as plain
    vocabulary entries (as in Gemma's and Llama's tokenizer.json), then merges trained on a small
    corpus; Metaspace pre-tokenizer; characters outside the vocabulary fall back to their bytes.
    `decoder` "metaspace" is what `tokenizers` writes for it, "gemma" Gemma's own spelling
    (Replace ▁, ByteFallback, Fuse)."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    trained.train_from_iterator(
        SENTENCEPIECE_CORPUS.splitlines(), trainers.BpeTrainer(vocab_size=400, show_progress=False)
    )
    learned = json.loads(trained.to_str())["model"]
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>"] + [f"<0x{b:02X}>" for b in range(256)])}
    for token, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    if decoder == "metaspace":
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    else:
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece-metaspace", "sentencepiece-gemma"])
def tokenizer_env(request, tmp_path_factory):
    """(tokenizer, Grammars over its tokenizer.json) for each kind of tokenizer."""
    if request.param == "byte-level":
        tok = build_chat_tokenizer()
    else:
        tok = sentencepiece_tokenizer(request.param.split("-")[1])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    # A model vocabulary past the tokenizer's: the extra ids are never allowed.
    return tok, gemma_engine.Grammars(str(path), [1], tok.get_vocab_size() + 64)


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("value", TEXTS)
@pytest.mark.parametrize("separators", [(", ", ": "), (",", ":")])
def test_the_token_env_accepts_the_tokenizers_own_encoding_of_matching_json(tokenizer_env, value, separators):
    tok, grammars = tokenizer_env
    grammars.check(GRAMMAR)
    ids = _ids(tok, json.dumps(value, separators=separators))
    assert grammars.accepts(GRAMMAR, ids)
    assert not grammars.accepts(GRAMMAR, ids[:-1]), "a JSON object cut short is not accepting"
    wrong = _ids(tok, json.dumps({**value, "color": "purple"}, separators=separators))
    assert not grammars.accepts(GRAMMAR, wrong)
    # Each prefix's next id is among those allowed; eos only once the object is complete.
    for i in range(len(ids)):
        assert ids[i] in grammars.allowed(GRAMMAR, ids[:i])
    assert 1 in grammars.allowed(GRAMMAR, ids)
    assert 1 not in grammars.allowed(GRAMMAR, ids[:-1])
    assert max(grammars.allowed(GRAMMAR, ids[:3])) < tok.get_vocab_size()


def test_byte_fallback_tokens_spell_characters_outside_the_vocabulary(tmp_path):
    tok = sentencepiece_tokenizer("gemma")
    tok.save(str(tmp_path / "tokenizer.json"))
    grammars = gemma_engine.Grammars(str(tmp_path / "tokenizer.json"), [1], tok.get_vocab_size())
    grammar = 'start: %json{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'
    ids = _ids(tok, json.dumps({"name": "café ☕"}, ensure_ascii=False))
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids), "the text needs byte-fallback tokens"
    assert grammars.accepts(grammar, ids)


def test_special_tokens_are_named_in_lark_by_text_or_by_id(tmp_path):
    tok = build_chat_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    grammars = gemma_engine.Grammars(str(tmp_path / "tokenizer.json"), EOS, CHAT_VOCAB_SIZE)
    turn = tok.token_to_id("<start_of_turn>")
    ids = _ids(tok, "model") + [turn] + _ids(tok, "ocean")
    for grammar in ['start: "model" <start_of_turn> "ocean"', f'start: "model" <[{turn}]> "ocean"']:
        assert grammars.accepts(grammar, ids)
        assert grammars.allowed(grammar, _ids(tok, "model")) == [turn]
    # A quoted string with the special token's text matches that text's bytes, not the special token.
    assert not grammars.accepts('start: "model" "<start_of_turn>" "ocean"', ids)


@pytest.fixture(scope="module")
def chat_grammars(chat_checkpoint):
    return gemma_engine.Grammars(str(chat_checkpoint / "tokenizer.json"), EOS, CHAT_VOCAB_SIZE)


@pytest.mark.parametrize(
    "grammar, why",
    [
        ("start: foo", "unknown name"),
        ('start: %json{"type": "object", "properties": {"a": {"type": "strin"}}}', "strin"),
        ("start: " + "(" * 3000 + '"a"' + ")" * 3000, "too deeply nested"),
        ("start: %json" + json.dumps({"enum": ["value %d" % i for i in range(8000)]}), "max_grammar_bytes"),
    ],
)
def test_a_bad_grammar_is_value_error_naming_why(chat_grammars, grammar, why):
    with pytest.raises(ValueError, match=why):
        chat_grammars.check(grammar)
    assert gemma_engine.LIMITS["max_grammar_bytes"] == 64 * 1024


@pytest.mark.parametrize(
    "bomb",
    [
        # Intersected regexes whose emptiness llguidance cannot decide within its fuel.
        {"type": "string", "allOf": [{"pattern": "^[ab]*a[ab]{%d}$" % (10 + i)} for i in range(8)]},
        # JSON nested past what llguidance's parser takes.
        json.loads('{"type": "array", "items": ' * 400 + '{"type": "integer"}' + "}" * 400),
    ],
    ids=["intersected-regexes", "deep-nesting"],
)
def test_a_schema_bomb_is_refused_fast(chat_grammars, bomb):
    grammar = "start: %json" + json.dumps(bomb)
    start = time.perf_counter()
    with pytest.raises(ValueError):
        chat_grammars.check(grammar)
    print(f"refused in {1000 * (time.perf_counter() - start):.1f} ms")


def test_grammars_refuse_a_tokenizer_larger_than_the_model_and_bad_eos_ids(chat_checkpoint):
    path = str(chat_checkpoint / "tokenizer.json")
    with pytest.raises(ValueError, match="more than the model's vocab_size"):
        gemma_engine.Grammars(path, EOS, 100)
    with pytest.raises(ValueError, match="eos id 9999"):
        gemma_engine.Grammars(path, [9999], CHAT_VOCAB_SIZE)
    with pytest.raises(OSError):
        gemma_engine.Grammars(path + ".missing", EOS, CHAT_VOCAB_SIZE)


# ----------------------------------------------------------------------------- the engine


def _engine(chat_checkpoint, grammars, **kwargs):
    kwargs = {"context": 256, "dtype": "float32", "like": torch.zeros(1), "grammars": grammars, **kwargs}
    return gemma_engine.Engine(str(chat_checkpoint), **kwargs)


@pytest.fixture(scope="module")
def prompt(chat_checkpoint):
    tok = Tokenizer.from_file(str(chat_checkpoint / "tokenizer.json"))
    return tok.encode("<start_of_turn>user\nAnswer in JSON.<end_of_turn>\n<start_of_turn>model\n").ids


def _constrained(rid, prompt, grammar=STRICT, max_new=96, **sampling):
    params = gemma_engine.SamplingParams(**sampling) if sampling else None
    return gemma_engine.Request(rid, prompt, max_new, sampling=params, grammar=grammar)


def _valid_json(chat_checkpoint, outcome):
    tok = Tokenizer.from_file(str(chat_checkpoint / "tokenizer.json"))
    assert outcome.finish == "stop", (outcome.finish, outcome.error)
    value = json.loads(tok.decode(outcome.tokens))
    jsonschema.validate(value, SCHEMA)
    return value


SAMPLED = dict(temperature=1.0, top_k=50, top_p=0.95, seed=7)


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "seeded"])
def test_random_weights_under_a_json_schema_grammar_give_valid_json(chat_checkpoint, chat_grammars, prompt, sampling):
    out = Script({0: [_constrained(0, prompt, **sampling)]}).run(_engine(chat_checkpoint, chat_grammars))
    _valid_json(chat_checkpoint, out[0])


def test_unconstrained_the_same_model_does_not_write_json(chat_checkpoint, chat_grammars, prompt):
    """The grammar is what makes the text valid: the same request without it is not JSON."""
    out = Script({0: [gemma_engine.Request(0, prompt, 40)]}).run(_engine(chat_checkpoint, chat_grammars))
    tok = Tokenizer.from_file(str(chat_checkpoint / "tokenizer.json"))
    with pytest.raises(ValueError):
        json.loads(tok.decode(out[0].tokens))


def test_two_constrained_requests_on_one_prompt_each_follow_their_own_grammar(
    chat_checkpoint, chat_grammars, prompt
):
    """As the n choices of one request: the second follows the first's prompt read and has its own matcher."""
    other = {"type": "object", "properties": {"flag": {"type": "boolean"}}, "required": ["flag"],
             "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    out = Script({0: [_constrained(0, prompt, **SAMPLED), _constrained(1, prompt, "start: %json" + json.dumps(other),
                                                                      **SAMPLED)]}).run(
        _engine(chat_checkpoint, chat_grammars, max_batch=2)
    )
    _valid_json(chat_checkpoint, out[0])
    tok = Tokenizer.from_file(str(chat_checkpoint / "tokenizer.json"))
    assert out[1].finish == "stop"
    assert json.loads(tok.decode(out[1].tokens)) in ({"flag": True}, {"flag": False})
    alone = Script({0: [_constrained(0, prompt, **SAMPLED)]}).run(_engine(chat_checkpoint, chat_grammars))
    assert out[0].tokens == alone[0].tokens


def test_a_constrained_neighbour_leaves_a_seeded_requests_tokens_unchanged(chat_checkpoint, chat_grammars, prompt):
    sampled = dict(temperature=0.9, top_k=40, top_p=0.95, seed=1234, logit_bias={1: -100.0, 4: -100.0})
    free = lambda: gemma_engine.Request(5, prompt, 40, sampling=gemma_engine.SamplingParams(**sampled))  # noqa: E731
    alone = Script({0: [free()]}).run(_engine(chat_checkpoint, chat_grammars, max_batch=3))[5]
    busy = Script({0: [_constrained(0, prompt[:-2], **SAMPLED), free(), _constrained(1, prompt[3:])]}).run(
        _engine(chat_checkpoint, chat_grammars, max_batch=3)
    )
    assert alone.finish == "length" and len(alone.tokens) == 40
    assert busy[5].tokens == alone.tokens
    _valid_json(chat_checkpoint, busy[0])
    _valid_json(chat_checkpoint, busy[1])


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "seeded"])
def test_read_every_and_prefill_chunk_do_not_change_constrained_tokens(
    chat_checkpoint, chat_grammars, prompt, sampling
):
    base = Script({0: [_constrained(0, prompt, **sampling)]}).run(_engine(chat_checkpoint, chat_grammars))[0]
    other = Script({0: [_constrained(0, prompt, **sampling)]}).run(
        _engine(chat_checkpoint, chat_grammars, prefill_chunk=5), read_every=4
    )[0]
    assert other.tokens == base.tokens and other.finish == base.finish == "stop"


def test_a_grammar_without_grammars_or_that_does_not_compile_ends_the_request_error(
    chat_checkpoint, chat_grammars, prompt
):
    out = Script({0: [_constrained(0, prompt), gemma_engine.Request(1, prompt, 5)]}).run(
        _engine(chat_checkpoint, None, max_batch=2)
    )
    assert out[0].finish == "error" and "grammars" in out[0].error
    assert out[1].finish == "length" and len(out[1].tokens) == 5
    out = Script({0: [_constrained(0, prompt, "start: foo")]}).run(_engine(chat_checkpoint, chat_grammars))
    assert out[0].finish == "error" and "unknown name" in out[0].error


def test_grammars_of_another_vocabulary_are_value_error(chat_checkpoint):
    tok = sentencepiece_tokenizer("gemma")
    path = chat_checkpoint.parent / "sp-tokenizer.json"
    tok.save(str(path))
    with pytest.raises(ValueError, match="vocab_size"):
        _engine(chat_checkpoint, gemma_engine.Grammars(str(path), EOS, CHAT_VOCAB_SIZE + 1))
