"""Concurrent requests, sampling, logprobs, n choices, several engines and the API key, through the
real openai SDK against the real engine on the tiny chat checkpoint (server in-process, conftest.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from tests.server.conftest import LONG_PROMPT, sample, start_in_process, wait_for

PROMPTS = [
    "Write a short paragraph about the ocean.",
    "Tell me about mountains.",
    "What is a river?",
    "Describe the sky at night.",
    "Hello",
    "Name three colours.",
]


@pytest.fixture(scope="module")
def long_prompt(tokenizer) -> list[int]:
    return tokenizer.encode(LONG_PROMPT)


def chat_ids(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def ask(client, model, content: str, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], **kw)


def test_concurrent_greedy_requests_each_get_the_engines_reply_alone(client, model, direct_engine, tokenizer, server):
    expected = {p: tokenizer.decode(direct_engine.decode(chat_ids(tokenizer, p), 40)[0], skip_special_tokens=True)
                for p in PROMPTS}
    before = batched_steps(server)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda p: ask(client, model, p, max_tokens=40, temperature=0), PROMPTS))
    assert {p: r.choices[0].message.content for p, r in zip(PROMPTS, replies)} == expected
    # They really ran together: decode steps with more than one request in them.
    assert batched_steps(server) > before


def batched_steps(server) -> float:
    """Decode steps so far that held two or more requests (gemma_iteration_tokens_total above its 1 bucket)."""
    return (sample(server, "gemma_iteration_tokens_total_count")
            - sample(server, "gemma_iteration_tokens_total_bucket", le="1.0"))


def test_a_seeded_sampled_reply_is_the_same_alone_and_under_load(client, model):
    kw = dict(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234, extra_body={"top_k": 40})
    alone = ask(client, model, PROMPTS[0], **kw).choices[0].message.content
    with ThreadPoolExecutor(5) as pool:
        noise = [pool.submit(ask, client, model, p, max_tokens=30, temperature=0.8, seed=i)
                 for i, p in enumerate(PROMPTS[1:4])]
        busy = pool.submit(ask, client, model, PROMPTS[0], **kw)
        again = busy.result().choices[0].message.content
        for f in noise:
            f.result()
    assert again == alone
    other_seed = ask(client, model, PROMPTS[0], **{**kw, "seed": 99}).choices[0].message.content
    greedy = ask(client, model, PROMPTS[0], max_tokens=24, temperature=0).choices[0].message.content
    # The seed decides the draw: a given seed repeats exactly (above); the draws are not the greedy path.
    assert {alone, other_seed, greedy} != {greedy}


def test_chat_logprobs_are_the_models_log_softmax(client, model, direct_engine, tokenizer):
    r = ask(client, model, PROMPTS[1], max_tokens=3, temperature=0, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 3
    ids = chat_ids(tokenizer, PROMPTS[1])
    lp = torch.log_softmax(direct_engine.logits(ids).double(), -1)
    first = content[0]
    top = lp.topk(5)
    assert [t.logprob for t in first.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert [t.token for t in first.top_logprobs] == [tokenizer.decode([i]) for i in top.indices.tolist()]
    assert first.logprob == pytest.approx(top.values[0].item(), abs=1e-4)  # greedy: the top token
    assert first.bytes == list(first.token.encode())


def test_completion_logprobs_have_the_legacy_shape(server, model):
    r = httpx.post(server.base + "/v1/completions", timeout=60,
                   json={"model": model, "prompt": "The sea", "max_tokens": 4, "temperature": 0, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    assert all(len(t) <= 2 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert "".join(lp["tokens"]) == r.json()["choices"][0]["text"]


def test_n_choices_are_each_reproducible_by_seed(client, model):
    r = ask(client, model, PROMPTS[2], max_tokens=12, n=3, temperature=1.0, seed=50)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert 3 <= r.usage.completion_tokens <= 36
    for c in r.choices:
        alone = ask(client, model, PROMPTS[2], max_tokens=12, temperature=1.0, seed=50 + c.index)
        assert c.message.content == alone.choices[0].message.content


def test_n_choices_read_their_prompt_once(server, client, model):
    before = sample(server, "gemma_prompt_tokens_read_total"), sample(server, "gemma_prompt_tokens_total")
    r = ask(client, model, PROMPTS[1], max_tokens=5, n=3, temperature=1.0, seed=8)
    read = sample(server, "gemma_prompt_tokens_read_total") - before[0]
    counted = sample(server, "gemma_prompt_tokens_total") - before[1]
    assert (read, counted) == (r.usage.prompt_tokens, 3 * r.usage.prompt_tokens)


def test_streamed_n_choices_each_finish(client, model):
    stream = ask(client, model, PROMPTS[3], max_tokens=6, n=2, temperature=0.9, seed=3, stream=True)
    text, finish = {0: "", 1: ""}, {}
    for chunk in stream:
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert set(finish) == {0, 1}
    for i in (0, 1):
        alone = ask(client, model, PROMPTS[3], max_tokens=6, temperature=0.9, seed=3 + i).choices[0].message.content
        assert text[i] == alone


STEP_SERIES = ("gemma_iteration_tokens_total_count", "gemma_iteration_tokens_total_sum",
               "gemma_engine_step_seconds_count", "gemma_prompt_tokens_read_total", "gemma_prompt_tokens_total",
               "gemma_generation_tokens_total", "gemma_request_generation_tokens_count",
               "gemma_request_generation_tokens_sum", "gemma_time_to_first_token_seconds_count",
               "gemma_inter_token_latency_seconds_count", "gemma_e2e_request_latency_seconds_count")


def test_step_and_token_metrics_grow_by_what_one_request_did(server, model, tokenizer):
    ids = tokenizer.encode("Hello")
    before = {name: sample(server, name) for name in STEP_SERIES}
    lengths = sample(server, "gemma_request_success_total", finished_reason="length")
    r = httpx.post(server.base + "/v1/completions", timeout=60, json={"model": model, "prompt": ids, "max_tokens": 8})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    grew = {name: sample(server, name) - before[name] for name in STEP_SERIES}
    # The first token comes out of the prompt's forward, the other 7 out of one decode step each, and the
    # request ran alone: one row per step.
    assert (grew["gemma_iteration_tokens_total_count"], grew["gemma_iteration_tokens_total_sum"]) == (7, 7)
    assert grew["gemma_engine_step_seconds_count"] >= 7  # the decode turns and the prompt's
    assert (grew["gemma_prompt_tokens_read_total"], grew["gemma_prompt_tokens_total"]) == (len(ids), len(ids))
    assert (grew["gemma_generation_tokens_total"], grew["gemma_request_generation_tokens_sum"]) == (8, 8)
    assert grew["gemma_request_generation_tokens_count"] == grew["gemma_time_to_first_token_seconds_count"] == 1
    assert grew["gemma_e2e_request_latency_seconds_count"] == 1
    assert grew["gemma_inter_token_latency_seconds_count"] == 7  # one per token after the first
    assert sample(server, "gemma_request_success_total", finished_reason="length") == lengths + 1
    # Its slot is free again.
    assert slots(server) == (0, 0)


def test_a_running_request_holds_one_of_the_four_slots_until_it_ends(server, model, long_prompt):
    with httpx.stream("POST", server.base + "/v1/completions", timeout=60,
                      json={"model": model, "prompt": long_prompt, "max_tokens": 200, "stream": True}) as r:
        events = r.iter_bytes()
        assert next(events).startswith(b"data: ")
        wait_for(lambda: slots(server) == (1, 0.25), 30, "the request in one of the four slots")
        assert b"".join(events).endswith(b"data: [DONE]\n\n")
    wait_for(lambda: slots(server) == (0, 0), 30, "the slot freed")


def slots(server) -> tuple[float, float]:
    """(gemma_num_requests_running, gemma_kv_cache_usage_perc)."""
    return sample(server, "gemma_num_requests_running"), sample(server, "gemma_kv_cache_usage_perc")


def test_the_engine_report_shows_the_slots_and_weights(server):
    info = httpx.get(server.base + "/v1/engine").json()
    assert [e["max_batch"] for e in info["engines"]] == [4]
    assert info["engines"][0]["kv_bytes"] == 4 * info["engines"][0]["kv_bytes_per_slot"] > 0
    # A float32 engine dequantizes int4 weights (the packed kernels take bfloat16), or has none.
    assert info["engines"][0]["int4_weights"] in ("none", "dequantized")
    assert info["engines"][0]["weight_bytes"] > 0
    # On the CPU in float32 the dense weights go through oneDNN (rust/src/gemma4/linear.rs).
    assert info["engines"][0]["linear"] == "onednn"


def test_two_engines_on_the_cpu_share_the_requests(chat_checkpoint, direct_engine, tokenizer):
    s = start_in_process(chat_checkpoint, "--devices", "2", "--max-num-seqs", "2", "--default-temperature", "0")
    try:
        info = httpx.get(s.base + "/v1/engine").json()
        assert [(e["index"], e["device"]) for e in info["engines"]] == [(0, "cpu"), (1, "cpu")]
        client = openai.OpenAI(base_url=s.base + "/v1", api_key="unused", max_retries=0)
        name = s.state.config.model_name
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda p: ask(client, name, p, max_tokens=30), PROMPTS[:4]))
        for p, r in zip(PROMPTS[:4], replies):
            expected = direct_engine.decode(chat_ids(tokenizer, p), 30)[0]
            assert r.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
        served = [w.served for w in s.state.scheduler.workers]
        assert all(n >= 1 for n in served), served
    finally:
        s.stop()


def test_shard_groups_split_the_devices_in_order_and_refuse_a_size_that_does_not_divide_them():
    from gemma_server.boot import shard_groups

    assert shard_groups(["tpu:0", "tpu:1", "tpu:2", "tpu:3"], 2) == [["tpu:0", "tpu:1"], ["tpu:2", "tpu:3"]]
    assert shard_groups(["cpu", "cpu"], 4) == [["cpu"] * 4, ["cpu"] * 4]
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 does not divide the 4 devices"):
        shard_groups(["cuda:0", "cuda:1", "cuda:2", "cuda:3"], 3)


def test_api_key_guards_the_api_and_leaves_probes_and_the_boot_report_open(chat_checkpoint):
    s = start_in_process(chat_checkpoint, "--api-key", "sesame", "--default-temperature", "0")
    try:
        r = httpx.post(s.base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"
        for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):  # refused before the form is read
            assert httpx.post(s.base + path, files={"file": ("a.wav", b"RIFF")}).status_code == 401, path
        assert httpx.get(s.base + "/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        client = openai.OpenAI(base_url=s.base + "/v1", api_key="sesame", max_retries=0)
        assert client.models.list().data[0].id == s.state.config.model_name
        for path in ("/health", "/live", "/metrics", "/version"):
            assert httpx.get(s.base + path).status_code == 200, path
        # The operator holds no Secrets: it reads the boot report and the served model id without the key.
        report = httpx.get(s.base + "/v1/engine").json()
        assert report["stage"] == "serving" and report["served_model_name"] == s.state.config.model_name
    finally:
        s.stop()


def test_metrics_can_need_the_key_and_paths_show_only_when_asked(chat_checkpoint):
    s = start_in_process(chat_checkpoint, "--api-key", "sesame", "--metrics-need-key", "--expose-paths")
    try:
        assert httpx.get(s.base + "/metrics").status_code == 401
        metrics = httpx.get(s.base + "/metrics", headers={"Authorization": "Bearer sesame"})
        assert metrics.status_code == 200 and "gemma_num_requests_running" in metrics.text
        models = httpx.get(s.base + "/v1/models", headers={"Authorization": "Bearer sesame"}).json()
        assert models["data"][0]["root"] == str(chat_checkpoint)
        report = httpx.get(s.base + "/v1/engine").json()
        assert report["model"] == str(chat_checkpoint) and report["model_dir"] == str(chat_checkpoint)
        assert report["build"]["module"].endswith((".py", ".so"))
    finally:
        s.stop()
