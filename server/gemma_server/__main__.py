"""`python -m gemma_server`: parse flags, start uvicorn at once, boot the engine behind it.

uvicorn's own SIGTERM handling closes the listening socket and waits for open connections, which would
refuse new connections instead of answering 503 and could wait forever on an open stream. So the first
SIGTERM/SIGINT starts the app's drain (state.ServerState.drain) and only the drain tells uvicorn to exit;
`timeout_graceful_shutdown` is the backstop for connections still open after that. A second SIGINT
forces the exit, as in uvicorn. The exit status is 1 when a boot stage failed (the reason is in the
termination-message file), else 0.

Connections (connections.py): a request's headers must be in within `--header-read-timeout` and the whole
request within `--request-read-timeout` (against slowloris); open connections are capped per client address
(`--max-connections-per-client`) and in all (`--max-connections`); a reply its client stops reading is
aborted after `--stream-stall-timeout`. Requests in flight are capped by the app (`--max-concurrent-requests`).
With `--probe-port`, a second uvicorn serves the probes alone (app.create_probe_app) on a thread and event
loop of its own, with the same connection limits (its own counts), so no load on the API port reaches them.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading

import uvicorn

from gemma_server.app import create_app, create_probe_app
from gemma_server.config import Config, parse_config
from gemma_server.connections import GuardedProtocol, Limits


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose exit signals start the app's drain instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, state) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.scheduler.lifecycle.now().draining:
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
    limits = connection_limits(config)
    server = DrainingServer(
        uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                       timeout_graceful_shutdown=5, access_log=False,
                       http=GuardedProtocol.guarded(limits, state.metrics.stalled_replies.inc)),
        state,
    )
    if config.probe_port is not None:
        start_probe_listener(config, state, limits)

    def request_exit() -> None:
        server.should_exit = True

    state.request_exit = request_exit
    logging.getLogger("gemma_server").info(
        "serving %s as %r on http://%s:%d (chat page at /, API at /v1)", config.model, config.model_name,
        config.host, config.port,
    )
    server.run()
    return state.exit_code


def connection_limits(config: Config) -> Limits:
    return Limits(header_read_timeout=config.header_read_timeout, request_read_timeout=config.request_read_timeout,
                  max_connections=config.max_connections, max_per_client=config.max_connections_per_client,
                  stall_timeout=config.stream_stall_timeout)


def start_probe_listener(config: Config, state, limits: Limits) -> threading.Thread:
    """Serve the probe app on --probe-port from a daemon thread with its own event loop (uvicorn installs
    no signal handlers off the main thread; the process's exit ends it)."""
    probes = uvicorn.Server(uvicorn.Config(create_probe_app(state), host=config.host, port=config.probe_port,
                                           log_level="warning", access_log=False, lifespan="off",
                                           http=GuardedProtocol.guarded(limits)))
    thread = threading.Thread(target=probes.run, name="probes", daemon=True)
    thread.start()
    return thread


if __name__ == "__main__":
    sys.exit(main())
