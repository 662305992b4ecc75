"""Fixtures for the image tests: a Docker engine, the base images, and both images built from the
unmodified Dockerfiles.

`make test` runs pytest under tests/images/docker_engine.sh, which starts dockerd when none answers. Without
an engine these fixtures fail (never skip), naming what is missing. The first build of the server image
downloads torch (~3 GB of wheels) and takes minutes; later builds reuse Docker's layer cache and uv's
cache mount (images/Dockerfile.server) and take seconds.

Build and boot times are printed in pytest's terminal summary ("image tests: times").
"""

from __future__ import annotations

import pytest

from tests.images import base_images
from tests.images.containers import ROOT, Build, build, engine_answers, image_size

OPERATOR_TAG = "gemma-rust-operator/gemma-rust-operator:test"
SERVER_TAG = "gemma-rust-operator/gemma-server:test"
BUILD_TIMEOUT = 3600

TIMES: list[str] = []


def record(line: str) -> None:
    """A line for the terminal summary (and the live log)."""
    TIMES.append(line)
    print(line)


def pytest_terminal_summary(terminalreporter):
    if TIMES:
        terminalreporter.section("image tests: times")
        for line in TIMES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def docker_engine() -> None:
    why = engine_answers()
    if why:
        pytest.fail(f"the image tests need a Docker engine, and none answers: {why}\n"
                    "`make test` starts one (tests/images/docker_engine.sh; install Debian's docker.io, as "
                    ".ci/run does)", pytrace=False)


@pytest.fixture(scope="session")
def bases(docker_engine) -> None:
    """The images the Dockerfiles start FROM: pulled, or built here as stand-ins (tests/images/base_images.py)."""
    try:
        for image in base_images.base_images():
            record(base_images.ensure(image))
    except base_images.StandInError as e:
        pytest.fail(str(e), pytrace=False)


def _build(name: str, tag: str) -> Build:
    b = build(ROOT / "images" / f"Dockerfile.{name}", tag, timeout=BUILD_TIMEOUT)
    record(f"{name} image: built in {b.seconds:.1f}s, {image_size(b.image) / 1e9:.2f} GB ({b.image[:19]})")
    return b


@pytest.fixture(scope="session")
def operator_image(bases) -> Build:
    return _build("operator", OPERATOR_TAG)


@pytest.fixture(scope="session")
def server_image(bases) -> Build:
    return _build("server", SERVER_TAG)
