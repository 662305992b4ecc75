"""grammars.py against llguidance itself (gemma_engine.Grammars over the agent checkpoint's tokenizer).

The tool grammar and the chat template must agree: for each shape of tool the template's own rendering of
a call is accepted, and what the grammar allows parses (toolcalls.ReplySplitter) into arguments that
validate against the tool's schema (jsonschema). Wrong calls are refused token by token.
"""

from __future__ import annotations

import json

import gemma_engine
import jsonschema
import pytest
from transformers import AutoTokenizer

from gemma_server.grammars import FORBID_BIAS, SchemaError, forbid_calls, json_grammar, tool_grammar
from gemma_server.toolcalls import GemmaFormat, ReplySplitter, thinking_markers, token_bytes_of
from tests.checkpoints.agent import AGENT_EOS_IDS, AGENT_VOCAB_SIZE

# (parameters schema, arguments the template renders) for each shape the grammar writes.
SHAPES = {
    "strings": ({"type": "object", "properties": {"location": {"type": "string"}, "unit": {"type": "string"}},
                 "required": ["location"]},
                {"location": 'Paris, "FR" {x}: [y]\nnext line', "unit": "celsius"}),
    "optional key absent": ({"type": "object", "properties": {"location": {"type": "string"}, "unit": {"type": "string"}},
                             "required": ["location"]}, {"location": "Paris"}),
    "all optional, none given": ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}, {}),
    "enum and const": ({"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                                         "v": {"const": 2}, "mode": {"type": "string", "enum": ["a b", ""]}},
                        "required": ["unit", "v", "mode"]}, {"unit": "fahrenheit", "v": 2, "mode": ""}),
    "numbers": ({"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"},
                                                  "k": {"type": "integer", "minimum": 1, "maximum": 10},
                                                  "r": {"type": "number", "exclusiveMinimum": 0}},
                 "required": ["n", "x", "k", "r"]}, {"n": -42, "x": -1.5e-7, "k": 10, "r": 0.25}),
    "booleans and null": ({"type": "object", "properties": {"yes": {"type": "boolean"}, "no": {"type": "boolean"},
                                                            "nothing": {"type": "null"}},
                           "required": ["yes", "no", "nothing"]}, {"yes": True, "no": False, "nothing": None}),
    "nullable and type lists": ({"type": "object", "properties": {"a": {"type": ["string", "null"]},
                                                                  "b": {"type": "integer", "nullable": True}},
                                 "required": ["a", "b"]}, {"a": None, "b": None}),
    "arrays": ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                                 "pair": {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                                                          "maxItems": 2},
                                                 "empty": {"type": "array", "items": {"type": "number"}},
                                                 "many": {"type": "array", "items": {"type": "boolean"}, "minItems": 3}},
                "required": ["tags", "pair", "empty", "many"]},
               {"tags": ["a", "b", "c"], "pair": [1, 2], "empty": [], "many": [True, False, True, True]}),
    "nested objects": ({"type": "object", "properties": {"when": {"type": "object", "properties": {
        "day": {"type": "string"}, "Slot": {"type": "object", "properties": {"hour": {"type": "integer"}},
                                            "required": ["hour"]}}, "required": ["day"]},
        "guests": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}},
                                              "required": ["name"], "additionalProperties": False}}},
        "required": ["when"]},
        {"when": {"day": "monday", "Slot": {"hour": 9}}, "guests": [{"name": "anna"}, {"name": "bob"}]}),
    "anyOf and oneOf": ({"type": "object", "properties": {
        "id": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "shape": {"oneOf": [{"type": "object", "properties": {"r": {"type": "number"}}, "required": ["r"]},
                            {"type": "object", "properties": {"w": {"type": "number"}, "h": {"type": "number"}},
                             "required": ["w", "h"]}]}},
        "required": ["id", "shape"]}, {"id": "x7", "shape": {"w": 2, "h": 3.5}}),
    "free-form values": ({"type": "object", "properties": {"extra": {}, "blob": {"type": "object"}},
                          "required": ["extra", "blob"]},
                         {"extra": [1, "two", {"three": None}], "blob": {"k": {"deep": [True]}}}),
    "formats and lengths": ({"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                                              "id": {"type": "string", "format": "uuid"},
                                                              "code": {"type": "string", "minLength": 2, "maxLength": 3}},
                             "required": ["day", "id", "code"]},
                            {"day": "2026-12-02", "id": "123e4567-e89b-12d3-a456-426614174000", "code": "ab"}),
    "no parameters": (None, {}),
}


@pytest.fixture(scope="module")
def tokenizer(agent_checkpoint):
    return AutoTokenizer.from_pretrained(agent_checkpoint)


@pytest.fixture(scope="module")
def fmt(tokenizer) -> GemmaFormat:
    return GemmaFormat.detect(tokenizer)


@pytest.fixture(scope="module")
def grammars(agent_checkpoint):
    return gemma_engine.Grammars(str(agent_checkpoint / "tokenizer.json"), AGENT_EOS_IDS, AGENT_VOCAB_SIZE)


def tool(name: str, parameters: dict | None) -> dict:
    function = {"name": name, "description": f"The {name} tool"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def rendered_calls(tokenizer, tools, *calls: tuple[str, dict]) -> list[int]:
    """The ids the chat template renders for an assistant message holding `calls` (what the model writes)."""
    user = [{"role": "user", "content": "Hello"}]
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{k}", "type": "function", "function": {"name": n, "arguments": a}} for k, (n, a) in enumerate(calls)]}
    prompt = tokenizer.apply_chat_template(user, tools=tools, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(user + [message], tools=tools, tokenize=False)
    return tokenizer.encode(full[len(prompt):], add_special_tokens=False)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_grammar_accepts_the_templates_rendering_of_each_shape(tokenizer, fmt, grammars, shape):
    parameters, arguments = SHAPES[shape]
    tools = [tool("act", parameters), tool("other", {"type": "object", "properties": {"q": {"type": "string"}}})]
    grammar = tool_grammar(tools, fmt)
    grammars.check(grammar)
    ids = rendered_calls(tokenizer, tools, ("act", arguments))
    assert grammars.accepts(grammar, ids)
    # What the grammar accepted parses back and validates against the schema.
    splitter = ReplySplitter(fmt, None, token_bytes_of(tokenizer), tools=True, stream_calls=True)
    splitter.feed(ids)
    assert [c.name for c in splitter.calls] == ["act"]
    parsed = json.loads(splitter.calls[0].arguments)
    assert parsed == arguments
    jsonschema.validate(parsed, json_schema(parameters or {"type": "object"}))


def json_schema(schema):
    """OpenAPI's `nullable: true` (which Gemma's template knows) as JSON Schema's type list, for jsonschema."""
    if isinstance(schema, list):
        return [json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: json_schema(v) for k, v in schema.items() if k != "nullable"}
    if schema.get("nullable") is True:
        out["type"] = [schema["type"], "null"]
    return out


WEATHER = [tool("get_weather", {"type": "object", "properties": {
    "location": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["celsius", "fahrenheit"]}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
    "required": ["location"]}), tool("get_time", None)]


@pytest.mark.parametrize("call", [
    ("get_weather", {"location": "Paris", "days": 3}),
    ("get_weather", {"location": "Paris", "unit": "celsius", "tags": ["a", "b"]}),
    ("get_time", {}),
], ids=["weather", "weather with all", "time"])
def test_valid_calls_are_accepted(tokenizer, fmt, grammars, call):
    assert grammars.accepts(tool_grammar(WEATHER, fmt), rendered_calls(tokenizer, WEATHER, call))


@pytest.mark.parametrize("call", [
    ("get_news", {"location": "Paris"}),  # a tool nobody declared
    ("get_weather", {"location": 5}),  # wrong type
    ("get_weather", {"days": 3}),  # the required key missing
    ("get_weather", {"location": "Paris", "days": 8}),  # out of range
    ("get_weather", {"location": "Paris", "days": 2.5}),  # not an integer
    ("get_weather", {"location": "Paris", "unit": "kelvin"}),  # not in the enum
    ("get_weather", {"location": "Paris", "tags": ["a", "b", "c"]}),  # too many items
    ("get_weather", {"location": "Paris", "wind": True}),  # an undeclared key
    ("get_time", {"now": True}),  # arguments for a function without parameters
], ids=["undeclared tool", "wrong type", "missing required", "out of range", "fraction", "enum", "too many items",
        "extra key", "arguments to none"])
def test_wrong_calls_are_refused(tokenizer, fmt, grammars, call):
    assert not grammars.accepts(tool_grammar(WEATHER, fmt), rendered_calls(tokenizer, WEATHER, call))


def test_keys_out_of_the_templates_order_are_refused(tokenizer, fmt, grammars):
    text = '<|tool_call>call:get_weather{unit:<|"|>celsius<|"|>,location:<|"|>Paris<|"|>}<tool_call|>'
    assert not grammars.accepts(tool_grammar(WEATHER, fmt), encode(tokenizer, text))


def test_a_string_cannot_hold_the_quote_token_but_may_hold_its_text(tokenizer, fmt, grammars):
    grammar = tool_grammar(WEATHER, fmt)
    head = encode(tokenizer, '<|tool_call>call:get_weather{location:<|"|>Par')
    assert fmt.quote in grammars.allowed(grammar, head)
    typed = tokenizer.encode('<|"|>', add_special_tokens=False, split_special_tokens=True)
    assert grammars.accepts(grammar, head + typed + encode(tokenizer, 'is<|"|>}<tool_call|>'))
    assert not grammars.accepts(grammar, head + encode(tokenizer, '<|"|><|"|>is<|"|>}<tool_call|>'))


def test_parallel_false_allows_exactly_one_call(tokenizer, fmt, grammars):
    two = rendered_calls(tokenizer, WEATHER, ("get_time", {}), ("get_weather", {"location": "Rome"}))
    one = rendered_calls(tokenizer, WEATHER, ("get_time", {}))
    assert grammars.accepts(tool_grammar(WEATHER, fmt, parallel=True), two)
    assert not grammars.accepts(tool_grammar(WEATHER, fmt, parallel=False), two)
    single = tool_grammar(WEATHER, fmt, parallel=False)
    assert grammars.accepts(single, one)
    assert sorted(grammars.allowed(single, one)) == sorted(AGENT_EOS_IDS)  # stopped: only an eos can follow
    assert not grammars.accepts(single, [])


def test_name_forces_one_function(tokenizer, fmt, grammars):
    grammar = tool_grammar(WEATHER, fmt, name="get_time")
    assert grammars.accepts(grammar, rendered_calls(tokenizer, WEATHER, ("get_time", {})))
    assert not grammars.accepts(grammar, rendered_calls(tokenizer, WEATHER, ("get_weather", {"location": "Rome"})))


def test_a_call_may_follow_a_thought_when_thinking_is_on(tokenizer, fmt, grammars):
    thought = encode(tokenizer, "<|channel>thought\nI need the time.<channel|>")
    call = rendered_calls(tokenizer, WEATHER, ("get_time", {}))
    thinking = thinking_markers(tokenizer)
    assert grammars.accepts(tool_grammar(WEATHER, fmt, thinking=thinking), thought + call)
    assert grammars.accepts(tool_grammar(WEATHER, fmt, thinking=thinking), call)
    assert not grammars.accepts(tool_grammar(WEATHER, fmt), thought + call)


def test_the_thought_is_bounded_by_thinking_max_tokens(tokenizer, grammars):
    thinking = thinking_markers(tokenizer)
    answer = encode(tokenizer, '{"a": 1}')
    short = encode(tokenizer, "<|channel>thought\nok<channel|>")
    long = encode(tokenizer, "<|channel>thought\n" + "and then " * 20 + "<channel|>")
    bounded = json_grammar(None, thinking=thinking, thinking_max_tokens=8)
    assert grammars.accepts(bounded, short + answer)
    assert not grammars.accepts(bounded, long + answer)
    assert grammars.accepts(json_grammar(None, thinking=thinking), long + answer)


@pytest.mark.parametrize("text, ok", [
    ('{"a": 1, "b": [true, null, "x"]}', True),
    ("{}", True),
    ('{"a": }', False),
    ("[1, 2]", False),  # json_object: an object
    ('{"a": 1', False),
])
def test_json_object_accepts_json_objects_only(tokenizer, grammars, text, ok):
    assert grammars.accepts(json_grammar(None), encode(tokenizer, text)) is ok


def test_json_schema_is_enforced(tokenizer, grammars):
    grammar = json_grammar({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                            "required": ["name", "age"], "additionalProperties": False})
    grammars.check(grammar)
    assert grammars.accepts(grammar, encode(tokenizer, '{"name": "Ann", "age": 31}'))
    assert not grammars.accepts(grammar, encode(tokenizer, '{"name": "Ann"}'))
    assert not grammars.accepts(grammar, encode(tokenizer, '{"name": "Ann", "age": "31"}'))


@pytest.mark.parametrize("parameters, path", [
    ({"type": "object", "properties": {"when": {"type": "string", "format": "email"}}},
     "tools[0].function.parameters.properties.when.format"),
    ({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$"}}},
     "tools[0].function.parameters.properties.code.pattern"),
    ({"type": "object", "properties": {"loc": {"$ref": "#/$defs/loc"}}, "$defs": {"loc": {"type": "string"}}},
     "tools[0].function.parameters.$defs"),
    ({"type": "object", "properties": {"loc": {"$ref": "#/definitions/loc"}}},
     "tools[0].function.parameters.properties.loc.$ref"),
    ({"type": "object", "properties": {"x": {"allOf": [{"type": "string"}]}}},
     "tools[0].function.parameters.properties.x.allOf"),
    ({"type": "object", "properties": {"x": {"type": "string"}}, "additionalProperties": {"type": "integer"}},
     "tools[0].function.parameters.additionalProperties"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "tools[0].function.parameters.patternProperties"),
    ({"type": "object", "properties": {"a b": {"type": "string"}}}, "tools[0].function.parameters.properties.a b"),
    ({"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}},
     "tools[0].function.parameters.properties.xs.uniqueItems"),
    ({"type": "object", "properties": {"xs": {"type": "array", "prefixItems": [{"type": "string"}]}}},
     "tools[0].function.parameters.properties.xs.prefixItems"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "format": "int32"}}},
     "tools[0].function.parameters.properties.n.format"),
    ({"type": "string"}, "tools[0].function.parameters.type"),
    ({"type": "object", "properties": {"x": {"type": "decimal"}}}, "tools[0].function.parameters.properties.x.type"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_unsupported_schema_parts_are_schema_errors_naming_the_path(fmt, parameters, path):
    with pytest.raises(SchemaError) as error:
        tool_grammar([tool("act", parameters)], fmt)
    assert error.value.path == path
    assert path in str(error.value)


def test_a_function_name_that_cannot_be_written_bare_is_a_schema_error(fmt):
    with pytest.raises(SchemaError) as error:
        tool_grammar([tool("get_weather", None), tool("get-time", None)], fmt)
    assert error.value.path == "tools[1].function.name"


def test_naming_an_undeclared_function_is_a_schema_error(fmt):
    with pytest.raises(SchemaError) as error:
        tool_grammar(WEATHER, fmt, name="get_news")
    assert error.value.path == "tool_choice.function.name"


def test_forbid_calls_biases_the_call_marker_away(fmt):
    assert forbid_calls(fmt) == {fmt.tool_call_start: FORBID_BIAS}


# ---------------------------------------------------------------- golden grammars

FMT = GemmaFormat(tool_call_start=7, tool_call_end=8, quote=11, tool_response=9, channel_start=12, channel_end=13)


def test_golden_one_required_string():
    schema = {"type": "object", "properties": {"location": {"type": "string", "description": "A city"}},
              "required": ["location"]}
    assert tool_grammar([tool("get_weather", schema)], FMT) == (
        "start: calls\n"
        "calls: call+\n"
        'call: <[7]> "call:" (fn_0) <[8]>\n'
        'fn_0: "get_weather" "{" "location:" <[11]> TEXT <[11]> "}"\n'
        "TEXT: /(?s:.)*/\n"
    )


def test_golden_optional_members_in_dictsort_order_one_call():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "A": {"type": "boolean"}}, "required": ["b"]}
    assert tool_grammar([tool("f", schema), tool("g", None)], FMT, parallel=False) == (
        "start: calls\n"
        "calls: call\n"
        'call: <[7]> "call:" (fn_0 | fn_1) <[8]>\n'
        'member_0: "A:" ("true" | "false")\n'
        'member_1: "b:" INTEGER\n'
        'fn_0: "f" "{" (member_0 ("," member_1) | member_1) "}"\n'
        'fn_1: "g" "{" "}"\n'
        "INTEGER: /-?(0|[1-9][0-9]*)/\n"
    )


def test_golden_enum_array_and_thought():
    schema = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                               "xs": {"type": "array", "items": {"type": "number"}, "maxItems": 3}},
              "required": ["unit", "xs"]}
    assert tool_grammar([tool("f", schema)], FMT, name="f", thinking=(12, 13), thinking_max_tokens=64) == (
        "start: thought? calls\n"
        "calls: call+\n"
        'call: <[7]> "call:" (fn_0) <[8]>\n'
        'thought: <[12]> "thought\\n" thought_text <[13]>\n'
        "thought_text[max_tokens=64]: /(?s:.)*/\n"
        'fn_0: "f" "{" "unit:" (<[11]> "c" <[11]> | <[11]> "f" <[11]>) ("," "xs:" "[" (NUMBER ("," NUMBER) ~ 0..2)? "]") "}"\n'
        "NUMBER: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/\n"
    )


def test_golden_json_grammars():
    assert json_grammar(None) == 'start: %json {"type": "object"}\n'
    assert json_grammar({"type": "array"}, thinking=("<|channel>", "<channel|>")) == (
        "start: thought? answer\n"
        'answer: %json {"type": "array"}\n'
        'thought: <|channel> "thought\\n" thought_text <channel|>\n'
        "thought_text: /(?s:.)*/\n"
    )


# ---------------------------------------------------------------- the engine under a tool grammar

# Every value bounded (enums, booleans, a ranged integer), so a random model's forced call ends.
BOUNDED = [tool("set_light", {"type": "object", "properties": {
    "room": {"enum": ["hall", "kitchen"]}, "on": {"type": "boolean"},
    "level": {"type": "integer", "minimum": 0, "maximum": 99}, "color": {"enum": ["red", None, 3]}},
    "required": ["room", "on"]}), tool("reset", None)]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 11}], ids=["greedy", "seeded"])
def test_random_weights_under_a_tool_grammar_write_a_call_that_parses_and_validates(
    agent_checkpoint, tokenizer, fmt, grammars, sampling
):
    import torch

    from tests.checkpoints.shared import one_thread
    from tests.engine.test_batching import Script

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Lights on in the hall."}], tools=BOUNDED,
                                           tokenize=True, add_generation_prompt=True, return_dict=False)
    grammar = tool_grammar(BOUNDED, fmt, parallel=False)
    params = gemma_engine.SamplingParams(**sampling) if sampling else None
    with one_thread():
        engine = gemma_engine.Engine(str(agent_checkpoint), context=512, dtype="float32", like=torch.zeros(1),
                                     grammars=grammars)
        out = Script({0: [gemma_engine.Request(0, list(prompt), 128, sampling=params, grammar=grammar)]}).run(engine)[0]
    assert out.finish == "stop", (out.finish, out.error)
    splitter = ReplySplitter(fmt, None, token_bytes_of(tokenizer), tools=True, stream_calls=True)
    splitter.feed(out.tokens)
    splitter.close()
    assert splitter.malformed == 0 and len(splitter.calls) == 1
    call = splitter.calls[0]
    schema = next(t["function"].get("parameters") or {"type": "object", "additionalProperties": False}
                  for t in BOUNDED if t["function"]["name"] == call.name)
    jsonschema.validate(json.loads(call.arguments), {**schema, "additionalProperties": False})
