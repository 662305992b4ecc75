"""Tensor parallelism across processes: rank 0 leads the engine's loop, every other rank follows it step for step.

Each rank holds one shard (`Engine(tensor_parallel_size=N, tensor_parallel_rank=r, tensor_parallel_group=name)`),
and its layers' partial outputs meet the other ranks' in collectives inside the step, so every rank must run the
same steps in the same order. `Engine.run` decides its steps from what its `poll` returns and nothing else
(admission and slots, prompt chunks, decode buckets, read points, grammar masks and seeded draws; the logits every
rank draws from are the same all-gathered ones), so rank 0 alone talks to the scheduler: `lead` broadcasts what
each of its polls returned (the new requests, pickled as their constructor's arguments, and the ids to cancel)
over a control group, and `follow` makes every other rank's poll return it. A follower never sees HTTP or the
scheduler; it receives one small message a poll, as vLLM's workers execute the scheduler's output of each step
(vllm/v1/executor/multiproc_executor.py broadcasts it to the workers through a shared-memory queue).

Failure: a rank that dies makes the next collective of every other rank fail (gloo: at once, "Connection reset
by peer"; any backend: within the group's timeout), so the engine fails the requests it was running ("failed",
with the reason) and the next broadcast raises out of `lead` and `follow`: the caller turns unready and restarts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

import gemma_engine

Poll = Callable[[int, bool], tuple[Sequence[gemma_engine.Request], Sequence[int]] | None]


def _broadcast(message: Any, group: dist.ProcessGroup | None) -> Any:
    """Rank 0's `message` on every rank of `group` (a CPU group: gloo)."""
    box = [message]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return box[0]


def lead(engine: gemma_engine.Engine, poll: Poll, on_events: Callable, read_every: int = 1,
         control: dist.ProcessGroup | None = None) -> None:
    """Run `engine` on rank 0 as `Engine.run` does; every poll's result goes to the followers first. Raises when a
    broadcast fails (a rank is gone)."""
    def shared_poll(free: int, idle: bool):
        got = poll(free, idle)
        message = None if got is None else (list(got[0]), list(got[1]))
        _broadcast(message, control)
        return message

    engine.run(shared_poll, on_events, read_every)


def follow(engine: gemma_engine.Engine, read_every: int = 1, control: dist.ProcessGroup | None = None,
           on_events: Callable = lambda events, stats: None) -> None:
    """Run `engine` on a rank other than 0: each poll returns what rank 0's returned, until it ends the loop.
    Raises when a broadcast fails (rank 0 is gone)."""
    def follower_poll(free: int, idle: bool):
        return _broadcast(None, control)

    engine.run(follower_poll, on_events, read_every)
