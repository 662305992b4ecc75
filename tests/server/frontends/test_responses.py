"""/v1/responses, judged by the openai SDK's `responses.create`, `responses.stream` and `responses.parse`,
and by the OpenAI Agents SDK running its default model (`OpenAIResponsesModel`).

The server is the real app on the real engine with Google's own Gemma 4 template (`gemma4_server`: random
weights, so every valid call or JSON here is the grammar's doing; schemas are enums, bounded integers and
short strings so that replies end). Where a request's meaning is in its prompt (a function_call_output turn,
a previous response's conversation, thinking), the test holds the response's `usage.input_tokens` equal to
/tokenize of the same conversation written as chat messages.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from gemma_server.errors import ApiError
from gemma_server.frontends.responses import ResponsesRequest, to_chat
from tests.server.conftest import openai_client, prompt_tokens, sample, start_in_process, wait_for

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 6},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
ALERT = {"type": "object", "additionalProperties": False, "required": ["urgent"],
         "properties": {"urgent": {"type": "boolean"}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather of a city.", "parameters": WEATHER,
          "strict": True},
         {"type": "function", "name": "send_alert", "description": "Alert someone.", "parameters": ALERT,
          "strict": True}]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]


@pytest.fixture(scope="module")
def client(gemma4_server) -> openai.OpenAI:
    return openai_client(gemma4_server)


@pytest.fixture(scope="module")
def model(gemma4_server) -> str:
    return gemma4_server.state.config.model_name


def calls_of(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


def assert_valid_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


# ---------------------------------------------------------------- create and stream


def test_a_string_input_gets_a_message_with_output_text_and_usage(gemma4_server, client, model):
    r = client.responses.create(model=model, input="Hello there", instructions="Be brief.", max_output_tokens=12)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    message = [item for item in r.output if item.type == "message"]
    assert len(message) == 1 and message[0].role == "assistant" and r.output_text == message[0].content[0].text
    expected = prompt_tokens(gemma4_server, [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hello there"}])
    assert r.usage.input_tokens == expected
    assert 1 <= r.usage.output_tokens <= 12 and r.usage.total_tokens == expected + r.usage.output_tokens
    assert r.instructions == "Be brief."


def test_max_output_tokens_makes_the_response_incomplete_in_both_ways(client, model):
    r = client.responses.create(model=model, input="Tell me a long story", max_output_tokens=1)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 1
    with client.responses.stream(model=model, input="Tell me a long story", max_output_tokens=1) as stream:
        events = list(stream)
    # OpenAI ends such a stream with response.incomplete, not response.completed (so the helper's
    # get_final_response, which waits for the latter, has none): the event carries the response.
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.status == "incomplete" and events[-1].response.usage.output_tokens == 1


def test_the_stream_helper_sees_the_sdks_event_sequence_and_the_same_text(client, model):
    kw = dict(model=model, input="Hi", max_output_tokens=64)  # greedy, this checkpoint ends it in 6 tokens
    whole = client.responses.create(**kw)
    assert whole.status == "completed"
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text  # greedy: the same reply both ways
    assert final.id == events[0].response.id


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "send_alert"}])
def test_forced_function_calls_are_valid_for_their_schemas_streamed_or_not(client, model, tool_choice):
    kw = dict(model=model, input="Weather in Paris, and alert me", tools=TOOLS, tool_choice=tool_choice,
              max_output_tokens=80)
    whole = client.responses.create(**kw)
    assert_valid_calls(calls_of(whole))
    if isinstance(tool_choice, dict):
        assert [c.name for c in calls_of(whole)] == ["send_alert"]
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [(c.name, c.arguments) for c in calls_of(final)] == [(c.name, c.arguments) for c in calls_of(whole)]
    for call in calls_of(final):
        deltas = [e for e in events if e.type == "response.function_call_arguments.delta" and e.item_id == call.id]
        assert "".join(e.delta for e in deltas) == call.arguments
        assert call.parsed_arguments == json.loads(call.arguments)  # the SDK parsed the strict tool's arguments


class Forecast(BaseModel):
    sky: Literal["clear", "cloudy", "rain"]
    high: Annotated[int, Field(ge=-30, le=45)]


def test_structured_output_through_text_format_and_the_parse_helper(client, model):
    r = client.responses.parse(model=model, input="Forecast for Paris", text_format=Forecast, max_output_tokens=40)
    assert isinstance(r.output_parsed, Forecast)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.responses.create(model=model, input="Is it ok?", max_output_tokens=20, text={"format": {
        "type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    r = client.responses.create(model=model, input="Any JSON", max_output_tokens=6,
                                text={"format": {"type": "json_object"}})
    assert r.output_text.startswith("{")


# ---------------------------------------------------------------- conversations


def test_a_function_call_output_turn_is_rendered_as_chats_tool_round_trip(gemma4_server, client, model):
    """The item list an agent sends after running a tool: the prompt is chat's for the same conversation,
    which Gemma 4's template renders with the result inside the model turn."""
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": json.dumps({"city": "Paris", "days": 1})},
             {"type": "function_call_output", "call_id": "call_1", "output": json.dumps({"temp": 4})}]
    r = client.responses.create(model=model, input=items, tools=TOOLS, max_output_tokens=8, tool_choice="none")
    chat = [items[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": items[1]["arguments"]}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": items[2]["output"]}]
    assert r.usage.input_tokens == prompt_tokens(gemma4_server, chat, CHAT_TOOLS)


def test_reasoning_effort_turns_thinking_on(gemma4_server, client, model):
    r = client.responses.create(model=model, input="Think first", reasoning={"effort": "high"}, max_output_tokens=4)
    user = [{"role": "user", "content": "Think first"}]
    assert r.usage.input_tokens == prompt_tokens(gemma4_server, user, chat_template_kwargs={"enable_thinking": True})
    assert r.usage.input_tokens != prompt_tokens(gemma4_server, user)


# A grammar forces the thought channel (random weights would not open it on their own), as test_agents.py does
# for chat: what is tested is the channel read into a reasoning item, not the model's wish to think.
THOUGHT = 'start: <|channel> "thought\\nI think" <channel|> "Done."'


def test_a_thought_becomes_a_reasoning_item_before_the_message_streamed_or_not(client, model, monkeypatch):
    from gemma_server.frontends import responses
    from gemma_server.protocol.content import StructuredOutputs

    translate = responses.to_chat

    def with_grammar(body, earlier=None):
        chat = translate(body, earlier)
        chat.request = chat.request.model_copy(update={"structured_outputs": StructuredOutputs(grammar=THOUGHT)})
        return chat

    monkeypatch.setattr(responses, "to_chat", with_grammar)
    kw = dict(model=model, input="Think first", reasoning={"effort": "high"}, max_output_tokens=30)
    r = client.responses.create(**kw)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "I think" and r.output_text == "Done."
    assert r.usage.output_tokens_details.reasoning_tokens >= 1
    with client.responses.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content == r.output[0].content and final.output_text == r.output_text


def test_previous_response_id_continues_the_stored_conversation(gemma4_server, client, model):
    first = client.responses.create(model=model, input="Weather in Paris?", instructions="Be brief.", tools=TOOLS,
                                    tool_choice="required", max_output_tokens=80)
    call = calls_of(first)[0]
    second = client.responses.create(model=model, previous_response_id=first.id, tools=TOOLS, tool_choice="none",
                                     max_output_tokens=8, input=[{"type": "function_call_output",
                                                                  "call_id": call.call_id, "output": "sunny"}])
    assert second.previous_response_id == first.id
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                for call in calls_of(first)]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    # Instructions are not carried over (OpenAI's rule): the second prompt has no system turn but the tools'.
    assert second.usage.input_tokens == prompt_tokens(gemma4_server, chat, CHAT_TOOLS)
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_a_stored_response_is_read_and_deleted_only_with_the_key_that_made_it(gemma4_server, client, model):
    r = client.responses.create(model=model, input="Remember me", max_output_tokens=4)
    other = openai.OpenAI(base_url=gemma4_server.base + "/v1", api_key="someone-else", max_retries=0)
    with pytest.raises(openai.NotFoundError) as seen:
        other.responses.retrieve(r.id)
    assert seen.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as seen:
        other.responses.create(model=model, input="and?", previous_response_id=r.id, max_output_tokens=4)
    assert seen.value.body["param"] == "previous_response_id"
    assert client.responses.retrieve(r.id).id == r.id
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model=model, input="Forget me", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_with_an_api_key_every_responses_route_needs_it(gemma4_checkpoint):
    server = start_in_process(gemma4_checkpoint, "--api-key", "right-key")
    try:
        for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"),
                             ("DELETE", "/v1/responses/resp_1")):
            r = httpx.request(method, server.base + path, json={"input": "hi"} if method == "POST" else None)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (method, path, r.text)
        keyed = openai.OpenAI(base_url=server.base + "/v1", api_key="right-key", max_retries=0)
        made = keyed.responses.create(model=server.state.config.model_name, input="hi", max_output_tokens=2)
        assert keyed.responses.retrieve(made.id).id == made.id
    finally:
        server.stop()


def test_a_flooding_key_through_the_server_evicts_only_its_own(gemma4_checkpoint):
    """The attack through the real server and the openai SDK: with room for 6 responses, one bearer token's 10
    stores leave another token's 2 readable; the flooder's own oldest went."""
    server = start_in_process(gemma4_checkpoint, "--responses-store-max-count", "6",
                              "--responses-store-max-count-per-key", "6")
    try:
        model = server.state.config.model_name
        victim = openai.OpenAI(base_url=server.base + "/v1", api_key="victim", max_retries=0)
        flooder = openai.OpenAI(base_url=server.base + "/v1", api_key="flooder", max_retries=0)
        kept = [victim.responses.create(model=model, input="keep me", max_output_tokens=1).id for _ in range(2)]
        flood = [flooder.responses.create(model=model, input="flood", max_output_tokens=1).id for _ in range(10)]
        assert [victim.responses.retrieve(i).id for i in kept] == kept
        for gone in flood[:6]:
            with pytest.raises(openai.NotFoundError):
                flooder.responses.retrieve(gone)
        assert [flooder.responses.retrieve(i).id for i in flood[6:]] == flood[6:]
    finally:
        server.stop()


# ---------------------------------------------------------------- errors and admission


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"type": "input_image", "image_url": "data:,"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                   "arguments": "[1]"}]}, "input[1].arguments"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].tool_call_id"),
    # An empty call_id (the document says minLength 1), on a call and on its output.
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "", "name": "f",
                                                   "arguments": "{}"}]}, "input[1].call_id"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                   "arguments": "{}"},
                {"type": "function_call_output", "call_id": "", "output": "1"}]}, "input[2].call_id"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": [], "max_output_tokens": 4}, "input"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format"),
])
def test_a_bad_request_is_a_400_naming_the_responses_field(gemma4_server, body, param):
    r = httpx.post(gemma4_server.base + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, r.text


def test_metadata_past_openais_bounds_is_a_400_naming_metadata(gemma4_server, client, model):
    """OpenAI's bounds (16 pairs, keys of 64 characters, values of 512), refused through the openai SDK's
    `responses.create(metadata=...)`; at the bounds, the metadata is echoed and stored; the document says so."""
    for metadata, says in (({f"k{i}": "v" for i in range(17)}, "at most 16 items"),
                           ({"k" * 65: "v"}, "metadata keys have at most 64 characters, got one of 65"),
                           ({"k": "v" * 513}, "metadata values have at most 512 characters, got 513 for 'k'")):
        with pytest.raises(openai.BadRequestError) as seen:
            client.responses.create(model=model, input="hi", max_output_tokens=1, metadata=metadata)
        assert seen.value.body["param"] == "metadata" and says in seen.value.body["message"], seen.value.body
    at_the_bounds = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    r = client.responses.create(model=model, input="hi", max_output_tokens=1, metadata=at_the_bounds)
    assert r.metadata == at_the_bounds and client.responses.retrieve(r.id).metadata == at_the_bounds
    document = httpx.get(gemma4_server.base + "/openapi.json", timeout=30).json()
    declared = document["components"]["schemas"]["ResponsesRequest"]["properties"]["metadata"]
    assert declared["maxProperties"] == 16 and declared["propertyNames"] == {"maxLength": 64}
    assert declared["additionalProperties"] == {"type": "string", "maxLength": 512}


def test_the_chat_checks_name_the_responses_fields():
    body = ResponsesRequest.model_validate({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "b", "output": "1"}]})
    chat = to_chat(body)
    cases = {"messages[3].tool_call_id": "input[3].tool_call_id", "messages[0].content": "instructions",
             "messages[2].tool_calls[1].function.arguments": "input[2].arguments",
             "max_tokens": "max_output_tokens", "response_format.json_schema.schema.x": "text.format.schema.x",
             "tools[1].function.parameters": "tools[1].parameters", "messages": "input", "temperature": "temperature"}
    for field, ours in cases.items():
        assert chat.names.error(ApiError(400, "m", field)).param == ours


def test_an_unknown_model_or_response_id_is_a_404_in_openais_shape(gemma4_server, client):
    with pytest.raises(openai.NotFoundError) as seen:
        client.responses.create(model="other", input="hi")
    assert seen.value.body["param"] == "model"
    r = httpx.get(gemma4_server.base + "/v1/responses/resp_missing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_a_stream_the_client_leaves_is_aborted_and_counted_like_chat(gemma4_server, model):
    aborts = sample(gemma4_server, "gemma_request_success_total", finished_reason="abort")
    with httpx.stream("POST", gemma4_server.base + "/v1/responses", timeout=30,
                      json={"model": model, "input": "Talk for a long time", "stream": True,
                            "max_output_tokens": 600}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: response.output_text.delta"):
                break
    wait_for(lambda: sample(gemma4_server, "gemma_request_success_total", finished_reason="abort") == aborts + 1,
             30, "the abort counted")


# ---------------------------------------------------------------- the OpenAI Agents SDK


def test_the_agents_sdk_runs_a_function_tool_with_its_default_responses_model(gemma4_server, model):
    import agents

    ran: list[tuple[str, int]] = []

    @agents.function_tool
    def get_weather(unit: Literal["celsius", "fahrenheit"], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather for the next days."""
        ran.append((unit, days))
        return f"sunny for {days} days, 20 {unit}"

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=gemma4_server.base + "/v1", api_key="unused", max_retries=0)
    provider = agents.OpenAIProvider(openai_client=client)  # its default: the Responses API
    assert isinstance(provider.get_model(model), agents.OpenAIResponsesModel)
    agent = agents.Agent(name="forecaster", instructions="Use the tool.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=40))
    result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?", max_turns=3,
                                           run_config=agents.RunConfig(model_provider=provider)))
    assert ran and ran[0][0] in ("celsius", "fahrenheit") and 1 <= ran[0][1] <= 7
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert outputs and outputs[0].output.startswith("sunny")
    assert isinstance(result.final_output, str)
