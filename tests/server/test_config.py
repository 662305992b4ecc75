"""Unit tests of config.py, sources.py, build.py's key, boot.py's TPU environment and metrics.py's buckets
(pure parts)."""

import enum
from pathlib import Path
from types import SimpleNamespace

import pytest

from gemma_server.boot import eager_mode_name, tpu_environment
from gemma_server.build import cache_key, copy_crate, source_files, source_hash
from gemma_server.config import parse_config
from gemma_server.metrics import build_1_2_5_buckets, cache_config
from gemma_server.sources import Source, materialize, parse_source


def test_flags_win_over_environment_and_environment_over_defaults():
    env = {"GEMMA_MODEL": "/m", "GEMMA_PORT": "9000", "GEMMA_CONTEXT": "4096", "GEMMA_DEVICE": "tpu",
           "TORCH_TPU_DEFER_AND_FUSE": "1", "GEMMA_SERVED_MODEL_NAME": "gemma"}
    c = parse_config(["--port", "9001"], env)
    assert (c.model, c.port, c.context, c.device, c.tpu_defer_and_fuse, c.model_name) == (
        "/m", 9001, 4096, "tpu", True, "gemma")
    assert parse_config([], {"GEMMA_MODEL": "/x"}).port == 8000


def test_missing_model_or_bad_values_exit_with_usage_error(capsys):
    for argv in ([], ["--model", "/m", "--context", "0"], ["--model", "/m", "--queue-limit", "0"],
                 ["--model", "/m", "--device", "gpu"]):
        with pytest.raises(SystemExit) as e:
            parse_config(argv, {})
        assert e.value.code == 2
    assert "--device" in capsys.readouterr().err


def test_a_variable_that_does_not_convert_is_a_usage_error_naming_it(capsys):
    for env, text in (("GEMMA_PORT", "eighty"), ("TORCH_TPU_DEFER_AND_FUSE", "maybe")):
        with pytest.raises(SystemExit) as e:
            parse_config([], {"GEMMA_MODEL": "/m", env: text})
        assert e.value.code == 2
        assert f"{env}={text!r}" in capsys.readouterr().err


def test_defer_and_fuse_is_on_by_default_and_either_flag_or_variable_turns_it_off(capsys):
    def on(argv, env):
        return parse_config(["--model", "/m", *argv], env).tpu_defer_and_fuse

    assert on([], {}) is True
    assert on([], {"TORCH_TPU_DEFER_AND_FUSE": "0"}) is False
    assert on([], {"TORCH_TPU_DEFER_AND_FUSE": "true"}) is True
    assert on(["--tpu-defer-and-fuse", "off"], {"TORCH_TPU_DEFER_AND_FUSE": "1"}) is False
    assert on(["--tpu-defer-and-fuse", "1"], {"TORCH_TPU_DEFER_AND_FUSE": "0"}) is True
    with pytest.raises(SystemExit):
        on(["--tpu-defer-and-fuse", "sometimes"], {})
    assert "--tpu-defer-and-fuse: must be 1 or 0" in capsys.readouterr().err


def test_tpu_environment_turns_on_defer_and_fuse_and_the_compile_cache_under_the_build_cache():
    def tpu_env(*argv, env=None):
        return tpu_environment(parse_config(["--model", "/m", "--device", "tpu", *argv], env or {}))

    assert tpu_env("--build-cache", "/cache/build") == {
        "TORCH_TPU_DEFER_AND_FUSE": "1", "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": "/cache/build/tpu-compile"}
    # The operator's pod: its variables, nothing on the command line.
    assert tpu_env(env={"GEMMA_BUILD_CACHE": "/var/cache/gemma/build", "TORCH_TPU_DEFER_AND_FUSE": "1",
                        "GEMMA_TPU_COMPILE_CACHE": "/var/cache/gemma/tpu-compile"}) == {
        "TORCH_TPU_DEFER_AND_FUSE": "1", "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": "/var/cache/gemma/tpu-compile"}
    # torch_tpu reads only "1" as on, so a "true" the user gave is written as "1".
    assert tpu_env(env={"TORCH_TPU_DEFER_AND_FUSE": "true", "GEMMA_TPU_COMPILE_CACHE": "off"}) == {
        "TORCH_TPU_DEFER_AND_FUSE": "1"}
    assert tpu_env("--tpu-defer-and-fuse", "0", "--tpu-compile-cache", "gs://b/tpu") == {
        "TORCH_TPU_DEFER_AND_FUSE": "0", "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": "gs://b/tpu"}


def test_tpu_environment_is_empty_off_tpu():
    for device in ("cpu", "cuda"):
        config = parse_config(["--model", "/m", "--device", device], {"TORCH_TPU_DEFER_AND_FUSE": "1",
                                                                    "GEMMA_TPU_COMPILE_CACHE": "/c"})
        assert tpu_environment(config) == {}


class FakeEagerMode(enum.Enum):
    """torch_tpu's EagerMode members (no torch_tpu is installed off TPU)."""

    DEFER_AND_FUSE = 1
    DEFER_NEVER = 2


class FakeTorch:
    """torch as eager_mode_name sees it: with torch_tpu's `torch.tpu` module (given its attributes), or without."""

    def __init__(self, **tpu) -> None:
        if tpu:
            self.tpu = SimpleNamespace(**tpu)


def test_eager_mode_name_reads_torch_tpu_or_says_unknown():
    assert eager_mode_name(FakeTorch(eager_mode=FakeEagerMode.DEFER_AND_FUSE)) == "DEFER_AND_FUSE"
    assert eager_mode_name(FakeTorch(device_count=lambda: 1)) == "unknown"  # a torch_tpu without the property
    assert eager_mode_name(FakeTorch()) == "unknown"


def test_served_name_defaults_to_the_model_source():
    assert parse_config(["--model", "hf://google/gemma-4-e2b@main"], {}).model_name == "google/gemma-4-e2b"
    assert parse_config(["--model", "/models/tiny/"], {}).model_name == "tiny"
    assert parse_config(["--model", "gs://b/models/g4"], {}).model_name == "g4"


def test_model_sources_parse():
    assert parse_source("hf://org/repo") == Source("hf", "org/repo", None)
    assert parse_source("hf://org/repo@v1.0") == Source("hf", "org/repo", "v1.0")
    assert parse_source("gs://bucket/a/b/") == Source("gs", "bucket/a/b")
    assert parse_source("/data/model") == Source("local", "/data/model")
    assert str(parse_source("hf://org/repo@abc")) == "hf://org/repo@abc"
    for bad in ("hf://repo", "hf://org/repo@", "hf://a/b/c", "gs://", "s3://b/p"):
        with pytest.raises(ValueError, match="://"):
            parse_source(bad)


def test_gs_source_is_read_under_the_mount_root(tmp_path):
    (tmp_path / "bucket" / "m").mkdir(parents=True)
    (tmp_path / "bucket" / "m" / "config.json").write_text("{}")
    src = parse_source("gs://bucket/m")
    assert materialize(src, hf_token=None, gcs_root=str(tmp_path), mount_timeout=0) == tmp_path / "bucket" / "m"
    with pytest.raises(FileNotFoundError, match="mount bucket other with GCS FUSE at"):
        materialize(parse_source("gs://other/m"), hf_token=None, gcs_root=str(tmp_path), mount_timeout=0)


def test_local_source_needs_a_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        materialize(parse_source(str(tmp_path)), hf_token=None, gcs_root="/gcs", mount_timeout=0)


def test_hf_source_offline_without_a_cached_copy_names_the_repo(tmp_path, monkeypatch):
    # huggingface_hub's real code path; no hub is reachable here, so only its offline failure is testable.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(RuntimeError) as e:
        materialize(parse_source("hf://google/gemma-4-e2b@v1"), hf_token=None, gcs_root="/gcs", mount_timeout=0)
    assert str(e.value).startswith("hf://google/gemma-4-e2b@v1: download failed: LocalEntryNotFoundError")


def test_build_key_changes_with_source_torch_and_python_but_not_with_ignored_outputs(tmp_path):
    crate = tmp_path / "crate"
    (crate / "src").mkdir(parents=True)
    (crate / "Cargo.toml").write_text("[package]\n")
    (crate / "src" / "lib.rs").write_text("fn a() {}\n")
    (crate / ".gitignore").write_text("/target/\n/python/pkg/_build.py\n")
    h = source_hash(crate)
    (crate / "target").mkdir()
    (crate / "target" / "x.rs").write_text("junk")
    (crate / "python" / "pkg").mkdir(parents=True)
    (crate / "python" / "pkg" / "_build.py").write_text("TORCH_VERSION = '1'\n")
    assert source_hash(crate) == h
    assert Path("python/pkg/_build.py") not in source_files(crate)
    (crate / "src" / "lib.rs").write_text("fn b() {}\n")
    assert source_hash(crate) != h
    assert cache_key(h, "2.14.1+cu130", "3.11") == f"{h[:16]}-torch2.14.1_cu130-py3.11"
    assert cache_key(h, "2.14.1", "3.11") != cache_key(h, "2.14.1", "3.12")


def test_the_engine_builds_from_a_copy_of_the_crate_without_its_build_outputs(tmp_path):
    # The image's crate is root-owned on a read-only filesystem, and build.rs writes into the tree it builds.
    crate = tmp_path / "crate"
    (crate / "src").mkdir(parents=True)
    (crate / "python" / "pkg").mkdir(parents=True)
    (crate / "target").mkdir()
    (crate / "Cargo.toml").write_text("[package]\n")
    (crate / "src" / "lib.rs").write_text("fn a() {}\n")
    (crate / "python" / "pkg" / "py.typed").write_text("")
    (crate / "python" / "pkg" / "_build.py").write_text("TORCH_VERSION = '1'\n")
    (crate / "target" / "x.rs").write_text("junk")
    (crate / ".gitignore").write_text("/target/\n/python/pkg/_build.py\n")
    copy = copy_crate(crate, tmp_path / "copy")
    assert sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file()) == [
        ".gitignore", "Cargo.toml", "python/pkg/py.typed", "src/lib.rs"]
    assert source_hash(copy) == source_hash(crate)


def test_token_count_buckets_are_vllms_1_2_5_series():
    assert build_1_2_5_buckets(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert build_1_2_5_buckets(8192)[-1] == 5000


def test_cache_config_info_counts_the_kv_in_prefill_chunks_as_vllm_counts_it_in_blocks():
    # block_size x num_gpu_blocks is the KV of every slot in tokens (8 slots of 8192).
    assert cache_config(slots=8, context=8192, prefill_chunk=256, prefix_caching=True, sliding_window=512) == {
        "block_size": "256", "num_gpu_blocks": "256", "enable_prefix_caching": "True", "sliding_window": "512"}
    # A chunk longer than the context is a block of the context; values are spelt as vLLM's str() spells them.
    assert cache_config(slots=2, context=100, prefill_chunk=256, prefix_caching=False, sliding_window=None) == {
        "block_size": "100", "num_gpu_blocks": "2", "enable_prefix_caching": "False", "sliding_window": "None"}


def test_packed_int4_and_cuda_graphs_are_on_by_default_and_each_can_be_switched_off():
    c = parse_config(["--model", "m"], {})
    assert (c.packed_int4, c.cuda_graphs) == (True, True)
    c = parse_config(["--model", "m", "--no-packed-int4", "--cuda-graphs", "0"], {})
    assert (c.packed_int4, c.cuda_graphs) == (False, False)
    c = parse_config(["--model", "m"], {"GEMMA_PACKED_INT4": "0", "GEMMA_CUDA_GRAPHS": "off"})
    assert (c.packed_int4, c.cuda_graphs) == (False, False)


def test_prefix_caching_is_on_by_default_and_vllms_negated_flag_or_the_variable_turns_it_off():
    def on(argv, env):
        return parse_config(["--model", "m", *argv], env).enable_prefix_caching

    assert on([], {}) is True
    assert on(["--no-enable-prefix-caching"], {}) is False
    assert on([], {"GEMMA_ENABLE_PREFIX_CACHING": "0"}) is False
    assert on(["--enable-prefix-caching"], {"GEMMA_ENABLE_PREFIX_CACHING": "off"}) is True  # the flag wins
    # Every switch has both forms, as vLLM's boolean flags do.
    assert parse_config(["--model", "m", "--packed-int4", "--no-packed-int4"], {}).packed_int4 is False


SWITCHES = ("GEMMA_PACKED_INT4", "GEMMA_CUDA_GRAPHS", "GEMMA_METRICS_NEED_KEY", "GEMMA_EXPOSE_PATHS",
            "GEMMA_USE_INSTALLED_ENGINE", "TORCH_TPU_DEFER_AND_FUSE", "GEMMA_ENABLE_PREFIX_CACHING")


@pytest.mark.parametrize("env", SWITCHES)
def test_an_unknown_word_in_a_switch_variable_stops_the_start_naming_it_and_the_accepted_words(env, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(["--model", "/m"], {env: "maybe"})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{env}='maybe'" in err and "must be 1 or 0 (true/false, yes/no, on/off)" in err


@pytest.mark.parametrize("env", SWITCHES)
def test_every_switch_variable_reads_the_same_words(env):
    name = next(f for f in ("packed_int4", "cuda_graphs", "metrics_need_key", "expose_paths", "use_installed_engine",
                            "tpu_defer_and_fuse", "enable_prefix_caching") if env.endswith(f.upper()))
    for word, value in (("1", True), ("TRUE", True), (" yes", True), ("on", True), ("0", False), ("false", False),
                        ("No", False), ("off ", False)):
        assert getattr(parse_config(["--model", "/m"], {env: word}), name) is value, word


def test_the_queue_limit_is_64_unless_set():
    assert parse_config(["--model", "/m"], {}).queue_limit == 64
    assert parse_config(["--model", "/m"], {"GEMMA_QUEUE_LIMIT": "5"}).queue_limit == 5
