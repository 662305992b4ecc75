"""Unit tests of scheduler.py: admission, free slots, the drain and the shutdown timeout, a dead engine and a
failed request, and which engine takes a request. The engine is the real one on the tiny chat checkpoint,
loaded on its worker's thread as the boot loads it; faults come from `Engine.inject_fault_for_tests` or from a
step hook that raises inside the engine's loop. No HTTP: jobs are made, submitted and read as the request
handlers do. The engine choice is tested on its pure parts (`common_prefix`, `Histories`, `engines_for`) and
on workers with no engine behind them, polled by hand as engines poll."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from gemma_server.jobs import Cause, Draining, EngineDead, EngineFailed, Job, NotReady, QueueFull, Shutdown
from gemma_server.scheduler import (
    EngineWorker,
    Histories,
    Life,
    Lifecycle,
    Phase,
    Scheduler,
    StepObserver,
    common_prefix,
    engines_for,
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


def test_the_lifecycle_serves_after_loading_drains_once_and_a_death_keeps_its_first_reason():
    life = Lifecycle()
    assert (life.now().phase, str(life.now().refusal())) == (Phase.LOADING, "The model is loading.")
    life.serve()
    assert life.now().phase is Phase.SERVING and life.now().refusal() is None
    assert life.drain() and not life.drain()  # the second SIGTERM begins nothing
    assert (life.now().phase, life.now().draining, type(life.now().refusal())) == (Phase.DRAINING, True, Draining)
    life.fail("boot: ValueError: x")
    life.fail("RuntimeError: later")
    assert life.now() == Life(Phase.DEAD, "boot: ValueError: x", draining=True)
    assert str(life.now().refusal()) == "No engine is running: boot: ValueError: x"
    dead = Lifecycle()  # a server that died before SIGTERM still drains, once, and stays dead
    dead.fail("weights: FileNotFoundError: gone")
    dead.serve()
    assert dead.drain() and not dead.drain()
    assert (dead.now().phase, dead.now().draining) == (Phase.DEAD, True)


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
    assert worker.dead == sched.lifecycle.now().reason == "RuntimeError: the device fell off the bus"
    with pytest.raises(EngineDead, match="^No engine is running: RuntimeError: the device fell off the bus$"):
        sched.admit()
    assert sched.lifecycle.now().phase is Phase.DEAD and not sched.busy()


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
        assert sched.lifecycle.now().reason is None and worker.dead is None and worker.free == 2

    asyncio.run(main())


# ---- which engine takes a request -------------------------------------------------------------------


def test_common_prefix_is_the_longest_shared_start():
    assert common_prefix((), (1, 2)) == 0
    assert common_prefix((1, 2, 3), (1, 2, 3)) == 3
    assert common_prefix((1, 2, 3, 4), (1, 2, 9, 4)) == 2
    assert common_prefix((5,), (6,)) == 0
    long = tuple(range(8192))
    assert common_prefix(long, long[:5000] + (-1,) + long[5001:]) == 5000
    assert common_prefix(long, long[:100]) == 100


def test_histories_score_the_longest_shared_prefix_of_the_same_salt_only():
    h = Histories(size=4)
    h.add(None, (1, 2, 3, 4, 5, 6))
    h.add("a", (1, 2, 3, 7, 8))
    assert h.score(None, (1, 2, 3, 4, 9)) == 4
    assert h.score("a", (1, 2, 3, 7, 8, 9)) == 5
    assert h.score("b", (1, 2, 3, 4, 5, 6)) == 0  # another tenant's histories are not its own
    # A prefix shorter than a tenth of the prompt (the template's first ids) does not count.
    assert h.score(None, (1, 2) + tuple(range(100, 130))) == 0
    assert h.score(None, (1, 2, 3, 4) + tuple(range(100, 130))) == 4


def test_histories_keep_one_per_slot_newest_first_and_an_extension_replaces_what_it_extends():
    h = Histories(size=2)
    h.add(None, (1, 2))
    h.add(None, (1, 2, 3, 4))  # the next turn of the same conversation: it took over that slot
    assert len(h) == 1
    h.add(None, (5, 6))
    h.add(None, (7, 8))  # a third: the oldest goes
    assert len(h) == 2 and h.score(None, (1, 2, 3, 4)) == 0 and h.score(None, (7, 8)) == 2
    version = h.version
    h.add("x", (7, 8))  # the same ids under another salt are another history, and the oldest goes
    assert h.version == version + 1 and h.score("x", (7, 8)) == 2 and h.score(None, (7, 8)) == 2
    assert h.score(None, (5, 6)) == 0
    off = Histories(size=0)  # an engine without prefix caching keeps nothing
    off.add(None, (1, 2))
    assert (len(off), off.score(None, (1, 2))) == (0, 0)


@pytest.mark.parametrize("candidates,chosen", [
    ([(0, 2), (0, 2)], [0, 1]),    # nothing shared: the most free slots, ties to both
    ([(0, 1), (0, 3)], [1]),
    ([(40, 1), (0, 3)], [0]),      # the engine holding the prefix, though it has fewer free slots
    ([(40, 1), (40, 2)], [1]),     # same prefix on both: the more free
    ([(40, 0), (0, 1), (0, 3)], [2]),  # the holder is full: not waited for, the most free takes it
    ([(40, 0), (30, 1), (0, 3)], [1]),  # ... unless another free engine shares a shorter prefix
    ([(40, 0), (0, 0)], []),       # no free slot anywhere
])
def test_a_queued_job_goes_to_the_free_engine_with_its_longest_prefix_then_the_most_free(candidates, chosen):
    assert engines_for(candidates) == chosen


class NoEngine:
    """Two workers without engines, serving one scheduler: `poll` is called by hand, as engines call it."""

    def __init__(self, free: tuple[int, int]) -> None:
        self.sched = Scheduler(queue_limit=8)
        self.workers = [EngineWorker(i, "cpu", self.sched) for i in range(2)]
        for w, f in zip(self.workers, free):
            w.serving, w.max_batch, w.histories = True, 4, Histories(4)
            self.sched.places.report(w.index, f)
        self.sched.workers = list(self.workers)
        self.sched.lifecycle.serve()

    def job(self, prompt: tuple[int, ...], salt: str | None = None) -> Job:
        return Job(request=None, loop=asyncio.get_running_loop(), arrival=time.monotonic(), prompt=prompt, salt=salt)

    def taken(self, index: int, *jobs: Job) -> list[Job]:
        """What worker `index` takes at a read point, after `jobs` were queued."""
        if jobs:
            queue(self.sched, *jobs)
        w = self.workers[index]
        return self.sched.poll(w, w.free, idle=False)[0]


TURN = tuple(range(2, 40))


def test_the_next_turn_of_a_conversation_goes_to_the_engine_that_served_the_last_not_the_most_free():
    async def main():
        s = NoEngine(free=(1, 4))
        first = s.job(TURN, salt="t")
        assert s.taken(1, first) == [first]  # nothing shared yet: the most free
        first.output = [50, 51, 52]
        s.sched.finished(s.workers[1], first)  # its slot keeps the prompt and the reply
        s.sched.places.report(0, 4)
        s.sched.places.report(1, 2)  # now the fuller of the two
        second = s.job(TURN + (50, 51, 52, 60, 61), salt="t")
        assert s.taken(0, second) == []  # the more free engine leaves it
        assert s.taken(1) == [second]  # to the one whose slot holds the conversation
        other = s.job(TURN + (50, 51, 52, 60, 61), salt="u")  # the same ids for another tenant
        assert s.taken(1, other) == [] and s.taken(0) == [other]

    asyncio.run(main())


def test_the_choices_of_one_request_reach_one_engine_together_and_a_full_holder_is_not_waited_for():
    async def main():
        s = NoEngine(free=(2, 2))
        a, b = s.job(TURN), s.job(TURN)  # n=2: one prompt
        assert s.taken(0, a, b) == [a, b]  # the second follows the first, though engine 1 then has more free
        a.output = [7]
        s.sched.finished(s.workers[0], a)
        s.sched.places.report(0, 0)
        again = s.job(TURN + (7, 8))
        assert s.taken(1, again) == [again]  # its engine is full: the free one takes it at once

    asyncio.run(main())


def test_a_request_that_failed_leaves_no_history_behind():
    async def main():
        s = NoEngine(free=(4, 4))
        j = s.job(TURN)
        assert s.taken(0, j) == [j]
        s.sched.finished(s.workers[0], j, wrote=False)
        assert len(s.workers[0].histories) == 0 and s.workers[0].free == 4

    asyncio.run(main())
