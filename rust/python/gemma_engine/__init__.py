"""gemma_engine: the Rust Gemma 4 engine over PyTorch's ATen (see rust/README.md).

The native module links the libtorch it was compiled against, whose C++ ABI changes between
torch releases, so this wrapper imports torch first and refuses to load the native module
under any other torch version. The API is documented in `__init__.pyi` next to this file; functions for
tests and benchmarks alone are in `gemma_engine.testing` (testing.py, testing.pyi).
"""

from pathlib import Path

import torch

from ._build import TORCH_VERSION as _BUILT_TORCH

if torch.__version__ != _BUILT_TORCH:
    raise ImportError(
        f"gemma_engine was built against torch {_BUILT_TORCH} but torch {torch.__version__} "
        "is installed; rebuild it (make engine)"
    )

from ._native import (  # noqa: E402
    BUILD,
    LIMITS,
    Encoder,
    Engine,
    Event,
    Grammars,
    Request,
    SamplingParams,
    __version__,
    adopt_storage_,
    smoke,
)

__all__ = [
    "BUILD",
    "LIMITS",
    "Encoder",
    "Engine",
    "Event",
    "Grammars",
    "Request",
    "SamplingParams",
    "__version__",
    "adopt_storage_",
    "smoke",
]


def _host_free_bytes() -> int | None:
    """MemAvailable, bounded by the cgroup v2 limit when the process runs in one (a container)."""
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max" and free is not None:
            free = min(free, int(limit) - used)
    except (OSError, ValueError):
        pass
    return free


def _free_bytes(like: torch.Tensor) -> int | None:
    """Bytes free on `like`'s device, or None where torch cannot tell (the engine then does not check).

    Called by `Engine(...)` after the weights are loaded, to refuse a KV cache that cannot fit.
    """
    if like.device.type == "cuda":
        return torch.cuda.mem_get_info(like.device)[0]
    if like.device.type == "cpu":
        return _host_free_bytes()
    return None
