"""What a connection may hold: deadlines for receiving a request, a cap per client address and in all, and a
deadline for a client that stops reading its reply.

uvicorn (0.54, `uvicorn/protocols/http/h11_impl.py`) has no timeout on receiving a request: its keep-alive
timer runs only between requests and is cancelled by every byte that arrives, so a client that sends its
headers or its body one byte at a time (slowloris) holds a connection, a file descriptor and a parser for as
long as it likes; ASGI middleware cannot help, because the app is called only once the headers are in.
(encode/uvicorn issue #157 lists `--timeout-request-start` and `--timeout-request-complete` as wanted.)
Its `limit_concurrency` counts open connections, those still sending headers included, so a flood of
unfinished requests turns every real request into a 503; the server caps requests in flight instead
(app.InFlightLimit), and connections here.

`GuardedProtocol` is uvicorn's h11 protocol with, per connection:
- a header deadline: the request's headers must be in `header_read_timeout` seconds after the connection
  opened or the previous reply ended, and the whole request (headers and body) in `request_read_timeout`.
  The timer is never reset by a byte, and is disarmed once h11 has the whole request; a request that is
  in gets all the time it needs, however long its stream runs. When it fires the connection is closed (an
  app still reading that body sees `http.disconnect`);
- a cap on open connections per client address (`max_per_client`) and in all (`max_connections`): a
  connection past either is closed as it opens, before a byte of it is parsed;
- a stall deadline: once the client leaves `WRITE_BUFFER_BYTES` of reply unread (the transport pauses
  writing; uvicorn's `send` then waits for it to drain), it has `stall_timeout` seconds to read again, or
  the connection is aborted and its buffer dropped. The app sees `http.disconnect`, so the request is
  cancelled and its sequence slot freed; `on_stall` counts it (a metric), and the request's ASGI scope
  says so under `STALLED` (serving.py `gone_of` reads it, so the request's end names the stall, not a plain disconnect).
The reply a client has not read is thus bounded by the write buffer plus what one stall allows.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

# h11 states of the client's side while its request is still arriving: nothing yet, or headers without the
# whole body (h11's docs, "Special states").
_RECEIVING = (h11.IDLE, h11.SEND_BODY)


# The reply a client may leave unread before its stall deadline runs (the transport's high-water mark).
WRITE_BUFFER_BYTES = 256 * 1024
# The ASGI scope key that is True once the connection was aborted because its reply stalled.
STALLED = "gemma_server.stalled"


@dataclass(frozen=True)
class Limits:
    """One listener's connection limits (see the module docstring); the server's Config declares them
    (`__main__.connection_limits`)."""

    header_read_timeout: float
    request_read_timeout: float
    max_connections: int
    max_per_client: int
    stall_timeout: float


class GuardedProtocol(H11Protocol):
    """uvicorn's `H11Protocol` with the module docstring's limits. Make a class per listener with `guarded`
    and hand it to uvicorn (`uvicorn.Config(http=...)`): the counts of open connections are per class."""

    limits: Limits
    on_stall: Callable[[], None] = staticmethod(lambda: None)
    open_per_client: collections.Counter

    _deadline: asyncio.TimerHandle | None = None
    _deadline_for_body: bool = False
    _started: float = 0.0
    _stall: asyncio.TimerHandle | None = None
    _counted: str | None = None

    @classmethod
    def guarded(cls, limits: Limits, on_stall: Callable[[], None] | None = None) -> type[GuardedProtocol]:
        """A subclass with its own limits, stall counter and per-client connection counts (the total is
        uvicorn's own set of the server's connections)."""
        return type(cls.__name__, (cls,), {"limits": limits, "on_stall": staticmethod(on_stall or (lambda: None)),
                                           "open_per_client": collections.Counter()})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # adds this one to uvicorn's `connections`
        host = self.client[0] if self.client else "?"
        limits = self.limits
        if len(self.connections) > limits.max_connections or self.open_per_client[host] >= limits.max_per_client:
            log.debug("refusing a connection from %s: %d open from it, %d in all", host,
                      self.open_per_client[host], len(self.connections) - 1)
            transport.abort()
            return
        self._counted = host
        self.open_per_client[host] += 1
        transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
        self._started = self.loop.time()
        self._follow_request()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._started = self.loop.time()
        self._follow_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadline = _cancelled(self._deadline)
        self._stall = _cancelled(self._stall)
        if self._counted is not None:
            self.open_per_client[self._counted] -= 1
            if self.open_per_client[self._counted] <= 0:
                del self.open_per_client[self._counted]
            self._counted = None
        super().connection_lost(exc)

    # ---- receiving: the header and request deadlines ---------------------------------------------

    def _follow_request(self) -> None:
        """Arm the header deadline while headers arrive, the request deadline while its body does, and
        disarm once the request is in (bytes never move either deadline)."""
        state = self.conn.their_state
        if self.transport.is_closing() or state not in _RECEIVING:
            self._deadline = _cancelled(self._deadline)
            return
        for_body = state is h11.SEND_BODY
        if self._deadline is not None and self._deadline_for_body == for_body:
            return
        self._deadline = _cancelled(self._deadline)
        limits = self.limits
        seconds = limits.request_read_timeout
        if not for_body:
            seconds = min(seconds, limits.header_read_timeout)
        self._deadline = self.loop.call_at(self._started + seconds, self._expire)
        self._deadline_for_body = for_body

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            what = "request" if self._deadline_for_body else "request headers"
            log.debug("closing %s: no whole %s in time", self.client, what)
            self.transport.close()

    # ---- sending: the stall deadline -------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(self.limits.stall_timeout, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stall = _cancelled(self._stall)

    def _stalled(self) -> None:
        self._stall = None
        if not self.transport.is_closing():
            log.warning("aborting the reply to %s: the client read nothing for %gs", self.client,
                        self.limits.stall_timeout)
            self.on_stall()
            if self.cycle is not None:  # uvicorn's current request: its scope is the one the app holds
                self.cycle.scope[STALLED] = True
            self.transport.abort()


def _cancelled(timer: asyncio.TimerHandle | None) -> None:
    """Cancel `timer` if there is one; None, for the attribute that held it."""
    if timer is not None:
        timer.cancel()
