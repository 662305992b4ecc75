"""Where a checkpoint comes from: a local directory, `hf://org/repo[@revision]` or `gs://bucket/path`.

`parse_source` is pure; `materialize` does the I/O.

- hf:// downloads with `huggingface_hub.snapshot_download` into the Hugging Face cache (`HF_HOME`, mount a
  volume there to keep downloads across restarts), with its tqdm progress bars and the token from
  `HF_TOKEN`.
- gs:// is read through a GCS FUSE mount. Convention: bucket B is mounted at `<gcs-root>/B` (default
  `/gcs/B`, as Vertex AI does), so `gs://B/models/gemma` is the directory `/gcs/B/models/gemma`. The GKE
  GCS FUSE CSI driver's volume may become readable after the container starts, so the server waits (up to
  `--mount-timeout`) for `config.json` to appear there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

# What a checkpoint directory needs; snapshot_download fetches only these.
HF_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


@dataclass(frozen=True)
class Source:
    """A parsed checkpoint location.

    Attributes:
        kind: "local", "hf" or "gs".
        path: local: the directory; hf: "org/repo"; gs: "bucket/path".
        revision: hf only: branch, tag or commit (None = main).
    """

    kind: str
    path: str
    revision: str | None = None

    def __str__(self) -> str:
        if self.kind == "hf":
            return f"hf://{self.path}" + (f"@{self.revision}" if self.revision else "")
        if self.kind == "gs":
            return f"gs://{self.path}"
        return self.path


def parse_source(text: str) -> Source:
    """Parse a --model / --emb value.

    Raises:
        ValueError: an hf:// name that is not org/repo, a gs:// without a bucket, an unknown scheme.
    """
    if text.startswith("hf://"):
        rest = text[len("hf://") :]
        repo, _, rev = rest.partition("@")
        parts = repo.strip("/").split("/")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"{text}: expected hf://org/repo[@revision]")
        if "@" in rest and not rev:
            raise ValueError(f"{text}: empty revision after @")
        return Source("hf", "/".join(parts), rev or None)
    if text.startswith("gs://"):
        rest = text[len("gs://") :].strip("/")
        if not rest or not rest.split("/")[0]:
            raise ValueError(f"{text}: expected gs://bucket/path")
        return Source("gs", rest)
    if "://" in text:
        raise ValueError(f"{text}: unknown scheme; use a local directory, hf://org/repo[@rev] or gs://bucket/path")
    return Source("local", text)


def gcs_mount_path(source: Source, gcs_root: str) -> Path:
    """Where gs://bucket/path is read: <gcs_root>/bucket/path."""
    return Path(gcs_root) / source.path


def materialize(source: Source, *, hf_token: str | None, gcs_root: str, mount_timeout: float) -> Path:
    """Make the checkpoint a local directory holding config.json; download if remote.

    Args:
        source: from parse_source.
        hf_token: Hugging Face token (gated repos), or None.
        gcs_root: mount root for gs:// sources.
        mount_timeout: seconds to wait for a gs:// checkpoint to appear.
    Returns:
        The local directory.
    Raises:
        FileNotFoundError: the directory or its config.json is missing (after the wait, for gs://).
        RuntimeError: the download failed (no network, gated repo, unknown revision), naming the repo.
    """
    if source.kind == "hf":
        from huggingface_hub import snapshot_download

        try:
            path = Path(snapshot_download(source.path, revision=source.revision, token=hf_token,
                                          allow_patterns=HF_PATTERNS))
        except Exception as e:  # name the repo: the message ends up in the termination log
            raise RuntimeError(f"{source}: download failed: {type(e).__name__}: {e}") from e
    elif source.kind == "gs":
        path = gcs_mount_path(source, gcs_root)
        deadline = time.monotonic() + mount_timeout
        while not (path / "config.json").is_file() and time.monotonic() < deadline:
            time.sleep(0.5)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{source}: no config.json at {path} after {mount_timeout:g}s; mount bucket "
                f"{source.path.split('/')[0]} with GCS FUSE at {Path(gcs_root) / source.path.split('/')[0]}"
            )
        return path
    else:
        path = Path(source.path)
    if not path.is_dir():
        raise FileNotFoundError(f"{source}: not a directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{source}: no config.json in {path}")
    return path
