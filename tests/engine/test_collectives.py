"""Collectives called from Rust through PyTorch's dispatcher (rust/src/aten.cpp, `aten_all_reduce_sum`): the path
tensor parallelism across processes takes, a process per device, each holding its shard.

Two gloo ranks, each a process of its own (as torchrun starts them), reduce and gather through the engine's
shim: the sum is every rank's, the gathered logits are the shards side by side, and a dispatcher-level capture
(`make_fx`, as the compiled step records a step) sees the functional collectives (`_c10d_functional.all_reduce`,
`all_gather_into_tensor`, `wait_tensor`), the ops Inductor and torch_tpu lower inside a compiled graph, and its
replay reduces again. A rank that is gone fails its peer's collective in bounded time instead of hanging.
"""

import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gemma_engine import testing

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_input(rank: int) -> torch.Tensor:
    return torch.arange(6.0).reshape(2, 3) * (rank + 1) + rank


def _logits_shard(rank: int) -> torch.Tensor:
    """Rank `rank`'s columns of [3, 8] logits: 4 of them."""
    return torch.arange(24.0).reshape(3, 8)[:, 4 * rank: 4 * (rank + 1)]


def _rank(rank: int, port: int, out_dir: str) -> None:
    """One rank: reduce eagerly, capture the reduction, replay the capture; each result saved for the test."""
    from torch.fx.experimental.proxy_tensor import make_fx

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        group = dist.group.WORLD.group_name
        x = _rank_input(rank)
        eager = testing.all_reduce_sum(x, group)
        gm = make_fx(lambda t: testing.all_reduce_sum(t, group), tracing_mode="real")(x)
        ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        replayed = gm(x)
        try:
            testing.all_reduce_sum(x, "no-such-group")
            refused = None
        except ValueError as e:
            refused = str(e)
        shard = _logits_shard(rank)
        gathered = testing.all_gather_last(shard, WORLD, group)
        gather_gm = make_fx(lambda t: testing.all_gather_last(t, WORLD, group), tracing_mode="real")(shard)
        gather_ops = [str(n.target) for n in gather_gm.graph.nodes if n.op == "call_function"]
        torch.save({"eager": eager, "ops": ops, "replayed": replayed, "input": x, "refused": refused,
                    "gathered": gathered, "gather_ops": gather_ops}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("collectives")
    mp.spawn(_rank, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def test_an_all_reduce_from_rust_sums_every_ranks_tensor(ranks):
    want = sum(_rank_input(r) for r in range(WORLD))
    for rank, r in enumerate(ranks):
        assert torch.equal(r["input"], _rank_input(rank))  # its own input untouched
        assert torch.equal(r["eager"], want)


def test_a_capture_records_the_functional_collective_and_its_replay_reduces_again(ranks):
    want = sum(_rank_input(r) for r in range(WORLD))
    for r in ranks:
        assert r["ops"] == ["_c10d_functional.all_reduce.default", "_c10d_functional.wait_tensor.default"]
        assert torch.equal(r["replayed"], want)


def test_an_unknown_group_is_a_value_error_naming_it(ranks):
    for r in ranks:
        assert r["refused"] is not None and "all_reduce_sum" in r["refused"] and "no-such-group" in r["refused"]


def test_an_all_gather_from_rust_puts_the_ranks_shards_side_by_side_and_is_captured(ranks):
    for r in ranks:
        assert torch.equal(r["gathered"], torch.arange(24.0).reshape(3, 8))
        assert [op for op in r["gather_ops"] if op.startswith("_c10d_functional")] == [
            "_c10d_functional.all_gather_into_tensor.default", "_c10d_functional.wait_tensor.default"]


TIMEOUT_S = 5


def _rank_that_loses_its_peer(rank: int, port: int, out_dir: str) -> None:
    """Rank 1 leaves once both have joined (rank 0 says so through the group's store); rank 0's reduction then
    fails instead of waiting forever."""
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=TIMEOUT_S))
    if rank == 1:
        store.wait(["joined"])
        os._exit(0)
    store.set("joined", "1")
    started = time.monotonic()
    try:
        testing.all_reduce_sum(torch.ones(4), dist.group.WORLD.group_name)
        error = None
    except ValueError as e:
        error = str(e)
    torch.save({"error": error, "seconds": time.monotonic() - started}, f"{out_dir}/lost.pt")
    os._exit(0)  # the group's teardown would wait on the peer that is gone


def test_a_collective_whose_peer_is_gone_fails_instead_of_waiting(tmp_path):
    """Bounded by the group's timeout with slack (gloo reports the closed connection at once: 0.02 s here)."""
    mp.spawn(_rank_that_loses_its_peer, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    lost = torch.load(tmp_path / "lost.pt")
    assert lost["error"] is not None and "all_reduce_sum" in lost["error"], lost
    assert lost["seconds"] < 6 * TIMEOUT_S, lost
