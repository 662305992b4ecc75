"""Session-wide test configuration: markers and the GPU skip rule.

Nothing skips except tests marked `gpu` on a machine without CUDA.
"""

import pytest

# Checkpoints built at test time (tests/checkpoints/fixtures.py) and the local control
# plane (tests/cluster/), started once per session by the `cluster` fixture.
pytest_plugins = ("tests.checkpoints.fixtures", "tests.cluster.plugin")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; torch.cuda.is_available() is False here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
