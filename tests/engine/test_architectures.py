"""Gemma 4 variants beyond the E-series, against the plain Transformers load, in float32.

* K=V attention (`attention_k_eq_v`, the 31B's full-attention layers: no v_proj, the values are the key
  projection's output before k_norm and RoPE, and `num_global_key_value_heads` KV heads): a tiny random
  config shaped like the 31B (no per-layer inputs, no KV sharing, full layers with their own head size and
  KV head count), and the E-series tiny config with K=V turned on (its KV-shared tail reads a K=V layer's
  values).
* Mixture of experts (`enable_moe_block`, the 26B-A4B): the 31B shape with a router and 8 experts (2 a
  token) beside every layer's MLP.
* The 12B "unified" text model (`gemma4_unified_text`, Gemma4UnifiedForCausalLM): Gemma 4's decoder with
  no per-layer inputs, experts or KV sharing.

On each, 32 greedy tokens equal Transformers' and the first token's KL(hf || engine) <= 1e-5, W4A16 too
where compressed-tensors quantizes the architecture (its "Linear" target: attention, MLP, the router's
projection; the experts are 3D parameters, not Linear modules, and stay bfloat16); in bfloat16, read a
token at a time, the engine is no further from float32 than Transformers' own bfloat16 run (its KL times
BF16_DRIFT_FACTOR at most, as tests/engine/test_parity.py holds the E-series). A config.json as the hub ships it (no
`per_layer_config`, `global_head_dim` and `num_global_key_value_heads` instead) gives the same geometry,
as Transformers' own config derives it. An MoE layer's ATen calls do not depend on the number of experts.
"""

import json

import pytest
import torch

import gemma_engine
from tests.checkpoints.parity import BF16_DRIFT_FACTOR, PARITY_PROMPT, greedy_reference, load_hf_reference
from tests.checkpoints.quantized import save_w4a16
from tests.checkpoints.text import SEED, save_dense, tiny_text_config, tiny_unified_text_config

pytestmark = pytest.mark.slow

TOKENS = 32
SLIDING, FULL = "sliding_attention", "full_attention"


def k_eq_v_31b_shaped(**extra):
    """The 31B's shape in miniature: K=V full layers with a head size and a KV head count of their own, no
    per-layer inputs, no KV sharing, the single-width MLP."""
    return tiny_text_config(attention_k_eq_v=True, num_global_key_value_heads=1, num_kv_shared_layers=0,
                               hidden_size_per_layer_input=0, use_double_wide_mlp=False,
                               layer_types=[SLIDING] * 5 + [FULL] + [SLIDING] * 2 + [FULL], **extra)


def k_eq_v_e_series():
    """The E-series tiny config with K=V on: the shared tail's full layers read a K=V layer's values."""
    return tiny_text_config(attention_k_eq_v=True, num_global_key_value_heads=1)


def moe_26b_shaped(num_experts: int = 8):
    """The 31B shape with an MoE block in every layer: a dense MLP of 128 beside `num_experts` experts of
    64, two a token."""
    return k_eq_v_31b_shaped(enable_moe_block=True, num_experts=num_experts, top_k_experts=2,
                             moe_intermediate_size=64, intermediate_size=128)


def is_k_eq_v(reference) -> bool:
    own_keys = [layer.self_attn for layer in reference.model.layers
                if not layer.self_attn.is_sliding and not layer.self_attn.is_kv_shared_layer]
    return bool(own_keys) and all(a.v_proj is None for a in own_keys)


def is_moe(reference) -> bool:
    return is_k_eq_v(reference) and all(layer.enable_moe_block for layer in reference.model.layers)


def is_unified(reference) -> bool:
    return type(reference).__name__ == "Gemma4UnifiedForCausalLM"


# name: (config builder, what the reference must really be)
CONFIGS = {
    "31b_shaped": (k_eq_v_31b_shaped, is_k_eq_v),
    "e_series": (k_eq_v_e_series, is_k_eq_v),
    "26b_moe_shaped": (moe_26b_shaped, is_moe),
    "12b_shaped": (tiny_unified_text_config, is_unified),
}
SAVERS = {"dense": save_dense, "w4a16": lambda out, seed, config: save_w4a16(out, seed=seed, config=config)}
# (config, checkpoint kind, weight seed): every config dense; the 31B shape W4A16 (compressed-tensors
# quantizes its k_proj, which the engine stacks twice), and the MoE one (its router's projection quantized,
# the experts not). The MoE W4A16 and the 12B runs draw their weights from seed 172: with SEED their
# references write an eos id (106) after 2 and 26 tokens (172's smallest top-1/top-2 gaps over the 32 steps:
# 0.62 and 1.38).
RUNS = [("31b_shaped", "dense", SEED), ("31b_shaped", "w4a16", SEED), ("e_series", "dense", SEED),
        ("26b_moe_shaped", "dense", SEED), ("26b_moe_shaped", "w4a16", 172), ("12b_shaped", "dense", 172)]


@pytest.fixture(scope="module", params=RUNS, ids=[f"{name}-{kind}" for name, kind, _ in RUNS])
def arch_run(request, tmp_path_factory):
    """(checkpoint dir, Transformers' greedy tokens and logits) of one config and checkpoint kind."""
    name, kind, seed = request.param
    build, really = CONFIGS[name]
    model_dir = SAVERS[kind](tmp_path_factory.mktemp(f"{name}_{kind}"), seed, build())
    reference = load_hf_reference(model_dir)
    assert really(reference), name
    return model_dir, greedy_reference(reference, PARITY_PROMPT, TOKENS)


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    log_p, log_q = (torch.log_softmax(x.double(), -1) for x in (p_logits, q_logits))
    return float(torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="sum"))


def engine(model_dir, **kwargs) -> gemma_engine.Engine:
    return gemma_engine.Engine(str(model_dir), None, like=torch.zeros(1), context=128, dtype="float32", **kwargs)


@pytest.mark.parametrize("onednn", [True, False])
def test_greedy_tokens_and_first_token_match_transformers(arch_run, onednn):
    model_dir, (hf_tokens, hf_logits) = arch_run
    e = engine(model_dir, onednn=onednn)
    tokens, finish, _, _ = e.decode(PARITY_PROMPT, TOKENS)
    assert len(hf_tokens) == TOKENS and tokens == hf_tokens and finish == "length"
    divergence = kl(hf_logits[0], e.logits(PARITY_PROMPT))
    assert divergence <= 1e-5, f"KL(hf||rust) = {divergence:.3e}"


def test_bfloat16_stays_as_close_to_float32_as_transformers_own(arch_run):
    """The prompt read a token at a time (the decode step's path) in bfloat16, as test_parity.py holds the
    E-series: the engine drifts from Transformers' float32 no further than Transformers' own bfloat16 does
    (within BF16_DRIFT_FACTOR)."""
    from transformers import DynamicCache

    model_dir, (_, hf_logits) = arch_run
    hf = load_hf_reference(model_dir, dtype=torch.bfloat16)
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        for token in PARITY_PROMPT:
            hf_bf16 = hf(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1].float()
    e = gemma_engine.Engine(str(model_dir), None, like=torch.zeros(1), context=128, dtype="bfloat16",
                            packed_int4=False, prefill_chunk=1)
    hf_drift, rust_drift = kl(hf_logits[0], hf_bf16), kl(hf_logits[0], e.logits(PARITY_PROMPT))
    assert 0 < hf_drift and rust_drift <= BF16_DRIFT_FACTOR * hf_drift, \
        f"KL from float32: engine {rust_drift:.3e}, Transformers {hf_drift:.3e}"


def test_a_hub_config_without_per_layer_config_gives_the_same_geometry(arch_run, tmp_path):
    """The hub's config.json names global_head_dim and num_global_key_value_heads rather than writing
    per_layer_config; Transformers derives the same per-layer geometry from them, and so does the engine."""
    model_dir, (hf_tokens, _) = arch_run
    hub = tmp_path / "hub"
    hub.mkdir()
    for f in model_dir.iterdir():
        (hub / f.name).symlink_to(f)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("per_layer_config")
    config.update(global_head_dim=64, num_global_key_value_heads=1)
    (hub / "config.json").unlink()
    (hub / "config.json").write_text(json.dumps(config))
    tokens, _, _, _ = engine(hub).decode(PARITY_PROMPT, TOKENS)
    assert tokens == hf_tokens
    assert tokens == greedy_reference(load_hf_reference(hub), PARITY_PROMPT, TOKENS)[0]


def test_an_moe_config_without_its_sizes_is_refused_naming_the_key(tmp_path):
    model_dir = save_dense(tmp_path / "moe", SEED, moe_26b_shaped())
    config = json.loads((model_dir / "config.json").read_text())
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        (model_dir / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != key}))
        with pytest.raises(ValueError, match=key):
            engine(model_dir)


def test_an_moe_layers_aten_calls_do_not_grow_with_the_number_of_experts(tmp_path):
    """The experts run as two grouped products (gemma4/moe.rs): 4 or 16 experts, a decode step and a prompt
    read make the same calls a layer."""
    def layer_calls(num_experts: int) -> tuple[list[int], list[int]]:
        e = engine(save_dense(tmp_path / f"moe{num_experts}", SEED, moe_26b_shaped(num_experts)))
        e.logits(PARITY_PROMPT)
        prompt = e.layer_calls
        e.decode(PARITY_PROMPT, 3)
        return prompt, e.layer_calls

    few, many = layer_calls(4), layer_calls(16)
    assert few == many, (few, many)
    assert len(few[1]) == 9 and all(c > 0 for c in few[1])


def test_batched_requests_a_cached_history_and_prompt_logprobs_match_transformers(arch_run):
    """The runtime is the model's, whatever its layers: staggered greedy requests batched together (a
    prompt read in chunks beside decode steps), a second turn that resumes from the first one's cache (its
    sliding rings and a snapshot), and prompt log-probabilities, each against Transformers alone; a seeded
    sampled request among them against itself alone."""
    from tests.engine.test_batching import PROMPTS, Script
    from tests.engine.test_prompt_logprobs import TOLERANCE, Recorder

    model_dir, (hf_tokens, _) = arch_run
    reference = load_hf_reference(model_dir)
    first = PARITY_PROMPT + hf_tokens[:8]  # the parity prompt and the start of its own reply
    second = first + PROMPTS["short"][1:]
    sampled = gemma_engine.SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    requests = {0: [gemma_engine.Request(0, first, 12)],
                2: [gemma_engine.Request(1, PROMPTS["other"], 12, prompt_logprobs=0),
                    gemma_engine.Request(3, PROMPTS["short"], 12, sampling=sampled)],
                40: [gemma_engine.Request(2, second, 12)]}
    e = gemma_engine.Engine(str(model_dir), like=torch.zeros(1), context=128, dtype="float32", max_batch=4,
                            prefill_chunk=5)
    script = Recorder(requests)
    outcomes = script.run(e, read_every=3)
    for rid, prompt in ((0, first), (1, PROMPTS["other"]), (2, second)):
        want, _ = greedy_reference(reference, prompt, 12)  # ends with the eos id when it says one
        finish = "stop" if want[-1] in reference.config.eos_token_id else "length"
        assert (outcomes[rid].tokens, outcomes[rid].finish) == (want[:-1] if finish == "stop" else want, finish), rid
    assert max(Script.batch_sizes(script)) >= 2
    # A seeded sampled request draws in the batch what it draws alone.
    alone = gemma_engine.Engine(str(model_dir), like=torch.zeros(1), context=128, dtype="float32")
    assert outcomes[3].tokens == alone.decode(PROMPTS["short"], 12, sampling=sampled)[0]
    assert sum(s["cache_hits"] for s in script.stats) >= len(first) - 1  # the second turn resumed
    with torch.no_grad():
        lp = reference(torch.tensor([PROMPTS["other"]])).logits[0, :-1].float().log_softmax(-1)
    want = lp.gather(1, torch.tensor(PROMPTS["other"][1:]).unsqueeze(1))[:, 0]
    got = torch.tensor([chosen for chosen, _ in script.prompt_lp[1]])
    # Relative as well as test_prompt_logprobs.py's absolute bound: without per-layer inputs these models'
    # logprobs reach -25 and float32 rounding moves them further (Transformers' one forward against the
    # engine's chunks of 5, measured: up to 6.5e-3 absolute, 3.8e-4 relative, on the 31B shapes).
    assert torch.allclose(got, want, rtol=1e-3, atol=TOLERANCE), (got - want).abs().max()
