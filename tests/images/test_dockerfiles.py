"""What building and running the images does not check: that the Dockerfiles agree with the code and pins
they package.

test_server_image.py and test_operator_image.py build both images and run them as the pod specs do; the
pod spec's command, user and environment then override the image's own ENTRYPOINT, USER and ENV. So
these checks read the Dockerfiles:
- each image's ENTRYPOINT, USER and default ENV are what the operator's pod spec and the chart run, so
  that `docker run IMAGE` alone behaves as the pod does;
- the server image keeps the boot build off the network (CARGO_NET_OFFLINE);
- versions: Python (the Makefile's, which torch_tpu supports), torch (the lock's), torch_tpu/libtpu,
  every package of images/server-requirements.txt that the lock also pins, maturin (rust/pyproject.toml's
  build requirement), uv (the Makefile's), and base images pinned to exact versions;
- each build context holds exactly what its Dockerfile copies (a broader one would still build).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

from gemma_operator.builders.deployment import build_deployment
from gemma_operator.builders.ownership import Meta
from gemma_operator import spec as grs_spec
from tests.images.dockerfile import parse_dockerfile

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"
OPERATOR = parse_dockerfile(IMAGES / "Dockerfile.operator")
SERVER = parse_dockerfile(IMAGES / "Dockerfile.server")


def requirement_pins(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if m:
            pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


def lock_pins() -> dict[str, str]:
    return requirement_pins((ROOT / "requirements" / "dev.lock").read_text())


def makefile_python() -> str:
    """The x.y of the Python `make test` runs (Makefile PYTHON)."""
    return re.search(r"^PYTHON\s*\?=\s*python(3\.\d+)", (ROOT / "Makefile").read_text(), re.M).group(1)


def server_pod() -> dict:
    """The pod spec the operator builds for a GemmaRustServer with the defaults."""
    spec = grs_spec.parse_spec({"model": {"source": "hf://org/model"}})
    return build_deployment(spec, Meta("gemma", "default"))["spec"]["template"]["spec"]


def server_container() -> dict:
    (container,) = server_pod()["containers"]
    return container


# ------------------------------------------------------------------------------------------- server image


def test_server_entrypoint_is_the_command_the_operator_runs():
    assert SERVER.final.exec_form("ENTRYPOINT") == server_container()["command"] == ["python", "-m", "gemma_server"]


def test_server_user_is_the_non_root_uid_and_gid_of_the_operators_pod():
    uid, _, gid = SERVER.final.last("USER").partition(":")
    pod = server_pod()["securityContext"]
    assert int(uid) != 0
    assert (int(uid), int(gid)) == (pod["runAsUser"], pod["runAsGroup"])


def test_server_env_defaults_are_the_operators_values():
    env = SERVER.final.env()
    pod_env = {e["name"]: e.get("value") for e in server_container()["env"]}
    for var in ("GEMMA_BUILD_CACHE", "GEMMA_TPU_COMPILE_CACHE", "HF_HOME"):
        assert env[var] == pod_env[var], f"{var}: image {env[var]!r}, operator {pod_env[var]!r}"
    assert int(env["GEMMA_PORT"]) == grs_spec.ServerSpec().port
    assert SERVER.final.last("EXPOSE") == env["GEMMA_PORT"]


def test_server_boot_build_stays_off_the_network():
    # Containers in the tests share the host's network, so only this setting keeps cargo from fetching.
    assert SERVER.final.env()["CARGO_NET_OFFLINE"] == "true"


def test_server_python_is_the_tests_python_and_the_requirements_are_compiled_for_it():
    m = re.fullmatch(r"python:(\d+\.\d+)\.\d+-slim-\w+", SERVER.final.base)
    assert m and m.group(1) == makefile_python(), f"server base {SERVER.final.base} is not Python {makefile_python()}"
    compiled = (IMAGES / "server-requirements.txt").read_text().splitlines()[1]
    assert f"--python-version {makefile_python()} " in compiled


def test_server_requirements_pin_the_locks_versions_and_the_tpu_stack():
    pins = requirement_pins((IMAGES / "server-requirements.txt").read_text())
    lock = lock_pins()
    assert pins["torch"] == lock["torch"]
    assert pins["torch-tpu"] == "0.2.0" and pins["libtpu"] == "0.0.51"
    differ = {k: (v, lock[k]) for k, v in pins.items() if k in lock and lock[k] != v}
    assert not differ, f"images/server-requirements.txt differs from requirements/dev.lock: {differ}"
    server = tomllib.loads((ROOT / "server" / "pyproject.toml").read_text())["project"]["dependencies"]
    for requirement in server:
        name, _, version = requirement.partition("==")
        assert pins[re.sub(r"[-_.]+", "-", name).lower()] == version, requirement
    maturin = tomllib.loads((ROOT / "rust" / "pyproject.toml").read_text())["build-system"]["requires"]
    assert f"maturin=={pins['maturin']}" in maturin


def test_server_image_installs_with_the_makefiles_uv():
    wanted = re.search(r"^UV_VERSION\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert re.findall(r"\buv==(\S+)", SERVER.final.runs()) == [wanted]


# ------------------------------------------------------------------------------------------- operator image


def test_operator_entrypoint_is_python_m_gemma_operator():
    # The chart passes only args; the image's ENTRYPOINT is the command.
    assert OPERATOR.final.exec_form("ENTRYPOINT") == ["python", "-m", "gemma_operator"]


def test_operator_user_is_the_charts_non_root_uid_and_gid():
    values = yaml.safe_load((ROOT / "charts" / "gemma-rust-operator" / "values.yaml").read_text())
    uid, _, gid = OPERATOR.final.last("USER").partition(":")
    assert int(uid) != 0
    assert (int(uid), int(gid)) == (values["podSecurityContext"]["runAsUser"],
                                    values["podSecurityContext"]["runAsGroup"])


def test_operator_python_is_the_tests_python():
    m = re.fullmatch(r"python:(\d+\.\d+)\.\d+-slim-\w+", OPERATOR.final.base)
    assert m and m.group(1) == makefile_python(), f"operator base {OPERATOR.final.base} is not Python {makefile_python()}"


# ------------------------------------------------------------------------------------------- both


def test_build_contexts_hold_exactly_what_each_dockerfile_copies():
    for name, df in (("operator", OPERATOR), ("server", SERVER)):
        lines = [ln for ln in (IMAGES / f"Dockerfile.{name}.dockerignore").read_text().splitlines()
                 if ln and not ln.startswith("#")]
        assert lines[0] == "*", f"Dockerfile.{name}.dockerignore must start by excluding everything"
        allowed = {ln[1:] for ln in lines if ln.startswith("!")}
        copied = {c.split()[0] for c in df.final.all("COPY") if not c.startswith("--from")}
        assert allowed == copied, f"Dockerfile.{name}: context {sorted(allowed)}, copied {sorted(copied)}"


@pytest.mark.parametrize("dockerfile", [OPERATOR, SERVER], ids=["operator", "server"])
def test_base_images_are_pinned_to_exact_versions(dockerfile):
    for stage in dockerfile.stages:
        assert re.fullmatch(r"[a-z]+:\d+\.\d+\.\d+-slim-[a-z]+", stage.base), f"{stage.base} is not pinned to x.y.z"
