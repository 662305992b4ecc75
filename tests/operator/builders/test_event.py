"""The Event the operator posts (gemma_operator/builders/event.py): golden dicts, no cluster involved."""

from __future__ import annotations

from gemma_operator.builders.event import build_event


def test_event_is_built_from_the_time_and_instance_given():
    from datetime import datetime, timezone

    body = {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer",
            "metadata": {"name": "g", "namespace": "ns", "uid": "u1"}}
    now = datetime(2026, 1, 2, 3, 4, 5, 600000, tzinfo=timezone.utc)
    event = build_event(body, "Normal", "Ready", "x" * 2000, now, "op-0")
    assert event["metadata"]["name"].startswith("g.") and len(event["metadata"]["name"]) == 12
    assert event == build_event(body, "Normal", "Ready", "x" * 2000, now, "op-0")
    assert event["involvedObject"] == {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer",
                                       "name": "g", "namespace": "ns", "uid": "u1"}
    assert (event["firstTimestamp"], event["reportingInstance"], len(event["message"])) == (
        "2026-01-02T03:04:05Z", "op-0", 1024)
