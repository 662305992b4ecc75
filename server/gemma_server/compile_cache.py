"""torch_tpu's persistent compilation cache, shared by replicas without sharing their writes.

torch_tpu 0.2.0 keeps compiled programs under TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT, as
`<root>/<fingerprint>/<key>.bin` (csrc/common/tier3_compilation_cache.cc), written in place. Several replicas
pointing that variable at one ReadWriteMany volume is the pattern Google's GKE TPU serving tutorials report
failing ("cannot create directories"), and a reader can meet another pod's half-written file. So with a
shared cache (`--tpu-compile-cache`) and a local one (`--tpu-compile-cache-local`, a directory of this pod
alone), torch_tpu reads and writes only the local directory, and:

* `seed(shared, local)`, before torch_tpu is imported: every complete entry of the shared cache that the local
  one lacks is copied in, so a new replica loads what the others compiled;
* `publish(local, shared)`, after warmup and when the server drains: every local entry the shared cache lacks
  is copied there under a temporary name in its final directory and renamed into place (`os.replace`, atomic
  on one filesystem), so a reader sees a whole file or none. Directories are made with `exist_ok`, so two
  pods making one at once both go on. Two pods publishing one key both rename a whole file; the last wins.

Temporary names start with `PARTIAL`; `seed` never copies them.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

PARTIAL = ".partial-"


def entries(root: Path) -> set[Path]:
    """The complete entries under `root`, as paths relative to it (none when it does not exist)."""
    if not root.is_dir():
        return set()
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file() and not p.name.startswith(PARTIAL)}


def _place(src: Path, dst: Path) -> None:
    """Copy `src` to `dst` through a temporary name beside it and an atomic rename."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{PARTIAL}{os.getpid()}-{uuid.uuid4().hex}-{dst.name}")
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def _copy_missing(src_root: Path, dst_root: Path) -> int:
    missing = entries(src_root) - entries(dst_root)
    for rel in sorted(missing):
        _place(src_root / rel, dst_root / rel)
    return len(missing)


def seed(shared: Path, local: Path) -> int:
    """Copy the shared cache's complete entries that `local` lacks into it; returns how many."""
    local.mkdir(parents=True, exist_ok=True)
    return _copy_missing(shared, local)


def publish(local: Path, shared: Path) -> int:
    """Copy `local`'s entries that the shared cache lacks into it, each renamed into place; returns how many."""
    shared.mkdir(parents=True, exist_ok=True)
    return _copy_missing(local, shared)


def publish_quietly(local: Path, shared: Path) -> str:
    """`publish`, its outcome as a line for the log: a failed publish costs the other replicas a compile, never
    this server its requests."""
    try:
        return f"published {publish(local, shared)} compiled programs to {shared}"
    except OSError as e:
        log.warning("could not publish the compilation cache to %s: %s", shared, e)
        return f"compilation cache not published: {e}"
