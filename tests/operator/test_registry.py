"""The operator's state in one owner (operator/gemma_operator/registry.py): a server's entry is made on first
use and `forget` drops it whole, its pods' polling included."""

from __future__ import annotations

from gemma_operator.registry import Registry


class RecordingPoller:
    def __init__(self):
        self.forgotten = []

    def forget(self, server):
        self.forgotten.append(server)


def test_forget_drops_everything_held_for_a_server_and_stops_polling_its_pods():
    poller = RecordingPoller()
    registry = Registry(poller=poller)
    registry.track("u-1", "ns", "a")
    registry.track("u-2", "ns", "b")
    a = registry.server("u-1", "ns", "a")
    a.written = {"phase": "Ready"}
    a.own_children.add(("Deployment", "a"))
    assert registry.server("u-1", "ns", "a") is a
    assert sorted(registry.known()) == [("ns", "a"), ("ns", "b")]

    registry.forget("u-1")
    assert registry.known() == [("ns", "b")]
    assert poller.forgotten == ["ns/a"]
    fresh = registry.server("u-1", "ns", "a")
    assert fresh is not a and fresh.written is None and not fresh.own_children and not fresh.known
    registry.forget("u-unknown")  # a server never seen: nothing to drop
    assert poller.forgotten == ["ns/a"]


def test_a_server_synced_before_the_watch_saw_it_is_not_resynced():
    registry = Registry(poller=RecordingPoller())
    registry.server("u-1", "ns", "a")
    assert registry.known() == []
