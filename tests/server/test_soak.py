"""A short soak: bench/soak.py's load (concurrent streaming openai SDK clients, mixed lengths, sampling on
and off, disconnects and cancels, bursts past the queue limit) against the real server on the tiny
checkpoint for under a minute, then its invariants: every request completed, refused with 429 or cancelled
by its client, none open past its deadline; nothing running or waiting afterwards, every slot free, and
the RSS within 10 % of its size after the warmup."""

from __future__ import annotations

import pytest

from bench.soak import SERVER_ENV, server_args, soak
from tests.server.conftest import get_status, wait_for

CLIENTS = 6
WARMUP_S = 15
SOAK_S = 45


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_short_soak_ends_every_request_and_leaves_the_server_as_it_was(spawn, chat_checkpoint):
    server = spawn(*server_args(str(chat_checkpoint)), "--use-installed-engine", "--served-model-name", "soak",
                   env=SERVER_ENV)
    wait_for(lambda: get_status(server.base + "/health") == 200, 300, "/health 200")
    tally, after, warm_rss, broken = soak(server.base, server.proc.pid, "soak", CLIENTS, WARMUP_S, SOAK_S, seed=7,
                                          say=lambda line: None)
    assert broken == [], f"{tally.summary()}\n" + "\n".join(broken)
    # The load did what it is meant to: replies, refusals past the queue, cancels and disconnects.
    assert tally.completed >= 20 and tally.refused >= 1, tally.summary()
    assert tally.cancelled - tally.disconnected >= 1 and tally.disconnected >= 1, tally.summary()
    assert tally.sent == tally.completed + tally.refused + tally.cancelled
    assert (after.running, after.waiting, after.free_slots) == (0, 0, after.slots)
