"""Unit tests of scheduler.py: admission, free slots, the drain and the shutdown timeout, a dead engine and a
failed request. The engine is the real one on the tiny chat checkpoint, loaded on its worker's thread as the
boot loads it; faults come from `Engine.inject_fault_for_tests` or from a step hook that raises inside the
engine's loop. No HTTP: jobs are made, submitted and read as the request handlers do."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from gemma_server.scheduler import (
    Cause,
    Draining,
    EngineDead,
    EngineFailed,
    EngineWorker,
    Job,
    NotReady,
    QueueFull,
    Scheduler,
    Shutdown,
    StepObserver,
)
from tests.server.conftest import CONTEXT

GREEDY = {"temperature": 0.0, "seed": 0}
# Any ids in the chat checkpoint's vocabulary (CHAT_VOCAB_SIZE) make a prompt.
PROMPT = [2, 17, 101, 300]


class Gauges:
    """The scheduler's gauges as it sets them: one (waiting, running) snapshot per update."""

    def __init__(self) -> None:
        self.waiting = self.running = 0
        self.snapshots: list[tuple[int, int]] = []

    def observer(self, on_steps=lambda stats: None) -> StepObserver:
        return StepObserver(on_waiting=lambda n: setattr(self, "waiting", n),
                            on_running=lambda n: setattr(self, "running", n),
                            on_usage=lambda f: self.snapshots.append((self.waiting, self.running)),
                            on_steps=on_steps)


@pytest.fixture
def make(chat_checkpoint) -> Iterator:
    """make(queue_limit, max_batch, observer) -> a scheduler serving one real engine of `max_batch` slots."""
    import gemma_engine
    import torch

    started: list[Scheduler] = []

    def start(queue_limit: int = 4, max_batch: int = 2, observer: StepObserver | None = None,
              before_serving=lambda engine: None) -> tuple[Scheduler, EngineWorker]:
        sched = Scheduler(queue_limit, observer)
        worker = EngineWorker(0, "cpu", sched)

        def load() -> None:  # on the worker's thread: the engine is unsendable
            worker.set_engine(gemma_engine.Engine(str(chat_checkpoint), None, torch.zeros(1), context=CONTEXT,
                                                  dtype="float32", max_batch=max_batch))
            before_serving(worker.engine)

        worker.call(load).result()
        sched.start([worker], read_every=1)
        started.append(sched)
        return sched, worker

    yield start
    for sched in started:
        # The engine is dropped on its own thread too, once its loop has ended (queued behind it).
        released = [w.call(lambda w=w: setattr(w, "engine", None)) for w in sched.workers]
        sched.stop()
        for f in released:
            f.result(60)


def job(max_new: int) -> Job:
    return Job.create(PROMPT, max_new, [], GREEDY, asyncio.get_running_loop(), time.monotonic())


def queue(sched: Scheduler, *jobs: Job) -> None:
    sched.admit(len(jobs))
    sched.submit(*jobs)


async def outcome(j: Job, timeout: float = 60) -> tuple[str, object, list[int]]:
    """(kind, payload, tokens) of the job's last event: ("done", Done) or ("error", exception)."""
    tokens: list[int] = []
    while True:
        kind, payload = await asyncio.wait_for(j.events.get(), timeout)
        if kind != "tokens":
            return kind, payload, tokens
        tokens += payload[0]


async def first_tokens(j: Job, timeout: float = 60) -> None:
    kind, _ = await asyncio.wait_for(j.events.get(), timeout)
    assert kind == "tokens"


def test_admission_counts_choices_all_or_none_against_the_queue_limit():
    gauges = Gauges()
    sched = Scheduler(queue_limit=4, observer=gauges.observer())
    with pytest.raises(NotReady):
        sched.admit()
    sched.start([], read_every=1)
    sched.admit(3)
    with pytest.raises(QueueFull, match="4 requests are already waiting"):
        sched.admit(2)  # the two choices of one request: both or neither
    assert gauges.waiting == 3
    sched.admit(1)
    sched.release(2)  # admitted, never queued (a bad prompt): given back
    assert gauges.waiting == 2 and sched.busy()
    sched.admit(2)
    with pytest.raises(QueueFull):
        sched.admit(1)


def test_a_job_waits_for_a_free_slot_and_takes_it_when_one_frees(make):
    gauges = Gauges()
    sched, worker = make(max_batch=2, observer=gauges.observer())

    async def main():
        jobs = [job(6) for _ in range(3)]
        queue(sched, *jobs)
        ends = [await outcome(j) for j in jobs]
        assert [(kind, done.finish, len(tokens)) for kind, done, tokens in ends] == [("done", "length", 6)] * 3
        return jobs

    jobs = asyncio.run(main())
    # Two slots: the third waited while both ran, then took the first slot that freed.
    assert max(running for _, running in gauges.snapshots) == 2
    assert (1, 2) in gauges.snapshots
    assert jobs[2].started > max(jobs[0].started, jobs[1].started)
    assert (worker.served, worker.free, gauges.snapshots[-1]) == (3, 2, (0, 0))
    assert not sched.busy()


def test_the_drain_refuses_new_work_and_lets_admitted_and_running_jobs_finish(make):
    sched, _ = make()

    async def main():
        running = job(8)
        queue(sched, running)
        sched.admit()  # admitted (counted as waiting) before the drain, queued after it: still served
        sched.start_drain()
        with pytest.raises(Draining):
            sched.admit()
        admitted = job(4)
        sched.submit(admitted)
        for j, n in ((running, 8), (admitted, 4)):
            kind, done, tokens = await outcome(j)
            assert (kind, done.finish, len(tokens)) == ("done", "length", n)

    asyncio.run(main())
    assert not sched.busy()


def test_the_shutdown_timeout_cancels_the_running_job_and_fails_the_queued_one(make):
    sched, _ = make(max_batch=1)

    async def main():
        running, queued = job(CONTEXT - len(PROMPT)), job(8)
        queue(sched, running, queued)
        await first_tokens(running)
        sched.abort_all()
        kind, error, _ = await outcome(queued)
        assert kind == "error" and isinstance(error, Shutdown) and "before this request started" in str(error)
        kind, done, tokens = await outcome(running)
        # The engine's own answer to the cancel, long before the context is full.
        assert (kind, done.finish) == ("done", "cancelled") and len(tokens) < 200
        assert running.ended.cause is queued.ended.cause is Cause.SHUTDOWN
        assert "before this request finished" in str(running.ended.error)

    asyncio.run(main())
    assert not sched.busy()


def test_a_dead_engine_fails_its_requests_and_answers_the_next_one_with_a_clear_error(make):
    def boom(stats):  # raised inside the engine's loop (its on_events callback): the loop ends
        raise RuntimeError("the device fell off the bus")

    sched, worker = make(observer=StepObserver(on_steps=boom))

    async def main():
        running = job(8)
        queue(sched, running)
        kind, error, _ = await outcome(running)
        assert kind == "error" and isinstance(error, EngineDead)
        assert str(error) == "The engine failed: RuntimeError: the device fell off the bus"

    asyncio.run(main())
    assert worker.dead == sched.dead == "RuntimeError: the device fell off the bus"
    with pytest.raises(EngineDead, match="^No engine is running: RuntimeError: the device fell off the bus$"):
        sched.admit()
    assert not sched.ready and not sched.busy()


@pytest.mark.parametrize("at", ["admit", "prompt", "decode"])
def test_an_engine_fault_fails_the_request_and_the_engine_serves_the_next(make, at):
    async def main():
        faulty = job(8)
        sched, worker = make(before_serving=lambda engine: engine.inject_fault_for_tests(at, faulty.id))
        queue(sched, faulty)
        kind, error, _ = await outcome(faulty)
        assert kind == "error" and isinstance(error, EngineFailed)
        assert str(error).startswith("The engine failed this request: ") and "injected" in str(error)
        after = job(4)
        queue(sched, after)
        kind, done, tokens = await outcome(after)
        assert (kind, done.finish, len(tokens)) == ("done", "length", 4)
        assert sched.dead is None and worker.dead is None and worker.free == 2

    asyncio.run(main())
