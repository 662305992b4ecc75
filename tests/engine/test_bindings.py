"""The Python surface of `gemma_engine` (rust/src/bindings.rs, rust/python/gemma_engine/__init__.pyi):
one test per binding behaviour, on the real engine and the dense tiny checkpoint."""

import json
import platform
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

import gemma_engine
from gemma_engine import testing
from tests.checkpoints.parity import PARITY_PROMPT

CONTEXT = 96
PROMPT = PARITY_PROMPT


@pytest.fixture(scope="module")
def engine(dense_checkpoint):
    return gemma_engine.Engine(str(dense_checkpoint), like=torch.zeros(1), context=CONTEXT, dtype="float32")


@pytest.fixture(scope="module")
def greedy(engine):
    """The engine's own 20-token run, used only to pick stop ids and batch sizes (parity with
    Transformers is in test_parity.py)."""
    return engine.decode(PROMPT, 20)[0]


def test_module_surface_and_build_record_versions():
    for name in ("Engine", "smoke", "BUILD", "__version__"):
        assert hasattr(gemma_engine, name), name
    for name in ("matmul_sum", "add_"):
        assert hasattr(testing, name) and name not in gemma_engine.__all__, name
    build = gemma_engine.BUILD
    assert set(build) == {"torch", "rustc", "python", "crate", "cuda_graphs"}
    if torch.version.cuda is None:
        assert build["cuda_graphs"] is False
    assert build["torch"] == torch.__version__
    assert build["python"] == platform.python_version()
    assert build["crate"] == gemma_engine.__version__
    assert build["rustc"].startswith("rustc ")


def test_a_pickled_request_is_made_again_from_its_constructors_arguments(engine):
    """Requests cross to the other ranks of a tensor-parallel group pickled (gemma_engine.distributed): every
    argument survives, soft tokens included, and the engine decodes the copy as the original."""
    import pickle

    sampling = gemma_engine.SamplingParams(temperature=0.8, top_k=5, seed=3, logit_bias={7: -2.5}, logprobs=2,
                                           repetition_penalty=1.1)
    request = gemma_engine.Request(9, PARITY_PROMPT, 6, [1], sampling, prompt_logprobs=1, cache_salt="s",
                                   cache_boundary=3, media=[(2, torch.arange(8.0).reshape(1, 8), 77)], next_turn=5)
    copy = pickle.loads(pickle.dumps(request))
    assert (copy.id, copy.ids, copy.max_new, copy.cache_salt, copy.cache_boundary, copy.next_turn) == (
        9, PARITY_PROMPT, 6, "s", 3, 5)
    assert repr(pickle.loads(pickle.dumps(sampling))) == repr(sampling)
    args = copy.__reduce__()[1]
    assert (args[3], repr(args[4]), args[6]) == ([1], repr(sampling), 1)
    [(start, embeds, key)] = args[9]
    assert (start, key) == (2, 77) and torch.equal(embeds, torch.arange(8.0).reshape(1, 8))

    def run(r):
        events = []
        pending = [r]

        def poll(free, idle):
            nonlocal pending
            if not pending and events and events[-1].finish:
                return None
            handed, pending = pending, []
            return handed, []

        engine.run(poll, lambda evs, stats: events.extend(evs))
        return [(e.tokens, e.logprobs, e.prompt_logprobs, e.finish) for e in events]

    plain = gemma_engine.Request(9, PARITY_PROMPT, 6, [1], sampling, prompt_logprobs=1)
    assert run(pickle.loads(pickle.dumps(plain))) == run(plain)


def test_aten_calls_counts_each_operator_call_and_no_handle_copy():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    before = testing.aten_calls()
    testing.matmul_sum(a, b)  # matmul, sum, item; taking the two tensors reaches no operator
    assert testing.aten_calls() - before == 3


def test_smoke_runs_an_aten_call_on_the_like_device():
    assert gemma_engine.smoke(torch.zeros(1)) == {"value": 4096.0, "device": "cpu"}


def test_matmul_sum_equals_torch():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    assert testing.matmul_sum(a, b) == pytest.approx(float((a @ b).sum()), rel=1e-5)


def test_matmul_sum_bad_shapes_is_value_error_with_both_shapes():
    with pytest.raises(ValueError, match=r"3x4 and 5x5"):
        testing.matmul_sum(torch.ones(3, 4), torch.ones(5, 5))


def test_add_shares_storage_with_python():
    t = torch.zeros(2, 3)
    view = t[1]
    testing.add_(view, 2.5)
    assert t.tolist() == [[0.0, 0.0, 0.0], [2.5, 2.5, 2.5]]


def test_non_tensor_argument_is_type_error():
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        testing.add_([1.0], 1.0)


def test_properties_and_layout(engine, dense_checkpoint):
    assert engine.eos_ids == [1, 106, 50]
    assert engine.vocab_size == 512
    assert engine.context == CONTEXT
    assert engine.max_batch == 1
    assert engine.dtype == "float32"
    assert engine.device == "cpu"
    # tiny config: S S F S F own their K/V, S F S F share it. Each own-KV layer holds K and V of
    # kv_heads x (ring + 1) x head_dim float32 (the extra entry takes padding rows' writes).
    cfg = json.loads((dense_checkpoint / "config.json").read_text())
    kv_heads, sliding_dim, full_dim = cfg["num_key_value_heads"], cfg["head_dim"], cfg["per_layer_config"]["2"]["head_dim"]
    sliding, full = 12, CONTEXT
    sliding_rings = 3 * 2 * kv_heads * (sliding + 1) * sliding_dim * 4
    rings = sliding_rings + 2 * 2 * kv_heads * (full + 1) * full_dim * 4
    # With prefix caching (the default) each slot also holds two snapshots of its sliding rings.
    snapshots = 2 * sliding_rings
    assert engine.layout() == {
        "full_rings": 2,
        "sliding_rings": 3,
        "shared_layers": 4,
        "context": CONTEXT,
        "sliding_window": 12,
        "max_batch": 1,
        "kv_bytes_per_slot": rings + snapshots,
        "kv_bytes": rings + snapshots,
        "prefix_caching": True,
        "snapshot_bytes_per_slot": snapshots,
        "tensor_parallel_size": 1,
        "tensor_parallel_rank": None,
    }
    off = gemma_engine.Engine(str(dense_checkpoint), like=torch.zeros(1), context=CONTEXT, dtype="float32",
                              prefix_caching=False)
    assert {k: off.layout()[k] for k in ("kv_bytes_per_slot", "prefix_caching", "snapshot_bytes_per_slot")} == {
        "kv_bytes_per_slot": rings, "prefix_caching": False, "snapshot_bytes_per_slot": 0}


@pytest.mark.parametrize(
    "ids, kwargs, message",
    [
        ([], {}, "empty"),
        (PROMPT, {"max_new": 0}, "max_new"),
        (PROMPT, {"read_every": 0}, "read_every"),
        ([2] * CONTEXT, {}, "context"),
        (PROMPT + [-1], {}, "-1"),
        (PROMPT + [512], {}, "512"),
    ],
    ids=["empty", "max_new", "read_every", "too_long", "negative_id", "id_past_vocab"],
)
def test_bad_decode_input_is_value_error(engine, ids, kwargs, message):
    args = {"max_new": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        engine.decode(ids, **args)


def test_bad_logits_input_is_value_error(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.logits([])


@pytest.mark.parametrize(
    "kwargs, message",
    [({"dtype": "int8"}, "dtype"), ({"context": 0}, "context"), ({"prefill_chunk": 0}, "prefill_chunk")],
    ids=["dtype", "context", "prefill_chunk"],
)
def test_bad_engine_argument_is_value_error(dense_checkpoint, kwargs, message):
    with pytest.raises(ValueError, match=message):
        gemma_engine.Engine(str(dense_checkpoint), **kwargs)


def test_onednn_is_the_cpu_default_in_float32_and_bfloat16_and_refused_where_it_cannot_run(dense_checkpoint):
    def engine(**kwargs):
        return gemma_engine.Engine(str(dense_checkpoint), context=32, **kwargs)

    onednn, aten = engine(dtype="float32"), engine(dtype="float32", onednn=False)
    assert (onednn.weights()["linear"], aten.weights()["linear"]) == ("onednn", "aten")
    assert onednn.weights()["linear_note"] is None
    assert aten.weights()["linear_note"] == "ATen's matmul, as asked (onednn=False)"
    # The tied lm_head keeps the embedding table and adds its packed copy.
    config = json.loads((dense_checkpoint / "config.json").read_text())
    assert config["tie_word_embeddings"] is not False
    table = config["vocab_size"] * config["hidden_size"] * 4
    assert onednn.weights()["bytes"] == aten.weights()["bytes"] + table
    # bfloat16: oneDNN where this CPU's oneDNN computes it, else ATen's matmul with a line that says why.
    bf16 = engine(dtype="bfloat16").weights()
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert (bf16["linear"], bf16["linear_note"]) == ("onednn", None)
    else:
        assert bf16["linear"] == "aten" and "no bfloat16 support in oneDNN" in bf16["linear_note"]
    assert engine(dtype="float16").weights()["linear"] == "aten"
    with pytest.raises(ValueError, match="oneDNN linears compute in float32 or bfloat16; dtype is float16"):
        engine(dtype="float16", onednn=True)


def test_callback_exception_propagates_from_decode(engine):
    class Boom(Exception):
        pass

    def on_tokens(batch):
        raise Boom("from the callback")

    with pytest.raises(Boom, match="from the callback"):
        engine.decode(PROMPT, 8, on_tokens=on_tokens)


def test_falsy_callback_return_cancels(engine, greedy):
    seen = []
    tokens, finish, _, _ = engine.decode(PROMPT, 20, read_every=3, on_tokens=lambda b: seen.append(b))
    assert finish == "cancelled"
    assert seen == [greedy[:3]]
    assert tokens == greedy[:3]


def test_max_new_gives_length_finish(engine, greedy):
    tokens, finish, read_s, decode_s = engine.decode(PROMPT, 5)
    assert (tokens, finish) == (greedy[:5], "length")
    assert read_s > 0 and decode_s > 0


def test_full_context_gives_length_finish(engine):
    tokens, finish, _, _ = engine.decode(PROMPT, 1000)
    assert finish == "length"
    assert len(PROMPT) + len(tokens) == CONTEXT


def test_stop_id_ends_decode_without_returning_it(engine, greedy):
    stop = greedy[6]
    first = greedy.index(stop)
    seen = []
    tokens, finish, _, _ = engine.decode(PROMPT, 20, stop_ids=[stop], read_every=4, on_tokens=lambda b: seen.append(b) or True)
    assert finish == "stop"
    assert tokens == greedy[:first]
    assert stop not in sum(seen, [])


def test_tokens_stream_in_batches_of_read_every(engine, greedy):
    seen = []
    tokens, finish, _, _ = engine.decode(PROMPT, 10, read_every=4, on_tokens=lambda b: seen.append(b) or True)
    assert [len(b) for b in seen] == [4, 4, 2]
    assert sum(seen, []) == tokens == greedy[:10]
    assert finish == "length"


def test_gil_is_released_during_decode(engine):
    count = 0
    running = threading.Event()
    stop = threading.Event()

    def spin():
        nonlocal count
        running.set()
        while not stop.is_set():
            count += 1

    thread = threading.Thread(target=spin)
    thread.start()
    running.wait()
    try:
        before = count
        engine.decode(PROMPT, CONTEXT - len(PROMPT))
        during = count - before
    finally:
        stop.set()
        thread.join()
    # Holding the GIL for the whole call would leave the spinning thread a few switch intervals.
    assert during > 10_000


def test_call_from_another_thread_is_refused(engine):
    caught = []

    def other():
        try:
            engine.layout()
        except BaseException as e:  # pyo3's PanicException derives from BaseException
            caught.append(e)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(caught) == 1
    assert type(caught[0]).__name__ == "PanicException"
    assert "unsendable" in str(caught[0]) or "thread" in str(caught[0])


def test_import_under_another_torch_version_is_import_error():
    code = "import torch; torch.__version__ = '0.0.1'; import gemma_engine"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "ImportError" in result.stderr
    assert "0.0.1" in result.stderr
    assert gemma_engine.BUILD["torch"] in result.stderr


def _copy_checkpoint(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_tensor_is_value_error_naming_it_and_its_shape(dense_checkpoint, tmp_path):
    name = "model.layers.1.self_attn.q_norm.weight"
    bad = _copy_checkpoint(dense_checkpoint, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"{name}: missing \(expected shape \[32\]\)"):
        gemma_engine.Engine(str(bad), context=CONTEXT)


def test_misshapen_tensor_is_value_error_naming_both_shapes(dense_checkpoint, tmp_path):
    name = "model.layers.2.self_attn.q_proj.weight"  # full layer: [heads * 64, hidden]

    def edit(t):
        t[name] = t[name][:100]

    bad = _copy_checkpoint(dense_checkpoint, tmp_path / "misshapen", edit)
    with pytest.raises(ValueError, match=rf"{name}: has shape \[100, 128\], expected \[256, 128\]"):
        gemma_engine.Engine(str(bad), context=CONTEXT)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("hidden_size", None, "hidden_size: missing"),
        ("num_attention_heads", "four", "num_attention_heads: must be an integer"),
        ("layer_types", ["sliding_attention"], "layer_types: has 1 entries"),
        ("enable_moe_block", True, "num_experts: missing"),
        ("vocab_size_per_layer_input", 100, r"vocab_size_per_layer_input: must be >= vocab_size \(512\)"),
    ],
    ids=["missing", "not_an_integer", "layer_types_length", "moe_without_sizes", "small_per_layer_vocab"],
)
def test_bad_config_key_is_value_error_naming_it(dense_checkpoint, tmp_path, key, value, message):
    bad = tmp_path / "config"
    shutil.copytree(dense_checkpoint, bad)
    config = json.loads((bad / "config.json").read_text())
    if value is None:
        del config[key]
    else:
        config[key] = value
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"config.json: {message}"):
        gemma_engine.Engine(str(bad), context=CONTEXT)


def test_sharded_checkpoint_with_index_reads_the_same_model(dense_checkpoint, tmp_path, greedy):
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(dense_checkpoint / name, sharded / name)
    tensors = load_file(dense_checkpoint / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, sharded / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    other = gemma_engine.Engine(str(sharded), context=CONTEXT, dtype="float32")
    assert other.decode(PROMPT, 20)[0] == greedy


def test_zero_padded_per_layer_config_keys_are_read(dense_checkpoint, tmp_path, engine, greedy):
    # Transformers zero-pads the layer keys to one width ({"04": ...} in a 35-layer config.json).
    padded = tmp_path / "padded"
    shutil.copytree(dense_checkpoint, padded)
    config = json.loads((padded / "config.json").read_text())
    config["per_layer_config"] = {k.zfill(3): v for k, v in config["per_layer_config"].items()}
    (padded / "config.json").write_text(json.dumps(config))
    other = gemma_engine.Engine(str(padded), context=CONTEXT, dtype="float32")
    assert other.decode(PROMPT, 20)[0] == greedy


def test_language_model_prefix_and_redundant_shared_kv_tensors_read_the_same_model(
    dense_checkpoint, tmp_path, greedy
):
    # The hub's E2B files are a Gemma4ForConditionalGeneration: tensors under model.language_model.*,
    # and KV-shared layers still ship k/v projections and norms that Transformers ignores.
    config = json.loads((dense_checkpoint / "config.json").read_text())
    first_shared = config["num_hidden_layers"] - config["num_kv_shared_layers"]
    kind = config["layer_types"][first_shared]
    # The last layer of the same type that owns K/V: its tensors have the shapes the hub's would have.
    donor = max(i for i in range(first_shared) if config["layer_types"][i] == kind)

    def edit(t):
        for name in list(t):
            if name.startswith("model.") and f"layers.{donor}.self_attn." in name:
                for part in ("k_proj", "v_proj", "k_norm"):
                    if f".{part}." in name:
                        shared = name.replace(f"layers.{donor}.", f"layers.{first_shared}.")
                        t[shared] = torch.randn_like(t[name])
        for name in list(t):
            t[name.replace("model.", "model.language_model.", 1)] = t.pop(name)

    hub_like = _copy_checkpoint(dense_checkpoint, tmp_path / "hub_like", edit)
    names = load_file(hub_like / "model.safetensors")
    assert f"model.language_model.layers.{first_shared}.self_attn.k_proj.weight" in names
    assert not [n for n in names if n.startswith("model.layers.")]
    other = gemma_engine.Engine(str(hub_like), context=CONTEXT, dtype="float32")
    assert other.decode(PROMPT, 20)[0] == greedy


@pytest.mark.gpu
def test_smoke_runs_on_cuda():
    result = gemma_engine.smoke(torch.zeros(1, device="cuda"))
    assert result["value"] == 4096.0
    assert result["device"].startswith("cuda")
