"""The chat page (GET /, server/gemma_server/static/index.html) in a real headless browser.

Chromium (Debian's /usr/bin/chromium) is driven by Playwright's sync API against the real server on the real
engine (the `server` and `agent_server` fixtures of conftest.py). The weights are random, so the tests assert
on structure and counters (the page's ids and data-* attributes, the server's metrics and /v1/engine), never
on words. Where the page must show something random weights do not write on demand (a thought), the test
adds a constraint to the page's own request on its way out (Playwright's `page.route`); a reply that runs
until Stop is held by tests/server/fakes.py's FakeGatedEngine behind the real server.
"""

from __future__ import annotations

import base64
import io
import json
import re
import threading
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
import soundfile
from playwright.sync_api import Browser, Page, Request, Route, expect, sync_playwright
from prometheus_client.parser import text_string_to_metric_families

from gemma_server.boot import Boot
from gemma_server import sse
from gemma_server.errors import error_body
from tests.checkpoints.multimodal import random_image
from tests.server.conftest import start_in_process, wait_for
from tests.server.fakes import fake_gated_boot
from tests.server.test_agents import SCHEMAS, TOOLS

CHROMIUM = "/usr/bin/chromium"
TIMEOUT_MS = 60_000  # every wait: the engine shares 2 loaded cores with the browser and other runs
ESSAY = "Write a long essay about the sea."  # greedy on the chat checkpoint: 113 tokens, then an end of turn

# Records, in order, each text the page puts in a reply's answer (the Text node of each `textContent =`)
# and each time it writes a reply's meta line, so a test can tell a streamed reply from one written at once.
RECORDER = """
window.__events = [];
new MutationObserver((records) => {
  for (const r of records) {
    const t = r.target;
    if (!t.classList) continue;
    if (t.classList.contains("answer"))
      for (const n of r.addedNodes) window.__events.push(["answer", t.id, n.textContent.length]);
    else if (t.classList.contains("meta") && r.addedNodes.length) window.__events.push(["meta", t.id, 0]);
  }
}).observe(document, {childList: true, subtree: true});
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        # Chromium runs as root here: no user namespaces for its sandbox; /dev/shm may be small in containers.
        # The fake capture device (a beep) stands in for a microphone, granted without a prompt.
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-dev-shm-usage", "--use-fake-device-for-media-stream",
            "--use-fake-ui-for-media-stream"])
        yield b
        b.close()


def new_page(browser: Browser, base: str, ready: bool = True) -> Page:
    page = browser.new_context(base_url=base).new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.add_init_script(RECORDER)
    page.goto("/")
    if ready:
        expect(page.locator("#engine-status")).to_have_text("ready", timeout=TIMEOUT_MS)
        expect(page.locator("#status")).to_contain_text("ready", timeout=TIMEOUT_MS)
    return page


@pytest.fixture
def page(browser, server) -> Iterator[Page]:
    p = new_page(browser, server.base)
    yield p
    p.context.close()


@pytest.fixture
def media_page(browser, media_server) -> Iterator[Page]:
    p = new_page(browser, media_server.base)
    yield p
    p.context.close()


@pytest.fixture
def agent_page(browser, agent_server) -> Iterator[Page]:
    p = new_page(browser, agent_server.base)
    yield p
    p.context.close()


def chat_bodies(page: Page) -> list[dict]:
    """The bodies of the page's POST /v1/chat/completions requests, appended as the browser sends them."""
    bodies: list[dict] = []

    def on_request(request: Request) -> None:
        if request.url.endswith("/v1/chat/completions"):
            bodies.append(request.post_data_json)

    page.on("request", on_request)
    return bodies


def set_controls(page: Page, **values: str) -> None:
    for name, value in values.items():
        page.fill(f"#{name}", value)


def ask(page: Page, text: str, n: int) -> dict[str, str]:
    """Send `text` and wait for reply `n` to end; its meta line's data-* attributes (set when the reply ends)."""
    page.fill("#input", text)
    page.click("#send")
    return reply_meta(page, n)


def reply_meta(page: Page, n: int) -> dict[str, str]:
    meta = page.wait_for_selector(f"#reply-{n}-meta[data-finish]", state="attached", timeout=TIMEOUT_MS)
    return meta.evaluate("(e) => ({...e.dataset, text: e.textContent})")


def metric(base: str, name: str, **labels: str) -> float:
    """The sum of the samples `name` whose labels include `labels`, from the server's GET /metrics."""
    total, found = 0.0, False
    for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == name and labels.items() <= s.labels.items():
                total, found = total + s.value, True
    assert found, f"no sample {name} {labels}"
    return total


def requests_ended(base: str) -> float:
    return metric(base, "gemma_request_success_total")


# ---------------------------------------------------------------- streaming, sampling, the meta line


def test_a_reply_streams_and_its_meta_shows_the_servers_counts_for_the_sampling_sent(page):
    bodies = chat_bodies(page)
    set_controls(page, max_tokens="96")
    meta = ask(page, ESSAY, 1)

    # The server read max_tokens: 96 tokens, cut by the length (greedy, the reply would run to 113); enough
    # tokens that the reply arrives as several pieces even on a loaded machine.
    assert bodies[0]["max_tokens"] == 96 and bodies[0]["stream_options"] == {"include_usage": True}
    assert not {"temperature", "top_p", "seed", "tools", "chat_template_kwargs"} & set(bodies[0])
    assert meta["finish"] == "length" and meta["tokens"] == "96", meta
    assert float(meta["ttftMs"]) > 0 and float(meta["tps"]) > 0
    assert re.search(r"first token \d+ ms", meta["text"]) and "96 tokens" in meta["text"] and "tok/s" in meta["text"]

    # The answer grew over several updates, each longer than the last, all before the meta line was written.
    events = page.evaluate("window.__events")
    meta_at = events.index(["meta", "reply-1-meta", 0])
    lengths = [length for kind, el, length in events[:meta_at] if el == "reply-1-answer"]
    final = len(page.text_content("#reply-1-answer"))
    assert len(lengths) >= 2 and lengths == sorted(set(lengths)) and lengths[-1] == final > 0, lengths

    # The conversation's next turn reads its first turn from the prefix cache, and the meta line says so.
    meta2 = ask(page, "And then?", 2)
    assert int(meta2["cached"]) > int(meta["cached"]) and "cached" in meta2["text"], (meta, meta2)
    assert [m["role"] for m in bodies[1]["messages"]] == ["user", "assistant", "user"]


def test_a_seed_gives_the_same_sampled_reply_twice(page):
    def sampled(seed: str, n: int) -> str:
        page.click("#clear")
        set_controls(page, temperature="1", max_tokens="16", seed=seed)
        ask(page, "Hello", n)
        return page.text_content(f"#reply-{n}-answer")

    bodies = chat_bodies(page)
    first, again, other = sampled("1234", 1), sampled("1234", 2), sampled("99", 3)
    assert [(b["temperature"], b["seed"], len(b["messages"])) for b in bodies] == [(1, 1234, 1), (1, 1234, 1),
                                                                                    (1, 99, 1)]
    assert first and first == again and other != first


# ---------------------------------------------------------------- Stop


@pytest.fixture(scope="module")
def gated_server(chat_checkpoint) -> Iterator:
    """The real server on tests/server/fakes.py's FakeGatedEngine: a request holds the slot for as long as the
    test keeps the engine's gate closed (the real engine ends a 1,000-token reply in about a second here,
    sometimes before a click lands)."""
    s = start_in_process(chat_checkpoint, boot_class=fake_gated_boot(str(chat_checkpoint)))
    yield s
    s.stop()


def test_stop_aborts_the_reply_on_the_server_and_frees_its_slot(browser, gated_server):
    engine = gated_server.state.boot.loaded.workers[0].engine
    page = new_page(browser, gated_server.base)
    try:
        aborts = metric(gated_server.base, "gemma_request_success_total", finished_reason="abort")
        engine.gate.clear()  # the engine holds the request at its next step
        set_controls(page, max_tokens="200")
        page.fill("#input", "Hello")
        page.click("#send")
        wait_for(engine.decoding.is_set, 60, "the request in the engine's slot")
        page.click("#stop")

        meta = reply_meta(page, 1)
        assert meta["finish"] == "stopped" and "finish: stopped" in meta["text"]
        expect(page.locator("#reply-1")).to_have_class(re.compile(r"\bstopped\b"))
        expect(page.locator("#send")).to_be_enabled()
        expect(page.locator("#stop")).to_be_disabled()
        # The server saw the disconnect and cancelled the decode: one more abort, the slot free again.
        engine.gate.set()  # the engine takes its step and reads the cancel at its next read point
        wait_for(lambda: metric(gated_server.base, "gemma_request_success_total",
                                finished_reason="abort") == aborts + 1, 60, "the abort counted")
        wait_for(lambda: not engine.decoding.is_set(), 60, "the slot free")
        assert metric(gated_server.base, "gemma_num_requests_running") == 0
        assert engine.decodes == 1
    finally:
        engine.gate.set()
        page.context.close()


# ---------------------------------------------------------------- the side panel


def test_the_side_panel_shows_the_engines_build_and_the_model(page, server):
    info = httpx.get(server.base + "/v1/engine").json()
    build = info["build"]
    for key in ("version", "torch", "rustc", "python", "crate"):
        expect(page.locator(f"#engine-{key}")).to_have_text(build[key])
    expect(page.locator("#engine-device")).to_have_text(info["device"])
    expect(page.locator("#engine-dtype")).to_have_text(info["dtype"])
    expect(page.locator("#engine-model")).to_have_text(server.state.config.model_name)
    expect(page.locator("#engine-engines")).to_contain_text(f"/{info['engines'][0]['max_batch']} slots busy")
    expect(page.locator("#engine-stages")).to_contain_text("warmup ok")


def test_the_page_shows_the_boot_stage_until_ready_and_sends_the_api_key(browser, chat_checkpoint):
    gate = threading.Event()

    class GatedWeights(Boot):  # the real boot, held at the weights stage until the test lets it go
        def _weights(self) -> str:
            gate.wait(120)
            return super()._weights()

    s = start_in_process(chat_checkpoint, "--api-key", "s3cret", "--max-num-seqs", "2", boot_class=GatedWeights,
                         wait_ready=False)
    try:
        page = new_page(browser, s.base, ready=False)
        # /v1/engine stays open without the key, so the boot shows; /v1/models does not.
        expect(page.locator("#engine-status")).to_have_text("booting, stage: weights")
        expect(page.locator("#status")).to_contain_text("API key needed")
        gate.set()
        expect(page.locator("#engine-status")).to_have_text("ready", timeout=TIMEOUT_MS)  # the page polled

        # Without the key, the server's 401 (OpenAI's error shape) is shown in the reply.
        ask(page, "Hello", 1)
        expect(page.locator("#reply-1-error")).to_be_visible()
        expect(page.locator("#reply-1-error")).to_contain_text("401")

        # The key is kept for the tab (a reload keeps it) and sent as a bearer token.
        page.fill("#api_key", "s3cret")
        page.reload()
        expect(page.locator("#api_key")).to_have_value("s3cret")
        expect(page.locator("#status")).to_contain_text(s.state.config.model_name)
        with page.expect_request("**/v1/chat/completions") as sent:
            page.fill("#max_tokens", "4")
            page.fill("#input", "Hello")
            page.click("#send")
        assert sent.value.headers["authorization"] == "Bearer s3cret"
        meta = reply_meta(page, 1)
        assert meta["finish"] in ("stop", "length") and meta["tokens"] != "", meta
        expect(page.locator("#reply-1-error")).to_be_hidden()
        page.context.close()
    finally:
        gate.set()
        s.stop()


# ---------------------------------------------------------------- tools and thinking (the agent checkpoint)


def test_a_forced_tool_call_is_shown_with_its_name_and_arguments(agent_page):
    bodies = chat_bodies(agent_page)
    agent_page.fill("#tools", json.dumps(TOOLS, indent=1))
    agent_page.select_option("#tool_choice", "required")
    set_controls(agent_page, max_tokens="120")
    meta = ask(agent_page, "What is the weather in Paris?", 1)

    assert bodies[0]["tools"] == TOOLS and bodies[0]["tool_choice"] == "required"
    assert meta["finish"] == "tool_calls", meta
    calls = agent_page.locator("#reply-1-tools .call")
    assert calls.count() >= 1
    for i in range(calls.count()):
        name = calls.nth(i).locator(".name").text_content()
        args = calls.nth(i).locator(".args").text_content()
        assert name in SCHEMAS and args.startswith("(") and args.endswith(")")
        jsonschema.validate(json.loads(args[1:-1]), SCHEMAS[name])  # the concatenated fragments are the JSON
    assert agent_page.text_content("#reply-1-answer") == ""


def test_thinking_is_sent_and_the_thought_is_shown_apart_from_the_answer(agent_page):
    # A grammar makes the model write a thought (random weights would not open the channel); the page's own
    # body goes out with it added, so what is tested is the page's request and its rendering of the stream.
    grammar = 'start: <|channel> "thought\\nI think" <channel|> "Done."'
    sent: list[dict] = []

    def constrain(route: Route) -> None:
        body = route.request.post_data_json
        sent.append(body)
        route.continue_(post_data=json.dumps({**body, "structured_outputs": {"grammar": grammar}}))

    agent_page.route("**/v1/chat/completions", constrain)
    agent_page.check("#thinking")
    set_controls(agent_page, max_tokens="30")
    meta = ask(agent_page, "What is the weather in Paris?", 1)

    assert sent[0]["chat_template_kwargs"] == {"enable_thinking": True}
    assert meta["finish"] == "stop", meta
    thinking = agent_page.locator("#reply-1-thinking")
    expect(thinking).to_be_visible()
    expect(thinking.locator(".thinking-text")).to_have_text("I think")
    expect(agent_page.locator("#reply-1-answer")).to_have_text("Done.")
    # Apart: the thought is not in the answer, and it folded away once the answer began.
    assert thinking.evaluate("(e) => !e.open && !document.getElementById('reply-1-answer').contains(e)")


# ---------------------------------------------------------------- invalid input


def test_invalid_tools_json_is_shown_and_nothing_is_sent(page, server):
    bodies = chat_bodies(page)
    ended = requests_ended(server.base)
    page.fill("#tools", '[{"type": "function",')
    page.fill("#input", "Hello")
    page.click("#send")
    expect(page.locator("#tools_error")).to_be_visible()
    expect(page.locator("#tools_error")).to_contain_text("tools: not JSON")
    expect(page.locator("#input")).to_have_value("Hello")  # the message is kept for another try
    assert page.locator("#log .msg").count() == 0 and bodies == []
    assert requests_ended(server.base) == ended

    # The same click with the tools fixed (none) is sent and counted: the counter above could have moved.
    page.fill("#tools", "")
    set_controls(page, max_tokens="2")
    page.click("#send")
    reply_meta(page, 1)
    expect(page.locator("#tools_error")).to_be_hidden()
    assert len(bodies) == 1 and "tools" not in bodies[0]
    wait_for(lambda: requests_ended(server.base) == ended + 1, 30, "the one request counted")


def test_server_errors_are_shown_in_the_reply(page):
    # A request the server refuses (a tool without a function is JSON, but not a tool): its 400 in OpenAI's
    # shape, shown with the status and the field at fault.
    page.fill("#tools", '[{"type": "function"}]')
    meta = ask(page, "Hello", 1)
    assert meta["finish"] == "error", meta
    expect(page.locator("#reply-1-error")).to_be_visible()
    expect(page.locator("#reply-1-error")).to_contain_text("Error 400 (tools")

    # An error after the stream opened comes as an SSE event (the server's own framing, errors.py); what
    # streamed before it stays.
    stream = (sse.event({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Hi"}}]})
              + sse.event(error_body(500, "the engine failed this request")) + sse.DONE)
    page.route("**/v1/chat/completions",
               lambda route: route.fulfill(status=200, content_type="text/event-stream", body=stream))
    page.fill("#tools", "")
    meta = ask(page, "Hello", 2)
    assert meta["finish"] == "error", meta
    expect(page.locator("#reply-2-answer")).to_have_text("Hi")
    expect(page.locator("#reply-2-error")).to_have_text("Error 500: the engine failed this request")


# ---------------------------------------------------------------- images and audio (the checkpoint with both towers)


def test_an_attached_image_and_a_recording_go_out_as_parts_before_the_text(media_page, media_server, tmp_path):
    bodies = chat_bodies(media_page)
    picture = tmp_path / "cat.png"
    random_image(40, 30, seed=1).save(picture)
    # A pinned seed: random weights sample any token, the end of turn among them.
    set_controls(media_page, max_tokens="6", seed="11")
    media_page.set_input_files("#attach", str(picture))
    expect(media_page.locator("#attachments")).to_contain_text("cat.png")
    meta = ask(media_page, "What is this?", 1)
    assert meta["finish"] == "length" and meta["tokens"] == "6", meta
    content = bodies[0]["messages"][0]["content"]
    assert [p["type"] for p in content] == ["image_url", "text"] and content[1]["text"] == "What is this?"
    assert base64.b64decode(content[0]["image_url"]["url"].split(",", 1)[1]) == picture.read_bytes()
    expect(media_page.locator("#log .msg.user img")).to_have_count(1)
    expect(media_page.locator("#attachments")).to_be_empty()  # sent once, not again with the next turn

    # Record: the fake microphone's beep, sent as a 16 kHz mono wav the page encodes.
    media_page.click("#record")
    expect(media_page.locator("#record")).to_have_text("Stop recording")
    media_page.wait_for_timeout(1200)
    media_page.click("#record")
    expect(media_page.locator("#attachments")).to_contain_text("recording.wav", timeout=TIMEOUT_MS)
    meta = ask(media_page, "What did I say?", 2)
    # The recording's length (and so the prompt) varies with timing: the reply may sample the end of turn at any
    # step, the first included (a reply of no tokens); either way it ends as a reply, not an error.
    finish, tokens = meta["finish"], int(meta["tokens"])
    assert (finish, tokens) == ("length", 6) or (finish == "stop" and 0 <= tokens < 6), meta
    part = bodies[1]["messages"][2]["content"][0]
    assert part["type"] == "input_audio" and part["input_audio"]["format"] == "wav"
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(part["input_audio"]["data"])))
    assert rate == 16_000 and samples.ndim == 1 and 0.5 < len(samples) / rate < 10 and abs(samples).max() > 0
    # The earlier turn's image goes back with the conversation; the recording was counted as audio.
    assert bodies[1]["messages"][0] == bodies[0]["messages"][0]
    assert metric(media_server.base, "gemma_media_inputs_total", modality="audio") >= 1
