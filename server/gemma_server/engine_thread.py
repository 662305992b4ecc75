"""The one thread that owns the engine, and the bounded queue in front of it.

`gemma_engine.Engine` is `unsendable`: only the thread that built it may call it. So this thread runs the
boot stages that create the engine (weights, warmup) and then serves decodes one at a time. The asyncio
side talks to it through `Job`s:

- admission (`admit`) counts a request against `--queue-limit` before it is tokenized (TGI takes its
  semaphore before validation; vLLM issue #58192 is the bug of counting only after rendering);
- the engine's `on_tokens` callback posts each token batch to the job's asyncio queue with
  `loop.call_soon_threadsafe`, and returns False once the job is cancelled, so a disconnect, a stop
  string or a shutdown stops the decode within one token batch (vLLM aborts the same way on
  `CancelledError`);
- a cancelled job that has not started leaves the queue at once.

An exception from a decode goes to that request only; the thread keeps serving. A BaseException that is
not an Exception (pyo3's PanicException) leaves the engine in an unknown state: the thread marks itself
dead, so /health and /live turn 503 and Kubernetes restarts the pod (vLLM's engine-dead watchdog).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gemma_server.errors import ApiError, NotReady, ShuttingDown

log = logging.getLogger(__name__)


@dataclass
class Done:
    """The engine's answer: finish is "stop" | "length" | "cancelled"."""

    tokens: list[int]
    finish: str
    read_s: float
    decode_s: float


@dataclass(eq=False)
class Job:
    """One request's decode, shared between the asyncio side and the engine thread.

    Events on `events` (asyncio side): ("tokens", (ids, t_monotonic)), ("done", Done),
    ("error", exception). `cancel` is written by the asyncio side and read by the engine thread between
    token batches; a str assignment is atomic under the GIL.
    """

    prompt_ids: list[int]
    max_new: int
    stop_ids: list[int]
    loop: asyncio.AbstractEventLoop
    arrival: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: str | None = None  # "abort" (client left), "stop" (stop string), "shutdown"
    started: float | None = None

    def post(self, kind: str, payload: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


class QueueFull(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            429,
            f"The server is overloaded: {limit} requests are already waiting for the engine. Retry later.",
            headers={"Retry-After": "1"},
        )


class EngineThread(threading.Thread):
    """Owns the engine: boots it, then runs queued decodes one at a time.

    Args:
        boot: called on this thread; returns the engine (anything with gemma_engine.Engine's `decode`),
            or raises; boot failures are the boot's business (it records and reports them).
        queue_limit: most requests admitted but not yet decoding.
        read_every: the engine's read_every for every decode.
        on_waiting / on_running: gauges' setters (metrics), called with the new counts.
    """

    def __init__(
        self,
        boot: Callable[[], Any],
        queue_limit: int,
        read_every: int = 1,
        on_waiting: Callable[[int], None] = lambda n: None,
        on_running: Callable[[int], None] = lambda n: None,
    ) -> None:
        super().__init__(name="engine", daemon=True)
        self._boot = boot
        self.queue_limit = queue_limit
        self.read_every = read_every
        self._on_waiting = on_waiting
        self._on_running = on_running
        self._cond = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._admitted = 0  # admitted, not yet decoding (queued or still tokenizing)
        self.running: Job | None = None
        self.engine: Any = None
        self.ready = False
        self.dead: str | None = None  # why the thread died
        self.draining = False
        self._stopping = False

    # ---- asyncio side --------------------------------------------------------------------------

    def admit(self) -> None:
        """Count one request against the queue limit, before any tokenizing.

        Raises:
            NotReady: booting or dead (503). ShuttingDown: draining (503). QueueFull: over the limit (429).
        """
        if self.dead:
            raise NotReady(f"The engine thread died: {self.dead}")
        if not self.ready:
            raise NotReady("The model is loading.")
        if self.draining:
            raise ShuttingDown()
        with self._cond:
            if self._admitted >= self.queue_limit:
                raise QueueFull(self.queue_limit)
            self._admitted += 1
            self._on_waiting(self._admitted)

    def release(self) -> None:
        """Give back an admission that never became a job (e.g. the prompt was bad)."""
        with self._cond:
            self._admitted -= 1
            self._on_waiting(self._admitted)

    def submit(self, job: Job) -> None:
        """Queue an admitted job.

        Raises:
            ShuttingDown: the server began draining while the request was being tokenized.
        """
        with self._cond:
            if self.dead:  # died while this request was being tokenized: nobody would read the queue
                raise NotReady(f"The engine thread died: {self.dead}")
            if self.draining:
                raise ShuttingDown()  # the caller releases its admission
            self._queue.append(job)
            self._cond.notify()

    def withdraw(self, job: Job) -> bool:
        """Take a job that has not started out of the queue. Returns whether it was still queued."""
        with self._cond:
            try:
                self._queue.remove(job)
            except ValueError:
                return False
            self._admitted -= 1
            self._on_waiting(self._admitted)
            return True

    def busy(self) -> bool:
        """True while a decode runs or requests wait."""
        with self._cond:
            return self.running is not None or self._admitted > 0

    def start_drain(self) -> None:
        """Refuse new work from now on; queued and running jobs continue."""
        self.draining = True

    def abort_all(self) -> None:
        """Shutdown timeout reached: stop the running decode and fail every queued job."""
        with self._cond:
            queued, self._queue = list(self._queue), collections.deque()
            self._admitted -= len(queued)
            self._on_waiting(self._admitted)
            if self.running is not None:
                self.running.cancel = "shutdown"
        for job in queued:
            job.cancel = "shutdown"
            job.post("error", ShuttingDown("The server shut down before this request started."))

    def stop(self) -> None:
        """Let the thread end after the current decode."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    # ---- engine thread ------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self.engine = self._boot()
        except BaseException as e:  # the boot reports its own failure; the thread just ends
            self.dead = f"boot failed: {e}"
            return
        self.ready = True
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._admitted -= 1
                self._on_waiting(self._admitted)
                self.running = job
                self._on_running(1)
            try:
                self._decode(job)
            except BaseException as e:  # a panic: the engine can no longer be trusted
                self.dead = f"{type(e).__name__}: {e}"
                self.ready = False
                log.critical("engine thread died: %s", self.dead, exc_info=True)
                job.post("error", ApiError(500, f"The engine failed: {self.dead}"))
                with self._cond:
                    queued, self._queue = list(self._queue), collections.deque()
                    self._admitted -= len(queued)  # so busy() turns false and a SIGTERM exits at once
                    self._on_waiting(self._admitted)
                for other in queued:
                    other.post("error", NotReady(f"The engine thread died: {self.dead}"))
                return
            finally:
                with self._cond:
                    self.running = None
                    self._on_running(0)

    def _decode(self, job: Job) -> None:
        if job.cancel is not None:  # left while queued but we popped it first
            job.post("done", Done([], "cancelled", 0.0, 0.0))
            return
        job.started = time.monotonic()
        post = job.post

        def on_tokens(batch: list[int]) -> bool:
            post("tokens", (batch, time.monotonic()))
            return job.cancel is None

        try:
            tokens, finish, read_s, decode_s = self.engine.decode(
                job.prompt_ids, job.max_new, job.stop_ids, self.read_every, on_tokens
            )
        except Exception as e:  # noqa: BLE001 - goes to the one request that caused it
            log.exception("decode failed")
            post("error", e)
            return
        post("done", Done(list(tokens), finish, read_s, decode_s))
