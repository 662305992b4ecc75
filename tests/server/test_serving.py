"""Unit tests of serving.Generation's end: each cause of a request's end gives one OpenAI finish_reason (or
error) and one `gemma_request_success` label, and the first cause wins. Pure: the engine's events are put
on the job's queue by hand, the tokenizer is one character per id, and the scheduler and metrics are the
real classes with no engine behind them."""

from __future__ import annotations

import asyncio
import time

import pytest

from gemma_server.errors import ApiError
from gemma_server.metrics import FINISHED_REASONS, Metrics
from gemma_server.protocol.engine import EngineParams
from gemma_server.jobs import Cause, Done, End, EngineDead, EngineFailed, EngineRefused, Job, Shutdown
from gemma_server.scheduler import Scheduler
from gemma_server.serving import Generation

MODEL = "m"


class CharTokenizer:
    """Token id i is the character chr(i)."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(map(chr, ids))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


class Harness:
    """One Generation on a job nobody runs: `engine(...)` plays the engine's events."""

    def __init__(self, stop: tuple[str, ...] = (), gone=lambda: Cause.CLIENT_GONE) -> None:
        self.scheduler = Scheduler(queue_limit=4)
        self.scheduler.start([], read_every=1)
        self.metrics = Metrics(MODEL, 64)
        self.job = Job(request=None, loop=asyncio.get_running_loop(), arrival=time.monotonic())
        params = EngineParams(prompt_ids=tuple(ids("> ")), max_new=32, stop_ids=(), stop=stop)
        self.gen = Generation(params, 0, self.job, CharTokenizer(), self.scheduler, self.metrics, gone=gone)

    def tokens(self, text: str) -> None:
        self.job.events.put_nowait(("tokens", (ids(text), [], time.monotonic())))

    def done(self, finish: str) -> None:
        self.job.events.put_nowait(("done", Done(finish, 0.1, 0.2)))

    def error(self, exc: Exception) -> None:
        self.job.events.put_nowait(("error", exc))

    async def text(self) -> str:
        return "".join([piece.text async for piece in self.gen.pieces()])

    def counted(self) -> dict[str, float]:
        """gemma_request_success by finished_reason, through the registry's public API."""
        return {reason: self.metrics.registry.get_sample_value(
            "gemma_request_success_total", {"model_name": MODEL, "finished_reason": reason})
            for reason in FINISHED_REASONS}


def counted_once(label: str) -> dict[str, float]:
    return {reason: float(reason == label) for reason in FINISHED_REASONS}


@pytest.mark.parametrize("finish,reason", [("stop", "stop"), ("length", "length"), ("cancelled", "abort")])
def test_the_engines_finish_is_the_finish_reason_and_the_label(finish, reason):
    async def main():
        h = Harness()
        h.tokens("hel")
        h.tokens("lo")
        h.done(finish)
        assert await h.text() == "hello"
        assert (h.gen.finish_reason, h.job.ended.cause) == (reason, Cause.ENGINE)
        assert h.counted() == counted_once(reason)
        assert h.gen.completion_tokens == 5 and h.gen.timings().decode_seconds == 0.2

    asyncio.run(main())


def test_a_stop_string_ends_the_request_before_the_engine_does_and_its_later_finish_changes_nothing():
    async def main():
        h = Harness(stop=("END",))
        h.tokens("ab E")
        h.tokens("ND cd")
        pieces = h.gen.pieces()
        assert (await anext(pieces)).text == "ab "
        # Decided as the stop string matched: the engine's worker sees the end and cancels the decode.
        assert h.job.ended.cause is Cause.STOP_STRING
        h.done("cancelled")  # the engine's answer to that cancel
        assert [p.text async for p in pieces] == [""]
        assert h.gen.finish_reason == "stop"
        assert h.counted() == counted_once("stop")

    asyncio.run(main())


@pytest.mark.parametrize("cause", [Cause.CLIENT_GONE, Cause.STALLED])
def test_a_client_that_leaves_mid_decode_ends_it_as_an_abort_whatever_the_engine_says_next(cause):
    async def main():
        h = Harness(gone=lambda: cause)
        h.tokens("hi")
        pieces = h.gen.pieces()
        assert (await anext(pieces)).text == "hi"
        await pieces.aclose()  # the disconnect: Starlette closes the stream's generator
        assert (h.job.ended.cause, h.gen.finish_reason) == (cause, "abort")
        assert h.job.end(Cause.ENGINE, engine_finish="length") is h.job.ended  # the engine's finish, too late
        assert h.gen.finish_reason == "abort"
        assert h.counted() == counted_once("abort")

    asyncio.run(main())


def test_a_queued_request_whose_client_leaves_is_taken_out_of_the_queue_and_counted_once():
    async def main():
        h = Harness()
        h.scheduler.admit(1)
        h.scheduler.submit(h.job)
        assert h.scheduler.busy()
        h.gen.leave()
        h.gen.leave()
        assert not h.scheduler.busy()
        assert h.job.ended.cause is Cause.CLIENT_GONE
        assert h.counted() == counted_once("abort")

    asyncio.run(main())


@pytest.mark.parametrize("error,status", [(EngineRefused("bad value"), 400), (EngineFailed("device error"), 500),
                                          (EngineDead("engine died"), 503)])
def test_an_engine_failure_is_the_requests_error_with_no_finish_reason(error, status):
    async def main():
        h = Harness()
        h.tokens("x")
        h.error(error)
        with pytest.raises(ApiError) as e:
            await h.text()
        assert (e.value.status, e.value.message) == (status, str(error))
        assert (h.job.ended.cause, h.gen.finish_reason) == (Cause.FAILED, None)
        assert h.counted() == counted_once("error")

    asyncio.run(main())


def test_the_shutdown_timeout_ends_a_running_request_with_a_503_counted_as_an_abort():
    async def main():
        h = Harness()
        h.tokens("part")
        # Scheduler.abort_all's decision, then the engine's answer to the cancel it makes.
        h.job.end(Cause.SHUTDOWN, error=Shutdown("The server shut down before this request finished."))
        h.done("cancelled")
        with pytest.raises(ApiError) as e:
            await h.text()
        assert e.value.status == 503 and "shut down" in e.value.message
        assert h.gen.finish_reason is None
        assert h.counted() == counted_once("abort")

    asyncio.run(main())


def test_the_first_decision_wins():
    async def main():
        h = Harness(stop=("!",))
        h.tokens("done!")
        pieces = h.gen.pieces()
        assert (await anext(pieces)).text == "done"
        # The shutdown timeout comes after the stop string matched: the request still ends "stop".
        later = h.job.end(Cause.SHUTDOWN, error=Shutdown("late"))
        assert later.cause is Cause.STOP_STRING and later.error is None
        h.done("cancelled")
        assert [p.text async for p in pieces] == [""]
        assert h.gen.finish_reason == "stop"
        assert h.counted() == counted_once("stop")

    asyncio.run(main())


def test_an_end_without_what_its_cause_needs_is_refused():
    with pytest.raises(ValueError, match="engine's finish"):
        End.of(Cause.ENGINE, engine_finish="error")
    with pytest.raises(ValueError, match="FAILED needs error"):
        End.of(Cause.FAILED)
    with pytest.raises(ValueError, match="CLIENT_GONE takes no error"):
        End.of(Cause.CLIENT_GONE, error=EngineDead("x"))
