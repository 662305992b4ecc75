"""/v1/messages (Anthropic's Messages API), judged by Anthropic's own SDK against the real server and engine.

The server is the real app on the agent checkpoint (Gemma 4's tool and thinking markers, random weights:
tests/checkpoints/agent.py `save_agent_chat`), greedy by default. A Messages request is served as the chat
request it translates to (gemma_server/frontends/messages.py), so the same conversation sent to
/v1/chat/completions gives the same reply and the same prompt: most tests compare the two. A random model cannot write a valid call
by chance, so every valid tool_use here is the grammar's doing (tool_choice any or tool); the schemas are
enums, booleans, bounded integers and short strings so that a random model's reply ends, and the replies no
grammar ends get a small max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import anthropic
import httpx
import jsonschema
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gemma_server.errors import ApiError, param_from_loc
from gemma_server.frontends import messages
from gemma_server.frontends.messages import AnthropicRoute, MessagesRequest, Translation, to_chat
from gemma_server.frontends.messages_format import Blocks, MessagesFormat, partial_object
from gemma_server.protocol.content import StructuredOutputs
from gemma_server.jobs import QueueFull
from gemma_server.serving import Piece, stream
from gemma_server.toolcalls import CallArguments, CallStart
from tests.server.conftest import openai_client, prompt_tokens, sample, start_in_process, wait_for
from tests.server.test_agents import ALERT, WEATHER

TOOLS = [{"name": "get_weather", "description": "The weather of a city.", "input_schema": WEATHER},
         {"name": "send_alert", "description": "Alert someone.", "input_schema": ALERT}]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
# The same tools as chat declares them (messages.to_chat's mapping).
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                "parameters": t["input_schema"]}} for t in TOOLS]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
RAW_EVENTS = {"message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
              "message_stop"}


def anthropic_client(server) -> anthropic.Anthropic:
    """Anthropic's SDK pointed at `server`, without retries (a refusal is the test's to see)."""
    return anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(agent_server) -> anthropic.Anthropic:
    return anthropic_client(agent_server)


@pytest.fixture(scope="module")
def chat(agent_server) -> openai.OpenAI:
    return openai_client(agent_server)


@pytest.fixture(scope="module")
def model(agent_server) -> str:
    return agent_server.state.config.model_name


def prompt_of(usage) -> int:
    """Anthropic's usage counts the prompt in parts: not cached, read from the cache, written to it."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def assert_valid_tool_uses(message) -> list:
    """The message's tool_use blocks: at least one, each input valid for its tool's input_schema."""
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and message.stop_reason == "tool_use"
    for use in uses:
        assert use.name in SCHEMAS and use.id
        jsonschema.validate(use.input, SCHEMAS[use.name])
    return uses


# ---------------------------------------------------------------- replies


def test_a_plain_message_is_the_chat_reply_to_the_same_conversation(agent_server, claude, chat, model):
    m = claude.messages.create(model=model, max_tokens=12, messages=ASK, metadata={"user_id": "u-1"},
                               extra_body={"temperature": 0, "top_k": 5, "top_p": 0.9})
    c = chat.chat.completions.create(model=model, max_tokens=12, messages=ASK, top_p=0.9,
                                     extra_body={"top_k": 5}, temperature=0)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == model
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == c.choices[0].message.content
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[c.choices[0].finish_reason]
    assert m.stop_sequence is None
    assert m.usage.output_tokens == c.usage.completion_tokens
    assert prompt_of(m.usage) == c.usage.prompt_tokens == prompt_tokens(agent_server, ASK)
    assert m.usage.cache_creation_input_tokens == 0


def test_system_as_a_string_and_as_text_blocks_is_the_chat_system_message(agent_server, claude, chat, model):
    as_string = claude.messages.create(model=model, max_tokens=8, messages=ASK, system="Be brief.\nAnswer in French.")
    as_blocks = claude.messages.create(model=model, max_tokens=8, messages=ASK, system=[
        {"type": "text", "text": "Be brief."},
        {"type": "text", "text": "Answer in French.", "cache_control": {"type": "ephemeral"}}])
    system = [{"role": "system", "content": "Be brief.\nAnswer in French."}]
    c = chat.chat.completions.create(model=model, max_tokens=8, messages=system + ASK)
    assert text_of(as_string) == text_of(as_blocks) == c.choices[0].message.content
    assert prompt_of(as_string.usage) == prompt_of(as_blocks.usage) == prompt_tokens(agent_server, system + ASK)
    assert prompt_of(as_string.usage) > prompt_tokens(agent_server, ASK)


def test_max_tokens_ends_the_reply_with_stop_reason_max_tokens(claude, model):
    m = claude.messages.create(model=model, max_tokens=3, messages=ASK)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_stop_sequences_end_the_reply_and_name_the_sequence_that_matched(claude, model):
    whole = text_of(claude.messages.create(model=model, max_tokens=24, messages=ASK))
    stop = next(whole[i:i + 2] for i in range(3, len(whole) - 2) if whole[i:i + 2].strip() == whole[i:i + 2])
    m = claude.messages.create(model=model, max_tokens=24, messages=ASK, stop_sequences=[stop])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert text_of(m) == whole[:whole.index(stop)]
    with claude.messages.stream(model=model, max_tokens=24, messages=ASK, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, text_of(final)) == ("stop_sequence", stop, text_of(m))
    # With several sequences, the one that matched is named.
    several = claude.messages.create(model=model, max_tokens=24, messages=ASK, stop_sequences=["\x00never", stop])
    assert (several.stop_reason, several.stop_sequence, text_of(several)) == ("stop_sequence", stop, text_of(m))


def test_a_streamed_message_is_the_unstreamed_one_in_anthropics_event_order(claude, model):
    whole = claude.messages.create(model=model, max_tokens=16, messages=ASK)
    kinds, text = [], ""
    with claude.messages.stream(model=model, max_tokens=16, messages=ASK) as stream:
        for event in stream:
            if event.type in RAW_EVENTS:
                kinds.append(event.type)
            if event.type == "text":
                text += event.text
        final = stream.get_final_message()
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * (len(kinds) - 5),
                     "content_block_stop", "message_delta", "message_stop"]
    assert text == text_of(final) == text_of(whole)
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert prompt_of(final.usage) == prompt_of(whole.usage)
    # text_stream is the same text.
    with claude.messages.stream(model=model, max_tokens=16, messages=ASK) as stream:
        assert "".join(stream.text_stream) == text_of(whole)


# ---------------------------------------------------------------- tools


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "send_alert"}])
def test_forced_tool_use_gives_tool_use_blocks_whose_input_validates(claude, model, tool_choice):
    m = claude.messages.create(model=model, max_tokens=120, messages=ASK, tools=TOOLS, tool_choice=tool_choice)
    uses = assert_valid_tool_uses(m)
    if tool_choice["type"] == "tool":
        assert [u.name for u in uses] == ["send_alert"]
    assert all(b.type == "tool_use" for b in m.content)


@pytest.mark.parametrize("tool_choice", [{"type": "any", "disable_parallel_tool_use": True},
                                         {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use_streams_input_json_that_validates(claude, model, tool_choice):
    kw = dict(model=model, max_tokens=120, messages=ASK, tools=TOOLS, tool_choice=tool_choice)
    whole = claude.messages.create(**kw)
    fragments: dict[int, list[str]] = {}
    with claude.messages.stream(**kw) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                fragments.setdefault(event.index, []).append(event.delta.partial_json)
        final = stream.get_final_message()
    uses = assert_valid_tool_uses(final)
    assert [(u.name, u.input) for u in uses] == [(u.name, u.input) for u in assert_valid_tool_uses(whole)]
    # Each block's input came as JSON fragments (as the grammar let the model write it), which join into it.
    assert sorted(fragments) == [i for i, b in enumerate(final.content) if b.type == "tool_use"]
    assert all(len(f) > 1 for f in fragments.values())
    assert [json.loads("".join(fragments[i])) for i in sorted(fragments)] == [u.input for u in uses]
    if tool_choice.get("disable_parallel_tool_use"):
        assert len(uses) == 1


def test_tool_choice_none_declares_the_tools_but_never_calls(agent_server, claude, chat, model):
    m = claude.messages.create(model=model, max_tokens=10, messages=ASK, tools=TOOLS, tool_choice={"type": "none"})
    c = chat.chat.completions.create(model=model, max_tokens=10, messages=ASK, tools=CHAT_TOOLS, tool_choice="none")
    assert not [b for b in m.content if b.type == "tool_use"] and m.stop_reason != "tool_use"
    assert text_of(m) == c.choices[0].message.content
    assert prompt_of(m.usage) == prompt_tokens(agent_server, ASK, CHAT_TOOLS) > prompt_tokens(agent_server, ASK)


def round_trip(server, is_error: bool):
    """A forced call, its result (an error result when `is_error`), and a reply: the three Messages requests'
    answers, and the chat conversation the last one is."""
    claude = anthropic_client(server)
    model = server.state.config.model_name
    called = claude.messages.create(model=model, max_tokens=120, messages=ASK, tools=TOOLS,
                                    tool_choice={"type": "tool", "name": "get_weather"})
    use = assert_valid_tool_uses(called)[0]
    conversation = ASK + [called.to_param(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "sunny, 21 degrees"}],
         "is_error": is_error},
        {"type": "text", "text": "Thanks. Anything else?"}]}]
    answer = claude.messages.create(model=model, max_tokens=10, messages=conversation, tools=TOOLS)
    result = json.dumps({"error": "sunny, 21 degrees"}) if is_error else "sunny, 21 degrees"
    as_chat = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": result},
        {"role": "user", "content": "Thanks. Anything else?"}]
    return answer, as_chat


@pytest.mark.parametrize("server_name", ["agent_server", "gemma4_server"])
@pytest.mark.parametrize("is_error", [False, True])
def test_a_tool_use_and_its_tool_result_round_trip_to_a_reply(request, server_name, is_error):
    server = request.getfixturevalue(server_name)
    answer, as_chat = round_trip(server, is_error)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # The result went where chat puts a tool message: after the call, before the turn's text (and, for
    # Google's template, folded into the model turn that called: chat_template.fold_tool_results).
    assert prompt_of(answer.usage) == prompt_tokens(server, as_chat, CHAT_TOOLS)


# ---------------------------------------------------------------- thinking


def test_thinking_enabled_reaches_the_chat_template(agent_server, claude, model):
    off = claude.messages.create(model=model, max_tokens=4, messages=ASK, thinking={"type": "disabled"})
    on = claude.messages.create(model=model, max_tokens=4, messages=ASK,
                                thinking={"type": "enabled", "budget_tokens": 1024})
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    assert prompt_of(on.usage) == prompt_tokens(agent_server, ASK, **thinking) > prompt_of(off.usage)
    assert prompt_of(off.usage) == prompt_tokens(agent_server, ASK)


# A grammar forces the thought channel (random weights would not open it on their own), as test_agents.py does
# for chat: what is tested is the channel read into a thinking block, not the model's wish to think.
THOUGHT = 'start: <|channel> "thought\\nI think" <channel|> "Done."'


def test_a_thought_reaches_a_thinking_block_in_the_message_and_the_stream(claude, model, monkeypatch):
    translate = messages.to_chat

    def with_grammar(request: MessagesRequest) -> Translation:
        t = translate(request)
        return Translation(t.chat.model_copy(update={"structured_outputs": StructuredOutputs(grammar=THOUGHT)}),
                           t.names)

    monkeypatch.setattr(messages, "to_chat", with_grammar)
    kw = dict(model=model, max_tokens=30, messages=ASK, thinking={"type": "enabled", "budget_tokens": 2048})
    m = claude.messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", "I think"), ("text", "Done.")]
    deltas = []
    with claude.messages.stream(**kw) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                deltas.append(event.delta.type)
        final = stream.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in final.content] == [b.model_dump(exclude_none=True)
                                                                         for b in m.content]
    assert deltas.index("thinking_delta") < deltas.index("text_delta")


def test_thinking_blocks_of_an_assistant_turn_become_its_reasoning_content():
    t = to_chat(MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": ASK + [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Paris needs a lookup.", "signature": ""},
            {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"}]}]}))
    assistant = t.chat.messages[1]
    assert assistant.reasoning_content == "Paris needs a lookup." and assistant.content is None
    assert json.loads(assistant.tool_calls[0].function.arguments) == {"city": "Paris"}
    # A turn of tool results alone is the tool messages, with no empty user message after them.
    assert [m.role for m in t.chat.messages] == ["user", "assistant", "tool"]
    assert t.names.field("messages[1].reasoning_content") == "messages[1].content[0].thinking"
    assert t.names.field("messages[2].tool_call_id") == "messages[2].content[0].tool_use_id"


# ---------------------------------------------------------------- usage and the prefix cache


def test_cache_read_input_tokens_are_the_prompt_tokens_the_prefix_cache_held(claude, model):
    system = f"You are agent {uuid.uuid4().hex}."  # a prompt no earlier request shares
    first = claude.messages.create(model=model, max_tokens=2, system=system, messages=ASK)
    second = claude.messages.create(model=model, max_tokens=2, system=system, messages=ASK)
    assert second.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens
    assert prompt_of(second.usage) == prompt_of(first.usage)
    with claude.messages.stream(model=model, max_tokens=2, system=system, messages=ASK) as stream:
        final = stream.get_final_message()
    # The stream's message_delta carries the totals known at the end, which replace message_start's.
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (
        second.usage.input_tokens, second.usage.cache_read_input_tokens)


# ---------------------------------------------------------------- refusals

CALL = {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}
BAD = [
    ("max_tokens", {"max_tokens": None}),
    ("messages[0].content[0].type", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}),
    ("messages[2].content[0].tool_use_id", {"messages": ASK + [
        {"role": "assistant", "content": [CALL]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_9", "content": "sunny"}]}]}),
    ("tool_choice.name", {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}),
    ("tool_choice", {"tool_choice": {"type": "any"}}),
    ("tools[0].type", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
    ("tools[1].name", {"tools": [TOOLS[0], {**TOOLS[1], "name": "get_weather"}]}),
    # llguidance cannot enforce the format: chat's own 400, renamed to the Anthropic field.
    ("tools[0].input_schema.properties.when.format", {"tool_choice": {"type": "any"}, "tools": [
        {"name": "f", "input_schema": {"type": "object", "properties": {"when": {"format": "uri"}}}}]}),
    ("messages[1].role", {"messages": ASK + [{"role": "assistant", "content": "The weather is"}]}),
    ("messages[1].content[0].type", {"messages": ASK + [
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "xyz"}]}, *ASK]}),
    ("messages[0].role", {"messages": [{"role": "system", "content": "x"}, *ASK]}),
    ("thinking.budget_tokens", {"thinking": {"type": "enabled", "budget_tokens": 10}}),
    ("temperature", {"temperature": 1.5}),
    ("stop_sequences[0]", {"stop_sequences": [""]}),
]


@pytest.mark.parametrize("param,body", BAD, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD)])
def test_what_cannot_be_served_is_a_400_naming_the_anthropic_field(claude, model, param, body):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.post("/v1/messages", cast_to=anthropic.types.Message,
                    body={"model": model, "max_tokens": 4, "messages": ASK, **body})
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error"  # Anthropic's shape, around the server's one error object
    error = e.value.body["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] == 400, error


def test_an_unknown_model_is_a_404_not_found_error(claude):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-nope", max_tokens=4, messages=ASK)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "not_found_error" and e.value.body["error"]["param"] == "model"


def test_a_refusal_of_the_scheduler_keeps_its_status_and_retry_after():
    """The route class answers every error of the route in Anthropic's shape, headers included (a full
    queue's 429 and its Retry-After, errors.from_scheduler)."""
    app = FastAPI()

    async def full(body: MessagesRequest):
        raise QueueFull(8)

    app.router.add_api_route("/v1/messages", full, methods=["POST"], route_class_override=AnthropicRoute)
    r = TestClient(app).post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": ASK})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json() == {"type": "error", "error": {"message": str(QueueFull(8)), "type": "rate_limit_error",
                                                   "param": None, "code": 429}}


# ---------------------------------------------------------------- the stream's end


def test_a_stream_the_client_leaves_is_aborted_like_chats(agent_server, model):
    state = agent_server.state
    aborts = sample(agent_server, "gemma_request_success_total", finished_reason="abort")
    with httpx.stream("POST", agent_server.base + "/v1/messages", timeout=60, json={
            "model": model, "max_tokens": 1000, "messages": ASK, "stream": True}) as r:
        assert next(r.iter_bytes()).startswith(b"event: message_start\n")
    wait_for(lambda: sample(agent_server, "gemma_request_success_total", finished_reason="abort") == aborts + 1,
             30, "the abort counted")
    wait_for(lambda: not state.scheduler.busy(), 30, "engine idle")


class FakeJob:
    ended = None


class FakeGeneration:
    """What MessagesFormat reads of a choice: its prompt, its calls and ending (the stream fails here first)."""

    class params:
        prompt_ids = (1, 2, 3)

    job = FakeJob()
    calls = []


def test_an_error_after_the_stream_opened_is_its_last_event():
    async def pieces():
        yield 0, Piece("Hel")
        raise ApiError(503, "The shutdown timeout cut the request.")

    async def receive():  # a client that stays
        await asyncio.Event().wait()

    async def read() -> bytes:
        body = await stream(pieces(), MessagesFormat("m", FakeGeneration()), receive)
        return b"".join([chunk async for chunk in body])

    events = asyncio.run(read()).decode().split("\n\n")[:-1]
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert names == ["message_start", "content_block_start", "content_block_delta", "error"]
    error = json.loads(events[-1].split("\n", 1)[1].removeprefix("data: "))
    assert error == {"type": "error", "error": {"message": "The shutdown timeout cut the request.",
                                                "type": "unavailable_error", "param": None, "code": 503}}


def test_streamed_blocks_open_and_close_in_order_and_calls_stream_their_input():
    blocks = Blocks()
    out = blocks.piece(Piece("", reasoning="hm")) + blocks.piece(Piece("  ")) + blocks.piece(Piece(
        "", calls=[CallStart(0, "call_1", "f"), CallArguments(0, '{"a":'), CallArguments(0, "1}")])) + blocks.close()
    events = [json.loads(e.split("\ndata: ")[1]) for e in out.decode().split("\n\n")[:-1]]
    assert [(e["type"], e.get("index")) for e in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1), ("content_block_stop", 1)]
    # The whitespace before a call is left out, as the unstreamed message leaves it out.
    assert events[3]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}
    assert "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "input_json_delta") == '{"a":1}'


# ---------------------------------------------------------------- pure pieces


@pytest.mark.parametrize("text,value", [
    ('{"a":1,"b":"x"}', {"a": 1, "b": "x"}),
    ('{"a":1,"b":"xy', {"a": 1}),
    ('{"a":1,"b', {"a": 1}),
    ('{"a":{"c":[true,', {"a": {"c": [True]}}),
    ('{"a":"x\\"', {}),
    ('{"u":"celsius","d":{', {"u": "celsius", "d": {}}),
    ("", {}),
])
def test_a_cut_calls_input_is_read_as_far_as_its_values_are_complete(text, value):
    assert partial_object(text) == value


@pytest.mark.parametrize("loc,param", [
    (("body", "messages", 1, "assistant", "content", "list[tagged-union[A,B]]", 0, "thinking", "thinking"),
     "messages[1].content[0].thinking"),
    (("body", "messages", 1, "assistant", "content", "list[tagged-union[A,B]]", 0, "thinking", "signature"),
     "messages[1].content[0].signature"),
    (("body", "system", "list[TextBlockParam]", 0, "text"), "system[0].text"),
    (("body", "thinking", "enabled", "budget_tokens"), "thinking.budget_tokens"),
])
def test_a_validation_errors_location_names_the_body_field_past_the_union_tags(loc, param):
    body = {"messages": [ASK[0], {"role": "assistant", "content": [{"type": "thinking", "thinking": 5}]}],
            "system": [{"type": "text", "text": 5}], "thinking": {"type": "enabled", "budget_tokens": 1}}
    assert param_from_loc(loc, body) == param


def test_the_document_states_the_routes_bounds_and_statuses(agent_server):
    doc = httpx.get(agent_server.base + "/openapi.json").json()
    operation = doc["paths"]["/v1/messages"]["post"]
    assert set(operation["responses"]) == {"200", "400", "404", "413", "429", "500", "503"}
    assert set(operation["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    schemas = doc["components"]["schemas"]
    request = schemas["MessagesRequest"]
    assert request["required"] == ["model", "messages", "max_tokens"]
    assert list(request["properties"]) == ["model", "messages", "max_tokens", "metadata", "stop_sequences", "stream",
                                           "system", "temperature", "thinking", "tool_choice", "tools", "top_k",
                                           "top_p"]
    p = request["properties"]
    assert (p["messages"]["minItems"], p["max_tokens"]["minimum"]) == (1, 1)
    assert p["messages"]["items"]["discriminator"]["propertyName"] == "role"
    assert p["temperature"]["anyOf"][0]["maximum"] == 1
    user = schemas["UserMessageParam"]["properties"]["content"]["anyOf"][1]["items"]
    assert set(user["discriminator"]["mapping"]) == {"text", "tool_result"}
    assert schemas["ToolUseBlockParam"]["required"] == ["id", "input", "name", "type"]




def test_with_an_api_key_the_sdks_x_api_key_or_a_bearer_token_is_let_in(agent_checkpoint):
    """Anthropic's SDK sends `api_key` as X-Api-Key and `auth_token` as a bearer token: either carries the
    server's --api-key on /v1/messages, and a wrong or missing one is a 401 (X-Api-Key opens no other route)."""
    server = start_in_process(agent_checkpoint, "--api-key", "right-key")
    try:
        name = server.state.config.model_name
        for client in (anthropic.Anthropic(base_url=server.base, api_key="right-key", max_retries=0),
                       anthropic.Anthropic(base_url=server.base, auth_token="right-key", max_retries=0)):
            reply = client.messages.create(model=name, max_tokens=2, messages=ASK)
            assert reply.type == "message"
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0).messages.create(
                model=name, max_tokens=2, messages=ASK)
        r = httpx.post(server.base + "/v1/chat/completions", headers={"x-api-key": "right-key"},
                       json={"messages": ASK, "max_tokens": 2})
        assert r.status_code == 401
    finally:
        server.stop()
