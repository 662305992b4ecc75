"""The memory plan (operator/gemma_operator/memory.py): its arithmetic on hand-checked cases, the model a source
names, the tensor-parallel size a spec gets, the rule that it divides the slice's chips, and the README's table."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from gemma_operator import memory
from gemma_operator.spec import (MODEL_SIZES, TP_DIVIDES_MESSAGE, TP_ON_CPU_MESSAGE, TPU_TOPOLOGY_CHIPS, TPU_V5E,
                                 TPU_V6E, parse_spec)

README = Path(__file__).resolve().parents[2] / "README.md"
GIB = 2**30


def spec(source="hf://google/gemma-4-31B-it", accelerator=None, **engine):
    return parse_spec({"model": {"source": source}, "accelerator": accelerator or {}, "engine": engine})


# ---------------------------------------------------------------------------------------------------------
# Arithmetic


def test_e2b_kv_per_slot_is_the_engines_figure():
    # rust/README.md: Gemma 4 E2B in bfloat16 at context 8192 has 48.0 MiB of full rings and 6.0 MiB of sliding
    # rings per slot, and the snapshots add 12.0 MiB. By hand: the first 15 layers hold their own KV, 3 of them
    # full (2 * 1 head * 8193 * 512 * 2 bytes = 16,779,264 each) and 12 sliding (2 * 1 * 513 * 256 * 2 = 525,312
    # each, three times with the two snapshots).
    kv = memory.kv_bytes_per_slot(memory.ARCHITECTURES["e2b"], 2, 1, 8192)
    assert kv == 3 * 16_779_264 + 12 * 525_312 * 3 == 69_249_024


def test_31b_counts_googles_30_7_billion_parameters_and_26b_a4b_its_25_2():
    # By hand, 31B: 50 sliding layers of q, k, v, o (32, 16, 16, 32 heads of 256 over 5376) and an MLP of 3 x 5376 x
    # 21504 = 478,937,088 each; 10 full layers of q, k, o (32, 4, 32 heads of 512; K=V: no v_proj) and the MLP =
    # 533,987,328 each; the 262,144 x 5376 embedding, tied to lm_head.
    assert memory.parameters(memory.ARCHITECTURES["31b"]) == 50 * 478_937_088 + 10 * 533_987_328 + 262_144 * 5376
    assert round(memory.parameters(memory.ARCHITECTURES["31b"]) / 1e9, 1) == 30.7
    assert round(memory.parameters(memory.ARCHITECTURES["26b-a4b"]) / 1e9, 1) == 25.2


def test_31b_over_eight_v5e_chips_by_hand():
    # One shard of 8: 4 query heads; the sliding layers' 16 KV heads split to 2, the full layers' 4 (fewer than
    # the shards) leave each shard the one its queries read; an eighth of the MLP; the whole embedding.
    # Sliding layer: (4 + 2 + 2 + 4) heads x 256 x 5376 + 3 x 5376 x 2688 = 59,867,136 parameters.
    # Full layer: (4 + 1 + 4) heads x 512 x 5376 + 3 x 5376 x 2688 = 68,124,672.
    p = memory.plan("31b", "bf16", TPU_V5E, "2x4", 8192, 8, 8)
    assert p.weight_bytes == 2 * (50 * 59_867_136 + 10 * 68_124_672 + 262_144 * 5376) == 10_167_779_328
    # Per slot and shard: 50 sliding layers of 2 x 2 heads x 1025 x 256 x 2 bytes (and two snapshots of them),
    # 10 full layers of 2 x 1 head x 8193 x 512 x 2.
    assert p.kv_bytes_per_slot == 50 * 2_099_200 * 3 + 10 * 16_779_264 == 482_672_640
    assert p.total_bytes == p.weight_bytes + 8 * p.kv_bytes_per_slot
    assert (p.hbm_bytes, p.usable_bytes) == (16 * GIB, int(16 * GIB * 0.9))
    # (14.4 GiB usable - 9.5 GiB of weights) / 460 MiB a slot.
    assert (p.fits, p.slots, p.chips, p.accelerator) == (True, 10, 8, "v5e 2x4")
    assert p.chunk_row_bytes == 0


def test_a_compiling_engines_plan_counts_the_chunk_row_its_prompt_chunks_run_on():
    # spec.engine.compile on: one more row of rings, without the sliding rings' snapshots (rust/src/gemma4/cache.rs
    # `CacheSize::chunk_row_bytes`): 50 x 2,099,200 + 10 x 16,779,264 bytes on each shard of the 31B over 8.
    p = memory.plan("31b", "bf16", TPU_V5E, "2x4", 8192, 8, 8, compiled=True)
    assert p.chunk_row_bytes == 50 * 2_099_200 + 10 * 16_779_264 == 272_752_640
    assert p.total_bytes == p.weight_bytes + 8 * p.kv_bytes_per_slot + p.chunk_row_bytes
    assert "+ 260.1 MiB for compiled prompt chunks" in p.explanation
    assert p.slots == 10  # (14.4 GiB - 9.5 GiB - 260 MiB) / 460 MiB = 10.4
    on = memory.placement(spec(accelerator={"type": TPU_V5E, "topology": "2x4"}, compile="on", tensorParallelSize=8))
    off = memory.placement(spec(accelerator={"type": TPU_V5E, "topology": "2x4"}, tensorParallelSize=8))
    assert (on.plan.chunk_row_bytes, off.plan.chunk_row_bytes) == (272_752_640, 0)


def test_w4a16_weights_take_half_a_byte_and_a_scale_per_group_only_where_int4_stays_packed():
    a = memory.ARCHITECTURES["31b"]
    linear = memory.parameters(a) - 262_144 * 5376  # everything but the (16-bit) embedding is a Linear
    packed = memory.weight_bytes(a, "w4a16", 2, 1, int4_packed=True)
    assert packed == linear // 2 + linear // 128 * 2 + 2 * 262_144 * 5376 == 17_919_541_248
    # Dequantized at load (what the engine does on a TPU): as many bytes as bf16.
    assert memory.weight_bytes(a, "w4a16", 2, 1, int4_packed=False) == memory.weight_bytes(
        a, "bf16", 2, 1, int4_packed=False) == 2 * memory.parameters(a)


def test_a_tpu_plan_counts_w4a16_at_the_compute_dtype_and_says_why():
    bf16 = memory.plan("31b", "bf16", TPU_V5E, "2x4", 8192, 8, 8)
    w4a16 = memory.plan("31b", "w4a16", TPU_V5E, "2x4", 8192, 8, 8)
    assert w4a16.weight_bytes == bf16.weight_bytes
    assert "int4 dequantized to bfloat16 at load, as the engine does on a TPU" in w4a16.explanation


def test_float32_doubles_weights_and_cache():
    b16 = memory.plan("e2b", "bf16", TPU_V6E, "1x1", 4096, 4, 1)
    f32 = memory.plan("e2b", "bf16", TPU_V6E, "1x1", 4096, 4, 1, dtype="float32")
    assert (f32.weight_bytes, f32.kv_bytes_per_slot) == (2 * b16.weight_bytes, 2 * b16.kv_bytes_per_slot)


def test_31b_on_one_v5e_chip_does_not_fit_and_names_the_slices_that_hold_it():
    p = memory.plan("31b", "bf16", TPU_V5E, "1x1", 8192, 8, 1)
    assert not p.fits and p.slots == 0
    assert p.weight_bytes == 2 * memory.parameters(memory.ARCHITECTURES["31b"])
    assert p.explanation.startswith("Gemma 4 31B (bf16) does not fit v5e 1x1 with tensorParallelSize 1: a chip "
                                    "would hold 57.2 GiB of weights and 8 x 3.0 GiB of KV cache at context 8192")
    assert "over the 14.4 GiB usable of its 16 GiB HBM (10% kept for the runtime); the weights alone" in p.explanation
    assert p.explanation.endswith(
        "It fits with any one of: spec.accelerator.topology 2x4 (8 chips, tensorParallelSize 8); "
        "spec.accelerator.type tpu-v6e-slice with spec.accelerator.topology 2x2 (4 chips, tensorParallelSize 4)")


def test_a_plan_whose_weights_fit_suggests_a_shorter_context_or_fewer_slots():
    p = memory.plan("31b", "bf16", TPU_V6E, "2x4", 8192, 64, 8)
    assert not p.fits and p.slots == 43
    assert p.explanation.endswith("It fits with any one of: spec.engine.context 768 or less; "
                                  "spec.engine.maxNumSeqs 43 or less")
    for context, seqs in ((768, 64), (8192, 43)):
        assert memory.plan("31b", "bf16", TPU_V6E, "2x4", context, seqs, 8).fits
    assert not memory.plan("31b", "bf16", TPU_V6E, "2x4", 1024, 64, 8).fits


def test_an_explicit_size_too_small_hears_of_the_one_that_fits():
    p = memory.plan("12b", "bf16", TPU_V5E, "2x2", 8192, 8, 2)
    assert not p.fits and "It fits with any one of: spec.engine.tensorParallelSize 4; " in p.explanation


def test_w4a16_is_suggested_once_the_engine_keeps_int4_packed_on_a_tpu(monkeypatch):
    assert "W4A16" not in memory.plan("31b", "bf16", TPU_V5E, "2x2", 8192, 8, 4).explanation
    monkeypatch.setattr(memory, "INT4_PACKED_ON_TPU", True)
    assert memory.plan("31b", "w4a16", TPU_V5E, "2x2", 8192, 8, 4).fits
    assert memory.plan("31b", "bf16", TPU_V5E, "2x2", 8192, 8, 4).explanation.endswith("; a W4A16 checkpoint")


def test_a_size_that_does_not_divide_the_slice_is_no_plan():
    with pytest.raises(ValueError, match="3 does not divide the 4 chips"):
        memory.plan("e2b", "bf16", TPU_V5E, "2x2", 8192, 8, 3)


@pytest.mark.parametrize("size", MODEL_SIZES)
def test_every_size_splits_over_every_size_a_slice_allows(size):
    # The engine refuses a split its shapes do not take (rust/src/gemma4/parallel.rs check_divisible).
    chips = {c for topologies in TPU_TOPOLOGY_CHIPS.values() for c in topologies.values()}
    for n in {d for c in chips for d in memory.divisors(c)}:
        assert memory.splits(memory.ARCHITECTURES[size], n), n


def test_splits_refuses_kv_heads_neither_divided_nor_shared():
    a = memory.ARCHITECTURES["31b"]._replace(num_key_value_heads=12)
    assert memory.splits(a, 4) and not memory.splits(a, 8)  # 12 KV heads: 3 a shard of 4; 8 neither divide nor share
    assert not memory.splits(a._replace(num_attention_heads=36), 8)


# ---------------------------------------------------------------------------------------------------------
# The model a spec names


@pytest.mark.parametrize("source,model", [
    ("hf://google/gemma-4-31B-it", ("31b", "bf16")),
    ("hf://google/gemma-4-E2B-it@main", ("e2b", "bf16")),
    ("hf://RedHatAI/gemma-4-26B-A4B-it-quantized.w4a16", ("26b-a4b", "w4a16")),
    ("hf://xbill9/gemma-4-E2B-it-qat-q4_0-w4a16-ct-text", ("e2b", "w4a16")),
    ("gs://weights/models/gemma-4-12b-int4", ("12b", "w4a16")),
    ("pvc://models/gemma-4-e4b", ("e4b", "bf16")),
    ("hf://google/gemma-4-31B-it@e2b-fix", ("31b", "bf16")),  # a revision names no model
    ("hf://o/m", None),
    ("hf://org/gemma-4-e2b-vs-e4b", None),  # two sizes: which one is unknown
    ("hf://org/model-131b", None),  # 31b inside a longer number
    ("gs://e2b/model", None),  # a bucket's name is not the model's
])
def test_the_size_and_quantization_a_source_names(source, model):
    found = memory.model_of(spec(source).model)
    assert (tuple(found) if found else None) == model


def test_explicit_size_and_quantization_win_over_the_name():
    m = parse_spec({"model": {"source": "hf://o/gemma-4-e2b", "size": "31b", "quantization": "w4a16"}}).model
    assert memory.model_of(m) == ("31b", "w4a16")
    assert memory.model_of(parse_spec({"model": {"source": "pvc://weights/x", "size": "12b"}}).model) == ("12b", "bf16")


# ---------------------------------------------------------------------------------------------------------
# The tensor-parallel size a spec gets


@pytest.mark.parametrize("accelerator,n", [
    ({"topology": "2x4"}, 8),
    ({"type": "tpu-v6e-slice", "topology": "2x2"}, 4),
    ({"type": "tpu-v6e-slice", "topology": "2x4"}, 4),  # the smallest that fits, not all the chips
])
def test_the_smallest_size_that_fits_is_picked(accelerator, n):
    p = memory.placement(spec(accelerator=accelerator))
    assert (p.tensor_parallel_size, p.plan.tensor_parallel_size, p.plan.fits) == (n, n, True)
    assert not memory.plan("31b", "bf16", accelerator.get("type", TPU_V5E), accelerator["topology"], 8192, 8,
                           n // 2).fits


def test_a_small_model_keeps_one_engine_per_chip():
    p = memory.placement(spec("hf://google/gemma-4-e2b-it", {"topology": "2x4"}))
    assert p.tensor_parallel_size == 1 and p.plan.fits


MTP = {"method": "mtp", "numSpeculativeTokens": 2, "source": "hf://google/gemma-4-E2B-it-assistant"}


def test_an_mtp_drafter_is_counted_and_keeps_an_engine_on_one_chip():
    with_drafter = memory.placement(spec("hf://google/gemma-4-e2b-it", {"topology": "2x2"}, speculative=MTP))
    without = memory.placement(spec("hf://google/gemma-4-e2b-it", {"topology": "2x2"}))
    assert with_drafter.tensor_parallel_size == without.tensor_parallel_size == 1
    assert with_drafter.plan.weight_bytes - without.plan.weight_bytes == memory.DRAFTER_PARAMETERS * 2
    assert "an assistant drafter's included" in with_drafter.plan.explanation
    # The 31B needs more than one v5e chip: with a drafter it gets no tensor parallelism, and the plan says what
    # would hold it on one chip (a larger one), never a larger tensorParallelSize.
    big = memory.placement(spec(accelerator={"topology": "2x4"}, speculative=MTP))
    assert big.tensor_parallel_size == 1 and not big.plan.fits
    assert "spec.engine.tensorParallelSize" not in big.plan.explanation
    with pytest.raises(pydantic.ValidationError, match="runs its drafter without tensor parallelism"):
        spec(accelerator={"topology": "2x4"}, speculative=MTP, tensorParallelSize=2)


def test_the_slots_asked_for_move_the_size():
    assert memory.placement(spec("hf://google/gemma-4-12B-it", {"topology": "2x2"})).tensor_parallel_size == 4
    assert memory.placement(spec("hf://google/gemma-4-12B-it", {"topology": "2x2", "type": "tpu-v6e-slice"},
                                 maxNumSeqs=32)).tensor_parallel_size == 4
    assert memory.placement(spec("hf://google/gemma-4-12B-it", {"topology": "2x2", "type": "tpu-v6e-slice"},
                                 maxNumSeqs=8)).tensor_parallel_size == 2


def test_an_explicit_size_is_kept_and_planned():
    p = memory.placement(spec("hf://google/gemma-4-e2b-it", {"topology": "2x4"}, tensorParallelSize=2))
    assert (p.tensor_parallel_size, p.plan.tensor_parallel_size) == (2, 2)


def test_when_nothing_fits_the_plan_is_over_all_the_chips():
    p = memory.placement(spec(accelerator={"topology": "2x2"}))
    assert (p.tensor_parallel_size, p.plan.fits) == (4, False)
    assert "with tensorParallelSize 4:" in p.plan.explanation


@pytest.mark.parametrize("source,accelerator", [
    ("hf://o/m", {"topology": "2x4"}),
    ("pvc://weights/checkpoint", {"type": "tpu-v6e-slice"}),
    ("hf://google/gemma-4-31B-it", {"type": "cpu"}),
    ("hf://google/gemma-4-31B-it", {"type": "tpu-v9-slice"}),  # UnknownAccelerator's to report
])
def test_no_plan_for_an_unknown_size_or_off_tpu(source, accelerator):
    assert memory.placement(spec(source, accelerator)) == (1, None)


def test_an_unknown_size_keeps_an_explicit_tensor_parallel_size():
    assert memory.placement(spec("hf://o/m", {"topology": "2x4"}, tensorParallelSize=4)) == (4, None)


# ---------------------------------------------------------------------------------------------------------
# The rule: it divides the slice's chips


@pytest.mark.parametrize("accelerator,n", [({"topology": "2x2"}, 3), ({"topology": "2x2"}, 8), ({}, 2),
                                           ({"type": "tpu-v6e-slice", "topology": "2x4"}, 3)])
def test_a_tensor_parallel_size_that_does_not_divide_the_chips_is_refused(accelerator, n):
    with pytest.raises(pydantic.ValidationError, match=TP_DIVIDES_MESSAGE.replace("(", r"\(").replace(")", r"\)")):
        spec(accelerator=accelerator, tensorParallelSize=n)


@pytest.mark.parametrize("accelerator,n", [({"topology": "2x2"}, 2), ({"topology": "2x4"}, 8), ({}, 1)])
def test_a_divisor_of_the_chips_is_accepted(accelerator, n):
    assert spec(accelerator=accelerator, tensorParallelSize=n).engine.tensor_parallel_size == n


def test_a_tensor_parallel_size_on_cpu_is_refused():
    with pytest.raises(pydantic.ValidationError, match="applies to TPUs only"):
        spec(accelerator={"type": "cpu"}, tensorParallelSize=1)


def test_the_crd_carries_the_same_rules():
    from gemma_operator import crd

    rules = {r["message"]: r for r in crd.spec_schema()["x-kubernetes-validations"]}
    divides = rules[TP_DIVIDES_MESSAGE]
    assert divides["fieldPath"] == ".engine.tensorParallelSize"
    assert "{'1x1': 1, '2x2': 4, '2x4': 8}" in divides["rule"] and "% self.engine.tensorParallelSize == 0" in \
        divides["rule"]
    assert rules[TP_ON_CPU_MESSAGE]["rule"] == "!has(self.engine.tensorParallelSize) || self.accelerator.type != 'cpu'"


# ---------------------------------------------------------------------------------------------------------
# The README


def test_readme_table_is_what_the_plan_computes():
    table = memory.table()
    assert table in README.read_text(), f"README.md's table of sizes and slices is stale; it is now:\n{table}"


def test_the_table_reads_like_the_plans():
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in memory.table().splitlines()[2:]}
    assert rows["31B"][:3] == ["no", "no", "N=8, 10 slots"]
    assert rows["E2B"][0] == "N=1, 75 slots"
    assert rows["12B"][3] == "no (6 slots at N=1)"


def test_the_e_series_towers_are_transformers_default_towers_and_make_googles_totals():
    """The towers' counts are those of Transformers' Gemma4VisionModel and Gemma4AudioModel at their default configs
    (built on the meta device, nothing allocated), with the embedders' projections into each text width; with them
    the E-series make Google's totals (E2B 5.1 B, E4B 8 B)."""
    import torch
    from transformers import Gemma4AudioConfig, Gemma4VisionConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel, Gemma4VisionModel

    with torch.device("meta"):
        vision = sum(p.numel() for p in Gemma4VisionModel(Gemma4VisionConfig()).parameters())
        audio = sum(p.numel() for p in Gemma4AudioModel(Gemma4AudioConfig()).parameters())
    assert (vision, audio) == (memory.VISION_TOWER_PARAMETERS, memory.AUDIO_TOWER_PARAMETERS)
    assert (Gemma4VisionConfig().hidden_size, Gemma4AudioConfig().output_proj_dims) == (
        memory.VISION_WIDTH, memory.AUDIO_WIDTH)
    e2b, e4b = memory.ARCHITECTURES["e2b"], memory.ARCHITECTURES["e4b"]
    assert round((memory.parameters(e2b) + e2b.encoder_parameters) / 1e9, 1) == 5.1
    assert round((memory.parameters(e4b) + e4b.encoder_parameters) / 1e9) == 8
    # The plan puts them on the first chip in the compute dtype.
    with_towers = memory.plan("e2b", "bf16", TPU_V6E, "1x1", 4096, 4, 1).weight_bytes
    assert with_towers - memory.weight_bytes(e2b._replace(encoder_parameters=0), "bf16", 2, 1,
                                             int4_packed=False) == 2 * e2b.encoder_parameters
