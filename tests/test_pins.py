"""Every distribution pins the same versions as the test environment's lock.

The operator and server distributions are installed on their own in the
images; their pins must be the versions the tests ran with.
"""

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def locked_versions() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements/dev.lock").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if m:
            pins[normalise(m.group(1))] = m.group(2)
    return pins


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize("dist", ["operator", "server"])
def test_distribution_pins_match_the_lock(dist):
    project = tomllib.loads((ROOT / dist / "pyproject.toml").read_text())["project"]
    locked = locked_versions()
    assert project["dependencies"], f"{dist}/pyproject.toml lists no dependencies"
    for requirement in project["dependencies"]:
        name, _, version = requirement.partition("==")
        assert version, f"{dist}: {requirement!r} is not pinned with =="
        assert locked.get(normalise(name)) == version, (
            f"{dist}: {name}=={version} but requirements/dev.lock has {locked.get(normalise(name))}"
        )


def test_operator_distribution_needs_no_torch():
    deps = tomllib.loads((ROOT / "operator/pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if normalise(d).startswith(("torch", "transformers"))]
