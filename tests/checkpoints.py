"""Deterministic tiny Gemma 4 checkpoints for tests and the demo, built with Transformers.

What this file is
-----------------
Builders and pytest fixtures for the small random Gemma 4 text checkpoints that the engine's parity
tests and the server demo run on. Everything is derived from a
fixed seed, so two builds write the same bytes. The architecture follows
``transformers/models/gemma4/{configuration,modeling}_gemma4.py`` (Transformers 5.18); the tiny config switches on every feature E2B uses.

Builders (plain functions) and fixtures (session scope, registered through
``pytest_plugins = ("tests.checkpoints",)``):

* ``tiny_text_config(**overrides)``: the small :class:`Gemma4TextConfig` (vocab 512, H=128, P=32,
  9 layers S S F S F | S F S F with the last 4 KV-shared, head_dim 32 / global_head_dim 64, window 12,
  softcap 30, tied embeddings, eos ids [1, 106, 50]).
* ``random_model(config=None, seed=SEED)``: a float32 ``Gemma4ForCausalLM`` whose every parameter and
  ``layer_scalar`` is drawn from ``seed`` and rounded to bfloat16, so the dense bf16 file holds the
  exact values.
* ``save_dense(dir)`` -> fixture ``dense_checkpoint`` (a Path).
* ``save_w4a16(dir, group_size=32)`` -> fixture ``w4a16_checkpoint`` (a Path).
* ``save_w4a16_emb4(model_dir, emb_dir, group_size=32)`` -> fixture ``emb4_checkpoint``
  (``(model_dir, emb_dir)``).
* ``save_chat(dir)`` -> fixture ``chat_checkpoint`` (a Path); also ``python -m tests.checkpoints
  --kind chat --out DIR`` (kinds: dense, w4a16, emb4 with ``--emb-out``, chat, agent).
* ``save_agent_chat(dir)`` -> fixture ``agent_checkpoint`` (a Path); also ``--kind agent``.
* ``PARITY_PROMPT`` -> fixture ``parity_prompt`` (28 ids, bos first, eos id 106 inside; longer than
  the window).
* ``load_hf_reference(model_dir, emb_dir=None, dtype=torch.float32)``: the Transformers model whose
  weights are exactly what the engine should compute with (the plain ``from_pretrained(model_dir,
  dtype=dtype)``, with the int4 tables of ``emb_dir`` put in); ``greedy_reference(model, prompt)`` runs
  it greedily for 64 tokens and returns the tokens and each step's logits.

All three parity checkpoints come from the same random model (``SEED``). Greedy float32 runs of
their references on ``PARITY_PROMPT`` each give 64 tokens with no eos, at least
``MIN_DISTINCT_TOKENS`` distinct tokens, and a top-1/top-2 logit gap above ``MIN_MARGIN`` at every
step (asserted in tests/test_checkpoints.py).

Dense checkpoint (``save_dense``)
---------------------------------
``Gemma4ForCausalLM.save_pretrained`` output: ``config.json`` (``model_type: gemma4_text``,
``dtype: bfloat16``, the full-layer head dim in ``per_layer_config: {"2": {"head_dim": 64}, ...}``),
``generation_config.json`` and ``model.safetensors`` with bf16 tensors named ``model.*``
(``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``,
``model.layers.{i}.layer_scalar`` [1], ...). No ``lm_head`` tensor: it is tied to
``model.embed_tokens.weight``. KV-shared layers (``i >= L - num_kv_shared_layers``) have no
``k_proj``/``v_proj``/``k_norm`` tensors. Reference: the same tensors in float32.

W4A16 checkpoint (``save_w4a16``)
---------------------------------
The same files, written by compressed-tensors 0.20.1 (``apply_quantization_config`` + min/max group
scales from its ``calculate_qparams`` + ``ModelCompressor.compress_model`` + ``update_config``). Every
``nn.Linear`` but ``lm_head`` is quantized: ``q/k/v/o_proj``, ``gate/up/down_proj``,
``per_layer_input_gate``, ``per_layer_projection`` and ``model.per_layer_model_projection``. For each,
``X.weight`` is replaced by

* ``X.weight_packed``: int32 ``[out, in/8]``;
* ``X.weight_scale``: bfloat16 ``[out, in/G]``;
* ``X.weight_shape``: int64 ``[2]`` = ``[out, in]``.

Embeddings, norms and ``layer_scalar`` stay dense bf16. ``config.json`` gains, exactly as
compressed-tensors writes it::

    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "quantization_status": "compressed", "ignore": ["lm_head"], "version": "0.20.1",
      "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
        "weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group",
                    "group_size": 32, "dynamic": false, ...}, "input_activations": null, ...}}, ...}

Unpacking (4 bits, compressed_tensors/compressors/pack_quantized/helpers.py): column ``c`` of row
``r`` lives in word ``weight_packed[r, c // 8]``, bits ``4*(c % 8)`` to ``4*(c % 8) + 3`` (column
``8k`` in the least significant nibble), as the unsigned nibble ``u``; the int4 value is
``q = u - 8`` in ``[-8, 7]``. Symmetric, so there is no zero point. The weight, computed in the
compute dtype ``D``, is::

    w[r, c] = q[r, c] * D(weight_scale[r, c // G])     # G = group_size = 32, product in D

which is what the plain ``Gemma4ForCausalLM.from_pretrained(dir, dtype=D)`` computes: Transformers
loads the bf16 scales cast to ``D`` and compressed-tensors' decompression (``forward_helpers._dequantize``)
multiplies in the scale's dtype. In float32 the product of a 4-bit integer and a bf16 scale is exact;
in bfloat16 it is rounded once. Reference: ``load_hf_reference``, that plain call.

Int4 vocabulary tables (``save_w4a16_emb4``), after the seed's "-emb4" twin
----------------------------------------------------------------------------
``model_dir`` is exactly ``save_w4a16``'s output (its dense bf16 ``model.embed_tokens.weight`` and
``model.embed_tokens_per_layer.weight`` included). ``emb_dir`` is a second directory with two files:

* ``model.safetensors``, exactly six tensors, with the ``model.language_model.`` prefix (the
  ``Gemma4ForConditionalGeneration`` naming of the hub files, while ``model_dir`` uses ``model.``)::

      model.language_model.embed_tokens.weight_packed            int32 [V, H/8]     = [512, 16]
      model.language_model.embed_tokens.weight_scale             bf16  [V, H/G]     = [512, 4]
      model.language_model.embed_tokens.weight_shape             int64 [2]          = [512, 128]
      model.language_model.embed_tokens_per_layer.weight_packed  int32 [V, L*P/8]   = [512, 36]
      model.language_model.embed_tokens_per_layer.weight_scale   bf16  [V, L*P/G]   = [512, 9]
      model.language_model.embed_tokens_per_layer.weight_shape   int64 [2]          = [512, 288]

  packed exactly like the linears (``out`` = vocabulary row, ``in`` = embedding column, groups of
  G consecutive columns along each row), by compressed-tensors' pack-quantized compressor applied to
  the ``nn.Embedding`` modules.
* ``config.json``: ``model_type``, ``vocab_size``, ``vocab_size_per_layer_input``, ``hidden_size``,
  ``hidden_size_per_layer_input``, ``num_hidden_layers`` (for shape checks) and a
  ``quantization_config`` of the same form as above with ``"targets": ["Embedding"]`` and
  ``"ignore": []``; the group size is ``quantization_config.config_groups.group_0.weights.group_size``.

When an ``emb_dir`` is given, its tables replace ``model_dir``'s dense ones: the engine looks rows up
in ``q * scale`` computed in the compute dtype, like the linears (then scales by sqrt(H) and sqrt(P)
as usual), and the tied ``lm_head`` uses the same dequantized int4 ``embed_tokens`` table, not
``model_dir``'s dense one: Transformers ties ``lm_head.weight`` to whatever ``embed_tokens.weight``
holds. ``dequantize_emb4_tables(emb_dir, dtype)`` returns the two tables; ``load_hf_reference(model_dir,
emb_dir)`` is the W4A16 reference with them.

Chat checkpoint (``save_chat``)
-------------------------------
The dense layout with ``vocab_size = 512`` matching a byte-level BPE tokenizer trained in-process
(``tokenizer.json``, ``tokenizer_config.json`` with a Gemma chat_template, class
PreTrainedTokenizerFast). Ids: ``<pad>``=0, ``<eos>``=1, ``<bos>``=2, ``<start_of_turn>``=3,
``<end_of_turn>``=4; config ``eos_token_id`` = [1, 4]. Encoding plain text prepends ``<bos>``. The
template renders ``<bos><start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n``.

Agent checkpoint (``save_agent_chat``)
--------------------------------------
The chat checkpoint's layout with Gemma 4's markers (Transformers 5.18 ``transformers/cli/serving/utils.py``,
the "gemma4" response template) as special tokens, ids 0-13: ``<pad> <eos> <bos> <|turn> <turn|> <|tool>
<tool|> <|tool_call> <tool_call|> <|tool_response> <tool_response|> <|"|> <|channel> <channel|>``
(``AGENT_SPECIAL_TOKENS``); config ``eos_token_id`` = [1, 4, 9] (<eos>, <turn|>, <|tool_response>). The
byte-level BPE tokenizer is trained on chat text and the pieces of Gemma's call syntax, without a
pre-tokenizer split, so tokens span keys, colons and braces. ``AGENT_CHAT_TEMPLATE`` (after vLLM's
``examples/tool_chat_template_gemma4.jinja``) renders, for ``tools`` and a user message::

    <bos><|turn>system\n<|tool>declaration:get_weather{description:<|"|>...<|"|>,parameters:{...}}<tool|><turn|>\n
    <|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n

an assistant message with ``tool_calls`` (arguments as dicts) as
``<|turn>model\n<|tool_call>call:get_weather{location:<|"|>Paris<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>``
(keys sorted, strings between ``<|"|>``, numbers, booleans and null bare) and each tool message after it as
``<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>``, in the same model turn.
``enable_thinking`` is one of its variables: true adds a line to the system turn and lets the model open
``<|channel>thought\n...<channel|>`` itself; nothing is pre-filled either way.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedConfig
from transformers.utils import logging as transformers_logging
from transformers.models.gemma4 import Gemma4ForCausalLM, Gemma4TextConfig

# Chosen by `search_seed(0, 200)`, which returned 170: the first seed from 0 upward whose layer
# scalars are all distinct and whose greedy 64-token float32 run on PARITY_PROMPT under
# Transformers, for the dense, W4A16 and W4A16+emb4 references alike (`load_hf_reference`: the
# plain float32 load, int4 weights dequantized in float32), never hits eos, uses at least
# MIN_DISTINCT_TOKENS distinct tokens and keeps every step's top-1/top-2 logit gap above
# SEARCH_MARGIN. Minimum gaps it gave (Transformers 5.18, torch 2.14.1, CPU): dense 0.0339, W4A16
# 0.0681, emb4 0.0768 (median gaps 0.76-1.3; 51-55 distinct tokens).
SEED = 170

# Greedy length of the parity run; long enough to run far past the sliding window.
GENERATE_TOKENS = 64
# Lower bound asserted in tests/test_checkpoints.py for every step of every reference run. Float32
# reordering noise in the logits is ~1e-5, so a gap this size cannot flip a greedy choice.
MIN_MARGIN = 1e-2
MIN_DISTINCT_TOKENS = 16
# What `search_seed` demanded of the chosen seed: twice the asserted bound, for headroom.
SEARCH_MARGIN = 2e-2

# Columns per int4 scale group (W4A16 linears and emb4 tables). Divides every input width of the
# tiny config (32 = P, 128 = H, 256/512 = MLP widths), and matches the q4_0 block size.
GROUP_SIZE = 32
PACK_FORMAT = "pack-quantized"
EMB_TABLES = ("embed_tokens", "embed_tokens_per_layer")
# Tensor-name prefix of the emb4 tables: the Gemma4ForConditionalGeneration one, as in the hub files.
EMB_PREFIX = "model.language_model."

SLIDING = "sliding_attention"
FULL = "full_attention"

# Fixed parity prompt: bos, then 27 ids (28 > sliding_window=12). It happens to hold eos id 106 at
# index 17; kept on purpose: eos ids stop only generated tokens, never the prompt read.
PARITY_PROMPT: list[int] = [2] + [(37 * i + 11) % 500 + 3 for i in range(27)]

# How much further from Transformers' float32 logits (KL) the engine's bfloat16 run, the prompt read a token
# at a time, may drift than Transformers' own bfloat16 run: on these tiny random models one prompt's KL is a
# noisy measure (the ratio swings with the matmul kernel, one bfloat16 rounding tipping another), so the bound
# is a margin over what both kernels gave, not a ratio of 1. Measured, engine / Transformers: with oneDNN's
# bfloat16 linears (an Intel Xeon with AMX) at most 2; on a CPU without them (an AMD EPYC with AVX2 only,
# where both multiply with ATen's bfloat16 matmul) 0.18 (emb4), 1.47 (dense), 2.00 (W4A16), 2.35 (26B-A4B
# shape, W4A16), 2.13 (31B shape, W4A16). A wrong rounding point or dtype shows as orders of magnitude.
BF16_DRIFT_FACTOR = 3


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one intra-op thread, then restore the previous count.

    The tiny model gains nothing from more, and on a loaded machine (CI, parallel jobs) OpenMP
    barriers between descheduled threads made a 1 s greedy run take 60 s. Results do not depend on
    it: the builders' ops are elementwise or seeded, and the margins dwarf reduction-order noise.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def tiny_text_config(**overrides) -> Gemma4TextConfig:
    """The small Gemma 4 text config that exercises every feature of the E2B forward pass.

    Layers 0-4 own their K/V (types S S F S F); layers 5-8 are KV-shared (S F S F), so the shared tail
    has both types: sliding ones read layer 3, full ones read layer 4. Full layers use
    ``global_head_dim`` (64) and proportional RoPE (4 of 32 frequency pairs rotate), sliding layers
    ``head_dim`` (32) and default RoPE, with a 12-token window.

    Args:
        **overrides: Gemma4TextConfig keyword arguments replacing the defaults below.

    Returns:
        A Gemma4TextConfig.
    """
    kwargs = dict(
        vocab_size=512,
        vocab_size_per_layer_input=512,
        hidden_size=128,
        hidden_size_per_layer_input=32,
        intermediate_size=256,
        use_double_wide_mlp=True,
        num_hidden_layers=9,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        attention_k_eq_v=False,
        num_kv_shared_layers=4,
        sliding_window=12,
        layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL, SLIDING, FULL, SLIDING, FULL],
        rope_parameters={
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        },
        final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        enable_moe_block=False,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=[1, 106, 50],
    )
    kwargs.update(overrides)
    return Gemma4TextConfig(**kwargs)


def tiny_unified_text_config(**overrides) -> PreTrainedConfig:
    """A small text config of the 12B "unified" Gemma 4 (``Gemma4UnifiedTextConfig``, Transformers 5.18
    ``models/gemma4_unified``): Gemma 4's decoder without per-layer inputs, experts or KV sharing, its own
    model type; sizes as ``tiny_text_config`` (8 layers S S S S S F S F, head_dim 32 / global_head_dim 64,
    window 12, softcap 30, tied embeddings, eos ids [1, 106, 50]).
    """
    from transformers.models.gemma4_unified import Gemma4UnifiedTextConfig

    kwargs = dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, global_head_dim=64, sliding_window=12,
        layer_types=[SLIDING] * 5 + [FULL, SLIDING, FULL], final_logit_softcapping=30.0,
        max_position_embeddings=1024, tie_word_embeddings=True, pad_token_id=0, bos_token_id=2,
        eos_token_id=[1, 106, 50],
    )
    kwargs.update(overrides)
    return Gemma4UnifiedTextConfig(**kwargs)


def _is_norm(name: str) -> bool:
    # MoE layers number their extra norms: post_feedforward_layernorm_1, _2, pre_feedforward_layernorm_2.
    return name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight"))


def _init_tensor(name: str, shape: torch.Size, config: Gemma4TextConfig, gen: torch.Generator) -> torch.Tensor:
    """Draw one tensor. Scales keep activations O(1) and the logits spread a few units apart."""
    if name.endswith("layer_scalar"):
        # Multiplies the whole residual stream; a value far from 1 exposes a missing or misplaced scalar.
        return torch.empty(shape).uniform_(0.4, 1.0, generator=gen)
    if _is_norm(name):
        # Around 1 with a wide spread: `w` and `1 + w` give clearly different outputs.
        return torch.empty(shape).uniform_(0.5, 1.5, generator=gen)
    if name.endswith("embed_tokens.weight"):
        # Scaled by sqrt(H) on the way in; tied lm_head: logit std ~ 0.5 * sqrt(H) ~ 5.7, which spreads
        # the top of the distribution (the top-1/top-2 gaps) without saturating the 30.0 softcap.
        return torch.randn(shape, generator=gen) * 0.5
    if name.endswith(("router.scale", "router.per_expert_scale")):
        # Multipliers around 1 (the router's input scale and each expert's output weight), wide enough
        # that a missing one changes which experts win and what they weigh.
        return torch.empty(shape).uniform_(0.5, 1.5, generator=gen)
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        # [E, out, in]: each expert a unit-variance linear, like the 2D rule below.
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    if name.endswith("embed_tokens_per_layer.weight"):
        # Scaled by sqrt(P) on the way in, so each PLE entry is O(1).
        return torch.randn(shape, generator=gen) / math.sqrt(config.hidden_size_per_layer_input)
    if len(shape) == 2:
        # Linear [out, in]: unit-variance outputs for unit-variance inputs.
        return torch.randn(shape, generator=gen) / math.sqrt(shape[1])
    raise ValueError(f"no init rule for tensor {name} of shape {tuple(shape)}")


def random_model(config: Gemma4TextConfig | None = None, seed: int = SEED) -> Gemma4ForCausalLM:
    """A deterministic random Gemma4ForCausalLM in float32 with bf16-representable weights.

    Every persistent tensor (parameters and the ``layer_scalar`` buffers) is drawn in sorted-name
    order from one generator seeded with ``seed``, then rounded to bfloat16, so saving in bf16 is
    lossless and the float32 model is the exact reference for the dense checkpoint.

    Args:
        config: the text config; ``tiny_text_config()`` when None.
        seed: generator seed.

    Returns:
        The model in eval mode, float32, on CPU.
    """
    config = config or tiny_text_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the constructor's default init; overwritten below anyway
        model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    persistent = {n for n, _ in model.named_parameters()} | {
        n for n, _ in model.named_buffers() if n.endswith("layer_scalar")
    }
    with torch.no_grad():
        for name in sorted(persistent):
            t = state[name]
            t.copy_(_init_tensor(name, t.shape, config, gen).to(torch.bfloat16).to(t.dtype))
    model.eval()
    return model


def greedy_reference(model: Gemma4ForCausalLM, prompt: list[int], max_new: int = GENERATE_TOKENS):
    """Greedy generation under Transformers with each step's logits.

    Args:
        model: the reference model.
        prompt: prompt token ids.
        max_new: tokens to generate; stops early at the config's eos ids.

    Returns:
        (tokens, logits): the generated ids and a float32 tensor [len(tokens), vocab] of the logits
        each token was chosen from (after the final softcap).
    """
    ids = torch.tensor([prompt])
    with one_thread():
        out = _generate(model, ids, max_new)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.cat([step.float() for step in out.logits], dim=0)
    return tokens, logits


def _generate(model: Gemma4ForCausalLM, ids: torch.Tensor, max_new: int):
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=model.config.eos_token_id,
            pad_token_id=model.config.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )


def top2_margins(logits: torch.Tensor) -> torch.Tensor:
    """Per-step gap between the largest and second-largest logit."""
    top = logits.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def save_dense(out_dir: str | Path, seed: int = SEED, config: Gemma4TextConfig | None = None) -> Path:
    """Write the dense bf16 checkpoint (config.json, generation_config.json, model.safetensors).

    Args:
        out_dir: target directory (created).
        seed: weight seed.
        config: text config; ``tiny_text_config()`` when None.

    Returns:
        The directory.
    """
    out_dir = Path(out_dir)
    with one_thread():
        model = random_model(config, seed).to(torch.bfloat16)
        model.save_pretrained(out_dir)
    return out_dir


def save_two_token(source: str | Path, out_dir: str | Path) -> Path:
    """A copy of the checkpoint `source` whose final norm's weight is zero but for feature 0: its logits are that
    feature times one column of the tied embeddings, so it writes runs of that column's two extreme tokens,
    switching with the context (a target whose own output prompt-lookup drafts often match, for the speculative
    decoding tests and bench/speculative.py)."""
    out_dir = Path(out_dir)
    shutil.copytree(source, out_dir)
    (path, tensors, name), = [(f, t, k) for f in out_dir.glob("*.safetensors") for t in [load_file(f)] for k in t
                              if k in ("model.norm.weight", "model.language_model.norm.weight")]
    weight = torch.zeros_like(tensors[name])
    weight[0] = 1.0
    tensors[name] = weight
    save_file(tensors, path, metadata={"format": "pt"})
    return out_dir


def load_hf_reference(
    model_dir: str | Path, emb_dir: str | Path | None = None, dtype: torch.dtype = torch.float32
) -> Gemma4ForCausalLM:
    """The Transformers model holding exactly the weights the engine should compute with.

    Args:
        model_dir: a checkpoint written by one of the savers here.
        emb_dir: the int4 embedding-table directory of ``save_w4a16_emb4``, or None.
        dtype: compute dtype of the returned model.

    It is ``AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)``, the plain call a user makes
    (``Gemma4ForCausalLM`` for ``gemma4_text``, ``Gemma4UnifiedForCausalLM`` for the 12B's text model).
    For a W4A16 checkpoint that call (Transformers 5.18 with compressed-tensors installed) loads the
    packed int4 weights with their scales cast to ``dtype``, and compressed-tensors decompresses them
    to ``q * scale`` in ``dtype`` on the first forward pass (``ModelCompressor.add_decompress_hook``).
    Here that decompression runs at once, through the same ``decompress_model`` the hook calls, so
    the returned model holds dense weights. With ``emb_dir`` the two vocabulary tables are replaced
    by ``dequantize_emb4_tables(emb_dir, dtype)``.

    Returns:
        Gemma4ForCausalLM in eval mode.
    """
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.compressor.decompress_model(model)
    if emb_dir is not None:
        _replace_tables(model, dequantize_emb4_tables(emb_dir, dtype), emb_dir)
    model.eval()
    return model


def round_up_to_bits(scale: torch.Tensor, bits: int) -> torch.Tensor:
    """`scale` rounded up to `bits` significant bits (in its own dtype).

    With 5 bits, every ``q * scale`` of an int4 ``q`` (|q| <= 8, 4 bits) has at most 8 significant
    bits, so it is exact in bfloat16: the dequantized weight is the same number whoever computes it.
    """
    mantissa, exponent = torch.frexp(scale.float())  # mantissa in [0.5, 1)
    rounded = torch.ldexp(torch.ceil(mantissa * 2**bits) / 2**bits, exponent.float())
    return rounded.to(scale.dtype)


def _quantize_in_place(
    model: torch.nn.Module, qconfig: QuantizationConfig, scale_bits: int | None = None
) -> ModelCompressor:
    """Quantize and pack the modules `qconfig` targets, the way llm-compressor's flow does it.

    compressed-tensors attaches the scheme and empty qparams; the group scales come from each
    group's min/max through compressed-tensors' own `calculate_qparams` (what llm-compressor's
    default min-max observer feeds it), rounded up to `scale_bits` significant bits when given
    (`round_up_to_bits`); `compress_model` then quantizes and packs.
    """
    apply_quantization_config(model, qconfig, show_progress=False)
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        args = scheme.weights
        weight = module.weight.data
        groups = weight.unflatten(-1, (weight.shape[-1] // args.group_size, args.group_size))
        scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        module.weight_scale.data.copy_(scale if scale_bits is None else round_up_to_bits(scale, scale_bits))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=PACK_FORMAT)
    compressor.compress_model(model)
    return compressor


def _w4a16_args(group_size: int) -> QuantizationArgs:
    return QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size, dynamic=False
    )


def w4a16_config(group_size: int = GROUP_SIZE, targets: tuple[str, ...] = ("Linear",)) -> QuantizationConfig:
    """The compressed-tensors W4A16 config: int4 symmetric group weights, 16-bit activations.

    Args:
        group_size: columns per scale group.
        targets: compressed-tensors targets (module class names or "re:" patterns).

    Returns:
        A QuantizationConfig in the pack-quantized format; lm_head is ignored (it is tied).
    """
    scheme = QuantizationScheme(targets=list(targets), weights=_w4a16_args(group_size))
    return QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format=PACK_FORMAT)


def save_w4a16(
    out_dir: str | Path,
    group_size: int = GROUP_SIZE,
    seed: int = SEED,
    config: Gemma4TextConfig | None = None,
    scale_bits: int | None = None,
) -> Path:
    """Write the W4A16 checkpoint: the dense model with every Linear int4 pack-quantized.

    Quantized (the compressed-tensors target "Linear", lm_head ignored): q/k/v/o_proj, gate/up/down_proj,
    per_layer_input_gate, per_layer_projection and per_layer_model_projection. Embeddings, norms and
    layer_scalar stay dense bf16. config.json carries the quantization_config that compressed-tensors'
    `ModelCompressor.update_config` writes.

    Args:
        out_dir: target directory (created).
        group_size: columns per scale group; must divide every Linear's input width.
        seed: weight seed (the same random model as ``save_dense``).
        config: text config; ``tiny_text_config()`` when None.
        scale_bits: round every scale up to this many significant bits (``round_up_to_bits``).

    Returns:
        The directory.
    """
    out_dir = Path(out_dir)
    with one_thread():
        model = random_model(config, seed).to(torch.bfloat16)
        compressor = _quantize_in_place(model, w4a16_config(group_size), scale_bits)
        model.save_pretrained(out_dir)
    compressor.update_config(str(out_dir))
    return out_dir


def dense_table_and_norm_bytes(model_dir: str | Path, dtype: torch.dtype) -> int:
    """Bytes in `dtype` of a checkpoint's tensors that are not quantized linears (embedding tables,
    norms, layer scalars): what an engine holds dense whatever it does with the int4 weights."""
    from safetensors import safe_open

    quantized = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                if not name.endswith(quantized):
                    total += math.prod(f.get_slice(name).get_shape())
    return total * torch.finfo(dtype).bits // 8


def save_w4a16_emb4(
    model_dir: str | Path,
    emb_dir: str | Path,
    group_size: int = GROUP_SIZE,
    seed: int = SEED,
    config: Gemma4TextConfig | None = None,
    scale_bits: int | None = None,
) -> tuple[Path, Path]:
    """Write the W4A16 checkpoint and, beside it, the int4 vocabulary tables (layout in the module docstring).

    Args:
        model_dir: target of the W4A16 checkpoint (exactly ``save_w4a16``'s output).
        emb_dir: target of the int4 tables.
        group_size: columns per scale group, for the linears and the tables alike.
        seed: weight seed (the same random model as ``save_dense``).
        config: text config; ``tiny_text_config()`` when None.
        scale_bits: round every scale up to this many significant bits (``round_up_to_bits``).

    Returns:
        (model_dir, emb_dir).
    """
    model_dir = save_w4a16(model_dir, group_size, seed, config, scale_bits)
    emb_dir = Path(emb_dir)
    emb_dir.mkdir(parents=True, exist_ok=True)
    with one_thread():
        model = random_model(config, seed).to(torch.bfloat16)
        model.lm_head = torch.nn.Linear(1, 1, bias=False)  # untie: only the two tables are quantized here
        qconfig = w4a16_config(group_size, targets=("Embedding",))
        compressor = _quantize_in_place(model, qconfig, scale_bits)
    tensors = {}
    for table in EMB_TABLES:
        module = getattr(model.model, table)
        for suffix in ("weight_packed", "weight_scale", "weight_shape"):
            tensors[f"{EMB_PREFIX}{table}.{suffix}"] = getattr(module, suffix).data.contiguous()
    save_file(tensors, emb_dir / "model.safetensors", metadata={"format": "pt"})
    emb_config = {
        "model_type": model.config.model_type,
        "vocab_size": model.config.vocab_size,
        "vocab_size_per_layer_input": model.config.vocab_size_per_layer_input,
        "hidden_size": model.config.hidden_size,
        "hidden_size_per_layer_input": model.config.hidden_size_per_layer_input,
        "num_hidden_layers": model.config.num_hidden_layers,
    }
    (emb_dir / "config.json").write_text(json.dumps(emb_config, indent=2, sort_keys=True) + "\n")
    compressor.update_config(str(emb_dir))  # adds quantization_config exactly as for the linears
    return model_dir, emb_dir


def dequantize_emb4_tables(emb_dir: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The int4 vocabulary tables of ``emb_dir``, dequantized by compressed-tensors in ``dtype``.

    The scales are cast to ``dtype`` first, as ``from_pretrained(dtype=dtype)`` casts a quantized
    module's scales, so compressed-tensors' decompression multiplies in ``dtype``.

    Args:
        emb_dir: a directory written by ``save_w4a16_emb4``.
        dtype: the dtype of the product.

    Returns:
        {"embed_tokens": [V, H], "embed_tokens_per_layer": [V, L*P]} in ``dtype``, each value
        ``q * dtype(scale)``.

    Raises:
        ValueError: when a tensor is missing or the group size does not match.
    """
    emb_dir = Path(emb_dir)
    qconfig = QuantizationConfig.model_validate(
        json.loads((emb_dir / "config.json").read_text())["quantization_config"]
    )
    scheme = qconfig.config_groups["group_0"]
    tensors = load_file(emb_dir / "model.safetensors")
    tables = {}
    for table in EMB_TABLES:
        names = {s: f"{EMB_PREFIX}{table}.{s}" for s in ("weight_packed", "weight_scale", "weight_shape")}
        missing = [n for n in names.values() if n not in tensors]
        if missing:
            raise ValueError(f"{emb_dir}: missing tensors {missing}")
        state = {s: tensors[n] for s, n in names.items()}
        state["weight_scale"] = state["weight_scale"].to(dtype)
        tables[table] = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    return tables


def _replace_tables(model: Gemma4ForCausalLM, tables: dict[str, torch.Tensor], emb_dir) -> None:
    with torch.no_grad():
        for table, values in tables.items():
            weight = getattr(model.model, table).weight
            if weight.shape != values.shape:
                raise ValueError(f"{emb_dir}: {table} is {tuple(values.shape)}, model wants {tuple(weight.shape)}")
            # In place, so the tied lm_head follows the int4 table as Transformers ties it.
            weight.copy_(values)


def reference_runs(seed: int = SEED, prompt: list[int] = PARITY_PROMPT, group_size: int = GROUP_SIZE) -> dict:
    """Greedy float32 runs of the three references (dense, w4a16, emb4) built from ``seed``.

    Args:
        seed: weight seed.
        prompt: prompt ids.
        group_size: W4A16 group size.

    Returns:
        {kind: (tokens, logits)} for kind in ("dense", "w4a16", "emb4").
    """
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        save_dense(tmp / "dense", seed)
        save_w4a16_emb4(tmp / "w4a16", tmp / "emb4", group_size, seed)
        return {
            "dense": greedy_reference(load_hf_reference(tmp / "dense"), prompt),
            "w4a16": greedy_reference(load_hf_reference(tmp / "w4a16"), prompt),
            "emb4": greedy_reference(load_hf_reference(tmp / "w4a16", tmp / "emb4"), prompt),
        }


def run_ok(tokens: list[int], logits: torch.Tensor, min_margin: float = MIN_MARGIN) -> bool:
    """Whether a greedy run is a good parity target: full length, varied, clear top-1 every step."""
    return (
        len(tokens) == GENERATE_TOKENS
        and len(set(tokens)) >= MIN_DISTINCT_TOKENS
        and float(top2_margins(logits).min()) > min_margin
    )


def layer_scalars_distinct(model: Gemma4ForCausalLM) -> bool:
    """Whether no two layers share a ``layer_scalar`` value (after the bf16 rounding), so a scalar
    applied to the wrong layer changes the output."""
    scalars = [layer.layer_scalar.item() for layer in model.model.layers]
    return len(set(scalars)) == len(scalars)


def search_seed(start: int = 0, stop: int = 200, min_margin: float = SEARCH_MARGIN) -> int:
    """The first seed in [start, stop) whose layer scalars are distinct and whose three reference
    runs all pass ``run_ok``.

    The dense run is checked first, since it is the cheapest to build.

    Raises:
        RuntimeError: when no seed in the range qualifies.
    """
    for seed in range(start, stop):
        model = random_model(seed=seed)
        if not layer_scalars_distinct(model):
            continue
        tokens, logits = greedy_reference(model, PARITY_PROMPT)
        if not run_ok(tokens, logits, min_margin):
            continue
        if all(run_ok(t, lg, min_margin) for t, lg in reference_runs(seed).values()):
            return seed
    raise RuntimeError(f"no seed in [{start}, {stop}) gives clear greedy margins")


# ---------------------------------------------------------------- chat checkpoint (demo, server tests)

# Special tokens and their ids: Gemma's <pad>/<eos>/<bos> ids, then the turn markers (ids 3 and 4
# here, 105 and 106 in Gemma's own vocabulary).
CHAT_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")
CHAT_VOCAB_SIZE = 512
# Chosen by `search_chat_seed()`, which returned 0: the first seed from 0 upward whose greedy reply
# to CHAT_PROMPT runs at least CHAT_MIN_REPLY tokens before an eos id, so the demo has something to
# stream. With it the reply is 49 tokens, then <end_of_turn> (finish "stop").
CHAT_SEED = 0
CHAT_MIN_REPLY = 24
CHAT_PROMPT = [{"role": "user", "content": "Write a short paragraph about the ocean."}]

# Gemma's chat format: a system message is folded into the first user turn, "assistant" is called
# "model", each turn is <start_of_turn>role\n...<end_of_turn>\n. Content may be a string or a list of
# OpenAI-style parts ({"type": "text", "text": ...}).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set first_user_prefix = (messages[0]['content'] | map(attribute='text') | join('')) + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

# Training text for the demo tokenizer, written for this file. Any text still encodes (byte-level).
_CHAT_CORPUS = """\
The ocean covers most of the surface of the earth. Its water moves in long currents that carry heat from
the warm seas near the equator toward the cold seas near the poles. Waves rise when the wind blows across
the water, and tides follow the pull of the moon. Fish, whales, turtles and tiny plankton live in the
ocean, and the light of the sun reaches only its upper layers.
A model server answers questions over HTTP. The user sends a message, the model reads the prompt, and
then it writes a reply one token at a time. Each token is a small piece of text: a word, part of a word,
a space or a mark of punctuation. The server streams the tokens back so the reply appears as it is made.
What is a TPU? A TPU is a chip built to multiply large matrices quickly. Who are you? I am a small test
model. Hello! How are you today? Thank you, I am well. Please write a short story about a cat, a boat and
the sea. Once upon a time a cat sailed a small boat across the quiet sea, looking for an island of fish.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Code: def main(): print("hello, world") return 0.
"""


def _byte_level_bpe(special: tuple[str, ...], vocab_size: int, corpus: str, use_regex: bool = True) -> Tokenizer:
    """A byte-level BPE tokenizer of `vocab_size` tokens trained on `corpus`'s lines: ids 0.. are `special`
    (as special tokens), the 256 byte tokens follow, encoding prepends <bos> (id 2). `use_regex` False
    drops ByteLevel's pre-split, so merges may cross words and punctuation.

    Raises:
        RuntimeError: a special token did not get its index as id.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.splitlines(), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)]
    )
    for i, token in enumerate(special):
        if tokenizer.token_to_id(token) != i:
            raise RuntimeError(f"special token {token} got id {tokenizer.token_to_id(token)}, expected {i}")
    return tokenizer


def build_chat_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer of CHAT_VOCAB_SIZE tokens trained on `_CHAT_CORPUS`.

    Ids 0-4 are CHAT_SPECIAL_TOKENS; the 256 byte tokens follow, so any text encodes. Encoding
    prepends <bos> (as Gemma's tokenizer does); decoding drops special tokens on request.

    Returns:
        A `tokenizers.Tokenizer`.
    """
    return _byte_level_bpe(CHAT_SPECIAL_TOKENS, CHAT_VOCAB_SIZE, _CHAT_CORPUS)


def chat_text_config(**overrides) -> Gemma4TextConfig:
    """The tiny config with the chat tokenizer's vocabulary and eos ids (<eos>, <end_of_turn>)."""
    kwargs = dict(
        vocab_size=CHAT_VOCAB_SIZE,
        vocab_size_per_layer_input=CHAT_VOCAB_SIZE,
        pad_token_id=0,
        eos_token_id=[1, 4],
        bos_token_id=2,
    )
    kwargs.update(overrides)
    return tiny_text_config(**kwargs)


def save_chat(out_dir: str | Path, seed: int = CHAT_SEED) -> Path:
    """Write the demo chat checkpoint: dense bf16 model, tokenizer.json, tokenizer_config.json.

    Loadable with ``AutoTokenizer.from_pretrained(out_dir)`` (its chat_template is Gemma's format)
    and served like any dense checkpoint. The replies are gibberish: the weights are random.

    Args:
        out_dir: target directory (created).
        seed: weight seed.

    Returns:
        The directory.
    """
    out_dir = save_dense(out_dir, seed, chat_text_config())
    return _save_tokenizer(out_dir, build_chat_tokenizer(), CHAT_VOCAB_SIZE, "<end_of_turn>",
                           ["<start_of_turn>", "<eos>"], CHAT_TEMPLATE)


def _save_tokenizer(out_dir: Path, tokenizer: Tokenizer, vocab_size: int, eos: str, extra: list[str],
                    template: str) -> Path:
    """Write `tokenizer` as tokenizer.json and a tokenizer_config.json (<bos>, <pad>, `eos`, the `extra`
    special tokens, the chat `template`) into `out_dir`, so ``AutoTokenizer.from_pretrained`` loads it.

    Raises:
        RuntimeError: the tokenizer does not have `vocab_size` tokens.
    """
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, expected {vocab_size}")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": eos,
        "pad_token": "<pad>",
        "additional_special_tokens": extra,
        "model_max_length": 1024,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    return out_dir


def chat_reply(model_dir: str | Path, messages=CHAT_PROMPT, max_new: int = GENERATE_TOKENS) -> list[int]:
    """The greedy reply of the chat checkpoint under Transformers (float32), eos excluded."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    model = load_hf_reference(model_dir)
    tokens, _ = greedy_reference(model, list(ids), max_new)
    eos = set(model.config.eos_token_id)
    return [t for t in tokens if t not in eos]


def search_chat_seed(start: int = 0, stop: int = 200) -> int:
    """The first seed in [start, stop) whose greedy chat reply has at least CHAT_MIN_REPLY tokens.

    Raises:
        RuntimeError: when no seed in the range qualifies.
    """
    for seed in range(start, stop):
        with tempfile.TemporaryDirectory() as tmp:
            if len(chat_reply(save_chat(tmp, seed))) >= CHAT_MIN_REPLY:
                return seed
    raise RuntimeError(f"no chat seed in [{start}, {stop}) replies with {CHAT_MIN_REPLY}+ tokens")


# ---------------------------------------------------------------- agent checkpoint (tools, thinking)

# Gemma 4's markers (Transformers 5.18 transformers/cli/serving/utils.py, the "gemma4" response template;
# vLLM examples/tool_chat_template_gemma4.jinja), ids 0-13 in this order. Gemma's own vocabulary has them
# at other ids: code looks them up by text, never by number.
AGENT_SPECIAL_TOKENS = (
    "<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
    "<|tool_response>", "<tool_response|>", '<|"|>', "<|channel>", "<channel|>",
)
AGENT_VOCAB_SIZE = 512
# <eos>, <turn|>, <|tool_response>: a reply ends at the end of the turn, or after its tool calls, where
# the model waits for the results.
AGENT_EOS_IDS = [1, 4, 9]
# Any seed gives a usable checkpoint (the tests of tool calls drive the parser and the grammars with
# rendered text, not with the random model's replies); 0 is the first.
AGENT_SEED = 0

# A value in Gemma 4's call syntax: keys bare and sorted (dictsort, case-insensitive as Jinja's is),
# strings between <|"|> tokens, numbers as Jinja prints them, booleans and null bare. The same macro
# renders the tools' parameter schemas in the declarations.
_AGENT_VALUE_MACRO = (
    "{%- macro gemma_value(v) -%}"
    "{%- if v is string -%}{{ '<|\"|>' + v + '<|\"|>' }}"
    "{%- elif v is boolean -%}{{ 'true' if v else 'false' }}"
    "{%- elif v is none -%}{{ 'null' }}"
    "{%- elif v is mapping -%}{{ '{' }}"
    "{%- for key, item in v | dictsort -%}{{ key + ':' }}{{ gemma_value(item) }}{{ ',' if not loop.last }}{%- endfor -%}"
    "{{ '}' }}"
    "{%- elif v is iterable -%}{{ '[' }}"
    "{%- for item in v -%}{{ gemma_value(item) }}{{ ',' if not loop.last }}{%- endfor -%}"
    "{{ ']' }}"
    "{%- else -%}{{ v }}"
    "{%- endif -%}"
    "{%- endmacro -%}"
)

# Gemma 4's chat format, written for the tests after vLLM's examples/tool_chat_template_gemma4.jinja:
# - a system turn when there is a system message, tools or enable_thinking: the system text, then one
#   <|tool>declaration:NAME{description:<|"|>...<|"|>,parameters:{...}}<tool|> per tool; with
#   enable_thinking it opens with a line asking for thought first (Gemma's own template puts its
#   <|think|> token there; this vocabulary has none). Nothing is pre-filled in the model turn either way:
#   with thinking on the model may open <|channel>thought\n itself.
# - user turns <|turn>user\n...<turn|>\n; assistant turns <|turn>model\n, the content, then each tool call
#   <|tool_call>call:NAME{key:value,...}<tool_call|> (arguments a dict, rendered natively; a string is
#   copied as it is, as Gemma's template does);
# - each tool message right after the calls, in the same model turn:
#   <|tool_response>response:NAME{value:<|"|>...<|"|>}<tool_response|> (NAME: the message's name, or the
#   name of the call its tool_call_id answers); an assistant message after tool messages continues that
#   turn, and a turn with tool calls ends at the next user message;
# - the generation prompt is <|turn>model\n, or nothing when a model turn is still open (after tool
#   results the model goes on in the same turn).
AGENT_CHAT_TEMPLATE = _AGENT_VALUE_MACRO + (
    "{%- macro text_of(content) -%}"
    "{%- if content is string -%}{{ content | trim }}"
    "{%- elif content -%}{%- for part in content -%}{%- if part['type'] == 'text' -%}{{ part['text'] | trim }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{{ bos_token }}"
    "{%- set loop_messages = messages -%}"
    "{%- set has_system = messages and messages[0]['role'] in ['system', 'developer'] -%}"
    "{%- if has_system or tools or enable_thinking -%}"
    "{{ '<|turn>system\n' }}"
    "{%- if enable_thinking -%}{{ 'Think step by step before you answer.\n' }}{%- endif -%}"
    "{%- if has_system -%}{{ text_of(messages[0]['content']) }}{%- set loop_messages = messages[1:] -%}{%- endif -%}"
    "{%- for tool in tools or [] -%}"
    "{%- set function = tool['function'] if 'function' in tool else tool -%}"
    "{{ '<|tool>declaration:' + function['name'] + '{description:<|\"|>' + (function['description'] or '') + '<|\"|>' }}"
    "{%- if function['parameters'] -%}{{ ',parameters:' }}{{ gemma_value(function['parameters']) }}{%- endif -%}"
    "{{ '}<tool|>' }}"
    "{%- endfor -%}"
    "{{ '<turn|>\n' }}"
    "{%- endif -%}"
    "{%- set ns = namespace(open=false, calls=[]) -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- if not ns.open -%}{{ raise_exception('A tool message must follow an assistant message with tool_calls.') }}{%- endif -%}"
    "{%- set found = namespace(name=message.get('name')) -%}"
    "{%- for call in ns.calls -%}{%- if not found.name and call.get('id') == message.get('tool_call_id') -%}"
    "{%- set found.name = call['function']['name'] -%}{%- endif -%}{%- endfor -%}"
    "{{ '<|tool_response>response:' + (found.name or 'unknown') + '{value:<|\"|>' + text_of(message['content']) + '<|\"|>}<tool_response|>' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- if not ns.open -%}{{ '<|turn>model\n' }}{%- set ns.open = true -%}{%- endif -%}"
    "{{ text_of(message['content']) }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{ '<|tool_call>call:' + call['function']['name'] }}"
    "{%- if call['function']['arguments'] is mapping -%}{{ gemma_value(call['function']['arguments']) }}"
    "{%- else -%}{{ call['function']['arguments'] }}{%- endif -%}"
    "{{ '<tool_call|>' }}"
    "{%- endfor -%}"
    "{%- if message.get('tool_calls') -%}{%- set ns.calls = message['tool_calls'] -%}"
    "{%- else -%}{{ '<turn|>\n' }}{%- set ns.open = false -%}{%- endif -%}"
    "{%- else -%}"
    "{%- if ns.open -%}{{ '<turn|>\n' }}{%- set ns.open = false -%}{%- endif -%}"
    "{{ '<|turn>' + message['role'] + '\n' + text_of(message['content']) + '<turn|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt and not ns.open -%}{{ '<|turn>model\n' }}{%- endif -%}"
)

# Training text for the agent tokenizer, written for this file: chat, and the pieces of Gemma 4's call
# syntax (without the special tokens, which are never trained), so `call:`, `{`, `location:`, `},` and
# the like get tokens of their own, some spanning a key and its colon or a value and a comma.
_AGENT_CORPUS = _CHAT_CORPUS + """\
call:get_weather{location:Paris,unit:celsius}
call:get_weather{location:London,unit:fahrenheit}
call:get_time{city:Tokyo,timezone:Asia/Tokyo}
call:search{query:weather in Paris,limit:10,safe:true}
call:add{a:1,b:2}call:add{a:-3.5,b:1e3}
call:book{when:{day:monday,hour:9},guests:[anna,bob],vip:false,note:null}
response:get_weather{value:sunny, 21 degrees}
response:search{value:[1,2,3]}
declaration:get_weather{description:Get the weather in a city,parameters:{properties:{location:{type:string},
unit:{enum:[celsius,fahrenheit],type:string}},required:[location],type:object}}
The weather in Paris is sunny. Let me call a tool to find out. thought
I should check the weather first, then answer the user.
"""


def build_agent_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer of AGENT_VOCAB_SIZE tokens with Gemma 4's markers as special tokens.

    Ids 0-13 are AGENT_SPECIAL_TOKENS; the 256 byte tokens follow, so any text encodes. There is no
    pre-tokenizer split (ByteLevel without its regex), so merges span punctuation and words alike:
    tokens such as ``location:`` or ``},`` cross the structure of a call, as a real vocabulary's do.
    Encoding prepends <bos>.

    Returns:
        A `tokenizers.Tokenizer`.
    """
    return _byte_level_bpe(AGENT_SPECIAL_TOKENS, AGENT_VOCAB_SIZE, _AGENT_CORPUS, use_regex=False)


def agent_text_config(**overrides) -> Gemma4TextConfig:
    """The tiny config with the agent tokenizer's vocabulary and eos ids (<eos>, <turn|>, <|tool_response>)."""
    kwargs = dict(
        vocab_size=AGENT_VOCAB_SIZE,
        vocab_size_per_layer_input=AGENT_VOCAB_SIZE,
        pad_token_id=0,
        eos_token_id=list(AGENT_EOS_IDS),
        bos_token_id=2,
    )
    kwargs.update(overrides)
    return tiny_text_config(**kwargs)


def save_agent_chat(out_dir: str | Path, seed: int = AGENT_SEED) -> Path:
    """Write the agent checkpoint: dense bf16 model, tokenizer.json, tokenizer_config.json.

    Like ``save_chat``, with Gemma 4's markers and ``AGENT_CHAT_TEMPLATE`` (tools, tool calls, tool
    results, enable_thinking). The replies are gibberish: the weights are random.

    Args:
        out_dir: target directory (created).
        seed: weight seed.

    Returns:
        The directory.
    """
    return _save_agent_weights(out_dir, seed, AGENT_SPECIAL_TOKENS, build_agent_tokenizer(), AGENT_CHAT_TEMPLATE)


def _save_agent_weights(out_dir: str | Path, seed: int, markers: tuple[str, ...], tokenizer: Tokenizer,
                        template: str) -> Path:
    """The agent weights (`agent_text_config`) with `tokenizer`, its `markers` as special tokens and
    `template` as the chat template; eos <turn|>."""
    out_dir = save_dense(out_dir, seed, agent_text_config())
    extra = [t for t in markers if t not in ("<pad>", "<bos>", "<turn|>")]
    return _save_tokenizer(out_dir, tokenizer, AGENT_VOCAB_SIZE, "<turn|>", extra, template)


# ---------------------------------------------------------------- Gemma 4's own chat template

# Gemma 4's markers that its published template writes besides the agent ones: <|think|> opens a system turn
# that asks for thought; <|image|>, <|audio|> and <|video|> stand for media. Ids 14-17, after the agent's.
GEMMA4_SPECIAL_TOKENS = AGENT_SPECIAL_TOKENS + ("<|think|>", "<|image|>", "<|audio|>", "<|video|>")


def build_gemma4_tokenizer() -> Tokenizer:
    """The agent tokenizer's recipe with every marker Google's Gemma 4 template writes as a special token
    (GEMMA4_SPECIAL_TOKENS); AGENT_VOCAB_SIZE tokens, so the agent weights fit it."""
    return _byte_level_bpe(GEMMA4_SPECIAL_TOKENS, AGENT_VOCAB_SIZE, _AGENT_CORPUS, use_regex=False)


def save_gemma4_chat(out_dir: str | Path, template: str, seed: int = AGENT_SEED) -> Path:
    """Write a checkpoint that renders through Google's own Gemma 4 chat template: the agent checkpoint's
    weights and eos ids, GEMMA4_SPECIAL_TOKENS, and `template` (tests/fetch_chat_templates.py fetches
    Google's templates).

    Args:
        out_dir: target directory (created).
        template: the chat template's text.
        seed: weight seed.
    Returns:
        The directory.
    """
    return _save_agent_weights(out_dir, seed, GEMMA4_SPECIAL_TOKENS, build_gemma4_tokenizer(), template)


# ---------------------------------------------------------------- multimodal (image and audio)

# Gemma 4's media markers besides GEMMA4_SPECIAL_TOKENS' placeholders: begin and end of an image (<|image>,
# <image|>) and of an audio clip (<|audio>, <audio|>), as Google's tokenizer names them. Ids 18-21.
MULTIMODAL_SPECIAL_TOKENS = GEMMA4_SPECIAL_TOKENS + ("<|image>", "<image|>", "<|audio>", "<audio|>")
MULTIMODAL_SEED = 0
# The image processor's smallest budget (Gemma4ImageProcessor's _SUPPORTED_SOFT_TOKENS): at most 70 soft tokens.
MULTIMODAL_MAX_SOFT_TOKENS = 70


def build_multimodal_tokenizer() -> Tokenizer:
    """The agent tokenizer's recipe with MULTIMODAL_SPECIAL_TOKENS; AGENT_VOCAB_SIZE tokens."""
    return _byte_level_bpe(MULTIMODAL_SPECIAL_TOKENS, AGENT_VOCAB_SIZE, _AGENT_CORPUS, use_regex=False)


def tiny_multimodal_config(bidirectional: bool = False) -> PreTrainedConfig:
    """A small ``Gemma4Config`` with both towers (Transformers 5.18 ``configuration_gemma4.py``).

    Text: ``agent_text_config`` (E-series features, no bidirectional attention, as E2B/E4B; with
    `bidirectional`, ``use_bidirectional_attention="vision"`` as the larger Gemma 4 models set it: sliding
    layers read an image's soft tokens both ways). Vision: 2 layers,
    hidden 64, 2 heads of 32, 4-pixel patches pooled 2x2, a 64-entry position table, clipped linears and
    standardisation on. Audio: 2 conformer layers, hidden 64, 2 heads, subsampling channels (128, 8) over the
    feature extractor's 128 mel bins, chunks of 12 with 12 frames of left context, output 96. Media ids are
    the tokenizer's (``build_multimodal_tokenizer``).
    """
    from transformers import Gemma4Config

    tok = build_multimodal_tokenizer()
    ids = {t: tok.token_to_id(t) for t in MULTIMODAL_SPECIAL_TOKENS}
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=32, patch_size=4, pooling_kernel_size=2, position_embedding_size=64,
                  use_clipped_linears=True, standardize=True, rope_parameters={"rope_type": "axial", "rope_theta": 100.0})
    audio = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[128, 8],
                 conv_kernel_size=5, attention_chunk_size=12, attention_context_left=13, attention_context_right=0,
                 output_proj_dims=96, use_clipped_linears=True)
    text = agent_text_config(use_bidirectional_attention="vision" if bidirectional else None)
    return Gemma4Config(
        text_config=text.to_dict(), vision_config=vision, audio_config=audio,
        image_token_id=ids["<|image|>"], audio_token_id=ids["<|audio|>"], video_token_id=ids["<|video|>"],
        boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"], boa_token_id=ids["<|audio>"],
        eoa_token_index=ids["<audio|>"],
    )


def _init_media_tensor(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """One tower tensor: norms and scales around 1, tables and linears unit-variance, clip bounds that bite."""
    if name.endswith(("input_min", "output_min")):
        return -torch.empty(shape).uniform_(1.5, 3.0, generator=gen)
    if name.endswith(("input_max", "output_max")):
        return torch.empty(shape).uniform_(1.5, 3.0, generator=gen)
    if name.endswith(("norm.weight", "norm_out.weight", "norm_pre_attn.weight", "norm_post_attn.weight", "std_scale")):
        return torch.empty(shape).uniform_(0.5, 1.5, generator=gen)
    if name.endswith(("std_bias", "per_dim_scale", "output_proj.bias")):
        return torch.randn(shape, generator=gen) * 0.5
    if name.endswith("position_embedding_table"):
        return torch.randn(shape, generator=gen) * 0.5
    if len(shape) >= 2:
        # Linear [out, in] and convolutions [out, in / groups, *kernel]: unit-variance outputs.
        return torch.randn(shape, generator=gen) / math.sqrt(shape[1:].numel())
    raise ValueError(f"no init rule for tensor {name} of shape {tuple(shape)}")


def random_multimodal_model(seed: int = MULTIMODAL_SEED, bidirectional: bool = False):
    """A deterministic random float32 ``Gemma4ForConditionalGeneration`` (``tiny_multimodal_config``) with
    bf16-representable weights: the text model's as ``random_model`` draws them, then the towers' parameters and
    their persistent buffers (clip bounds, standardisation) in sorted-name order from one generator."""
    from transformers import Gemma4ForConditionalGeneration

    config = tiny_multimodal_config(bidirectional)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma4ForConditionalGeneration(config)
    text = random_model(config.text_config, seed)
    state = model.state_dict()
    persistent = {n for n, _ in model.named_parameters()} | {
        n for n, b in model.named_buffers() if n.endswith(("_min", "_max", "std_bias", "std_scale", "layer_scalar"))
    }
    gen = torch.Generator().manual_seed(seed)
    text_state = text.state_dict()
    with torch.no_grad():
        for name in sorted(persistent):
            t = state[name]
            if name.startswith("model.language_model."):
                value = text_state["model." + name.removeprefix("model.language_model.")]
            elif name == "lm_head.weight":
                continue
            else:
                value = _init_media_tensor(name, t.shape, gen)
            t.copy_(value.to(torch.bfloat16).to(t.dtype))
    model.eval()
    return model


def save_multimodal(out_dir: str | Path, template: str, seed: int = MULTIMODAL_SEED,
                    bidirectional: bool = False, w4a16_group: int | None = None) -> Path:
    """Write a checkpoint with both towers as the hub lays Gemma 4 out: ``Gemma4ForConditionalGeneration``
    weights in bf16 (``model.language_model.*``, ``model.vision_tower.*``, ``model.audio_tower.*``,
    ``model.embed_vision.*``, ``model.embed_audio.*``), the tokenizer with MULTIMODAL_SPECIAL_TOKENS (its
    ``extra_special_tokens`` name the media markers, as Gemma4Processor reads them), `template` as the chat
    template, and Transformers' own processor configuration (``Gemma4Processor`` with the Pillow image
    processor at 4-pixel patches, 2x2 pooling and at most MULTIMODAL_MAX_SOFT_TOKENS soft tokens, and the
    default ``Gemma4AudioFeatureExtractor``; the video processor the class requires, at the same patches), saved
    by ``save_pretrained``. `bidirectional`: see ``tiny_multimodal_config``. With `w4a16_group`, every
    ``Linear`` of the text model and both towers (their clippable linears' inner ``linear``, the embedders'
    projections, the audio tower's relative-position and output projections) is int4 pack-quantized with
    that group size, as ``save_w4a16`` quantizes the text model.
    """
    from transformers.models.gemma4 import Gemma4Processor
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor

    out_dir = Path(out_dir)
    with one_thread():
        model = random_multimodal_model(seed, bidirectional).to(torch.bfloat16)
        compressor = None if w4a16_group is None else _quantize_in_place(model, w4a16_config(w4a16_group))
        model.save_pretrained(out_dir)
    if compressor is not None:
        compressor.update_config(str(out_dir))
    extra = [t for t in MULTIMODAL_SPECIAL_TOKENS if t not in ("<pad>", "<bos>", "<turn|>")]
    _save_tokenizer(out_dir, build_multimodal_tokenizer(), AGENT_VOCAB_SIZE, "<turn|>", extra, template)
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["extra_special_tokens"] = {
        "image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
        "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>",
    }
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    image_processor = Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2,
                                              max_soft_tokens=MULTIMODAL_MAX_SOFT_TOKENS)
    processor = Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=image_processor,
                                tokenizer=tokenizer, chat_template=template,
                                video_processor=Gemma4VideoProcessor(patch_size=4, pooling_kernel_size=2,
                                                                     max_soft_tokens=MULTIMODAL_MAX_SOFT_TOKENS),
                                image_seq_length=MULTIMODAL_MAX_SOFT_TOKENS)
    processor.save_pretrained(out_dir)
    return out_dir


def load_multimodal_reference(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    """``Gemma4ForConditionalGeneration.from_pretrained(model_dir, dtype=dtype)`` in eval mode: the plain call
    (a W4A16 checkpoint decompressed at once, as ``load_hf_reference`` does)."""
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(model_dir, dtype=dtype)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.compressor.decompress_model(model)
    return model.eval()


def test_image(width: int, height: int, seed: int = 0):
    """A deterministic RGB ``PIL.Image`` of smooth colour gradients plus noise (``seed``)."""
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    base = torch.stack([x, y, (x + y) / 2], dim=-1)
    pixels = (base * 0.7 + torch.rand(height, width, 3, generator=gen) * 0.3).clamp(0, 1)
    return Image.fromarray((pixels * 255).round().to(torch.uint8).numpy(), mode="RGB")


def test_audio(seconds: float, seed: int = 0, rate: int = 16_000):
    """A deterministic mono float32 waveform (numpy) at `rate`: two chirps plus a little noise."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(int(seconds * rate), dtype=torch.float64) / rate
    wave = 0.4 * torch.sin(2 * math.pi * (220 + 400 * t) * t) + 0.2 * torch.sin(2 * math.pi * 1250 * t)
    wave = wave + 0.02 * torch.randn(wave.shape, generator=gen, dtype=torch.float64)
    return wave.to(torch.float32).numpy()


# ---------------------------------------------------------------- pytest fixtures


@pytest.fixture(scope="session")
def dense_checkpoint(tmp_path_factory) -> Path:
    """Directory of the dense bf16 tiny checkpoint (``save_dense``)."""
    return save_dense(tmp_path_factory.mktemp("dense"))


@pytest.fixture(scope="session")
def w4a16_checkpoint(tmp_path_factory) -> Path:
    """Directory of the W4A16 tiny checkpoint (``save_w4a16``), same random model as the dense one."""
    return save_w4a16(tmp_path_factory.mktemp("w4a16"))


@pytest.fixture(scope="session")
def emb4_checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    """(model_dir, emb_dir) of ``save_w4a16_emb4``: the W4A16 checkpoint and its int4 tables."""
    root = tmp_path_factory.mktemp("emb4")
    return save_w4a16_emb4(root / "model", root / "emb4")


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory) -> Path:
    """Directory of the chat checkpoint (``save_chat``): dense model plus tokenizer and chat template."""
    return save_chat(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="session")
def agent_checkpoint(tmp_path_factory) -> Path:
    """Directory of the agent checkpoint (``save_agent_chat``): Gemma 4's tool and thinking markers."""
    return save_agent_chat(tmp_path_factory.mktemp("agent"))


@pytest.fixture(scope="session")
def gemma4_checkpoint(tmp_path_factory) -> Path:
    """Directory of a checkpoint with Google's Gemma 4 template that reads tool results from the model turn
    (`tool_responses`) and has no `tool` role (``save_gemma4_chat``)."""
    from tests.fetch_chat_templates import INTERLEAVED, template_path

    return save_gemma4_chat(tmp_path_factory.mktemp("gemma4"), template_path(INTERLEAVED).read_text())


@pytest.fixture(scope="session")
def multimodal_checkpoint(tmp_path_factory) -> Path:
    """Directory of the tiny checkpoint with both towers, Google's Gemma 4 template and Transformers' processor
    configuration (``save_multimodal``)."""
    from tests.fetch_chat_templates import TOOL_ROLE, template_path

    return save_multimodal(tmp_path_factory.mktemp("multimodal"), template_path(TOOL_ROLE).read_text())


@pytest.fixture(scope="session")
def multimodal_w4a16_checkpoint(tmp_path_factory) -> Path:
    """``multimodal_checkpoint`` with every Linear, the towers' too, int4 pack-quantized in groups of 16."""
    from tests.fetch_chat_templates import TOOL_ROLE, template_path

    return save_multimodal(tmp_path_factory.mktemp("multimodal-w4a16"), template_path(TOOL_ROLE).read_text(),
                           w4a16_group=16)


@pytest.fixture(scope="session")
def multimodal_bidirectional_checkpoint(tmp_path_factory) -> Path:
    """``multimodal_checkpoint`` with ``use_bidirectional_attention="vision"``, as the 31B and 26B-A4B set it."""
    from tests.fetch_chat_templates import TOOL_ROLE, template_path

    return save_multimodal(tmp_path_factory.mktemp("multimodal-bidirectional"), template_path(TOOL_ROLE).read_text(),
                           bidirectional=True)


@pytest.fixture(scope="session")
def parity_prompt() -> list[int]:
    """The fixed parity prompt: bos plus 27 ids, longer than the 12-token sliding window."""
    return list(PARITY_PROMPT)


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.checkpoints --kind chat --out DIR``: write one checkpoint and print its path."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.checkpoints", description=main.__doc__)
    parser.add_argument("--kind", choices=("dense", "w4a16", "emb4", "chat", "agent", "gemma4"), required=True)
    parser.add_argument("--out", required=True, type=Path, help="checkpoint directory (created)")
    parser.add_argument("--emb-out", type=Path, help="int4 table directory, for --kind emb4")
    parser.add_argument("--group-size", type=int, default=GROUP_SIZE, help="int4 group size (w4a16, emb4)")
    args = parser.parse_args(argv)
    # Quiet the library progress bars (compressed-tensors' tqdm, Transformers' shard writer).
    os.environ.setdefault("TQDM_DISABLE", "1")
    transformers_logging.disable_progress_bar()
    if args.kind == "emb4" and args.emb_out is None:
        parser.error("--kind emb4 needs --emb-out DIR for the int4 tables")
    if args.kind == "dense":
        print(save_dense(args.out))
    elif args.kind == "w4a16":
        print(save_w4a16(args.out, args.group_size))
    elif args.kind == "emb4":
        print(*save_w4a16_emb4(args.out, args.emb_out, args.group_size))
    elif args.kind == "chat":
        print(save_chat(args.out))
    elif args.kind == "agent":
        print(save_agent_chat(args.out))
    else:
        from tests.fetch_chat_templates import INTERLEAVED, template_path

        print(save_gemma4_chat(args.out, template_path(INTERLEAVED).read_text()))


if __name__ == "__main__":
    main()
