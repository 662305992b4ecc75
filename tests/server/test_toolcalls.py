"""ReplySplitter on the agent checkpoint's tokenizer: Gemma 4 calls, reasoning and content, parsed from ids.

Calls are written by the checkpoint's own chat template (an assistant message with `tool_calls`, rendered and
tokenized), so the parser is checked against the format the model is taught, and against Transformers' own
Gemma 4 response parser (`tokenizer.parse_response` with the "gemma4" template of Transformers 5.18
`transformers/cli/serving/utils.py`) on the same text.
"""

from __future__ import annotations

import itertools
import json
import re

import pytest
from transformers import AutoTokenizer

from gemma_server.toolcalls import (
    CallArguments,
    CallStart,
    Content,
    GemmaFormat,
    GemmaToJson,
    Malformed,
    Reasoning,
    ReplySplitter,
    thinking_markers,
    token_bytes_of,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city",
                                      "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                                                     "required": ["location"]}}},
    {"type": "function", "function": {"name": "book", "description": "Book a table", "parameters": {}}},
]

# Argument dicts covering the value shapes of the call syntax.
ARGUMENTS = {
    "plain string": {"location": "Paris"},
    "string with delimiters": {"q": 'a, b} c: "d" [e] {f}'},
    "string with newlines": {"text": "line one\nline two\n\ttabbed\r\n"},
    "unicode": {"city": "Zürich", "greeting": "日本語 — ☃ 🎉"},
    "empty string": {"note": ""},
    "nested objects": {"when": {"day": "monday", "slot": {"hour": 9, "minute": 30}}, "who": "anna"},
    "arrays": {"guests": ["anna", "bob"], "matrix": [[1, 2], [3]], "mixed": [1, "x", True, None, {"k": "v"}], "none": []},
    "numbers": {"a": -3, "b": 0.25, "c": -1.5e-7, "d": 1e21, "e": 0, "f": 12345678901234567890},
    "booleans and null": {"yes": True, "no": False, "nothing": None},
    "no arguments": {},
    "mixed case keys": {"B": 1, "a": 2, "C": {"z": 1, "Y": 2}},
}


@pytest.fixture(scope="module")
def tokenizer(agent_checkpoint):
    return AutoTokenizer.from_pretrained(agent_checkpoint)


@pytest.fixture(scope="module")
def fmt(tokenizer) -> GemmaFormat:
    return GemmaFormat.detect(tokenizer)


def encode(tokenizer, text: str) -> list[int]:
    """Markup in `text` becomes its special tokens, as in the template's own rendering."""
    return tokenizer.encode(text, add_special_tokens=False)


def assistant_reply(tokenizer, message: dict, tools=TOOLS) -> list[int]:
    """The ids the template renders for one assistant message after a user turn (what the model writes)."""
    user = [{"role": "user", "content": "Hello"}]
    prompt = tokenizer.apply_chat_template(user, tools=tools, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(user + [message], tools=tools, tokenize=False)
    assert full.startswith(prompt)
    return encode(tokenizer, full[len(prompt):])


def call_message(*calls: tuple[str, dict], content: str = "") -> dict:
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call_{k}", "type": "function", "function": {"name": n, "arguments": a}} for k, (n, a) in enumerate(calls)]}


def run(tokenizer, fmt, ids, *, stream: bool, by_token: bool = True, tools: bool = True, thinking=True):
    splitter = ReplySplitter(fmt, thinking_markers(tokenizer) if thinking else None, token_bytes_of(tokenizer),
                             tools=tools, stream_calls=stream)
    events = []
    for chunk in ([i] for i in ids) if by_token else [ids]:
        events += splitter.feed(chunk)
    events += splitter.close()
    return events, splitter


def summary(tokenizer, events) -> dict:
    """What a client sees: content and reasoning text, and each call's name and joined argument fragments."""
    content, reasoning, calls = [], [], {}
    for e in events:
        if isinstance(e, Content):
            content += e.ids
        elif isinstance(e, Reasoning):
            reasoning += e.ids
        elif isinstance(e, CallStart):
            assert re.fullmatch(r"call_[0-9a-f]{24}", e.id)
            assert e.index == len(calls)
            calls[e.index] = [e.name, ""]
        else:
            assert isinstance(e, CallArguments)
            calls[e.index][1] += e.text
    return {"content": tokenizer.decode(content), "reasoning": tokenizer.decode(reasoning),
            "calls": [tuple(c) for c in calls.values()]}


def test_detect_finds_the_markers_by_text(tokenizer, fmt):
    ids = tokenizer.convert_tokens_to_ids
    assert fmt == GemmaFormat(tool_call_start=ids("<|tool_call>"), tool_call_end=ids("<tool_call|>"), quote=ids('<|"|>'),
                              tool_response=ids("<|tool_response>"), tool_start=ids("<|tool>"), tool_end=ids("<tool|>"),
                              channel_start=ids("<|channel>"), channel_end=ids("<channel|>"))
    assert thinking_markers(tokenizer) == (ids("<|channel>"), ids("<channel|>"))


def test_detect_is_none_for_a_tokenizer_without_tool_markers(chat_checkpoint):
    chat = AutoTokenizer.from_pretrained(chat_checkpoint)
    assert GemmaFormat.detect(chat) is None
    assert thinking_markers(chat) is None


@pytest.mark.parametrize("stream", [False, True], ids=["held", "streamed"])
@pytest.mark.parametrize("case", list(ARGUMENTS))
def test_the_templates_rendering_of_a_call_parses_back_to_its_arguments(tokenizer, fmt, case, stream):
    ids = assistant_reply(tokenizer, call_message(("get_weather", ARGUMENTS[case])))
    events, splitter = run(tokenizer, fmt, ids, stream=stream)
    seen = summary(tokenizer, events)
    assert [(c.name, json.loads(c.arguments)) for c in splitter.calls] == [("get_weather", ARGUMENTS[case])]
    # The fragments join into exactly the final arguments.
    assert seen["calls"] == [("get_weather", splitter.calls[0].arguments)]
    assert splitter.malformed == 0
    assert seen["content"] == ""  # the template's <|tool_response> follows only with a tool message


@pytest.mark.parametrize("stream", [False, True], ids=["held", "streamed"])
def test_token_by_token_equals_all_at_once(tokenizer, fmt, stream):
    text = ('Sure.<|channel>thought\nI will look it up.<channel|>Checking <|tool_call>call:get_weather{location:'
            '<|"|>Zürich, "CH"<|"|>,n:-1.5e3,ok:true,z:null,tags:[1,<|"|>a<|"|>,{b:false}]}<tool_call|>'
            '<|tool_call>call:book{}<tool_call|>')
    ids = encode(tokenizer, text)
    one = summary(tokenizer, run(tokenizer, fmt, ids, stream=stream, by_token=True)[0])
    whole = summary(tokenizer, run(tokenizer, fmt, ids, stream=stream, by_token=False)[0])
    assert one == whole
    assert one == {"content": "Sure.Checking ", "reasoning": "I will look it up.", "calls": [
        ("get_weather", '{"location":"Zürich, \\"CH\\"","n":-1.5e3,"ok":true,"z":null,"tags":[1,"a",{"b":false}]}'),
        ("book", "{}")]}


def test_streamed_arguments_come_as_the_tokens_do(tokenizer, fmt):
    ids = assistant_reply(tokenizer, call_message(("get_weather", ARGUMENTS["nested objects"])))
    splitter = ReplySplitter(fmt, None, token_bytes_of(tokenizer), tools=True, stream_calls=True)
    fragments = [e for i in ids for e in splitter.feed([i]) if isinstance(e, CallArguments)]
    assert len(fragments) > 5
    assert "".join(f.text for f in fragments) == splitter.calls[0].arguments


def test_parallel_calls_keep_their_order(tokenizer, fmt):
    ids = assistant_reply(tokenizer, call_message(("get_weather", {"location": "Paris"}), ("book", {"n": 2}),
                                                  ("get_weather", {"location": "Rome"})))
    _, splitter = run(tokenizer, fmt, ids, stream=False)
    assert [(c.name, json.loads(c.arguments)) for c in splitter.calls] == [
        ("get_weather", {"location": "Paris"}), ("book", {"n": 2}), ("get_weather", {"location": "Rome"})]
    assert len({c.id for c in splitter.calls}) == 3


def test_content_before_a_call_stays_content(tokenizer, fmt):
    ids = assistant_reply(tokenizer, call_message(("get_weather", {"location": "Paris"}), content="Let me check."))
    events, splitter = run(tokenizer, fmt, ids, stream=False)
    assert summary(tokenizer, events)["content"] == "Let me check."
    assert isinstance(events[0], Content)
    assert len(splitter.calls) == 1


def test_reasoning_then_content_then_a_call(tokenizer, fmt):
    ids = encode(tokenizer, '<|channel>thought\nThe user wants weather.<channel|>One moment.'
                            '<|tool_call>call:get_weather{location:<|"|>Oslo<|"|>}<tool_call|>')
    events, splitter = run(tokenizer, fmt, ids, stream=True)
    assert [kind for kind, _ in itertools.groupby(type(e) for e in events)] == [Reasoning, Content, CallStart, CallArguments]
    assert summary(tokenizer, events) == {"content": "One moment.", "reasoning": "The user wants weather.",
                                          "calls": [("get_weather", '{"location":"Oslo"}')]}


def test_without_thinking_markers_a_channel_is_content(tokenizer, fmt):
    ids = encode(tokenizer, "<|channel>thought\nhmm<channel|>Hi")
    events, _ = run(tokenizer, fmt, ids, stream=False, by_token=False, thinking=False)
    assert [type(e) for e in events] == [Content]
    assert events[0].ids == ids


@pytest.mark.parametrize("stream", [False, True], ids=["held", "streamed"])
def test_an_unterminated_call_comes_back_as_content(tokenizer, fmt, stream):
    ids = encode(tokenizer, "Hi<|tool_call>call:get_w")
    events, splitter = run(tokenizer, fmt, ids, stream=stream)
    assert [i for e in events if isinstance(e, Content) for i in e.ids] == ids
    assert splitter.calls == [] and splitter.malformed == 1


def test_a_call_cut_after_its_arguments_began_is_content_when_held(tokenizer, fmt):
    ids = encode(tokenizer, '<|tool_call>call:get_weather{location:<|"|>Par')
    events, splitter = run(tokenizer, fmt, ids, stream=False)
    assert events == [Content(ids)]
    assert splitter.malformed == 1


@pytest.mark.parametrize("text", [
    "<|tool_call>call:get_weather{location:}<tool_call|>",  # a key without a value
    "<|tool_call>call:get_weather{location:1,}<tool_call|>",  # a trailing comma
    "<|tool_call>call:get_weather{location:[1}<tool_call|>",  # brackets that do not match
    "<|tool_call>cal:get_weather{}<tool_call|>",  # not "call:"
    "<|tool_call>call:{}<tool_call|>",  # no name
    "<|tool_call>call:get weather{}<tool_call|>",  # a space in the name
    "<|tool_call>call:get_weather{} extra<tool_call|>",  # text after the arguments
    '<|tool_call>call:get_weather<|"|>{}<tool_call|>',  # a quote in the name
])
def test_a_malformed_call_comes_back_as_content_when_held(tokenizer, fmt, text):
    ids = encode(tokenizer, text)
    events, splitter = run(tokenizer, fmt, ids, stream=False)
    assert [i for e in events if isinstance(e, Content) for i in e.ids] == ids
    assert splitter.calls == [] and splitter.malformed == 1


def test_a_new_call_marker_ends_a_broken_call_and_opens_the_next(tokenizer, fmt):
    broken = encode(tokenizer, "<|tool_call>call:get_weather{location:")
    good = encode(tokenizer, '<|tool_call>call:book{n:1}<tool_call|>')
    events, splitter = run(tokenizer, fmt, broken + good, stream=False)
    assert events[0] == Content(broken)
    assert [(c.name, c.arguments) for c in splitter.calls] == [("book", '{"n":1}')]
    assert splitter.malformed == 1


def test_marker_text_typed_as_characters_is_never_a_call(tokenizer, fmt):
    text = '<|tool_call>call:get_weather{location:<|"|>Paris<|"|>}<tool_call|>'
    ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert fmt.tool_call_start not in ids and fmt.quote not in ids
    events, splitter = run(tokenizer, fmt, ids, stream=True)
    assert summary(tokenizer, events) == {"content": text, "reasoning": "", "calls": []}
    assert splitter.calls == [] and splitter.malformed == 0


def test_without_tools_a_call_is_content(tokenizer, fmt):
    ids = assistant_reply(tokenizer, call_message(("get_weather", {"location": "Paris"})))
    events, splitter = run(tokenizer, fmt, ids, stream=False, tools=False)
    assert [i for e in events for i in e.ids] == ids
    assert splitter.calls == []


def test_a_character_split_across_tokens_is_decoded_whole(tokenizer, fmt):
    ids = assistant_reply(tokenizer, call_message(("get_weather", {"location": "日本"})))
    token_bytes = token_bytes_of(tokenizer)

    def whole_characters(b: bytes) -> bool:
        try:
            b.decode()
            return True
        except UnicodeDecodeError:
            return False

    assert not all(whole_characters(token_bytes(i)) for i in ids)  # the tokenizer does split a character
    _, splitter = run(tokenizer, fmt, ids, stream=True)
    assert json.loads(splitter.calls[0].arguments) == {"location": "日本"}


@pytest.mark.parametrize("raw, value", [
    ("42", 42), ("-0.5", -0.5), ("1e3", 1000.0), ("-2.5E-3", -0.0025), ("true", True), ("false", False), ("null", None),
    ("hello world", "hello world"), ("1.", "1."), ("+1", "+1"), ("01", "01"), ("True", "True"), ("nan", "nan"),
])
def test_bare_scalars_are_typed_as_json_reads_them(raw, value):
    transcoder = GemmaToJson()
    text = transcoder.start() + transcoder.text(f"v:{raw}}}")
    assert transcoder.done
    assert json.loads(text) == {"v": value}


def test_the_transcoder_refuses_text_after_the_arguments_closed():
    transcoder = GemmaToJson()
    transcoder.text("}")
    with pytest.raises(Malformed):
        transcoder.text("x")


@pytest.mark.parametrize("case", list(ARGUMENTS))
def test_transformers_gemma4_parser_reads_the_same_calls(tokenizer, fmt, case):
    from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS

    template = _RESPONSE_TEMPLATE_FALLBACKS[("gemma4",)]
    message = call_message(("get_weather", ARGUMENTS[case]), ("book", {"n": 1}))
    ids = assistant_reply(tokenizer, message)
    ids += [fmt.tool_response]  # where the model stops after its calls
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tools=TOOLS, tokenize=False,
                                           add_generation_prompt=True)
    parsed = tokenizer.parse_response(ids, template, prefix=prompt)
    theirs = [(c["function"]["name"], c["function"]["arguments"]) for c in parsed["tool_calls"]]
    _, splitter = run(tokenizer, fmt, ids, stream=False)
    assert [(c.name, json.loads(c.arguments)) for c in splitter.calls] == theirs


def test_the_agent_template_renders_gemma4_turns(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"location": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS[:1], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<bos><|turn>system\nBe brief."
        '<|tool>declaration:get_weather{description:<|"|>Get the weather in a city<|"|>,parameters:{properties:'
        '{location:{type:<|"|>string<|"|>}},required:[<|"|>location<|"|>],type:<|"|>object<|"|>}}<tool|><turn|>\n'
        "<|turn>user\nWeather in Paris?<turn|>\n"
        '<|turn>model\nChecking.<|tool_call>call:get_weather{location:<|"|>Paris<|"|>}<tool_call|>'
        '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>'  # the model goes on in this turn
    )
    after = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "Sunny."},
                                                      {"role": "user", "content": "Thanks"}],
                                          tools=TOOLS[:1], tokenize=False, add_generation_prompt=True)
    assert after == text + "Sunny.<turn|>\n<|turn>user\nThanks<turn|>\n<|turn>model\n"
    thinking = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=True)
    plain = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert plain == "<bos><|turn>user\nHi<turn|>\n<|turn>model\n"
    assert thinking.startswith("<bos><|turn>system\n") and thinking.endswith(plain[len("<bos>"):])
