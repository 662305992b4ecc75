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

The scheduler's state has one owner per piece. `Capacity` holds the counts (requests admitted and not yet in
an engine, each engine's free slots), written only by its methods under the scheduler's lock. `Lifecycle`
holds readiness, the one state that admission, /health, /live, /v1/engine, the MCP `endpoint_status` and the
SIGTERM drain read: LOADING until the boot starts the engines, SERVING, DRAINING from SIGTERM, and DEAD with
its reason (the boot's failed stage, or the last engine's death) from any phase. How a request ends is
`jobs.py`'s (`Job.end`).

This layer knows nothing of HTTP: it raises the plain exceptions of `jobs.py`, and `errors.py` maps them to
statuses in one table. A BaseException from an engine (pyo3's PanicException) leaves that engine in an
unknown state: its worker is marked dead, its requests fail, and when no engine is left /health and /live
turn 503 so Kubernetes restarts the pod (vLLM's engine-dead watchdog).
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from gemma_server.jobs import (
    Cause,
    Done,
    Draining,
    EngineDead,
    EngineFailed,
    EngineRefused,
    Job,
    NotReady,
    QueueFull,
    SchedulerError,
    Shutdown,
)

log = logging.getLogger(__name__)


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


class Phase(enum.Enum):
    """Where the server is in its life (`Lifecycle`)."""

    LOADING = "loading"  # the boot runs: requests are refused (NotReady)
    SERVING = "serving"
    DRAINING = "draining"  # SIGTERM: new requests are refused, admitted ones finish
    DEAD = "dead"  # the boot failed or no engine is left: nothing is served again


@dataclass(frozen=True)
class Life:
    """One reading of the `Lifecycle`, taken whole.

    Attributes:
        phase: where the server is.
        reason: why it is DEAD (the boot's failed stage, or the last engine's death), else None.
        draining: whether the SIGTERM drain began (a dead server drains too: its process must still exit).
    """

    phase: Phase = Phase.LOADING
    reason: str | None = None
    draining: bool = False

    def refusal(self) -> SchedulerError | None:
        """What a new request is refused with now, or None while SERVING."""
        if self.phase is Phase.DEAD:
            return EngineDead(f"No engine is running: {self.reason}")
        if self.phase is Phase.LOADING:
            return NotReady("The model is loading.")
        if self.phase is Phase.DRAINING:
            return Draining()
        return None


class Lifecycle:
    """The server's readiness, its one owner: LOADING -> SERVING (`serve`: the boot started the engines) ->
    DRAINING (`drain`: SIGTERM), and DEAD (`fail`) from any phase, keeping the first reason. Written from the
    boot thread, the workers and the event loop, each change whole under its lock; `now()` reads it whole."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now = Life()

    def now(self) -> Life:
        return self._now

    def serve(self) -> None:
        with self._lock:
            if self._now.phase is Phase.LOADING:
                self._now = Life(Phase.SERVING)

    def drain(self) -> bool:
        """Refuse new work from now on (queued and running jobs continue). Returns whether this call began
        the drain (False when it had begun already)."""
        with self._lock:
            now = self._now
            if now.draining:
                return False
            phase = now.phase if now.phase is Phase.DEAD else Phase.DRAINING
            self._now = Life(phase, now.reason, draining=True)
            return True

    def fail(self, reason: str) -> None:
        """Nothing can serve any more: the boot failed, or the last engine died. The first reason stays."""
        with self._lock:
            if self._now.phase is not Phase.DEAD:
                self._now = Life(Phase.DEAD, reason, self._now.draining)


class Capacity:
    """The scheduler's counts, written only by these methods and under the scheduler's lock: the requests
    admitted and not yet in an engine (queued, or still tokenizing), and each engine's free sequence slots
    (by worker index), as it reported them at its last read point, less what it took since."""

    def __init__(self) -> None:
        self._admitted = 0
        self._free: dict[int, int] = {}

    @property
    def admitted(self) -> int:
        return self._admitted

    def free(self, engine: int) -> int:
        return self._free.get(engine, 0)

    def admit(self, count: int, limit: int) -> None:
        """Count `count` admissions, all or none.

        Raises:
            QueueFull: they would pass `limit`.
        """
        if self._admitted + count > limit:
            raise QueueFull(limit)
        self._admitted += count

    def release(self, count: int = 1) -> None:
        """Admissions that leave without reaching an engine (a bad prompt, withdrawn, aborted, failed)."""
        self._admitted -= count

    def report(self, engine: int, free: int) -> None:
        """An engine's own count of its free slots: all of them once it is loaded, then at each read point."""
        self._free[engine] = free

    def take(self, engine: int) -> None:
        """A queued job went to `engine`: it leaves the admitted count and takes a slot."""
        self._admitted -= 1
        self._free[engine] -= 1

    def freed(self, engine: int) -> None:
        """A job left `engine`: its slot is free."""
        self._free[engine] = self.free(engine) + 1


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
        self.active: dict[int, Job] = {}
        self.histories = Histories(0)  # what its finished slots hold; sized once the engine is loaded
        self.served = 0  # requests it has taken
        self.serving = False
        self.dead: str | None = None
        self._loop: Future | None = None

    @property
    def free(self) -> int:
        """Free slots at the last read point, less those taken since (`Capacity`)."""
        return self.scheduler.places.free(self.index)

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
        self.scheduler.sized(self)
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
    Attributes:
        places: the counts (`Capacity`), changed only under the scheduler's lock.
        lifecycle: the server's readiness (`Lifecycle`); the boot marks it dead when a stage fails.
    """

    def __init__(self, queue_limit: int, observer: StepObserver | None = None) -> None:
        self.queue_limit = queue_limit
        self.observer = observer or StepObserver()
        self.workers: list[EngineWorker] = []
        self._cond = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self.places = Capacity()
        self.lifecycle = Lifecycle()
        self._stopping = False

    # ---- asyncio side --------------------------------------------------------------------------

    def admit(self, count: int = 1) -> None:
        """Count `count` jobs (a request's choices) against the queue limit, before any tokenizing: all of
        them or none.

        Raises:
            EngineDead, NotReady, Draining, QueueFull.
        """
        refusal = self.lifecycle.now().refusal()
        if refusal is not None:
            raise refusal
        with self._cond:
            self.places.admit(count, self.queue_limit)
            self._gauges()

    def release(self, count: int = 1) -> None:
        """Give back admissions that never became jobs (e.g. the prompt was bad)."""
        with self._cond:
            self.places.release(count)
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
            life = self.lifecycle.now()
            if life.phase is Phase.DEAD:
                raise life.refusal()
            self._queue.extend(jobs)
            self._cond.notify_all()

    def withdraw(self, job: Job) -> bool:
        """Take a job that has not reached an engine out of the queue. Returns whether it was still queued."""
        with self._cond:
            try:
                self._queue.remove(job)
            except ValueError:
                return False
            self.places.release()
            self._gauges()
            return True

    def queued(self) -> int:
        """Requests admitted and not yet in an engine (queued or still tokenizing)."""
        with self._cond:
            return self.places.admitted

    def running(self) -> int:
        """Sequence slots occupied, over every engine (gemma_num_requests_running)."""
        with self._cond:
            return sum(len(w.active) for w in self.workers)

    def busy(self) -> bool:
        """True while a request runs or waits."""
        with self._cond:
            return self.places.admitted > 0 or any(w.active for w in self.workers)

    def start_drain(self) -> bool:
        """Refuse new work from now on; queued and running jobs continue (`Lifecycle.drain`). Returns whether
        this call began the drain."""
        return self.lifecycle.drain()

    def abort_all(self) -> None:
        """Shutdown timeout reached: end every running and queued job (the engine cancels the running ones)."""
        with self._cond:
            queued, self._queue = list(self._queue), collections.deque()
            self.places.release(len(queued))
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
        self.lifecycle.serve()

    def sized(self, worker: EngineWorker) -> None:
        """`worker`'s engine is loaded (on its thread): all its slots are free."""
        with self._cond:
            self.places.report(worker.index, worker.max_batch)

    def capacity(self) -> int:
        """Sequence slots of the serving engines."""
        return sum(w.max_batch for w in self.workers if w.serving and not w.dead)

    # ---- worker side -----------------------------------------------------------------------------

    def poll(self, worker: EngineWorker, free: int, idle: bool) -> tuple[list[Job], list[int]] | None:
        """A worker's read point: its new jobs and cancels, or None when the server stops or the engine was found
        dead meanwhile (a lost tensor-parallel rank, reported from a watcher while the engine idled)."""
        with self._cond:
            self.places.report(worker.index, free)
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
            if job.ended is not None:  # ended while queued, but reached here first
                self.places.release()
                job.post("done", Done("cancelled", 0.0, 0.0))
                continue
            self.places.take(worker.index)
            job.started = time.monotonic()
            worker.active[job.id] = job
            worker.served += 1
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
            self.places.freed(worker.index)
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
                self.lifecycle.fail(reason)
                queued, self._queue = list(self._queue), collections.deque()
                self.places.release(len(queued))
                failed += queued
            self._gauges()
            self._cond.notify_all()
        for job in failed:
            job.post("error", EngineDead(f"The engine failed: {reason}"))

    def _gauges(self) -> None:
        """The queue's gauges (the caller holds the lock)."""
        running = sum(len(w.active) for w in self.workers)
        self.observer.on_waiting(self.places.admitted)
        self.observer.on_running(running)
        capacity = self.capacity()
        self.observer.on_usage(running / capacity if capacity else 0.0)
