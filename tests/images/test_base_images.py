"""Which base images the Dockerfiles need, and the stand-in recipe for each (pure; no Docker needed)."""

from __future__ import annotations

import pytest

from tests.images.base_images import STANDINS, StandInError, base_images, standin_for
from tests.images.dockerfile import parse_dockerfile
from tests.images.containers import ROOT


def test_the_bases_are_every_external_from_of_both_dockerfiles():
    server = parse_dockerfile(ROOT / "images" / "Dockerfile.server")
    operator = parse_dockerfile(ROOT / "images" / "Dockerfile.operator")
    assert base_images() == [operator.final.base, server.stages[0].base]
    assert {b.split(":")[0] for b in base_images()} == {"python", "rust"}


def test_a_python_stand_in_is_debians_python_of_the_same_minor_version():
    s = standin_for("python:3.11.7-slim-bookworm")
    assert (s.suite, s.dockerfile, s.build_args) == ("bookworm", STANDINS / "python.Dockerfile",
                                                      (("PYTHON_MINOR", "3.11"),))


def test_a_rust_stand_in_installs_the_exact_toolchain():
    s = standin_for("rust:1.95.0-slim-bookworm")
    assert (s.suite, s.dockerfile, s.build_args) == ("bookworm", STANDINS / "rust.Dockerfile",
                                                      (("RUST_VERSION", "1.95.0"),))


@pytest.mark.parametrize("image,message", [
    ("python:3.14.10-slim-trixie", "Debian trixie ships Python 3.13, not 3.14"),
    ("python:3.11-slim", "not of the form <x.y.z>-slim-<debian>"),
    ("golang:1.26.0-slim-bookworm", "no stand-in recipe for the image 'golang'"),
])
def test_an_image_without_a_faithful_stand_in_is_refused_by_name(image, message):
    with pytest.raises(StandInError, match=message):
        standin_for(image)
