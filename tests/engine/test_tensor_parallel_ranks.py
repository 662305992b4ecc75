"""Tensor parallelism across processes (`Engine(tensor_parallel_rank=r, tensor_parallel_group=name)`,
rust/src/gemma4/parallel.rs `Split::Rank`): each rank a process of its own (as torchrun starts them) holding one
shard, its layers' partial outputs summed by all-reduces and the logits' vocabulary gathered by an all-gather,
both `_c10d_functional` ops called from the Rust model through the dispatcher, over gloo on the CPU.

Every rank is given the same requests and runs the same steps, so this checks the model's split and its
collectives, not yet a rank that follows another's schedule: on every tiny architecture, 2 and 4 ranks give
TP 1's and Transformers' greedy tokens, logits within test_tensor_parallel's bound, and, in a busy run
(staggered batched requests, a follower, a resumed second turn, a seeded sampled request, prompt
log-probabilities), TP 1's outcomes; every rank the same.
"""

import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import checkpoints as ck
from tests.engine.test_architectures import SAVERS, kl
from tests.engine.test_tensor_parallel import ALL_CONFIGS, LOGIT_BOUND, RUNS, TOKENS, busy_outcome, engine

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, model_dir: str, hf_tokens: list[int], out_dir: str) -> None:
    """One rank: its shard's engine decodes, reads logits and runs the busy script; results saved for the test."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        group = dist.group.WORLD.group_name
        kwargs = {"tensor_parallel_rank": rank, "tensor_parallel_group": group}
        e = engine(model_dir, world, **kwargs)
        tokens, finish, _, _ = e.decode(ck.PARITY_PROMPT, TOKENS)
        logits = e.logits(ck.PARITY_PROMPT)
        layout = e.layout()
        busy = busy_outcome(engine(model_dir, world, max_batch=4, prefill_chunk=5, **kwargs), hf_tokens)
        torch.save({"tokens": tokens, "finish": finish, "logits": logits, "busy": busy, "layout": layout},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=RUNS, ids=[f"{name}-{kind}" for name, kind, _ in RUNS])
def run(request, tmp_path_factory):
    name, kind, seed = request.param
    model_dir = SAVERS[kind](tmp_path_factory.mktemp(f"ranks_{name}_{kind}"), seed, ALL_CONFIGS[name]())
    tokens, _ = ck.greedy_reference(ck.load_hf_reference(model_dir), ck.PARITY_PROMPT, TOKENS)
    return model_dir, tokens


def ranks(model_dir, hf_tokens: list[int], world: int, out) -> list[dict]:
    mp.spawn(_rank, args=(world, _free_port(), str(model_dir), hf_tokens, str(out)), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_give_the_unsplit_models_tokens_logits_and_busy_outcomes(run, world, tmp_path):
    model_dir, hf_tokens = run
    one = engine(model_dir, 1)
    want_logits = one.logits(ck.PARITY_PROMPT)
    want_busy = busy_outcome(engine(model_dir, 1, max_batch=4, prefill_chunk=5), hf_tokens)
    results = ranks(model_dir, hf_tokens, world, tmp_path)
    for rank, r in enumerate(results):
        assert r["layout"]["tensor_parallel_rank"] == rank
        assert (r["tokens"], r["finish"]) == (hf_tokens, "length")
        divergence, difference = kl(want_logits, r["logits"]), (r["logits"] - want_logits).abs().max().item()
        assert divergence <= 1e-6 and difference <= LOGIT_BOUND, (divergence, difference)
        (outcomes, hits, prompt_lp), (want_outcomes, want_hits, want_lp) = r["busy"], want_busy
        assert outcomes == want_outcomes and hits == want_hits
        got, want = torch.tensor([c for c, _ in prompt_lp]), torch.tensor([c for c, _ in want_lp])
        assert torch.allclose(got, want, rtol=1e-3, atol=LOGIT_BOUND), (got - want).abs().max()
        # A rank holds its shard's rings: a 1 / world share of what TP 1 holds, or more where KV heads replicate.
        split = engine(model_dir, world).layout()
        assert (r["layout"]["tensor_parallel_size"], r["layout"]["kv_bytes"]) == (world, split["kv_bytes"] // world)
        assert r["layout"]["kv_bytes"] < one.layout()["kv_bytes"]
    assert all(torch.equal(r["logits"], results[0]["logits"]) for r in results)  # the same sums on every rank


def test_a_rank_is_refused_shard_devices_and_a_rank_outside_the_group(run):
    model_dir, _ = run
    with pytest.raises(ValueError, match="tensor_parallel_rank must be in 0..2, got 2"):
        engine(model_dir, 2, tensor_parallel_rank=2, tensor_parallel_group="0")
    with pytest.raises(ValueError, match="a tensor-parallel rank holds one shard"):
        engine(model_dir, 2, tensor_parallel_rank=0, tensor_parallel_group="0", shard_devices=[torch.zeros(1)] * 2)
    with pytest.raises(ValueError, match="given together, or neither"):
        engine(model_dir, 2, tensor_parallel_rank=0)
