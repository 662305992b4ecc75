"""Speculative decoding by prompt lookup against plain decoding, in one run: generated tokens/s at batch 1, 4 and
16, the drafts' acceptance, and the tokens (equal, or the run says DIFFER).

    python -m bench.speculative [--config small|e2b-layers] [--batches 1,4,16] [--new 64] [--tokens 4]

Two targets of the same random weights: as drawn (they almost never agree with a draft: what speculation costs
when it does not pay), and "two-token" (the final norm's weight zero but for one feature, so the logits are that
feature times one column of the tied embeddings and the target writes runs of that column's two extreme tokens,
switching with the context: drafts copied from the runs are kept, the switches rejected). The drafts come from the
context (prompt lookup), never from the target. Each request's prompt is a block of 16 tokens said twice; every
request is greedy. `--speculative-max-batch` is the engine's default (4): at batch 16 no step speculates, and the
ratio there is the cost of having it on. Medians of `--repeats` runs each; the prompt read is in both timings.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from bench.engine import make_config, random_model


def two_token(model_dir: Path, out: Path) -> Path:
    """`model_dir`'s checkpoint with the final norm's weight zero but for feature 0 (module docs)."""
    out.mkdir()
    for f in model_dir.iterdir():
        tensors = load_file(f) if f.suffix == ".safetensors" else None
        if tensors is None:
            (out / f.name).write_bytes(f.read_bytes())
            continue
        if "model.norm.weight" in tensors:
            w = torch.zeros_like(tensors["model.norm.weight"])
            w[0] = 1.0
            tensors["model.norm.weight"] = w
        save_file(tensors, out / f.name, metadata={"format": "pt"})
    return out


def prompts(batch: int, vocab: int) -> list[list[int]]:
    blocks = [[(97 * r + 31 * i) % (vocab - 10) + 5 for i in range(16)] for r in range(batch)]
    return [[2] + b + b for b in blocks]


def run(engine, batch: int, new: int) -> tuple[float, dict[int, list[int]], dict[str, int]]:
    """Seconds, tokens per request and the speculation counters of one batch of greedy requests."""
    import gemma_engine

    queue = [gemma_engine.Request(i, p, new) for i, p in enumerate(prompts(batch, engine.vocab_size))]
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)
    import gemma_engine

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    config = make_config(args.config)
    print(f"config {args.config}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocabulary "
          f"{config.vocab_size}; {args.dtype}, {args.new} new tokens a request, {args.tokens} drafts a step, "
          f"{args.threads} thread(s); medians of {args.repeats}")
    with tempfile.TemporaryDirectory() as tmp:
        drawn = Path(tmp) / "random"
        random_model(config, "cpu").to(getattr(torch, args.dtype)).save_pretrained(drawn)
        targets = {"random": drawn, "two-token": two_token(drawn, Path(tmp) / "two_token")}
        for name, model_dir in targets.items():
            make = lambda **kw: gemma_engine.Engine(  # noqa: E731
                str(model_dir), like=torch.zeros(1), context=256, dtype=args.dtype, max_batch=max(batches), **kw)
            plain, spec = make(), make(speculative_method="ngram", num_speculative_tokens=args.tokens)
            for batch in batches:
                times = {"plain": [], "spec": []}
                for _ in range(args.repeats):
                    for side, engine in (("plain", plain), ("spec", spec)):
                        seconds, tokens, stats = run(engine, batch, args.new)
                        times[side].append(seconds)
                        if side == "plain":
                            want = tokens
                        else:
                            same, counters = tokens == want, stats
                generated = batch * args.new
                rate = {side: generated / statistics.median(t) for side, t in times.items()}
                drafts, offered, kept = (counters[k] for k in ("spec_drafts", "spec_draft_tokens",
                                                               "spec_accepted_tokens"))
                accept = f"{kept / offered:.2f} of {offered} drafts kept, {1 + kept / drafts:.2f} tokens a verify " \
                    f"step" if offered else "no step speculated"
                print(f"{name:9s} batch {batch:2d}: plain {rate['plain']:7.1f} tok/s, ngram {rate['spec']:7.1f} tok/s, "
                      f"{rate['spec'] / rate['plain']:.2f}x; {accept}; tokens {'equal' if same else 'DIFFER'}",
                      flush=True)


if __name__ == "__main__":
    main()
