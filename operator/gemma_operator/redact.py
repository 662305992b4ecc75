"""Redaction of text that a pod controls, before it reaches a GemmaRustServer's status.

A container's termination message (with `terminationMessagePolicy: FallbackToLogsOnError`, the tail of its
log when the file is empty) and the `failed` reason of its `GET /v1/engine` report are written by whatever
runs in the pod, and the status is readable by everyone who may read the custom resource. So an image that
prints its environment would hand its Secrets (the Hugging Face token, the API key) to those readers.
`redact` removes what looks like a credential and caps the text at 1 KiB.

What counts as a credential follows Yelp's detect-secrets (1.5, `detect_secrets/plugins/`: `private_key.py`,
`jwt.py`, `aws.py`, `github_token.py`, `keyword.py`, `basic_auth.py`, `high_entropy_strings.py`), plus
Hugging Face's `hf_` tokens and environment assignments (`NAME=value` with an upper-case NAME, what `env`
prints). Unlike detect-secrets, which looks for entropy only inside quoted strings, any run of 20 or more
token characters is measured here: its Shannon entropy, relative to the most that its length allows, is
0.85 or more for random tokens and 0.64 to 0.79 for identifiers, model names and digests.
"""

from __future__ import annotations

import math
import re
from collections import Counter

MAX_BYTES = 1024
REDACTED = "[redacted]"

# (pattern, replacement), applied in order.
_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"-----BEGIN[A-Z ]*PRIVATE KEY-----.*?(-----END[A-Z ]*PRIVATE KEY-----|\Z)", re.S), REDACTED),
    (re.compile(r"\beyJ[\w-]{4,}\.[\w-]{4,}\.[\w-]*"), REDACTED),  # JWT (header.payload.signature)
    (re.compile(r"(?i)\b(bearer|basic)(\s+)[\w.~+/=-]{8,}"), rf"\1\2{REDACTED}"),  # Authorization schemes
    (re.compile(r"://[^/\s:@]+:[^/\s@]+@"), f"://{REDACTED}@"),  # credentials in a URL
    (re.compile(r"\b(hf_[A-Za-z0-9]{16,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,}|glpat-[\w-]{20,}"
                r"|sk-[\w-]{20,}|xox[abprs]-[\w-]{10,}|(AKIA|ASIA)[0-9A-Z]{16}|AIza[\w-]{35}|ya29\.[\w.-]+)"),
     REDACTED),
    # Environment assignments (an `env` dump), and keyword assignments such as password: x, api_key=x.
    (re.compile(r"\b([A-Z][A-Z0-9_]{1,})=([^\s\"']+|\"[^\"]*\"|'[^']*')"), rf"\1={REDACTED}"),
    (re.compile(r"(?i)\b(?!\w*tokens\b)(\w*(?:token|secret|passw(?:or)?d|api[_-]?key|credential|private[_-]?key)\w*)"
                r"([\"']?\s*[:=]\s*[\"']?)([^\s\"',;]+)"), rf"\1\2{REDACTED}"),
]
_CANDIDATE = re.compile(r"[A-Za-z0-9+/=_-]{20,}")
_HEX = re.compile(r"^[0-9a-fA-F]{32,}$")


def _looks_random(word: str) -> bool:
    if _HEX.match(word):
        return True
    if not (re.search(r"[0-9]", word) or re.search(r"[A-Z]", word) and re.search(r"[a-z]", word)):
        return False
    counts = Counter(word)
    entropy = -sum(c / len(word) * math.log2(c / len(word)) for c in counts.values())
    return entropy >= 0.85 * math.log2(min(len(word), 64))


def redact(text: str, max_bytes: int = MAX_BYTES) -> str:
    """`text` with credentials replaced by "[redacted]", cut to at most `max_bytes` of UTF-8.

    Args:
        text: a termination message or a failure reason, as the pod wrote it.
        max_bytes: the cap; the end of the text is kept (a log's last lines say why it ended), marked "…".
    Returns:
        The redacted text, stripped.
    """
    # Redact before cutting, so that a cut never leaves half a credential behind. The work is bounded by
    # looking at the last 16 KiB only, from a word start (Kubernetes itself keeps at most 4 KiB).
    out = text
    if len(out) > 16 * max_bytes:
        out = re.split(r"\s", out[-16 * max_bytes:], maxsplit=1)[-1]
    for pattern, replacement in _RULES:
        out = pattern.sub(replacement, out)
    out = _CANDIDATE.sub(lambda m: REDACTED if _looks_random(m.group(0)) else m.group(0), out).strip()
    data = out.encode()
    if len(data) <= max_bytes:
        return out
    marker = "…".encode()
    tail = data[-(max_bytes - len(marker)):].decode(errors="ignore")
    return "…" + tail
