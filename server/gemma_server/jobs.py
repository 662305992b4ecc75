"""A request's job: its decode, shared between the asyncio side and an engine worker (`Job`), how it ends
(`End`, `Cause`, the engine's `Done`), the scheduler's refusals (`SchedulerError` and its kinds; `errors.py`
gives each its HTTP status in one table) and each client's share of the server (`ClientShares`).

A request's end is decided once, by `Job.end`: the first cause wins (a stop string matched, the client left,
its reply stalled, the engine finished or failed it, the shutdown timeout cut it), and the `End` it holds is
what the stream, the response and the metrics all read (vLLM's output processor decides an abort once in the
same way: `reqs_to_abort` in vllm/v1/engine/output_processor.py). An end decided while the engine still runs
the request is its cancel: a queued job leaves the queue at once, a running one is cancelled at the engine's
next read point, which frees its slot for the next step.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class SchedulerError(Exception):
    """Base of the scheduler's refusals; errors.py gives each its HTTP status."""


class QueueFull(SchedulerError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"The server is overloaded: {limit} requests are already waiting for an engine. Retry later.")


class Draining(SchedulerError):
    def __init__(self, message: str = "The server is shutting down; retry on another replica.") -> None:
        super().__init__(message)


class NotReady(SchedulerError):
    """Still booting."""


class EngineDead(SchedulerError):
    """No engine is left to serve (or the request's engine died under it)."""


class EngineRefused(SchedulerError):
    """The engine refused one request for its own values (its checks; ours should have caught it first)."""


class EngineFailed(SchedulerError):
    """The engine failed while admitting or running one request (it serves the next ones)."""


class Shutdown(SchedulerError):
    """The shutdown timeout cut the request."""


class OverShare(SchedulerError):
    """One client already has its share of the server's slots and queue."""

    def __init__(self, client: str, held: int, limit: int) -> None:
        super().__init__(f"This client already has {held} choices queued or running, and one client may hold "
                         f"{limit}. Retry when some have finished.")


class ClientShares:
    """How many choices (a request's n) each client address has queued or running, and the cap on them, so
    one client cannot take every slot and the whole queue (say with n=16 requests).

    Args:
        limit: most choices per client; 0: half of the server's slots and queue, and at least one request of
            the largest n (16).
    """

    MIN = 16

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: collections.Counter[str] = collections.Counter()

    def cap(self, total: int) -> int:
        """The cap for a server of `total` slots and queue places."""
        return self.limit or max(self.MIN, total // 2)

    def take(self, client: str, n: int, total: int) -> None:
        """Count `n` choices against `client`'s share (each given back by `give_back` when it ends).

        Raises:
            OverShare: the client would hold more than its cap.
        """
        cap = self.cap(total)
        if self.held[client] + n > cap:
            raise OverShare(client, self.held[client], cap)
        self.held[client] += n

    def give_back(self, client: str, n: int) -> None:
        if n:
            self.held[client] -= n
            if self.held[client] <= 0:
                del self.held[client]


@dataclass
class Done:
    """The engine's end of a request: finish is "stop" | "length" | "cancelled"; the engine's own clocks;
    the prompt tokens it took from the prefix cache (`gemma_engine.Event.cached_tokens`)."""

    finish: str
    prompt_s: float
    decode_s: float
    cached_tokens: int = 0


class Cause(enum.Enum):
    """Why a request ended (`Job.end`)."""

    STOP_STRING = "a stop string matched"
    CLIENT_GONE = "the client left"
    STALLED = "the client stopped reading its reply"
    ENGINE = "the engine finished it"
    FAILED = "the engine refused or failed it"
    SHUTDOWN = "the shutdown timeout cut it"


# Cause -> (OpenAI's finish_reason, gemma_request_success's finished_reason label). A request that failed has
# no finish_reason: its client gets the error instead.
_ENDS: dict[Cause, tuple[str | None, str]] = {
    Cause.STOP_STRING: ("stop", "stop"),
    Cause.CLIENT_GONE: ("abort", "abort"),
    Cause.STALLED: ("abort", "abort"),
    Cause.FAILED: (None, "error"),
    Cause.SHUTDOWN: (None, "abort"),
}
# The engine's finish (gemma_engine.Event.finish) -> the same pair; "cancelled" without our asking is the
# engine loop ending under it (scheduler.Scheduler.stop).
_ENGINE_FINISHES: dict[str, tuple[str, str]] = {
    "stop": ("stop", "stop"), "length": ("length", "length"), "cancelled": ("abort", "abort")}


@dataclass(frozen=True)
class End:
    """How a request ended, as decided once.

    Attributes:
        cause: what ended it.
        finish_reason: OpenAI's finish_reason ("stop", "length", "abort"); None when the request failed.
        label: the `finished_reason` it is counted under in gemma_request_success (stop, length, abort, error).
        error: what its client is answered instead of a finish_reason (a SchedulerError), or None.
    """

    cause: Cause
    finish_reason: str | None
    label: str
    error: SchedulerError | None = None

    @classmethod
    def of(cls, cause: Cause, engine_finish: str | None = None, error: SchedulerError | None = None) -> End:
        """The end `cause` makes (with the engine's own finish for Cause.ENGINE, the error for FAILED and
        SHUTDOWN).

        Raises:
            ValueError: a cause without what it needs (an engine finish, an error) or with what it has not.
        """
        if cause is Cause.ENGINE:
            if engine_finish not in _ENGINE_FINISHES:
                raise ValueError(f"the engine's finish must be one of {sorted(_ENGINE_FINISHES)}, "
                                 f"got {engine_finish!r}")
            return cls(cause, *_ENGINE_FINISHES[engine_finish])
        if (error is not None) != (cause in (Cause.FAILED, Cause.SHUTDOWN)):
            raise ValueError(f"{cause.name} {'needs' if error is None else 'takes no'} error")
        return cls(cause, *_ENDS[cause], error=error)


_ids = itertools.count(1)


@dataclass(eq=False)
class Job:
    """One request's decode, shared between the asyncio side and an engine worker.

    Events on `events` (asyncio side): ("prompt_logprobs", entries) first when the request asked for them,
    ("tokens", (ids, logprobs, t_monotonic)), ("done", Done), ("error", exception). `ended` is written once, by `end`, and read by the worker at read points: a job that has ended
    while the engine still runs it is cancelled there.

    Attributes:
        request: the gemma_engine.Request the worker hands to its engine, built on the asyncio side
            (`Job.create`) so that the engine's own checks of its values answer this request alone.
        prompt, salt: the request's prompt ids and cache_salt, as the engine got them (its getters): what
            the scheduler scores engines by.
        output: the ids the engine generated (written on its worker's thread): with the prompt, the
            history its slot keeps when it ends.
        scores: engine index -> (that engine's scheduler.Histories.version, the job's score there), under the
            scheduler's lock, so a job waiting at the head is scored again only when an engine's
            histories change.
    """

    request: Any
    loop: asyncio.AbstractEventLoop
    arrival: float
    id: int = field(default_factory=lambda: next(_ids))
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    ended: End | None = None
    cancel_sent: bool = False
    started: float | None = None
    prompt: tuple[int, ...] = ()
    salt: str | None = None
    output: list[int] = field(default_factory=list, repr=False)
    scores: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)
    _deciding: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def create(cls, prompt_ids: list[int], max_new: int, stop_ids: list[int], sampling: dict[str, Any],
               loop: asyncio.AbstractEventLoop, arrival: float, grammar: str | None = None,
               prompt_logprobs: int | None = None, cache_salt: str | None = None,
               cache_boundary: int | None = None, media: Sequence[tuple[int, Any, int]] = (),
               next_turn: int | None = None, speculative: bool = True) -> Job:
        """A job and its gemma_engine.Request (with its SamplingParams, keyword arguments `sampling`; its
        grammar and prompt log-probabilities, when asked for; its cache salt and its cache marks, the
        boundary and the next turn; the soft tokens of its images and audio; whether it may speculate).

        Raises:
            EngineRefused: the engine's own checks refused a value (ValueError, which names it), or a value
                does not fit the engine's integer types (OverflowError): this request's 400.
        """
        import gemma_engine

        job_id = next(_ids)
        try:
            request = gemma_engine.Request(job_id, prompt_ids, max_new, stop_ids, gemma_engine.SamplingParams(**sampling),
                                           grammar=grammar, prompt_logprobs=prompt_logprobs, cache_salt=cache_salt,
                                           cache_boundary=cache_boundary, media=list(media), next_turn=next_turn,
                                           speculative=speculative)
        except (ValueError, OverflowError) as e:
            raise EngineRefused(f"The engine refused the request: {e}") from e
        return cls(request, loop, arrival, id=job_id, prompt=tuple(request.ids), salt=request.cache_salt)

    def same_prompt(self, other: Job) -> bool:
        """Whether `other` has this job's prompt and salt (the n choices of one request do)."""
        return self.salt == other.salt and self.prompt == other.prompt

    def end(self, cause: Cause, engine_finish: str | None = None, error: SchedulerError | None = None) -> End:
        """Decide this request's end, unless it is decided already: the first decision wins, from any thread.

        Args: as `End.of`.
        Returns:
            the end that holds (this one, or the one decided before).
        """
        with self._deciding:
            if self.ended is None:
                self.ended = End.of(cause, engine_finish, error)
            return self.ended

    def post(self, kind: str, payload: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))

