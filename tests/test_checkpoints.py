"""Tests of the tiny test checkpoints (tests/checkpoints/): determinism, the on-disk formats its
docstring documents, Transformers references, greedy margins, and the chat tokenizer."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from tests.checkpoints.__main__ import main
from tests.checkpoints.agent import save_agent_chat
from tests.checkpoints.chat import (
    CHAT_MIN_REPLY,
    CHAT_PROMPT,
    CHAT_SPECIAL_TOKENS,
    CHAT_VOCAB_SIZE,
    chat_reply,
    save_chat,
)
from tests.checkpoints.parity import (
    GENERATE_TOKENS,
    MIN_DISTINCT_TOKENS,
    MIN_MARGIN,
    PARITY_PROMPT,
    greedy_reference,
    load_hf_reference,
    top2_margins,
)
from tests.checkpoints.quantized import GROUP_SIZE, dequantize_emb4_tables, save_w4a16, save_w4a16_emb4
from tests.checkpoints.text import random_model, save_dense, tiny_text_config

LINEAR_SUFFIXES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "per_layer_input_gate",
    "per_layer_projection",
)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _unpack_int4(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """The unpacking rule of tests/checkpoints/quantized.py's docstring, written out independently of
    compressed-tensors: the float32 product q * scale (exact: a 4-bit integer times a bf16 scale)."""
    rows, cols = shape.tolist()
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = 4 * torch.arange(8)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF  # [rows, cols/8, 8], column 8k+j at nibble j
    q = nibbles.reshape(rows, -1)[:, :cols] - 8
    group = cols // scale.shape[1]
    return q.float() * scale.float().repeat_interleave(group, dim=1)


def _quantized_linears(config) -> list[str]:
    shared_from = config.num_hidden_layers - config.num_kv_shared_layers
    names = ["model.per_layer_model_projection"]
    for i in range(config.num_hidden_layers):
        for suffix in LINEAR_SUFFIXES:
            if i >= shared_from and suffix in ("self_attn.k_proj", "self_attn.v_proj"):
                continue
            names.append(f"model.layers.{i}.{suffix}")
    return names


def test_tiny_config_exercises_every_feature():
    config = tiny_text_config()
    shared_from = config.num_hidden_layers - config.num_kv_shared_layers
    own, shared = config.layer_types[:shared_from], config.layer_types[shared_from:]
    assert {"sliding_attention", "full_attention"} <= set(own)
    assert {"sliding_attention", "full_attention"} <= set(shared)
    assert config.hidden_size_per_layer_input > 0 and config.use_double_wide_mlp
    assert config.final_logit_softcapping == 30.0 and config.tie_word_embeddings
    assert config.rope_parameters["full_attention"]["rope_type"] == "proportional"
    assert len(PARITY_PROMPT) > config.sliding_window and PARITY_PROMPT[0] == config.bos_token_id
    model = random_model()
    # Full layers use global_head_dim (64), sliding ones head_dim (32).
    head_dims = {t: {layer.self_attn.q_norm.weight.shape[0] for layer, lt in zip(model.model.layers, config.layer_types) if lt == t}
                 for t in ("sliding_attention", "full_attention")}
    assert head_dims == {"sliding_attention": {32}, "full_attention": {64}}
    # Shared layers get the double-wide MLP, owning layers the normal one.
    assert model.model.layers[0].mlp.gate_proj.weight.shape[0] == config.intermediate_size
    assert model.model.layers[-1].mlp.gate_proj.weight.shape[0] == 2 * config.intermediate_size
    assert not hasattr(model.model.layers[-1].self_attn, "k_proj") or model.model.layers[-1].self_attn.k_proj is None


def test_random_init_moves_norms_and_layer_scalars_off_one():
    model = random_model()
    state = model.state_dict()
    norms = [n for n in state if n.endswith("norm.weight")]
    assert norms
    for name in norms:
        assert not torch.allclose(state[name], torch.ones_like(state[name])), name
    scalars = torch.cat([state[n] for n in state if n.endswith("layer_scalar")])
    assert len(scalars) == model.config.num_hidden_layers
    assert scalars.min() >= 0.4 and scalars.max() <= 1.0 and len(set(scalars.tolist())) == len(scalars)
    # bf16-representable, so the dense file is lossless.
    for name, tensor in state.items():
        assert torch.equal(tensor, tensor.to(torch.bfloat16).float()), name


def test_builders_are_deterministic(tmp_path):
    for run in ("a", "b"):
        save_dense(tmp_path / run / "dense")
        save_w4a16_emb4(tmp_path / run / "w4a16", tmp_path / run / "emb4")
        save_chat(tmp_path / run / "chat")
        save_agent_chat(tmp_path / run / "agent")
    for kind in ("dense", "w4a16", "emb4", "chat", "agent"):
        assert _files(tmp_path / "a" / kind) == _files(tmp_path / "b" / kind), kind
    # The W4A16 checkpoint of the emb4 pair is the plain W4A16 checkpoint.
    save_w4a16(tmp_path / "w4a16_alone")
    assert _files(tmp_path / "w4a16_alone") == _files(tmp_path / "a" / "w4a16")


def test_dense_checkpoint_is_bf16_and_loads_back_exactly(dense_checkpoint):
    tensors = _tensors(dense_checkpoint / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert "lm_head.weight" not in tensors and "model.layers.0.layer_scalar" in tensors
    assert "model.layers.8.self_attn.k_proj.weight" not in tensors  # KV-shared layer
    config = json.loads((dense_checkpoint / "config.json").read_text())
    assert config["model_type"] == "gemma4_text" and config["dtype"] == "bfloat16"
    reference = load_hf_reference(dense_checkpoint)
    expected = random_model().state_dict()
    for name, tensor in reference.state_dict().items():
        if name in expected and "rotary_emb" not in name and "embed_scale" not in name:
            assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name
    assert reference.lm_head.weight.data_ptr() == reference.model.embed_tokens.weight.data_ptr()


def test_w4a16_packs_have_documented_dtypes_shapes_and_config(w4a16_checkpoint):
    config = tiny_text_config()
    tensors = _tensors(w4a16_checkpoint / "model.safetensors")
    linears = _quantized_linears(config)
    dense = random_model().state_dict()
    for name in linears:
        out_features, in_features = dense[f"{name}.weight"].shape
        assert f"{name}.weight" not in tensors, name
        assert tensors[f"{name}.weight_packed"].dtype == torch.int32
        assert tensors[f"{name}.weight_packed"].shape == (out_features, in_features // 8)
        assert tensors[f"{name}.weight_scale"].dtype == torch.bfloat16
        assert tensors[f"{name}.weight_scale"].shape == (out_features, in_features // GROUP_SIZE)
        assert tensors[f"{name}.weight_shape"].tolist() == [out_features, in_features]
    packed = {n.rsplit(".", 1)[0] for n in tensors if n.endswith("weight_packed")}
    assert packed == set(linears)
    for name in ("model.embed_tokens.weight", "model.embed_tokens_per_layer.weight", "model.norm.weight"):
        assert tensors[name].dtype == torch.bfloat16
    qc = json.loads((w4a16_checkpoint / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    weights = group["weights"]
    assert (weights["num_bits"], weights["type"], weights["symmetric"], weights["strategy"]) == (4, "int", True, "group")
    assert weights["group_size"] == GROUP_SIZE


def test_w4a16_reference_holds_the_documented_dequantized_weights(w4a16_checkpoint):
    tensors = _tensors(w4a16_checkpoint / "model.safetensors")
    reference = load_hf_reference(w4a16_checkpoint).state_dict()
    dense = random_model().state_dict()
    for name in _quantized_linears(tiny_text_config()):
        expected = _unpack_int4(*(tensors[f"{name}.weight_{s}"] for s in ("packed", "scale", "shape")))
        assert torch.equal(reference[f"{name}.weight"], expected), name
        error = (reference[f"{name}.weight"] - dense[f"{name}.weight"]).norm() / dense[f"{name}.weight"].norm()
        assert 0 < error < 0.2, (name, float(error))
    assert torch.equal(reference["model.embed_tokens.weight"], dense["model.embed_tokens.weight"])


def test_emb4_tables_follow_the_documented_layout(emb4_checkpoint, w4a16_checkpoint):
    model_dir, emb_dir = emb4_checkpoint
    assert _files(model_dir) == _files(w4a16_checkpoint)
    assert sorted(p.name for p in emb_dir.iterdir()) == ["config.json", "model.safetensors"]
    config = tiny_text_config()
    widths = {"embed_tokens": config.hidden_size,
              "embed_tokens_per_layer": config.num_hidden_layers * config.hidden_size_per_layer_input}
    tensors = _tensors(emb_dir / "model.safetensors")
    assert set(tensors) == {f"model.language_model.{t}.weight_{s}" for t in widths for s in ("packed", "scale", "shape")}
    dense = random_model().state_dict()
    reference = load_hf_reference(model_dir, emb_dir)
    w4a16 = load_hf_reference(model_dir).state_dict()
    for table, width in widths.items():
        prefix = f"model.language_model.{table}.weight_"
        packed, scale, shape = (tensors[prefix + s] for s in ("packed", "scale", "shape"))
        assert packed.dtype == torch.int32 and packed.shape == (config.vocab_size, width // 8)
        assert scale.dtype == torch.bfloat16 and scale.shape == (config.vocab_size, width // GROUP_SIZE)
        assert shape.dtype == torch.int64 and shape.tolist() == [config.vocab_size, width]
        expected = _unpack_int4(packed, scale, shape)
        assert torch.equal(dequantize_emb4_tables(emb_dir)[table], expected)
        # In bfloat16 the product is rounded once.
        assert torch.equal(dequantize_emb4_tables(emb_dir, torch.bfloat16)[table], expected.to(torch.bfloat16))
        assert torch.equal(getattr(reference.model, table).weight, expected)
        error = (expected - dense[f"model.{table}.weight"]).norm() / dense[f"model.{table}.weight"].norm()
        assert 0 < error < 0.2, (table, float(error))
    # The tied lm_head uses the int4 table; the linears are the W4A16 ones.
    assert torch.equal(reference.lm_head.weight, reference.model.embed_tokens.weight)
    for name, tensor in reference.state_dict().items():
        if "embed_tokens" not in name and name != "lm_head.weight":
            assert torch.equal(tensor, w4a16[name]), name
    qc = json.loads((emb_dir / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["targets"] == ["Embedding"]
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == GROUP_SIZE
    assert qc["format"] == "pack-quantized"


@pytest.mark.parametrize("kind", ["dense", "w4a16", "emb4"])
def test_greedy_reference_run_has_clear_margins(kind, request, parity_prompt):
    if kind == "emb4":
        model = load_hf_reference(*request.getfixturevalue("emb4_checkpoint"))
    else:
        model = load_hf_reference(request.getfixturevalue(f"{kind}_checkpoint"))
    tokens, logits = greedy_reference(model, parity_prompt)
    assert len(tokens) == GENERATE_TOKENS and not set(tokens) & set(model.config.eos_token_id)
    assert len(set(tokens)) >= MIN_DISTINCT_TOKENS
    assert float(top2_margins(logits).min()) > MIN_MARGIN
    assert len(parity_prompt) + len(tokens) > 4 * model.config.sliding_window


def test_chat_tokenizer_round_trips_and_renders_gemma_template(chat_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)
    assert len(tokenizer) == CHAT_VOCAB_SIZE
    assert tokenizer.convert_tokens_to_ids(list(CHAT_SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]
    text = "Hello, ocean! Ünïcødé 🌊 and\ttabs\n  two spaces."
    ids = tokenizer(text).input_ids
    assert ids[0] == 2 and max(ids) < CHAT_VOCAB_SIZE
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "What is a TPU?"}]},
    ]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nWhat is a TPU?<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = tokenizer.apply_chat_template(CHAT_PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids[:2]) == [2, 3] and list(ids[-4:]) == tokenizer.encode("<start_of_turn>model\n", add_special_tokens=False)
    config = json.loads((chat_checkpoint / "config.json").read_text())
    assert config["vocab_size"] == CHAT_VOCAB_SIZE and config["eos_token_id"] == [1, 4]
    generation = json.loads((chat_checkpoint / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 4]


def test_chat_reply_is_long_enough_to_stream(chat_checkpoint):
    assert len(chat_reply(chat_checkpoint)) >= CHAT_MIN_REPLY


def test_command_line_writes_the_chat_checkpoint(tmp_path, chat_checkpoint):
    main(["--kind", "chat", "--out", str(tmp_path / "chat")])
    assert _files(tmp_path / "chat") == _files(chat_checkpoint)
