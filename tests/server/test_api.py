"""The OpenAI API of the server, driven by the real openai SDK and raw HTTP, over the real engine on the
tiny chat checkpoint (server running in-process, see conftest.py)."""

from __future__ import annotations

import dataclasses
import json
import socket

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gemma_server.protocol.requests import ChatCompletionRequest
from tests.checkpoints.chat import CHAT_PROMPT
from tests.server.conftest import CONTEXT, LONG_PROMPT, sample, wait_for


@pytest.fixture(scope="module")
def reference(direct_engine, tokenizer):
    """The engine's own greedy reply to CHAT_PROMPT (called directly) and its text."""
    ids = tokenizer.apply_chat_template(CHAT_PROMPT, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(ids, add_special_tokens=False)
    tokens, finish, _, _ = direct_engine.decode(ids, 200)
    return ids, tokens, finish, tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def long_prompt(tokenizer) -> list[int]:
    # The chat checkpoint's greedy reply to this prompt runs 284 tokens before an eos: long enough for a
    # client to leave mid-decode.
    return tokenizer.encode(LONG_PROMPT)


def test_chat_completion_through_the_sdk_is_the_engines_greedy_reply(client, model, reference):
    ids, tokens, finish, text = reference
    r = client.chat.completions.create(model=model, messages=CHAT_PROMPT, max_tokens=200)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == ("stop" if finish == "stop" else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(tokens))
    assert r.usage.total_tokens == len(ids) + len(tokens)
    assert r.system_fingerprint.startswith("gemma_engine-")
    timings = r.model_extra["timings"]
    assert timings["prompt_read_seconds"] > 0 and timings["decode_seconds"] > 0


def test_streamed_chat_with_usage_through_the_sdk(client, model, reference):
    ids, tokens, _, text = reference
    stream = client.chat.completions.create(model=model, messages=CHAT_PROMPT, max_tokens=200, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ids), len(tokens))
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completion_through_the_sdk_with_text_and_token_prompts(client, model, direct_engine, tokenizer):
    prompt = "The ocean covers"
    ids = tokenizer.encode(prompt)
    tokens, _, _, _ = direct_engine.decode(ids, 10)
    expected = tokenizer.decode(tokens, skip_special_tokens=True)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=10)
    assert r.object == "text_completion"
    assert r.choices[0].text == expected
    assert r.usage.prompt_tokens == len(ids)
    r2 = client.completions.create(model=model, prompt=ids, max_tokens=10)
    assert r2.choices[0].text == expected
    streamed = client.completions.create(model=model, prompt=ids, max_tokens=10, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_completions_default_to_16_tokens(client, model, direct_engine, tokenizer):
    ids = tokenizer.encode("Hello")
    tokens, finish, _, _ = direct_engine.decode(ids, 16)
    assert finish == "length"  # this prompt's reply is longer than 16 tokens, so the cap is what ends it
    r = client.completions.create(model=model, prompt=ids)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == len(tokens) == 16


def test_models_lists_the_served_name_with_max_model_len(client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].model_extra["max_model_len"] == CONTEXT


def test_max_completion_tokens_wins_over_max_tokens(client, model, reference):
    assert len(reference[1]) >= 5
    r = client.chat.completions.create(model=model, messages=CHAT_PROMPT, max_tokens=20, max_completion_tokens=3)
    assert r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "length"


def test_stop_string_split_across_tokens_cuts_the_reply(client, model, reference, tokenizer):
    _, tokens, _, text = reference
    # A stop string that starts inside one token's text and ends inside the next one's.
    for i in range(3, len(tokens) - 1):
        before = tokenizer.decode(tokens[:i], skip_special_tokens=True)
        a, b = (tokenizer.decode(tokens[i : i + k], skip_special_tokens=True) for k in (1, 2))
        if len(a) >= 2 and len(b) - len(a) >= 2:
            stop = a[1:] + b[len(a) : len(a) + 1]
            break
    else:
        pytest.fail("the reference reply has no two neighbouring multi-character tokens")
    expected = text[: text.find(stop)]
    assert len(expected) < len(text)
    r = client.chat.completions.create(model=model, messages=CHAT_PROMPT, max_tokens=200, stop=[stop])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=model, messages=CHAT_PROMPT, max_tokens=200, stop=stop,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    assert before  # the stop is not at the very start


def sse_events(body: bytes) -> list[bytes]:
    assert body.endswith(b"\n\n")
    return body[:-2].split(b"\n\n")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_sse_framing_byte_by_byte(server, model, path):
    payload = {"model": model, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    payload |= {"messages": CHAT_PROMPT} if "chat" in path else {"prompt": "The ocean"}
    with httpx.stream("POST", server.base + path, json=payload, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        body = r.read()
    events = sse_events(body)
    assert events[-1] == b"data: [DONE]"
    assert body.endswith(b"}\n\ndata: [DONE]\n\n")
    objects = []
    for e in events[:-1]:
        assert e.startswith(b"data: {") and b"\n" not in e and b"\r" not in e
        objects.append(json.loads(e[len(b"data: ") :]))
    kind = "chat.completion.chunk" if "chat" in path else "text_completion"
    assert {o["object"] for o in objects} == {kind}
    assert objects[-1]["choices"] == [] and objects[-1]["usage"]["completion_tokens"] <= 8
    assert [o["choices"][0]["finish_reason"] for o in objects[:-1]].count(None) == len(objects) - 2
    if "chat" in path:
        assert objects[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


BAD = [
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 100}, "n"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"seed": "7"}, "seed"),
    ({"stop": ["s"] * 17}, "stop"),
    ({"stop": "x" * 257}, "stop"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": "many"}, "max_completion_tokens"),
    ({"stop": ""}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "word " * 2000}]}, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"chat_template_kwargs": {"chat_template": "{{ 1/0 }}"}}, "chat_template_kwargs"),
]


@pytest.mark.parametrize("change,param", BAD, ids=[p for _, p in BAD])
def test_each_bad_chat_input_is_400_naming_the_parameter(server, model, change, param):
    body = {"model": model, "messages": CHAT_PROMPT, "max_tokens": 4} | change
    r = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["param"], err["code"], err["type"]) == (param, 400, "invalid_request_error")
    assert err["message"]


@pytest.mark.parametrize("change,param", [({"prompt": [1, 2, 100000]}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
                                          ({"echo": True, "max_tokens": 0}, "max_tokens"),
                                          ({"max_tokens": 0}, "max_tokens"), ({"prompt": None}, "prompt")])
def test_each_bad_completion_input_is_400_naming_the_parameter(server, model, change, param):
    r = httpx.post(server.base + "/v1/completions", json={"model": model, "prompt": "x"} | change, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path,field", [("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")])
def test_text_the_tokenizer_cannot_take_is_400_not_500(server, path, field):
    # A lone UTF-16 surrogate is valid JSON but not valid Unicode text.
    value = b'[{"role": "user", "content": "a\\ud800b"}]' if field == "messages" else b'"a\\ud800b"'
    r = httpx.post(server.base + path, content=b'{"max_tokens": 2, "%s": %s}' % (field.encode(), value),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_malformed_json_is_400_and_unknown_model_is_404(server, client):
    r = httpx.post(server.base + "/v1/chat/completions", content=b"{nope",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=CHAT_PROMPT)
    assert e.value.body["param"] == "model"


def test_sdk_sees_bad_request_errors_with_the_param(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=CHAT_PROMPT, temperature=2.7)
    assert e.value.body["param"] == "temperature"


def test_unknown_fields_seed_and_user_are_accepted(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT_PROMPT, max_tokens=2, seed=7, user="me",
                                       temperature=0, extra_body={"frobnicate": True})
    assert r.usage.completion_tokens <= 2


def test_a_request_that_disconnects_mid_stream_is_aborted_and_the_engine_goes_idle(server, model, long_prompt):
    state = server.state
    aborts = aborted(server)
    with httpx.stream("POST", server.base + "/v1/completions", timeout=60,
                      json={"model": model, "prompt": long_prompt, "max_tokens": CONTEXT, "stream": True}) as r:
        it = r.iter_bytes()
        assert next(it).startswith(b"data: ")
        job = wait_for(lambda: running_job(state), 30, "decode running")
    # The server notices the closed connection; the decode stops at the engine's next read point.
    wait_for(lambda: aborted(server) == aborts + 1, 30, "abort counted")
    wait_for(lambda: not state.scheduler.busy(), 30, "engine idle")
    assert sample(server, "gemma_num_requests_running") == 0
    assert_engine_cancelled(job)


def aborted(server) -> float:
    return sample(server, "gemma_request_success_total", finished_reason="abort")


def running_job(state):
    """A job that holds an engine slot, if any."""
    return next((job for w in state.scheduler.workers for job in list(w.active.values())), None)


def assert_engine_cancelled(job):
    """The engine's own answer for `job` (left unread on its queue once the client is gone) is
    "cancelled": it stopped before the 284 tokens of the full reply, which would end "stop"."""
    queued = job.events._queue  # asyncio.Queue's deque: nobody reads it after the abort
    wait_for(lambda: queued and queued[-1][0] == "done", 30, "the engine's done event")
    assert queued[-1][1].finish == "cancelled", queued[-1][1]


def test_a_non_streamed_request_that_disconnects_mid_decode_is_aborted(server, model, long_prompt):
    state = server.state
    aborts = aborted(server)
    body = json.dumps({"model": model, "prompt": long_prompt, "max_tokens": CONTEXT}).encode()
    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:  # a client that hangs up mid-decode
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        job = wait_for(lambda: running_job(state), 30, "decode running")
    wait_for(lambda: aborted(server) == aborts + 1, 30, "abort counted")
    wait_for(lambda: not state.scheduler.busy(), 30, "engine idle")
    assert_engine_cancelled(job)


def test_health_live_and_engine_report_after_boot(server, chat_checkpoint):
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}
    # Nowhere in the report, the stages' messages included, is the checkpoint's directory.
    assert str(chat_checkpoint) not in httpx.get(server.base + "/v1/engine").text
    assert httpx.get(server.base + "/live").status_code == 200
    info = httpx.get(server.base + "/v1/engine").json()
    assert info["stage"] == "serving"
    # A local checkpoint's directory and the engine module's file stay private without --expose-paths.
    assert info["model"] is None and "model_dir" not in info and "module" not in info["build"]
    assert httpx.get(server.base + "/v1/models").json()["data"][0]["root"] is None
    assert [(s["stage"], s["status"]) for s in info["stages"]] == [
        ("build", "skipped"), ("import", "ok"), ("smoke", "ok"), ("weights", "ok"), ("compile", "skipped"),
        ("warmup", "ok"), ("serving", "running")]
    assert all(s["seconds"] is not None for s in info["stages"])
    assert set(info["build"]) >= {"torch", "rustc", "python", "crate"}
    assert info["layout"]["context"] == CONTEXT
    assert info["device"] == "cpu" and info["load_seconds"] > 0 and info["warmup_seconds"] > 0


def test_chat_page_is_served(server):
    r = httpx.get(server.base + "/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert "/v1/chat/completions" in r.text and "AbortController" in r.text


METRICS = {
    "gemma_num_requests_running": "gauge",
    "gemma_num_requests_waiting": "gauge",
    "gemma_time_to_first_token_seconds": "histogram",
    "gemma_inter_token_latency_seconds": "histogram",
    "gemma_request_time_per_output_token_seconds": "histogram",
    "gemma_e2e_request_latency_seconds": "histogram",
    "gemma_request_queue_time_seconds": "histogram",
    "gemma_request_prefill_time_seconds": "histogram",
    "gemma_request_decode_time_seconds": "histogram",
    "gemma_prompt_tokens": "counter",
    "gemma_prompt_tokens_read": "counter",
    "gemma_generation_tokens": "counter",
    "gemma_request_success": "counter",
    "gemma_request_prompt_tokens": "histogram",
    "gemma_request_generation_tokens": "histogram",
    "gemma_boot_stage_seconds": "gauge",
    "gemma_engine_ready": "gauge",
    "gemma_build_info": "gauge",
    "gemma_prefix_cache_queries": "counter",
    "gemma_prefix_cache_hits": "counter",
    "gemma_cache_config_info": "gauge",
}


def test_every_metric_is_present_with_its_type_after_real_traffic(server, client, model):
    client.chat.completions.create(model=model, messages=CHAT_PROMPT, max_tokens=6)
    list(client.chat.completions.create(model=model, messages=CHAT_PROMPT, max_tokens=6, stream=True))
    text = httpx.get(server.base + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in METRICS.items():
        assert name in families, name
        assert families[name].type == kind, name
        assert all(s.labels.get("model_name") == model for s in families[name].samples), name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    get = lambda name, **labels: samples[(name, tuple(sorted({"model_name": model, **labels}.items())))]  # noqa
    assert get("gemma_time_to_first_token_seconds_count") >= 2
    assert get("gemma_inter_token_latency_seconds_count") >= 10
    assert get("gemma_generation_tokens_total") >= 12
    assert get("gemma_engine_ready") == 1
    assert {s.labels["finished_reason"] for s in families["gemma_request_success"].samples} == {
        "stop", "length", "abort", "error"}
    ttft_buckets = [s.labels["le"] for s in families["gemma_time_to_first_token_seconds"].samples
                    if s.name.endswith("_bucket")]
    assert ttft_buckets[:3] == ["0.001", "0.005", "0.01"] and ttft_buckets[-2:] == ["2560.0", "+Inf"]
    (info,) = families["gemma_build_info"].samples
    assert info.labels["device"] == "cpu" and info.labels["torch"] and info.labels["rustc"]


@pytest.mark.gpu
def test_the_server_boots_and_answers_on_cuda(chat_checkpoint):
    from tests.server.conftest import start_in_process

    s = start_in_process(chat_checkpoint, "--device", "cuda")
    try:
        info = httpx.get(s.base + "/v1/engine").json()
        assert info["device"].startswith("cuda")
        assert [x["status"] for x in info["stages"]][1:5] == ["ok", "ok", "ok", "ok"]
        client = openai.OpenAI(base_url=s.base + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model=s.state.config.model_name, messages=CHAT_PROMPT, max_tokens=8)
        assert 1 <= r.usage.completion_tokens <= 8 and r.system_fingerprint.endswith("-cuda")
    finally:
        s.stop()


@pytest.mark.parametrize("path", ["/v1/models/", "/v1/chat/completions/", "/health/"])
def test_a_trailing_slash_is_a_404_not_a_redirect_built_from_the_host_header(server, path):
    r = httpx.request("POST" if "completions" in path else "GET", server.base + path,
                      headers={"Host": "evil.example"}, follow_redirects=False)
    assert r.status_code == 404 and "location" not in r.headers
    assert r.json()["error"]["code"] == 404


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_request_the_protocol_lets_through_but_the_engine_refuses_is_a_400_and_the_next_is_served(
        server, model, monkeypatch, stream):
    loaded = server.state.boot.loaded
    # The server's vocabulary bound loosened past the engine's, so the protocol lets an id the engine does
    # not have through, and the engine's own admission check (finish "error") is what refuses it.
    monkeypatch.setattr(server.state.boot, "loaded", dataclasses.replace(loaded, vocab_size=loaded.vocab_size + 10))
    errors = sample(server, "gemma_request_success_total", finished_reason="error")
    body = {"model": model, "prompt": [2, loaded.vocab_size + 5], "max_tokens": 2, "stream": stream}
    r = httpx.post(server.base + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"  # an error before the first token opens no stream
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"]) == ("invalid_request_error", 400)
    assert str(loaded.vocab_size + 5) in err["message"]
    assert sample(server, "gemma_request_success_total", finished_reason="error") == errors + 1
    monkeypatch.undo()
    r = httpx.post(server.base + "/v1/completions", json={**body, "prompt": [2, 3], "stream": False}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_request_is_checked_once(server, client, model, monkeypatch):
    calls = []
    check = ChatCompletionRequest.check
    monkeypatch.setattr(ChatCompletionRequest, "check", lambda self: (calls.append(self), check(self))[1])
    client.chat.completions.create(model=model, messages=CHAT_PROMPT, max_tokens=2)
    assert len(calls) == 1
