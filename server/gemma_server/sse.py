"""Server-sent events, the one framing every streamed API here uses, and the compact JSON they carry.

The format is the WHATWG HTML standard's "Server-sent events" (`event:` and `data:` fields, a blank line
ending each event). OpenAI's chat and completion streams send bare `data:` events and end with
`data: [DONE]`; the Responses API and Anthropic's Messages API name each event (`event: <type>`).
"""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def dumps(value: Any) -> bytes:
    """`value` as compact JSON in UTF-8 (no spaces, non-ASCII as it is; NaN and infinities refused, since
    JSON has none)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def event(data: dict[str, Any], name: str | None = None) -> bytes:
    """One event carrying `data`; with `name`, an `event: <name>` line before it."""
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + dumps(data) + b"\n\n"
