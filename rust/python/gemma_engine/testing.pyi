"""Type stub for `gemma_engine.testing`: the engine's internals reached from Python for tests and benchmarks.

Nothing that serves requests calls these (the server, the operator and the engine's own loop use the
`gemma_engine` API of __init__.pyi). They are there to check or measure one piece alone: a tensor round trip
through ATen, the kernels the model calls, the sampler on given logits, the collectives tensor parallelism
takes, and the shim's count of operator calls. Change this file together with rust/src/bindings.rs, as
__init__.pyi: tests/engine/test_stub.py checks both.

Tensor arguments (`a`, `b`, `t`, `x`, `q`, ...) must be torch.Tensor: anything else is TypeError.
"""

from collections.abc import Sequence

import torch

from gemma_engine import SamplingParams

def matmul_sum(a: torch.Tensor, b: torch.Tensor) -> float:
    """sum(a @ b) computed by ATen from Rust; a and b cross without copies.

    Raises:
        ValueError: the shapes do not multiply (ATen's message, with both shapes).
    """

def add_(t: torch.Tensor, value: float) -> None:
    """Add `value` to `t` in place from Rust: proves tensors share storage."""

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """The engine's RMSNorm over the last dim, as Gemma 4 computes it: in float32,
    `x * (mean(x**2) + eps) ** -0.5 * weight`, rounded once to x's dtype. On the CPU, up to 4,096
    values, one pass a row (ATen's `rms_norm` there is eight kernels); otherwise `at::rms_norm`.

    Raises:
        ValueError: a weight whose size is not the last dim's, or an x that is not floating point.
    """

def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float = 1.0
) -> torch.Tensor:
    """The engine's attention: `scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
    enable_gqa=True)`, except for bfloat16 and float16 on the CPU with at most 16 query rows a
    sequence, which run in float32 through two matrix products and a softmax (ATen's CPU kernel
    is several times slower there). q `[rows, heads, T, d]`, k and v `[rows, kv_heads, keys, d]`,
    mask bool `[rows or 1, 1, T, keys]` (true: visible).

    Raises:
        ValueError: shapes or dtypes that do not fit together (ATen's message).
    """

def sample(
    logits: torch.Tensor, rows: Sequence[tuple[SamplingParams, Sequence[int], Sequence[int], int]]
) -> tuple[list[int], torch.Tensor]:
    """Run the engine's sampler on given logits, for tests against Transformers' processors.

    Args:
        logits: float [n, vocab], one row per draw.
        rows: per row (params, prompt ids, ids generated so far, draw index): the prompt and the
            output ids feed the penalties, the draw index the seeded uniform number.
    Returns:
        (tokens, probs): the token each row draws, and the float32 [n, vocab] distribution it
        draws from (after bias, penalties, temperature, top-k, top-p and min-p).
    Raises:
        ValueError: shapes that do not match, or a parameter out of range (named).
    """

def uniform(seeds: Sequence[int], steps: Sequence[int]) -> list[float]:
    """The uniform number in [0, 1) the sampler draws token `step` of a request seeded `seed` with:
    the (step + 1)-th output of splitmix64 started at `seed`, top 24 bits / 2**24."""

def aten_calls() -> int:
    """ATen operator calls the engine has made in this process, on every thread. Each costs the
    device a fixed amount (a kernel launch on CUDA, a dispatch on TPU) whatever its size, so the
    calls a decode step makes are a device-independent measure of its host-side work; handle
    copies and shape reads are not counted. `bench/engine.py` prints it per step and per layer."""

def all_reduce_sum(t: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of `t` over the ranks of torch.distributed's process group `group_name` (as
    `torch.distributed.group.WORLD.group_name`), called from Rust through the dispatcher op
    `_c10d_functional.all_reduce`: the collective path tensor parallelism across processes takes, which a
    dispatcher-level capture records. For tests of that path.

    Raises:
        ValueError: no process group of that name, or a tensor its backend cannot reduce (torch's message).
    """

def all_gather_last(t: torch.Tensor, size: int, group_name: str) -> torch.Tensor:
    """The ranks' `t` of torch.distributed's process group `group_name` (of `size` ranks) side by side along
    the last dimension, in rank order (how a vocabulary-parallel head joins its logits), called from Rust
    through the dispatcher op `_c10d_functional.all_gather_into_tensor`. For tests of that path.

    Raises:
        ValueError: no process group of that name, a size that is not the group's, or a tensor its backend
            cannot gather (torch's message).
    """
