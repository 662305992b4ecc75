"""Tensor parallelism across processes against one process, in one run: decode and prompt read of 1, 2 and 4
ranks, each rank a process holding one shard (`Engine(tensor_parallel_rank=...)`), and the bytes the ranks'
collectives move per decode step.

    python -m bench.tensor_parallel [--config small|e2b-layers] [--ranks 1,2,4] [--batch 1] [--new 32]
                                    [--prompt 64] [--repeats 3] [--threads 1]

Every rank is a process of its own with `--threads` torch threads, TP 1 too, so each side runs under the same
conditions; ranks talk over gloo on the CPU (NCCL where `--device cuda` and the GPUs are at hand). Each rank
runs the same requests (what `gemma_engine.distributed.lead` / `follow` make them do) and rank 0's rates are
reported, medians of `--repeats`, with their ratio to TP 1. On a machine with fewer cores than ranks x threads
the ranks share cores: the ratio then shows the collectives' cost and the sharing together, which the printed
core count says.

The payload per decode step is counted from the shapes: per layer one all-reduce of the attention output and
one of the MLP's (one of both branches side by side on MoE layers), `[batch, hidden]` each, and one all-gather
of the logits' vocabulary, `[batch, vocab]`, in the compute dtype. A ring all-reduce sends 2 (N - 1) / N of its
payload from each rank, an all-gather (N - 1) / N.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
from datetime import timedelta

import torch

from bench.compiled import decode_rate, prompts
from bench.engine import make_config, random_model

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_payload(config, batch: int, dtype: str) -> tuple[int, int]:
    """(all-reduce bytes, all-gather bytes) of one decode step's collectives, by shape."""
    b = DTYPE_BYTES[dtype]
    moe = bool(getattr(config, "enable_moe_block", False))
    per_layer = (1 + (2 if moe else 1)) * batch * config.hidden_size * b
    return config.num_hidden_layers * per_layer, batch * config.vocab_size * b


def _rank(rank: int, world: int, port: int, model_dir: str, args: argparse.Namespace, vocab: int, out: str) -> None:
    import gemma_engine

    torch.set_num_threads(args.threads)
    split = {}
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
        split = {"tensor_parallel_size": world, "tensor_parallel_rank": rank,
                 "tensor_parallel_group": dist.group.WORLD.group_name}
    engine = gemma_engine.Engine(model_dir, like=torch.zeros(1), context=args.prompt + args.new + 8,
                                 dtype=args.dtype, max_batch=args.batch, prefix_caching=False, **split)
    decode_rate(engine, args.batch, args.prompt, 4, vocab)  # warm-up
    decode, read = [], []
    for _ in range(args.repeats):
        rate, tokens = decode_rate(engine, args.batch, args.prompt, args.new, vocab)
        decode.append(rate)
        _, _, read_s, _ = engine.decode(prompts(1, args.prompt, vocab)[0], 1)
        read.append(args.prompt / read_s)
    if rank == 0:
        torch.save({"decode": statistics.median(decode), "read": statistics.median(read), "tokens": tokens}, out)
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts (1 is the baseline)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args(argv)
    import multiprocessing

    config = make_config(args.config)
    worlds = [int(n) for n in args.ranks.split(",")]
    print(f"config {args.config}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocabulary "
          f"{config.vocab_size}; {args.dtype}, batch {args.batch}; {args.threads} thread(s) a rank on "
          f"{os.cpu_count()} cores")
    reduce_bytes, gather_bytes = step_payload(config, args.batch, args.dtype)
    print(f"collective payload per decode step: all-reduces {reduce_bytes / 1024:,.1f} KiB, logits all-gather "
          f"{gather_bytes / 1024:,.1f} KiB")
    ctx = multiprocessing.get_context("spawn")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        random_model(config, "cpu").to(getattr(torch, args.dtype)).save_pretrained(tmp)
        for world in worlds:
            out, port = os.path.join(tmp, f"tp{world}.pt"), _free_port()
            procs = [ctx.Process(target=_rank, args=(r, world, port, tmp, args, config.vocab_size, out))
                     for r in range(world)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            if any(p.exitcode for p in procs):
                raise SystemExit(f"TP {world}: a rank exited {[p.exitcode for p in procs]}")
            results[world] = torch.load(out)
            sent = (2 * reduce_bytes + gather_bytes) * (world - 1) / world
            print(f"TP {world}: decode {results[world]['decode']:.1f} tok/s, prompt read {results[world]['read']:.0f} "
                  f"tok/s (medians of {args.repeats}); each rank sends {sent / 1024:,.1f} KiB a step", flush=True)
    base = results.get(1)
    if base:
        for world in (w for w in worlds if w > 1):
            r = results[world]
            same = r["tokens"] == base["tokens"]
            # Per step: a decode step makes every request one token.
            extra_ms = 1000 * args.batch * (1 / r["decode"] - 1 / base["decode"])
            collectives = 2 * config.num_hidden_layers + 1
            print(f"TP {world} / TP 1: decode {r['decode'] / base['decode']:.2f}x ({extra_ms:+.2f} ms a step, "
                  f"{extra_ms / collectives:+.3f} ms for each of its {collectives} collectives), prompt read "
                  f"{r['read'] / base['read']:.2f}x; tokens {'equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
