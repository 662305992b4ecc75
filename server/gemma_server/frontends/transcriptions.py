"""POST /v1/audio/transcriptions and POST /v1/audio/translations: OpenAI's Audio API, on the chat path.

Design: the OpenAI API reference's "Create transcription" and "Create translation" and the shapes the openai
SDK 3.57.0 reads (`openai/types/audio/`: transcription.py, transcription_verbose.py, translation.py,
translation_verbose.py, transcription_segment.py, transcription_text_delta_event.py,
transcription_text_done_event.py); vLLM's `vllm/entrypoints/openai/speech_to_text.py` serves the same routes
with audio language models, cutting long audio into clips the model reads whole.

Gemma 4 has no speech-to-text head: it transcribes when a chat turn asks it to. So a request's file is read
once, with a place in the queue and one of the media workers' places, in a media worker process
(media_worker.Workers.decode_file: media.decode_audio, wav, flac, mp3 or ogg at one of media.AUDIO_RATES,
mono or stereo, averaged to mono), cut there into clips of at most the model's 30 s (media.split_clip, at a
pause), and each clip becomes one chat request of the same model (`chat_request`: a
user turn holding the clip and the instruction Google's Gemma audio guide and Gemma 3n model card use,
"Transcribe the following speech segment in {language} into {language} text.", or "... into English text."
to translate) that takes the one admission path (`ServerState.start`: the queue, the client's share, the
metrics, cancellation). The clips run one after another and their texts are joined with a space. Each
clip's reply is bounded (`max_tokens_for`), so a model that does not stop cannot write a whole context.

Replies: `json` ({"text", "usage"} with the prompt's audio and text tokens), `text`, `verbose_json`
({"language", "duration", "text", "segments"}: one segment per clip, with its times, tokens, mean
log-probability and compression ratio as Whisper computes it; no_speech_prob is 0, the model having no such
head). A transcription with `stream` sends `transcript.text.delta` events as the text is written and a
`transcript.text.done` with the whole text and usage, then `data: [DONE]`; the first clip's first piece is
awaited before the stream opens, so an early failure is a JSON error.
"""

from __future__ import annotations

import math
import zlib
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from gemma_server import media, openapi, sse
from gemma_server.errors import ApiError, bad_request
from gemma_server.protocol.requests import ChatCompletionRequest
from gemma_server.serving import (
    ClientDisconnected,
    Generation,
    Items,
    Output,
    Piece,
    client_of,
    gone_of,
    race_disconnect,
    reply,
)

if TYPE_CHECKING:
    from gemma_server.state import ServerState

Task = Literal["transcribe", "translate"]
# A clip's reply is at most this many tokens a second of audio, plus FLOOR_TOKENS: speech runs at two to four
# words a second and a word is one to three of Gemma's tokens, so a transcript fits, and a model that does not
# stop (or repeats itself) ends within a few hundred tokens instead of at the context.
TOKENS_PER_SECOND = 16
FLOOR_TOKENS = 32
MAX_PROMPT_CHARS = 4096


class TranscriptionForm(BaseModel):
    """POST /v1/audio/transcriptions, a multipart form. Field order: the OpenAI API reference's."""

    model_config = ConfigDict(extra="ignore")

    file: UploadFile = Field(description="The audio: wav, flac, mp3 or ogg, any rate and channels.")
    model: str
    language: str | None = Field(default=None, max_length=40, description=(
        "The spoken language, ISO-639-1 (en) or its English name; absent: the instruction names none."))
    prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS, description=(
        "Text the speech follows or whose spellings it uses; added to the instruction."))
    response_format: Literal["json", "text", "verbose_json"] = "json"
    stream: bool = False
    temperature: float = Field(default=0.0, ge=0.0, le=1.0)
    timestamp_granularities: list[Literal["segment"]] = Field(
        default_factory=list, alias="timestamp_granularities[]", max_length=1,
        description="segment (verbose_json's segments: one per clip of at most 30 s); word is not supported.")


class TranslationForm(BaseModel):
    """POST /v1/audio/translations, a multipart form: the speech in English text."""

    model_config = ConfigDict(extra="ignore")

    file: UploadFile = Field(description="The audio: wav, flac, mp3 or ogg, any rate and channels.")
    model: str
    prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    response_format: Literal["json", "text", "verbose_json"] = "json"
    temperature: float = Field(default=0.0, ge=0.0, le=1.0)


class TextResponse(BaseModel):
    """`json`: OpenAI's Transcription / Translation."""

    text: str
    usage: dict[str, Any] | None = None


class Segment(BaseModel):
    """OpenAI's TranscriptionSegment: one clip."""

    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


class VerboseResponse(BaseModel):
    """`verbose_json`: OpenAI's TranscriptionVerbose / TranslationVerbose."""

    language: str
    duration: float
    text: str
    segments: list[Segment]
    usage: dict[str, Any]


def language_name(code: str | None) -> str | None:
    """The English name of a language given as an ISO-639-1 code or a name (Whisper's table in Transformers,
    `models/whisper/tokenization_whisper.py` LANGUAGES), capitalised; None when none is given.

    Raises:
        ApiError: 400 naming `language` for one the table lacks.
    """
    if code is None or not code.strip():
        return None
    from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

    key = code.strip().lower()
    name = LANGUAGES.get(key) or (key if key in TO_LANGUAGE_CODE else None)
    if name is None:
        raise bad_request("language", f"Unknown language {code[:40]!r}: give an ISO-639-1 code such as en or fr.")
    return name.title()


def instruction(task: Task, language: str | None, prompt: str | None) -> str:
    """The user turn's text after the clip (Google's Gemma audio guide, ai.google.dev/gemma/docs/capabilities/
    audio, and the Gemma 3n model card's speech prompts)."""
    spoken = f" in {language}" if language else ""
    if task == "translate":
        text = f"Translate the following speech segment{spoken} into English text."
    elif language:
        text = f"Transcribe the following speech segment in {language} into {language} text."
    else:
        text = "Transcribe the following speech segment into text."
    if prompt and prompt.strip():
        text += f"\nThe text before it, or words it may use: {prompt.strip()}"
    return text


def max_tokens_for(seconds: float) -> int:
    """The most tokens one clip's reply may take (TOKENS_PER_SECOND)."""
    return FLOOR_TOKENS + math.ceil(TOKENS_PER_SECOND * seconds)


def chat_request(model: str, task: Task, language: str | None, prompt: str | None, temperature: float,
                 seconds: float, logprobs: bool) -> ChatCompletionRequest:
    """The chat request of one clip (pure): a user turn of the clip and the instruction. The clip is given
    to `ServerState.start` decoded, so its part carries no data here."""
    content = [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
               {"type": "text", "text": instruction(task, language, prompt)}]
    return ChatCompletionRequest.model_validate({
        "model": model, "messages": [{"role": "user", "content": content}], "temperature": temperature,
        "max_tokens": max_tokens_for(seconds), "logprobs": logprobs})


@dataclass
class Clip:
    """One clip's place in the file and, once read, its transcript."""

    index: int
    start: float
    end: float
    decoded: media.Decoded
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    audio_tokens: int = 0
    output_tokens: int = 0

    def segment(self, temperature: float) -> Segment:
        raw = self.text.encode()
        ratio = len(raw) / len(zlib.compress(raw)) if raw else 0.0  # Whisper's compression_ratio
        mean = sum(self.logprobs) / len(self.logprobs) if self.logprobs else 0.0
        return Segment(id=self.index, seek=round(self.start * 100), start=round(self.start, 3),
                       end=round(self.end, 3), text=self.text, tokens=self.tokens, temperature=temperature,
                       avg_logprob=mean, compression_ratio=ratio, no_speech_prob=0.0)


def clips_of(decoded: list[media.Decoded]) -> list[Clip]:
    """The file's clips (media.cut_clips, in order) with their places in it."""
    out, at = [], 0
    for i, clip in enumerate(decoded):
        start, at = at, at + len(clip.value)
        out.append(Clip(i, start / media.SAMPLE_RATE, at / media.SAMPLE_RATE, clip))
    return out


def usage(clips: list[Clip]) -> dict[str, Any]:
    """OpenAI's token usage over the clips: the prompts' audio (soft) and text tokens, the replies'."""
    prompt = sum(c.prompt_tokens for c in clips)
    audio = sum(c.audio_tokens for c in clips)
    out = sum(c.output_tokens for c in clips)
    return {"type": "tokens", "input_tokens": prompt, "output_tokens": out, "total_tokens": prompt + out,
            "input_token_details": {"audio_tokens": audio, "text_tokens": prompt - audio}}


def joined(clips: list[Clip]) -> str:
    return " ".join(c.text for c in clips if c.text)


async def read_file(state: ServerState, form: TranscriptionForm | TranslationForm,
                    client: str) -> tuple[list[Clip], float]:
    """The uploaded file as clips and its length in seconds: decoded and cut in a media worker, holding a
    place in the queue (`ServerState.queue_place`) and one of the workers' places.

    Raises:
        ApiError: 400 naming `file`: a checkpoint without an audio tower, a file over --max-media-bytes,
            --max-audio-seconds or --max-media-decoded-bytes, another rate or more channels than the server
            reads, one that cannot be read or takes longer than --media-decode-timeout.
        SchedulerError: the queue or the client's share is full (429), the server drains (503).
    """
    loaded = state.loaded
    limits = state.media_limits
    if "audio" not in loaded.modalities:
        media.check_parts([media.Part("audio", "file", "")], limits, loaded.modalities, loaded.media_missing)
    data = await form.file.read(limits.item_bytes + 1)
    if len(data) > limits.item_bytes:
        raise bad_request("file", f"The file is larger than {limits.item_bytes} bytes (--max-media-bytes).")
    with state.queue_place(client):
        async with state.media_workers.place():
            seconds, decoded = await state.media_workers.decode_file(data, "file", limits, loaded.media.clip_samples)
    return clips_of(decoded), seconds


class Transcriber:
    """One request's clips through the chat path, one after another.

    Args:
        state: the server.
        request: the HTTP request (its client, its disconnect).
        form: the form.
        task: transcribe or translate.
        clips: the file's clips (`read_file`).
    """

    def __init__(self, state: ServerState, request: Request, form: TranscriptionForm | TranslationForm,
                 task: Task, clips: list[Clip]) -> None:
        self.state = state
        self.request = request
        self.clips = clips
        self.language = language_name(getattr(form, "language", None))
        self._client, self._gone = client_of(request), gone_of(request)
        self._bodies = [chat_request(state.config.model_name, task, self.language, form.prompt, form.temperature,
                                     c.decoded.seconds, logprobs=form.response_format == "verbose_json")
                        for c in clips]

    async def start(self, clip: Clip) -> Generation:
        """Queue one clip's chat request (`ServerState.start`)."""
        gens = await self.state.start(self._bodies[clip.index], self._client, self._gone, [clip.decoded],
                                      receive=self.request.receive)
        gen = gens[0]
        clip.prompt_tokens = len(gen.params.prompt_ids)
        clip.audio_tokens = sum(int(embeds.shape[0]) for _, embeds, _ in gen.params.media)
        return gen

    async def items(self) -> Items:
        """Every clip's text as it is written, the clips in order, each queued when the one before has ended;
        (clip index, None) at a clip's end. Each clip's transcript, tokens and log-probabilities are kept on it."""
        for clip in self.clips:
            gen = await self.start(clip)
            parts: list[str] = []
            async with aclosing(gen.pieces()) as pieces:
                async for piece in pieces:
                    clip.tokens += [t for t, _, _ in piece.logprobs]
                    clip.logprobs += [lp for _, lp, _ in piece.logprobs]
                    text = piece.text if parts else piece.text.lstrip()  # the transcript starts at its first word
                    if text:
                        parts.append(text)
                        yield clip.index, Piece(text)
            clip.text = "".join(parts).rstrip()
            clip.output_tokens = gen.completion_tokens
            yield clip.index, None


class TranscriptFormat:
    """A transcription's or translation's reply (a `serving.Format`): the clips' texts joined by a space.
    Streamed: `transcript.text.delta` events as the text is written, then `transcript.text.done` with the whole
    text and usage, then `data: [DONE]`. Whole: `json` (text and usage), `text`, or `verbose_json` (language,
    duration, text, one segment per clip).

    Args:
        clips: the request's clips (their texts and counts filled in as they are read).
        response_format: the form's.
        language: the language `verbose_json` names.
        seconds: the file's length.
        temperature: the form's (each segment reports it).
    """

    def __init__(self, clips: list[Clip], response_format: str, language: str, seconds: float,
                 temperature: float) -> None:
        self.clips = clips
        self.response_format = response_format
        self.media_type = "text/plain" if response_format == "text" else "application/json"
        self.language = language
        self.seconds = seconds
        self.temperature = temperature
        self._written: set[int] = set()  # clips whose text has begun

    def open(self) -> bytes:
        return b""

    def piece(self, index: int, piece: Piece) -> bytes:
        if not piece.text:
            return b""
        head = " " if index not in self._written and joined(self.clips[:index]) else ""
        self._written.add(index)
        return delta_event(head + piece.text)

    def finish(self, index: int) -> bytes:
        return b""

    def close(self) -> bytes:
        return sse.event({"type": "transcript.text.done", "text": joined(self.clips), "usage": usage(self.clips)}
                         ) + sse.DONE

    def error(self, err: ApiError) -> bytes:
        return sse.event(err.body()) + sse.DONE

    def whole(self, outputs: list[Output]) -> bytes:
        text = joined(self.clips)
        if self.response_format == "text":
            return text.encode()
        if self.response_format == "verbose_json":
            return sse.dumps(VerboseResponse(
                language=self.language, duration=round(self.seconds, 3), text=text,
                segments=[c.segment(self.temperature) for c in self.clips],
                usage={"type": "duration", "seconds": round(self.seconds, 3)}).model_dump())
        return sse.dumps(TextResponse(text=text, usage=usage(self.clips)).model_dump())


async def serve(state: ServerState, form: TranscriptionForm | TranslationForm, request: Request,
                task: Task) -> Response:
    """POST /v1/audio/transcriptions (task "transcribe") or /v1/audio/translations ("translate"): the file read
    into clips, then the clips' replies through `serving.reply` (a stream's first clip's first piece is awaited
    before it opens, so an early failure is a JSON error)."""
    state.check_model(form.model)
    language_name(getattr(form, "language", None))  # an unknown language is a 400 before the file is read
    try:  # a client that leaves while its file decodes stops the decode (its worker is killed)
        clips, seconds = await race_disconnect(request.receive, read_file(state, form, client_of(request)))
    except ClientDisconnected:
        return Response(status_code=499)
    job = Transcriber(state, request, form, task, clips)
    language = "english" if task == "translate" else (job.language or "unknown").lower()
    fmt = TranscriptFormat(clips, form.response_format, language, seconds, form.temperature)
    return await reply(request, job.items(), fmt, bool(getattr(form, "stream", False)))


# The routes' statuses for the OpenAPI document: the JSON shapes, plain text, or the event stream.
RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": TextResponse | VerboseResponse,
          "description": "The text: `json` (text and usage), `verbose_json` (language, duration, text, segments), "
                         "`text`; with `stream` (transcriptions), server-sent events `transcript.text.delta` and "
                         "`transcript.text.done`, then `data: [DONE]`.",
          "content": {"text/plain": {"schema": {"type": "string"}},
                      "text/event-stream": {"schema": openapi.SSE_EVENT}}},
    **openapi.errors(400, 404, 413, 429, 500, 503)}


def delta_event(text: str) -> bytes:
    return sse.event({"type": "transcript.text.delta", "delta": text})
