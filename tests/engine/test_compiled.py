"""The compiled decode step (rust/src/engine/compiled.rs, rust/python/gemma_engine/compiling.py): the Rust
model's step recorded at the dispatcher and compiled by Inductor, against the same engine run eagerly.

A captured step is replayed for other requests, slots, positions and sampling parameters than the ones it
was recorded with, so equal tokens across a busy scripted run (staggered arrivals, a seeded sampled request
with log-probabilities, a second turn resumed from the first's cache, a grammar-constrained request) are the
proof that nothing a request wrote was baked into the graph. Both engines multiply with ATen's matmul
(`onednn=False`), the path of every device but the CPU, unless a test says otherwise; over oneDNN's packed weights
a compiled engine freezes them into each graph (gemma_engine/compiling.py `_keep_packed_weights`).
"""

import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from types import SimpleNamespace

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

import gemma_engine
from gemma_engine.compiling import (StepCompiler, capture, chain_from, natural_shape, storage_swap_check,
                                     view_chain)
from tests.checkpoints.chat import CHAT_VOCAB_SIZE
from tests.checkpoints.multimodal import random_image
from tests import assistants
from tests.checkpoints.text import SEED, SMALL_LAYERS, save_dense, save_two_token, tiny_text_config
from tests.engine.test_architectures import CONFIGS
from tests.engine.test_batching import PROMPTS, Script
from tests.engine.test_speculative import PROMPTS as SPECULATED

CONTEXT = 128
# float32, compiled against eager: Inductor reorders reductions, and a capture takes ATen's RMSNorm where
# eager takes the shim's one-pass kernel (rust/src/aten.cpp). Relative past a magnitude of 1: the 31B-shaped
# models' top log-probabilities reach -25, where float32's spacing is 1.9e-6 (measured there: 1.1e-5).
LOGPROB_BOUND = 1e-5
# A compiled prompt chunk shorter than its bucket runs left-padded (rust/src/engine/chunks.rs): other matrix
# shapes, so other float32 rounding, as reading the prompt in other chunk sizes gives eagerly. On the E-series
# shape the eager engine's own log-probabilities in the busy run move by up to 9.0e-5 between prefill_chunk 4,
# 5, 6, 7 and 64 (measured); the compiled engine's, against eager at prefill_chunk 5, by 5.3e-5.
PADDED_CHUNK_BOUND = 2e-4
SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 3, "speculative_max_batch": 2}


def _close(a: float, b: float, bound: float = LOGPROB_BOUND) -> bool:
    return abs(a - b) <= bound * max(1.0, abs(b))


def _engine(model_dir, compiler=None, **kwargs) -> gemma_engine.Engine:
    kwargs = {"like": torch.zeros(1), "context": CONTEXT, "dtype": "float32", "onednn": False, **kwargs}
    return gemma_engine.Engine(str(model_dir), compiler=compiler, **kwargs)


# ----------------------------------------------------------------------------- re-making views of a storage

@pytest.mark.parametrize("make", [
    lambda b: b.narrow(0, 1, 2).narrow(1, 0, 3),      # a KV ring's rows and key heads
    lambda b: b.narrow(0, 0, 2).narrow(1, 3, 3),      # ... and its value heads
    lambda b: b[:, 2],                                 # a select
    lambda b: b.narrow(3, 1, 2),                       # the innermost dimension cut
    lambda b: b.transpose(1, 2).narrow(0, 1, 1),       # permuted
    lambda b: b.view(-1)[7:9].view(2, 1, 1),           # a reshaped contiguous piece
    lambda b: b[:, :, 0:1].expand(4, 6, 4, 5),         # expanded
    lambda b: b[3, 5, 8, 4],                           # one element
    lambda b: b,                                       # the whole
], ids=["rows-keys", "rows-values", "select", "inner", "permuted", "reshaped", "expanded", "element", "whole"])
def test_view_chain_remakes_a_view_from_its_flat_storage(make):
    base = torch.arange(4 * 6 * 9 * 5.0).reshape(4, 6, 9, 5)
    view = make(base)
    flat = base.view(-1)
    x = flat
    for name, args in view_chain(list(view.size()), list(view.stride()), view.storage_offset(), flat.numel()):
        x = getattr(x, name)(*args)
    assert x.size() == view.size() and x.storage_offset() == view.storage_offset()
    assert [s for s, n in zip(x.stride(), x.size()) if n != 1] == [s for s, n in zip(view.stride(), view.size()) if n != 1]
    assert torch.equal(view, x)
    base.mul_(-1)  # both see a write to the storage: x is a view of it, not a copy
    assert torch.equal(view, x) and x.max() <= 0


@pytest.mark.parametrize("make", [
    lambda b: b.narrow(0, 1, 2).narrow(1, 0, 3),
    lambda b: b.narrow(0, 0, 2).narrow(1, 3, 3),
    lambda b: b[:, 2],
    lambda b: b.narrow(3, 1, 2),
    lambda b: b.transpose(1, 2).narrow(0, 1, 1),
    lambda b: b[:, :, 0:1].expand(4, 6, 4, 5),
    lambda b: b,
], ids=["rows-keys", "rows-values", "select", "inner", "permuted", "expanded", "whole"])
def test_a_narrowed_view_is_remade_from_its_storage_in_the_rings_own_shape(make):
    """The KV rings' views are narrowings of the ring: they are re-made from an input of the ring's shape,
    through which Inductor writes in place (a reshaped flat storage makes it copy the whole ring)."""
    base = torch.arange(4 * 6 * 9 * 5.0).reshape(4, 6, 9, 5)
    keys = base.narrow(0, 1, 2).narrow(1, 0, 3)
    assert natural_shape(list(keys.size()), list(keys.stride()), base.numel()) == [4, 6, 9, 5]
    view = make(base)
    ops = chain_from([4, 6, 9, 5], list(view.size()), list(view.stride()), view.storage_offset())
    assert ops is not None and all(name != "view" for name, _ in ops)
    x = base
    for name, args in ops:
        x = getattr(x, name)(*args)
    assert torch.equal(x, view) and x.storage_offset() == view.storage_offset()
    assert chain_from([4, 6, 9, 5], [2, 1, 1], [1, 1, 1], 7) is not None  # a run of the innermost dimension
    assert chain_from([4, 6, 9, 5], [10], [1], 7) is None


def test_view_chain_refuses_a_layout_it_cannot_remake_naming_it():
    base = torch.zeros(64)
    with pytest.raises(ValueError, match="strides"):
        view_chain([3, 4], [2, 2], 0, base.numel())
    with pytest.raises(ValueError, match="runs past"):
        view_chain([4, 4], [16, 1], 60, 64)


def test_capture_lifts_every_tensor_the_step_did_not_create_into_an_input():
    cache = torch.zeros(2, 4, 8)
    rows = cache.narrow(0, 1, 1)  # a view made before the capture, as the engine's are
    pos = torch.tensor([3])
    weight = torch.randn(8, 8)

    def step():
        x = torch.ones(1, 4, 8) @ weight
        rows.index_put_((torch.zeros(1, dtype=torch.long), torch.arange(4), pos), x[0, :, :1].T.squeeze(0))
        pos.add_(1)
        return [x.sum(-1)]

    gm, inputs = capture(step)
    assert [n for n in gm.graph.nodes if n.op == "get_attr"] == []
    assert len([n for n in gm.graph.nodes if n.op == "placeholder"]) == len(inputs) == 3
    # The cache whole, in the shape its view narrows ([1, 4, 8] rows of 8: [8, 8]), not flat.
    assert [tuple(t.shape) for t in inputs if t.data_ptr() == cache.data_ptr()] == [(8, 8)]
    cache.zero_()
    pos.fill_(5)  # new state: the graph reads it, it was not baked in
    gm(*inputs)
    assert int(pos) == 6 and cache[1, :, 5].abs().sum() > 0 and cache[1, :, 3].abs().sum() == 0


def test_a_constant_with_no_elements_is_made_anew_in_the_graph():
    """A verify step that only records an assistant's states has drafts of shape [b, 0]: no storage to view."""
    drafts = torch.zeros(2, 0, dtype=torch.long)
    nexts = torch.tensor([5, 6])

    def step():
        return [torch.cat([nexts.reshape(2, 1), drafts], 1).sum(1)]

    gm, inputs = capture(step)
    assert [n for n in gm.graph.nodes if n.op == "get_attr"] == [] and len(inputs) == 1
    nexts.copy_(torch.tensor([7, 9]))
    assert gm(*inputs)[0].tolist() == [7, 9]


# ----------------------------------------------------------------------------- compiled = eager, busy runs

def _busy() -> dict:
    """Two greedy requests read in chunks of 5 and decoded together; a seeded sampled request with top-3
    log-probabilities queued behind them, taking the first slot to free; and, after those end, a second turn
    of the first request that resumes its cache (two slots: buckets 1 and 2)."""
    sampled = gemma_engine.SamplingParams(temperature=0.9, top_p=0.95, seed=7, logprobs=3)
    return {
        0: [gemma_engine.Request(0, PROMPTS["parity"], 24), gemma_engine.Request(1, PROMPTS["other"], 12)],
        2: [gemma_engine.Request(2, PROMPTS["short"], 16, sampling=sampled)],
        40: [gemma_engine.Request(3, PROMPTS["parity"] + PROMPTS["short"][1:], 12)],
    }


def _assert_same(eager: dict, compiled: dict, bound: float = LOGPROB_BOUND):
    for rid, want in eager.items():
        got = compiled[rid]
        assert (got.tokens, got.finish) == (want.tokens, want.finish), rid
        assert len(got.logprobs) == len(want.logprobs), rid
        for (c_got, top_got), (c_want, top_want) in zip(got.logprobs, want.logprobs):
            assert _close(c_got, c_want, bound), (rid, c_got, c_want)
            assert [t for t, _ in top_got] == [t for t, _ in top_want], rid
            assert all(_close(a, b, bound) for (_, a), (_, b) in zip(top_got, top_want)), (rid, top_got, top_want)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    """The tiny config cut to 4 layers (`SMALL_LAYERS`: sliding, full, then a KV-shared one of each): every kind
    of layer, under half the kernels to compile."""
    return save_dense(tmp_path_factory.mktemp("compiled_small"), SEED, tiny_text_config(**SMALL_LAYERS))


def _busy_run(model_dir, backend, prefill_chunk=5, bound=LOGPROB_BOUND, **kwargs) -> StepCompiler:
    """The busy script on an engine compiling with `backend` (a name, or a whole StepCompiler) and on one that does
    not: the same outcomes, every key captured once."""
    kwargs = {"max_batch": 2, "prefill_chunk": prefill_chunk, **kwargs}
    eager = Script(_busy()).run(_engine(model_dir, **kwargs), read_every=2)
    compiler = backend if isinstance(backend, StepCompiler) else StepCompiler(backend)
    engine = _engine(model_dir, compiler, **kwargs)
    script = Script(_busy())
    compiled = script.run(engine, read_every=2)
    report = engine.compile_report()
    assert report["fallbacks"] == [] and report["active"]
    # Each key ran eagerly once, was captured on its second step and replayed after that.
    assert report["captured"] == len(compiler.compiled) >= 4, compiler.compiled
    assert max(script.batch_sizes()) == 2
    assert sum(s["cache_hits"] for s in script.stats) >= len(PROMPTS["parity"]) - 1  # the second turn resumed
    _assert_same(eager, compiled, bound)
    return compiler


def test_inductor_compiled_steps_give_the_eager_tokens_and_logprobs_in_a_busy_run(small_checkpoint):
    _busy_run(small_checkpoint, "inductor")


def test_inductor_over_onednn_packed_weights_gives_the_eager_tokens_and_logprobs(small_checkpoint):
    """On the CPU the engine multiplies with oneDNN's packed weights by default: each graph keeps them as frozen
    constants (the one thing frozen), which Inductor lowers to the same oneDNN kernel, while the state it reads and
    writes stays inputs (the busy run's replays read other slots, positions and parameters)."""
    compiler = _busy_run(small_checkpoint, "inductor", onednn=True)
    for name, gm in compiler.graphs.items():
        buffers = list(gm.buffers())
        assert all(b.is_mkldnn for b in buffers), name
        # Every graph that multiplies keeps the packed weights; a step's choice (its sampling) multiplies nothing.
        choice = name.startswith("decode") and not name.endswith(" forward")
        assert bool(buffers) != choice, name


def test_prompt_chunks_padded_to_their_buckets_give_the_eager_tokens_and_logprobs(small_checkpoint):
    """Prompt chunks of 32 columns read at buckets 16 and 32 (rust/src/engine/chunks.rs): a first chunk left-padded
    (28 tokens at 32), a prompt longer than a chunk (41: 32, then 9 at 16, its sliding ring of 12 wrapped), a
    short one (9 at 16, a key seen once: run eagerly on the chunk row), and a second turn resumed from the cache
    (a later chunk at 16). Replays read other slots, positions and ring contents than the chunk they were
    captured on."""
    compiler = _busy_run(small_checkpoint, "aot_eager", prefill_chunk=32)
    chunks = {name for name, _ in compiler.compiled if name.startswith("prompt")}
    assert chunks == {"prompt t=32 first", "prompt t=16 later"}, compiler.compiled


@pytest.mark.gpu
def test_on_cuda_compiled_steps_are_replayed_as_cuda_graphs_and_give_the_eager_tokens(small_checkpoint):
    """On CUDA a compiled step's replay is captured as a CUDA graph of its own (one launch a step, as the eager
    path's graphs): the busy run through Inductor's Triton kernels gives the eager engine's tokens and
    log-probabilities, that engine's CUDA graphs included."""
    cuda = {"like": torch.zeros(1, device="cuda"), "max_batch": 2, "prefill_chunk": 5}
    eager_engine = _engine(small_checkpoint, **cuda)
    eager = Script(_busy()).run(eager_engine, read_every=2)
    compiler = StepCompiler("inductor")
    engine = _engine(small_checkpoint, compiler, **cuda)
    compiled = Script(_busy()).run(engine, read_every=2)
    report = engine.compile_report()
    assert report["fallbacks"] == [] and report["captured"] == len(compiler.compiled) >= 4, compiler.compiled
    assert eager_engine.captured_steps > 0
    assert engine.captured_steps > 0  # only compiled replays are graphs in this engine: its eager steps are not
    _assert_same(eager, compiled)


def donating_compiler_fake(gm, example_inputs, donated_inputs):
    """Stands in for a compiler that takes donated inputs (torch_tpu's StaticCompiler; no TPU here): runs the
    functional graph as written."""
    return gm.forward


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("path", ["aot_eager", "donating"])
def test_every_architectures_captured_steps_give_the_eager_tokens_in_a_busy_run(name, path, tmp_path_factory):
    """The capture on every architecture (K=V attention, the MoE block's grouped products, the 12B's unified
    layers): the graphs run by AOTAutograd's eager backend, the functionalized graph Inductor starts from (its
    kernels are the test above's; compiling each architecture's seven step shapes with Inductor would take
    minutes here), and made functional for a compiler that takes donated inputs (the TPU's path), the engine
    taking each new ring. Prompt chunks of 5 columns: the last chunk of each prompt runs padded
    (`PADDED_CHUNK_BOUND`)."""
    build, _ = CONFIGS[name]
    model_dir = save_dense(tmp_path_factory.mktemp(f"compiled_{name}"), 172, build())
    compiler = StepCompiler(donating_compiler_fake, donate=True) if path == "donating" else "aot_eager"
    _busy_run(model_dir, compiler, bound=PADDED_CHUNK_BOUND)


def test_image_prompts_batched_beside_a_text_prompt_give_the_eager_tokens_compiled(multimodal_checkpoint):
    """Media in the batch: two image prompts (their soft tokens enter at the prompt reads) decode in the same
    captured steps as a text prompt. Through AOTAutograd's eager backend, as the architectures above."""
    from transformers import AutoProcessor

    from tests.engine.test_media import chat_inputs, media_of
    from tests.engine.test_prefix_cache import serve

    d = str(multimodal_checkpoint)
    processor, encoder = AutoProcessor.from_pretrained(d), gemma_engine.Encoder(d, dtype="float32")
    images = [random_image(40, 30, 0), random_image(20, 36, 1), random_image(48, 48, 2)]
    one = chat_inputs(processor, images[:1], "What is in this picture?")
    two = chat_inputs(processor, images[1:], "Compare them.")
    one_media, two_media = media_of(encoder, one, images[:1]), media_of(encoder, two, images[1:])

    def requests():
        return [gemma_engine.Request(1, one["input_ids"][0].tolist(), 24, media=one_media),
                gemma_engine.Request(2, [2, 3, 40, 41, 42, 43, 4], 16),
                gemma_engine.Request(3, two["input_ids"][0].tolist(), 24, media=two_media)]

    kwargs = {"context": 512, "max_batch": 4}
    eager = serve(_engine(d, **kwargs), requests())
    engine = _engine(d, StepCompiler("aot_eager"), **kwargs)
    compiled = serve(engine, requests())
    assert engine.compile_report()["captured"] >= 1 and engine.compile_report()["fallbacks"] == []
    for rid in (1, 2, 3):
        assert compiled.results[rid].tokens == eager.results[rid].tokens and eager.results[rid].tokens, rid


def _compiled_rank(rank: int, port: int, model_dir: str, out_dir: str, speculating: bool = False) -> None:
    """Rank `rank` of 2 (gloo): the busy script on its shard (`speculating`: the speculating one, prompt lookup on,
    compiled by AOTAutograd's eager backend), eagerly and compiled; outcomes, the compiled graphs' names and the
    drafts kept saved."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=600))
    try:
        script, spec, backend = (_speculating, SPEC, "aot_eager") if speculating else (_busy, {}, "inductor")
        kwargs = {"max_batch": 2, "prefill_chunk": 5, "tensor_parallel_size": 2, "tensor_parallel_rank": rank,
                  "tensor_parallel_group": dist.group.WORLD.group_name, **spec}
        scripts = Script(script()), Script(script())
        eager = scripts[0].run(_engine(model_dir, **kwargs), read_every=2)
        compiler = StepCompiler(backend)
        engine = _engine(model_dir, compiler, **kwargs)
        compiled = scripts[1].run(engine, read_every=2)
        plain = {rid: SimpleNamespace(tokens=o.tokens, finish=o.finish, logprobs=o.logprobs)
                 for rid, o in {**{("eager", k): v for k, v in eager.items()},
                                **{("compiled", k): v for k, v in compiled.items()}}.items()}
        kept = [sum(s.get("spec_accepted_tokens", 0) for s in sc.stats) for sc in scripts]
        torch.save({"outcomes": plain, "report": engine.compile_report(), "kept": kept,
                    "graphs": [name for name, _ in compiler.compiled]}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _ranks(model_dir, out, speculating: bool = False) -> list[dict]:
    """What each of two ranks (`_compiled_rank`, a spawned process each) saved."""
    import torch.multiprocessing as mp

    from tests.engine.test_tensor_parallel import _free_port

    mp.spawn(_compiled_rank, args=(_free_port(), str(model_dir), str(out), speculating), nprocs=2, join=True)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def _split(outcomes: dict) -> tuple[dict, dict]:
    """A rank's saved outcomes as (eager, compiled)."""
    return tuple({rid: o for (kind, rid), o in outcomes.items() if kind == want} for want in ("eager", "compiled"))


def test_tensor_parallel_ranks_give_the_eager_tokens_compiled(small_checkpoint, tmp_path):
    """Two ranks (gloo, a process each): each rank's captured step holds its shard's work and the
    `_c10d_functional` all-reduces and all-gather the Rust model calls; its tokens and log-probabilities are the
    eager rank's, and the tokens the unsplit engine's."""
    unsplit = Script(_busy()).run(_engine(small_checkpoint, max_batch=2, prefill_chunk=5), read_every=2)
    for saved in _ranks(small_checkpoint, tmp_path):
        report = saved["report"]
        assert report["captured"] >= 4 and report["fallbacks"] == [], report
        eager, compiled = _split(saved["outcomes"])
        _assert_same(eager, compiled)
        assert {rid: r.tokens for rid, r in compiled.items()} == {rid: r.tokens for rid, r in unsplit.items()}


def test_tensor_parallel_ranks_speculating_give_the_eager_tokens_compiled(two_token_small, tmp_path):
    """Speculative decoding on two ranks: each rank's captured verify forward holds its shard's work and its
    collectives, its checks choose from the gathered logits; both ranks keep the same drafts as their eager runs,
    with the eager rank's tokens and log-probabilities and the unsplit engine's tokens."""
    kwargs = {"max_batch": 2, "prefill_chunk": 5, **SPEC}
    unsplit = Script(_speculating()).run(_engine(two_token_small, **kwargs), read_every=2)
    kept = []
    for saved in _ranks(two_token_small, tmp_path, speculating=True):
        assert saved["report"]["fallbacks"] == [], saved["report"]
        verify = {name for name in saved["graphs"] if name.startswith("verify")}
        forwards = {name for name in verify if name.endswith(" forward")}
        assert forwards and verify - forwards, saved["graphs"]
        eager, compiled = _split(saved["outcomes"])
        _assert_same(eager, compiled)
        assert {rid: r.tokens for rid, r in compiled.items()} == {rid: r.tokens for rid, r in unsplit.items()}
        kept.append(saved["kept"])
    assert kept[0] == kept[1] and kept[0][0] == kept[0][1] > 0, kept


def test_a_seeded_request_draws_the_same_tokens_on_replayed_steps_as_alone_eagerly(small_checkpoint):
    """Sampling parameters are step inputs: two seeded requests with other temperatures and seeds replay the
    graphs a first one's steps compiled."""
    def run(engine, seed, temperature):
        params = gemma_engine.SamplingParams(temperature=temperature, top_k=40, seed=seed)
        return engine.decode(PROMPTS["parity"], 24, sampling=params)[0]

    compiled = _engine(small_checkpoint, StepCompiler("inductor"))
    eager = _engine(small_checkpoint)
    settings = [(1, 2.0), (2, 4.0), (3, 8.0)]  # hot enough that the random model's draws differ
    firsts = [run(compiled, seed, t) for seed, t in settings]
    assert compiled.compile_report()["captured"] >= 1
    assert firsts == [run(eager, seed, t) for seed, t in settings]
    assert len(set(map(tuple, firsts))) == 3


def test_one_step_shape_serves_every_top_logprobs_count(small_checkpoint):
    """A step computes the top `max_top_logprobs` for every request that asks for log-probabilities, each taking its
    own first k: requests with top 1, then top 5 and 0, replay the shapes the first one's steps compiled, and each
    gets the eager engine's k entries."""
    def script(rid, top, prompt):
        sampling = gemma_engine.SamplingParams(logprobs=top)
        return Script({0: [gemma_engine.Request(rid, PROMPTS[prompt], 8, sampling=sampling)]})

    runs = [(0, 1, "parity"), (1, 5, "other"), (2, 0, "short")]
    compiler = ReplayCountingCompiler("aot_eager")
    compiled, eager = _engine(small_checkpoint, compiler), _engine(small_checkpoint)
    first = script(*runs[0]).run(compiled, read_every=2)
    shapes = [name for name, _ in compiler.compiled]
    choices = [name for name in shapes if name.startswith("decode") and not name.endswith(" forward")]
    assert choices and all(name.endswith(" logprobs20") for name in choices), shapes
    replayed = sum(compiler.replays.values())
    outcomes = {**first, **{rid: script(rid, top, p).run(compiled, read_every=2)[rid] for rid, top, p in runs[1:]}}
    assert [name for name, _ in compiler.compiled] == shapes, "no shape compiled for another k"
    assert sum(compiler.replays.values()) > replayed
    _assert_same({rid: script(rid, top, p).run(eager, read_every=2)[rid] for rid, top, p in runs}, outcomes)
    assert [{len(top) for _, top in outcomes[rid].logprobs} for rid, _, _ in runs] == [{1}, {5}, {0}]


def test_a_step_with_new_sampling_stages_replays_its_buckets_compiled_forward(small_checkpoint):
    """Steps that differ only in their sampling stages share the forward: once a greedy request's steps compiled
    bucket 1's forwards, a request with a logit bias, a repetition penalty and log-probabilities compiles only its
    choices (the small graphs), replays those forwards, and gets the eager engine's tokens and log-probabilities."""
    def script(rid, prompt, sampling=None):
        return Script({0: [gemma_engine.Request(rid, PROMPTS[prompt], 8, sampling=sampling)]})

    compiler = ReplayCountingCompiler("aot_eager")
    compiled, eager = _engine(small_checkpoint, compiler), _engine(small_checkpoint)
    outcomes = script(0, "parity").run(compiled, read_every=2)
    forwards = [name for name, _ in compiler.compiled if name.endswith(" forward")]
    assert forwards == ["decode b=1 forward", "decode b=1 padded forward"], compiler.compiled
    replayed, before = sum(compiler.replays[n] for n in forwards), len(compiler.compiled)

    biased = gemma_engine.SamplingParams(logit_bias={5: 3.0}, repetition_penalty=1.5, logprobs=2)
    outcomes.update(script(1, "other", biased).run(compiled, read_every=2))
    new = [name for name, _ in compiler.compiled[before:] if name.startswith("decode")]
    assert new == ["decode b=1 bias+repetition+logprobs20", "decode b=1 padded bias+repetition+logprobs20"], new
    assert sum(compiler.replays[n] for n in forwards) > replayed
    assert compiled.compile_report()["fallbacks"] == []
    want = {**script(0, "parity").run(eager, read_every=2), **script(1, "other", biased).run(eager, read_every=2)}
    _assert_same(want, outcomes)


def test_grammar_constrained_requests_give_the_eager_tokens_compiled(small_chat_checkpoint):
    from tests.engine.test_grammar import EOS, SCHEMA, STRICT

    grammars = gemma_engine.Grammars(str(small_chat_checkpoint / "tokenizer.json"), EOS, CHAT_VOCAB_SIZE)
    tok = Tokenizer.from_file(str(small_chat_checkpoint / "tokenizer.json"))
    prompt = tok.encode("<start_of_turn>user\nAnswer in JSON.<end_of_turn>\n<start_of_turn>model\n").ids
    requests = lambda: {0: [gemma_engine.Request(0, prompt, 96, grammar=STRICT),  # noqa: E731
                            gemma_engine.Request(1, prompt[:-3], 24)]}
    kwargs = {"context": 256, "grammars": grammars, "max_batch": 2}
    eager = Script(requests()).run(_engine(small_chat_checkpoint, **kwargs))
    engine = _engine(small_chat_checkpoint, StepCompiler("inductor"), **kwargs)
    compiled = Script(requests()).run(engine)
    assert engine.compile_report()["fallbacks"] == []
    _assert_same(eager, compiled)
    jsonschema.validate(json.loads(tok.decode(compiled[0].tokens)), SCHEMA)


# ----------------------------------------------------------------------------- fallback, switching, backends

def failing_backend_fake(gm, example_inputs):
    """A fake backend: refuses every graph, as a compiler that cannot lower an op does."""
    raise RuntimeError("this fake backend compiles nothing")


def test_a_capture_that_fails_runs_eagerly_and_says_why(small_checkpoint):
    compiler = StepCompiler(failing_backend_fake)
    engine = _engine(small_checkpoint, compiler)
    tokens = engine.decode(PROMPTS["parity"], 16)[0]
    assert tokens == _engine(small_checkpoint).decode(PROMPTS["parity"], 16)[0]
    report = engine.compile_report()
    assert report["captured"] == 0
    # Both halves of the step: its forward and its choice.
    assert [step for step, _ in report["fallbacks"]] == ["decode b=1 forward", "decode b=1 greedy"]
    assert all("this fake backend compiles nothing" in reason for _, reason in report["fallbacks"]), report


def syncing_backend_fake(gm, example_inputs):
    """A fake backend whose compiled step reads a value back to the host at every call (as a kernel that sizes
    its output from data would): it runs, but cannot be captured as a CUDA graph."""
    def run(*args):
        out = gm(*args)
        float(args[0].sum())  # refused while the stream captures
        return out

    return run


@pytest.mark.gpu
def test_on_cuda_a_compiled_step_whose_cuda_graph_fails_replays_without_one_and_says_why(small_checkpoint):
    cuda = {"like": torch.zeros(1, device="cuda")}
    compiler = StepCompiler(syncing_backend_fake)
    engine = _engine(small_checkpoint, compiler, **cuda)
    tokens = engine.decode(PROMPTS["parity"], 16)[0]
    assert tokens == _engine(small_checkpoint, **cuda).decode(PROMPTS["parity"], 16)[0]
    report = engine.compile_report()
    assert report["captured"] == 1 and engine.captured_steps == 0
    [(step, reason)] = report["fallbacks"]
    assert step == "decode b=1 greedy (CUDA graph)" and "captur" in reason, reason
    assert compiler.fallbacks == [(step, reason)]  # the hook was told: its log line and metric


def test_a_compiling_engine_holds_one_more_row_of_rings_for_its_prompt_chunks(small_checkpoint):
    eager = _engine(small_checkpoint, max_batch=2, prefill_chunk=40)
    compiled = _engine(small_checkpoint, StepCompiler("aot_eager"), max_batch=2, prefill_chunk=40)
    e, c = eager.layout(), compiled.layout()
    assert c["kv_bytes_per_slot"] == e["kv_bytes_per_slot"]
    assert c["kv_bytes"] == e["kv_bytes"] + e["kv_bytes_per_slot"] - e["snapshot_bytes_per_slot"]  # no snapshots
    assert (eager.chunk_buckets, compiled.chunk_buckets) == ([], [16, 32, 40])


def test_chunks_that_score_their_prompt_run_eagerly_and_the_rest_compiled(small_checkpoint):
    """Prompt log-probabilities need every position's hidden state, not a compiled chunk's last logits: such
    chunks run as without a compiler (rust/src/engine/chunks.rs), and give the eager engine's values."""
    def run(engine, scored):
        requests = [gemma_engine.Request(k, PROMPTS["long"][: 30 + k], 2, prompt_logprobs=1 if scored else None)
                    for k in range(2)]
        return Script({0: requests[:1], 6: requests[1:]}).run(engine)

    kwargs = {"max_batch": 1, "prefill_chunk": 16, "prefix_caching": False}  # each prompt read from its start
    compiler = StepCompiler("aot_eager")
    engine = _engine(small_checkpoint, compiler, **kwargs)
    want = run(_engine(small_checkpoint, **kwargs), True)
    got = run(engine, True)
    assert not [name for name, _ in compiler.compiled if name.startswith("prompt")], compiler.compiled
    for rid, w in want.items():
        assert got[rid].tokens == w.tokens and len(got[rid].prompt_logprobs) == len(w.prompt_logprobs) == 29 + rid
        assert all(_close(a, b) for (a, _), (b, _) in zip(got[rid].prompt_logprobs, w.prompt_logprobs))
    run(engine, False)
    assert {name for name, _ in compiler.compiled if name.startswith("prompt")} == {
        "prompt t=16 first", "prompt t=16 later"}, compiler.compiled


def test_use_compiled_switches_between_replays_and_eager_steps(small_checkpoint):
    engine = _engine(small_checkpoint, StepCompiler("inductor"))
    want = engine.decode(PROMPTS["parity"], 12)[0]
    engine.use_compiled(False)
    assert engine.compile_report()["active"] is False
    assert engine.decode(PROMPTS["parity"], 12)[0] == want
    engine.use_compiled(True)
    assert engine.decode(PROMPTS["parity"], 12)[0] == want
    with pytest.raises(ValueError, match="no compiler"):
        _engine(small_checkpoint).use_compiled(True)
    assert _engine(small_checkpoint).compile_report() is None


def test_use_compiled_per_bucket_runs_that_buckets_steps_without_the_replays(small_checkpoint):
    """`--compile auto` keeps the faster way per bucket: a bucket switched off runs as without a compiler (no replay
    is called), the others replay, and the tokens stay the same."""
    calls = []

    def counting_backend_fake(gm, example_inputs):
        def run(*args):
            calls.append(1)
            return gm(*args)

        return run

    # Without prefix caching each request takes slot 0 (with it, a repeated prompt may take another slot).
    engine = _engine(small_checkpoint, StepCompiler(counting_backend_fake), max_batch=2, prefix_caching=False)
    want = engine.decode(PROMPTS["parity"], 12)[0]  # one request in slot 0: bucket 1
    replayed = len(calls)
    assert replayed > 0
    engine.use_compiled(False, 1)
    report = engine.compile_report()
    assert report["eager_buckets"] == [1] and report["active"] is True
    assert engine.decode(PROMPTS["parity"], 12)[0] == want and len(calls) == replayed
    engine.use_compiled(True, 1)
    assert engine.decode(PROMPTS["parity"], 12)[0] == want and len(calls) > replayed
    assert engine.compile_report()["eager_buckets"] == []
    with pytest.raises(ValueError, match=r"bucket 3 is not one of this engine's buckets \[1, 2\]"):
        engine.use_compiled(False, 3)


def test_every_backend_is_handed_the_same_graph(small_checkpoint):
    """torch_tpu's `tpu` backend takes what Inductor takes: one graph of ATen ops, every tensor an input.
    A fake recording backend stands in for it here (no TPU)."""
    handed = {"graphs": [], "inputs": []}

    def recording_backend_fake(gm, example_inputs):
        handed["graphs"].append(gm.code)
        handed["inputs"] += example_inputs
        return gm.forward

    inductor, recording = StepCompiler("inductor"), StepCompiler(recording_backend_fake)
    recorded = _engine(small_checkpoint, recording).decode(PROMPTS["parity"], 4)[0]
    assert [name for name, _ in recording.compiled] == ["decode b=1 forward", "decode b=1 greedy"]
    assert _engine(small_checkpoint, inductor).decode(PROMPTS["parity"], 4)[0] == recorded
    assert [name for name, _ in inductor.compiled] == [name for name, _ in recording.compiled]
    assert [inductor.graphs[name].code for name, _ in inductor.compiled] == handed["graphs"]
    # Each input is a whole storage (weights, rings, slot and sampler tables), contiguous from its start.
    assert all(t.is_contiguous() and t.storage_offset() == 0 and t.numel() * t.element_size()
               == t.untyped_storage().nbytes() for t in handed["inputs"])


def test_a_donating_compiler_is_handed_a_graph_that_writes_nothing_and_the_engine_gets_the_new_rings(
        small_checkpoint, monkeypatch):
    """`StepCompiler(donate=True)`, the path to torch_tpu's StaticCompiler with donated inputs (no TPU here: a fake
    that records what it is handed and runs the graph as written stands in). The graph writes none of its inputs and
    returns the new value of each input it wrote after the step's outputs, those inputs donated; each replay swaps
    the new values' memory into the engine's own tensors (`adopt_storage_`, no copy), and a busy run gives the eager
    tokens and log-probabilities."""
    handed, adopted = [], []

    def recording_donating_compiler_fake(gm, example_inputs, donated_inputs):
        handed.append((gm, list(example_inputs), list(donated_inputs)))
        return gm.forward

    def counted(dst, src):
        adopted.append(dst)
        adopt(dst, src)

    adopt = gemma_engine.adopt_storage_
    monkeypatch.setattr(gemma_engine, "adopt_storage_", counted)
    compiler = _busy_run(small_checkpoint, StepCompiler(recording_donating_compiler_fake, donate=True))
    assert len(handed) == len(compiler.compiled)
    for gm, inputs, donated in handed:
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        assert donated and not any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
                                   for n in calls), gm.code
        returned = gm.graph.find_nodes(op="output")[0].args[0][-len(donated):]
        assert [tuple(n.meta["val"].shape) for n in returned] == [tuple(inputs[i].shape) for i in donated]
    # Each replay gave the engine the new values of exactly the inputs its graph donated.
    donated_inputs = [inputs[i] for _, inputs, donated in handed for i in donated]
    assert adopted and all(any(dst is t for t in donated_inputs) for dst in adopted)


def test_a_storage_takes_another_ones_memory_and_its_views_follow():
    """`adopt_storage_`, how a donating compiler's new rings reach the engine: a view made before reads the new
    values, the other tensor the old memory; `storage_swap_check` finds that it works here and names what fails on
    a device where it cannot."""
    ring = torch.zeros(4, 3)
    view = ring[1]
    new = torch.arange(12.0).reshape(4, 3).clone()
    gemma_engine.adopt_storage_(ring, new)
    assert view.tolist() == [3.0, 4.0, 5.0] and new.sum().item() == 0
    for dst, src, message in [(ring, torch.zeros(3, 4), r"\[3, 4\] float on cpu is not \[4, 3\] float on cpu"),
                              (ring, torch.zeros(4, 3, dtype=torch.float64), "double on cpu is not"),
                              (ring[:2], torch.zeros(2, 3), "not all of its storage"),
                              (ring, torch.zeros(8, 3)[::2], "not all of its storage")]:
        with pytest.raises(RuntimeError, match=message):
            gemma_engine.adopt_storage_(dst, src)
    assert storage_swap_check("cpu") is None
    assert storage_swap_check("meta").startswith("swapping storages failed: ")


class StaticCompilerFake:
    """Stands in for torch_tpu 0.2.0's `torch_tpu._internal.compile.compiler.StaticCompiler` (no TPU here), with its
    `__call__` signature; records what it is handed and runs the graph as written."""

    handed: list = []

    def __call__(self, graph_module, example_inputs, is_fwd=True, bounds=None, argument_layouts=None,
                 dynamic_outputs=None, donated_inputs=None, module_name=None):
        StaticCompilerFake.handed.append((graph_module, donated_inputs))
        return graph_module.forward


def test_on_a_tpu_the_functional_step_goes_to_torch_tpus_static_compiler_with_its_written_inputs_donated(
        small_checkpoint, monkeypatch):
    """`StepCompiler("tpu", donate=True)`, the server's choice on a TPU: torch_tpu's StaticCompiler (a fake module
    here) is handed the functional step and the inputs it writes as donated; the tokens are the eager engine's."""
    from types import ModuleType

    fake = ModuleType("torch_tpu._internal.compile.compiler")
    fake.StaticCompiler = StaticCompilerFake
    monkeypatch.setitem(sys.modules, "torch_tpu._internal.compile.compiler", fake)
    monkeypatch.setattr(StaticCompilerFake, "handed", [])
    compiler = StepCompiler("tpu", donate=True)
    eager = _engine(small_checkpoint).decode(PROMPTS["parity"], 6)[0]
    assert _engine(small_checkpoint, compiler).decode(PROMPTS["parity"], 6)[0] == eager
    assert compiler.fallbacks == [] and len(StaticCompilerFake.handed) == len(compiler.compiled) >= 1
    for gm, donated in StaticCompilerFake.handed:
        placeholders = gm.graph.find_nodes(op="placeholder")
        returned = gm.graph.find_nodes(op="output")[0].args[0][-len(donated):]
        assert donated and [n.meta["val"].shape for n in returned] == [placeholders[i].meta["val"].shape
                                                                       for i in donated]


def test_donating_refuses_a_backend_that_takes_no_donated_inputs(small_checkpoint):
    compiler = StepCompiler("inductor", donate=True)
    _engine(small_checkpoint, compiler).decode(PROMPTS["parity"], 3)
    assert compiler.fallbacks and all("takes no donated inputs" in reason for _, reason in compiler.fallbacks)


# ----------------------------------------------------------------------------- verify steps (speculative decoding)

@dataclass
class ReplayCountingCompiler(StepCompiler):
    """The engine's compiler hook, counting each compiled step's replays by name (the engine replays without
    telling; a count is how a test sees that a key ran compiled, not eagerly)."""

    replays: Counter = field(default_factory=Counter)

    def __call__(self, name, run):
        replay = super().__call__(name, run)

        def counted():
            self.replays[name] += 1
            return replay()

        return counted


@pytest.fixture(scope="module")
def two_token_small(small_checkpoint, tmp_path_factory):
    """The small checkpoint made a two-token target (tests/checkpoints/text.py `save_two_token`): its drafts are
    often kept and often not, so every path of a verify step runs."""
    return save_two_token(small_checkpoint, tmp_path_factory.mktemp("compiled_two_token") / "model")


def _speculating() -> dict:
    """Two greedy requests whose prompts repeat themselves (the lookup finds drafts), the first short, so the second
    decodes alone in the bucket of two for a while (padded verify steps); then a seeded sampled one with top-3
    log-probabilities."""
    sampled = gemma_engine.SamplingParams(temperature=0.9, top_p=0.95, seed=7, logprobs=3)
    R = gemma_engine.Request
    return {0: [R(0, SPECULATED[0], 8), R(1, SPECULATED[1], 48)], 14: [R(2, SPECULATED[2], 32, sampling=sampled)]}


def _verify_run(model_dir, compiler, prepare=lambda engine: None, **spec) -> dict[str, int]:
    """The speculating script on an engine that compiles with `compiler` (after `prepare(engine)`) and one that does
    not, which must give the same outcomes and keep drafts; the replays of each verify key."""
    kwargs = {"max_batch": 2, **spec}
    eager = Script(_speculating())
    eager_out = eager.run(_engine(model_dir, **kwargs), read_every=2)
    engine = _engine(model_dir, compiler, **kwargs)
    prepare(engine)
    script = Script(_speculating())
    compiled = script.run(engine, read_every=2)
    assert engine.compile_report()["fallbacks"] == []
    _assert_same(eager_out, compiled)
    kept = sum(s.get("spec_accepted_tokens", 0) for s in script.stats)
    assert kept == sum(s.get("spec_accepted_tokens", 0) for s in eager.stats) > 0, "drafts were kept"
    return {name: n for name, n in compiler.replays.items() if name.startswith("verify")}


def test_verify_steps_replayed_compiled_give_the_eager_tokens_and_logprobs(two_token_small):
    """Prompt-lookup drafts (rust/src/engine/verify.rs): the drafts and offers are copied into the key's own buffers
    before each replay, so replays read other drafts, slots and positions than the step they were captured on."""
    compiler = ReplayCountingCompiler("aot_eager")
    verified = _verify_run(two_token_small, compiler, **SPEC)
    assert verified and all(n > 0 for n in verified.values()), compiler.replays
    assert any("padded" in name for name in verified) and any("padded" not in name for name in verified), verified


def test_an_assistants_verify_steps_replayed_compiled_give_the_eager_tokens(small_checkpoint, two_token_small,
                                                                              tmp_path_factory):
    """MTP drafts (rust/src/engine/drafter.rs): the graph also returns every position's hidden state and the drafts
    kept, from which the drafter keeps the states it drafts from next. Compiled ahead (`compile_verify`), with the
    steps that only record the assistant's states."""
    root = tmp_path_factory.mktemp("compiled_assistants")
    random = assistants.save_assistant(root / "random", target=tiny_text_config(**SMALL_LAYERS))
    drafter = assistants.save_two_token_assistant(random, two_token_small, root / "two_token")
    compiler = ReplayCountingCompiler("aot_eager")
    spec = {**SPEC, "speculative_method": "mtp", "speculative_model": str(drafter)}
    ahead: list[str] = []
    verified = _verify_run(two_token_small, compiler, partial(_compile_verify_ahead, compiler, ahead), **spec)
    assert verified and all(name.endswith(("hidden", "hidden forward")) for name in verified), verified
    # compile_verify ahead: every key's step with 3 drafts and the one that only records the assistant's states,
    # the forward of each shared by its greedy and sampled checks.
    shapes = [f"b={b} k={k}{padded}" for k in (3, 0) for b, padded in ((1, ""), (2, ""), (2, " padded"))]
    keys = {f"verify {shape} {stages} hidden" for stages in ("greedy", "draw+logprobs20") for shape in shapes}
    assert set(ahead) == keys | {f"verify {shape} hidden forward" for shape in shapes}, ahead
    assert [name for name, _ in compiler.compiled if name.startswith("verify")] == ahead, "none compiled later"


def test_verify_steps_compiled_by_inductor_give_the_eager_tokens(two_token_small):
    """One request, so few keys to compile: Inductor's code for a verify step = the eager step."""
    compiler = ReplayCountingCompiler("inductor")
    eager = _engine(two_token_small, max_batch=1, **SPEC).decode(SPECULATED[0], 32)[0]
    engine = _engine(two_token_small, compiler, max_batch=1, **SPEC)
    assert engine.decode(SPECULATED[0], 32)[0] == eager
    assert engine.compile_report()["fallbacks"] == []
    assert compiler.replays["verify b=1 k=3 forward"] > 0 and compiler.replays["verify b=1 k=3 greedy"] > 0, \
        compiler.replays


def test_a_verify_step_with_new_sampling_stages_replays_its_compiled_forward(two_token_small):
    """Verify steps that differ only in their sampling stages share the forward over the drafts: once a greedy
    request's verify steps compiled bucket 1's, a request with a logit bias and a repetition penalty compiles only
    its checks, replays that forward, and gets the eager engine's tokens."""
    def script(rid, prompt, sampling=None):
        return Script({0: [gemma_engine.Request(rid, SPECULATED[prompt], 24, sampling=sampling)]})

    compiler = ReplayCountingCompiler("aot_eager")
    compiled, eager = _engine(two_token_small, compiler, max_batch=1, **SPEC), _engine(two_token_small, **SPEC)
    outcomes = script(0, 0).run(compiled, read_every=2)
    verify = [name for name, _ in compiler.compiled if name.startswith("verify")]
    assert verify == ["verify b=1 k=3 forward", "verify b=1 k=3 greedy"], compiler.compiled
    replayed, before = compiler.replays["verify b=1 k=3 forward"], len(compiler.compiled)

    biased = gemma_engine.SamplingParams(logit_bias={5: 3.0}, repetition_penalty=1.5)
    outcomes.update(script(1, 1, biased).run(compiled, read_every=2))
    new = [name for name, _ in compiler.compiled[before:] if name.startswith("verify")]
    assert new == ["verify b=1 k=3 bias+repetition"], new
    assert compiler.replays["verify b=1 k=3 forward"] > replayed
    assert compiler.replays["verify b=1 k=3 bias+repetition"] > 0, compiler.replays
    assert compiled.compile_report()["fallbacks"] == []
    want = {**script(0, 0).run(eager, read_every=2), **script(1, 1, biased).run(eager, read_every=2)}
    _assert_same(want, outcomes)


def test_grammar_constrained_verify_steps_replayed_compiled_give_the_eager_tokens(chat_checkpoint, tmp_path_factory):
    """Constrained rows' masks, one a position made on the host after the drafts before it, are the third input
    copied into a key's buffers; the two-token chat checkpoint keeps most drafts of a repeating JSON array."""
    from tests.engine.test_speculative_constrained import EOS, _grammar_script

    two_token = save_two_token(chat_checkpoint, tmp_path_factory.mktemp("compiled_chat_two_token") / "model")
    grammars = gemma_engine.Grammars(str(chat_checkpoint / "tokenizer.json"), EOS, CHAT_VOCAB_SIZE)
    tok = Tokenizer.from_file(str(chat_checkpoint / "tokenizer.json"))
    prompt = tok.encode("<start_of_turn>user\nList colours in JSON.<end_of_turn>\n<start_of_turn>model\n").ids
    kwargs = {"context": 256, "grammars": grammars, "max_batch": 4, **SPEC, "speculative_max_batch": 4}
    eager = Script(_grammar_script(prompt)).run(_engine(two_token, **kwargs))
    compiler = ReplayCountingCompiler("aot_eager")
    engine = _engine(two_token, compiler, **kwargs)
    compiled = Script(_grammar_script(prompt)).run(engine)
    assert engine.compile_report()["fallbacks"] == []
    _assert_same(eager, compiled)
    constrained = {n: c for n, c in compiler.replays.items() if n.startswith("verify") and "grammar" in n}
    assert constrained and all(c > 0 for c in constrained.values()), compiler.replays
    forwards = {n: c for n, c in compiler.replays.items() if n.startswith("verify") and n.endswith(" forward")}
    assert forwards and all(c > 0 for c in forwards.values()), compiler.replays


def _compile_verify_ahead(compiler: StepCompiler, ahead: list[str], engine: gemma_engine.Engine) -> None:
    """`compile_verify` in buckets 1 and 2, greedy and as `_speculating`'s sampled request samples; the verify steps
    it compiled, into `ahead`."""
    sampled = gemma_engine.SamplingParams(temperature=0.9, top_p=0.95, seed=7, logprobs=3)
    for sampling in (None, sampled):
        for b in (1, 2):
            assert engine.compile_verify([[3 + i, 5, 7, 11] for i in range(b)], sampling) is True
    ahead.extend(name for name, _ in compiler.compiled if name.startswith("verify"))


def test_compile_verify_compiles_the_verify_steps_serving_meets_before_it_meets_them(two_token_small):
    """`compile_verify` (rust/src/engine/tuning.rs) runs made-up verify steps in a bucket under the caller's sampling,
    every row live and then with the first row cancelled: the keys the speculating script meets (greedy and sampled
    with log-probabilities, bucket 2 with and without padding, bucket 1) are all compiled before it runs, it compiles
    no verify step of its own, replays them and gives the eager outcomes."""
    compiler = ReplayCountingCompiler("aot_eager")
    ahead: list[str] = []
    verified = _verify_run(two_token_small, compiler, partial(_compile_verify_ahead, compiler, ahead), **SPEC)
    shapes = [f"b={b} k=3{padded}" for b, padded in ((1, ""), (2, ""), (2, " padded"))]
    keys = {f"verify {shape} {stages}" for stages in ("greedy", "draw+logprobs20") for shape in shapes}
    keys |= {f"verify {shape} forward" for shape in shapes}
    assert set(ahead) == keys, ahead
    assert [name for name, _ in compiler.compiled if name.startswith("verify")] == ahead, "none compiled later"
    assert verified and set(verified) <= keys and all(n > 0 for n in verified.values()), verified
    assert any("padded" in name for name in verified) and any("draw" in name for name in verified), verified


def test_verify_steps_compiled_with_their_written_rings_donated_give_the_eager_tokens(two_token_small):
    """The donating path (`StepCompiler(donate=True)`, torch_tpu's StaticCompiler on a TPU; here a fake that runs
    the functional graph as written) on verify steps: their rings, slots and sampler state come back as new values
    the engine takes in place of its own, padded keys and unpadded."""
    compiler = ReplayCountingCompiler(donating_compiler_fake, donate=True)
    verified = _verify_run(two_token_small, compiler, **SPEC)
    assert verified and all(n > 0 for n in verified.values()), compiler.replays
    assert any("padded" in name for name in verified) and any("padded" not in name for name in verified), verified


def test_speculation_costs_on_a_compiling_engine_time_replays(two_token_small):
    """The warmup's measurement of plain and verify steps (rust/src/engine/tuning.rs) first runs each kind's keys
    until they are captured, so every timed step is a replay: none of a capture's or a compile's time is in it."""
    compiler = ReplayCountingCompiler("aot_eager")
    engine = _engine(two_token_small, compiler, max_batch=1, **SPEC)
    turns = 3
    # Its requests hold 8 prompt tokens and 3 + 2 a turn, two warming rounds among them.
    assert engine.speculation_turns == (CONTEXT - 10) // 5 - 2 == _engine(two_token_small, **SPEC).speculation_turns - 2
    costs = engine.speculation_costs(1, turns)
    assert costs["bucket"] == 1 and costs["plain_s"] > 0 and costs["verify_s"] > 0

    def replayed(kind, forward=False):
        return sum(n for name, n in compiler.replays.items()
                   if name.startswith(kind) and name.endswith(" forward") == forward)

    # A timed step replays its forward and its choice (a verify step's checks).
    kinds = (replayed("decode", True), replayed("decode"), replayed("verify", True), replayed("verify"))
    assert kinds == (turns,) * 4, compiler.replays
