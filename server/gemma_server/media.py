"""Images and audio in a request: read, budgeted from their headers, decoded in a worker process,
pre-processed, turned into soft tokens and placed in the prompt.

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
3. `Decoded` -> model inputs with Transformers 5.18's own Gemma 4 pre-processing, loaded from the
   checkpoint's processor_config.json and called as `Gemma4Processor` calls it (processing_gemma4.py,
   processing_utils.py `_process_images` / `_process_audio`): `Gemma4ImageProcessorPil`
   (image_processing_pil_gemma4.py, the Pillow backend: no torchvision) gives `pixel_values`,
   `image_position_ids` and `num_soft_tokens_per_image`; `Gemma4AudioFeatureExtractor`
   (feature_extraction_gemma4.py) gives `input_features` and `input_features_mask` (`image_inputs`,
   `audio_inputs`). They run on the encoder's own pre-processing threads, never on the event loop or on
   asyncio's default executor (which renders and tokenizes every prompt).
4. model inputs -> `Soft` tokens: the engine's `gemma_engine.Encoder` (the towers and their projections into
   the text model), which is `unsendable`: `MediaEncoder` builds it on a thread of its own and runs every
   call there, off the event loop; the engine threads are untouched.
5. The prompt: the checkpoint's chat template renders an image part as `<|image|>` and an audio part as
   `<|audio|>` (Google's Gemma 4 template), and `expand` replaces each such id as `Gemma4Processor`
   (`replace_image_token`, `replace_audio_token`) replaces the marker in the text: boi, the image token once
   per soft token, eoi (boa, the audio token, eoa). The soft tokens then take those positions in the engine
   (`Request(media=[(start, embeds, key)])`). A client's text cannot make a placeholder: the chat template's
   client texts are tokenized with special tokens as plain text (chat_template.py).

`soft_tokens` runs 1-4 for one request: the URLs fetched first, then, holding one of the workers' places
(`media_worker.Workers.place`), the parts decoded in order, pre-processed and encoded, so at most
--media-workers requests hold decoded media at once. A MemoryError anywhere on this path is a 400 naming the
part, never a 500.

Pure functions hold the rules (`check_parts`, `inline_bytes`, `jpeg_scans`, `decode_*`, `resample`,
`expand`, `split_clip`); the side effects are at the edges (`fetch`, the workers, `MediaEncoder`).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import binascii
import functools
import hashlib
import io
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from gemma_server.errors import ApiError, bad_request

if TYPE_CHECKING:
    from gemma_server.media_worker import Workers

log = logging.getLogger(__name__)

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
# Threads that run Transformers' processors (the requests that hold a worker's place take turns on them).
PREP_THREADS = 2


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


@dataclass(frozen=True)
class Soft:
    """A part's soft tokens: `embeds` [n, hidden] that take its n placeholder positions, and its key."""

    kind: Kind
    param: str
    embeds: Any
    key: int

    @property
    def count(self) -> int:
        return int(self.embeds.shape[0])


@dataclass(frozen=True)
class Tokens:
    """The checkpoint's media token ids (config.json's `image_token_id`, `boi_token_id`, ...)."""

    image: int
    audio: int
    boi: int
    eoi: int
    boa: int
    eoa: int

    def placeholder(self, kind: Kind) -> int:
        return self.image if kind == "image" else self.audio

    def frame(self, kind: Kind) -> tuple[int, int]:
        """The ids an item's soft tokens stand between."""
        return (self.boi, self.eoi) if kind == "image" else (self.boa, self.eoa)


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


async def fetch_urls(parts: Sequence[Part], limits: Limits) -> dict[int, bytes]:
    """The bytes of every image URL part (`fetch`), by the part's index: network I/O only, done before the
    request takes a worker's place."""
    return {i: await fetch(part, limits) for i, part in enumerate(parts)
            if part.kind == "image" and not part.source.startswith("data:")}


async def read(parts: Sequence[Part], limits: Limits, workers: Workers, fetched: dict[int, bytes],
               clip_seconds: float | None) -> list[Decoded]:
    """A request's parts decoded in a worker process (`media_worker.Workers.decode`: the inline ones from their
    base64 there too, the fetched ones from `fetched`), in order, each counted against what the earlier ones
    used of the request's seconds and decoded bytes. Called holding one of the workers' places.

    Raises:
        ApiError: 400 naming the first part that breaks a limit or cannot be read.
    """
    out: list[Decoded] = []
    seconds, size = 0.0, 0
    for i, part in enumerate(parts):
        item = await workers.decode(part, fetched.get(i), limits, seconds, size,
                                    clip_seconds if part.kind == "audio" else None)
        seconds += item.seconds
        size += item.size
        out.append(item)
    return out


async def soft_tokens(front: MediaEncoder, workers: Workers, parts: Sequence[Part], limits: Limits,
                      decoded: Sequence[Decoded] | None = None) -> list[Soft]:
    """One request's media parts as soft tokens: its URLs fetched (`fetch_urls`), then, holding one of the
    workers' places, its parts decoded (`read`, unless `decoded` holds them already: a transcription's clip),
    pre-processed and encoded (`MediaEncoder.encode`). Cancelling it (the client left) kills the decode.

    Raises:
        ApiError: 400 naming the part that breaks a limit or cannot be read.
    """
    fetched = await fetch_urls(parts, limits) if decoded is None else {}
    async with workers.place():
        items = (list(decoded) if decoded is not None
                 else await read(parts, limits, workers, fetched, front.clip_samples / SAMPLE_RATE))
        return await front.encode(items)


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


# ---- model inputs and the prompt ----------------------------------------------------------------------


def image_inputs(processor, images: list) -> dict[str, Any]:
    """Gemma4ImageProcessorPil over one request's images, as Gemma4Processor calls it (`do_convert_rgb`, its
    default images_kwargs; one batch, padded to the most patches).

    Returns:
        {"pixel_values": float [n, patches, 3*p*p], "image_position_ids": int64 [n, patches, 2],
         "num_soft_tokens_per_image": [n]} as torch tensors.
    """
    return dict(processor(images, do_convert_rgb=True, return_tensors="pt"))


def audio_inputs(extractor, clips: list) -> dict[str, Any]:
    """Gemma4AudioFeatureExtractor over one request's clips (16 kHz mono), as Gemma4Processor calls it (its
    defaults: padded to the longest, truncated at 30 s, which `check_clip` refuses first).

    Returns:
        {"input_features": float [n, frames, mel], "input_features_mask": bool [n, frames]} as torch tensors.
    """
    return dict(extractor(clips, sampling_rate=SAMPLE_RATE, return_tensors="pt"))


def expand(ids: Sequence[int], counts: Sequence[tuple[Kind, int]], tokens: Tokens) -> tuple[list[int], list[int]]:
    """The prompt with each media placeholder (one `<|image|>` or `<|audio|>` id, as the chat template writes
    it) replaced as Gemma4Processor's `replace_image_token` / `replace_audio_token` replace it: boi, the image
    token `n` times, eoi (boa, the audio token `n` times, eoa).

    Args:
        ids: the rendered prompt's ids, one placeholder per media part.
        counts: each part's (kind, soft tokens), in prompt order.
        tokens: the checkpoint's media ids.
    Returns:
        (ids, starts): the expanded ids, and where each part's soft tokens start.
    Raises:
        ApiError: 400 when the placeholders are not the parts (the chat template did not place them).
    """
    marks = (tokens.image, tokens.audio)
    where = [i for i, t in enumerate(ids) if t in marks]
    kinds = ["image" if ids[i] == tokens.image else "audio" for i in where]
    if kinds != [kind for kind, _ in counts]:
        raise bad_request("messages", f"The chat template placed {len(where)} media markers for "
                                      f"{len(counts)} media parts: this checkpoint's template does not render "
                                      f"them as Gemma 4's does.")
    out: list[int] = []
    starts: list[int] = []
    at = 0
    for i, (kind, n) in zip(where, counts):
        first, last = tokens.frame(kind)
        out += ids[at:i]
        out.append(first)
        starts.append(len(out))
        out += [tokens.placeholder(kind)] * n
        out.append(last)
        at = i + 1
    out += ids[at:]
    return out, starts


def prompt_ids(tokenizer, request, counts: Sequence[tuple[Kind, int]], tokens: Tokens) -> tuple[list[int], list[int]]:
    """The prompt ids the engine gets for a chat request (protocol.requests.ChatCompletionRequest) whose media parts
    give `counts` soft tokens: the checkpoint's template rendered and tokenized (chat_template.chat_prompt),
    then `expand`ed. Pure: what the server sends, without the HTTP layer or an encoder.

    Returns:
        (ids, starts) as `expand`.
    """
    from gemma_server.chat_template import chat_prompt

    ids, _ = chat_prompt(tokenizer, request, mark=False)
    return expand(ids, counts, tokens)


def place(ids: Sequence[int], soft: Sequence[Soft], tokens: Tokens, marks):
    """The prompt with its parts' soft tokens placed (`expand`): the ids, the engine's media items (start,
    embeds, key) and the cache marks (chat_template.CacheMarks) moved to the expanded prompt: the boundary
    kept where it lies before the first part, else dropped; the next turn moved past the parts before it.

    Returns:
        (ids, items, marks).
    """
    expanded, starts = expand(ids, [(s.kind, s.count) for s in soft], tokens)
    items = tuple((start, s.embeds, s.key) for start, s in zip(starts, soft))
    boundary, next_turn = marks.boundary, marks.next_turn
    if boundary is not None and starts and boundary >= starts[0] - 1:
        boundary = None
    if next_turn is not None:
        # Each placeholder before it became its frame: the soft tokens and the two ids around them.
        where = [i for i, t in enumerate(ids) if t in (tokens.image, tokens.audio)]
        next_turn += sum(s.count + 1 for at, s in zip(where, soft) if at < next_turn)
    return expanded, items, dataclasses.replace(marks, boundary=boundary, next_turn=next_turn)


# ---- the checkpoint's media front end (its side effects: files, a thread, the encoder) -----------------


class MediaEncoder:
    """A checkpoint's processors and the engine's `gemma_engine.Encoder`, which runs on a thread of its own
    (it is `unsendable`: the thread that builds it is the only one that may call it). The processors run on
    PREP_THREADS threads of its own.

    Args:
        pool: the encoder's one thread, where `encoder` was built.
        encoder: the gemma_engine.Encoder (even its properties are read on `pool` only).
        towers: what the encoder takes (its `modalities`).
        tokens: its media token ids.
        image_processor: Gemma4ImageProcessorPil, or None without images.
        feature_extractor: Gemma4AudioFeatureExtractor, or None without audio.
        on_encoded: called with (kind, items, seconds) after each tower call (metrics).
    """

    def __init__(self, pool: ThreadPoolExecutor, encoder: Any, towers: Sequence[str], tokens: Tokens,
                 image_processor: Any, feature_extractor: Any,
                 on_encoded: Callable[[str, int, float], None] = lambda kind, n, s: None) -> None:
        self._pool = pool
        self._encoder = encoder
        self.tokens = tokens
        self.image_processor = image_processor
        self.feature_extractor = feature_extractor
        self._on_encoded = on_encoded
        self._prep = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="media-prep")
        self.modalities = tuple(m for m in towers if (m == "image" and image_processor is not None)
                                or (m == "audio" and feature_extractor is not None))
        # The longest clip the feature extractor reads (its `max_length`: 30 s); longer is truncated there.
        self.clip_samples = 480_000 if feature_extractor is None else int(
            getattr(feature_extractor, "max_length", None) or 480_000)

    @classmethod
    def load(cls, gemma_engine, model_dir: Path, device: str, dtype: str,
             on_encoded: Callable[[str, int, float], None] = lambda kind, n, s: None,
             ) -> tuple[MediaEncoder | None, str]:
        """The media front end of the checkpoint in `model_dir`, its encoder on `device` in `dtype` (called on
        the boot thread; the encoder is built on its own thread).

        Returns:
            (encoder, ""), or (None, why) for a checkpoint without towers or without a processor config.
        Raises:
            ValueError, OSError: a tower config or tensor the engine refuses (the boot stage fails on it).
        """
        import json

        root = json.loads((Path(model_dir) / "config.json").read_text())
        if not isinstance(root, dict) or not (root.get("vision_config") or root.get("audio_config")):
            return None, ("the checkpoint has no vision or audio tower (its config.json has no vision_config or "
                          "audio_config)")
        loaded = processors(Path(model_dir), bool(root.get("vision_config")), bool(root.get("audio_config")))
        if loaded[0] is None and loaded[1] is None:
            return None, ("the checkpoint has no processor_config.json (Transformers' Gemma4Processor configuration) "
                          "for its towers")
        pool = ThreadPoolExecutor(1, thread_name_prefix="media-encoder")

        def build():
            import torch

            e = gemma_engine.Encoder(str(model_dir), like=torch.zeros(1, device=device), dtype=dtype)
            return e, list(e.modalities), Tokens(e.image_token_id, e.audio_token_id, e.boi_token_id,
                                                 e.eoi_token_id, e.boa_token_id, e.eoa_token_id)

        try:
            encoder, towers, tokens = pool.submit(build).result()
        except BaseException:
            pool.shutdown(wait=False)
            raise
        return cls(pool, encoder, towers, tokens, *loaded, on_encoded=on_encoded), ""

    def describe(self) -> dict[str, Any]:
        """What /v1/engine shows of it."""
        return {"modalities": list(self.modalities),
                "image_max_soft_tokens": getattr(self.image_processor, "max_soft_tokens", None),
                "audio_clip_seconds": self.clip_samples / SAMPLE_RATE if self.feature_extractor else None}

    def check_clip(self, item: Decoded) -> None:
        """A chat audio part is one clip the model reads whole: longer than the extractor's `max_length` is a
        400 (Transformers would truncate it silently). `decode_audio` refuses it from the header first."""
        if item.kind == "audio" and len(item.value) > self.clip_samples:
            raise clip_too_long(item.param, f"{item.seconds:.1f} s long", self.clip_samples / SAMPLE_RATE)

    async def encode(self, items: Sequence[Decoded]) -> list[Soft]:
        """Soft tokens of a request's decoded parts, in order: pre-processed on the pre-processing threads, then
        the towers on the encoder's thread (images in one call, clips in one call).

        Raises:
            ApiError: 400 naming a part that the pre-processing or the encoder refuses, or that gives no soft
                token (a clip too short to make one).
        """
        images = [d for d in items if d.kind == "image"]
        clips = [d for d in items if d.kind == "audio"]
        for clip in clips:
            self.check_clip(clip)
        out: dict[int, Soft] = {}
        if images:
            inputs = await _off_loop(self._prep, images[0].param, image_inputs, self.image_processor,
                                     [d.value for d in images])
            embeds = await self._tower(images[0].param, "image", len(images), inputs["pixel_values"],
                                       inputs["image_position_ids"])
            out.update({id(d): Soft("image", d.param, e, d.key) for d, e in zip(images, embeds)})
        if clips:
            inputs = await _off_loop(self._prep, clips[0].param, audio_inputs, self.feature_extractor,
                                     [d.value for d in clips])
            embeds = await self._tower(clips[0].param, "audio", len(clips), inputs["input_features"],
                                       inputs["input_features_mask"])
            out.update({id(d): Soft("audio", d.param, e, d.key) for d, e in zip(clips, embeds)})
        soft = [out[id(d)] for d in items]
        for s in soft:
            if s.count < 1:
                raise bad_request(s.param, f"The {s.kind} is too short to give the model a soft token.")
        return soft

    async def _tower(self, param: str, kind: Kind, n: int, *args: Any) -> list:
        """`Encoder.image(*args)` or `Encoder.audio(*args)` on the encoder's thread; a ValueError (a tower the
        checkpoint lacks, a shape the encoder refuses) or a MemoryError is the request's 400."""
        t0 = time.monotonic()
        try:
            embeds = await asyncio.wrap_future(self._pool.submit(lambda: getattr(self._encoder, kind)(*args)))
        except ValueError as e:
            raise bad_request(param, f"The {kind} encoder refused the input: {e}"[:500]) from None
        except MemoryError:
            raise bad_request(param, f"The {kind} encoder ran out of memory on this input.") from None
        self._on_encoded(kind, n, time.monotonic() - t0)
        return list(embeds)

    def shutdown(self) -> None:
        """Drop the encoder on its own thread (PyO3 refuses an unsendable object dropped elsewhere), then the
        thread, and the pre-processing threads."""
        self._pool.submit(setattr, self, "_encoder", None)
        self._pool.shutdown(wait=True)
        self._prep.shutdown(wait=False, cancel_futures=True)


async def _off_loop(executor: ThreadPoolExecutor, param: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on `executor` (never asyncio's default one, which renders and tokenizes every prompt); what
    the pre-processing raises on a client's media, a MemoryError included, is its 400."""
    try:
        return await asyncio.wrap_future(executor.submit(fn, *args))
    except ApiError:
        raise
    except MemoryError:
        raise bad_request(param, "The media ran out of memory in pre-processing.") from None
    except (ValueError, TypeError, OSError, IndexError, ZeroDivisionError, RuntimeError) as e:
        raise bad_request(param, f"The media could not be pre-processed: {type(e).__name__}: {e}"[:500]) from None


def processors(model_dir: Path, vision: bool, audio: bool) -> tuple[Any, Any]:
    """Transformers' Gemma 4 image processor (the Pillow backend) and audio feature extractor, from the
    checkpoint's processor_config.json, for the towers it has; None for a tower without one."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    def load(cls):
        try:
            return cls.from_pretrained(str(model_dir))
        except (OSError, ValueError) as e:
            log.warning("no %s for this checkpoint: %s", cls.__name__, e)
            return None

    return (load(Gemma4ImageProcessorPil) if vision else None,
            load(Gemma4AudioFeatureExtractor) if audio else None)
