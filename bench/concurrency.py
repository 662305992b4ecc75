"""Batching through the server: `python -m bench.server --concurrency 1,2,4,8,16` (bench/server.py parses the
flags and calls `main` here).

In one run, on a random checkpoint of bench/engine.py's "small" config (hidden 512, 8 layers, vocab 8192;
written once to a temporary directory with a word-level tokenizer whose every id decodes to one word),
float32 on the CPU, greedy:

1. Concurrency. `python -m gemma_server` in a subprocess with `--max-num-seqs` = the largest C and
   `--context` = prompt + max_tokens. For each C, C streamed /v1/completions through the openai SDK
   (`AsyncOpenAI`, one event loop) start together, each with its own token-id prompt of the same length.
   Aggregate tokens/s = all completion tokens / (last stream's end - first request sent); TTFT = request
   sent -> first content chunk; inter-token = the gaps between a stream's content chunks, a chunk of k
   tokens (the server coalesces batches a slow client has not read yet) counting as k gaps of gap/k.
   Percentiles are per round; the table shows their medians over the rounds (the C values alternate
   within each round, so load on the machine hits them alike).
   Beside it, at the `--compare-at` levels (default 1 and 8), "engine": the same prompts submitted at once to
   `gemma_engine.Engine.run` in this process (max_batch = the largest C, read_every 1), tokens / seconds of
   the call: the batching gain without HTTP and the client; and from the engine's own stats, the median
   time of a turn that is one decode step of 1 (and of 8) rows and no prompt chunk, set against the floor.
2. Transformers at the `--compare-at` batch sizes, on the same weights, device, dtype and threads:
   `generate_batch` (its continuous-batching manager) when the installed version runs it on this model, else
   batched `generate` with a static cache (`disable_compile`, eager as our engine is); the table says which
   and why. tokens/s = batch x new tokens / seconds of the call, the same prompts and lengths.
3. The floor: the decode step's matrix products alone (every nn.Linear of the model, lm_head included, at
   its weight's shape) at 1 and at 8 rows, on 1 and 2 torch threads (and --threads); the fastest of 7
   repeats, since a floor is what the kernels can do and a shared machine only slows them. It is measured
   on ATen's kernels (Transformers') and, where the engine uses them (CPU, float32), on oneDNN's over
   weights packed once (rust/src/gemma4/linear.rs). 8 x time(1 row) / time(8 rows) is the most that 8
   streams can gain over one on those kernels; the goal line compares with the ratio of the engine's
   kernels at the server's thread count.
4. The longest gap a running stream sees while a long prompt is read: one stream decodes, then a request
   with a `--long-prompt`-token prompt arrives (max_tokens 1, so its TTFT is the read). Per
   `--gap-chunks` value the server is restarted with that `--prefill-chunk`; a chunk >= the prompt reads it
   in one forward (how an engine without chunked prefill reads it), smaller ones interleave chunks with the
   running stream's decode steps. The longest gap is the largest gap between the running stream's chunks
   that overlaps the read; its steady gap is the median before the long request was sent.

Goals (CPU, small config, float32): aggregate at 8 >= 2.5x aggregate at 1,
which is >= 80 % of the floor ratio, and >= 1.5x Transformers' batching at 8.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from bench.demo import pick_port, stop_server
from bench.engine import make_config, matvec_floor_runner, random_model
from bench.server import start_server, wait_healthy

MODEL = "bench"


def write_word_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` words "t0".."t{n-1}", no special tokens: every id the random
    model emits decodes to one non-empty word, so the server streams one chunk per token and a chunk's
    token count is its word count."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config) + "\n")


def prompt_ids(n: int, salt: int, vocab: int) -> list[int]:
    """A deterministic prompt of `n` ids, different for each `salt`."""
    return [(37 * i + 1009 * salt + 11) % (vocab - 3) + 3 for i in range(n)]


# --- 1 and 4: streams through the server -------------------------------------------------------------


@dataclass
class Stream:
    """One streamed completion as the client saw it: send time, (arrival, tokens) per content chunk."""

    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    completion_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.sent

    @property
    def end(self) -> float:
        return self.chunks[-1][0]

    def token_gaps(self) -> list[float]:
        """Inter-token gaps: a chunk of k tokens after a gap g gives k gaps of g/k."""
        out = []
        for (a, _), (b, k) in zip(self.chunks, self.chunks[1:]):
            out += [(b - a) / k] * k
        return out


async def stream_completion(client, ids: list[int], max_tokens: int, stop_after=None) -> Stream:
    """Stream one greedy completion; `stop_after(stream)` True closes it early (the server cancels it)."""
    s = Stream(time.perf_counter())
    response = await client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True})
    async with response:
        async for chunk in response:
            if chunk.usage:
                s.completion_tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].text:
                s.chunks.append((time.perf_counter(), len(chunk.choices[0].text.split())))
                if stop_after and stop_after(s):
                    break
    return s


async def burst(client, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """len(prompts) streams started together: aggregate tokens/s, TTFT and inter-token p50/p99 (seconds)."""
    streams = await asyncio.gather(*(stream_completion(client, ids, max_tokens) for ids in prompts))
    for s in streams:
        if s.completion_tokens != max_tokens or sum(k for _, k in s.chunks) != max_tokens:
            raise RuntimeError(f"a stream got {s.completion_tokens} tokens ({sum(k for _, k in s.chunks)} in "
                               f"chunks), expected {max_tokens}")
    wall = max(s.end for s in streams) - min(s.sent for s in streams)
    ttfts = [s.ttft for s in streams]
    gaps = [g for s in streams for g in s.token_gaps()]
    (ttft50, ttft99), (itl50, itl99) = np.percentile(ttfts, [50, 99]), np.percentile(gaps, [50, 99])
    return {"agg": sum(s.completion_tokens for s in streams) / wall,
            "ttft50": ttft50, "ttft99": ttft99, "itl50": itl50, "itl99": itl99}


async def concurrency_rounds(base: str, levels: list[int], rounds: int, prompt_len: int, max_tokens: int,
                             vocab: int) -> dict[int, dict[str, float]]:
    """Medians over `rounds` of `burst` at each level (levels alternate within a round)."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        await burst(client, [prompt_ids(prompt_len, i, vocab) for i in range(max(levels))], max_tokens)  # warm-up
        samples: dict[int, list[dict[str, float]]] = {c: [] for c in levels}
        for r in range(rounds):
            for c in levels:
                samples[c].append(await burst(client, [prompt_ids(prompt_len, 100 * r + i, vocab) for i in range(c)],
                                              max_tokens))
            rates = ", ".join(f"C={c} {samples[c][-1]['agg']:.0f} tok/s" for c in levels)
            print(f"  round {r + 1}/{rounds} ({time.strftime('%X')}): {rates}", flush=True)
    return {c: {k: statistics.median(s[k] for s in v) for k in v[0]} for c, v in samples.items()}


async def read_gap(client, short: list[int], long: list[int], running_max: int) -> dict[str, float]:
    """One stream decodes; a request with the `long` prompt arrives. The running stream's gaps around the read."""
    started, read_done = asyncio.Event(), asyncio.Event()
    t_read: list[float] = []

    def stop_after(s: Stream) -> bool:
        if len(s.chunks) >= 16:
            started.set()
        # Close a few tokens after the read, so the gaps after it are seen too.
        return read_done.is_set() and sum(t > t_read[1] for t, _ in s.chunks) >= 4

    running = asyncio.create_task(stream_completion(client, short, running_max, stop_after))
    await started.wait()
    long_stream = await stream_completion(client, long, 1)
    t_read[:] = [long_stream.sent, long_stream.chunks[0][0]]
    read_done.set()
    s = await running
    if s.end <= t_read[1]:
        raise RuntimeError("the running stream ended before the long prompt was read; raise its max_tokens")
    times = [t for t, _ in s.chunks]
    pairs = list(zip(times, times[1:]))
    before = [b - a for a, b in pairs if b <= t_read[0]]
    during = [b - a for a, b in pairs if b > t_read[0] and a < t_read[1]]
    return {"read": t_read[1] - t_read[0], "steady": statistics.median(before), "longest": max(during)}


async def gap_rounds(base: str, rounds: int, long_len: int, context: int, vocab: int) -> dict[str, float]:
    """Medians over `rounds` of `read_gap`."""
    from openai import AsyncOpenAI

    short = prompt_ids(32, 7, vocab)
    async with AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        await stream_completion(client, prompt_ids(long_len, 1, vocab), 2)  # warm-up: one long read
        out = [await read_gap(client, short, prompt_ids(long_len, 2 + r, vocab), context - len(short))
               for r in range(rounds)]
    return {k: statistics.median(o[k] for o in out) for k in out[0]}


def engine_runner(engine, new: int, steps: dict[int, list[float]]):
    """run(prompts) -> tokens/s of `Engine.run` given all prompts at once (greedy, `new` tokens each).

    Appends to `steps[rows]` the seconds of each turn that was one decode step of `rows` rows and no
    prompt chunk (the engine's own stats, its read point included)."""
    import gemma_engine

    def run(prompts: list[list[int]]) -> float:
        waiting = [gemma_engine.Request(i, ids, new) for i, ids in enumerate(prompts)]
        ended: set[int] = set()
        tokens = 0

        def poll(free: int, idle: bool):
            nonlocal waiting
            if len(ended) == len(prompts):
                return None
            take, waiting = waiting[:free], waiting[free:]
            return take, []

        def on_events(events, stats) -> None:
            nonlocal tokens
            if len(stats["batch_sizes"]) == 1 and not stats["prompt_tokens"]:
                steps.setdefault(stats["batch_sizes"][0], []).append(stats["seconds"])
            for e in events:
                tokens += len(e.tokens)
                if e.finish:
                    if e.finish != "length":
                        raise RuntimeError(f"request {e.id} ended {e.finish}: {e.error}")
                    ended.add(e.id)

        t0 = time.perf_counter()
        engine.run(poll, on_events, 1)
        if tokens != new * len(prompts):
            raise RuntimeError(f"the engine gave {tokens} tokens, expected {new * len(prompts)}")
        return tokens / (time.perf_counter() - t0)

    return run


# --- 2: Transformers' batching --------------------------------------------------------------------------


def hf_continuous_batching_error(model, prompt: list[int]) -> str | None:
    """None when `model.generate_batch` (Transformers' continuous batching) generates here, else why not."""
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    attn = model.config._attn_implementation
    try:
        out = model.generate_batch([prompt], generation_config=gc, progress_bar=False)
    except Exception as e:  # noqa: BLE001 - any failure means: fall back, and say why
        return f"{type(e).__name__}: {str(e).split('. ')[0]}"
    finally:
        # A failed start leaves the model on "paged|<attn>", which a plain forward refuses.
        if model.config._attn_implementation != attn:
            model.set_attn_implementation(attn)
    errors = [o.error for o in out.values() if o.error or len(o.generated_tokens) != 2]
    return f"request failed: {errors[0]}" if errors else None


def hf_runner(model, continuous: bool, new: int):
    """run(prompts) -> tokens/s of Transformers generating `new` tokens for each prompt, all in one call."""
    from transformers import GenerationConfig

    @torch.no_grad()
    def run(prompts: list[list[int]]) -> float:
        t0 = time.perf_counter()
        if continuous:
            gc = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
            out = model.generate_batch(prompts, generation_config=gc, progress_bar=False)
            n = sum(len(o.generated_tokens) for o in out.values())
        else:
            ids = torch.tensor(prompts)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0, cache_implementation="static", disable_compile=True)
            n = out[:, ids.shape[1]:].numel()
        return n / (time.perf_counter() - t0)

    return run


# --- 3: the floor ---------------------------------------------------------------------------------------


def matmul_seconds(model, rows: int, threads: int, onednn: bool, repeats: int = 7) -> float:
    """Seconds of one decode step's matrix products alone (bench/engine.py `matvec_floor_runner`: ATen's
    kernels, or oneDNN's with `onednn`), `rows` rows, on `threads` torch threads: the fastest of `repeats`
    runs, after one warm-up run."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run = matvec_floor_runner(model, "cpu", rows=rows, onednn=onednn)
        run()
        return 1 / max(run() for _ in range(repeats))
    finally:
        torch.set_num_threads(before)


# --- the run --------------------------------------------------------------------------------------------


def main(a) -> int:
    """`a`: bench/server.py's parsed flags (concurrency, rounds, prompt_tokens, max_tokens, threads, dtype,
    long_prompt, gap_chunks, gap_context, gap_rounds)."""
    t_start = time.perf_counter()
    levels = sorted({int(c) for c in a.concurrency.split(",")})
    compare = sorted({int(c) for c in a.compare_at.split(",") if c})
    # --gap-rounds 0 (or an empty --gap-chunks) skips the gap measurement (part 4).
    gap_chunks = [int(c) for c in a.gap_chunks.split(",") if c] if a.gap_rounds > 0 else []
    context = a.prompt_tokens + a.max_tokens
    torch.set_num_threads(a.threads)
    config = make_config("small")
    vocab = config.vocab_size
    import gemma_engine
    import transformers

    print(f"small config: hidden {config.hidden_size}, layers {config.num_hidden_layers}, vocab {vocab}; CPU "
          f"{a.dtype}, {a.threads} torch thread(s) for the server and Transformers, {os.cpu_count()} cores; prompt "
          f"{a.prompt_tokens}, max_tokens {a.max_tokens}, context {context}, {a.rounds} rounds, medians")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"gemma_engine {gemma_engine.__version__}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-small.") as tmp:
        model_dir = Path(tmp)
        model = random_model(config, "cpu")
        model.save_pretrained(model_dir)
        write_word_tokenizer(model_dir, vocab)
        model = model.to(getattr(torch, a.dtype))

        # The in-process engine and 2 first, while no server runs.
        engine = gemma_engine.Engine(str(model_dir), None, torch.zeros(1), context=context, dtype=a.dtype,
                                     max_batch=max(levels), prefix_caching=False)  # as the server (start_server)
        step_s: dict[int, list[float]] = {}
        direct_run = engine_runner(engine, a.max_tokens, step_s)
        why_not = hf_continuous_batching_error(model, prompt_ids(a.prompt_tokens, 0, vocab))
        hf_kind = "generate_batch (continuous batching)" if why_not is None else "batched generate, static cache"
        hf_run = hf_runner(model, why_not is None, a.max_tokens)
        side = {"engine": direct_run, "hf": hf_run}
        for run in side.values() if compare else ():  # warm-up (an empty --compare-at runs neither)
            run([prompt_ids(a.prompt_tokens, i, vocab) for i in range(max(compare))])
        samples: dict[str, dict[int, list[float]]] = {k: {c: [] for c in compare} for k in side}
        for r in range(a.rounds):
            for c in compare:
                for k, run in side.items():
                    samples[k][c].append(run([prompt_ids(a.prompt_tokens, 100 * r + i, vocab) for i in range(c)]))
        kernel = engine.weights()["linear"]
        direct = {c: statistics.median(v) for c, v in samples["engine"].items()}
        steps = {rows: statistics.median(v) for rows, v in step_s.items() if rows in (1, 8)}
        hf_med = {c: statistics.median(v) for c, v in samples["hf"].items()}
        del engine, direct_run, side
        print(f"[{time.perf_counter() - t_start:.0f} s] engine in-process: "
              + ", ".join(f"C={c} {v:.0f}" for c, v in direct.items())
              + f" tok/s; transformers {hf_kind}: " + ", ".join(f"B={c} {v:.0f}" for c, v in hf_med.items())
              + " tok/s", flush=True)

        # 3
        kernels = sorted({"aten", kernel})
        floor = {(k, t): {rows: matmul_seconds(model, rows, t, k == "onednn") for rows in (1, 8)}
                 for k in kernels for t in sorted({1, 2, a.threads})}

        # 1
        port = pick_port()
        base = f"http://127.0.0.1:{port}"
        server = start_server(str(model_dir), port, a.threads, [
            "--context", str(context), "--dtype", a.dtype, "--max-num-seqs", str(max(levels)),
            "--default-temperature", "0", "--queue-limit", str(max(levels))])
        try:
            wait_healthy(base, server)
            ours = asyncio.run(concurrency_rounds(base, levels, a.rounds, a.prompt_tokens, a.max_tokens, vocab))
        finally:
            stop_server(server)

        # 4
        gaps = {}
        for chunk in gap_chunks:
            server = start_server(str(model_dir), port, a.threads, [
                "--context", str(a.gap_context), "--dtype", a.dtype, "--max-num-seqs", "2",
                "--prefill-chunk", str(chunk), "--default-temperature", "0"])
            try:
                wait_healthy(base, server)
                gaps[chunk] = asyncio.run(gap_rounds(base, a.gap_rounds, a.long_prompt, a.gap_context, vocab))
            finally:
                stop_server(server)
            print(f"  prefill chunk {chunk}: longest gap {gaps[chunk]['longest'] * 1000:.0f} ms", flush=True)

    report(a, levels, ours, direct, hf_med, hf_kind, why_not, floor, kernel, steps, gaps)
    print(f"\nwhole run: {time.perf_counter() - t_start:.0f} s")
    return 0


def report(a, levels, ours, direct, hf, hf_kind, why_not, floor, kernel, steps, gaps) -> None:
    """`floor[(kernel, threads)][rows]`: seconds; `kernel`: what the engine multiplies with ("onednn" or
    "aten"), whose floor the goal lines use."""
    one, d_one = ours[levels[0]]["agg"], direct.get(levels[0])
    x = f"x C={levels[0]}"
    cell = lambda v: f"{v:>8.1f}" if v is not None else f"{'-':>8}"  # noqa: E731
    ratio = lambda a, b: f"{a / b:>7.2f}" if a is not None and b is not None else f"{'-':>7}"  # noqa: E731
    print(f"\n{'':>3} {'server, openai SDK':^54} {'engine':^16} {'transformers':^17}")
    print(f"{'C':>3} {'agg tok/s':>10} {x:>7} {'TTFT p50':>9} {'p99 ms':>7} {'ITL p50':>8} {'p99 ms':>7} "
          f"{'tok/s':>8} {x:>7} {'tok/s':>8} {'ours/HF':>8}")
    for c in levels:
        o = ours[c]
        d, h = direct.get(c), hf.get(c)
        print(f"{c:>3} {o['agg']:>10.1f} {o['agg'] / one:>7.2f} {o['ttft50'] * 1e3:>9.1f} {o['ttft99'] * 1e3:>7.1f} "
              f"{o['itl50'] * 1e3:>8.2f} {o['itl99'] * 1e3:>7.2f} {cell(d)} {ratio(d, d_one)} {cell(h)} "
              f"{ratio(o['agg'], h):>8}")
    print(f"engine = Engine.run in this process, no HTTP; transformers = {hf_kind}"
          + (f" (generate_batch: {why_not})" if why_not else "") + "; ours/HF = server agg / transformers")
    names = {"aten": "ATen's kernels (Transformers')", "onednn": "oneDNN's kernels (the engine's)"}
    if kernel == "aten":
        names["aten"] = "ATen's kernels (both sides')"
    for (k, t), f in floor.items():
        print(f"floor, {names[k]}, {t} thread(s): matrix products of one step {f[1] * 1e3:.2f} ms at 1 row, "
              f"{f[8] * 1e3:.2f} ms at 8 rows -> 8 streams at most {8 * f[1] / f[8]:.2f}x one stream")
    if {1, 8} <= set(ours) and 8 in hf:
        gain = ours[8]["agg"] / ours[1]["agg"]
        f = floor[kernel, a.threads]
        ceiling = 8 * f[1] / f[8]
        share, vs_hf = gain / ceiling, ours[8]["agg"] / hf[8]
        met = lambda ok: "met" if ok else "MISSED"  # noqa: E731
        print(f"at 8: {gain:.2f}x one stream (goal >= 2.5x: {met(gain >= 2.5)}), {share:.0%} of the "
              f"{a.threads}-thread floor ratio {ceiling:.2f}x on the engine's kernels (goal >= 80%: "
              f"{met(share >= 0.8)}), {vs_hf:.2f}x Transformers (goal >= 1.5x: {met(vs_hf >= 1.5)})")
        if {1, 8} <= set(direct):
            print(f"engine in-process at 8: {direct[8] / direct[1]:.2f}x one stream, "
                  f"{direct[8] / direct[1] / ceiling:.0%} of the floor ratio")
        if {1, 8} <= set(steps):
            step_gain = 8 * steps[1] / steps[8]
            print(f"engine decode step alone (its stats, turns without a prompt chunk, medians): "
                  f"{steps[1] * 1e3:.2f} ms at 1 row ({f[1] / steps[1]:.0%} of it matrix products), "
                  f"{steps[8] * 1e3:.2f} ms at 8 rows ({f[8] / steps[8]:.0%}) -> {step_gain:.2f}x, "
                  f"{step_gain / ceiling:.0%} of the floor ratio")
    if gaps:
        print(f"\nrunning stream's gaps while a {a.long_prompt}-token prompt is read (context {a.gap_context}, "
              f"{a.gap_rounds} rounds, medians):")
        print(f"{'prefill chunk':>14} {'read s':>7} {'steady gap ms':>14} {'longest gap ms':>15}")
        for chunk, g in gaps.items():
            label = f"{chunk}" + (" (whole)" if chunk >= a.long_prompt else "")
            print(f"{label:>14} {g['read']:>7.2f} {g['steady'] * 1e3:>14.1f} {g['longest'] * 1e3:>15.1f}")
        whole = [c for c in gaps if c >= a.long_prompt]
        if whole and len(whole) < len(gaps):
            w = gaps[whole[0]]["longest"]
            print("longest gap, whole prompt / chunked: " + ", ".join(
                f"chunk {c}: {w / g['longest']:.1f}x shorter" for c, g in gaps.items() if c < a.long_prompt))


if __name__ == "__main__":
    sys.exit("run it as: python -m bench.server --concurrency 1,2,4,8,16")
