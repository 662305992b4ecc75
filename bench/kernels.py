"""The engine's own CPU kernels against the ATen calls they replace, at a decode step's shapes, in one run.

    python -m bench.kernels [--repeats 7] [--threads 1]

* norm: `gemma_engine.testing.rms_norm` (one pass a row up to 4,096 values, rust/src/aten.cpp `rms_norm_cpu`) against
  `torch.nn.functional.rms_norm` (ATen's CPU composite), on a hidden row, four of them, and a step's q/k heads;
* attention: `gemma_engine.testing.attention` (16-bit, up to 16 query rows: `few_row_attention`) against
  `scaled_dot_product_attention(..., enable_gqa=True)` with a boolean mask (ATen's CPU flash kernel), one and
  eight sequences over 329 keys, 8 query heads on 2 KV heads of 64.

Each pair alternates call by call in each round; it prints the median microseconds a call of each and the
ratio. tests/engine/test_kernels.py holds the two kernels to their references; this measures only time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

CALLS = 200  # per timing


def per_call_us(f: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    for _ in range(CALLS):
        f()
    return (time.perf_counter() - t0) / CALLS * 1e6


def compare(ours: Callable[[], object], aten: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median microseconds a call of each, the two timed alternately."""
    ours(), aten()  # warm-up
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        times[0].append(per_call_us(ours))
        times[1].append(per_call_us(aten))
    return statistics.median(times[0]), statistics.median(times[1])


def cases(dtype: torch.dtype):
    """(name, engine call, ATen call) at one dtype."""
    from gemma_engine import testing

    gen = torch.Generator().manual_seed(0)
    for shape in ((1, 512), (4, 512), (1, 12, 1, 64)):
        x = torch.randn(*shape, generator=gen).to(dtype)
        w = torch.rand(shape[-1], generator=gen).to(dtype)
        yield (f"norm {tuple(shape)}", lambda x=x, w=w: testing.rms_norm(x, w, 1e-6),
               lambda x=x, w=w: F.rms_norm(x, (x.shape[-1],), w, 1e-6))
    if dtype == torch.float32:
        return  # float32 attention is ATen's SDPA on both sides
    for rows in (1, 8):
        q = torch.randn(rows, 8, 1, 64, generator=gen).to(dtype)
        k, v = (torch.randn(rows, 2, 329, 64, generator=gen).to(dtype) for _ in range(2))
        mask = torch.rand(rows, 1, 1, 329, generator=gen) < 0.9
        yield (f"attention {rows} x 1 over 329", lambda q=q, k=k, v=v, m=mask: testing.attention(q, k, v, m),
               lambda q=q, k=k, v=v, m=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=1.0,
                                                                             enable_gqa=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), medians of {args.repeats} rounds of {CALLS} calls")
    print(f"{'':38}{'engine us':>10}{'ATen us':>10}{'ATen/engine':>13}")
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            for name, ours, aten in cases(dtype):
                a, b = compare(ours, aten, args.repeats)
                print(f"{str(dtype).removeprefix('torch.') + ' ' + name:38}{a:>10.1f}{b:>10.1f}{b / a:>12.2f}x")


if __name__ == "__main__":
    main()
