"""The repository's structural rules that a reader relies on."""

from pathlib import Path

RUST = Path(__file__).resolve().parents[1] / "rust" / "src"
MAX_LINES = 700


def test_no_rust_file_is_over_700_lines():
    """A file over this is doing more than one job: split it by job (as engine/ is: settings, lifecycle,
    prompts, step, read_point, ...)."""
    long = {str(p.relative_to(RUST)): n for p in RUST.rglob("*.rs") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long
