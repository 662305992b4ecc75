"""Ranks that follow rank 0's loop (rust/python/gemma_engine/distributed.py): two processes, each holding one shard,
rank 0 leading a staggered scripted run and rank 1 fed nothing but rank 0's poll results.

Rank 0's outcomes equal one unsplit engine's given the same script (batching, a resumed second turn, a seeded
sampled request, a cancel), so the follower made exactly the leader's steps (else their collectives would not
meet, or would meet on other tensors). A follower killed mid-stream fails the leader's running requests with
the reason, and the leader's loop raises, within a bounded time: no request waits forever.
"""

import multiprocessing
import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import gemma_engine
from gemma_engine.distributed import follow, lead, start
from tests import checkpoints as ck
from tests.engine.test_batching import PROMPTS, Script

pytestmark = pytest.mark.slow

WORLD = 2
TIMEOUT_S = 10  # the group's collective timeout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CANCEL = (44, 4)  # at poll call 44, cancel request 4


def _script() -> Script:
    """Two greedy requests together, a seeded sampled one with log-probabilities queued behind them, and after
    they end a second turn of the first (a prefix-cache resume) beside a long request cancelled part way."""
    sampled = gemma_engine.SamplingParams(temperature=0.9, top_p=0.95, seed=7, logprobs=2)
    arrivals = {
        0: [gemma_engine.Request(0, PROMPTS["parity"], 24), gemma_engine.Request(1, PROMPTS["other"], 12)],
        2: [gemma_engine.Request(2, PROMPTS["short"], 16, sampling=sampled)],
        40: [gemma_engine.Request(3, PROMPTS["parity"] + PROMPTS["short"][1:], 12),
             gemma_engine.Request(4, PROMPTS["long"], 40)],
    }
    return Script(arrivals, cancel=lambda call, _: [CANCEL[1]] if call == CANCEL[0] else [])


def _engine(model_dir: str, rank: int | None = None) -> gemma_engine.Engine:
    split = {} if rank is None else {"tensor_parallel_size": WORLD, "tensor_parallel_rank": rank,
                                     "tensor_parallel_group": dist.group.WORLD.group_name}
    return gemma_engine.Engine(model_dir, like=torch.zeros(1), context=256, dtype="float32", max_batch=2,
                               prefill_chunk=5, **split)


def _rank(rank: int, port: int, model_dir: str, out: str, die_after: int | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=TIMEOUT_S))
    engine = _engine(model_dir, rank)
    if rank > 0:
        polls = 0

        def on_events(events, stats):
            nonlocal polls
            polls += 1
            if die_after is not None and polls == die_after:
                os._exit(3)  # a rank that dies mid-stream, as a killed process does

        follow(engine, read_every=2, on_events=on_events)
        return
    script, started, raised = _script(), time.monotonic(), None
    try:
        lead(engine, script.poll, script.on_events, read_every=2)
    except Exception as e:  # what the caller of a rank sees when another is gone
        raised = f"{type(e).__name__}: {e}"
    outcomes = {rid: (o.tokens, o.finish, o.error, o.logprobs) for rid, o in script.outcomes.items()}
    torch.save({"outcomes": outcomes, "raised": raised, "seconds": time.monotonic() - started}, out)
    os._exit(0)  # no process group teardown: a dead peer would make it wait


def _run(model_dir, out, die_after=None) -> tuple[dict, list[int]]:
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(model_dir), str(out), die_after)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return torch.load(out), codes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ck.save_dense(tmp_path_factory.mktemp("distributed"), ck.SEED, ck.tiny_text_config())


def test_a_follower_makes_the_leaders_steps_and_the_outcomes_are_one_engines(model_dir, tmp_path):
    want = _script().run(_engine(str(model_dir)), read_every=2)
    got, codes = _run(model_dir, tmp_path / "rank0.pt")
    assert codes == [0, 0] and got["raised"] is None
    assert want[4].finish == "cancelled" and want[2].tokens and sum(len(o.tokens) for o in want.values()) > 60
    for rid, w in want.items():
        tokens, finish, error, logprobs = got["outcomes"][rid]
        assert (tokens, finish, error) == (w.tokens, w.finish, w.error), rid
        assert [t for _, top in logprobs for t, _ in top] == [t for _, top in w.logprobs for t, _ in top], rid


def test_a_follower_that_dies_mid_stream_fails_the_leaders_requests_within_a_bounded_time(model_dir, tmp_path):
    """The leader finds the follower gone at its next collective: inside a step (the engine fails the requests it
    was running, each with the reason) or at the next poll's broadcast (here: the follower dies between two
    polls); either way its loop raises within moments (measured 0.2 to 0.9 s), so its caller fails what is still
    running and turns unready, as the server's scheduler does when an engine's loop raises (`worker_died`),
    instead of waiting on a peer that will never answer."""
    got, codes = _run(model_dir, tmp_path / "rank0.pt", die_after=5)
    assert codes == [0, 3]
    assert got["raised"] and ("Connection" in got["raised"] or "closed" in got["raised"]), got["raised"]
    assert got["seconds"] < 3 * TIMEOUT_S, got["seconds"]
    finishes = {rid: o[1] for rid, o in got["outcomes"].items()}
    assert all(o[2] for o in got["outcomes"].values() if o[1] == "failed"), finishes  # each with its reason
    assert "length" not in finishes.values(), finishes  # it died before any request could end


def test_a_leader_over_follower_processes_makes_every_engine_call_on_every_rank(model_dir):
    """`start`: rank 1 a process of its own serving rank 0's calls; decode, logits, a cache reset and a scripted
    run through rank 0's `Leader` give one unsplit engine's results, and `close` ends the follower."""
    recipe = {"model_dir": str(model_dir), "devices": ["cpu"] * WORLD, "grammars": None, "compile_backend": None,
              "engine": {"context": 256, "dtype": "float32", "max_batch": 2, "prefill_chunk": 5}}
    one = _engine(str(model_dir))
    want = (one.decode(PROMPTS["parity"], 12)[0], one.logits(PROMPTS["other"]), _script().run(one, read_every=2))
    leader = start(recipe, WORLD, f"tcp://127.0.0.1:{_free_port()}", timeout_s=TIMEOUT_S * 6)
    try:
        assert leader.layout()["tensor_parallel_rank"] == 0  # rank 0 reads its own engine
        tokens, logits = leader.decode(PROMPTS["parity"], 12)[0], leader.logits(PROMPTS["other"])
        leader.reset_prefix_cache()
        got = _script().run(leader, read_every=2)
    finally:
        leader.close()
    assert tokens == want[0] and (logits - want[1]).abs().max() < 1e-3
    assert {rid: (o.tokens, o.finish) for rid, o in got.items()} == {
        rid: (o.tokens, o.finish) for rid, o in want[2].items()}
    assert not dist.is_initialized()
