"""The Responses API's store (response_store.ResponseStore) on its own: its count, byte and age caps, who
loses what when they are passed, and that the bytes it counts are the memory it takes. The store through the
server and the openai SDK is tests/server/frontends/test_responses.py's."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from gemma_server.errors import ApiError
from gemma_server.response_store import ResponseStore


def test_the_store_keeps_its_count_bytes_and_age_caps():
    now = [0.0]
    store = ResponseStore(max_count=2, max_bytes=3_000, max_age=60, clock=lambda: now[0])

    def put(i: int, size: int = 10) -> None:
        store.put("me", {"id": f"resp_{i}", "output": [], "pad": "x" * size}, [])

    put(1), put(2), put(3)
    assert len(store) == 2
    with pytest.raises(ApiError) as seen:
        store.get("resp_1", "me")
    assert seen.value.status == 404
    assert store.get("resp_3", "me").response["id"] == "resp_3"
    with pytest.raises(ApiError):
        store.get("resp_3", "someone else")
    put(4, size=2_000)  # past the byte cap with the others: the oldest go
    assert len(store) == 1 and store.get("resp_4", "me")
    put(5, size=4_000)  # larger than the whole store: not kept, nothing lost
    assert len(store) == 1
    now[0] = 61.0
    with pytest.raises(ApiError):
        store.get("resp_4", "me")
    assert len(store) == 0 and store.total_bytes == 0


def stored_ids(store: ResponseStore, owner: str, ids) -> list[str]:
    kept = []
    for response_id in ids:
        try:
            kept.append(store.get(response_id, owner).response["id"])
        except ApiError:
            pass
    return kept


def test_one_keys_flood_evicts_its_own_responses_never_anothers():
    """The attack's shape, at a small size: past the whole store's count, the key that holds the most loses its
    oldest. The victim's 3 responses stay through the flooder's 60; the flooder keeps its 17 newest."""
    now = [0.0]
    store = ResponseStore(max_count=20, max_bytes=10**9, max_age=3600, clock=lambda: now[0])

    def put(owner: str, i: int) -> str:
        now[0] += 0.01
        store.put(owner, {"id": f"resp_{owner}_{i}", "output": []}, [{"role": "user", "content": "hi"}])
        return f"resp_{owner}_{i}"

    victim = [put("victim", i) for i in range(3)]
    flood = [put("flooder", i) for i in range(60)]
    assert stored_ids(store, "victim", victim) == victim
    assert stored_ids(store, "flooder", flood) == flood[-17:]
    assert len(store) == 20 and store.held("victim")[0] == 3 and store.held("flooder")[0] == 17


def test_past_the_byte_cap_the_key_holding_the_most_bytes_loses_its_oldest():
    now = [0.0]
    store = ResponseStore(max_count=1000, max_bytes=200_000, max_age=3600, clock=lambda: now[0])

    def put(owner: str, i: int, size: int) -> str:
        now[0] += 0.01
        store.put(owner, {"id": f"resp_{owner}_{i}", "output": [], "pad": "x" * size}, [])
        return f"resp_{owner}_{i}"

    victim = [put("victim", i, 20_000) for i in range(3)]
    flood = [put("flooder", i, 30_000) for i in range(40)]
    assert stored_ids(store, "victim", victim) == victim
    kept = stored_ids(store, "flooder", flood)
    assert kept == flood[-len(kept):] and len(kept) == 4  # 3 x 20 kB + 4 x 30 kB with their bookkeeping
    assert store.total_bytes <= 200_000


def test_of_two_keys_holding_as_much_the_one_with_the_older_response_loses_it():
    now = [0.0]
    store = ResponseStore(max_count=4, max_bytes=10**9, max_age=3600, clock=lambda: now[0])
    for owner in ("a", "b", "a", "b"):
        now[0] += 1
        store.put(owner, {"id": f"resp_{owner}_{now[0]:g}", "output": []}, [])
    now[0] += 1
    store.put("c", {"id": "resp_c", "output": []}, [])
    assert stored_ids(store, "a", ["resp_a_1", "resp_a_3"]) == ["resp_a_3"]
    assert stored_ids(store, "b", ["resp_b_2", "resp_b_4"]) == ["resp_b_2", "resp_b_4"]


def test_a_keys_own_caps_evict_its_own_oldest_first():
    now = [0.0]
    store = ResponseStore(max_count=100, max_bytes=10**9, max_age=3600, max_count_per_key=5,
                          max_bytes_per_key=60_000, clock=lambda: now[0])

    def put(owner: str, i: int, size: int = 10) -> str:
        now[0] += 0.01
        store.put(owner, {"id": f"resp_{owner}_{i}", "output": [], "pad": "x" * size}, [])
        return f"resp_{owner}_{i}"

    other = [put("other", i) for i in range(2)]
    mine = [put("me", i) for i in range(8)]
    assert stored_ids(store, "me", mine) == mine[-5:] and stored_ids(store, "other", other) == other
    big = [put("me", 100 + i, 25_000) for i in range(3)]  # 3 x 25 kB is past the key's 60 kB
    assert stored_ids(store, "me", mine + big) == big[-2:]
    assert store.held("me")[1] <= 60_000 and stored_ids(store, "other", other) == other
    put("me", 200, 70_000)  # larger than the key's cap alone: not kept, nothing of its own lost
    assert stored_ids(store, "me", big) == big[-2:] and len(store) == 4


def test_a_stored_response_comes_back_as_it_was_put():
    store = ResponseStore(max_count=10, max_bytes=10**6, max_age=60)
    response = {"id": "resp_1", "output": [{"text": "日本語 and \ud800 alone", "logprobs": [-0.125, -1e-9]}],
                "metadata": {"k": "v"}, "usage": None}
    conversation = [{"role": "user", "content": [{"type": "text", "text": "ünïcode"}]}]
    store.put("me", response, conversation)
    stored = store.get("resp_1", "me")
    assert stored.response == response and stored.conversation == conversation


def test_the_counted_bytes_are_the_memory_stored_responses_take():
    """tracemalloc's count of what the store holds after a batch of 40 responses of 100 kB (and their
    conversations) is within 10% of the bytes the caps count: the byte cap bounds memory, not JSON text."""
    store = ResponseStore(max_count=1000, max_bytes=10**9, max_age=3600)
    batch = [({"id": f"resp_{i}", "output": [{"type": "message", "content": [{"type": "output_text",
              "text": f"{i} " + "word " * 20_000, "logprobs": [{"token": "w", "logprob": -0.5}] * 500}]}]},
              [{"role": "user", "content": "question " * 5_000}, {"role": "assistant", "content": "word " * 20_000}])
             for i in range(40)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i, (response, conversation) in enumerate(batch):
            store.put(f"owner-{i % 4}", response, conversation)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(store) == 40 and store.total_bytes > 40 * 200_000
    assert 0.9 <= store.total_bytes / grown <= 1.1, (store.total_bytes, grown)
