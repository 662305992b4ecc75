"""Token ids -> text deltas, and stop strings matched across token boundaries.

`IncrementalDetokenizer` is the prefix/read-offset scheme of TGI's `decode_token` and vLLM's
`detokenize_incrementally`: decode a short window of already-emitted tokens with and without the new
ones and emit the difference, so SentencePiece spaces and multi-token characters come out right. Text
ending in U+FFFD (half of a UTF-8 character) is held back until the next token completes it, or the
decode ends (`flush`).

`StopMatcher` holds back the tail of the text that could still grow into a stop string, so a stop string
split over several tokens (or several deltas) is found and never half-sent.
"""

from __future__ import annotations

from collections.abc import Sequence

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens used as left context.
_LEFT_CONTEXT = 5


class IncrementalDetokenizer:
    """Feed generated ids one at a time; get the text each adds.

    Args:
        tokenizer: a transformers tokenizer (anything with `decode(ids, skip_special_tokens=...)`).
        prompt_ids: the prompt; its last few ids give the first generated tokens their left context.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int]) -> None:
        self._decode = _decoder(tokenizer)
        self._ids = list(prompt_ids[-_LEFT_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, token_id: int) -> str:
        """Append one generated id; return the new text (may be "" while a character is incomplete)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Text still held back when the decode ends (an unfinished character comes out as U+FFFD, as
        `tokenizer.decode` of the whole output gives it)."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]


def _decoder(tokenizer):
    """ids -> text without special tokens. A fast tokenizer's Rust backend gives what
    `tokenizer.decode(ids, skip_special_tokens=True)` gives when no space clean-up is configured, at a
    fifth of the cost (it runs for every generated token)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class StopMatcher:
    """Cuts the output at the first stop string, wherever token boundaries fall.

    Args:
        stops: the stop strings (non-empty). The matched stop string is not part of the output, as in
            OpenAI's API.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that matched (the earliest in the text)

    def feed(self, text: str) -> str:
        """Add text; return what is safe to send now. After a match, `stopped` is True and later feeds return ""."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buf = self._pending + text
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self._stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            self.stopped = True
            self._pending = ""
            return buf[:at]
        keep = _longest_suffix_prefix(buf, self._stops)
        self._pending = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back tail, once the decode ended without a match."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out


def _longest_suffix_prefix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
