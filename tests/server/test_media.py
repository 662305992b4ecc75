"""Images and audio through the server: chat parts, the Responses API, the MCP `ask` tool, the transcription
and translation routes, the limits, and parity with Transformers' own Gemma 4 processor and model.

Everything runs on the real engine and media encoder over the tiny checkpoint with both towers
(tests/checkpoints/multimodal.py `save_multimodal`: random weights, Google's Gemma 4 chat template, Transformers'
processor config), served in-process in float32 and greedy by default (conftest.py `media_server`, with
MEDIA_LIMITS low enough to cross). The reference is Transformers 5.18: `Gemma4Processor` with the Pillow image
processor (the server's; the torchvision one rounds resizes differently) and `Gemma4ForConditionalGeneration`
in float32. Random weights write endless strings, so every reply is bounded by max_tokens.
"""

from __future__ import annotations

import base64
import http.server
import io
import os
import threading
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import soundfile
import torch

from gemma_server import media, media_encoder
from gemma_server.protocol.requests import ChatCompletionRequest
from gemma_server.frontends.transcriptions import chat_request, max_tokens_for
from tests.checkpoints.multimodal import load_multimodal_reference, random_audio, random_image
from tests.server.conftest import MEDIA_LIMITS, InProcessServer, openai_client, sample, start_in_process
from tests.server.frontends.test_mcp_server import call

QUESTION = "What is in the picture?"


# ---------------------------------------------------------------- helpers


def png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def wav(wave: np.ndarray, rate: int = 16_000, subtype: str = "FLOAT", fmt: str = "WAV") -> bytes:
    """A file of `wave` (float32 WAV by default: decoding it gives the very samples back)."""
    out = io.BytesIO()
    soundfile.write(out, wave, rate, format=fmt, subtype=subtype)
    return out.getvalue()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def user(*parts: dict, text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def chat(server: InProcessServer, messages: list[dict], **extra) -> httpx.Response:
    return httpx.post(server.base + "/v1/chat/completions", timeout=120,
                      json={"messages": messages, "max_tokens": 8, **extra})


def refused(r: httpx.Response, param: str, *words: str) -> str:
    """Assert `r` is a 400 in OpenAI's shape naming `param`, its message holding `words`; the message."""
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", 400, param), error
    assert all(w in error["message"] for w in words), error["message"]
    return error["message"]


IMAGE = random_image(40, 30, seed=1)
CLIP = random_audio(1.0, seed=0)


@pytest.fixture(scope="module")
def client(media_server) -> openai.OpenAI:
    return openai_client(media_server)


@pytest.fixture(scope="module")
def model(media_server) -> str:
    return media_server.state.config.model_name


@pytest.fixture(scope="module")
def processor(multimodal_checkpoint):
    """Transformers' Gemma4Processor for the checkpoint, with the Pillow image processor the server uses."""
    from transformers import AutoProcessor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    d = str(multimodal_checkpoint)
    return AutoProcessor.from_pretrained(d, image_processor=Gemma4ImageProcessorPil.from_pretrained(d))


@pytest.fixture(scope="module")
def reference(multimodal_checkpoint):
    return load_multimodal_reference(multimodal_checkpoint)


def hf_inputs(processor, content: list[dict]) -> dict:
    """The processor's inputs for one user turn of Transformers' content items (apply_chat_template, as a
    Transformers user calls it)."""
    return processor.apply_chat_template([{"role": "user", "content": content}], tokenize=True, return_dict=True,
                                         add_generation_prompt=True, return_tensors="pt")


# ---------------------------------------------------------------- parity with Transformers' processor


def test_prompt_ids_and_model_inputs_equal_gemma4_processors(multimodal_checkpoint, processor):
    import gemma_engine
    from transformers import AutoTokenizer

    d = str(multimodal_checkpoint)
    images = [random_image(40, 30, seed=1), random_image(23, 57, seed=2)]
    clip = random_audio(1.3, seed=4)
    hf = processor.apply_chat_template(
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image", "image": images[0]},
                                      {"type": "text", "text": " with "}, {"type": "image", "image": images[1]},
                                      {"type": "audio", "audio": clip}, {"type": "text", "text": " please."}]}],
        tokenize=True, return_dict=True, add_generation_prompt=True, return_tensors="pt")

    # The server's side: the bytes a client sends, decoded (gemma_server.media), pre-processed and placed
    # (gemma_server.media_encoder).
    request = ChatCompletionRequest(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, image_part(data_url(png(images[0]))),
                                     {"type": "text", "text": " with "}, image_part(data_url(png(images[1]))),
                                     audio_part(wav(clip)), {"type": "text", "text": " please."}]}])
    decoded = [media.decode(p, media.inline_bytes(p, 1 << 20), media.Limits(8, 1 << 20, 60, 1 << 20))
               for p in request.media_parts()]
    image_processor, extractor = media_encoder.processors(multimodal_checkpoint, vision=True, audio=True)
    pixels = media_encoder.image_inputs(image_processor, [d.value for d in decoded[:2]])
    features = media_encoder.audio_inputs(extractor, [decoded[2].value])
    assert torch.equal(pixels["pixel_values"], hf["pixel_values"])
    assert torch.equal(pixels["image_position_ids"], hf["image_position_ids"])
    assert torch.equal(features["input_features"], hf["input_features"])
    assert torch.equal(features["input_features_mask"], hf["input_features_mask"])

    # Soft-token counts: the image processor's, and the rows the engine's audio encoder returns.
    encoder = gemma_engine.Encoder(d, dtype="float32")
    image_rows = [e.shape[0] for e in encoder.image(pixels["pixel_values"], pixels["image_position_ids"])]
    assert image_rows == pixels["num_soft_tokens_per_image"].tolist()
    audio_rows = encoder.audio(features["input_features"], features["input_features_mask"])[0].shape[0]
    tokens = media_encoder.Tokens(encoder.image_token_id, encoder.audio_token_id, encoder.boi_token_id,
                                  encoder.eoi_token_id, encoder.boa_token_id, encoder.eoa_token_id)
    ids, starts = media_encoder.prompt_ids(AutoTokenizer.from_pretrained(d), request,
                                           [("image", image_rows[0]), ("image", image_rows[1]), ("audio", audio_rows)],
                                           tokens)
    assert ids == hf["input_ids"][0].tolist()
    assert [ids[s - 1] for s in starts] == [tokens.boi, tokens.boi, tokens.boa]
    assert [ids[s + n] for s, n in zip(starts, [*image_rows, audio_rows])] == [tokens.eoi, tokens.eoi, tokens.eoa]


def test_the_servers_tokenize_gives_the_processors_ids(media_server, processor):
    r = httpx.post(media_server.base + "/tokenize", timeout=120, json={"messages": user(
        image_part(data_url(png(IMAGE))), audio_part(wav(CLIP)))})
    assert r.status_code == 200, r.text
    hf = hf_inputs(processor, [{"type": "image", "image": IMAGE}, {"type": "audio", "audio": CLIP},
                               {"type": "text", "text": QUESTION}])
    assert r.json()["tokens"] == hf["input_ids"][0].tolist()


# ---------------------------------------------------------------- the model reads the soft tokens


def greedy_tokens(reference, inputs: dict, tokenizer, eos: set[int], n: int) -> list[str]:
    """Transformers' greedy continuation of `inputs` (its first n tokens, up to an eos, which the engine does
    not return), each token's text."""
    with torch.no_grad():
        out = reference.generate(**inputs, do_sample=False, max_new_tokens=n)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    new = new[:next((i for i, t in enumerate(new) if t in eos), len(new))]
    return [tokenizer.decode([t]) for t in new]


@pytest.mark.parametrize("kind", ["image", "audio"])
def test_the_greedy_reply_is_transformers_greedy_generate(media_server, client, model, processor, reference, kind):
    tok = processor.tokenizer
    eos = set(reference.generation_config.eos_token_id or [])
    if kind == "image":
        picture = random_image(48, 40, seed=5)
        part, item = image_part(data_url(png(picture))), {"type": "image", "image": picture}
    else:
        clip = random_audio(1.5, seed=6)
        part, item = audio_part(wav(clip)), {"type": "audio", "audio": clip}
    inputs = hf_inputs(processor, [item, {"type": "text", "text": "Describe it."}])
    want = greedy_tokens(reference, inputs, tok, eos, 16)

    r = client.chat.completions.create(model=model, messages=user(part, text="Describe it."), max_tokens=16,
                                       temperature=0, logprobs=True)
    assert r.usage.prompt_tokens == inputs["input_ids"].shape[1]
    assert [t.token for t in r.choices[0].logprobs.content] == want


# ---------------------------------------------------------------- the OpenAI SDK: chat

def test_chat_with_an_image_and_with_audio_answers_through_the_sdk(media_server, client, model):
    before = {k: sample(media_server, "gemma_media_inputs_total", modality=k) for k in ("image", "audio")}
    r = client.chat.completions.create(model=model, messages=user(image_part(data_url(png(IMAGE)))), max_tokens=8)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert isinstance(r.choices[0].message.content, str)
    r = client.chat.completions.create(model=model, messages=user(audio_part(wav(CLIP), "wav")), max_tokens=8)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    # Another rate and two channels, as flac and mp3: decoded, averaged to mono and resampled to 16 kHz.
    stereo = np.stack([CLIP, CLIP[::-1]], axis=1)
    for data, fmt in ((wav(stereo, 44_100, "PCM_16", "FLAC"), "flac"),
                      (wav(CLIP, 22_050, "MPEG_LAYER_III", "MP3"), "mp3")):
        r = client.chat.completions.create(model=model, messages=user(audio_part(data, fmt)), max_tokens=4)
        assert r.usage.completion_tokens == 4
    streamed = client.chat.completions.create(model=model, messages=user(image_part(data_url(png(IMAGE)))),
                                              max_tokens=8, stream=True)
    assert sum(1 for c in streamed if c.choices and c.choices[0].delta.content is not None) >= 1
    after = {k: sample(media_server, "gemma_media_inputs_total", modality=k) for k in ("image", "audio")}
    assert (after["image"] - before["image"], after["audio"] - before["audio"]) == (2, 3)
    assert sample(media_server, "gemma_media_encode_seconds_count", modality="image") >= 2


def test_the_choices_of_one_request_share_its_image(media_server, client, model):
    before = sample(media_server, "gemma_media_inputs_total", modality="image")
    r = client.chat.completions.create(model=model, messages=user(image_part(data_url(png(IMAGE)))), max_tokens=8,
                                       n=3, temperature=0)
    assert len({c.message.content for c in r.choices}) == 1 and r.usage.completion_tokens == 24
    assert sample(media_server, "gemma_media_inputs_total", modality="image") == before + 1  # encoded once


def test_the_same_image_resumes_the_prefix_cache_and_another_does_not(media_server):
    first = random_image(36, 36, seed=11)
    other = random_image(36, 36, seed=12)  # the same size: the same placeholder ids, another key
    messages = lambda image: user(image_part(data_url(png(image))), text="Say something.")  # noqa: E731
    a = chat(media_server, messages(first)).json()
    b = chat(media_server, messages(first)).json()
    c = chat(media_server, messages(other)).json()
    ids = httpx.post(media_server.base + "/tokenize", json={"messages": messages(first)}).json()["tokens"]
    start = ids.index(media_server.state.loaded.media.tokens.image)
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"] == c["usage"]["prompt_tokens"] == len(ids)
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] > start + 1  # past the image
    assert c["usage"]["prompt_tokens_details"]["cached_tokens"] <= start  # stopped at the image


# ---------------------------------------------------------------- transcriptions and translations


def upload(wave: np.ndarray = CLIP) -> tuple[str, bytes, str]:
    return ("clip.wav", wav(wave), "audio/wav")


def chat_transcript(server: InProcessServer, task: str, language: str | None, seconds: float) -> str:
    """What the chat route writes for the transcription's own chat request (same clip, same instruction)."""
    body = chat_request(server.state.config.model_name, task, language, None, 0.0, seconds, False)
    messages = body.model_dump(exclude_none=True)["messages"]
    messages[0]["content"][0] = audio_part(wav(CLIP))
    r = chat(server, messages, max_tokens=max_tokens_for(seconds), temperature=0)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"].strip()


def test_transcriptions_and_translations_through_the_sdk_are_the_chat_routes_replies(media_server, client, model):
    want = chat_transcript(media_server, "transcribe", "English", 1.0)
    r = client.audio.transcriptions.create(file=upload(), model=model, language="en")
    assert r.text == want
    assert r.usage.type == "tokens" and r.usage.output_tokens >= 1
    assert r.usage.input_token_details.audio_tokens == 25  # 1 s of audio: 25 soft tokens of 40 ms
    assert client.audio.transcriptions.create(file=upload(), model=model, language="en",
                                              response_format="text") == want
    verbose = client.audio.transcriptions.create(file=upload(), model=model, language="en",
                                                 response_format="verbose_json", timestamp_granularities=["segment"])
    assert (verbose.text, verbose.language, verbose.duration) == (want, "english", 1.0)
    [segment] = verbose.segments
    assert (segment.id, segment.start, segment.end, segment.text) == (0, 0.0, 1.0, want)
    assert len(segment.tokens) >= 1 and segment.avg_logprob < 0

    translated = chat_transcript(media_server, "translate", None, 1.0)
    with pytest.deprecated_call():  # the SDK marks OpenAI's translations route deprecated
        assert client.audio.translations.create(file=upload(), model=model).text == translated
        verbose = client.audio.translations.create(file=upload(), model=model, response_format="verbose_json")
    assert (verbose.text, verbose.language) == (translated, "english")


def test_a_streamed_transcription_sends_deltas_then_done(media_server, client, model):
    whole = client.audio.transcriptions.create(file=upload(), model=model)
    events = list(client.audio.transcriptions.create(file=upload(), model=model, stream=True))
    assert [e.type for e in events] == ["transcript.text.delta"] * (len(events) - 1) + ["transcript.text.done"]
    assert len(events) >= 2
    done = events[-1]
    assert done.text == whole.text == "".join(e.delta for e in events[:-1]).rstrip()
    assert done.usage.output_tokens == whole.usage.output_tokens


def test_long_audio_is_cut_into_clips_at_a_pause():
    rate = media.SAMPLE_RATE
    wave = np.concatenate([np.full(int(rate * 27.3), 0.5), np.zeros(rate // 5), np.full(rate * 12, 0.5)])
    clips = media.split_clip(wave.astype(np.float32), 30 * rate)
    assert [len(c) for c in clips] != [30 * rate, len(wave) - 30 * rate]
    assert sum(len(c) for c in clips) == len(wave) and all(len(c) <= 30 * rate for c in clips)
    cut = len(clips[0])
    assert int(rate * 27.3) <= cut <= int(rate * 27.5)  # inside the silence
    assert len(media.split_clip(wave[: 10 * rate], 30 * rate)) == 1


# ---------------------------------------------------------------- the Responses API and MCP


def test_responses_input_image_and_input_audio_give_the_chat_routes_replies(media_server, client, model):
    url, clip = data_url(png(IMAGE)), wav(CLIP)
    want = chat(media_server, user(image_part(url), audio_part(clip)), max_tokens=8).json()
    r = client.responses.create(model=model, max_output_tokens=8, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": url, "detail": "auto"},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}},
        {"type": "input_text", "text": QUESTION}]}])
    assert r.output_text == want["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == want["usage"]["prompt_tokens"]


def test_the_mcp_ask_tool_takes_an_image(media_server):
    url = data_url(png(IMAGE))
    got = call(media_server.base, "ask", {"prompt": QUESTION, "image": url, "max_tokens": 8})
    assert not got.is_error, got.content
    want = chat(media_server, user(image_part(url))).json()
    assert got.structured_content["text"] == want["choices"][0]["message"]["content"]
    assert got.structured_content["prompt_tokens"] == want["usage"]["prompt_tokens"]
    bad = call(media_server.base, "ask", {"prompt": QUESTION, "image": "data:image/png;base64,AAAA"})
    assert bad.is_error and "400" in bad.content[0].text and "messages[0].content[0]" in bad.content[0].text


# ---------------------------------------------------------------- refusals: limits, bad files, no tower


def noise_png(width: int, height: int) -> bytes:
    rng = np.random.default_rng(0)
    from PIL import Image

    return png(Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)))


def test_each_limit_is_a_400_naming_the_part_and_the_flag(media_server):
    url = data_url(png(IMAGE))
    refused(chat(media_server, user(image_part(url), image_part(url), image_part(url))),
            "messages[0].content[2]", "at most 2 images", "--max-images-per-request")
    refused(chat(media_server, user(image_part(data_url(png(random_image(201, 150)))))),
            "messages[0].content[0]", "201x150", "--max-image-pixels")
    big = os.urandom(MEDIA_LIMITS["--max-media-bytes"] + 1)  # refused by its size, before it is decoded
    refused(chat(media_server, user(image_part(data_url(big)))), "messages[0].content[0]", "--max-media-bytes")
    refused(chat(media_server, user(audio_part(wav(random_audio(4.5), subtype="PCM_16")))), "messages[0].content[0]",
            "4.5 s", "--max-audio-seconds")
    # Seconds count over the request: two clips of 2.5 s are more than 4 s.
    two = wav(random_audio(2.5), subtype="PCM_16")
    refused(chat(media_server, user(audio_part(two), audio_part(two))), "messages[0].content[1]", "--max-audio-seconds")
    r = httpx.post(media_server.base + "/v1/audio/transcriptions", timeout=60,
                   files={"file": ("long.wav", wav(random_audio(5.0), subtype="PCM_16"))}, data={"model": "x"})
    assert r.status_code == 404  # the model is checked first
    r = httpx.post(media_server.base + "/v1/audio/transcriptions", timeout=60,
                   data={"model": media_server.state.config.model_name},
                   files={"file": ("long.wav", wav(random_audio(5.0), subtype="PCM_16"))})
    refused(r, "file", "--max-audio-seconds")


def test_corrupt_or_unsupported_files_are_400s_never_500s(media_server):
    good = png(IMAGE)
    gif = io.BytesIO()
    random_image(20, 20).convert("P").save(gif, format="GIF")
    tiff = io.BytesIO()
    IMAGE.save(tiff, format="TIFF")
    cases = [
        (image_part(data_url(good[: len(good) // 2])), "corrupt"),
        (image_part(data_url(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)), ""),
        (image_part(data_url(tiff.getvalue(), "image/tiff")), "PNG, JPEG"),
        (image_part("data:image/png;base64,not base64!"), "base64"),
        (image_part("data:image/png," + "abc"), "base64"),
        (image_part("data:text/plain;base64,AAAA"), "image/"),
        (image_part("data:image/png;base64,"), "empty"),
        (audio_part(b"RIFF" + b"\0" * 100), "wav, flac, mp3 or ogg"),
        (audio_part(good), "wav, flac, mp3 or ogg"),
        (audio_part(wav(CLIP, fmt="AIFF", subtype="PCM_16")), "AIFF"),
        (audio_part(wav(np.zeros(0, dtype=np.float32))), "no samples"),
    ]
    for part, words in cases:
        refused(chat(media_server, user(part)), "messages[0].content[0]", words)
    # What the processors take at the edges: one pixel, an image in palette mode, a clip shorter than a frame.
    for part in (image_part(data_url(png(random_image(1, 1)))), image_part(data_url(gif.getvalue(), "image/gif")),
                 audio_part(wav(CLIP[:100]))):
        r = chat(media_server, user(part))
        assert r.status_code in (200, 400), r.text
    bad_format = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(CLIP)).decode(),
                                                         "format": "ogg"}}
    refused(chat(media_server, user(bad_format)), "messages[0].content[0].input_audio.format")
    r = httpx.post(media_server.base + "/v1/audio/transcriptions", timeout=60,
                   data={"model": media_server.state.config.model_name}, files={"file": ("x.png", good)})
    refused(r, "file", "wav, flac, mp3 or ogg")
    r = httpx.post(media_server.base + "/v1/audio/transcriptions", timeout=60,
                   data={"model": media_server.state.config.model_name, "language": "klingon"},
                   files={"file": upload()})
    refused(r, "language", "klingon")
    r = httpx.post(media_server.base + "/v1/audio/transcriptions", timeout=60,
                   data={"model": media_server.state.config.model_name, "response_format": "srt"},
                   files={"file": upload()})
    refused(r, "response_format")
    # Media only in a user turn; a clip is at most the model's 30 s (here past the limit first).
    refused(chat(media_server, [{"role": "system", "content": [image_part(data_url(good))]},
                                {"role": "user", "content": "hi"}]), "messages[0].content[0]", "user message")
    assert httpx.get(media_server.base + "/health").status_code == 200


def test_an_image_url_is_refused_while_fetching_is_off(media_server):
    refused(chat(media_server, user(image_part("https://example.com/cat.png"))), "messages[0].content[0]",
            "--media-fetch-hosts", "data URL")


def test_a_text_only_checkpoint_refuses_media_saying_so(server):
    refused(chat(server, user(image_part(data_url(png(IMAGE))))), "messages[0].content[0]",
            "no image input", "no vision or audio tower", "vision_config")
    refused(chat(server, user(audio_part(wav(CLIP)))), "messages[0].content[0]", "no audio input")
    r = httpx.post(server.base + "/v1/audio/transcriptions", timeout=60, files={"file": upload()},
                   data={"model": server.state.config.model_name})
    refused(r, "file", "no audio input")
    assert httpx.get(server.base + "/v1/engine").json()["media"]["modalities"] == []


def test_the_document_lists_media_only_where_the_checkpoint_takes_them(media_server, server):
    doc = httpx.get(media_server.base + "/openapi.json").json()
    parts = doc["components"]["schemas"]["ChatMessage"]["properties"]["content"]["anyOf"][1]["items"]["oneOf"]
    assert [p["$ref"].rsplit("/", 1)[1] for p in parts] == ["TextPart", "ImagePart", "AudioPart"]
    assert doc["components"]["schemas"]["ImageUrl"]["properties"]["url"]["pattern"].startswith("^data:image/")
    form = doc["paths"]["/v1/audio/transcriptions"]["post"]["requestBody"]["content"]
    assert list(form) == ["multipart/form-data"]
    assert "/v1/audio/translations" in doc["paths"]
    text_only = httpx.get(server.base + "/openapi.json").json()
    parts = text_only["components"]["schemas"]["ChatMessage"]["properties"]["content"]["anyOf"][1]["items"]["oneOf"]
    assert [p["$ref"].rsplit("/", 1)[1] for p in parts] == ["TextPart"]
    assert not {"/v1/audio/transcriptions", "/v1/audio/translations"} & set(text_only["paths"])
    assert httpx.get(media_server.base + "/v1/engine").json()["media"]["modalities"] == ["image", "audio"]


# ---------------------------------------------------------------- fetching image URLs, when allowed


class Files(http.server.BaseHTTPRequestHandler):
    """/cat.png (the test image), /redirect (to it), anything else 404; bodies as set on the server."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        files = self.server.files  # type: ignore[attr-defined]
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
        elif self.path in files:
            body = files[self.path]
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    httpd.files = {"/cat.png": png(IMAGE), "/big.png": noise_png(700, 600)}  # type: ignore[attr-defined]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def fetching_server(multimodal_checkpoint) -> Iterator[InProcessServer]:
    s = start_in_process(multimodal_checkpoint, "--default-temperature", "0", "--max-num-seqs", "2",
                         "--media-fetch-hosts", "127.0.0.1", "--media-fetch-timeout", "5",
                         "--max-media-bytes", "1100000")
    yield s
    s.stop()


def test_an_allowed_host_is_fetched_and_reads_as_the_data_url(fetching_server, image_host):
    fetched = chat(fetching_server, user(image_part(image_host + "/cat.png"))).json()
    inline = chat(fetching_server, user(image_part(data_url(png(IMAGE))))).json()
    assert fetched["choices"][0]["message"]["content"] == inline["choices"][0]["message"]["content"]
    assert inline["usage"]["prompt_tokens_details"]["cached_tokens"] > 10  # the same bytes: the same key
    refused(chat(fetching_server, user(image_part(image_host + "/missing.png"))), "messages[0].content[0]", "404")
    refused(chat(fetching_server, user(image_part(image_host + "/redirect"))), "messages[0].content[0]", "302")
    refused(chat(fetching_server, user(image_part(image_host + "/big.png"))), "messages[0].content[0]",
            "--max-media-bytes")
    other = image_host.replace("127.0.0.1", "localhost")
    refused(chat(fetching_server, user(image_part(other + "/cat.png"))), "messages[0].content[0]", "'localhost'")
    refused(chat(fetching_server, user(image_part("ftp://127.0.0.1/cat.png"))), "messages[0].content[0]", "http(s)")


def test_a_chat_clip_is_at_most_the_models_30_seconds(fetching_server):
    refused(chat(fetching_server, user(audio_part(wav(random_audio(31.0), subtype="PCM_16")))),
            "messages[0].content[0]", "30 s", "/v1/audio/transcriptions")
