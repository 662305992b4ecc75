"""Unit tests of the protocol package: request validation and request -> engine parameters (no server, no engine)."""

import logging
import re

import pytest
from pydantic import ValidationError

from gemma_server.errors import ApiError
from gemma_server.openapi import token_id_key_pattern
from gemma_server.protocol.requests import ChatCompletionRequest, CompletionRequest

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return ChatCompletionRequest(messages=MSG, **kw)


def params(req, n_prompt=10, context=100, vocab=512):
    """The request's engine parameters, checked first as the server checks it (once, before admission)."""
    req.check()
    return req.engine_params(list(range(1, n_prompt + 1)), context, vocab)


def assert_400(fn, param):
    with pytest.raises(ApiError) as e:
        fn()
    assert e.value.status == 400
    assert e.value.param == param
    return e.value


def test_max_completion_tokens_wins_over_max_tokens():
    assert params(chat(max_tokens=5, max_completion_tokens=7)).max_new == 7
    assert params(chat(max_tokens=5)).max_new == 5


def test_max_tokens_is_capped_at_context_minus_prompt():
    assert params(chat(max_tokens=1000), n_prompt=10, context=100).max_new == 90


def test_chat_without_max_tokens_may_fill_the_context_and_completions_default_to_16():
    assert params(chat(), n_prompt=10, context=100).max_new == 90
    assert params(CompletionRequest(prompt="x"), n_prompt=10, context=100).max_new == 16


def test_prompt_that_fills_the_context_is_400_naming_the_prompt_field():
    e = assert_400(lambda: params(chat(), n_prompt=100, context=100), "messages")
    assert "100" in e.message
    assert_400(lambda: params(CompletionRequest(prompt="x"), n_prompt=100, context=100), "prompt")


def test_token_ids_outside_the_vocabulary_are_400():
    req = CompletionRequest(prompt=[1, 2, 600])
    assert_400(lambda: req.engine_params([1, 2, 600], 100, 512), "prompt")
    assert_400(lambda: params(chat(stop_token_ids=[512])), "stop_token_ids")


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", 2.1),
        ("temperature", -1.0),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("n", 0),
        ("n", 17),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3.0),
        ("logit_bias", {"1": 200.0}),
        ("logit_bias", {"x": 1.0}),
        ("logit_bias", {"512": 1.0}),
        ("top_logprobs", 2),
        ("top_k", -2),
        ("logit_bias", {"\u00b2": 1.0}),  # a digit to str.isdigit, not to int()
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 3.0),
        ("stop", "x" * 257),
        ("ignore_eos", True),
        ("max_tokens", 0),
        ("max_completion_tokens", -1),
        ("stop", ["ok", ""]),
    ],
)
def test_unsupported_or_bad_chat_fields_are_400_naming_the_field(field, value):
    assert_400(lambda: params(chat(**{field: value})), field)


@pytest.mark.parametrize("field,value", [("logit_bias", {str(i): 1.0 for i in range(301)}), ("stop", ["s"] * 17),
                                         ("stop_token_ids", list(range(65))),
                                         ("messages", [{"role": "user", "content": "hi"}] * 1025)])
def test_list_caps_are_schema_bounds_that_stop_validation_at_the_first_excess(field, value):
    # A cap is part of the schema (the server's 400 names the field: tests/server/test_limits.py), so
    # pydantic refuses the list by its length instead of validating every item first.
    body = {"messages": MSG, field: value}
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(body)
    assert any(err["type"] == "too_long" and err["loc"][0] == field for err in e.value.errors())


@pytest.mark.parametrize("field,value", [("best_of", 2), ("max_tokens", 0), ("suffix", "x"), ("logprobs", 6)])
def test_unsupported_completion_fields_are_400_naming_the_field(field, value):
    assert_400(lambda: params(CompletionRequest(prompt="x", **{field: value})), field)


def test_several_prompts_in_one_request_are_400():
    assert_400(lambda: CompletionRequest(prompt=["a", "b"]).check(), "prompt")
    assert CompletionRequest(prompt=["a"]).single_prompt() == "a"
    assert CompletionRequest(prompt=[[5, 6]]).single_prompt() == [5, 6]
    assert CompletionRequest(prompt=[5, 6]).single_prompt() == [5, 6]


def test_stream_options_without_stream_is_400():
    assert_400(lambda: chat(stream_options={"include_usage": True}).check(), "stream_options")


def test_greedy_values_seed_and_user_are_accepted():
    p = params(chat(temperature=0, top_p=1, n=1, seed=123, user="u", top_k=1, stop="END", stop_token_ids=[7]))
    assert p.stop == ("END",)
    assert p.stop_ids == (7,)


def test_sampling_fields_become_engine_sampling_params_with_openai_defaults():
    p = params(chat(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5,
                    repetition_penalty=1.1, logit_bias={"5": -100, "7": 2.5}, seed=11, n=3, logprobs=True,
                    top_logprobs=4))
    assert dict(p.sampling) == {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "presence_penalty": 0.5,
                                "frequency_penalty": -0.5, "repetition_penalty": 1.1,
                                "logit_bias": {5: -100.0, 7: 2.5}, "seed": 11}
    assert (p.n, p.logprobs) == (3, 4)
    # Choice i of a seeded request draws with seed + i; without a seed each choice gets a fresh one.
    assert [p.choice_sampling(i, lambda: 0)["seed"] for i in range(3)] == [11, 12, 13]
    assert p.choice_sampling(0, lambda: 0)["logprobs"] == 4
    unseeded = params(chat())
    assert unseeded.choice_sampling(0, lambda: 42)["seed"] == 42
    # Absent fields are neutral; an absent temperature is the server's default (OpenAI's 1 by default).
    assert dict(unseeded.sampling)["temperature"] == 1.0 and dict(unseeded.sampling)["top_k"] == 0
    assert dict(chat().engine_params([1, 2], 100, 512, default_temperature=0.0).sampling)["temperature"] == 0.0
    assert dict(params(chat(top_k=-1)).sampling)["top_k"] == 0
    assert params(chat(logprobs=True)).logprobs == 0 and params(chat()).logprobs is None
    assert params(CompletionRequest(prompt="x", logprobs=2)).logprobs == 2


def test_unknown_fields_are_ignored_and_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="gemma_server.protocol.requests"):
        req = ChatCompletionRequest(messages=MSG, frobnicate=1, another={"x": 1})
    assert params(req).max_new == 90
    assert "ignored 2 unknown request fields: 'frobnicate', 'another'" in caplog.text


def test_text_content_parts_are_joined_and_media_parts_keep_their_places():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]}])
    assert req.template_messages() == [{"role": "user", "content": "ab"}] and req.media_parts() == []
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    audio = {"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}}
    req = ChatCompletionRequest(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Look: "}, image, audio, {"type": "text", "text": "?"}]}])
    req.check()
    assert req.template_messages()[1]["content"] == [{"type": "text", "text": "Look: "}, {"type": "image"},
                                                     {"type": "audio"}, {"type": "text", "text": "?"}]
    assert [(p.kind, p.param, p.source) for p in req.media_parts()] == [
        ("image", "messages[1].content[1]", "data:image/png;base64,AAAA"),
        ("audio", "messages[1].content[2]", "UklG")]
    # Only a user message holds media; a part is whole (an image has its url, audio a known format).
    assert_400(ChatCompletionRequest(messages=[{"role": "system", "content": [image]}]).check, "messages[0].content[0]")
    for bad in ({"type": "image_url", "image_url": {}}, {**audio, "input_audio": {"data": "x", "format": "ogg"}},
                {"type": "file", "file": {"file_id": "f"}}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest(messages=[{"role": "user", "content": [bad]}])


def test_bodies_are_read_as_json_schema_reads_them():
    assert CompletionRequest(prompt=[1.0, 2]).prompt == [1, 2] and chat(seed=5.0).seed == 5
    for bad in ({"temperature": "0.5"}, {"stream": 1}, {"n": "2"}, {"n": 1.5}, {"logprobs": "true"}):
        with pytest.raises(ValidationError):
            chat(**bad)


@pytest.mark.parametrize("vocab", [1, 10, 11, 512, 262144])
def test_logit_bias_key_pattern_is_exactly_the_ids_below_the_vocabulary(vocab):
    pattern = re.compile(token_id_key_pattern(vocab))
    accepted = [n for n in range(vocab * 3 + 20) if pattern.match(str(n))]
    assert accepted == list(range(vocab))
    assert bool(pattern.match("007")) == (vocab > 7) and not pattern.match("-1") and not pattern.match("\u00b2")


def test_seeds_and_top_k_past_64_bits_are_taken_in_range_not_refused():
    # A float rounds 2**63 - 1 to 2**63, which JSON Schema's maximum would pass: no such bound is kept.
    p = params(chat(seed=2**64 + 5, top_k=2**70))
    assert p.choice_sampling(0, lambda: 0)["seed"] == 5 and dict(p.sampling)["top_k"] == 2**63 - 1


def test_ignored_fields_are_logged_as_a_count_and_a_few_escaped_names():
    from gemma_server.protocol.base import ignored_fields

    forged = "x\n2026-12-01 INFO gemma_server: forged line"
    line = ignored_fields({forged: 1, **{f"f{i}": i for i in range(100_000)}, "y" * 5000: 0})
    assert "\n" not in line and len(line) < 400
    assert line.startswith("100002 unknown request fields: ") and "and 99997 more" in line
    assert repr(forged[:40]) in line


def test_a_logprob_answer_over_its_budget_is_400_naming_the_product():
    from gemma_server.protocol.requests import CompletionRequest
    from gemma_server.protocol.limits import MAX_LOGPROB_ENTRIES

    ok = chat(n=16, max_tokens=600, logprobs=True, top_logprobs=20).engine_params([1, 2], 1000, 512)
    assert ok.logprobs == 20 and 16 * 600 * 21 <= MAX_LOGPROB_ENTRIES
    with pytest.raises(ApiError) as e:
        chat(n=16, max_tokens=1000, logprobs=True, top_logprobs=20).engine_params([1, 2], 8192, 512)
    assert e.value.status == 400 and e.value.param == "top_logprobs"
    assert "16 x 1000 x 21 = 336000" in e.value.message
    # The tokens that can come (capped by the context) count, not the max_tokens asked for.
    chat(n=16, max_tokens=10**6, logprobs=True, top_logprobs=20).engine_params([1, 2], 800, 512)
    with pytest.raises(ApiError) as e:
        CompletionRequest(prompt="hi", n=16, max_tokens=4000, logprobs=5).engine_params([1, 2], 8192, 512)
    assert e.value.param == "logprobs"
    # Without log-probabilities there is no such budget.
    chat(n=16, max_tokens=8000).engine_params([1, 2], 8192, 512)


def test_the_protocols_copies_of_the_engines_limits_are_the_engines():
    """protocol/limits.py cannot import gemma_engine (it is imported before the boot builds the engine), so it writes
    the engine's bounds out; here they are held to the engine's own declaration."""
    import gemma_engine

    from gemma_server.protocol import limits as protocol

    assert {"max_top_logprobs": protocol.MAX_TOP_LOGPROBS, "max_logit_bias": protocol.MAX_LOGIT_BIAS,
            "max_stop_token_ids": protocol.MAX_STOP_TOKEN_IDS,
            "max_grammar_bytes": protocol.MAX_GRAMMAR_BYTES} == gemma_engine.LIMITS


@pytest.mark.parametrize("field, at_limit", [
    ("top_logprobs", lambda n: {"logprobs": True, "top_logprobs": n}),
    ("logit_bias", lambda n: {"logit_bias": {str(i): 1.0 for i in range(n)}}),
    ("stop_token_ids", lambda n: {"stop_token_ids": list(range(n))}),
])
def test_the_engines_limits_pass_at_the_limit_and_are_400_past_it(field, at_limit):
    import gemma_engine

    limit = gemma_engine.LIMITS[{"top_logprobs": "max_top_logprobs", "logit_bias": "max_logit_bias",
                                 "stop_token_ids": "max_stop_token_ids"}[field]]
    params(chat(**at_limit(limit)), vocab=1024)
    with pytest.raises((ApiError, ValidationError)) as e:
        req = chat(**at_limit(limit + 1))
        req.check()
    assert field in str(e.value.param if isinstance(e.value, ApiError) else e.value)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("body,param", [
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a.b"}}]}, "tools[0].function.name"),
    ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
    ({"messages": MSG + [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "1"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": MSG + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"whitespace_pattern": "a"}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"json": {}, "choice": ["a"]}}, "structured_outputs.choice"),
    ({"guided_json": "{not json"}, "guided_json"),
])
def test_bad_tool_and_structured_output_fields_are_400_naming_the_field(body, param):
    assert_400(lambda: ChatCompletionRequest(**{"messages": MSG, **body}).check(), param)


def test_constraints_follow_tool_choice_then_response_format_then_structured_outputs():
    assert chat(tools=[TOOL]).tool_choice_mode() == "auto" and chat().tool_choice_mode() == "none"
    assert chat(tools=[TOOL]).constraint() is None
    named = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}}).constraint()
    assert (named.kind, named.name) == ("tools", "f")
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    c = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).constraint()
    assert (c.kind, c.schema, c.param) == ("json", schema, "response_format.json_schema.schema")
    assert chat(guided_json='{"type": "object"}').constraint().schema == {"type": "object"}
    assert CompletionRequest(prompt="x", structured_outputs={"choice": ["a", "b"]}).constraint().choices == ("a", "b")
    p = params(chat(tools=[TOOL], tool_choice="required"))
    assert (p.tools, p.forced_calls) == (True, True)
    p = params(chat(tools=[TOOL], tool_choice="none"))
    assert (p.tools, p.forced_calls) == (False, False)


def test_assistant_tool_calls_reach_the_template_with_arguments_as_objects():
    req = ChatCompletionRequest(messages=MSG + [
        {"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}], tools=[TOOL])
    req.check()
    assert req.template_messages()[1:] == [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                             "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "done", "tool_call_id": "c1"}]


def test_the_server_bias_wins_and_echo_allows_max_tokens_0():
    p = chat(logit_bias={"7": 5.0}).engine_params([1, 2], 100, 512, internal_bias={7: -1e9, 8: -1e9})
    assert dict(p.sampling)["logit_bias"] == {7: -1e9, 8: -1e9}
    echo = CompletionRequest(prompt="x", echo=True, logprobs=1, max_tokens=0)
    echo.check()
    p = echo.engine_params([1, 2], 100, 512)
    assert (p.max_new, p.prompt_logprobs) == (0, 1)


@pytest.mark.parametrize("salt", ["", "s" * 257, "a\ud800b"])
def test_a_cache_salt_that_is_empty_too_long_or_not_unicode_is_400_naming_it(salt):
    for req in (chat(cache_salt=salt), CompletionRequest(prompt="x", cache_salt=salt)):
        assert_400(req.check, "cache_salt")


def test_the_cache_salt_and_the_cache_boundary_reach_the_engine_parameters():
    p = params(chat(cache_salt="tenant-a" * 32))  # 256 characters: the longest taken
    assert (p.cache_salt, p.cache_boundary) == ("tenant-a" * 32, None)
    req = chat()
    req.check()
    assert req.engine_params(list(range(1, 11)), 100, 512, cache_boundary=4).cache_boundary == 4
    assert params(CompletionRequest(prompt="x", cache_salt="b")).cache_salt == "b"
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": MSG, "cache_salt": 7})  # a string, strictly
