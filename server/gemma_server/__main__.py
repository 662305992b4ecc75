"""`python -m gemma_server`: parse flags, start uvicorn at once, boot the engine behind it.

uvicorn's own SIGTERM handling closes the listening socket and waits for open connections, which would
refuse new connections instead of answering 503 and could wait forever on an open stream. So the first
SIGTERM/SIGINT starts the app's drain (app.ServerState.drain) and only the drain tells uvicorn to exit;
`timeout_graceful_shutdown` is the backstop for connections still open after that. A second SIGINT
forces the exit, as in uvicorn. The exit status is 1 when a boot stage failed (the reason is in the
termination-message file), else 0.

Connections: a request must be all in within `--request-read-timeout` (connections.py, against slowloris),
and at `--max-connections` open connections uvicorn answers new requests with its own plain-text 503.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import uvicorn

from gemma_server.app import create_app
from gemma_server.config import parse_config
from gemma_server.connections import ReceiptDeadlineProtocol


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose exit signals start the app's drain instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, state) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.draining:
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        loop = self.state.loop
        if loop is None:  # not started yet: nothing to drain
            self.should_exit = True
            return
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.state.drain()))


def main(argv: list[str] | None = None) -> int:
    """Run the server until it is told to stop.

    Returns:
        the process exit status.
    """
    config = parse_config(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config)
    state = app.state.server
    server = DrainingServer(
        uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                       timeout_graceful_shutdown=5, access_log=False,
                       http=ReceiptDeadlineProtocol.with_deadline(config.request_read_timeout),
                       limit_concurrency=config.max_connections),
        state,
    )

    def request_exit() -> None:
        server.should_exit = True

    state.request_exit = request_exit
    logging.getLogger("gemma_server").info(
        "serving %s as %r on http://%s:%d (chat page at /, API at /v1)", config.model, config.model_name,
        config.host, config.port,
    )
    server.run()
    return state.exit_code


if __name__ == "__main__":
    sys.exit(main())
