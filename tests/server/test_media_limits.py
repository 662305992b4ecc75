"""Media bombs: the budgets read from a file's header before it is decoded, and the media workers
(media_worker.py) that decode in processes of their own, within a deadline and a memory limit.

Each attack is sent in its own shape at a safe size, through the real server: a `python -m gemma_server`
process on the tiny checkpoint with both towers (`guarded`, module scope), whose memory is read from /proc
before and after (`rss`), and whose workers are its child processes. The pure rules (the rate set and its
filters, the JPEG scan count, the read bound of a header that lies) are checked on the functions
themselves, and the worker's memory limit on a real worker pool.

Bounds on time and memory are generous (several times what was measured), so a busy machine does not fail
them; what they guard against took minutes and gigabytes (the module's numbers in the comments were
measured on the pre-fix server, on this 2-core machine).
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import http.server
import io
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile
from PIL import Image

from gemma_server import media
from gemma_server.media_worker import Workers
from tests.checkpoints.multimodal import random_audio, random_image
from tests.server.conftest import Spawned, get_status, spawn_server, wait_for
from tests.server.test_media import refused

# The guarded server's limits: scans enough to let a scan bomb reach a worker (to be stopped there), and a
# deadline well past any real decode (a 4096 x 4096 JPEG of 100 scans decodes in 1.4 s here).
SCANS = 2000
DEADLINE = 4.0
MIB = 1 << 20


# ---------------------------------------------------------------- files shaped like the attacks


def lying_wav(rate: int, frames: int = 16) -> bytes:
    """A mono 16-bit WAV (44-byte header + 2 bytes a frame: 76 bytes for 16 frames) whose header claims
    `rate` samples a second."""
    out = io.BytesIO()
    soundfile.write(out, np.zeros(frames, np.int16), 16_000, format="WAV", subtype="PCM_16")
    data = bytearray(out.getvalue())
    struct.pack_into("<II", data, 24, rate, (rate * 2) & 0xFFFFFFFF)  # fmt chunk: sample rate, byte rate
    return bytes(data)


def constant_flac(seconds: float, rate: int, channels: int) -> bytes:
    """Silence as FLAC: CONSTANT subframes, a few bytes a block, so minutes of many channels fit in kilobytes."""
    out = io.BytesIO()
    soundfile.write(out, np.zeros((int(seconds * rate), channels), np.int16), rate, format="FLAC", subtype="PCM_16")
    return out.getvalue()


def progressive_jpeg(width: int, height: int, repeats: int) -> bytes:
    """A grey progressive JPEG as Pillow writes it (libjpeg's 6-scan script for one component), its last scan
    (an AC refinement over the whole image) then repeated `repeats` times before EOI."""
    out = io.BytesIO()
    Image.new("L", (width, height), 128).save(out, "JPEG", progressive=True)
    data = out.getvalue()
    assert data.endswith(b"\xff\xd9")
    last = data[data.rfind(b"\xff\xda"):-2]  # Pillow writes no other FF DA bytes: its last SOS to EOI
    return data[:-2] + last * repeats + b"\xff\xd9"


def jpeg_url(data: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(data).decode()


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}]


# ---------------------------------------------------------------- the process and its memory


def status_kib(pid: int, field: str) -> int:
    """A /proc/<pid>/status field in KiB (VmRSS: resident now; VmHWM: the peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def rss_mib(s: Spawned) -> float:
    return status_kib(s.proc.pid, "VmRSS") / 1024


def workers_of(s: Spawned) -> set[int]:
    """The server's child processes that are media workers (their parent id read from /proc/<pid>/stat)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            if ppid == s.proc.pid and b"gemma_server.media_worker" in (entry / "cmdline").read_bytes():
                out.add(int(entry.name))
        except (OSError, IndexError, ValueError):  # it ended meanwhile
            continue
    return out


def decoding(s: Spawned) -> dict:
    """/v1/engine's media.decoding: the workers' settings and how many were replaced."""
    return httpx.get(s.base + "/v1/engine", timeout=10).json()["media"]["decoding"]


def ready(s: Spawned) -> bool:
    """Both media workers started and ready (a fresh one imports its decoders first: seconds on a busy
    machine), so a timed decode does not wait for one to start."""
    return len(workers_of(s)) == 2 and decoding(s)["ready"] == 2


def timed(fn, *args, **kwargs):
    t0 = time.monotonic()
    out = fn(*args, **kwargs)
    return out, time.monotonic() - t0


@pytest.fixture(scope="module")
def guarded(multimodal_checkpoint, tmp_path_factory) -> Iterator[Spawned]:
    """`python -m gemma_server` on the checkpoint with both towers, default media limits except the scans
    (SCANS), the deadline (DEADLINE) and fetching from 127.0.0.1."""
    s = spawn_server(tmp_path_factory.mktemp("guarded"), "--model", str(multimodal_checkpoint),
                     "--use-installed-engine", "--dtype", "float32", "--context", "1024", "--max-num-seqs", "2",
                     "--default-temperature", "0", "--max-jpeg-scans", str(SCANS),
                     "--media-decode-timeout", str(DEADLINE), "--media-fetch-hosts", "127.0.0.1",
                     "--media-fetch-timeout", "5")
    try:
        wait_for(lambda: s.proc.poll() is not None or get_status(s.base + "/health") == 200, 300, "/health 200")
        assert s.proc.poll() is None, s.logs()[-3000:]
        wait_for(lambda: ready(s), 60, "two media workers ready")
        yield s
    finally:
        s.proc.kill()
        s.proc.wait(10)


@pytest.fixture(scope="module")
def sdk(guarded) -> openai.OpenAI:
    return openai.OpenAI(base_url=guarded.base + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(s: Spawned, messages: list[dict], timeout: float = 60, **extra) -> httpx.Response:
    return httpx.post(s.base + "/v1/chat/completions", timeout=timeout,
                      json={"messages": messages, "max_tokens": 4, **extra})


# ---------------------------------------------------------------- the rules, on the functions


def test_every_rate_taken_resamples_with_a_filter_the_rate_set_bounds():
    wave = random_audio(1.0)
    for rate in media.AUDIO_RATES:
        assert media.resample_taps(rate) <= 12_801
        clip = np.resize(wave, rate)  # one second at `rate`
        out, seconds = timed(media.resample, clip, rate)
        assert len(out) == media.SAMPLE_RATE and out.dtype == np.float32
        assert seconds < 2.0, (rate, seconds)
    # The header's rate of the attack asked resample_poly for a filter of 167,772,341 taps (+7.5 GB); a rate
    # outside the set is refused before anything is designed.
    assert media.resample_taps(8_388_617) == 167_772_341
    with pytest.raises(ValueError, match="8388617"):
        media.resample(wave[:16], 8_388_617)


def test_a_lying_wav_header_is_refused_before_a_sample_is_read():
    for rate in (8_388_617, 2**31 - 1):
        data = lying_wav(rate)
        assert len(data) == 76
        with pytest.raises(media.ApiError) as e:
            media.decode_audio(data, "p", 300.0)
        assert e.value.status == 400 and f"{rate} Hz" in e.value.message and "16,000" in e.value.message


def test_a_header_that_states_no_length_is_read_at_most_one_frame_past_the_limit():
    """A FLAC whose STREAMINFO says 0 samples (libsndfile then reports SF_COUNT_MAX frames): the header
    bounds nothing, so the read does; 40 s of audio is refused as more than the 30 s clip, read no further."""
    out = io.BytesIO()
    soundfile.write(out, (random_audio(40.0) * 20_000).astype(np.int16), 16_000, format="FLAC", subtype="PCM_16")
    data = bytearray(out.getvalue())
    at = 8 + 10  # "fLaC", the STREAMINFO block header, then rate(20) channels(3) bits(5) total samples(36)
    fields = int.from_bytes(data[at:at + 8], "big")
    data[at:at + 8] = (fields & ~((1 << 36) - 1)).to_bytes(8, "big")
    with soundfile.SoundFile(io.BytesIO(bytes(data))) as sound:
        assert sound.frames == media.UNKNOWN_FRAMES
    with pytest.raises(media.ApiError) as e:
        media.decode_audio(bytes(data), "p", 300.0, clip_seconds=30.0)
    assert "more than 30.0 s long" in e.value.message and "clip of at most 30 s" in e.value.message
    # A budget of 10 s of samples: the read stops at its 160,001st frame.
    ten_seconds = media.Limits(0, 1, 300.0, len(data), decoded_bytes=10 * 16_000 * media.SAMPLE_BYTES)
    with pytest.raises(media.ApiError) as e:
        media.decode_audio(bytes(data), "p", 300.0, limits=ten_seconds)
    assert "at least 160001 frames x 1 channels" in e.value.message, e.value.message


def test_jpeg_scans_are_counted_from_the_markers_as_libjpeg_reads_them():
    def jpeg(mode: str, **options) -> bytes:
        out = io.BytesIO()
        Image.new(mode, (64, 48), (9,) * len(mode) if mode != "L" else 9).save(out, "JPEG", **options)
        return out.getvalue()

    # libjpeg's progressive script (jcparam.c jpeg_simple_progression, which Pillow calls): 6 scans for one
    # component, 10 for YCbCr, 2 + 4 a component for CMYK; a baseline JPEG has one.
    assert [media.jpeg_scans(jpeg(m, progressive=True), 1000) for m in ("L", "RGB", "CMYK")] == [6, 10, 18]
    assert media.jpeg_scans(jpeg("RGB"), 1000) == 1
    assert media.jpeg_scans(progressive_jpeg(64, 48, 94), 1000) == 100
    assert media.jpeg_scans(progressive_jpeg(64, 48, 94), 50) == 50  # stops at the bound
    # An SOS's bytes inside a segment are not a scan; a marker right after a segment ending in 0xFF is read.
    plain = jpeg("L", progressive=True)
    hidden = plain[:2] + b"\xff\xfe\x00\x06\xff\xda\x00\xff" + plain[2:]
    assert media.jpeg_scans(hidden, 1000) == 6
    assert media.jpeg_scans(plain + plain[2:], 1000) == 6  # what follows EOI is not read
    # Linear in the bytes, whatever they are: 4 MiB of fill bytes, of stuffed zeros.
    for junk in (b"\xff" * (4 * MIB) + b"\x00", b"\xff\x00" * (2 * MIB)):
        count, seconds = timed(media.jpeg_scans, b"\xff\xd8" + junk, 1000)
        assert count == 0 and seconds < 2.0
    # decode_image refuses past the limit before the pixels are decoded, and reads up to it.
    with pytest.raises(media.ApiError, match="--max-jpeg-scans"):
        media.decode_image(progressive_jpeg(64, 48, 95), "p", 64 * 48)
    assert media.decode_image(progressive_jpeg(64, 48, 94), "p", 64 * 48).size == (64, 48)


def test_a_decode_past_the_worker_memory_is_a_400_and_the_worker_is_replaced():
    """A real worker with 64 MiB beyond its libraries decodes a 4096 x 4096 image (64 MiB as RGB): the
    allocation fails in the worker, the request gets a 400 naming the part, and a fresh worker takes its
    place and decodes the next image."""
    workers = Workers(1, 64 * MIB, 30.0)
    limits = media.Limits(8, 4096 * 4096, 300.0, 4 * MIB)
    big = media.Part("image", "messages[0].content[0]", jpeg_url(progressive_jpeg(4096, 4096, 0)))
    small = media.Part("image", "messages[0].content[1]", jpeg_url(progressive_jpeg(64, 48, 0)))

    async def run():
        async with workers.place():
            with pytest.raises(media.ApiError) as e:
                await workers.decode(big, None, limits, 0.0, 0, None)
            item = await workers.decode(small, None, limits, 0.0, 0, None)
        return e.value, item

    try:
        workers.start()
        error, item = asyncio.run(run())
    finally:
        workers.shutdown()
    assert (error.status, error.param) == (400, "messages[0].content[0]")
    assert "memory" in error.message, error.message
    assert workers.replaced == 1
    assert item.value.size == (64, 48) and item.value.mode == "RGB" and item.size == 64 * 48 * 4


# ---------------------------------------------------------------- the attacks, through the server


def test_a_lying_sample_rate_is_a_400_on_every_route_without_memory_or_time(guarded, sdk):
    """Before: a 76-byte WAV at 8,388,617 Hz took the server +7.5 GB (here, the old decode: 55.6 s and
    7.8 GB peak); 2**31 - 1 Hz was a MemoryError, a 500."""
    model = httpx.get(guarded.base + "/v1/models").json()["data"][0]["id"]
    before = rss_mib(guarded)
    for rate in (8_388_617, 2**31 - 1):
        data = lying_wav(rate)
        r, seconds = timed(chat, guarded, user(audio_part(data)))
        refused(r, "messages[0].content[0]", f"{rate} Hz", "16,000")
        assert seconds < 5.0
        with pytest.raises(openai.BadRequestError) as e:
            sdk.responses.create(model=model, max_output_tokens=4, input=[{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}]}])
        assert f"{rate} Hz" in e.value.message
        r = httpx.post(guarded.base + "/tokenize", json={"messages": user(audio_part(data))}, timeout=30)
        refused(r, "messages[0].content[0]", f"{rate} Hz")
        with pytest.raises(openai.BadRequestError) as e:
            sdk.audio.transcriptions.create(file=("lie.wav", data, "audio/wav"), model=model)
        assert f"{rate} Hz" in e.value.message and e.value.body["param"] == "file"
    assert rss_mib(guarded) - before < 50
    assert all(status_kib(pid, "VmHWM") < 600 * 1024 for pid in workers_of(guarded))


def test_a_many_channel_long_flac_is_refused_from_its_header(guarded):
    """Before: 300 s x 655,350 Hz x 8 channels in 105,866 bytes took the server from 1.0 to 7.8 GB, and the
    chat route decoded all 300 s before refusing clips over 30 s (here, 60 s x 96 kHz x 8 channels in 46 KB:
    3.2 s and +280 MB in the old decode). Each is refused from the header, in the worker, before a sample."""
    before = rss_mib(guarded)
    cases = [(constant_flac(1.0, 655_350, 8), "655350 Hz"),  # the attack's rate
             (constant_flac(30.0, 48_000, 8), "8 channels"),  # its channels, at a rate taken
             (constant_flac(31.0, 48_000, 2), "clip of at most 30 s")]  # stereo past the chat clip
    for data, words in cases:
        assert len(data) < 400_000
        r, seconds = timed(chat, guarded, user(audio_part(data, "flac")))
        refused(r, "messages[0].content[0]", words)
        assert seconds < 5.0
    r = httpx.post(guarded.base + "/v1/audio/transcriptions", timeout=30, files={"file": ("x.flac", cases[1][0])},
                   data={"model": httpx.get(guarded.base + "/v1/models").json()["data"][0]["id"]})
    refused(r, "file", "8 channels")
    assert rss_mib(guarded) - before < 50


def test_a_jpeg_scan_bomb_is_refused_by_its_scan_count_before_decoding(guarded, media_server):
    # The attack's shape: a 4096 x 4096 grey JPEG of 33-byte AC refinement scans (13.6 ms a scan here).
    bomb = progressive_jpeg(4096, 4096, SCANS)
    r, seconds = timed(chat, guarded, user(image_part(jpeg_url(bomb))))
    refused(r, "messages[0].content[0]", f"more than {SCANS} scans", "--max-jpeg-scans")
    assert seconds < 3.0  # decoding it would take 27 s
    # The default limit (100), on the in-process server with small images.
    r = httpx.post(media_server.base + "/tokenize", timeout=30,
                   json={"messages": user(image_part(jpeg_url(progressive_jpeg(200, 150, 95))))})
    refused(r, "messages[0].content[0]", "more than 100 scans")
    r = httpx.post(media_server.base + "/tokenize", timeout=30,
                   json={"messages": user(image_part(jpeg_url(progressive_jpeg(200, 150, 94))))})
    assert r.status_code == 200, r.text


def test_a_decode_past_the_deadline_is_a_400_and_its_worker_is_replaced(guarded):
    # Within the scan count, slow: 1,990 scans of 4096 x 4096 is ~27 s of decoding, stopped at DEADLINE.
    bomb = progressive_jpeg(4096, 4096, SCANS - 10)
    replaced, pids = decoding(guarded)["replaced"], workers_of(guarded)
    r, seconds = timed(chat, guarded, user(image_part(jpeg_url(bomb))))
    refused(r, "messages[0].content[0]", f"longer than {DEADLINE:g} s", "--media-decode-timeout")
    assert DEADLINE - 0.5 < seconds < DEADLINE + 6
    assert decoding(guarded)["replaced"] == replaced + 1
    wait_for(lambda: ready(guarded) and workers_of(guarded) != pids, 60, "a fresh worker")
    r = chat(guarded, user(image_part(jpeg_url(progressive_jpeg(640, 480, 0)))))
    assert r.status_code == 200, r.text


def test_a_client_that_leaves_mid_decode_stops_the_decode(guarded):
    bomb = progressive_jpeg(4096, 4096, SCANS - 10)
    replaced = decoding(guarded)["replaced"]
    wait_for(lambda: ready(guarded), 60, "two workers ready")
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        chat(guarded, user(image_part(jpeg_url(bomb))), timeout=1.0)
    # The worker is killed when the server sees the client go, well before the deadline would have.
    wait_for(lambda: decoding(guarded)["replaced"] == replaced + 1, DEADLINE, "the decode's worker killed")
    assert time.monotonic() - t0 < DEADLINE
    wait_for(lambda: ready(guarded), 60, "its replacement ready")


def test_text_chats_stay_fast_while_media_decodes_are_slow(guarded):
    """Before: six 264 KB /tokenize scan bombs took asyncio's default executor (6 threads on 2 cores), and
    every text chat timed out for 265 s while /live stayed 200. Now the bombs wait for and run in the media
    workers, two at a time, each stopped at the deadline, and text requests never queue behind them."""
    wait_for(lambda: ready(guarded), 60, "two workers ready")
    bomb = jpeg_url(progressive_jpeg(4096, 4096, SCANS - 10))
    messages = [{"role": "user", "content": "Say something."}]
    chat(guarded, messages)  # warm
    replaced = decoding(guarded)["replaced"]

    def bombard() -> tuple[int, float]:
        r, seconds = timed(httpx.post, guarded.base + "/tokenize", json={"messages": user(image_part(bomb))},
                           timeout=120)
        return r.status_code, seconds

    latencies = []
    with ThreadPoolExecutor(6) as pool:
        bombs = [pool.submit(bombard) for _ in range(6)]
        time.sleep(0.5)
        while not all(b.done() for b in bombs):
            r, seconds = timed(chat, guarded, messages, timeout=30)
            assert r.status_code == 200, r.text
            latencies.append(seconds)
        outcomes = sorted(b.result() for b in bombs)
    assert len(latencies) >= 10
    assert max(latencies) < 5.0, latencies
    # Every bomb decoded until the deadline (a 400 and its worker replaced), two at a time: three rounds of the
    # deadline and a fresh worker's start, where the six on asyncio's default executor took minutes.
    assert [status for status, _ in outcomes] == [400] * 6, outcomes
    assert decoding(guarded)["replaced"] == replaced + 6
    assert outcomes[-1][1] < 3 * (DEADLINE + 10), outcomes


def test_a_requests_decoded_bytes_are_bounded(guarded):
    """Before: eight maximum-size images cost ~0.86 GB with no per-request bound. The default
    --max-media-decoded-bytes (256 MiB) takes four 4096 x 4096 images (64 MiB each as RGB), not a fifth."""
    before = rss_mib(guarded)
    url = jpeg_url(progressive_jpeg(4096, 4096, 0))
    r = httpx.post(guarded.base + "/tokenize", json={"messages": user(*[image_part(url)] * 8)}, timeout=60)
    refused(r, "messages[0].content[4]", "--max-media-decoded-bytes", "other media took 268435456")
    assert rss_mib(guarded) - before < 600  # four 64 MiB images as the server holds them, at most
    r = httpx.post(guarded.base + "/tokenize", json={"messages": user(*[image_part(url)] * 4)}, timeout=60)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- fetching


class Encoded(http.server.BaseHTTPRequestHandler):
    """Serves the server's `files` ({path: (body, Content-Encoding or None)}) and records each request's
    Accept-Encoding."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.seen.append(self.headers.get("Accept-Encoding"))  # type: ignore[attr-defined]
        body, encoding = self.server.files[self.path]  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if encoding:
            self.send_header("Content-Encoding", encoding)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def encoded_host() -> Iterator[http.server.ThreadingHTTPServer]:
    png = io.BytesIO()
    random_image(40, 30, seed=1).save(png, format="PNG")
    inner = gzip.compress(b"\0" * (64 * MIB), 9)  # 64 MiB of zeros: 65 KB
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Encoded)
    httpd.files = {"/plain.png": (png.getvalue(), None), "/identity.png": (png.getvalue(), "identity"),  # type: ignore[attr-defined]
                   "/gzip.png": (gzip.compress(png.getvalue()), "gzip"),
                   "/bomb.png": (gzip.compress(inner, 9), "gzip, gzip")}
    httpd.seen = []  # type: ignore[attr-defined]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()


def test_a_fetched_body_with_a_content_encoding_is_refused_and_never_inflated(guarded, encoded_host):
    """Before: a 6,777-byte body sent with `Content-Encoding: gzip, gzip` was inflated by httpx on the event
    loop, before the size cap (22 s, 2.0 to 10.2 GB). Here a smaller one (64 MiB inside)."""
    base = f"http://127.0.0.1:{encoded_host.server_address[1]}"
    before = rss_mib(guarded)
    bomb = encoded_host.files["/bomb.png"][0]
    assert len(bomb) < 10_000
    for path, words in (("/bomb.png", "'gzip, gzip'"), ("/gzip.png", "'gzip'")):
        (r, seconds) = timed(chat, guarded, user(image_part(base + path)))
        refused(r, "messages[0].content[0]", "Content-Encoding", words)
        assert seconds < 3.0
    assert rss_mib(guarded) - before < 50
    for path in ("/plain.png", "/identity.png"):
        r = chat(guarded, user(image_part(base + path)))
        assert r.status_code == 200, r.text
    assert set(encoded_host.seen) == {"identity"}
