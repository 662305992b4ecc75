"""Prefix caching through the server, end to end: the real engine on the tiny checkpoints, the openai SDK as
the client. What a client sees (`usage.prompt_tokens_details.cached_tokens`, its replies, `cache_salt`),
what Prometheus sees (`gemma_prefix_cache_queries_total`, `gemma_prefix_cache_hits_total`,
`gemma_cache_config_info`), and which engine a request goes to when there are two.

Each test sends its requests under a cache_salt of its own: the session's server keeps what earlier tests
wrote, and a fresh salt shares nothing with it, so a first request's cached_tokens is 0 by construction.
"""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.server.conftest import LONG_PROMPT, openai_client, sample, start_in_process, wait_for

OCEAN = {"role": "user", "content": "Write a short paragraph about the ocean."}


def fresh_salt() -> str:
    return f"test-{uuid.uuid4().hex}"


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def uncached(chat_checkpoint):
    """The session server's twin with --no-enable-prefix-caching."""
    s = start_in_process(chat_checkpoint, "--no-enable-prefix-caching", "--queue-limit", "8", "--max-num-seqs", "4",
                         "--default-temperature", "0")
    yield s
    s.stop()


def two_turns(client: openai.OpenAI, model: str, salt: str):
    """A greedy conversation: a first turn, then a second whose messages extend the first and its reply."""
    messages = [OCEAN]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=24, logprobs=True,
                                           extra_body={"cache_salt": salt})
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And the mountains?"}]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=24, logprobs=True,
                                            extra_body={"cache_salt": salt})
    return first, second


def tokens(reply) -> list[str]:
    return [t.token for t in reply.choices[0].logprobs.content]


def test_a_second_chat_turn_reads_only_its_new_part_and_replies_as_without_caching(client, model, uncached):
    first, second = two_turns(client, model, fresh_salt())
    assert cached(first.usage) == 0
    # The first turn's prompt is the start of the second's: the engine resumes at its end (a snapshot of the
    # sliding window is taken at every prompt end), or one token before where the reply's first token merged.
    assert first.usage.prompt_tokens - 1 <= cached(second.usage) < second.usage.prompt_tokens
    plain_first, plain_second = two_turns(openai_client(uncached), model, fresh_salt())
    assert cached(plain_first.usage) == cached(plain_second.usage) == 0
    assert tokens(first) == tokens(plain_first) and tokens(second) == tokens(plain_second)
    assert second.choices[0].message.content == plain_second.choices[0].message.content
    assert len(tokens(second)) > 0


def test_tenants_with_different_cache_salts_never_share_a_prefix(client, model):
    a, b = fresh_salt(), fresh_salt()

    def ask(salt: str) -> tuple[int, int]:
        r = client.chat.completions.create(model=model, messages=[OCEAN], max_tokens=4,
                                           extra_body={"cache_salt": salt})
        return r.usage.prompt_tokens, cached(r.usage)

    n, hit = ask(a)
    assert hit == 0
    assert ask(b) == (n, 0)  # the same prompt, another tenant: nothing of a's
    # The same prompt again under its own salt: all but its last token, which is read for its logits.
    assert ask(a) == (n, n - 1)
    assert ask(b) == (n, n - 1)


def test_the_prefix_cache_counters_move_by_exactly_the_usage_numbers(server, client, model):
    wait_for(lambda: not server.state.scheduler.busy(), 60, "no request running or waiting")
    queries = sample(server, "gemma_prefix_cache_queries_total")
    hits = sample(server, "gemma_prefix_cache_hits_total")
    salt = fresh_salt()
    usages = []
    first = client.chat.completions.create(model=model, messages=[OCEAN], max_tokens=8, extra_body={"cache_salt": salt})
    usages.append(first.usage)
    messages = [OCEAN, {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Thank you."}]
    # Streamed: the usage chunk carries cached_tokens too.
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"cache_salt": salt}))
    usages.append(chunks[-1].usage)
    assert cached(usages[-1]) >= first.usage.prompt_tokens - 1
    for stream in (False, True):  # completions: the same prompt twice
        for _ in range(2):
            kw = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
            r = client.completions.create(model=model, prompt="The ocean is", max_tokens=4,
                                          extra_body={"cache_salt": salt + str(stream)}, **kw)
            usages.append(list(r)[-1].usage if stream else r.usage)
    assert [cached(u) for u in usages[2:]] == [0, usages[2].prompt_tokens - 1] * 2
    assert sample(server, "gemma_prefix_cache_queries_total") - queries == sum(u.prompt_tokens for u in usages)
    assert sample(server, "gemma_prefix_cache_hits_total") - hits == sum(cached(u) for u in usages)


def test_cache_config_info_tells_an_endpoint_picker_the_kv_each_server_holds(server, uncached):
    for s, on in ((server, "True"), (uncached, "False")):
        window = str(s.state.boot.state.layout["sliding_window"])
        # 4 slots of 1024 tokens, in blocks of the default 256-token prefill chunk.
        assert sample(s, "gemma_cache_config_info", block_size="256", num_gpu_blocks="16",
                      enable_prefix_caching=on, sliding_window=window) == 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("salt", ["", "s" * 257, 7], ids=["empty", "too-long", "a-number"])
def test_a_bad_cache_salt_is_a_400_naming_it(server, model, path, salt):
    body = {"model": model, "max_tokens": 2, "cache_salt": salt}
    body |= {"messages": [OCEAN]} if path.endswith("chat/completions") else {"prompt": "x"}
    r = httpx.post(server.base + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["type"]) == ("cache_salt", "invalid_request_error")


def test_the_sdk_sees_a_bad_cache_salt_as_a_bad_request_naming_it(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[OCEAN], max_tokens=2, extra_body={"cache_salt": ""})
    assert e.value.body["param"] == "cache_salt"


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}]


def test_conversations_sharing_a_system_prompt_and_tools_hit_at_its_end(agent_server, agent_checkpoint):
    client, model = openai_client(agent_server), agent_server.state.config.model_name
    system = {"role": "system", "content": "You are a weather assistant. Answer in one short sentence."}
    salt = fresh_salt()
    replies = [client.chat.completions.create(model=model, messages=[system, {"role": "user", "content": text}],
                                              tools=WEATHER, max_tokens=4, extra_body={"cache_salt": salt})
               for text in ("What is the weather in Paris?", "Is it cold in Oslo today?")]
    tokenizer = AutoTokenizer.from_pretrained(agent_checkpoint)
    shared = tokenizer.apply_chat_template([system], tools=WEATHER, tokenize=True, add_generation_prompt=False,
                                           return_dict=False)
    # The second conversation shares the first's system turn and tools and nothing after them: it resumes
    # exactly at the cache boundary the server marked there (the engine's snapshot at that position).
    assert [cached(r.usage) for r in replies] == [0, len(shared)]


def test_a_repeated_prompt_goes_back_to_the_engine_that_holds_it(chat_checkpoint):
    s = start_in_process(chat_checkpoint, "--devices", "2", "--max-num-seqs", "2", "--default-temperature", "0")
    try:
        client, model = openai_client(s), s.state.config.model_name
        workers = s.state.scheduler.workers

        def taker(request) -> tuple[int, object]:
            """(the engine that took `request()`, its reply)."""
            served = [w.served for w in workers]
            reply = request()
            (index,) = [w.index for w, n in zip(workers, served) if w.served > n]
            return index, reply

        a, b = fresh_salt(), fresh_salt()
        # Tenant a's long decode holds a slot on one engine while tenant b's request arrives: b's goes to the
        # other engine, the one with more free slots (nothing is shared).
        stream = iter(client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=200, stream=True,
                                                extra_body={"cache_salt": a}))
        next(stream)
        (holder_a,) = [w.index for w in workers if w.active]
        holder_b, _ = taker(lambda: client.completions.create(model=model, prompt="The ocean is", max_tokens=4,
                                                              extra_body={"cache_salt": b}))
        assert holder_b != holder_a
        for _ in stream:
            pass
        wait_for(lambda: not s.state.scheduler.busy(), 60, "both engines idle")
        # Both engines idle, both with every slot free: each prompt again goes where its history is.
        for salt, prompt, holder in ((b, "The ocean is", holder_b), (a, LONG_PROMPT, holder_a)):
            index, reply = taker(lambda: client.completions.create(model=model, prompt=prompt, max_tokens=2,
                                                                   extra_body={"cache_salt": salt}))
            assert index == holder
            assert cached(reply.usage) == reply.usage.prompt_tokens - 1
    finally:
        s.stop()


# ---- chat turns on Google's Gemma 4 templates (chat_template.next_turn) ------------------------------------

SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer briefly."}
FOLLOW_UPS = ("Tell me more.", "And then?", "Why so?")


def prompt_ids(server, messages: list[dict], **extra) -> list[int]:
    r = httpx.post(server.base + "/tokenize", json={"messages": messages, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def converse(server, first_user: dict, thinking: bool, turns: int = 3, **extra) -> list[tuple[int, int, int]]:
    """A greedy conversation through the openai SDK under a fresh cache_salt: each turn sends the history, the
    reply and a follow-up. Returns per turn after the first (prompt tokens, tokens it shares with the previous
    turn's prompt, cached tokens), after checking the counters on /metrics moved by the usage numbers."""
    client, model = openai_client(server), server.state.config.model_name
    body = {"cache_salt": fresh_salt(), **({"chat_template_kwargs": {"enable_thinking": True}} if thinking else {})}
    messages, previous, out = [SYSTEM, first_user], None, []
    wait_for(lambda: not server.state.scheduler.busy(), 60, "no request running or waiting")
    queries, hits = sample(server, "gemma_prefix_cache_queries_total"), sample(server, "gemma_prefix_cache_hits_total")
    usages = []
    for turn in range(turns):
        ids = prompt_ids(server, messages, **{k: v for k, v in body.items() if k != "cache_salt"}, **extra)
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=12, extra_body=body, **extra)
        usages.append(r.usage)
        assert r.usage.prompt_tokens == len(ids)
        if previous is not None:
            out.append((len(ids), common(previous, ids), cached(r.usage)))
        previous = ids
        messages = [*messages, r.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
    assert sample(server, "gemma_prefix_cache_queries_total") - queries == sum(u.prompt_tokens for u in usages)
    assert sample(server, "gemma_prefix_cache_hits_total") - hits == sum(cached(u) for u in usages)
    return out


def assert_reuses_what_it_shares(turns: list[tuple[int, int, int]]) -> None:
    """Turn N reads from the cache at least 90 % of what its prompt shares with turn N-1's; every prompt is
    longer than the tiny checkpoints' 12-token sliding window, so only a snapshot at the right place serves."""
    for n, shared, hit in turns:
        assert shared > 12 and hit >= 0.9 * shared and hit < n, (n, shared, hit)


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "thinking-on"])
def test_each_chat_turn_reuses_what_it_shares_with_the_last_on_googles_first_template(gemma4_server, thinking):
    assert_reuses_what_it_shares(converse(gemma4_server, {"role": "user", "content": "What is a TPU?"}, thinking))


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "thinking-on"])
def test_each_image_turn_reuses_what_it_shares_with_the_last_on_googles_later_template(media_server, thinking):
    """The later revision of Google's template (the multimodal checkpoint's), an image in the first turn: its
    soft tokens stay in every later prompt, and each turn resumes past them."""
    from tests.checkpoints.multimodal import random_image
    from tests.server.test_media import data_url, image_part, png

    first = {"role": "user", "content": [image_part(data_url(png(random_image(40, 30, seed=1)))),
                                         {"type": "text", "text": "What is in this picture?"}]}
    assert_reuses_what_it_shares(converse(media_server, first, thinking))


WEATHER_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"]}}}]


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "thinking-on"])
def test_a_tool_round_trip_and_the_next_turn_reuse_what_they_share(gemma4_server, thinking):
    """A forced call, its result (folded into the model turn by the first template), the answer, a new user
    turn: the result turn and the next turn each reuse at least 90 % of what they share with the turn before."""
    client, model = openai_client(gemma4_server), gemma4_server.state.config.model_name
    body = {"cache_salt": fresh_salt(), **({"chat_template_kwargs": {"enable_thinking": True}} if thinking else {})}
    kwargs = {k: v for k, v in body.items() if k != "cache_salt"}
    messages = [SYSTEM, {"role": "user", "content": "Weather in Paris?"}]
    call = client.chat.completions.create(model=model, messages=messages, tools=WEATHER_TOOL, max_tokens=40,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                          extra_body=body)
    previous = prompt_ids(gemma4_server, messages, tools=WEATHER_TOOL, **kwargs)
    tool_call = call.choices[0].message.tool_calls[0]
    messages += [call.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": tool_call.id, "content": '{"temp": 4}'}]
    turns = []
    for follow_up in ("Thanks. And tomorrow?", None):
        ids = prompt_ids(gemma4_server, messages, tools=WEATHER_TOOL, **kwargs)
        r = client.chat.completions.create(model=model, messages=messages, tools=WEATHER_TOOL, max_tokens=8,
                                           tool_choice="none", extra_body=body)
        turns.append((len(ids), common(previous, ids), cached(r.usage)))
        previous = ids
        if follow_up:
            messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                         {"role": "user", "content": follow_up}]
    assert_reuses_what_it_shares(turns)
