"""Decoded images and audio (media.py) pre-processed, turned into soft tokens and placed in the prompt: the
checkpoint's media front end. The path of a media part goes on from media.py's steps 1 (bytes) and 2
(`Decoded`, in a worker process):

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

Pure functions hold the rules (`image_inputs`, `audio_inputs`, `expand`, `place`); the side effects are at the
edges (the workers, `MediaEncoder`'s threads and encoder).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gemma_server.errors import ApiError, bad_request
from gemma_server.media import SAMPLE_RATE, Decoded, Kind, Limits, Part, clip_too_long, fetch

if TYPE_CHECKING:
    from gemma_server.media_worker import Workers

log = logging.getLogger(__name__)

# Threads that run Transformers' processors (the requests that hold a worker's place take turns on them).
PREP_THREADS = 2


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


# ---- one request's media: fetched, decoded in a worker, encoded ----------------------------------------


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
