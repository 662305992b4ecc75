"""Session fixtures of the tiny checkpoints, a pytest plugin (tests/conftest.py registers it): each builds its
checkpoint once per session in a temporary directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoints.agent import save_agent_chat, save_gemma4_chat
from tests.checkpoints.chat import save_chat
from tests.checkpoints.multimodal import save_multimodal
from tests.checkpoints.parity import PARITY_PROMPT
from tests.checkpoints.quantized import save_w4a16, save_w4a16_emb4
from tests.checkpoints.text import SMALL_LAYERS, save_dense


@pytest.fixture(scope="session")
def dense_checkpoint(tmp_path_factory) -> Path:
    """Directory of the dense bf16 tiny checkpoint (``save_dense``)."""
    return save_dense(tmp_path_factory.mktemp("dense"))


@pytest.fixture(scope="session")
def w4a16_checkpoint(tmp_path_factory) -> Path:
    """Directory of the W4A16 tiny checkpoint (``save_w4a16``), same random model as the dense one."""
    return save_w4a16(tmp_path_factory.mktemp("w4a16"))


@pytest.fixture(scope="session")
def emb4_checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    """(model_dir, emb_dir) of ``save_w4a16_emb4``: the W4A16 checkpoint and its int4 tables."""
    root = tmp_path_factory.mktemp("emb4")
    return save_w4a16_emb4(root / "model", root / "emb4")


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory) -> Path:
    """Directory of the chat checkpoint (``save_chat``): dense model plus tokenizer and chat template."""
    return save_chat(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="session")
def small_chat_checkpoint(tmp_path_factory) -> Path:
    """The chat checkpoint's tokenizer and template over 4 layers (``text.SMALL_LAYERS``): for tests that compile
    many step shapes with Inductor, whose compile time grows with the layers."""
    return save_chat(tmp_path_factory.mktemp("small_chat"), **SMALL_LAYERS)


@pytest.fixture(scope="session")
def agent_checkpoint(tmp_path_factory) -> Path:
    """Directory of the agent checkpoint (``save_agent_chat``): Gemma 4's tool and thinking markers."""
    return save_agent_chat(tmp_path_factory.mktemp("agent"))


@pytest.fixture(scope="session")
def gemma4_checkpoint(tmp_path_factory) -> Path:
    """Directory of a checkpoint with Google's Gemma 4 template that reads tool results from the model turn
    (`tool_responses`) and has no `tool` role (``save_gemma4_chat``)."""
    from tests.fetch_chat_templates import INTERLEAVED, template_path

    return save_gemma4_chat(tmp_path_factory.mktemp("gemma4"), template_path(INTERLEAVED).read_text())


@pytest.fixture(scope="session")
def multimodal_checkpoint(tmp_path_factory) -> Path:
    """Directory of the tiny checkpoint with both towers, Google's Gemma 4 template and Transformers' processor
    configuration (``save_multimodal``)."""
    from tests.fetch_chat_templates import TOOL_ROLE, template_path

    return save_multimodal(tmp_path_factory.mktemp("multimodal"), template_path(TOOL_ROLE).read_text())


@pytest.fixture(scope="session")
def multimodal_w4a16_checkpoint(tmp_path_factory) -> Path:
    """``multimodal_checkpoint`` with every Linear, the towers' too, int4 pack-quantized in groups of 16."""
    from tests.fetch_chat_templates import TOOL_ROLE, template_path

    return save_multimodal(tmp_path_factory.mktemp("multimodal-w4a16"), template_path(TOOL_ROLE).read_text(),
                           w4a16_group=16)


@pytest.fixture(scope="session")
def multimodal_bidirectional_checkpoint(tmp_path_factory) -> Path:
    """``multimodal_checkpoint`` with ``use_bidirectional_attention="vision"``, as the 31B and 26B-A4B set it."""
    from tests.fetch_chat_templates import TOOL_ROLE, template_path

    return save_multimodal(tmp_path_factory.mktemp("multimodal-bidirectional"), template_path(TOOL_ROLE).read_text(),
                           bidirectional=True)


@pytest.fixture(scope="session")
def parity_prompt() -> list[int]:
    """The fixed parity prompt: bos plus 27 ids, longer than the 12-token sliding window."""
    return list(PARITY_PROMPT)
