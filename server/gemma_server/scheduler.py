"""The scheduler: a bounded first-come-first-served queue in front of one or more batched engines.

Each engine (`gemma_engine.Engine`, one per device) is owned by one `EngineWorker` thread: the engine is
`unsendable`, so the thread that loads it is the one that runs it. A worker's thread first runs boot tasks
(`call`: load the weights, warm up), then the engine's own continuous-batching loop (`Engine.run`), which
calls back at every read point:

- `poll(free, idle)`: the worker asks the scheduler for new requests (at most `free`, the engine's free
  sequence slots) and for the ids of its requests to cancel. An idle engine waits here (the GIL is
  released while it waits) until there is work or the server stops.
- `on_events(events, stats)`: new tokens and ends, posted to each request's asyncio queue with
  `loop.call_soon_threadsafe`; step statistics go to the metrics.

Which engine takes a request: the one that holds its longest prefix. With prefix caching an engine's
finished slots keep what they wrote, and the engine itself picks the slot (it alone knows which prefixes
its KV can resume); the scheduler picks the engine. Each worker keeps the token histories of its recently
finished requests (`Histories`: prompt and output ids with their cache_salt, at most one per slot), and the
head of the queue goes to the engine with a free slot whose histories share the longest prefix with it
(same salt only), ties to the engine with the most free slots, which is the whole rule when nothing is
shared (`engines_for`). A full engine is never waited for, so no request starves behind it; the `n`
choices of one request stay together. Without this a conversation's turns would spread over the engines
and hit none of them (the design of llm-d's and the inference gateway's prefix-aware scorers, inside one
process).

Admission (`admit`) counts a request against `--queue-limit` before it is tokenized (TGI takes its
semaphore before validation; vLLM issue #58192 is the bug of counting only after rendering).

A request's end is decided once, by `Job.end`: the first cause wins (a stop string matched, the client left,
its reply stalled, the engine finished or failed it, the shutdown timeout cut it), and the `End` it holds is
what the stream, the response and the metrics all read (vLLM's output processor decides an abort once in the
same way: `reqs_to_abort` in vllm/v1/engine/output_processor.py). An end decided while the engine still runs
the request is its cancel: a queued job leaves the queue at once, a running one is cancelled at the engine's
next read point, which frees its slot for the next step.

This layer knows nothing of HTTP: it raises the plain exceptions below, and `errors.py` maps them to
statuses in one table. A BaseException from an engine (pyo3's PanicException) leaves that engine in an
unknown state: its worker is marked dead, its requests fail, and when no engine is left /health and /live
turn 503 so Kubernetes restarts the pod (vLLM's engine-dead watchdog).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


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
# engine loop ending under it (Scheduler.stop).
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
        scores: engine index -> (that engine's Histories.version, the job's score there), under the
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


# A retained history counts for a queued job only when it shares more than this part of the job's prompt:
# llama.cpp's server picks a slot by its cached prompt only above the same similarity (common prefix /
# prompt length > --slot-prompt-similarity, 0.1 by default: common/common.h, and get_available_slot in
# tools/server/server-context.cpp). Below it the few ids every prompt shares (BOS, the chat template's
# first markup) would pull every request to the first engine that served one, for a hit worth nothing.
MIN_SHARED_FRACTION = 0.1


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two id sequences, by bisection over slice equality (the
    comparisons run in C: a whole context of ids takes microseconds, not a Python loop over them)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Histories:
    """The token histories an engine's slots keep after their requests finished (with prefix caching the
    engine keeps one per slot: a finished slot holds the prompt and output ids it wrote), newest last: at
    most `size`, the oldest dropped first. A history that a new one extends is replaced by it (the new
    request most likely took over its slot, and anything it shares with a prompt the new one shares too).

    Args:
        size: most histories kept: the engine's slots (0 when it caches nothing: every score is then 0).
    Attributes:
        version: counts the changes, so a score computed against them can be reused until the next one.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.version = 0
        self._items: list[tuple[str | None, tuple[int, ...]]] = []

    def __len__(self) -> int:
        return len(self._items)

    def add(self, salt: str | None, ids: Sequence[int]) -> None:
        """Keep the history `ids` of a finished request of cache salt `salt`."""
        if self.size <= 0 or not ids:
            return
        ids = tuple(ids)
        self._items = [(s, h) for s, h in self._items if not (s == salt and ids[:len(h)] == h)]
        self._items.append((salt, ids))
        del self._items[:-self.size]
        self.version += 1

    def score(self, salt: str | None, prompt: Sequence[int]) -> int:
        """How many leading ids of `prompt` the best same-salt history shares; 0 unless that is more than
        MIN_SHARED_FRACTION of the prompt (None is a salt of its own, as in the engine)."""
        shared = max((common_prefix(h, prompt) for s, h in self._items if s == salt), default=0)
        return shared if shared > MIN_SHARED_FRACTION * len(prompt) else 0


def engines_for(candidates: Sequence[tuple[int, int]]) -> list[int]:
    """Which engines the head of the queue may go to, given each engine's (score, free slots): of the
    engines with a free slot, those with the best score, and of those the ones with the most free slots.
    A full engine is never waited for (no request starves behind it): with nothing shared, or when the
    engine that shares most is full, this is the engines with the most free slots.

    Returns:
        indices into `candidates` (ties: several), empty when no engine has a free slot.
    """
    open_ = [i for i, (_, free) in enumerate(candidates) if free > 0]
    if not open_:
        return []
    best = max(candidates[i][0] for i in open_)
    pool = [i for i in open_ if candidates[i][0] == best]
    most = max(candidates[i][1] for i in pool)
    return [i for i in pool if candidates[i][1] == most]


@dataclass
class StepObserver:
    """Where engine statistics go (metrics setters; no-ops by default)."""

    on_waiting: Callable[[int], None] = lambda n: None
    on_running: Callable[[int], None] = lambda n: None
    on_usage: Callable[[float], None] = lambda f: None
    on_steps: Callable[[dict], None] = lambda stats: None


class EngineWorker:
    """One engine on one device, on its own thread.

    Args:
        index: the engine's number (0..devices-1).
        device: the torch device it runs on ("cpu", "cuda:1", "tpu:3").
        scheduler: where it takes requests from.
    """

    def __init__(self, index: int, device: str, scheduler: Scheduler) -> None:
        self.index = index
        self.device = device
        self.scheduler = scheduler
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"engine-{index}")
        self.engine: Any = None
        self.max_batch = 0
        self.layout: dict[str, int] = {}
        self.weights: dict[str, Any] = {}
        self.free = 0  # free slots at the last read point
        self.active: dict[int, Job] = {}
        self.histories = Histories(0)  # what its finished slots hold; sized once the engine is loaded
        self.served = 0  # requests it has taken
        self.serving = False
        self.dead: str | None = None
        self._loop: Future | None = None

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on this worker's thread (boot tasks: the engine may only be touched there)."""
        return self._pool.submit(fn)

    def set_engine(self, engine: Any) -> None:
        """Called on this worker's thread once the engine is loaded."""
        self.engine = engine
        self.max_batch = int(engine.max_batch)
        self.layout = dict(engine.layout())
        self.weights = dict(engine.weights())
        self.speculative = engine.speculative
        self.free = self.max_batch
        # An engine without prefix caching keeps nothing: its histories stay empty and score 0.
        self.histories = Histories(self.max_batch if self.layout.get("prefix_caching") else 0)

    def serve(self, read_every: int) -> None:
        """Start the engine's loop on this worker's thread."""
        self.serving = True
        self._loop = self._pool.submit(self._run, read_every)

    def _run(self, read_every: int) -> None:
        try:
            self.engine.run(self._poll, self._on_events, read_every)
        except BaseException as e:  # an exception from the loop or a panic: the engine can no longer be trusted
            self.scheduler.worker_died(self, f"{type(e).__name__}: {e}")
            log.critical("engine %d died", self.index, exc_info=True)

    def _poll(self, free: int, idle: bool):
        taken = self.scheduler.poll(self, free, idle)
        if taken is None:
            return None
        jobs, cancels = taken
        return [j.request for j in jobs], cancels

    def _on_events(self, events, stats: dict) -> None:
        now = time.monotonic()
        # The steps are counted before their tokens are posted: a scrape after a reply sees every step of it.
        if stats.get("batch_sizes") or stats.get("prompt_tokens") or stats.get("cache_queries"):
            self.scheduler.observer.on_steps(stats)
        for e in events:
            job = self.active.get(e.id)
            if job is None:
                continue
            prompt_logprobs = getattr(e, "prompt_logprobs", None)
            if prompt_logprobs is not None:
                job.post("prompt_logprobs", list(prompt_logprobs))
            if e.tokens:
                job.output += e.tokens
                job.post("tokens", (list(e.tokens), list(e.logprobs), now))
            if e.finish is not None:
                # A request refused or failed leaves no history its slot could be trusted for.
                self.scheduler.finished(self, job, wrote=e.finish not in ("error", "failed"))
                if e.finish == "error":
                    job.post("error", EngineRefused(e.error or "refused"))
                elif e.finish == "failed":
                    log.error("engine %d failed request %d: %s", self.index, job.id, e.error)
                    job.post("error", EngineFailed(f"The engine failed this request: {e.error}"))
                else:
                    job.post("done", Done(e.finish, e.prompt_s, e.decode_s, e.cached_tokens))

    def describe(self) -> dict[str, Any]:
        """What /v1/engine shows of this engine."""
        return {
            "index": self.index, "device": self.device, "max_batch": self.max_batch, "active": len(self.active),
            "served": self.served,
            "kv_bytes_per_slot": self.layout.get("kv_bytes_per_slot"), "kv_bytes": self.layout.get("kv_bytes"),
            "weight_bytes": self.weights.get("bytes"), "int4_weights": self.weights.get("int4"),
            "linear": self.weights.get("linear"), "linear_note": self.weights.get("linear_note"),
            "tensor_parallel_size": self.layout.get("tensor_parallel_size"), "speculative": self.speculative,
            "serving": self.serving, "dead": self.dead,
        }

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


class Scheduler:
    """The queue and the engines behind it. See the module docstring.

    Args:
        queue_limit: most requests admitted but not yet in an engine.
        observer: metrics hooks.
    """

    def __init__(self, queue_limit: int, observer: StepObserver | None = None) -> None:
        self.queue_limit = queue_limit
        self.observer = observer or StepObserver()
        self.workers: list[EngineWorker] = []
        self._cond = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._admitted = 0  # admitted, not yet in an engine (queued or still tokenizing)
        self.ready = False
        self.draining = False
        self.dead: str | None = None
        self._stopping = False

    # ---- asyncio side --------------------------------------------------------------------------

    def admit(self, count: int = 1) -> None:
        """Count `count` jobs (a request's choices) against the queue limit, before any tokenizing: all of
        them or none.

        Raises:
            EngineDead, NotReady, Draining, QueueFull.
        """
        if self.dead:
            raise EngineDead(f"No engine is running: {self.dead}")
        if not self.ready:
            raise NotReady("The model is loading.")
        if self.draining:
            raise Draining()
        with self._cond:
            if self._admitted + count > self.queue_limit:
                raise QueueFull(self.queue_limit)
            self._admitted += count
            self._gauges()

    def release(self, count: int = 1) -> None:
        """Give back admissions that never became jobs (e.g. the prompt was bad)."""
        with self._cond:
            self._admitted -= count
            self._gauges()

    def submit(self, *jobs: Job) -> None:
        """Queue admitted jobs, all at once: the `n` choices of one request reach an engine in one
        poll when it has the slots, so it reads their shared prompt once. A drain that began after their
        admission does not refuse them: an admitted request counts as waiting (gemma_num_requests_waiting),
        and the drain lets waiting requests finish.

        Raises:
            EngineDead: nothing was queued; the caller releases its admissions.
        """
        with self._cond:
            if self.dead:
                raise EngineDead(f"No engine is running: {self.dead}")
            self._queue.extend(jobs)
            self._cond.notify_all()

    def withdraw(self, job: Job) -> bool:
        """Take a job that has not reached an engine out of the queue. Returns whether it was still queued."""
        with self._cond:
            try:
                self._queue.remove(job)
            except ValueError:
                return False
            self._admitted -= 1
            self._gauges()
            return True

    def queued(self) -> int:
        """Requests admitted and not yet in an engine (queued or still tokenizing)."""
        with self._cond:
            return self._admitted

    def running(self) -> int:
        """Sequence slots occupied, over every engine (gemma_num_requests_running)."""
        with self._cond:
            return sum(len(w.active) for w in self.workers)

    def busy(self) -> bool:
        """True while a request runs or waits."""
        with self._cond:
            return self._admitted > 0 or any(w.active for w in self.workers)

    def start_drain(self) -> None:
        """Refuse new work from now on; queued and running jobs continue."""
        self.draining = True

    def abort_all(self) -> None:
        """Shutdown timeout reached: end every running and queued job (the engine cancels the running ones)."""
        with self._cond:
            queued, self._queue = list(self._queue), collections.deque()
            self._admitted -= len(queued)
            running = [job for w in self.workers for job in w.active.values()]
            self._gauges()
        for job in running:
            job.end(Cause.SHUTDOWN, error=Shutdown(
                "The server shut down before this request finished (--shutdown-timeout reached)."))
        for job in queued:
            end = job.end(Cause.SHUTDOWN, error=Shutdown("The server shut down before this request started."))
            job.post("error", end.error)

    def stop(self) -> None:
        """End the engines' loops (requests still running end cancelled)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for w in self.workers:
            w.shutdown()

    def start(self, workers: list[EngineWorker], read_every: int) -> None:
        """Boot is done: the workers start serving."""
        with self._cond:
            self.workers = list(workers)
        for w in workers:
            w.serve(read_every)
        self.ready = True

    def capacity(self) -> int:
        """Sequence slots of the serving engines."""
        return sum(w.max_batch for w in self.workers if w.serving and not w.dead)

    # ---- worker side -----------------------------------------------------------------------------

    def poll(self, worker: EngineWorker, free: int, idle: bool) -> tuple[list[Job], list[int]] | None:
        """A worker's read point: its new jobs and cancels, or None when the server stops or the engine was found
        dead meanwhile (a lost tensor-parallel rank, reported from a watcher while the engine idled)."""
        with self._cond:
            worker.free = free
            while True:
                if self._stopping or worker.dead:
                    return None
                cancels = []
                for job in worker.active.values():
                    if job.ended is not None and not job.cancel_sent:
                        job.cancel_sent = True
                        cancels.append(job.id)
                jobs = self._take(worker)
                if jobs:
                    self._gauges()
                    if self._queue:  # the new head may be another engine's: a waiting one looks again
                        self._cond.notify_all()
                if jobs or cancels or not idle:
                    return jobs, cancels
                self._cond.wait()

    def _take(self, worker: EngineWorker) -> list[Job]:
        """The queued jobs `worker` takes now (under the lock): from the head, while it has free slots and
        is the head's engine (`engines_for`); the choices of one request follow their first."""
        jobs: list[Job] = []
        while self._queue and worker.free > 0:
            job = self._queue[0]
            if job.ended is None and not (jobs and job.same_prompt(jobs[-1])) and not self._is_for(worker, job):
                break
            self._queue.popleft()
            self._admitted -= 1
            if job.ended is not None:  # ended while queued, but reached here first
                job.post("done", Done("cancelled", 0.0, 0.0))
                continue
            job.started = time.monotonic()
            worker.active[job.id] = job
            worker.served += 1
            worker.free -= 1
            jobs.append(job)
        return jobs

    def _is_for(self, worker: EngineWorker, job: Job) -> bool:
        """Whether `worker` is one of the engines `job` should go to now (`engines_for`)."""
        serving = [w for w in self.workers if w.serving and not w.dead]
        if len(serving) <= 1:
            return True
        chosen = engines_for([(self._score(w, job), w.free) for w in serving])
        return any(serving[i] is worker for i in chosen)

    @staticmethod
    def _score(worker: EngineWorker, job: Job) -> int:
        """`job`'s score on `worker`'s histories, computed once per version of them."""
        cached = job.scores.get(worker.index)
        if cached is None or cached[0] != worker.histories.version:
            cached = job.scores[worker.index] = (worker.histories.version,
                                                 worker.histories.score(job.salt, job.prompt))
        return cached[1]

    def finished(self, worker: EngineWorker, job: Job, wrote: bool = True) -> None:
        """`job` left `worker`'s engine; when `wrote`, its slot keeps its prompt and output ids."""
        with self._cond:
            worker.active.pop(job.id, None)
            worker.free += 1
            if wrote:
                worker.histories.add(job.salt, job.prompt + tuple(job.output))
            self._gauges()
            if self._queue:  # a freed slot or a new history may make another engine the head's
                self._cond.notify_all()

    def worker_died(self, worker: EngineWorker, reason: str) -> None:
        """Fail the dead engine's requests; with no engine left, fail the queue too."""
        with self._cond:
            worker.dead = worker.dead or reason  # the first report names the cause
            failed, worker.active = list(worker.active.values()), {}
            if all(w.dead for w in self.workers):
                self.dead = reason
                self.ready = False
                queued, self._queue = list(self._queue), collections.deque()
                self._admitted -= len(queued)
                failed += queued
            self._gauges()
            self._cond.notify_all()
        for job in failed:
            job.post("error", EngineDead(f"The engine failed: {reason}"))

    def _gauges(self) -> None:
        running = self.running()
        self.observer.on_waiting(self._admitted)
        self.observer.on_running(running)
        capacity = self.capacity()
        self.observer.on_usage(running / capacity if capacity else 0.0)
