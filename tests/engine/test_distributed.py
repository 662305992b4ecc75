"""Ranks that follow rank 0's loop (rust/python/gemma_engine/distributed.py): two processes, each holding one shard,
rank 0 leading a staggered scripted run and rank 1 fed nothing but rank 0's poll results.

Rank 0's outcomes equal one unsplit engine's given the same script (batching, a resumed second turn, a seeded
sampled request, a cancel), so the follower made exactly the leader's steps (else their collectives would not
meet, or would meet on other tensors). A follower killed mid-stream fails the leader's running requests with
the reason, and the leader's loop raises, within a bounded time: no request waits forever.
"""

import multiprocessing
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import gemma_engine
from gemma_engine.distributed import follow, lead, members, start
from tests.checkpoints.agent import AGENT_VOCAB_SIZE
from tests.checkpoints.multimodal import random_image
from tests.checkpoints.text import SEED, save_dense, tiny_text_config
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


def _rank(rank: int, port: int, model_dir: str, out: str, fault: tuple[str, int] | None) -> None:
    """Rank 0 leads the script, rank 1 follows; `fault` (kind, poll): at that poll the follower exits ("exit") or
    hangs ("hang": it stops itself, as a wedged process would)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=TIMEOUT_S))
    engine = _engine(model_dir, rank)
    if rank > 0:
        polls = 0

        def on_events(events, stats):
            nonlocal polls
            polls += 1
            if fault is not None and polls == fault[1]:
                if fault[0] == "hang":
                    os.kill(os.getpid(), signal.SIGSTOP)
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


def _run(model_dir, out, fault=None) -> tuple[dict, list[int | None]]:
    """Rank 0's saved result and each rank's exit code (None: still there when rank 0 ended, then killed)."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(model_dir), str(out), fault)) for r in range(WORLD)]
    for p in procs:
        p.start()
    procs[0].join(300)
    for p in procs[1:]:
        p.join(5 if fault else 300)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return torch.load(out), codes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_dense(tmp_path_factory.mktemp("distributed"), SEED, tiny_text_config())


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
    got, codes = _run(model_dir, tmp_path / "rank0.pt", fault=("exit", 5))
    assert codes == [0, 3]
    assert got["raised"] and ("Connection" in got["raised"] or "closed" in got["raised"]), got["raised"]
    assert got["seconds"] < 3 * TIMEOUT_S, got["seconds"]
    finishes = {rid: o[1] for rid, o in got["outcomes"].items()}
    assert all(o[2] for o in got["outcomes"].values() if o[1] == "failed"), finishes  # each with its reason
    assert "length" not in finishes.values(), finishes  # it died before any request could end


def test_a_follower_that_hangs_mid_stream_fails_the_leaders_requests_within_the_collective_timeout(
        model_dir, tmp_path):
    """A follower that stops answering (stopped, its connections open) is found at the group's timeout: the leader's
    collective raises after TIMEOUT_S, the requests fail with the reason, and its loop raises."""
    got, codes = _run(model_dir, tmp_path / "rank0.pt", fault=("hang", 5))
    assert codes == [0, None]  # the follower was still there, stopped, when rank 0 ended
    assert got["raised"] and "timed out" in got["raised"].lower(), got["raised"]
    assert TIMEOUT_S * 0.9 <= got["seconds"] < 3 * TIMEOUT_S, got["seconds"]
    finishes = {rid: o[1] for rid, o in got["outcomes"].items()}
    assert "length" not in finishes.values(), finishes


def test_the_ranks_of_each_engine_follow_its_own_leader_in_one_world():
    assert members([2]) == [[0, 1]]
    assert members([2, 2, 2]) == [[0, 1], [0, 2], [0, 3]]
    assert members([4, 2]) == [[0, 1, 2, 3], [0, 4]]


def test_leaders_over_follower_processes_make_every_engine_call_on_every_rank(model_dir):
    """`start` with two engines of two ranks: this process is rank 0 of both, each other rank a process of its own
    serving its leader's calls. From two threads at once (as the server's engine workers call them), decode, logits,
    a cache reset and a scripted run through each `Leader` give one unsplit engine's results; `close` ends the
    followers and, after the last, leaves the world."""
    recipe = {"model_dir": str(model_dir), "devices": ["cpu"] * WORLD, "grammars": None, "compile_backend": None,
              "engine": {"context": 256, "dtype": "float32", "max_batch": 2, "prefill_chunk": 5}}
    one = _engine(str(model_dir))
    want = (one.decode(PROMPTS["parity"], 12)[0], one.logits(PROMPTS["other"]), _script().run(one, read_every=2))
    seats = start([recipe, recipe], f"tcp://127.0.0.1:{_free_port()}", timeout_s=TIMEOUT_S * 6)

    def calls(seat):
        leader = seat.lead()  # on the thread that uses it (and drops it), as an Engine must be
        try:
            assert leader.layout()["tensor_parallel_rank"] == 0  # rank 0 reads its own engine
            tokens, logits = leader.decode(PROMPTS["parity"], 12)[0], leader.logits(PROMPTS["other"])
            leader.reset_prefix_cache()
            return tokens, logits, _script().run(leader, read_every=2)
        finally:
            leader.close()

    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(calls, seats))
    for tokens, logits, outcomes in got:
        assert tokens == want[0] and (logits - want[1]).abs().max() < 1e-3
        assert {rid: (o.tokens, o.finish) for rid, o in outcomes.items()} == {
            rid: (o.tokens, o.finish) for rid, o in want[2].items()}
    assert not dist.is_initialized()


def test_grammar_constrained_and_image_requests_across_ranks_give_one_engines_outcomes(multimodal_checkpoint):
    """An image request (its soft tokens cross to the follower inside the pickled Request) beside a request held to a
    JSON schema (each rank masks with its own copy of the grammars, fed the same tokens), through a `Leader` over a
    follower process: one unsplit engine's tokens, finishes and log-probabilities."""
    import json

    import jsonschema
    from transformers import AutoProcessor

    from tests.engine.test_grammar import SCHEMA, STRICT
    from tests.engine.test_media import chat_inputs, media_of

    d = str(multimodal_checkpoint)
    processor, encoder = AutoProcessor.from_pretrained(d), gemma_engine.Encoder(d, dtype="float32")
    images = [random_image(40, 30, 0)]
    pictured = chat_inputs(processor, images, "What is in this picture?")
    media = media_of(encoder, pictured, images)
    asked = chat_inputs(processor, [], "Answer in JSON.")["input_ids"][0].tolist()
    logprobs = gemma_engine.SamplingParams(temperature=0.0, logprobs=2)

    def requests():
        return {0: [gemma_engine.Request(0, pictured["input_ids"][0].tolist(), 16, media=media, sampling=logprobs),
                    gemma_engine.Request(1, asked, 96, grammar=STRICT)]}

    settings = {"context": 256, "dtype": "float32", "max_batch": 2, "prefill_chunk": 8}
    eos = gemma_engine.Engine(d, like=torch.zeros(1), **settings).eos_ids
    grammars = (str(multimodal_checkpoint / "tokenizer.json"), eos, AGENT_VOCAB_SIZE)
    one = gemma_engine.Engine(d, like=torch.zeros(1), grammars=gemma_engine.Grammars(*grammars), **settings)
    want = Script(requests()).run(one)
    recipe = {"model_dir": d, "devices": ["cpu"] * WORLD, "grammars": grammars, "compile_backend": None,
              "engine": settings}
    [seat] = start([recipe], f"tcp://127.0.0.1:{_free_port()}", timeout_s=TIMEOUT_S * 6)
    leader = seat.lead(grammars=gemma_engine.Grammars(*grammars))
    try:
        got = Script(requests()).run(leader)
    finally:
        leader.close()
    assert want[0].tokens and want[1].tokens
    for rid, w in want.items():
        assert (got[rid].tokens, got[rid].finish) == (w.tokens, w.finish), rid
        assert [t for _, top in got[rid].logprobs for t, _ in top] == [t for _, top in w.logprobs for t, _ in top]
    assert want[1].finish == "stop"  # the schema bounds the output (measured 40 tokens)
    jsonschema.validate(json.loads(processor.tokenizer.decode(got[1].tokens)), SCHEMA)
