"""Session-wide test configuration: markers, the `cluster` marker on every test on the control plane, and the GPU
skip rule.

Nothing skips except tests marked `gpu` on a machine without CUDA.
"""

import pytest

# Checkpoints built at test time (tests/checkpoints/fixtures.py) and the local control
# plane (tests/cluster/), started once per session by the `cluster` fixture.
pytest_plugins = ("tests.checkpoints.fixtures", "tests.cluster.plugin")


@pytest.hookimpl(tryfirst=True)  # before pytest's own `-m` selection reads the markers
def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:
        # A test on the control plane is a `cluster` test, marked or not: `make test` runs the others first, while
        # the control plane's binaries build (tests/run_all.sh).
        if "cluster" in item.fixturenames:
            item.add_marker(pytest.mark.cluster)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; torch.cuda.is_available() is False here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
