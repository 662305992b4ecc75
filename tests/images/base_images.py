"""The base images the Dockerfiles start FROM, made present in the local Docker engine.

Each one is pulled from its registry. Where no registry answers (a build machine behind a firewall that
lets only package mirrors through), a local stand-in is built instead and tagged with the very name the
Dockerfile uses, so images/Dockerfile.* build unmodified; where the base layers came from is then the only
difference from the image a user builds. A stand-in is made from Debian's packages:

- `gemma-standin/debian:<suite>-<key>`: `debootstrap --variant=minbase <suite>` from the Debian mirror,
  `docker import`ed (about 80 s). It trusts the host's local certificate authorities
  (/usr/local/share/ca-certificates, Debian's place for them), as the host's own apt, pip and cargo do,
  so the builds on top of it reach the package registries through the same TLS-inspecting proxy, if any.
  The root filesystem's tarball is cached in `$GEMMA_CACHE/base-images/` (default
  ~/.cache/gemma-rust-operator), keyed by its recipe;
- `python:<x.y.z>-slim-<suite>`: tests/images/standins/python.Dockerfile, Debian's CPython of the same
  minor version (so only the minor version is reproduced, not the patch release);
- `rust:<x.y.z>-slim-<suite>`: tests/images/standins/rust.Dockerfile, the exact toolchain by rustup, as the
  official image installs it.

A stand-in carries the label `dev.gemmarust.standin-recipe` (its recipe's hash): one built from an older
recipe is rebuilt, and an image without the label (a real one, pulled earlier) is never replaced.

Standard library only, so it runs before any set-up: `python3 -m tests.images.base_images` (`make
base-images`). Needs a Docker engine (tests/images/docker_engine.sh) and, for stand-ins, root and
debootstrap.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.images.containers import ROOT, client, docker
from tests.images.dockerfile import parse_dockerfile

STANDINS = Path(__file__).with_name("standins")
DOCKERFILES = (ROOT / "images" / "Dockerfile.operator", ROOT / "images" / "Dockerfile.server")
CACHE = Path(os.environ.get("GEMMA_CACHE", Path.home() / ".cache" / "gemma-rust-operator")) / "base-images"
DEBIAN_MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
LABEL = "dev.gemmarust.standin-recipe"
# The CPython each Debian release ships (packages python3.11 in bookworm, python3.13 in trixie).
DEBIAN_PYTHON = {"bookworm": "3.11", "trixie": "3.13"}
LOCAL_CAS = Path("/usr/local/share/ca-certificates")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PULL_TIMEOUT = 900


class StandInError(RuntimeError):
    """A base image could neither be pulled nor stood in for; the message says which and why."""


@dataclass(frozen=True)
class StandIn:
    """How to build a stand-in for one official image."""

    image: str  # the official name, e.g. python:3.11.7-slim-bookworm
    suite: str  # the Debian release its tag names
    dockerfile: Path
    build_args: tuple[tuple[str, str], ...]


def base_images() -> list[str]:
    """Every image a stage of images/Dockerfile.* starts FROM (stages naming an earlier stage excluded)."""
    out: list[str] = []
    for path in DOCKERFILES:
        df = parse_dockerfile(path)
        names = {s.name for s in df.stages if s.name}
        out += [s.base for s in df.stages if s.base not in names and s.base not in out]
    return out


def standin_for(image: str) -> StandIn:
    """The stand-in recipe for an official python or rust slim image (pure).

    Raises:
        StandInError: no recipe for this image, or Debian cannot provide its Python version.
    """
    repo, _, tag = image.partition(":")
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)-slim-([a-z]+)", tag)
    if not m:
        raise StandInError(f"{image}: no stand-in recipe for a tag not of the form <x.y.z>-slim-<debian>")
    version, suite = ".".join(m.groups()[:3]), m.group(4)
    if repo == "python":
        minor = f"{m.group(1)}.{m.group(2)}"
        if DEBIAN_PYTHON.get(suite) != minor:
            raise StandInError(f"{image}: no stand-in, Debian {suite} ships Python {DEBIAN_PYTHON.get(suite, 'unknown')}, "
                               f"not {minor}")
        return StandIn(image, suite, STANDINS / "python.Dockerfile", (("PYTHON_MINOR", minor),))
    if repo == "rust":
        return StandIn(image, suite, STANDINS / "rust.Dockerfile", (("RUST_VERSION", version),))
    raise StandInError(f"{image}: no stand-in recipe for the image {repo!r} (only python and rust)")


def recipe_key(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:16]


def debootstrap_args(suite: str) -> list[str]:
    return ["--variant=minbase", suite]


def local_cas() -> list[Path]:
    return sorted(LOCAL_CAS.glob("*.crt")) if LOCAL_CAS.is_dir() else []


def debian_key(suite: str) -> str:
    """The recipe of the Debian root filesystem: debootstrap's arguments, the mirror and the host's CAs."""
    return recipe_key(*debootstrap_args(suite), DEBIAN_MIRROR,
                      *(part for ca in local_cas() for part in (ca.name, ca.read_bytes())))


def _run(*args: str, timeout: float | None = None, quiet: bool = False) -> subprocess.CompletedProcess:
    print("+", " ".join(args), file=sys.stderr, flush=True)
    return subprocess.run(args, text=True, timeout=timeout,
                          stdout=subprocess.PIPE if quiet else None, stderr=subprocess.PIPE if quiet else None)


def _labels(image: str) -> dict[str, str] | None:
    """The image's labels ({} when it has none), or None when the engine does not have the image."""
    p = docker("image", "inspect", "--format", "{{json .Config.Labels}}", image, check=False)
    return None if p.returncode != 0 else (json.loads(p.stdout) or {})


def debian_base(suite: str) -> str:
    """`gemma-standin/debian:<suite>-<key>` in the engine: imported from the cached debootstrap tarball, made
    first when the cache lacks it."""
    key = debian_key(suite)
    name = f"gemma-standin/debian:{suite}-{key}"
    if _labels(name) is not None:
        return name
    tarball = CACHE / f"debian-{suite}-{key}.tar"
    t0 = time.monotonic()
    if not tarball.is_file():
        if not shutil.which("debootstrap"):
            raise StandInError("building a stand-in needs debootstrap (apt-get install debootstrap; .ci/run does this)")
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE, prefix=f".debian-{suite}.") as tmp:
            rootfs = Path(tmp) / "rootfs"
            p = _run("debootstrap", *debootstrap_args(suite), str(rootfs), DEBIAN_MIRROR)
            if p.returncode != 0:
                raise StandInError(f"debootstrap {suite} from {DEBIAN_MIRROR} failed (exit {p.returncode})")
            (rootfs / LOCAL_CAS.relative_to("/")).mkdir(parents=True, exist_ok=True)
            for ca in local_cas():
                shutil.copy(ca, rootfs / LOCAL_CAS.relative_to("/") / ca.name)
            for leftover in ("var/lib/apt/lists", "var/cache/apt/archives"):
                for f in (rootfs / leftover).glob("*"):
                    if f.is_file():
                        f.unlink()
            partial = Path(tmp) / "rootfs.tar"
            p = _run("tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial), ".")
            if p.returncode != 0:
                raise StandInError(f"tar of the {suite} root filesystem failed (exit {p.returncode})")
            partial.rename(tarball)
    p = _run(client(), "import", "--change", f"ENV PATH={DEFAULT_PATH}", "--change", 'CMD ["bash"]',
             str(tarball), name)
    if p.returncode != 0:
        raise StandInError(f"docker import of {tarball} failed (exit {p.returncode})")
    print(f"{name}: made in {time.monotonic() - t0:.0f}s", file=sys.stderr)
    return name


def build_standin(s: StandIn, key: str) -> None:
    base = debian_base(s.suite)
    args = [f"--build-arg=BASE={base}"] + [f"--build-arg={k}={v}" for k, v in s.build_args]
    p = _run(client(), "build", "--network", "host", "--label", f"{LABEL}={key}", *args,
             "-f", str(s.dockerfile), "-t", s.image, str(STANDINS))
    if p.returncode != 0:
        raise StandInError(f"building the stand-in {s.image} from {s.dockerfile} failed (exit {p.returncode})")


def ensure(image: str) -> str:
    """Make `image` present: kept if there, else pulled, else a stand-in built. Returns what was done.

    Raises:
        StandInError: it could not be pulled and no stand-in could be built.
    """
    labels = _labels(image)
    try:
        s = standin_for(image)
        standin, no_standin = (s, recipe_key(s.dockerfile.read_text(), *map("=".join, s.build_args),
                                             debian_key(s.suite))), None
    except StandInError as e:
        standin, no_standin = None, e
    if labels is not None and (LABEL not in labels or (standin and labels[LABEL] == standin[1])):
        return f"{image}: present" + (" (local stand-in)" if LABEL in labels else "")
    pull = _run(client(), "pull", image, timeout=PULL_TIMEOUT, quiet=True)
    if pull.returncode == 0:
        return f"{image}: pulled"
    why = (pull.stderr.strip().splitlines() or ["no message"])[-1]
    if standin is None:
        raise StandInError(f"{image}: cannot pull ({why}); {no_standin}")
    print(f"{image}: cannot pull ({why}); building a local stand-in from Debian's packages", file=sys.stderr)
    t0 = time.monotonic()
    build_standin(*standin)
    return f"{image}: local stand-in built in {time.monotonic() - t0:.0f}s"


def main() -> int:
    try:
        for image in base_images():
            print(ensure(image), file=sys.stderr)
    except StandInError as e:
        print(f"base_images: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
