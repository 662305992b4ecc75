"""The repository's structural rules that a reader relies on."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUST = ROOT / "rust" / "src"
PYTHON = (ROOT / "server" / "gemma_server", ROOT / "operator" / "gemma_operator")
MAX_LINES = 700


def long_files(root: Path, pattern: str) -> dict[str, int]:
    return {str(p.relative_to(ROOT)): n for p in root.rglob(pattern) if (n := len(p.read_text().splitlines())) > MAX_LINES}


def test_no_rust_file_is_over_700_lines():
    """A file over this is doing more than one job: split it by job (as engine/ is: settings, lifecycle,
    prompts, step, read_point, ...)."""
    long = long_files(RUST, "*.rs")
    assert not long, long


def test_no_python_source_file_is_over_700_lines():
    """The same rule for the server's and the operator's packages (split as the server's front-ends are:
    frontends/messages.py the way in, frontends/messages_format.py the way out)."""
    long = {k: v for root in PYTHON for k, v in long_files(root, "*.py").items()}
    assert not long, long
