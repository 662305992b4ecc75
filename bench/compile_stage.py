"""What the `compile` boot stage costs with an empty Inductor cache and on a restart that loads it.

    .venv/bin/python -m bench.compile_stage [--max-num-seqs 2] [--prefill-chunk 32] [--speculative]

Boots `python -m gemma_server --compile on --onednn off` (bench/server.py `start_server`) twice on one new
TORCHINDUCTOR_CACHE_DIR (a temporary directory, so nothing earlier is in it): the first boot compiles every graph
the compile stage runs (server/gemma_server/compile_stage.py), the second loads them from the cache. Prints each
boot's `compile` stage seconds and their ratio, and the first boot's graphs by kind with their compile seconds:
decode forwards (one per bucket and padding), decode choices (one per bucket, padding and sampling stages: what a
step whose stages warmup did not compile costs while serving) and prompt chunks. `--onednn off` because Inductor's
cache skips graphs over oneDNN's packed weights (README, "The compiled decode step").

`--speculative`: prompt lookup with 4 drafts in every bucket (`--speculative-method ngram --num-speculative-tokens 4
--speculative-max-batch` the slots), whose verify graphs the `warmup` stage compiles (rust/src/engine/tuning.rs
`compile_verify`): its seconds are printed too, and the verify forwards (one per bucket and padding) and checks (one
per bucket, padding and sampling stages) among the graphs.

The checkpoint: the tiny chat checkpoint (tests/checkpoints/chat.py) cut to 4 layers, one of each kind
(`SMALL_LAYERS`), float32, made in a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from bench.demo import pick_port, stop_server, wait_until_ready
from bench.server import start_server

CONTEXT = 1024  # the tiny checkpoint's max_position_embeddings


def boot(model_dir: Path, cache: Path, port: int, args: list[str]) -> dict:
    """One boot with `--compile on` on Inductor cache `cache`, on every core, stopped once ready; its
    /v1/engine."""
    server = start_server(str(model_dir), port, os.cpu_count() or 1,
                          ["--compile", "on", "--onednn", "off", "--dtype", "float32", "--context", str(CONTEXT),
                           *args],
                          env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    try:
        return wait_until_ready(f"http://127.0.0.1:{port}", server, timeout=1800, show_stages=False)
    finally:
        stop_server(server)


def kind(name: str) -> str:
    """The kind of a compiled graph, by the name the engine gives it (rust/src/engine/step.rs, chunks.rs,
    verify.rs)."""
    for step, second_half in (("decode", "choice"), ("verify", "check")):
        if name.startswith(step):
            return f"{step} {'forward' if name.endswith(' forward') else second_half}"
    return "prompt chunk" if name.startswith("prompt") else "other"


def stage_seconds(info: dict, stage: str) -> float:
    return next(s["seconds"] for s in info["stages"] if s["stage"] == stage)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-num-seqs", type=int, default=2)
    p.add_argument("--prefill-chunk", type=int, default=32)
    p.add_argument("--speculative", action="store_true", help="prompt lookup, 4 drafts, in every bucket")
    a = p.parse_args()
    from tests.checkpoints.chat import save_chat
    from tests.checkpoints.text import SMALL_LAYERS

    args = ["--max-num-seqs", str(a.max_num_seqs), "--prefill-chunk", str(a.prefill_chunk)]
    if a.speculative:
        args += ["--speculative-method", "ngram", "--num-speculative-tokens", "4",
                 "--speculative-max-batch", str(a.max_num_seqs)]
    with tempfile.TemporaryDirectory(prefix="bench-compile-stage-") as tmp:
        model_dir = save_chat(Path(tmp) / "model", **SMALL_LAYERS)
        port = pick_port()
        cold = boot(model_dir, Path(tmp) / "inductor", port, args)
        warm = boot(model_dir, Path(tmp) / "inductor", port, args)
    [engine] = cold["compile"]["engines"]
    print(f"{' '.join(args)}; fallbacks {len(engine['fallbacks'])}")
    for stage in ("compile", "warmup") if a.speculative else ("compile",):
        cold_s, warm_s = stage_seconds(cold, stage), stage_seconds(warm, stage)
        print(f"  {stage} stage: empty cache {cold_s:.1f} s, restart on it {warm_s:.1f} s ({cold_s / warm_s:.1f}x)")
    by_kind: dict[str, list[float]] = {}
    for name, seconds in engine["compiled"]:
        by_kind.setdefault(kind(name), []).append(seconds)
    for k, times in by_kind.items():
        print(f"  {k:<15} {len(times):>3} graphs, {min(times):6.1f} to {max(times):6.1f} s each, "
              f"{sum(times):7.1f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
