"""Compiled decode step against eager, and both against the device's read bound, in one run.

    python -m bench.compiled [--config small|tiny|e2b-layers|e2b] [--device cpu|cuda] [--dtype float32|bfloat16]
                             [--batches 1,8,32] [--new 32] [--repeats 3] [--spec-gbps N] [--transformers]

1. **The read bound, measured right** (bench/engine.py `read_bound_runner`): one float32 buffer of `--bound-gib`
   (default 1 GiB), read `--passes` times (default 20) by a plain `sum` and by a matrix-vector product over it,
   each loop between two device events (the wall clock on the CPU), so launch and sync cost nothing beside the
   bytes; the faster kernel sets it. Printed as GB/s and, with `--spec-gbps` or a known GPU (H100 SXM 3,350 GB/s,
   H200 4,800 GB/s), as a share of the device's specification.
2. **Decode at batch 1, 8, 32** (slots decoding together): the engine eager (oneDNN's packed weights where
   it picks them, the engine's default; its CUDA graphs on CUDA), and the engine compiled
   (`gemma_engine.compiling.StepCompiler`, Inductor; on CUDA each compiled step replayed as a CUDA graph; on
   the CPU over the same oneDNN weights, frozen into each graph); on the CPU both on ATen's matmul too;
   with `--transformers`, Transformers' `generate` with its static cache and the forward under
   `torch.compile` (the strong baseline; batch 1). Decode tok/s = the batch's tokens after the first over
   the seconds they took (from `Engine.run`'s own step timings), median of `--repeats`; each side's
   effective GB/s (weight bytes a step reads x steps per second) and its share of the read bound.
3. **Prompt read**: tokens per second of one `--prompt`-token prompt read alone, on every engine (the compiled
   one replays its compiled prompt chunk, rust/src/engine/chunks.rs), median of `--repeats`.

The weights are random (bench/engine.py's initialisation); each compiled engine's tokens are compared
with those of the eager engine on the same kernels and the agreement printed (tests/engine/test_compiled.py
holds it).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from bench.engine import captured, make_config, random_model, read_bound_runner, spec_gbps, step_read_bytes


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    return [[2] + [(37 * i + 11 * b + 5) % (vocab - 10) + 3 for i in range(length - 1)] for b in range(batch)]


def decode_rate(engine, batch: int, length: int, new: int, vocab: int) -> tuple[float, list[list[int]]]:
    """Decode tok/s of `batch` requests decoding together (tokens after each one's first, over the seconds of
    the turns that decoded them), and their tokens."""
    import gemma_engine

    reqs = [gemma_engine.Request(i, p, new) for i, p in enumerate(prompts(batch, length, vocab))]
    tokens: dict[int, list[int]] = {i: [] for i in range(batch)}
    seconds = [0.0]
    pending = list(reqs)

    def poll(free, idle):
        nonlocal pending
        if not pending and all(len(t) >= new for t in tokens.values()):
            return None
        new_reqs, pending = pending[:free], pending[free:]
        return new_reqs, []

    def on_events(events, stats):
        for e in events:
            tokens[e.id] += e.tokens
        if stats.get("batch_sizes") and not stats.get("prompt_tokens"):
            seconds[0] += stats["seconds"]

    engine.run(poll, on_events, 1)
    decoded = sum(len(t) - 1 for t in tokens.values())
    return decoded / seconds[0], [tokens[i] for i in range(batch)]


def report(rates: dict[str, float], batch: int, step_bytes: dict[str, int], bound: float, spec: float | None) -> None:
    """Each side's tok/s, the GB/s its weight reads make, and their share of the read bound (and of the spec)."""
    for name, rate in rates.items():
        gbps = rate / batch * step_bytes.get(name, step_bytes["eager"]) / 1e9
        spec_share = f", {100 * gbps / spec:.1f} % of spec" if spec else ""
        print(f"  {name:22s} {rate:9.1f} tok/s  {gbps:8.2f} GB/s = {100 * gbps * 1e9 / bound:5.1f} % of the "
              f"read bound{spec_share}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="small")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on the cpu, bfloat16 on cuda")
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes (e.g. 1,8,32)")
    ap.add_argument("--new", type=int, default=32, help="tokens each request decodes")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens of each request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the cpu")
    ap.add_argument("--bound-gib", type=float, default=1.0)
    ap.add_argument("--passes", type=int, default=20)
    ap.add_argument("--spec-gbps", type=float, default=None, help="the device's memory bandwidth by its spec")
    ap.add_argument("--transformers", action="store_true", help="add Transformers (static cache, torch.compile)")
    args = ap.parse_args(argv)
    import gemma_engine
    from gemma_engine.compiling import StepCompiler

    torch.set_num_threads(args.threads)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    batches = [int(b) for b in args.batches.split(",")]
    config = make_config(args.config)
    model = random_model(config, args.device).to(getattr(torch, dtype))
    bound, kernel = read_bound_runner(args.device, args.bound_gib, args.passes)()
    spec = spec_gbps(args.device, args.spec_gbps)
    share = f" = {100 * bound / 1e9 / spec:.1f} % of the {spec:,.0f} GB/s spec" if spec else ""
    print(f"read bound: {bound / 1e9:,.1f} GB/s ({args.bound_gib} GiB x {args.passes} passes of the faster of a sum "
          f"and a matrix-vector product: {kernel}){share}")

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        context = args.prompt + args.new + 8
        common = dict(like=torch.zeros(1, device=args.device), context=context, dtype=dtype,
                      prefix_caching=False, max_batch=max(batches))
        engines = {"eager": gemma_engine.Engine(tmp, **common)}
        engines["compiled"] = gemma_engine.Engine(tmp, compiler=StepCompiler("inductor"), **common)
        if args.device == "cpu":  # oneDNN is the CPU's; elsewhere eager runs ATen's matmul already
            engines["eager aten"] = gemma_engine.Engine(tmp, onednn=False, **common)
            engines["compiled aten"] = gemma_engine.Engine(tmp, onednn=False, compiler=StepCompiler("inductor"),
                                                           **common)
        same = {"compiled": "eager", "compiled aten": "eager aten"}  # each compiled engine's eager twin
        step_bytes = {name: step_read_bytes(e, config, dtype) for name, e in engines.items()}
        by_batch: dict[int, dict[str, float]] = {}

        def shapes() -> int:
            """Step shapes every compiling engine has captured so far."""
            return sum(captured(e) for e in engines.values())

        for b in batches:
            # Warm-up: every step shape the timed runs meet (buckets of part-admitted batches, padded ones) runs
            # on every engine twice before they start, so a compiled engine has captured each and replays it.
            t0, before = time.perf_counter(), shapes()
            for _ in range(2):
                for e in engines.values():
                    decode_rate(e, b, args.prompt, args.new, config.vocab_size)
            print(f"\nbatch {b}: warm-up {time.perf_counter() - t0:.1f} s (compiled {shapes() - before} "
                  f"step shapes; fallbacks: {engines['compiled'].compile_report()['fallbacks']})", flush=True)
            warmed = shapes()
            rates: dict[str, list[float]] = {name: [] for name in engines}
            agree: dict[str, list[int]] = {name: [] for name in same if name in engines}
            for _ in range(args.repeats):  # interleaved rounds
                made = {}
                for name, e in engines.items():
                    rate, made[name] = decode_rate(e, b, args.prompt, args.new, config.vocab_size)
                    rates[name].append(rate)
                for name in agree:
                    agree[name].append(sum(t == w for t, w in zip(made[name], made[same[name]])))
            equal = ", ".join(f"{name} = {same[name]} tokens in {min(n)}/{b} requests" for name, n in agree.items())
            late = shapes() - warmed  # a shape compiled inside a timed round slows that round
            print(f"batch {b}: decode tok/s, median of {args.repeats} ({equal}; {late} step shapes compiled while "
                  "timed)")
            by_batch[b] = {name: statistics.median(v) for name, v in rates.items()}
            report(by_batch[b], b, step_bytes, bound, spec)
            print("  " + "; ".join(f"compiled / {name}: {by_batch[b]['compiled'] / by_batch[b][name]:.2f}x"
                                   for name in engines if name != "compiled"), flush=True)
        if 1 in by_batch:
            for b in (b for b in batches if b > 1):
                print(f"batch {b} / batch 1 decode tok/s: " + ", ".join(
                    f"{name} {by_batch[b][name] / by_batch[1][name]:.2f}x" for name in engines))

        prompt = prompts(1, args.prompt, config.vocab_size)[0]
        for e in engines.values():  # warm-up: the compiled engine's chunk shape runs, then is captured
            for _ in range(2):
                e.decode(prompt, 1)
        read: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name in read:
                _, _, read_s, _ = engines[name].decode(prompt, 1)
                read[name].append(args.prompt / read_s)
        reads = {k: statistics.median(v) for k, v in read.items()}
        print(f"prompt read tok/s ({args.prompt} tokens, one chunk), median of {args.repeats}: " +
              ", ".join(f"{k} {v:,.0f}" for k, v in reads.items()) + "; " +
              "; ".join(f"compiled / {k}: {reads['compiled'] / v:.2f}x" for k, v in reads.items() if k != "compiled"))

        if args.transformers:  # last: its torch.compile takes long, and nothing above needs it
            from bench.engine import hf_runner

            if args.device == "cpu":  # generate compiles the forward itself on an accelerator, not on the CPU
                model.forward = torch.compile(model.forward)  # the plain call: its sliding cache counts in ints
            hf = hf_runner(model, args.device, prompts(1, args.prompt, config.vocab_size)[0], args.new, "static",
                           compile_=True)
            ours = by_batch.get(1, {}).get("compiled")
            theirs = statistics.median(hf()[1] for _ in range(args.repeats))
            report({"transformers compiled": theirs}, 1, step_bytes, bound, spec)
            if ours:
                print(f"  compiled / transformers compiled (batch 1): {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
