"""Type stub for `gemma_engine`, the Rust Gemma 4 engine over PyTorch's ATen.

This file is the contract between the engine (rust/) and its callers (the
server, the tests, the benchmarks). Change it together with rust/src/bindings.rs.
It lives beside the package's __init__.py (maturin's mixed Rust/Python layout:
gemma_engine/__init__.py checks the torch version, then loads gemma_engine._native).

Tensor arguments (`like`, `a`, `b`, `t`) must be torch.Tensor: anything else is TypeError.
"""

from collections.abc import Callable, Sequence
from typing import Literal

import torch

__version__: str

BUILD: dict[str, str]
"""What built this module: keys "torch", "rustc", "python", "crate".

Importing the module under a torch other than BUILD["torch"] raises ImportError
naming both versions.
"""

def smoke(like: torch.Tensor) -> dict[str, float | str]:
    """Run one Rust ATen call on `like`'s device and report it.

    Computes sum(ones(8, 64) @ ones(64, 8)) on the device of `like`.

    Returns:
        {"value": 4096.0, "device": "<device of the result, e.g. cpu, cuda:0>"}
    Raises:
        RuntimeError: the device failed the computation.
    """

def matmul_sum(a: torch.Tensor, b: torch.Tensor) -> float:
    """sum(a @ b) computed by ATen from Rust; a and b cross without copies.

    Raises:
        ValueError: the shapes do not multiply (ATen's message, with both shapes).
    """

def add_(t: torch.Tensor, value: float) -> None:
    """Add `value` to `t` in place from Rust: proves tensors share storage."""

Finish = Literal["stop", "length", "cancelled"]

class Engine:
    """One Gemma 4 text model and one fixed-shape ring KV cache.

    `#[pyclass(unsendable)]`: only the thread that built it may call it; a call
    from another thread raises pyo3's PanicException.
    """

    def __init__(
        self,
        model_dir: str,
        emb_dir: str | None = None,
        like: torch.Tensor | None = None,
        context: int = 8192,
        dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16",
        prefill_chunk: int = 256,
    ) -> None:
        """Load a checkpoint directory (config.json + *.safetensors).

        Args:
            model_dir: dense bf16/f32 or compressed-tensors W4A16 checkpoint.
            emb_dir: optional directory holding int4 `embed_tokens` /
                `embed_tokens_per_layer` tables that replace the model's own.
            like: a tensor on the target device (e.g. torch.zeros(1, device="cuda"));
                every weight and the cache follow it. Default: CPU.
            context: ring size of full-attention layers = the most tokens
                (prompt + generated) one decode can hold.
            dtype: compute dtype.
            prefill_chunk: prompt tokens read per forward.
        Raises:
            ValueError: bad config key, missing or misshapen tensor (named, with
                the expected shape), bad dtype, context < 1, prefill_chunk < 1.
        """

    @property
    def eos_ids(self) -> list[int]: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def context(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def device(self) -> str: ...

    def layout(self) -> dict[str, int]:
        """{"full_rings", "sliding_rings", "shared_layers", "context", "sliding_window"}."""

    def decode(
        self,
        ids: Sequence[int],
        max_new: int,
        stop_ids: Sequence[int] = (),
        read_every: int = 1,
        on_tokens: Callable[[list[int]], object] | None = None,
    ) -> tuple[list[int], Finish, float, float]:
        """Greedy decode from a fresh cache.

        Reads the prompt in chunks of `prefill_chunk`, then generates until a
        token in eos_ids or stop_ids (that token is not returned nor passed to
        on_tokens: "stop"), `max_new` tokens, or a full context, i.e. prompt +
        generated == context ("length"). Tokens come back to the host every
        `read_every` steps; `on_tokens(batch)` is called with each batch and a
        falsy return cancels ("cancelled"). The GIL is released while the device
        works and re-taken only for the callback. The tokens do not depend on
        read_every or prefill_chunk.

        Returns:
            (tokens, finish, read_s, decode_s): generated ids, "stop" | "length" |
            "cancelled", seconds reading the prompt, seconds generating.
        Raises:
            ValueError: empty prompt, max_new < 1, read_every < 1, a prompt of
                `context` tokens or more, a token id outside [0, vocab_size).
            Exception: whatever `on_tokens` raised.
        """

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """float32 [vocab_size] logits (after softcap) for the token after `ids`,
        from a fresh cache, on the host. For parity checks.

        Raises:
            ValueError: as for decode.
        """
