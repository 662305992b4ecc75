"""What a connection may hold before its request is in: a deadline for receiving each whole request.

uvicorn (0.54, `uvicorn/protocols/http/h11_impl.py`) has no timeout on receiving a request: its keep-alive
timer runs only between requests and is cancelled by every byte that arrives, so a client that sends its
headers or its body one byte at a time (slowloris) holds a connection, a file descriptor and a parser for as
long as it likes; ASGI middleware cannot help, because the app is called only once the headers are in.
(encode/uvicorn issue #157 lists `--timeout-request-start` and `--timeout-request-complete` as wanted.)

`ReceiptDeadlineProtocol` is uvicorn's h11 protocol with one timer more: armed when a connection opens and
again when a reply ends (the next request may begin), disarmed once h11 has the whole request (headers and
body), and never reset by a byte. When it fires the connection is closed; an app still reading that body
sees `http.disconnect`. A request that is in gets all the time it needs: the deadline never cuts a reply,
however long a stream runs. The number of open connections is capped apart from this (uvicorn's
`limit_concurrency`, see __main__.py).
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

# h11 states of the client's side while its request is still arriving: nothing yet, or headers without the
# whole body (h11's docs, "Special states").
_RECEIVING = (h11.IDLE, h11.SEND_BODY)


class ReceiptDeadlineProtocol(H11Protocol):
    """uvicorn's `H11Protocol`, closing a connection whose request is not all in `request_read_timeout`
    seconds after the connection opened or the previous reply ended. Set the class attribute with
    `with_deadline` before handing the class to uvicorn (`uvicorn.Config(http=...)`)."""

    request_read_timeout: float = 20.0

    _deadline: asyncio.TimerHandle | None = None

    @classmethod
    def with_deadline(cls, seconds: float) -> type[ReceiptDeadlineProtocol]:
        """A subclass with `request_read_timeout = seconds` (uvicorn builds the protocol from the class)."""
        return type(cls.__name__, (cls,), {"request_read_timeout": seconds})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._follow_request()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _follow_request(self) -> None:
        """Arm the timer while a request is arriving (once: bytes do not reset it), disarm it once it is in."""
        if self.transport.is_closing() or self.conn.their_state not in _RECEIVING:
            self._disarm()
        elif self._deadline is None:
            self._deadline = self.loop.call_later(self.request_read_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            log.debug("closing %s: no whole request within %gs", self.client, self.request_read_timeout)
            self.transport.close()
