"""Gemma 4 variants beyond the E-series, against the plain Transformers load, in float32.

K=V attention (`attention_k_eq_v`, Gemma 4 31B's full-attention layers: no v_proj, the values are the
key projection's output before k_norm and RoPE, and `num_global_key_value_heads` KV heads): on a tiny
random config shaped like the 31B (no per-layer inputs, no KV sharing, full layers with their own head
size and KV head count) and on the E-series tiny config with K=V turned on (its KV-shared tail reads a K=V
layer's values), 32 greedy tokens equal Transformers' and the first token's KL(hf || engine) <= 1e-5, the
31B shape W4A16 too; in bfloat16, read a token at a time, the engine is no further from float32 than
Transformers' own bfloat16 run (twice its KL at most, as tests/engine/test_parity.py holds the E-series). A
config.json as the hub ships it (no `per_layer_config`, `global_head_dim` and `num_global_key_value_heads`
instead) gives the same geometry, as Transformers' own config derives it.
"""

import json

import pytest
import torch

import gemma_engine
from tests import checkpoints as ck

pytestmark = pytest.mark.slow

TOKENS = 32
SLIDING, FULL = "sliding_attention", "full_attention"


def k_eq_v_31b_shaped() -> dict:
    """The 31B's shape in miniature: K=V full layers with a head size and a KV head count of their own, no
    per-layer inputs, no KV sharing, the single-width MLP."""
    return dict(attention_k_eq_v=True, num_global_key_value_heads=1, num_kv_shared_layers=0,
                hidden_size_per_layer_input=0, use_double_wide_mlp=False,
                layer_types=[SLIDING] * 5 + [FULL] + [SLIDING] * 2 + [FULL])


def k_eq_v_e_series() -> dict:
    """The E-series tiny config with K=V on: the shared tail's full layers read a K=V layer's values."""
    return dict(attention_k_eq_v=True, num_global_key_value_heads=1)


CONFIGS = {"31b_shaped": k_eq_v_31b_shaped, "e_series": k_eq_v_e_series}
SAVERS = {"dense": ck.save_dense, "w4a16": lambda out, seed, config: ck.save_w4a16(out, seed=seed, config=config)}
# (config, checkpoint kind): both configs dense, and the 31B shape W4A16 (compressed-tensors quantizes its
# k_proj, which the engine stacks twice).
RUNS = [("31b_shaped", "dense"), ("31b_shaped", "w4a16"), ("e_series", "dense")]


@pytest.fixture(scope="module", params=RUNS, ids=["-".join(r) for r in RUNS])
def k_eq_v_run(request, tmp_path_factory):
    """(checkpoint dir, Transformers' greedy tokens and logits) of one K=V config and checkpoint kind."""
    name, kind = request.param
    model_dir = SAVERS[kind](tmp_path_factory.mktemp(f"k_eq_v_{name}_{kind}"), ck.SEED,
                             ck.tiny_text_config(**CONFIGS[name]()))
    reference = ck.load_hf_reference(model_dir)
    own_keys = [layer.self_attn for layer in reference.model.layers
                if not layer.self_attn.is_sliding and not layer.self_attn.is_kv_shared_layer]
    assert own_keys and all(a.v_proj is None for a in own_keys)  # the reference really is K=V
    return model_dir, ck.greedy_reference(reference, ck.PARITY_PROMPT, TOKENS)


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    log_p, log_q = (torch.log_softmax(x.double(), -1) for x in (p_logits, q_logits))
    return float(torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="sum"))


def engine(model_dir, **kwargs) -> gemma_engine.Engine:
    return gemma_engine.Engine(str(model_dir), None, like=torch.zeros(1), context=128, dtype="float32", **kwargs)


@pytest.mark.parametrize("onednn", [True, False])
def test_k_eq_v_greedy_tokens_and_first_token_match_transformers(k_eq_v_run, onednn):
    model_dir, (hf_tokens, hf_logits) = k_eq_v_run
    e = engine(model_dir, onednn=onednn)
    tokens, finish, _, _ = e.decode(ck.PARITY_PROMPT, TOKENS)
    assert len(hf_tokens) == TOKENS and tokens == hf_tokens and finish == "length"
    divergence = kl(hf_logits[0], e.logits(ck.PARITY_PROMPT))
    assert divergence <= 1e-5, f"KL(hf||rust) = {divergence:.3e}"


def test_k_eq_v_in_bfloat16_stays_as_close_to_float32_as_transformers_own(k_eq_v_run):
    """The prompt read a token at a time (the decode step's path) in bfloat16, as test_parity.py holds the
    E-series: the engine drifts from Transformers' float32 no more than twice Transformers' own bfloat16."""
    from transformers import DynamicCache

    model_dir, (_, hf_logits) = k_eq_v_run
    hf = ck.load_hf_reference(model_dir, dtype=torch.bfloat16)
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        for token in ck.PARITY_PROMPT:
            hf_bf16 = hf(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1].float()
    e = gemma_engine.Engine(str(model_dir), None, like=torch.zeros(1), context=128, dtype="bfloat16",
                            packed_int4=False, prefill_chunk=1)
    hf_drift, rust_drift = kl(hf_logits[0], hf_bf16), kl(hf_logits[0], e.logits(ck.PARITY_PROMPT))
    assert 0 < hf_drift and rust_drift <= 2 * hf_drift, f"KL from float32: engine {rust_drift:.3e}, Transformers {hf_drift:.3e}"


def test_a_hub_config_without_per_layer_config_gives_the_same_geometry(k_eq_v_run, tmp_path):
    """The hub's config.json names global_head_dim and num_global_key_value_heads rather than writing
    per_layer_config; Transformers derives the same per-layer geometry from them, and so does the engine."""
    model_dir, (hf_tokens, _) = k_eq_v_run
    hub = tmp_path / "hub"
    hub.mkdir()
    for f in model_dir.iterdir():
        (hub / f.name).symlink_to(f)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("per_layer_config")
    config.update(global_head_dim=64, num_global_key_value_heads=1)
    (hub / "config.json").unlink()
    (hub / "config.json").write_text(json.dumps(config))
    tokens, _, _, _ = engine(hub).decode(ck.PARITY_PROMPT, TOKENS)
    assert tokens == hf_tokens
    assert tokens == ck.greedy_reference(ck.load_hf_reference(hub), ck.PARITY_PROMPT, TOKENS)[0]


def test_mixture_of_experts_is_still_refused_naming_its_key(tmp_path):
    model_dir = ck.save_dense(tmp_path / "moe", ck.SEED, ck.tiny_text_config())
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "enable_moe_block": True}))
    with pytest.raises(ValueError, match="enable_moe_block"):
        engine(model_dir)
