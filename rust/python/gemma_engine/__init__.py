"""gemma_engine: the Rust Gemma 4 engine over PyTorch's ATen (see rust/README.md).

The native module links the libtorch it was compiled against, whose C++ ABI changes between
torch releases, so this wrapper imports torch first and refuses to load the native module
under any other torch version. The API is documented in `__init__.pyi` next to this file.
"""

import torch

from ._build import TORCH_VERSION as _BUILT_TORCH

if torch.__version__ != _BUILT_TORCH:
    raise ImportError(
        f"gemma_engine was built against torch {_BUILT_TORCH} but torch {torch.__version__} "
        "is installed; rebuild it (make engine)"
    )

from ._native import BUILD, Engine, __version__, add_, matmul_sum, smoke  # noqa: E402

__all__ = ["BUILD", "Engine", "__version__", "add_", "matmul_sum", "smoke"]
