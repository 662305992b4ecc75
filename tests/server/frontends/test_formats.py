"""Each API's format (`serving.Format`) fed pieces by hand, without asyncio or a server: the bytes it gives
for a stream's opening, pieces, ends and errors, and for a whole reply. The servers' tests (tests/server/
test_api.py, test_responses.py, test_messages.py, test_media.py) check the same shapes with the SDKs."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import pytest

from gemma_server import sse
from gemma_server.errors import ApiError
from gemma_server.frontends.chat import ChatFormat, CompletionFormat
from gemma_server.frontends.messages_format import MessagesFormat
from gemma_server.frontends.responses import ResponsesRequest
from gemma_server.frontends.responses_format import ResponsesFormat
from gemma_server.frontends.transcriptions import Clip, TranscriptFormat
from gemma_server.protocol.replies import Timings
from gemma_server.serving import Output, Piece, stream
from gemma_server.toolcalls import CallArguments, CallStart, ToolCall

TOKENS = {1: "He", 2: "llo", 3: " world", 7: "The", 8: " sea"}


@dataclass
class FakeChoice:
    """Fake: what a format reads of a `serving.Generation` that has ended (a real one needs an engine job)."""

    index: int = 0
    finish_reason: str | None = "stop"
    calls: list[ToolCall] = field(default_factory=list)
    completion_tokens: int = 3
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    matched_stop: str | None = None

    class params:
        prompt_ids = (7, 8)

    class job:
        ended = None

    def timings(self) -> Timings:
        return Timings(prompt_read_seconds=0.0, decode_seconds=0.0)


def events(data: bytes) -> list[tuple[str | None, object]]:
    """The (name, data) of each server-sent event in `data` ([DONE] as the string)."""
    assert data.endswith(b"\n\n"), data
    out = []
    for block in data[:-2].decode().split("\n\n"):
        name = None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            else:
                payload = line.removeprefix("data: ")
                out.append((name, payload if payload == "[DONE]" else json.loads(payload)))
    return out


def test_chat_streams_roles_deltas_calls_finish_usage_and_done():
    gens = [FakeChoice(0), FakeChoice(1, finish_reason="tool_calls", calls=[ToolCall("call_1", "f", '{"a":1}')])]
    fmt = ChatFormat(gens, "m", "fp", TOKENS.get, include_usage=True)
    opened = [e for _, e in events(fmt.open())]
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"], c["usage"]) for c in opened] == [
        (0, {"role": "assistant", "content": ""}, None), (1, {"role": "assistant", "content": ""}, None)]
    assert fmt.piece(0, Piece("")) == b""  # an empty piece is no event
    text = events(fmt.piece(0, Piece("Hello", logprobs=[(1, -0.5, [(1, -0.5), (2, -1.5)])], reasoning="hm")))
    choice = text[0][1]["choices"][0]
    assert choice["delta"] == {"reasoning_content": "hm", "content": "Hello"}
    assert choice["logprobs"]["content"][0]["top_logprobs"][1] == {"token": "llo", "logprob": -1.5,
                                                                    "bytes": list(b"llo")}
    calls = events(fmt.piece(1, Piece("", calls=[CallStart(0, "call_1", "f"), CallArguments(0, '{"a":1}')])))
    assert [c["choices"][0]["delta"] for _, c in calls] == [
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":1}'}}]}]
    assert events(fmt.finish(1))[0][1]["choices"][0]["finish_reason"] == "tool_calls"
    last, done = events(fmt.close())
    assert last[1]["choices"] == [] and last[1]["usage"]["completion_tokens"] == 6 and done[1] == "[DONE]"
    assert {c["id"] for c in opened + [e for _, e in text + calls]} == {fmt.id} and fmt.id.startswith("chatcmpl-")


def test_an_error_is_the_streams_last_event_then_done():
    for fmt in (ChatFormat([FakeChoice()], "m", "fp", TOKENS.get),
                CompletionFormat([FakeChoice()], "m", "fp", TOKENS.get)):
        error, done = events(fmt.error(ApiError(503, "The shutdown timeout cut the request.")))
        assert error[1] == {"error": {"message": "The shutdown timeout cut the request.", "type": "unavailable_error",
                                      "param": None, "code": 503}}
        assert done[1] == "[DONE]"


def test_a_whole_chat_reply_holds_its_message_calls_and_logprobs():
    gens = [FakeChoice(finish_reason="tool_calls", calls=[ToolCall("call_1", "f", "{}")])]
    fmt = ChatFormat(gens, "m", "fp", TOKENS.get)
    reply = json.loads(fmt.whole([Output(text=" ", logprobs=[(3, -0.25, [])])]))
    message = reply["choices"][0]["message"]
    assert message["content"] is None and "reasoning_content" not in message  # only called; no thought
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert reply["choices"][0]["logprobs"]["content"][0]["token"] == " world"
    assert reply["object"] == "chat.completion" and fmt.media_type == "application/json"


def test_a_completion_echoes_its_prompt_with_the_first_piece_and_counts_text_offsets():
    fmt = CompletionFormat([FakeChoice()], "m", "fp", TOKENS.get, echo=("The sea", (7, 8)))
    assert fmt.open() == b""
    first = events(fmt.piece(0, Piece("", prompt_logprobs=[(-2.0, [(8, -2.0)])])))[0][1]["choices"][0]
    assert first["text"] == "The sea"
    assert first["logprobs"]["token_logprobs"] == [None, -2.0] and first["logprobs"]["text_offset"] == [0, 3]
    second = events(fmt.piece(0, Piece("Hello", logprobs=[(1, -0.5, [(1, -0.5)])])))[0][1]["choices"][0]
    assert second["logprobs"]["text_offset"] == [7] and second["logprobs"]["top_logprobs"] == [{"He": -0.5}]
    assert fmt.piece(0, Piece("")) == b""
    assert json.loads(CompletionFormat([FakeChoice()], "m", "fp", TOKENS.get, echo=("The sea", (7, 8))).whole(
        [Output(text="!")]))["choices"][0]["text"] == "The sea!"


def test_responses_events_are_numbered_and_the_final_response_is_handed_over_once():
    done = []
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi"})
    fmt = ResponsesFormat(body, "m", FakeChoice(), TOKENS.get, done.append)
    out = events(fmt.open() + fmt.piece(0, Piece("Hi", reasoning="hm")) + fmt.finish(0) + fmt.close())
    assert [e["sequence_number"] for _, e in out] == list(range(len(out)))
    assert all(name == e["type"] for name, e in out)
    assert [name for name, _ in out][:2] == ["response.created", "response.in_progress"]
    assert out[-1][0] == "response.completed" and done == [out[-1][1]["response"]]
    assert [item["type"] for item in done[0]["output"]] == ["reasoning", "message"]
    whole_done = []
    whole = json.loads(ResponsesFormat(body, "m", FakeChoice(), TOKENS.get, whole_done.append).whole(
        [Output(text="Hi")]))
    assert whole_done == [whole] and whole["output"][0]["content"][0]["text"] == "Hi"
    error = events(fmt.error(ApiError(500, "boom")))
    assert error[0][0] == "error" and error[0][1]["error"]["code"] == 500


def test_messages_open_with_message_start_and_end_with_delta_and_stop():
    fmt = MessagesFormat("m", FakeChoice(finish_reason="length"))
    out = events(fmt.open() + fmt.piece(0, Piece("Hi")) + fmt.finish(0) + fmt.close())
    assert [name for name, _ in out] == ["message_start", "content_block_start", "content_block_delta",
                                         "content_block_stop", "message_delta", "message_stop"]
    assert out[4][1]["delta"]["stop_reason"] == "max_tokens"
    whole = json.loads(fmt.whole([Output(text="Hi")]))
    assert whole["content"] == [{"type": "text", "text": "Hi"}] and whole["stop_reason"] == "max_tokens"


def clips(*texts: str) -> list[Clip]:
    return [Clip(i, float(i), float(i + 1), None, text=t, output_tokens=1) for i, t in enumerate(texts)]


def test_a_transcript_joins_its_clips_with_a_space_and_ends_with_done():
    given = clips("Hello there.", "", "Bye.")
    fmt = TranscriptFormat(given, "json", "english", 3.0, 0.0)
    out = events(fmt.piece(0, Piece("Hello")) + fmt.piece(0, Piece(" there.")) + fmt.finish(0)
                 + fmt.piece(2, Piece("Bye.")) + fmt.close())
    assert [e["delta"] for _, e in out[:3]] == ["Hello", " there.", " Bye."]
    assert out[3][1]["type"] == "transcript.text.done" and out[3][1]["text"] == "Hello there. Bye."
    assert out[4][1] == "[DONE]"
    assert json.loads(fmt.whole([]))["text"] == "Hello there. Bye."
    text = TranscriptFormat(given, "text", "english", 3.0, 0.0)
    assert text.whole([]) == b"Hello there. Bye." and text.media_type == "text/plain"
    verbose = json.loads(TranscriptFormat(given, "verbose_json", "english", 3.0, 0.0).whole([]))
    assert [s["text"] for s in verbose["segments"]] == ["Hello there.", "", "Bye."] and verbose["duration"] == 3.0


async def _stream(items, fmt) -> bytes:
    async def receive():  # a client that stays
        await asyncio.Event().wait()

    body = await stream(items, fmt, receive)
    return b"".join([chunk async for chunk in body])


def test_stream_sends_what_is_ready_and_turns_a_late_error_into_the_last_event():
    async def failing():
        yield 0, Piece("He")
        raise ApiError(503, "cut")

    fmt = ChatFormat([FakeChoice()], "m", "fp", TOKENS.get)
    out = events(asyncio.run(_stream(failing(), fmt)))
    assert [e if isinstance(e, str) else (e.get("error") or e["choices"][0]["delta"]) for _, e in out] == [
        {"role": "assistant", "content": ""}, {"content": "He"},
        {"message": "cut", "type": "unavailable_error", "param": None, "code": 503}, "[DONE]"]


def test_stream_raises_an_error_that_comes_before_any_piece():
    async def refused():
        raise ApiError(400, "no")
        yield  # an async generator

    with pytest.raises(ApiError):
        asyncio.run(_stream(refused(), ChatFormat([FakeChoice()], "m", "fp", TOKENS.get)))


def test_sse_event_framing():
    assert sse.event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert sse.event({"type": "x"}, "x") == b'event: x\ndata: {"type":"x"}\n\n'
    with pytest.raises(ValueError):
        sse.dumps(float("nan"))
