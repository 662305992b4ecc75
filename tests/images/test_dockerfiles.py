"""No image can be built here (no Docker daemon), so the Dockerfiles are parsed and checked against the
code they package: entrypoints, users, paths and every pinned version.

What must agree, and with what:
- the server image's ENTRYPOINT is the command the operator's Deployment runs and the tests start
  (`python -m gemma_server`); its uid/gid are the pod securityContext the operator builds; its cache
  paths are the env the operator sets, created and owned by that user; GEMMA_ENGINE_SRC is where rust/ is
  copied; nothing builds the engine at image build time (the boot stage does);
- the operator image's ENTRYPOINT is `python -m gemma_operator`, its uid is the chart's runAsUser, and
  it installs only the operator distribution, constrained by the lock;
- versions: Python (Makefile for the operator; 3.14 for torch_tpu on the server), torch (the lock's),
  torch_tpu/libtpu, maturin (rust/pyproject.toml's build requirement), every package of
  images/server-requirements.txt that the lock also pins, the Rust toolchain (edition 2024 needs 1.85).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

from gemma_operator import builders
from gemma_operator import spec as grs_spec
from gemma_server.config import parse_config

from .dockerfile import parse_dockerfile

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"


def lock_pins() -> dict[str, str]:
    return requirement_pins((ROOT / "requirements" / "dev.lock").read_text())


def requirement_pins(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if m:
            pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


def server_deployment() -> dict:
    spec = grs_spec.parse_spec({"model": {"source": "hf://org/model"}})
    return builders.build_deployment(spec, builders.Meta("gemma", "default"))


OPERATOR = parse_dockerfile(IMAGES / "Dockerfile.operator")
SERVER = parse_dockerfile(IMAGES / "Dockerfile.server")


# ------------------------------------------------------------------------------------------- server image


def test_server_entrypoint_is_the_command_the_operator_runs_and_the_tests_start():
    entry = SERVER.final.exec_form("ENTRYPOINT")
    (container,) = server_deployment()["spec"]["template"]["spec"]["containers"]
    assert entry == ["python", "-m", "gemma_server"]
    assert container["command"] == entry
    # tests/server/conftest.py's `spawn` starts `sys.executable -m gemma_server`.
    spawn = (ROOT / "tests" / "server" / "conftest.py").read_text()
    assert '[sys.executable, "-m", "gemma_server"' in spawn


def test_server_runs_as_the_non_root_user_the_operator_pod_asks_for():
    user = SERVER.final.last("USER")
    uid, _, gid = user.partition(":")
    pod_sc = server_deployment()["spec"]["template"]["spec"]["securityContext"]
    assert uid.isdigit() and int(uid) != 0, f"USER must be a numeric non-root uid, got {user!r}"
    assert int(uid) == pod_sc["runAsUser"] and int(gid) == pod_sc["runAsGroup"] == pod_sc["fsGroup"]
    assert f"useradd --uid {uid} --gid {gid}" in SERVER.final.runs()


def test_server_cache_paths_are_the_operators_mount_and_writable_by_the_user():
    env = SERVER.final.env()
    (container,) = server_deployment()["spec"]["template"]["spec"]["containers"]
    pod_env = {e["name"]: e.get("value") for e in container["env"]}
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "build-cache")
    for var in ("GEMMA_BUILD_CACHE", "HF_HOME"):
        assert env[var] == pod_env[var], f"{var}: image {env[var]!r}, operator {pod_env[var]!r}"
        assert env[var].startswith(mount + "/")
    uid = SERVER.final.last("USER")
    runs = SERVER.final.runs()
    assert f"mkdir -p {env['GEMMA_BUILD_CACHE']} {env['HF_HOME']}" in runs
    assert f"chown -R {uid} " in runs and mount in runs.split(f"chown -R {uid} ", 1)[1].split("\n")[0]


def test_server_port_matches_the_operator_default():
    env = SERVER.final.env()
    assert int(env["GEMMA_PORT"]) == grs_spec.ServerSpec().port
    assert SERVER.final.last("EXPOSE") == env["GEMMA_PORT"]
    assert parse_config(["--model", "m"], {"GEMMA_PORT": env["GEMMA_PORT"]}).port == int(env["GEMMA_PORT"])


def test_server_engine_sources_are_copied_where_the_server_looks():
    env = SERVER.final.env()
    copies = dict(reversed(c.split()) for c in SERVER.final.all("COPY") if not c.startswith("--from"))
    assert copies[env["GEMMA_ENGINE_SRC"] + "/"] == "rust/"
    assert (ROOT / "rust" / "Cargo.toml").is_file() and (ROOT / "rust" / "Cargo.lock").is_file()
    assert parse_config(["--model", "m"], env).engine_src == env["GEMMA_ENGINE_SRC"]
    # Side by side as in the checkout, which is also the server's default without the variable.
    assert copies["/opt/gemma-rust-operator/server/"] == "server/"


def test_server_image_does_not_build_the_engine():
    runs = SERVER.final.runs()
    for builder in ("maturin build", "maturin develop", "cargo build", "pip install /opt/gemma-rust-operator/rust"):
        assert builder not in runs, f"the image must not run {builder!r}: the boot stage builds the engine"
    assert "cargo fetch --locked" in runs  # crates are fetched so the boot build needs no network
    assert SERVER.final.env()["CARGO_NET_OFFLINE"] == "true"


def test_server_python_is_one_torch_tpu_supports_and_the_seed_rig_ran():
    m = re.fullmatch(r"python:(3\.(\d+)\.\d+)-slim-\w+", SERVER.final.base)
    assert m, f"server base must be python:<x.y.z>-slim-<debian>, got {SERVER.final.base}"
    assert m.group(1).startswith("3.14."), "torch_tpu 0.2.0's newest wheels are for Python 3.14 (seed rig)"
    compiled = (IMAGES / "server-requirements.txt").read_text().splitlines()[1]
    assert "--python-version 3.14" in compiled


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
    # The image installs exactly this file, then the server without resolving again.
    runs = SERVER.final.runs()
    assert "pip install --requirement /tmp/build/server-requirements.txt" in runs
    assert "pip install --no-deps /opt/gemma-rust-operator/server" in runs


def test_server_rust_toolchain_is_pinned_and_new_enough_for_the_crate():
    version = SERVER.args["RUST_VERSION"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), f"RUST_VERSION must be exact, got {version!r}"
    assert SERVER.stages[0].base == f"rust:{version}-slim-trixie"
    cargo = tomllib.loads((ROOT / "rust" / "Cargo.toml").read_text())["package"]
    if cargo.get("edition") == "2024":
        assert tuple(map(int, version.split("."))) >= (1, 85, 0), "edition 2024 needs Rust 1.85"
    toolchain = ROOT / "rust" / "rust-toolchain.toml"
    if toolchain.is_file():
        assert tomllib.loads(toolchain.read_text())["toolchain"]["channel"] == version
    assert {"/usr/local/rustup", "/usr/local/cargo"} <= {c.split()[-1] for c in SERVER.final.all("COPY")
                                                         if c.startswith("--from=rust")}


# ------------------------------------------------------------------------------------------- operator image


def test_operator_entrypoint_is_python_m_gemma_operator():
    assert OPERATOR.final.exec_form("ENTRYPOINT") == ["python", "-m", "gemma_operator"]
    assert (ROOT / "operator" / "gemma_operator" / "__main__.py").is_file()
    cmd = OPERATOR.final.exec_form("CMD")
    assert cmd == ["--liveness=http://0.0.0.0:8080/healthz"]
    assert OPERATOR.final.last("EXPOSE") == "8080"


def test_operator_runs_as_the_charts_non_root_user():
    values = yaml.safe_load((ROOT / "charts" / "gemma-rust-operator" / "values.yaml").read_text())
    uid, _, gid = OPERATOR.final.last("USER").partition(":")
    assert int(uid) != 0
    assert int(uid) == values["podSecurityContext"]["runAsUser"]
    assert int(gid) == values["podSecurityContext"]["runAsGroup"]


def test_operator_python_is_the_one_the_tests_run():
    makefile = (ROOT / "Makefile").read_text()
    wanted = re.search(r"^PYTHON\s*\?=\s*python(3\.\d+)", makefile, re.M).group(1)
    m = re.fullmatch(r"python:(\d+\.\d+)\.\d+-slim-\w+", OPERATOR.final.base)
    assert m and m.group(1) == wanted, f"operator base {OPERATOR.final.base} is not Python {wanted}"


def test_operator_image_installs_only_the_operator_under_the_lock():
    runs = OPERATOR.final.runs()
    copies = [c.split()[0] for c in OPERATOR.final.all("COPY")]
    assert copies == ["requirements/dev.lock", "operator/"]
    assert "pip install --constraint /tmp/build/dev.lock /tmp/build/operator" in runs
    for heavy in ("torch", "server", "rust", "maturin"):
        assert heavy not in runs, f"the operator image must not install {heavy}"
    deps = tomllib.loads((ROOT / "operator" / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not any(d.startswith(("torch", "transformers")) for d in deps)
    # The lock pins every transitive dependency of the operator's (a constraint cannot pin what it lacks).
    lock = lock_pins()
    for d in deps:
        assert re.sub(r"[-_.]+", "-", d.split("==")[0]).lower() in lock


def test_build_contexts_are_filtered_per_dockerfile():
    for name, wanted in (("operator", {"requirements/dev.lock", "operator/"}),
                         ("server", {"images/server-requirements.txt", "server/", "rust/"})):
        lines = [ln for ln in (IMAGES / f"Dockerfile.{name}.dockerignore").read_text().splitlines()
                 if ln and not ln.startswith("#")]
        assert lines[0] == "*"
        assert {ln[1:] for ln in lines if ln.startswith("!")} == wanted
        copied = {c.split()[0] for c in parse_dockerfile(IMAGES / f"Dockerfile.{name}").final.all("COPY")
                  if not c.startswith("--from")}
        assert copied == wanted


@pytest.mark.parametrize("dockerfile", [OPERATOR, SERVER], ids=["operator", "server"])
def test_base_images_are_pinned_to_exact_versions(dockerfile):
    for stage in dockerfile.stages:
        assert re.search(r":\d+\.\d+\.\d+-", stage.base), f"{stage.base} is not pinned to x.y.z"
