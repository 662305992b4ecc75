"""Server settings: command-line flags, each with a matching environment variable.

A flag wins over its variable, the variable over the default (`--port` / `GEMMA_PORT`, ...). The operator
sets the variables in the pod spec; people use the flags. `HF_TOKEN` is read from the environment only,
never from a flag, so it does not show in `ps` or in the pod's args.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DEVICES = ("cpu", "cuda", "tpu")
DTYPES = ("bfloat16", "float32", "float16")


def default_cache_root(environ: Mapping[str, str]) -> Path:
    """`$GEMMA_CACHE` (set by the Makefile) or ~/.cache/gemma-rust-operator."""
    if environ.get("GEMMA_CACHE"):
        return Path(environ["GEMMA_CACHE"])
    return Path(environ.get("HOME", "/root")) / ".cache" / "gemma-rust-operator"


def default_engine_src() -> Path:
    """rust/ beside server/ in a checkout; the image copies the repository the same way."""
    return Path(__file__).resolve().parents[2] / "rust"


@dataclass(frozen=True)
class Config:
    """Everything `python -m gemma_server` was told. See `parse_config` for each field's flag."""

    model: str
    emb: str | None = None
    device: str = "cpu"
    context: int = 8192
    read_every: int = 1
    dtype: str = "bfloat16"
    prefill_chunk: int = 256
    served_model_name: str | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    queue_limit: int = 32
    shutdown_timeout: float = 30.0
    build_cache: str = ""
    engine_src: str = ""
    use_installed_engine: bool = False
    termination_log: str = "/dev/termination-log"
    gcs_root: str = "/gcs"
    mount_timeout: float = 300.0
    tpu_defer_and_fuse: str | None = None
    log_level: str = "info"

    @property
    def model_name(self) -> str:
        """The id clients send as `model`: the served name, else the model source's last part."""
        if self.served_model_name:
            return self.served_model_name
        src = self.model.rstrip("/")
        if src.startswith("hf://"):
            return src[len("hf://") :].split("@", 1)[0]
        return src.rsplit("/", 1)[-1] or src


def _flag(environ: Mapping[str, str], var: str, default):
    return environ.get(var, default)


def _bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    return text.strip().lower() in ("1", "true", "yes", "on")


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """The flag parser; defaults come from `environ`."""
    cache = default_cache_root(environ)
    e = lambda var, default=None: _flag(environ, var, default)  # noqa: E731
    p = argparse.ArgumentParser(
        prog="python -m gemma_server",
        description="OpenAI-compatible server over the gemma_engine Rust engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=e("GEMMA_MODEL"),
                   help="checkpoint: a local directory, hf://org/repo[@revision] or gs://bucket/path "
                        "(GCS FUSE, mounted at <gcs-root>/<bucket>) [GEMMA_MODEL]")
    p.add_argument("--emb", default=e("GEMMA_EMB"),
                   help="optional int4 embedding twin, same source forms as --model [GEMMA_EMB]")
    p.add_argument("--device", choices=DEVICES, default=e("GEMMA_DEVICE", "cpu"),
                   help="cpu, cuda or tpu (tpu imports torch_tpu first) [GEMMA_DEVICE]")
    p.add_argument("--context", type=int, default=int(e("GEMMA_CONTEXT", 8192)),
                   help="most tokens (prompt + generated) per request [GEMMA_CONTEXT]")
    p.add_argument("--read-every", type=int, default=int(e("GEMMA_READ_EVERY", 1)),
                   help="tokens come back to the host every N decode steps [GEMMA_READ_EVERY]")
    p.add_argument("--dtype", choices=DTYPES, default=e("GEMMA_DTYPE", "bfloat16"),
                   help="compute dtype [GEMMA_DTYPE]")
    p.add_argument("--prefill-chunk", type=int, default=int(e("GEMMA_PREFILL_CHUNK", 256)),
                   help="prompt tokens read per forward [GEMMA_PREFILL_CHUNK]")
    p.add_argument("--served-model-name", default=e("GEMMA_SERVED_MODEL_NAME"),
                   help="the model id clients send (default: from --model) [GEMMA_SERVED_MODEL_NAME]")
    p.add_argument("--host", default=e("GEMMA_HOST", "0.0.0.0"), help="listen address [GEMMA_HOST]")
    p.add_argument("--port", type=int, default=int(e("GEMMA_PORT", 8000)), help="listen port [GEMMA_PORT]")
    p.add_argument("--queue-limit", type=int, default=int(e("GEMMA_QUEUE_LIMIT", 32)),
                   help="requests waiting for the engine beyond the one decoding; more get 429 "
                        "[GEMMA_QUEUE_LIMIT]")
    p.add_argument("--shutdown-timeout", type=float, default=float(e("GEMMA_SHUTDOWN_TIMEOUT", 30)),
                   help="seconds queued and running requests get to finish after SIGTERM "
                        "[GEMMA_SHUTDOWN_TIMEOUT]")
    p.add_argument("--build-cache", default=e("GEMMA_BUILD_CACHE", str(cache / "engine-builds")),
                   help="directory of engine builds keyed by source hash, torch and python; mount a "
                        "volume here so a restart skips the compile [GEMMA_BUILD_CACHE]")
    p.add_argument("--engine-src", default=e("GEMMA_ENGINE_SRC", str(default_engine_src())),
                   help="the engine crate (rust/) to build [GEMMA_ENGINE_SRC]")
    p.add_argument("--use-installed-engine", action="store_true",
                   default=_bool(e("GEMMA_USE_INSTALLED_ENGINE", "0")),
                   help="skip the build stage and import the gemma_engine already installed (development) "
                        "[GEMMA_USE_INSTALLED_ENGINE]")
    p.add_argument("--termination-log", default=e("GEMMA_TERMINATION_LOG", "/dev/termination-log"),
                   help="file that gets a one-line reason when a boot stage fails [GEMMA_TERMINATION_LOG]")
    p.add_argument("--gcs-root", default=e("GEMMA_GCS_ROOT", "/gcs"),
                   help="where GCS FUSE buckets are mounted: gs://B/P is read at <gcs-root>/B/P "
                        "[GEMMA_GCS_ROOT]")
    p.add_argument("--mount-timeout", type=float, default=float(e("GEMMA_MOUNT_TIMEOUT", 300)),
                   help="seconds to wait for a gs:// checkpoint to appear under its mount "
                        "[GEMMA_MOUNT_TIMEOUT]")
    p.add_argument("--tpu-defer-and-fuse", default=e("TORCH_TPU_DEFER_AND_FUSE"),
                   help="sets TORCH_TPU_DEFER_AND_FUSE before torch_tpu is imported [TORCH_TPU_DEFER_AND_FUSE]")
    p.add_argument("--log-level", default=e("GEMMA_LOG_LEVEL", "info"),
                   choices=("debug", "info", "warning", "error"), help="[GEMMA_LOG_LEVEL]")
    return p


def parse_config(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Config:
    """Flags and environment -> Config.

    Args:
        argv: the arguments after the program name.
        environ: the environment (default: os.environ).
    Returns:
        the Config.
    Raises:
        SystemExit: argparse's exit (status 2) on a bad flag or a missing model, naming it.
    """
    environ = os.environ if environ is None else environ
    parser = build_parser(environ)
    ns = parser.parse_args(list(argv))
    if not ns.model:
        parser.error("--model (or GEMMA_MODEL) is required")
    # queue_limit counts admitted requests not yet decoding: 0 would admit none, so 1 is the least.
    for name in ("context", "read_every", "prefill_chunk", "queue_limit"):
        if getattr(ns, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if ns.shutdown_timeout < 0:
        parser.error("--shutdown-timeout must be >= 0")
    return Config(**vars(ns))
