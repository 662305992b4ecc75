"""A /live prober for a process of its own (tests/server/test_limits.py `send_while_probing`): this module
imports only httpx, so a spawned process starts in a moment."""

import time

import httpx


def probe_live(base: str, stop, out) -> None:
    """Poll /live until `stop` is set; put ("ready", None) after the first answer, then ("slowest", seconds)
    or ("status", code) on a non-200."""
    slowest, ready = 0.0, False
    with httpx.Client(timeout=10) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            code = c.get(base + "/live").status_code
            if code != 200:
                out.put(("status", code))
                return
            slowest = max(slowest, time.monotonic() - t0)
            if not ready:
                out.put(("ready", None))
                ready = True
            time.sleep(0.01)
    out.put(("slowest", slowest))
