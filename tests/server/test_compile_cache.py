"""torch_tpu's compilation cache shared by replicas (gemma_server/compile_cache.py): each server's torch_tpu
writes a directory of its own; complete entries reach the shared directory by rename only.

There is no TPU here, so torch_tpu's writes are stood in for by files: two real processes publish the same
entry names into one shared directory at once, many times over, and a third reads it meanwhile.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

from gemma_server.boot import compile_cache_dirs, tpu_environment
from gemma_server.compile_cache import PARTIAL, entries, publish, seed
from gemma_server.config import parse_config

ENTRIES = 60
SIZE = 256 * 1024  # bytes an entry: large enough that a copy is many writes


def _write_local(local: Path, fill: bytes) -> None:
    """Entries laid out as torch_tpu lays them out: <root>/<fingerprint>/<key>.bin."""
    for i in range(ENTRIES):
        p = local / "fingerprint-1" / f"key-{i:03}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(fill * SIZE)


PUBLISHER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from gemma_server.compile_cache import publish
    local, shared, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    while not go.exists():
        time.sleep(0.001)
    for _ in range(20):
        publish(local, shared)
        # Drop what landed, so the next round writes every entry again while the other process does too.
        for p in sorted(shared.rglob("key-*.bin"))[::2]:
            p.unlink(missing_ok=True)
    publish(local, shared)
""")

READER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from gemma_server.compile_cache import entries
    shared, go, size = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    while not go.exists():
        time.sleep(0.001)
    seen, deadline = 0, time.monotonic() + 20
    while time.monotonic() < deadline:
        for rel in entries(shared):
            try:
                data = (shared / rel).read_bytes()
            except FileNotFoundError:
                continue  # unlinked by a publisher between listing and reading
            if len(data) != size or len(set(data)) != 1:
                print(f"torn entry {rel}: {len(data)} bytes")
                sys.exit(1)
            seen += 1
        if (go.parent / "done").exists():
            break
    print(seen)
""")


def test_two_processes_publishing_one_cache_at_once_leave_only_whole_entries(tmp_path):
    shared, go = tmp_path / "shared", tmp_path / "go"
    locals_ = [tmp_path / "pod-a", tmp_path / "pod-b"]
    for local, fill in zip(locals_, (b"a", b"b")):
        _write_local(local, fill)
    publishers = [subprocess.Popen([sys.executable, "-c", PUBLISHER, str(local), str(shared), str(go)])
                  for local in locals_]
    reader = subprocess.Popen([sys.executable, "-c", READER, str(shared), str(go), str(SIZE)],
                              stdout=subprocess.PIPE, text=True)
    go.touch()
    assert [p.wait(timeout=120) for p in publishers] == [0, 0]
    (tmp_path / "done").touch()
    out, _ = reader.communicate(timeout=60)
    assert reader.returncode == 0, out
    assert int(out) > 0  # the reader met entries while the publishers wrote
    assert len(entries(shared)) == ENTRIES
    assert not [p for p in shared.rglob("*") if p.name.startswith(PARTIAL)]
    for rel in entries(shared):
        data = (shared / rel).read_bytes()
        assert len(data) == SIZE and data in (b"a" * SIZE, b"b" * SIZE)


def test_a_new_replica_is_seeded_with_the_complete_entries_only(tmp_path):
    shared, old, new = tmp_path / "shared", tmp_path / "old", tmp_path / "new"
    _write_local(old, b"x")
    assert publish(old, shared) == ENTRIES and publish(old, shared) == 0
    half_written = shared / "fingerprint-1" / f"{PARTIAL}123-abc-key-999.bin"
    half_written.write_bytes(b"x" * 10)
    assert seed(shared, new) == ENTRIES
    assert entries(new) == entries(old) and not (new / "fingerprint-1" / half_written.name).exists()
    assert seed(shared, new) == 0


def test_torch_tpu_writes_the_local_directory_when_the_cache_is_shared():
    def config(*argv):
        return parse_config(["--model", "/m", "--device", "tpu", "--build-cache", "/cache/build", *argv], {})

    shared_only = config()
    assert tpu_environment(shared_only)["TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"] == "/cache/build/tpu-compile"
    assert compile_cache_dirs(shared_only) is None
    both = config("--tpu-compile-cache-local", "/scratch/tpu-compile")
    assert tpu_environment(both)["TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"] == "/scratch/tpu-compile"
    assert compile_cache_dirs(both) == (Path("/cache/build/tpu-compile"), Path("/scratch/tpu-compile"))
    assert compile_cache_dirs(config("--tpu-compile-cache", "off", "--tpu-compile-cache-local", "/s")) is None
