"""Stored responses (the Responses API's `store`, default true as OpenAI's), kept in memory.

`ResponseStore` keeps each response and the conversation that led to it as compact JSON bytes, so that the
bytes it counts are the memory they take, bounded by count, bytes and age for each API key and for all together
(past the whole store's caps, the key that holds the most loses its oldest, so one client's stores evict its
own). Each is visible only to the bearer token that made it (`owner_of`: a hash of it is kept, never the
token); an id that is not there (or not the caller's) is a 404 naming it.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gemma_server.errors import ApiError


def owner_of(authorization: str | None) -> str:
    """Whose a stored response is: a hash of the request's bearer token (empty without one)."""
    token = (authorization or "").partition(" ")[2] if (authorization or "").lower().startswith("bearer ") else ""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def _pack(value: Any) -> bytes:
    """`value` as compact JSON in UTF-8 (a lone surrogate, which a JSON request may carry, kept as it is)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def _unpack(data: bytes) -> Any:
    return json.loads(data.decode("utf-8", "surrogatepass"))


# What the store's bookkeeping takes, on CPython 3.11 (64-bit), measured with tracemalloc (tests/server/
# test_response_store.py holds the counted bytes to the memory a batch of entries takes): an entry besides its two
# byte strings (the Stored object, its id, a str keying two ordered dicts, and their nodes and slots), and an
# owner (its hash, a _Holding and its ordered dict, its slot in the store's dict of owners).
ENTRY_BYTES = 240
OWNER_BYTES = 384


@dataclass(frozen=True, slots=True)
class Stored:
    """One stored response: whose it is, when it was stored, and the response and the conversation that led to
    it as compact JSON bytes, decoded when read (`response`, `conversation`). Kept as Python objects they would
    take 4 to 5.5 times their JSON's length; kept as bytes, what the store counts (`size`) is what they take."""

    owner: str
    created: float
    response_json: bytes
    conversation_json: bytes

    @property
    def response(self) -> dict[str, Any]:
        return _unpack(self.response_json)

    @property
    def conversation(self) -> list[dict[str, Any]]:
        return _unpack(self.conversation_json)

    @property
    def size(self) -> int:
        """Bytes of memory it holds: its two byte strings as CPython keeps them, and ENTRY_BYTES."""
        return sys.getsizeof(self.response_json) + sys.getsizeof(self.conversation_json) + ENTRY_BYTES


@dataclass(eq=False, slots=True)
class _Holding:
    """One owner's part of the store: its ids, oldest first, and the bytes they and this bookkeeping take."""

    owner: str  # the one copy of the owner's hash that its entries share
    ids: OrderedDict[str, None] = field(default_factory=OrderedDict)
    size: int = OWNER_BYTES


class ResponseStore:
    """Stored responses in memory, with caps on each owner (an API key: `owner_of`) and on all of them.

    One owner keeps at most `max_count_per_key` responses and `max_bytes_per_key` bytes; past either, its own
    oldest goes. All owners together keep at most `max_count` and `max_bytes`; past either, the owner that holds
    the most (responses for the count, bytes for the bytes; of two that hold as much, the one whose oldest is
    older) loses its oldest, so a client that floods the store evicts its own responses, not another's smaller
    share. None is kept longer than `max_age` seconds. Bytes are memory: each response and its conversation are
    kept as compact JSON bytes (`Stored`). Thread-safe (the routes run on the event loop, tests read it).

    Args:
        max_count, max_bytes, max_age: the caps of the whole store (--responses-store-max-count, -max-bytes,
            -max-age).
        max_count_per_key, max_bytes_per_key: the caps of one owner (--responses-store-max-count-per-key,
            -max-bytes-per-key); None: the whole store's.
        clock: seconds (time.monotonic; tests pass their own).
    """

    def __init__(self, max_count: int, max_bytes: int, max_age: float, max_count_per_key: int | None = None,
                 max_bytes_per_key: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_count, self.max_bytes, self.max_age = max_count, max_bytes, max_age
        self.max_count_per_key = max_count if max_count_per_key is None else max_count_per_key
        self.max_bytes_per_key = max_bytes if max_bytes_per_key is None else max_bytes_per_key
        self._clock = clock
        self._items: OrderedDict[str, Stored] = OrderedDict()  # every owner's, oldest first
        self._owners: dict[str, _Holding] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, owner: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep `response` and the conversation that led to it (with its own reply at the end); one larger than
        the owner's or the whole store's byte cap alone is not kept, and evicts nothing."""
        response_json, conversation_json = _pack(response), _pack(conversation)
        with self._lock:
            self._drop(response["id"])
            holding = self._owners.get(owner) or _Holding(owner)
            stored = Stored(holding.owner, self._clock(), response_json, conversation_json)
            if (OWNER_BYTES + stored.size > min(self.max_bytes, self.max_bytes_per_key)
                    or min(self.max_count, self.max_count_per_key) == 0):
                return
            if owner not in self._owners:
                self._owners[owner] = holding
                self._bytes += holding.size
            self._items[response["id"]] = stored
            holding.ids[response["id"]] = None
            holding.size += stored.size
            self._bytes += stored.size
            self._expire()
            while len(holding.ids) > self.max_count_per_key or holding.size > self.max_bytes_per_key:
                self._drop(next(iter(holding.ids)))
            while len(self._items) > self.max_count or self._bytes > self.max_bytes:
                self._drop(next(iter(self._largest(self._bytes > self.max_bytes).ids)))

    def get(self, response_id: str, owner: str, param: str = "response_id") -> Stored:
        """The caller's stored response.

        Raises:
            ApiError: 404 naming `param` when there is none by that id for this owner (expired, deleted,
                evicted, or another key's).
        """
        with self._lock:
            self._expire()
            stored = self._items.get(response_id)
        if stored is None or stored.owner != owner:
            raise ApiError(404, f"No response with id {response_id[:80]!r} is stored for this API key.", param)
        return stored

    def delete(self, response_id: str, owner: str) -> None:
        """Remove the caller's stored response. Raises: ApiError 404 as `get`."""
        self.get(response_id, owner)
        with self._lock:
            self._drop(response_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def total_bytes(self) -> int:
        """Bytes of memory the stored responses take, as the caps count them."""
        with self._lock:
            return self._bytes

    def held(self, owner: str) -> tuple[int, int]:
        """How many responses `owner` holds, and their bytes."""
        with self._lock:
            holding = self._owners.get(owner)
            return (len(holding.ids), holding.size) if holding else (0, 0)

    def _largest(self, by_bytes: bool) -> _Holding:
        """The owner that holds the most bytes (`by_bytes`) or responses; of those that hold as much, the one
        whose oldest response is oldest (the caller holds the lock)."""
        return max(self._owners.values(), key=lambda h: (h.size if by_bytes else len(h.ids),
                                                         -self._items[next(iter(h.ids))].created))

    def _expire(self) -> None:
        """Drop what is older than max_age, oldest first (the caller holds the lock)."""
        oldest = self._clock() - self.max_age
        while self._items and next(iter(self._items.values())).created < oldest:
            self._drop(next(iter(self._items)))

    def _drop(self, response_id: str) -> None:
        """Remove one response if it is there (the caller holds the lock)."""
        stored = self._items.pop(response_id, None)
        if stored is None:
            return
        holding = self._owners[stored.owner]
        del holding.ids[response_id]
        holding.size -= stored.size
        self._bytes -= stored.size
        if not holding.ids:
            del self._owners[stored.owner]
            self._bytes -= holding.size
