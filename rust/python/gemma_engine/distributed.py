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

Several engines in one process (a server's, one per group of devices) share one world: `start` makes this
process rank 0 of each, every other rank a process of its own, and gives each engine its own collective and
control groups (`members`), so one engine's steps never wait on another's.

Failure: a rank that dies makes the next collective of every other rank fail (gloo: at once, "Connection reset
by peer"; any backend: within the group's timeout), so the engine fails the requests it was running ("failed",
with the reason) and the next broadcast raises out of `lead` and `follow`: the caller turns unready and restarts.
An idle rank 0 makes no collective; `Leader` watches its follower processes and tells `on_lost` at once.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

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


# The engine calls that run the model or change its state: every rank must make them, in the same order. Rank 0's
# other calls (layout, weights, compile_report, ...) read its own engine, from any thread.
MIRRORED = frozenset({"run", "decode", "logits", "reset_prefix_cache", "use_compiled", "speculation_costs",
                      "compile_verify", "set_speculative_max_bucket"})


class Leader:
    """Rank 0's engine, standing in for `gemma_engine.Engine`: a `MIRRORED` call is sent to the followers (`serve`)
    before rank 0 makes it, `run` through `lead`; every other attribute is rank 0's engine's. Calls come from one
    thread at a time (the engine's worker), as they do to an Engine."""

    def __init__(self, engine: gemma_engine.Engine, followers: Sequence[Any] = (),
                 control: dist.ProcessGroup | None = None, on_closed: Callable[[], None] = lambda: None):
        self._engine, self._followers, self._control = engine, list(followers), control
        self._closing, self._on_closed = False, on_closed
        #: Called as on_lost(reason) from a watcher thread when a follower process exits before `close`: an idle
        #: engine would otherwise notice only at its next collective.
        self.on_lost: Callable[[str], None] | None = None
        if self._followers:
            # A weak reference: the engine must be dropped on the thread that made it, not on the watcher's.
            threading.Thread(target=_watch, args=(weakref.ref(self), self._followers), name="rank-watch",
                             daemon=True).start()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._engine, name)
        if name not in MIRRORED:
            return attr
        if name == "run":
            def run(poll: Poll, on_events: Callable, read_every: int = 1) -> None:
                _broadcast(("run", (read_every,), {}), self._control)
                lead(self._engine, poll, on_events, read_every, self._control)
            return run

        def mirrored(*args, **kwargs):
            _broadcast((name, args, kwargs), self._control)
            return attr(*args, **kwargs)
        return mirrored

    def close(self, timeout: float = 30.0) -> None:
        """End the followers' loops, wait for their processes (killing any still there after `timeout`), then
        `on_closed` (from `start`: the last Leader of a world closed leaves it). Safe to call once the followers are
        gone."""
        self._closing = True
        try:
            _broadcast(None, self._control)
        except RuntimeError:
            pass  # a follower is gone: the others' next collective fails them
        for p in self._followers:
            p.join(timeout)
            if p.is_alive():
                p.kill()
        self._on_closed()


def _watch(leader: weakref.ref, followers: list[Any]) -> None:
    """Wait for the first follower process to exit; tell the leader's `on_lost` unless it is closing or gone."""
    from multiprocessing.connection import wait

    [gone] = wait([p.sentinel for p in followers])[:1]
    rank, p = next((r, p) for r, p in enumerate(followers, 1) if p.sentinel == gone)
    p.join(1)
    alive = leader()
    if alive is not None and not alive._closing and alive.on_lost is not None:
        alive.on_lost(f"tensor-parallel rank {rank} exited (code {p.exitcode})")


def serve(engine: gemma_engine.Engine, control: dist.ProcessGroup | None = None) -> None:
    """A follower's loop: make every call rank 0's `Leader` sends, `run` through `follow`, until it closes."""
    while (message := _broadcast(None, control)) is not None:
        name, args, kwargs = message
        if name == "run":
            follow(engine, args[0], control)
        else:
            getattr(engine, name)(*args, **kwargs)


def make_engine(recipe: dict[str, Any], rank: int, group: dist.ProcessGroup, **overrides) -> gemma_engine.Engine:
    """Shard `rank` of the engine `recipe` describes (picklable: it crosses to the follower processes): "model_dir",
    "emb_dir", "devices" (one per rank), "engine" (Engine's other keyword arguments), "grammars" ((tokenizer.json,
    eos ids, vocab size) or None), "compile_backend" (a StepCompiler backend or None) and "compile_donate" (its
    `donate`); its collectives run over `group`. `overrides` replace what the recipe makes (rank 0's own grammars
    and compiler)."""
    import torch

    made: dict[str, Any] = {}
    if recipe.get("grammars"):
        made["grammars"] = gemma_engine.Grammars(*recipe["grammars"])
    if recipe.get("compile_backend"):
        from gemma_engine.compiling import StepCompiler

        made["compiler"] = StepCompiler(recipe["compile_backend"], donate=recipe.get("compile_donate", False))
    made.update(overrides)
    return gemma_engine.Engine(
        recipe["model_dir"], recipe.get("emb_dir"), torch.zeros(1, device=recipe["devices"][rank]),
        tensor_parallel_size=len(recipe["devices"]), tensor_parallel_rank=rank, tensor_parallel_group=group.group_name,
        **recipe["engine"], **made)


# How long a follower waits for rank 0's next message: rank 0's poll blocks while no request runs, for as long as
# none comes. A rank that dies still fails the others at once (its connections close); one that hangs inside a step
# fails them within the collectives' own timeout.
CONTROL_TIMEOUT_S = 7 * 24 * 3600


def members(sizes: Sequence[int]) -> list[list[int]]:
    """The global ranks of each engine of `sizes` ranks in one world: this process, global rank 0, is every engine's
    rank 0; engine g's other ranks follow engine g-1's. `members([2, 2]) == [[0, 1], [0, 2]]`."""
    out, next_rank = [], 1
    for n in sizes:
        out.append([0, *range(next_rank, next_rank + n - 1)])
        next_rank += n - 1
    return out


def _join(rank: int, sizes: Sequence[int], init_method: str, backend: str,
          timeout_s: float) -> list[tuple[dist.ProcessGroup, dist.ProcessGroup]]:
    """Join the world as global rank `rank` and make every engine's groups, as every process must, in the same
    order: (its collectives' group, over `backend` and bounded by `timeout_s`; its control group for the pickled
    messages, gloo, bounded by CONTROL_TIMEOUT_S)."""
    from datetime import timedelta

    ranks = members(sizes)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=1 + sum(n - 1 for n in sizes),
                            timeout=timedelta(seconds=timeout_s))
    return [(dist.new_group(m, backend=backend, timeout=timedelta(seconds=timeout_s)),
             dist.new_group(m, backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S))) for m in ranks]


def _follower(rank: int, init_method: str, backend: str, timeout_s: float, recipes: list[dict]) -> None:
    sizes = [len(r["devices"]) for r in recipes]
    groups = _join(rank, sizes, init_method, backend, timeout_s)
    g, ranks = next((g, m) for g, m in enumerate(members(sizes)) if rank in m)
    collectives, control = groups[g]
    serve(make_engine(recipes[g], ranks.index(rank), collectives), control)


class Started(NamedTuple):
    """One engine's rank 0 seat in a started world (`start`): its recipe, follower processes and groups."""
    recipe: dict[str, Any]
    followers: list[Any]
    collectives: dist.ProcessGroup
    control: dist.ProcessGroup
    on_closed: Callable[[], None]

    def lead(self, **overrides) -> Leader:
        """Rank 0's engine (`overrides`: its own arguments, such as its grammars and compiler) as a `Leader`. Call it
        on the thread that will use the engine: an Engine stays on the thread that made it."""
        engine = make_engine(self.recipe, 0, self.collectives, **overrides)
        return Leader(engine, self.followers, self.control, self.on_closed)


def start(recipes: Sequence[dict[str, Any]], init_method: str, backend: str = "gloo",
          timeout_s: float = 600.0) -> list[Started]:
    """Start every engine `recipes` describe (`make_engine`; as many ranks as its devices) in one world: this process
    is rank 0 of each, and every other rank a process of its own, started here, that loads its shard and serves.
    Returns each engine's seat, whose `lead` makes rank 0's engine; the last `Leader` closed leaves the world.
    `timeout_s` bounds every collective: a rank that hangs fails the others' within it."""
    import multiprocessing

    sizes = [len(r["devices"]) for r in recipes]
    ctx = multiprocessing.get_context("spawn")
    followers = {r: ctx.Process(target=_follower, args=(r, init_method, backend, timeout_s, list(recipes)),
                                daemon=True) for m in members(sizes) for r in m[1:]}
    for p in followers.values():
        p.start()
    groups = _join(0, sizes, init_method, backend, timeout_s)
    open_leaders, lock = [len(recipes)], threading.Lock()

    def closed() -> None:
        with lock:
            open_leaders[0] -= 1
            if open_leaders[0] == 0:
                dist.destroy_process_group()

    return [Started(recipe, [followers[r] for r in m[1:]], collectives, control, closed)
            for recipe, m, (collectives, control) in zip(recipes, members(sizes), groups)]
