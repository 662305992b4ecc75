"""Quantized checkpoints: compressed-tensors W4A16 linears and int4 vocabulary tables.

Both come from the dense checkpoint's random model (``text.random_model``, ``SEED``):
``save_w4a16(dir, group_size=32)`` -> fixture ``w4a16_checkpoint`` (a Path);
``save_w4a16_emb4(model_dir, emb_dir, group_size=32)`` -> fixture ``emb4_checkpoint`` (``(model_dir, emb_dir)``).

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
"""

from __future__ import annotations

import json
import math
from pathlib import Path

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
from transformers.models.gemma4 import Gemma4TextConfig

from tests.checkpoints.shared import one_thread
from tests.checkpoints.text import SEED, random_model

# Columns per int4 scale group (W4A16 linears and emb4 tables). Divides every input width of the
# tiny config (32 = P, 128 = H, 256/512 = MLP widths), and matches the q4_0 block size.
GROUP_SIZE = 32
PACK_FORMAT = "pack-quantized"
EMB_TABLES = ("embed_tokens", "embed_tokens_per_layer")
# Tensor-name prefix of the emb4 tables: the Gemma4ForConditionalGeneration one, as in the hub files.
EMB_PREFIX = "model.language_model."


def round_up_to_bits(scale: torch.Tensor, bits: int) -> torch.Tensor:
    """`scale` rounded up to `bits` significant bits (in its own dtype).

    With 5 bits, every ``q * scale`` of an int4 ``q`` (|q| <= 8, 4 bits) has at most 8 significant
    bits, so it is exact in bfloat16: the dequantized weight is the same number whoever computes it.
    """
    mantissa, exponent = torch.frexp(scale.float())  # mantissa in [0.5, 1)
    rounded = torch.ldexp(torch.ceil(mantissa * 2**bits) / 2**bits, exponent.float())
    return rounded.to(scale.dtype)


def quantize_in_place(
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
        compressor = quantize_in_place(model, w4a16_config(group_size), scale_bits)
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
        compressor = quantize_in_place(model, qconfig, scale_bits)
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


def decompressed(model):
    """`model` as Transformers loaded it, with a compressed-tensors checkpoint's linears decompressed to dense
    weights in place (the reference runs dense)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.compressor.decompress_model(model)
    return model


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
