"""Images and audio in a request: read, budgeted from their headers and decoded in a worker process (then
pre-processed, turned into soft tokens and placed in the prompt: media_encoder.py).

A media file is a program its decoder runs: a 76-byte WAV header may claim millions of samples a second, a
100 KB FLAC may hold minutes of eight channels at any rate, a progressive JPEG may repeat its scans, each a
pass over the whole image (libjpeg-turbo's report "Two Issues with the JPEG Standard", LJT-01-003). So every
cost that a header states is checked before a pixel or sample is decoded, and what the header cannot bound
runs in a worker process that can be stopped (media_worker.py).

The path of one media part (a chat `image_url` or `input_audio` part, a Responses `input_image` or
`input_audio`, a transcription's file):

1. `Part` -> bytes: a data URL or base64 (`inline_bytes`), or, where the server is told to fetch
   (`--media-fetch-hosts`), an http(s) URL whose host is on that list (`fetch`: no redirects, a byte cap, a
   deadline). It asks for `Accept-Encoding: identity`, reads the raw body (httpx's `aiter_raw`) and refuses a
   body with any other Content-Encoding, so the cap counts every byte that is decoded: httpx 0.28 would
   otherwise inflate it on the event loop, one decoder per coding listed (`_models.py` `_get_content_decoder`),
   before any cap saw it. Every limit is a 400 naming the part and the flag.
2. bytes -> `Decoded`, in a worker process (media_worker.py: a memory and CPU limit of its own, a deadline,
   killed when its client leaves), the budgets read from the header first:
   - an image with Pillow (`decode_image`): width x height against --max-image-pixels; its decoded size
     (4 bytes a pixel, Pillow's RGB) against what the request has left of --max-media-decoded-bytes; a JPEG's
     scans counted from its markers (`jpeg_scans`) against --max-jpeg-scans; then the pixels, converted to
     RGB as Gemma4Processor's `do_convert_rgb` converts them (transformers image_transforms.convert_to_rgb);
   - audio with libsndfile through soundfile (`decode_audio`: WAV, FLAC, MP3 or Ogg): its sample rate one of
     AUDIO_RATES and at most MAX_AUDIO_CHANNELS channels (a 400 naming them otherwise); its frames against
     the request's seconds (--max-audio-seconds), a chat clip's 30 s, and its samples (frames x channels x 4
     bytes of float32) against --max-media-decoded-bytes; then at most that many frames + 1 are read, in
     blocks averaged to mono as they come (so a header that lies cannot make it read more, nor hold more
     than a block of its channels), and another rate than the model's 16 kHz is resampled with scipy's
     polyphase filter, whose length grows with the rates' ratio and is bounded by the rate set (`resample`).
   Its `key` is 63 bits of the sha256 of what was decoded: the prefix cache compares media positions by it
   (rust/python/gemma_engine `Request`'s `media`), so the same image resumes a cached prompt and another does
   not. A transcription's file is cut into the clips the model reads whole there too (`cut_clips`).

The rest of the path (pre-processing, soft tokens, the prompt) is media_encoder.py's, whose `soft_tokens` runs
it all for one request: the parts decoded here in a worker, then encoded. A MemoryError anywhere on it is a 400
naming the part, never a 500.

Pure functions hold the rules (`check_parts`, `inline_bytes`, `jpeg_scans`, `decode_*`, `resample`,
`split_clip`); the side effects are at the edges (`fetch`, the workers).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import hashlib
import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gemma_server.errors import ApiError, bad_request


Kind = Literal["image", "audio"]
# The model's audio rate: Gemma4AudioFeatureExtractor's `sampling_rate`.
SAMPLE_RATE = 16_000
# What Pillow may open (its other formats are refused before they are parsed).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# What libsndfile reads that a client sends: `SoundFile.format` names.
AUDIO_FORMATS = ("WAV", "WAVEX", "FLAC", "MP3", "OGG")
AUDIO_FORMAT_NAMES = "wav, flac, mp3 or ogg"
# The sample rates a client's audio may have: telephony's 8 kHz to 48 kHz, the rates of WAV, FLAC, MP3
# (MPEG-1, -2 and 2.5 layer III: 8 to 48 kHz), Vorbis and Opus (48 kHz) files as recorders and browsers write
# them. Resampling one of them to 16 kHz designs a filter of 2 * 10 * max(up, down) + 1 taps (scipy 1.17
# signal/_signaltools.py `resample_poly`, up/down the rates' ratio in lowest terms): at most 12,801 (11,025
# Hz: 640/441), where a header's 8,388,617 Hz asked for 167,772,341.
AUDIO_RATES = (8_000, 11_025, 12_000, 16_000, 22_050, 24_000, 32_000, 44_100, 48_000)
# Mono and stereo: what speech is recorded in (the model hears one channel: they are averaged).
MAX_AUDIO_CHANNELS = 2
# Decoded bytes a budget counts: a pixel as Pillow holds RGB (4 bytes), a sample as libsndfile gives float32.
PIXEL_BYTES = 4
SAMPLE_BYTES = 4
# Frames read from a sound file at a time (averaged to mono as they come).
READ_FRAMES = 1 << 16
# What libsndfile (1.2) gives as the frame count of a stream that does not state it: SF_COUNT_MAX.
UNKNOWN_FRAMES = (1 << 63) - 1
# The most scans a JPEG may hold by default (--max-jpeg-scans). Encoders write few: libjpeg's progressive
# script (jcparam.c `jpeg_simple_progression`, which Pillow's JpegEncode.c calls for `progressive=True`) has
# 10 scans for YCbCr and 2 + 4 per component otherwise, 18 for CMYK, the most components Pillow reads;
# mozjpeg's has 11. Each scan is a pass over the whole image (13.6 ms at 4096 x 4096 on a 2-core EPYC), and
# the format lets a file repeat them; libjpeg-turbo's own fuzzers stop at 500 (TJPARAM_SCANLIMIT).
MAX_JPEG_SCANS = 100
# --max-media-decoded-bytes's default, for callers of the pure functions that give no Limits.
DECODED_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """What one request may hold (config.py's flags).

    Attributes:
        images: images per request.
        image_pixels: width x height of one image.
        audio_seconds: seconds of audio per request, every clip together.
        item_bytes: bytes of one image or audio file as sent.
        fetch_hosts: host names whose http(s) URLs are fetched; empty: none.
        fetch_timeout: seconds to fetch one URL.
        decoded_bytes: bytes the request's parts decode to, all together (PIXEL_BYTES a pixel, SAMPLE_BYTES a
            sample of every channel).
        jpeg_scans: scans one JPEG may hold.
    """

    images: int
    image_pixels: int
    audio_seconds: float
    item_bytes: int
    fetch_hosts: frozenset[str] = frozenset()
    fetch_timeout: float = 10.0
    decoded_bytes: int = DECODED_BYTES
    jpeg_scans: int = MAX_JPEG_SCANS

    @classmethod
    def of(cls, config) -> Limits:
        return cls(config.max_images_per_request, config.max_image_pixels, config.max_audio_seconds,
                   config.max_media_bytes, config.fetch_hosts, config.media_fetch_timeout,
                   config.max_media_decoded_bytes, config.max_jpeg_scans)


@dataclass(frozen=True)
class Part:
    """One media part of a request, as sent.

    Attributes:
        kind: "image" or "audio".
        param: the request field it is (`messages[0].content[1]`), named by its 400s.
        source: a data URL or an http(s) URL (images), or base64 (audio; a data URL is taken too).
    """

    kind: Kind
    param: str
    source: str


@dataclass(frozen=True)
class Decoded:
    """A part's content, read.

    Attributes:
        kind, param: as the Part's.
        value: an RGB `PIL.Image.Image` (loaded), or audio as float32 mono samples at SAMPLE_RATE.
        key: 63 bits of the sha256 of the bytes decoded (the prefix cache's key of its positions).
        seconds: the audio's length (0 for an image).
        size: the bytes its decoding counted against --max-media-decoded-bytes.
    """

    kind: Kind
    param: str
    value: Any
    key: int
    seconds: float = 0.0
    size: int = 0


def content_key(data: bytes) -> int:
    """63 bits of the sha256 of `data`: a key the engine takes as a non-negative 64-bit integer."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") >> 1


# ---- the checks that need no decoding -----------------------------------------------------------------


def check_parts(parts: Sequence[Part], limits: Limits, modalities: Sequence[str], missing: str) -> None:
    """Refuse what can be refused before anything is read: a kind the checkpoint does not take, more images
    than the limit, a URL the server does not fetch.

    Args:
        parts: the request's media parts, in order.
        limits: the server's limits.
        modalities: what the checkpoint takes ("image", "audio").
        missing: why it takes no media at all (`MediaEncoder.load`'s reason), or "".
    Raises:
        ApiError: 400 naming the part.
    """
    images = 0
    for part in parts:
        if part.kind not in modalities:
            why = (missing if not modalities and missing
                   else f"the checkpoint has no {'vision' if part.kind == 'image' else 'audio'} tower")
            raise bad_request(part.param, f"This model takes no {part.kind} input: {why}.")
        if part.kind == "image":
            images += 1
            if images > limits.images:
                raise bad_request(part.param, f"A request holds at most {limits.images} images "
                                              f"(--max-images-per-request).")
            if not part.source.startswith("data:"):
                check_url(part.source, part.param, limits)


def check_url(url: str, param: str, limits: Limits) -> None:
    """An image URL the server may fetch: http(s), its host on --media-fetch-hosts.

    Raises:
        ApiError: 400 naming `param` and what to send instead.
    """
    import httpx

    if not limits.fetch_hosts:
        raise bad_request(param, "This server does not fetch image URLs (--media-fetch-hosts is empty): send the "
                                 "image inline as a data URL (data:image/png;base64,...).")
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as e:
        raise bad_request(param, f"The image URL is not a URL: {e}") from None
    if parsed.scheme not in ("http", "https"):
        raise bad_request(param, "An image URL is a data URL or an http(s) URL.")
    if parsed.host.lower() not in limits.fetch_hosts:
        raise bad_request(param, f"The image URL's host {parsed.host[:100]!r} is not one this server fetches from "
                                 f"(--media-fetch-hosts).")


# ---- bytes ---------------------------------------------------------------------------------------------


def inline_bytes(part: Part, max_bytes: int) -> bytes:
    """The bytes of an inline part: a data URL (`data:<type>;base64,<data>`: an image part's type must be
    image/*, an audio part's audio/* or none), or plain base64 (audio, as OpenAI's input_audio.data).

    Raises:
        ApiError: 400 naming the part: not base64, not a data URL of its kind, over `max_bytes`.
    """
    text = part.source
    if text.startswith("data:"):
        header, comma, text = text[5:].partition(",")
        mime, *params = header.split(";")
        if not comma or "base64" not in params:
            raise bad_request(part.param, "A data URL must be base64: data:<type>;base64,<data>.")
        if part.kind == "image" and not mime.startswith("image/"):
            raise bad_request(part.param, f"An image's data URL has type image/..., not {mime[:40]!r}.")
        if part.kind == "audio" and mime and not mime.startswith("audio/"):
            raise bad_request(part.param, f"An audio data URL has type audio/..., not {mime[:40]!r}.")
    elif part.kind == "image":
        raise bad_request(part.param, "An image is a data URL (data:image/png;base64,...) or an http(s) URL.")
    text = "".join(text.split())  # line breaks, as some encoders write them
    # 4 characters of base64 hold 3 bytes: too long a text is refused before any of it is decoded.
    if len(text) > 4 * (max_bytes // 3 + 1):
        raise bad_request(part.param, f"The {part.kind} is larger than {max_bytes} bytes (--max-media-bytes).")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(part.param, f"The {part.kind} data is not valid base64.") from None
    if len(data) > max_bytes:
        raise bad_request(part.param, f"The {part.kind} is {len(data)} bytes; at most {max_bytes} are taken "
                                      f"(--max-media-bytes).")
    if not data:
        raise bad_request(part.param, f"The {part.kind} data is empty.")
    return data


async def fetch(part: Part, limits: Limits) -> bytes:
    """GET an image URL that `check_url` allowed: status 200 only (no redirect is followed, so the host checked
    is the host read), the body as sent (`Accept-Encoding: identity`; any other Content-Encoding is refused,
    and the raw bytes are read, so nothing is inflated), at most `limits.item_bytes` bytes, within
    `limits.fetch_timeout` seconds in all. Only I/O runs here, on the event loop: the bytes are decoded in a
    worker process.

    Raises:
        ApiError: 400 naming the part: the host refused, a status other than 200, a Content-Encoding, too many
            bytes, too slow.
    """
    import httpx

    check_url(part.source, part.param, limits)
    cap = limits.item_bytes
    try:
        async with asyncio.timeout(limits.fetch_timeout):
            async with httpx.AsyncClient(follow_redirects=False, timeout=limits.fetch_timeout,
                                         verify=_tls_context()) as client:
                async with client.stream("GET", part.source, headers={"Accept-Encoding": "identity"}) as response:
                    if response.status_code != 200:
                        raise bad_request(part.param, f"Fetching the image URL got HTTP {response.status_code}.")
                    encoding = response.headers.get("content-encoding", "").strip().lower()
                    if any(coding.strip() not in ("", "identity") for coding in encoding.split(",")):
                        raise bad_request(part.param, f"The image URL's file came with Content-Encoding "
                                                      f"{encoding[:60]!r}; the server asks for identity and "
                                                      f"reads only the file's own bytes.")
                    declared = response.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > cap:
                        raise bad_request(part.param, f"The image URL's file is {declared} bytes; at most {cap} "
                                                      f"are taken (--max-media-bytes).")
                    chunks, size = [], 0
                    async for chunk in response.aiter_raw():
                        size += len(chunk)
                        if size > cap:
                            raise bad_request(part.param, f"The image URL's file is larger than {cap} bytes "
                                                          f"(--max-media-bytes).")
                        chunks.append(chunk)
    except TimeoutError:
        raise bad_request(part.param, f"The image URL was not fetched within {limits.fetch_timeout:g} s "
                                      f"(--media-fetch-timeout).") from None
    except httpx.HTTPError as e:
        raise bad_request(part.param, f"The image URL could not be fetched: {type(e).__name__}: {e}"[:300]) from None
    return b"".join(chunks)


@functools.cache
def _tls_context():
    """httpx's default TLS context (certifi's CAs), built once: building it reads the CA bundle, tens of
    milliseconds on the event loop for every fetch otherwise."""
    import httpx

    return httpx.create_ssl_context()


# ---- decoding (in a worker process: media_worker.py) ---------------------------------------------------


def over_budget(param: str, what: str, size: int, left: int, limits: Limits) -> ApiError:
    """The 400 of a part whose decoded size is more than the request has left of --max-media-decoded-bytes."""
    more = f"; the request's other media took {limits.decoded_bytes - left}" if left < limits.decoded_bytes else ""
    return bad_request(param, f"The {what} decodes to {size} bytes; a request's media may decode to at most "
                              f"{limits.decoded_bytes} bytes (--max-media-decoded-bytes){more}.")


# A JPEG marker (ITU-T T.81 B.1.1.2, B.1.1.5): 0xFF, any fill 0xFFs, then a code other than a stuffed zero
# or a restart marker, which live inside a scan's entropy-coded data; libjpeg's jdmarker.c `next_marker`
# skips the same bytes to find a segment. The look-behind starts a match only at the first 0xFF of a run, so
# the search is linear whatever the bytes.
_JPEG_MARKER = re.compile(rb"(?<!\xff)\xff+([^\x00\xd0-\xd7\xff])")
# Markers without a length (T.81 Table B.1): SOI and TEM; EOI ends the stream.
_JPEG_STANDALONE = (0xD8, 0x01)
_JPEG_EOI, _JPEG_SOS = 0xD9, 0xDA


def jpeg_scans(data: bytes, stop: int) -> int:
    """The scans of a JPEG stream (its SOS segments before the first EOI), counted from its markers alone as
    libjpeg's jdmarker.c reads them: each segment skipped by its length, each scan's entropy-coded data up to
    the next marker. Counting stops once it reaches `stop`.

    Args:
        data: the file.
        stop: the count at which to stop (the limit + 1).
    Returns:
        the scans counted, at most `stop`.
    """
    view = memoryview(data)
    count, at = 0, 2  # after SOI
    while count < stop:
        # A search from `at` in the view that starts there, so the look-behind cannot see the byte before it.
        m = _JPEG_MARKER.search(view[at:])
        if m is None:
            break
        code = m.group(1)[0]
        if code == _JPEG_EOI:
            break
        at += m.end()
        if code in _JPEG_STANDALONE:
            continue
        if at + 2 > len(data):
            break
        at += int.from_bytes(view[at:at + 2], "big")  # a length of 0 or 1 still moves on: `at` passed the code
        count += code == _JPEG_SOS
    return count


def decode_image(data: bytes, param: str, max_pixels: int, limits: Limits | None = None, decoded_used: int = 0):
    """An image's pixels, in RGB: its size and (a JPEG's) scans are read and checked before the pixels are
    decoded; then it is converted as Transformers' `convert_to_rgb` (Gemma4Processor's `do_convert_rgb`) does.

    Args:
        data: the file's bytes.
        param: the request field it came from.
        max_pixels: width x height it may have.
        limits: the request's limits (its decoded bytes and JPEG scans; the defaults without).
        decoded_used: bytes the request's earlier parts decoded to.
    Returns:
        the loaded RGB `PIL.Image.Image` (the first frame of an animation).
    Raises:
        ApiError: 400 naming `param`: not an image of IMAGE_FORMATS, larger than `max_pixels` or the decoded
            bytes left, a JPEG of more scans than the limit, corrupt.
    """
    from PIL import Image, UnidentifiedImageError

    limits = limits or Limits(1, max_pixels, 0.0, len(data))
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except UnidentifiedImageError:
        raise bad_request(param, f"The image is not a {', '.join(IMAGE_FORMATS)} file Pillow can read.") from None
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as e:
        raise bad_request(param, f"The image cannot be read: {e}"[:300]) from None
    width, height = image.size
    if width * height > max_pixels:
        raise bad_request(param, f"The image is {width}x{height} = {width * height} pixels; at most {max_pixels} "
                                 f"are taken (--max-image-pixels).")
    if width < 1 or height < 1:
        raise bad_request(param, f"The image is {width}x{height} pixels.")
    left = limits.decoded_bytes - decoded_used
    if width * height * PIXEL_BYTES > left:
        raise over_budget(param, f"image ({width}x{height})", width * height * PIXEL_BYTES, left, limits)
    # Pillow reads a JPEG (and an MPO's first frame) from the file's first byte to its first EOI.
    if image.format in ("JPEG", "MPO") and jpeg_scans(data, limits.jpeg_scans + 1) > limits.jpeg_scans:
        raise bad_request(param, f"The JPEG holds more than {limits.jpeg_scans} scans (--max-jpeg-scans); "
                                 f"encoders write at most 18 (libjpeg's progressive script).")
    try:
        image.load()
        if image.mode != "RGB":
            image = image.convert("RGB")
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as e:
        raise bad_request(param, f"The image is corrupt ({image.format}): {e}"[:300]) from None
    return image


def decode_audio(data: bytes, param: str, max_seconds: float, used: float = 0.0, rate: int = SAMPLE_RATE, *,
                 clip_seconds: float | None = None, limits: Limits | None = None,
                 decoded_used: int = 0) -> tuple[Any, float, int]:
    """Audio as float32 mono samples at `rate`: its rate, channels, length and decoded size are read from the
    header and checked before a sample is decoded; then at most that many frames + 1 are read, a block at a
    time, each averaged to mono as it comes, and another rate is resampled (`resample`).

    Args:
        data: the file's bytes.
        param: the request field it came from.
        max_seconds: seconds of audio the whole request may hold.
        used: seconds its earlier clips took.
        rate: the rate to return.
        clip_seconds: the longest clip the model reads whole (a chat part: the feature extractor's 30 s;
            None for a transcription's file, which is cut into clips).
        limits: the request's limits (its decoded bytes; the default without).
        decoded_used: bytes the request's earlier parts decoded to.
    Returns:
        (samples, seconds, size): a 1-D float32 numpy array, the clip's length in seconds, and the bytes its
        decoding counted (frames x channels x SAMPLE_BYTES).
    Raises:
        ApiError: 400 naming `param`: not a file of AUDIO_FORMATS, another sample rate than AUDIO_RATES, more
            channels than MAX_AUDIO_CHANNELS, longer than the seconds or the clip, more samples than the
            decoded bytes left, empty, corrupt.
    """
    import numpy as np
    import soundfile

    limits = limits or Limits(0, 1, max_seconds, len(data))
    try:
        sound = soundfile.SoundFile(io.BytesIO(data))
    except (soundfile.SoundFileError, RuntimeError, TypeError, ValueError) as e:
        raise bad_request(param, f"The audio is not a {AUDIO_FORMAT_NAMES} file libsndfile can read "
                                 f"({' '.join(str(e).split()[-4:])})") from None
    with sound:
        source_rate, channels = sound.samplerate, sound.channels
        if sound.format not in AUDIO_FORMATS:
            raise bad_request(param, f"The audio is {sound.format_info or sound.format}; send {AUDIO_FORMAT_NAMES}.")
        if source_rate not in AUDIO_RATES:
            raise bad_request(param, f"The audio's sample rate is {source_rate} Hz; the server reads audio at "
                                     f"{', '.join(f'{r:,}' for r in AUDIO_RATES)} Hz (resample it to one, e.g. "
                                     f"the model's 16,000).")
        if not 1 <= channels <= MAX_AUDIO_CHANNELS:
            raise bad_request(param, f"The audio has {channels} channels; the server reads at most "
                                     f"{MAX_AUDIO_CHANNELS} (mono or stereo: mix it down first).")
        left = max(max_seconds - used, 0.0)

        def too_long(length: str, frames: int) -> ApiError:
            more = f"; the request's other audio took {used:.1f} s" if used else ""
            return bad_request(param, f"The audio is {length}; a request holds at most {max_seconds:g} s of audio "
                                      f"(--max-audio-seconds){more}.")

        def too_large(length: str, frames: int) -> ApiError:
            return over_budget(param, f"audio ({'at least ' if length.startswith('more') else ''}{frames} frames x "
                                      f"{channels} channels)", frames * channels * SAMPLE_BYTES,
                               limits.decoded_bytes - decoded_used, limits)

        # The most frames each limit allows; the header's count is checked against them before decoding, and
        # the read stops one frame past the least of them, whatever the header said.
        allowed = [(math.floor(left * source_rate), too_long),
                   ((limits.decoded_bytes - decoded_used) // (channels * SAMPLE_BYTES), too_large)]
        if clip_seconds is not None:
            allowed.insert(1, (math.floor(clip_seconds * source_rate),
                               lambda length, frames: clip_too_long(param, length, clip_seconds)))
        # A stream that does not state its length (a FLAC whose STREAMINFO says 0 samples) reads as
        # UNKNOWN_FRAMES: only the read's own bound below holds it.
        for most, refuse in allowed:
            if UNKNOWN_FRAMES > sound.frames > most:
                raise refuse(f"{sound.frames / source_rate:.1f} s long", sound.frames)
        most = min(m for m, _ in allowed)
        blocks, read = [], 0
        block = np.empty((min(READ_FRAMES, most + 1), channels), dtype=np.float32)
        try:
            while read <= most:
                got = sound.read(min(len(block), most + 1 - read), dtype="float32", always_2d=True, out=block)
                if not len(got):
                    break
                blocks.append(got.mean(axis=1, dtype=np.float32))
                read += len(got)
        except (soundfile.SoundFileError, RuntimeError, ValueError) as e:
            raise bad_request(param, f"The audio is corrupt ({sound.format}): {e}"[:300]) from None
    for most, refuse in allowed:
        if read > most:  # the header said less, or nothing: the read stopped one frame past the limit
            raise refuse(f"more than {most / source_rate:.1f} s long", most + 1)
    if not read:
        raise bad_request(param, "The audio holds no samples.")
    mono = np.concatenate(blocks) if len(blocks) > 1 else blocks[0]
    del blocks
    return resample(mono, source_rate, rate), read / source_rate, read * channels * SAMPLE_BYTES


def clip_too_long(param: str, length: str, clip_seconds: float) -> ApiError:
    """The 400 of a chat audio part `length` long ("31.2 s long") when the model reads a clip of at most
    `clip_seconds` whole (Transformers would truncate it silently)."""
    return bad_request(param, f"The audio is {length}; the model reads a clip of at most "
                              f"{clip_seconds:g} s (use /v1/audio/transcriptions for longer audio, or send it in "
                              f"several parts).")


def resample(wave, source_rate: int, rate: int = SAMPLE_RATE):
    """`wave` at `rate`: scipy's polyphase resampler (`scipy.signal.resample_poly`, its default Kaiser-window
    anti-aliasing filter), as float32; unchanged when the rates agree. The filter has 2 * 10 * max(up, down)
    + 1 taps for the rates' ratio up/down in lowest terms, so only the rates of AUDIO_RATES are taken: at
    most 12,801 taps, and a cost per output sample that does not grow with what a header claims.

    Raises:
        ValueError: `source_rate` is not one of AUDIO_RATES (decode_audio refuses those first).
    """
    import numpy as np

    if source_rate == rate:
        return np.ascontiguousarray(wave, dtype=np.float32)
    if source_rate not in AUDIO_RATES:
        raise ValueError(f"cannot resample from {source_rate} Hz: not one of {AUDIO_RATES}")
    from scipy.signal import resample_poly

    g = math.gcd(source_rate, rate)
    return resample_poly(wave, rate // g, source_rate // g).astype(np.float32)


def resample_taps(source_rate: int, rate: int = SAMPLE_RATE) -> int:
    """The length of the filter `resample_poly` designs from `source_rate` to `rate` (scipy 1.17
    `_signaltools.py`: half_len = 10 * max(up, down))."""
    g = math.gcd(source_rate, rate)
    return 2 * 10 * max(rate // g, source_rate // g) + 1


def decode(part: Part, data: bytes, limits: Limits, audio_used: float = 0.0, decoded_used: int = 0,
           clip_seconds: float | None = None) -> Decoded:
    """A part's bytes, decoded and keyed (`decode_image`, `decode_audio`), counted against what the request's
    earlier parts used: `audio_used` seconds, `decoded_used` decoded bytes. `clip_seconds`: the longest clip
    an audio part may be.

    Raises:
        ApiError: as the decoder.
    """
    if part.kind == "image":
        image = decode_image(data, part.param, limits.image_pixels, limits, decoded_used)
        return Decoded("image", part.param, image, content_key(data), 0.0,
                       image.size[0] * image.size[1] * PIXEL_BYTES)
    wave, seconds, size = decode_audio(data, part.param, limits.audio_seconds, audio_used, clip_seconds=clip_seconds,
                                       limits=limits, decoded_used=decoded_used)
    return Decoded("audio", part.param, wave, content_key(data), seconds, size)


def cut_clips(wave, max_samples: int, param: str = "file") -> list[Decoded]:
    """A long recording (16 kHz mono) as the clips the model reads whole (`split_clip`), each keyed by its
    samples: a transcription's file."""
    return [Decoded("audio", param, clip, content_key(clip.tobytes()), len(clip) / SAMPLE_RATE)
            for clip in split_clip(wave, max_samples)]


def split_clip(wave, max_samples: int, window: int = SAMPLE_RATE // 10, search: int = 5 * SAMPLE_RATE) -> list:
    """`wave` in clips of at most `max_samples`, each cut at the quietest `window` samples of the last
    `search` samples before the limit (the lowest sum of squares), so a cut falls between words where there
    is a pause: vLLM's `_find_split_point` (vllm/entrypoints/openai/speech_to_text.py) cuts long audio the
    same way.

    Returns:
        views of `wave`, in order; together they are `wave`.
    """
    import numpy as np

    clips, at = [], 0
    while len(wave) - at > max_samples:
        end = at + max_samples
        lo = max(at + window, end - search)
        region = np.asarray(wave[lo:end], dtype=np.float64) ** 2
        if len(region) > window:
            energy = np.convolve(region, np.ones(window), mode="valid")
            end = lo + int(np.argmin(energy)) + window // 2
        clips.append(wave[at:end])
        at = end
    clips.append(wave[at:])
    return clips
