"""Speculative decoding through the server (`--speculative-method ngram --num-speculative-tokens k`): the same
replies as the server without it, through the openai SDK (greedy chat and completions, streamed and not, seeded,
penalized, with log-probabilities, and a JSON-schema reply); a request with `"speculative": false` gets no drafts;
/v1/engine names the method; vLLM's spec_decode counters move on /metrics; a bad setting stops the boot or the parser
with its name."""

import json
from contextlib import ExitStack

import httpx
import openai
import pytest

from gemma_server import speculation
from gemma_server.config import parse_config
from tests import assistants
from tests.checkpoints.chat import chat_text_config
from .conftest import sample, start_in_process

SPEC = ("--speculative-method", "ngram", "--num-speculative-tokens", "4", "--speculative-max-batch", "4")
# Prompts that repeat themselves, so prompt lookup finds n-grams to draft from.
PROMPTS = ["one two three one two three one two", "the cat sat on the mat, the cat sat on the", "Hello there"]


@pytest.fixture(scope="module")
def spec_server(chat_checkpoint):
    s = start_in_process(chat_checkpoint, *SPEC, "--max-num-seqs", "4", "--default-temperature", "0")
    yield s
    s.stop()


def replies(base: str, model: str) -> tuple[list, list[float]]:
    """The replies to a fixed set of requests, and the log-probabilities of one of them (to compare within float
    tolerance: a verify step computes the logits with other kernels)."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    out = []
    for p in PROMPTS:
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}], max_tokens=24)
        out.append((chat.choices[0].message.content, chat.choices[0].finish_reason))
        text = client.completions.create(model=model, prompt=p, max_tokens=24)
        out.append((text.choices[0].text, text.choices[0].finish_reason))
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt=p, max_tokens=16, stream=True) if c.choices)
        out.append(streamed)
    for seed in (7, 8):  # seeded sampled replies: the same draws with speculation
        sampled = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[1]}],
                                                 max_tokens=24, temperature=0.9, seed=seed)
        out.append(sampled.choices[0].message.content)
    scored = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                            max_tokens=16, logprobs=True, top_logprobs=2, frequency_penalty=0.5)
    content = scored.choices[0].logprobs.content
    out.append([(t.token, [a.token for a in t.top_logprobs]) for t in content])
    logprobs = [v for t in content for v in [t.logprob] + [a.logprob for a in t.top_logprobs]]
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 99}}, "required": ["a"],
              "additionalProperties": False}
    constrained = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=24,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    out.append(json.loads(constrained.choices[0].message.content))
    return out, logprobs


def assert_same_replies(base: str, plain_base: str, model: str) -> None:
    (out, logprobs), (want, want_logprobs) = replies(base, model), replies(plain_base, model)
    assert out == want and logprobs == pytest.approx(want_logprobs, abs=2e-3)


def test_replies_equal_the_server_without_speculation(spec_server, server, model):
    # Both serve the session's chat checkpoint, under its name.
    assert spec_server.state.config.model_name == model
    drafted = sample(spec_server, "gemma_spec_decode_num_draft_tokens_total")
    assert_same_replies(spec_server.base, server.base, model)
    assert sample(spec_server, "gemma_spec_decode_num_draft_tokens_total") > drafted
    assert sample(spec_server, "gemma_spec_decode_num_drafts_total") > 0
    accepted = sample(spec_server, "gemma_spec_decode_num_accepted_tokens_total")
    assert accepted <= sample(spec_server, "gemma_spec_decode_num_draft_tokens_total")
    assert sample(server, "gemma_spec_decode_num_draft_tokens_total") == 0


def test_a_request_that_opts_out_gets_no_drafts(spec_server, model):
    client = openai.OpenAI(base_url=f"{spec_server.base}/v1", api_key="unused", max_retries=0)
    drafted = sample(spec_server, "gemma_spec_decode_num_draft_tokens_total")
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                          max_tokens=24, extra_body={"speculative": False})
    assert chat.choices[0].message.content
    assert sample(spec_server, "gemma_spec_decode_num_draft_tokens_total") == drafted
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=24)
    assert sample(spec_server, "gemma_spec_decode_num_draft_tokens_total") > drafted, "the same request drafts"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                       max_tokens=4, extra_body={"speculative": "sometimes"})
    assert "speculative" in str(bad.value)


def test_v1_engine_names_the_method(spec_server, server):
    (engine,) = httpx.get(f"{spec_server.base}/v1/engine").json()["engines"]
    assert engine["speculative"] == {"method": "ngram", "speculative_model": None, "num_speculative_tokens": 4,
                                     "prompt_lookup_min": 1, "prompt_lookup_max": 4, "speculative_max_batch": 4,
                                     "speculative_max_bucket": None}
    (plain,) = httpx.get(f"{server.base}/v1/engine").json()["engines"]
    assert plain["speculative"] is None
    # Each draft position's accepted counter exists from the start (vLLM's), so the dashboard's query has series.
    per_position = [line for line in httpx.get(f"{spec_server.base}/metrics").text.splitlines()
                    if line.startswith("gemma_spec_decode_num_accepted_tokens_per_pos_total{")]
    assert {line.split('position="')[1].split('"')[0] for line in per_position} == {"0", "1", "2", "3"}


def test_an_mtp_drafter_gives_the_same_replies(chat_checkpoint, server, model, tmp_path):
    """`--speculative-method mtp --speculative-model DIR`: a (random) assistant drafter for the chat checkpoint,
    whose drafts the target rejects; the replies are those without speculation, and /v1/engine names it."""
    drafter = assistants.save_assistant(tmp_path / "assistant", target=chat_text_config())
    s = start_in_process(chat_checkpoint, "--speculative-method", "mtp", "--speculative-model", str(drafter),
                         "--num-speculative-tokens", "3", "--max-num-seqs", "4", "--default-temperature", "0",
                         "--speculative-max-batch", "4")
    try:
        (engine,) = httpx.get(f"{s.base}/v1/engine").json()["engines"]
        assert engine["speculative"]["method"] == "mtp"
        assert engine["speculative"]["speculative_model"] == str(drafter)
        assert_same_replies(s.base, server.base, model)
        assert sample(s, "gemma_spec_decode_num_draft_tokens_total") > 0
    finally:
        s.stop()


def test_the_limit_is_measured_at_warmup_without_a_setting(chat_checkpoint):
    """Without --speculative-max-batch each engine times plain and verify steps in every decode bucket at warmup
    and speculates up to the largest bucket where the verify step pays at 0.6 of drafts kept (speculation.py)."""
    s = start_in_process(chat_checkpoint, "--speculative-method", "ngram", "--num-speculative-tokens", "3",
                         "--max-num-seqs", "4", "--default-temperature", "0")
    try:
        info = httpx.get(f"{s.base}/v1/engine").json()
        (engine,) = info["engines"]
        measured = engine["speculative"]["measured"]
        buckets = [c["bucket"] for c in measured]
        assert buckets == sorted(set(buckets)) and buckets[0] == 1 and buckets[-1] == 4, "every decode bucket"
        assert all(c["drafts"] == 3 and 0 < c["plain_s"] and 0 < c["verify_s"] for c in measured)
        assert engine["speculative"]["speculative_max_bucket"] == speculation.limit(measured)
        assert engine["speculative"]["speculative_max_batch"] == 4, "the requests' limit is the bucket's"
        warmup = next(st for st in info["stages"] if st["stage"] == "warmup")
        assert f"speculative decoding in decode buckets up to {speculation.limit(measured)}" in warmup["message"]
    finally:
        s.stop()


def compiled_steps(base: str) -> list[str]:
    """The names of the steps the server's one engine compiled, in order (/v1/engine)."""
    return [name for name, _ in httpx.get(f"{base}/v1/engine").json()["compile"]["engines"][0]["compiled"]]


def greedy_and_sampled(base: str, model: str) -> tuple[str, str]:
    """A greedy completion and a seeded sampled chat reply, both of prompts that prompt lookup drafts from."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    greedy = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=24)
    sampled = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[1]}],
                                             max_tokens=24, temperature=0.9, seed=7)
    return greedy.choices[0].text, sampled.choices[0].message.content


def test_with_compile_warmup_compiles_the_verify_steps_and_serving_compiles_none(small_chat_checkpoint):
    """--compile on with speculation: the compile stage's requests do not speculate, so it compiles every decode
    step; once the buckets that speculate are known (here from --speculative-max-batch: all), warmup compiles
    their verify steps, greedy and sampled, so a speculating request compiles nothing while it waits; its replies
    are an eager server's without speculation. One slot, one prompt-chunk size and the 4-layer chat checkpoint
    keep the compiles few and short, and ATen's matmul keeps them in Inductor's cache."""
    with ExitStack() as servers:  # each stopped however the test ends, the second's start included
        eager = start_in_process(small_chat_checkpoint, "--default-temperature", "0")
        servers.callback(eager.stop)
        s = start_in_process(small_chat_checkpoint, *SPEC, "--max-num-seqs", "1", "--prefill-chunk", "16",
                             "--compile", "on", "--onednn", "off", "--default-temperature", "0")
        servers.callback(s.stop)
        info = httpx.get(f"{s.base}/v1/engine").json()
        warmup = next(st for st in info["stages"] if st["stage"] == "warmup")
        # Bucket 1's forward over the drafts, and its greedy and sampled checks.
        assert "3 verify graphs compiled (decode buckets [1])" in warmup["message"], warmup
        before = compiled_steps(s.base)
        decode = {f"decode b=1{padded} {stages}" for padded in ("", " padded")
                  for stages in ("forward", "greedy", "draw")}
        verify = {"verify b=1 k=4 forward", "verify b=1 k=4 greedy", "verify b=1 k=4 draw"}
        assert decode | verify <= set(before), before
        drafted = sample(s, "gemma_spec_decode_num_draft_tokens_total")
        model = s.state.config.model_name
        assert greedy_and_sampled(s.base, model) == greedy_and_sampled(eager.base, eager.state.config.model_name)
        assert sample(s, "gemma_spec_decode_num_draft_tokens_total") > drafted, "the requests speculated"
        assert compiled_steps(s.base) == before, "no step compiled while serving"


def test_bad_settings_are_refused_by_name(chat_checkpoint, capsys):
    with pytest.raises(SystemExit):
        parse_config(["--model", "m", "--speculative-method", "eagle"], {})
    assert "--speculative-method" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(["--model", "m", "--num-speculative-tokens", "0"], {})
    assert "--num-speculative-tokens must be at least 1" in capsys.readouterr().err
    s = start_in_process(chat_checkpoint, "--speculative-method", "ngram", wait_ready=False)
    try:
        from .conftest import wait_for

        failed = wait_for(lambda: s.state.boot.state.failed, 300, "the boot to fail")
        assert "needs num_speculative_tokens" in str(failed)
    finally:
        s.stop()
