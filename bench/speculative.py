"""Speculative decoding against plain decoding, in one run: generated tokens/s at batch 1, 4 and 16, the drafts'
acceptance, and the tokens (equal, or the run says DIFFER).

    python -m bench.speculative [--method ngram|mtp] [--config small|e2b-layers] [--batches 1,4,16] [--new 64]
        [--tokens 4] [--speculative-max-batch N|measured] [--distill-steps 200] [--compile inductor]

`--method ngram` (prompt lookup): two targets of the same random weights, as drawn (bench/engine.py
`random_model`, whose greedy text repeats one token) and "two-token" (tests/checkpoints/text.py `save_two_token`: the
final norm's weight zero but for one feature, so the target writes runs of two tokens, switching with the
context: drafts copied from the runs are kept, the switches rejected). The drafts come from the context, never
from the target.

`--method mtp` (an MTP assistant drafter): the target is tests/checkpoints/text.py's `random_model` (its greedy text
varies: about 36 distinct tokens in 48), the drafter a two-layer assistant of a quarter of its hidden size
(tests/assistants.py `assistant_config`), trained for `--distill-steps` steps to imitate the target's greedy text
of the "seen" prompts (bench/distill.py). A random target's text is a random function of its context, so what the
drafter learns there is that text, not the target: on the seen prompts most drafts are kept (the speed of an
engine whose drafter agrees that often), on "held-out" prompts almost none (the cost of drafts that fail). The
drafter is a separate model of its own weights, never the target.

Each request's prompt is a block of 16 tokens said twice; every request is greedy. `--speculative-max-batch` (the
engine's default, 1, unless given; `measured`: set from the engine's own step costs, as the server does at warmup,
gemma_server/speculation.py): above it no step speculates, and the ratio there is the cost of having it on.
Medians of `--repeats` runs each, every run on emptied rings (`reset_prefix_cache`), so the prompt read is in both
timings; the drafts counted over all runs; the tokens must be equal in every repeat. `--compile inductor`: both
engines compile their steps (plain and verify, rust/src/engine/compiled.rs) on their default kernels (on the CPU
oneDNN's packed weights, frozen into each graph), after two untimed runs of each batch: a step shape a run meets
once is captured in the second, so the timed runs replay every shape.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.engine import captured, make_config, random_model


HELD_OUT = 1000  # the first prompt number of the held-out set


def prompts(batch: int, vocab: int, first: int = 0) -> list[list[int]]:
    blocks = [[(97 * r + 31 * i) % (vocab - 10) + 5 for i in range(16)] for r in range(first, first + batch)]
    return [[2] + b + b for b in blocks]


def run(engine, batch: int, new: int, first: int = 0) -> tuple[float, dict[int, list[int]], dict[str, int]]:
    """Seconds, tokens per request and the speculation counters of one batch of greedy requests (`prompts`), on an
    engine whose rings hold nothing: the requests read their prompts and take the lowest slots (an earlier repeat's
    histories would send them elsewhere, into a larger decode bucket)."""
    import gemma_engine

    engine.reset_prefix_cache()
    queue = [gemma_engine.Request(i, p, new) for i, p in enumerate(prompts(batch, engine.vocab_size, first))]
    out, done, stats = {r.id: [] for r in queue}, set(), {"spec_draft_tokens": 0, "spec_accepted_tokens": 0,
                                                          "spec_drafts": 0}

    def poll(free, idle):
        if not queue and len(done) == batch:
            return None
        new_requests, queue[:] = queue[:free], queue[free:]
        return new_requests, []

    def on_events(events, s):
        for k in stats:
            stats[k] += s.get(k, 0)
        for e in events:
            out[e.id] += e.tokens
            if e.finish:
                done.add(e.id)

    t0 = time.perf_counter()
    engine.run(poll, on_events, 1)
    return time.perf_counter() - t0, out, stats


def compare(plain, spec, batches: list[int], args, label: str, first: int = 0) -> None:
    """Time `plain` and `spec` on each batch (prompts from number `first`) and print a line each."""
    for batch in batches:
        times, same, counters = {"plain": [], "spec": []}, True, {}
        before = captured(plain) + captured(spec)
        for _ in range(args.repeats):
            seconds, want, _ = run(plain, batch, args.new, first)
            times["plain"].append(seconds)
            seconds, tokens, counted = run(spec, batch, args.new, first)
            times["spec"].append(seconds)
            same = same and tokens == want
            counters = {k: counters.get(k, 0) + v for k, v in counted.items()}
        generated = batch * args.new
        rate = {side: generated / statistics.median(t) for side, t in times.items()}
        drafts, offered, kept = (counters[k] for k in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens"))
        accept = f"{kept / offered:.2f} of {offered} drafts kept, {1 + kept / drafts:.2f} tokens a verify step" \
            if offered else "no step speculated"
        late = captured(plain) + captured(spec) - before
        compiled = f"; {late} step shapes compiled while timed" if args.compile != "off" else ""
        equal = "equal" if same else "DIFFER"
        print(f"{label:9s} batch {batch:2d}: plain {rate['plain']:7.1f} tok/s, {args.method} {rate['spec']:7.1f} "
              f"tok/s, {rate['spec'] / rate['plain']:.2f}x; {accept}; tokens {equal}{compiled}", flush=True)


def compiling(backend: str) -> dict:
    """The Engine arguments of `--compile`: a compiler of `backend`, or none."""
    if backend == "off":
        return {}
    from gemma_engine.compiling import StepCompiler

    return {"compiler": StepCompiler(backend)}


def distilled(config, target_dir: Path, out_dir: Path, args, batches: list[int]) -> Path:
    """An assistant for the target in `target_dir` trained on its greedy text of the seen prompts."""
    from bench.distill import distill, target_texts
    from tests import assistants
    from tests.checkpoints.parity import load_hf_reference

    target = load_hf_reference(target_dir)
    for p in target.parameters():
        p.requires_grad_(False)
    texts = target_texts(target, prompts(max(batches), config.vocab_size), args.new)
    drafter = assistants.random_assistant(assistants.assistant_config(config, hidden=config.hidden_size // 4))
    t0 = time.perf_counter()
    right = distill(drafter, target, texts, args.distill_steps, args.tokens)
    print(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f} M parameters (target "
          f"{sum(p.numel() for p in target.parameters()) / 1e6:.2f} M), {args.distill_steps} steps in "
          f"{time.perf_counter() - t0:.0f} s, {right:.2f} of its training drafts right", flush=True)
    drafter.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", choices=("ngram", "mtp"), default="ngram")
    ap.add_argument("--config", default="small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--speculative-max-batch", default=None,
                    help="N, or 'measured' (timed as the server does at warmup); default: the engine's")
    ap.add_argument("--distill-steps", type=int, default=200, help="--method mtp: the drafter's training steps")
    ap.add_argument("--compile", choices=("off", "inductor"), default="off",
                    help="compile both engines' steps (after two untimed runs of each batch)")
    args = ap.parse_args(argv)
    import gemma_engine

    # Imported here, as bench/engine.py `make_config` imports it.
    from tests.checkpoints import text

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    config = make_config(args.config)
    print(f"config {args.config}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocabulary "
          f"{config.vocab_size}; {args.dtype}, {args.new} new tokens a request, {args.tokens} drafts a step, "
          f"{args.threads} thread(s); medians of {args.repeats}; compile {args.compile}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # Measured, as the server does: no limit on decoding requests, the measured one on buckets.
        limit = {} if args.speculative_max_batch is None else {"speculative_max_batch": max(batches)} \
            if args.speculative_max_batch == "measured" else {"speculative_max_batch": int(args.speculative_max_batch)}
        if args.method == "ngram":
            random_model(config, "cpu").to(getattr(torch, args.dtype)).save_pretrained(tmp / "random")
            targets = {"random": tmp / "random", "two-token": text.save_two_token(tmp / "random", tmp / "two_token")}
            method = {"speculative_method": "ngram"}
        else:
            text.random_model(config).to(getattr(torch, args.dtype)).save_pretrained(tmp / "random")
            targets = {"random": tmp / "random"}
            drafter = distilled(config, tmp / "random", tmp / "drafter", args, batches)
            method = {"speculative_method": "mtp", "speculative_model": str(drafter)}
        for name, model_dir in targets.items():
            make = lambda **kw: gemma_engine.Engine(  # noqa: E731
                str(model_dir), like=torch.zeros(1), context=256, dtype=args.dtype, max_batch=max(batches),
                **compiling(args.compile), **kw)
            plain, spec = make(), make(num_speculative_tokens=args.tokens, **method, **limit)
            if args.compile != "off":
                for batch in (b for b in batches for _ in range(2)):
                    run(plain, batch, args.new)
                    run(spec, batch, args.new)
            if args.speculative_max_batch == "measured":
                from gemma_server import speculation

                print(f"{name}: {speculation.summary(*speculation.measure(spec))}", flush=True)
            if args.method == "ngram":
                compare(plain, spec, batches, args, name)
            else:
                compare(plain, spec, batches, args, "seen")
                compare(plain, spec, batches, args, "held-out", first=HELD_OUT)


if __name__ == "__main__":
    main()
