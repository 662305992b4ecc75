"""The `build` stage: compile rust/ with maturin against the torch installed here, once per key.

The key is (the crate's source hash, torch version, python version): the extension links libtorch and
libpython, so a build is reusable exactly when all three match. Builds live in `<build-cache>/<key>/`:
the wheel is installed (unpacked, as `pip install --target` would) there, `BUILD.json` marks it
complete, and the directory goes first on sys.path. Mount a volume at the build cache and a restarted
pod skips the compile. A build goes to a temporary directory and is renamed into place, under a file
lock, so two processes sharing the cache never see half a build. maturin builds a copy of the crate made
in that directory, because the crate's build.rs writes a generated file into its source tree, and in the
image that tree is on a read-only root filesystem.

Cargo's own target directory is `$CARGO_TARGET_DIR` when set (the Makefile exports one per torch and
python version, so a rebuild is incremental), else `<build-cache>/cargo-target`.
"""

from __future__ import annotations

import fcntl
import fnmatch
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Files that change the build. target/ and caches are not sources.
_SOURCE_SUFFIXES = {".rs", ".toml", ".lock", ".cpp", ".cc", ".h", ".hpp", ".pyi", ".py", ".txt"}
_SKIP_DIRS = {"target", ".git", "__pycache__"}
DONE_MARKER = "BUILD.json"


@dataclass(frozen=True)
class BuildResult:
    """Where the engine is and whether this boot compiled it.

    Attributes:
        path: directory to put on sys.path.
        key: the cache key.
        cached: True when an earlier build was reused (no compile).
    """

    path: Path
    key: str
    cached: bool


def ignore_patterns(crate: Path) -> list[str]:
    """The crate's .gitignore lines (build outputs such as the generated `_build.py` must not change the key)."""
    gi = crate / ".gitignore"
    if not gi.is_file():
        return []
    lines = (ln.strip() for ln in gi.read_text().splitlines())
    return [ln.strip("/") for ln in lines if ln and not ln.startswith("#") and not ln.startswith("!")]


def crate_files(crate: Path) -> list[Path]:
    """Every file of the crate, sorted, relative to `crate`, without build outputs: target/, caches and
    what its .gitignore ignores.

    Only the .gitignore subset the crate uses is understood: glob patterns, anchored with a leading /
    or not, matched against the relative path or its file name.
    """
    ignored = ignore_patterns(crate)

    def skip(rel: str) -> bool:
        name = rel.rsplit("/", 1)[-1]
        return any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(name, p) for p in ignored)

    out = []
    for root, dirs, files in os.walk(crate):
        rel_root = Path(root).relative_to(crate)
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not skip(str(rel_root / d)))
        out += [rel_root / f for f in files if not skip(str(rel_root / f))]
    return sorted(out)


def source_files(crate: Path) -> list[Path]:
    """The crate's files that change the build (by suffix), as `crate_files` lists them."""
    return [rel for rel in crate_files(crate) if rel.suffix in _SOURCE_SUFFIXES]


def copy_crate(crate: Path, dest: Path) -> Path:
    """Copy the crate's files (`crate_files`) to `dest`; returns `dest`.

    The copies get new modification times, so cargo reruns build.rs (which writes the generated file into
    this copy) even where the shared target directory holds a build of the same sources.
    """
    for rel in crate_files(crate):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(crate / rel, dest / rel)
    return dest


def source_hash(crate: Path) -> str:
    """sha256 over every source file's relative path and bytes."""
    h = hashlib.sha256()
    for rel in source_files(crate):
        h.update(str(rel).encode() + b"\0")
        h.update((crate / rel).read_bytes() + b"\0")
    return h.hexdigest()


def cache_key(src_hash: str, torch_version: str, python_version: str) -> str:
    """`<hash16>-torch<version>-py<version>`, safe as a directory name."""
    safe = lambda s: re.sub(r"[^A-Za-z0-9._-]", "_", s)  # noqa: E731 - e.g. torch "2.14.1+cpu"
    return f"{src_hash[:16]}-torch{safe(torch_version)}-py{safe(python_version)}"


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def install_wheel(wheel: Path, target: Path) -> None:
    """Unpack a wheel into `target` like `pip install --target --no-deps` (the .data dirs spread too)."""
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
    for data in target.glob("*.data"):
        for sub in data.iterdir():  # purelib, platlib (and scripts/headers, unused here)
            if sub.name in ("purelib", "platlib"):
                for item in sub.iterdir():
                    shutil.move(str(item), target / item.name)
        shutil.rmtree(data)


def ensure_engine(crate: Path, cache_root: Path, torch_version: str) -> BuildResult:
    """Return a build of `crate` for this torch and python, compiling only when the cache lacks it.

    Args:
        crate: the engine crate directory (holds Cargo.toml).
        cache_root: the build cache.
        torch_version: torch.__version__ of this process.
    Returns:
        BuildResult.
    Raises:
        FileNotFoundError: no Cargo.toml in `crate`.
        RuntimeError: maturin failed (its last output lines are in the message) or made no wheel.
    """
    if not (crate / "Cargo.toml").is_file():
        raise FileNotFoundError(f"no Cargo.toml in {crate} (set --engine-src, or --use-installed-engine)")
    key = cache_key(source_hash(crate), torch_version, python_version())
    cache_root.mkdir(parents=True, exist_ok=True)
    final = cache_root / key
    if (final / DONE_MARKER).is_file():
        log.info("build: reusing cached engine %s", final)
        return BuildResult(final, key, cached=True)
    with open(cache_root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / DONE_MARKER).is_file():  # another process built it while we waited
            return BuildResult(final, key, cached=True)
        with tempfile.TemporaryDirectory(dir=cache_root, prefix=f".{key}.") as tmp:
            wheel = _maturin_build(copy_crate(crate, Path(tmp) / "crate"), Path(tmp) / "wheels", cache_root)
            staging = Path(tmp) / "install"
            install_wheel(wheel, staging)
            (staging / DONE_MARKER).write_text(
                json.dumps({"key": key, "wheel": wheel.name, "built_at": time.time()}) + "\n"
            )
            if final.exists():  # an incomplete leftover (no marker)
                shutil.rmtree(final)
            staging.rename(final)
    log.info("build: built engine into %s", final)
    return BuildResult(final, key, cached=False)


def _maturin_build(crate: Path, out: Path, cache_root: Path) -> Path:
    env = dict(os.environ)
    env.setdefault("CARGO_TARGET_DIR", str(cache_root / "cargo-target"))
    # The crate's build script finds torch through this interpreter; put its bin dir first too.
    env["PYO3_PYTHON"] = sys.executable
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [sys.executable, "-m", "maturin", "build", "--release", "--manifest-path", str(crate / "Cargo.toml"),
           "--interpreter", sys.executable, "--out", str(out),
           # The wheel links the libtorch of this environment and never leaves this machine: no manylinux
           # repair (it would try to bundle libtorch and needs patchelf).
           "--compatibility", "linux", "--auditwheel", "skip"]
    log.info("build: %s (CARGO_TARGET_DIR=%s)", " ".join(cmd), env["CARGO_TARGET_DIR"])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:  # the compile's progress goes to the pod log as it happens
        line = line.rstrip()
        log.info("maturin: %s", line)
        tail = (tail + [line])[-3:]
    if proc.wait() != 0:
        raise RuntimeError(f"maturin build failed (exit {proc.returncode}): " + " | ".join(tail))
    wheels = sorted(out.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"maturin build made no wheel in {out}")
    return wheels[-1]


def activate(path: Path) -> None:
    """Put a build first on sys.path so `import gemma_engine` finds it."""
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
