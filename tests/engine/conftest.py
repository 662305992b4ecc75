"""Fixtures for the engine tests: the three tiny checkpoints as (model_dir, emb_dir) pairs and their
Transformers references.

The checkpoints come from tests/checkpoints/ (session fixtures: fixtures.py).
"""

import pytest
import torch

from tests.checkpoints.parity import load_hf_reference
from tests.checkpoints.shared import one_thread


@pytest.fixture(scope="session")
def checkpoint_dirs(dense_checkpoint, w4a16_checkpoint, emb4_checkpoint):
    """{kind: (model_dir, emb_dir or None)} for kind in dense, w4a16, emb4."""
    return {
        "dense": (dense_checkpoint, None),
        "w4a16": (w4a16_checkpoint, None),
        "emb4": emb4_checkpoint,
    }


@pytest.fixture(scope="session")
def reference_model(checkpoint_dirs):
    """reference_model(kind, dtype) -> the Transformers model for that checkpoint (cached)."""
    cache = {}

    def get(kind, dtype=torch.float32):
        if (kind, dtype) not in cache:
            model_dir, emb_dir = checkpoint_dirs[kind]
            cache[kind, dtype] = load_hf_reference(model_dir, emb_dir, dtype)
        return cache[kind, dtype]

    return get


@pytest.fixture(autouse=True)
def _one_thread():
    """Run the engine's ATen ops on one thread: the tiny model gains nothing from more, and on a
    loaded machine OpenMP barriers made these runs 5-8 times slower with two (the tokens do not
    depend on it; see tests/checkpoints/shared.py `one_thread`)."""
    with one_thread():
        yield
