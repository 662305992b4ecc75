"""Google's Gemma 4 chat templates, as published with the checkpoints, fetched once into a cache outside the
checkout: `$GEMMA_CACHE/chat-templates/llama-cpp-python-<version>/<file>`.

The Hugging Face hub is out of reach here, so the templates come from a registry package that ships copies:
llama-cpp-python's source distribution vendors llama.cpp, whose `models/templates/` holds the templates of
the checkpoints its tests render (llama.cpp keeps them verbatim from each model's tokenizer_config.json /
chat_template.jinja). Two of them:

- `google-gemma-4-31B-it-interleaved.jinja`: Gemma 4's template that reads tool results from
  `message['tool_responses']` on the model turn and has no `tool` role (an OpenAI `tool` message renders as a
  `<|turn>tool` turn of its own); it also renders `reasoning_content` between the tool calls that follow the
  last user turn. The E-series checkpoints ship the same handling of tool results.
- `google-gemma-4-31B-it.jinja`: the later revision, which also reads OpenAI `tool` messages itself (a
  forward scan from the model turn that called).

The source distribution is pinned by version and sha256 and read with the standard library; nothing of it is
installed. `python -m tests.fetch_chat_templates` (make chat-templates) fetches; `template_path` is what
tests use, and fetches on first use when make has not.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
INSIDE = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/templates/"
INTERLEAVED = "google-gemma-4-31B-it-interleaved.jinja"
TOOL_ROLE = "google-gemma-4-31B-it.jinja"
FILES = (INTERLEAVED, TOOL_ROLE)

CACHE = Path(os.environ.get("GEMMA_CACHE", Path.home() / ".cache" / "gemma-rust-operator"))
DEST = CACHE / "chat-templates" / f"{PACKAGE}-{VERSION}"


def _pip() -> list[str]:
    """A pip to download with: the uv installer's venv's (the Makefile makes it), else this interpreter's."""
    uv_pip = next(iter(sorted(CACHE.glob("uv-*/bin/pip"))), None)
    return [str(uv_pip)] if uv_pip else [sys.executable, "-m", "pip"]


def fetch() -> Path:
    """Make every file of FILES present in DEST; returns DEST.

    Raises:
        RuntimeError: the download failed or its sha256 is not SHA256.
    """
    if all((DEST / f).is_file() for f in FILES):
        return DEST
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [*_pip(), "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               "-d", tmp, f"{PACKAGE}=={VERSION}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        archives = list(Path(tmp).glob("*.tar.gz"))
        if done.returncode != 0 or len(archives) != 1:
            raise RuntimeError(f"pip download {PACKAGE}=={VERSION} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        digest = hashlib.sha256(archives[0].read_bytes()).hexdigest()
        if digest != SHA256:
            raise RuntimeError(f"{archives[0].name} has sha256 {digest}, expected {SHA256}")
        DEST.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archives[0]) as tar:
            for name in FILES:
                data = tar.extractfile(INSIDE + name)
                if data is None:
                    raise RuntimeError(f"{archives[0].name} has no {INSIDE + name}")
                (DEST / name).write_bytes(data.read())
    return DEST


def template_path(name: str) -> Path:
    """The cached template `name` (one of FILES), fetched first if missing."""
    return fetch() / name


if __name__ == "__main__":
    print(f"{PACKAGE} {VERSION} templates in {fetch()}")
