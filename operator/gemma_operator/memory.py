"""Whether a Gemma 4 model fits a TPU slice, and over how many chips each engine spreads it: the memory plan
(pure).

A pod on a slice of C chips runs C / N engines, each over N chips (tensor parallelism: the server's
GEMMA_TENSOR_PARALLEL_SIZE). `plan` counts what one engine puts on its fullest chip for a size, a
quantization, a slice, a context, a number of slots and N, and says whether it fits; `placement` picks N for a
spec (spec.engine.tensorParallelSize, or else the smallest divisor of C that fits). A plan that does not fit
becomes the handlers' fatal ModelDoesNotFit problem, so no pod is started to fail at its weights stage.
`python -m gemma_operator.memory` prints the table of sizes and slices the README shows.

Where the numbers come from:
- Architectures (`ARCHITECTURES`): the text_config of each size's config.json on the Hugging Face Hub
  (google/gemma-4-E2B, -E4B, -12B, -26B-A4B, -31B), as ollama/ollama `x/models/gemma4/gemma4_test.go` (commit
  017eb8ae, TestParseTextConfigE2B, E4B, 12BUnified, 26B, 31B) copies them. Counted from them, the 31B has
  30.70 B parameters and the 26B-A4B 25.23 B, the totals of Google's Gemma 4 model card (30.7 B, 25.2 B); the
  E-series and 12B counts (4.63, 7.46, 11.91 B) are of the text model alone.
- Media towers (`Architecture.encoder_parameters`): the server loads a checkpoint's vision and audio towers
  (gemma_server/media.py) on the first engine's first chip, dense in the compute dtype. The E-series' are
  Transformers 5.18's Gemma4VisionConfig and Gemma4AudioConfig defaults (those of google/gemma-4-e2b-it; E4B's
  towers are the same, its embedders project to its wider hidden size): 167,364,608 + 304,824,608 parameters
  and the two embedders' projections, 0.48 B in all, which with the text model make Google's totals for E2B
  and E4B (5.1 B, 8 B). The larger sizes' vision towers are not counted (their configs are not in the sources
  above), so for them the runtime reserve has to hold the tower.
- Weights: every matrix the engine loads, in the compute dtype (spec.engine.dtype), to which the loader
  converts dense weights (rust/src/gemma4/weights.rs). Norms, per-layer scalars and the router's vectors are
  left out: under 0.01 % of any size.
- W4A16 (compressed-tensors pack-quantized int4): 0.5 byte a linear weight plus one scale in the compute dtype
  per group of W4A16_GROUP weights; the 26B-A4B's experts (3D parameters, not Linear modules), the router and
  the embeddings stay 16-bit. The engine keeps int4 weights packed only where ATen has int4 kernels (CPU and
  CUDA in bfloat16: `Kernels::int4_path` in rust/src/gemma4/weights.rs); on a TPU it dequantizes them at load,
  so there a W4A16 checkpoint takes as much HBM as a 16-bit one (INT4_PACKED_ON_TPU).
- KV cache: the engine's formula (rust/src/gemma4/cache.rs, `CacheSize`): per slot, for each layer that
  computes its own keys, 2 · kv_heads · (ring + 1) · head_dim · dtype bytes, the ring being the context on
  full-attention layers and min(sliding_window, context) on sliding ones; with prefix caching (the server's
  default, which the operator leaves on) each slot also keeps SNAPSHOTS copies of its sliding rings.
- Tensor parallelism, as rust/src/gemma4/parallel.rs splits the model: a shard holds heads / N query heads
  with their KV heads (kv_heads / N, or the one they share when there are fewer KV heads than shards) and
  their rings, 1 / N of every MLP's and expert's width and of lm_head's vocabulary; the embeddings, the
  per-layer-input tables and the router are whole on every rank, a process a chip. The plan counts one chip.
- HBM per chip: spec.TPU_HBM_GIB, of which RUNTIME_RESERVE is kept for what the plan does not count (the TPU
  runtime and compiled programs, activations, a prompt chunk's logits).
"""

from __future__ import annotations

import re
import sys
from typing import Iterator, NamedTuple

from .spec import (MAX_NUM_SEQS, MODEL_SIZES, TPU_HBM_GIB, TPU_NAMES, TPU_TOPOLOGY_CHIPS, GemmaRustServerSpec,
                   ModelSpec, chips, is_tpu)

GIB = 2**30
MIB = 2**20
RUNTIME_RESERVE = 0.10  # of each chip's HBM, for what the plan does not count (module docstring)
SNAPSHOTS = 2  # sliding-ring snapshots per slot with prefix caching (rust/src/gemma4/cache.rs `SNAPSHOTS`)
PREFIX_CACHING = True  # the server's default (gemma_server/config.py `enable_prefix_caching`); the pod keeps it
# Weights per int4 scale. Assumed, not read from a checkpoint: compressed-tensors' W4A16 preset scheme
# (quantization/quant_scheme.py, `W4A16`: group strategy, group_size 128).
W4A16_GROUP = 128
# Whether the engine keeps a W4A16 checkpoint's int4 linears packed on a TPU: not in this tree
# (rust/src/gemma4/weights.rs, `Kernels::int4_path`: packed on CPU and CUDA only, dequantized at load elsewhere).
INT4_PACKED_ON_TPU = False
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MIN_CONTEXT = 256  # spec.engine.context's lower bound, and the step the plan suggests contexts in
# An MTP assistant drafter (spec.engine.speculative.method mtp): E2B's, Google's smallest, is reported at 78 M
# parameters (its release, google/gemma-4-E2B-it-assistant; not read here). It holds no KV cache: every layer reads the target's keys
# (Transformers 5.18 models/gemma4_assistant/configuration_gemma4_assistant.py: num_kv_shared_layers =
# num_hidden_layers). The larger sizes' drafters are 4-layer models too whose widths are not in the sources above:
# the plan counts E2B's for every size, and the runtime reserve holds the difference. The engine runs a drafter
# only without tensor parallelism (rust/src/engine/drafter.rs), so such a plan has N = 1.
DRAFTER_PARAMETERS = 78_000_000


class Architecture(NamedTuple):
    """What a size's memory depends on, named as Transformers' Gemma4TextConfig names it."""

    hidden_size: int
    num_hidden_layers: int
    full_attention_every: int  # layer i is full attention when (i + 1) % this == 0 (the configs' layer_types)
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    sliding_window: int
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False  # KV-shared layers' MLP is twice as wide
    attention_k_eq_v: bool = False  # full layers: values are the keys' projection, num_global_key_value_heads
    num_global_key_value_heads: int | None = None
    hidden_size_per_layer_input: int = 0  # per-layer inputs (PLE), the E-series
    num_experts: int = 0
    moe_intermediate_size: int = 0
    head_dim: int = 256
    global_head_dim: int = 512
    vocab_size: int = 262144  # vocab_size, and vocab_size_per_layer_input where there are per-layer inputs
    encoder_parameters: int = 0  # the vision and audio towers with their embedders, whole on the first shard


# Transformers 5.18's default Gemma4VisionConfig and Gemma4AudioConfig (the E-series' towers; module docstring),
# and the widths their embedders project from.
VISION_TOWER_PARAMETERS = 167_364_608
AUDIO_TOWER_PARAMETERS = 304_824_608
VISION_WIDTH, AUDIO_WIDTH = 768, 1536


def e_series_encoder(hidden_size: int) -> int:
    """The E-series' towers and embedders (Gemma4MultimodalEmbedder: one projection each) for a text model of
    `hidden_size`."""
    return VISION_TOWER_PARAMETERS + AUDIO_TOWER_PARAMETERS + (VISION_WIDTH + AUDIO_WIDTH) * hidden_size


ARCHITECTURES: dict[str, Architecture] = {
    "e2b": Architecture(hidden_size=1536, num_hidden_layers=35, full_attention_every=5, intermediate_size=6144,
                        num_attention_heads=8, num_key_value_heads=1, sliding_window=512, num_kv_shared_layers=20,
                        use_double_wide_mlp=True, hidden_size_per_layer_input=256,
                        encoder_parameters=e_series_encoder(1536)),
    "e4b": Architecture(hidden_size=2560, num_hidden_layers=42, full_attention_every=6, intermediate_size=10240,
                        num_attention_heads=8, num_key_value_heads=2, sliding_window=512, num_kv_shared_layers=18,
                        hidden_size_per_layer_input=256, encoder_parameters=e_series_encoder(2560)),
    "12b": Architecture(hidden_size=3840, num_hidden_layers=48, full_attention_every=6, intermediate_size=15360,
                        num_attention_heads=16, num_key_value_heads=8, sliding_window=1024, attention_k_eq_v=True,
                        num_global_key_value_heads=1),
    "26b-a4b": Architecture(hidden_size=2816, num_hidden_layers=30, full_attention_every=6, intermediate_size=2112,
                            num_attention_heads=16, num_key_value_heads=8, sliding_window=1024,
                            attention_k_eq_v=True, num_global_key_value_heads=2, num_experts=128,
                            moe_intermediate_size=704),
    "31b": Architecture(hidden_size=5376, num_hidden_layers=60, full_attention_every=6, intermediate_size=21504,
                        num_attention_heads=32, num_key_value_heads=16, sliding_window=1024, attention_k_eq_v=True,
                        num_global_key_value_heads=4),
}


class _Layer(NamedTuple):
    full: bool
    own_kv: bool  # computes its own keys and values (not a KV-shared layer)
    head_dim: int
    kv_heads: int
    v_proj: bool  # False on K=V layers
    intermediate: int


def _layers(a: Architecture) -> Iterator[_Layer]:
    """Each decoder layer's geometry (Transformers 5.18 models/gemma4/modeling_gemma4.py, Gemma4TextAttention and
    Gemma4TextMLP): full layers take global_head_dim, and with attention_k_eq_v num_global_key_value_heads and no
    v_proj; the last num_kv_shared_layers layers read an earlier layer's keys, with use_double_wide_mlp a 2x MLP."""
    first_shared = a.num_hidden_layers - a.num_kv_shared_layers
    for i in range(a.num_hidden_layers):
        full = (i + 1) % a.full_attention_every == 0
        k_eq_v = full and a.attention_k_eq_v
        own = i < first_shared
        yield _Layer(full, own, a.global_head_dim if full else a.head_dim,
                     (a.num_global_key_value_heads or 0) if k_eq_v else a.num_key_value_heads, not k_eq_v,
                     a.intermediate_size * (2 if a.use_double_wide_mlp and not own else 1))


def shard_kv_heads(kv_heads: int, n: int) -> int:
    """KV heads one of n shards holds: its share, or the one its query heads read when there are fewer KV heads
    than shards (rust/src/gemma4/parallel.rs `Tp::kv_heads`)."""
    return kv_heads // n if kv_heads >= n else 1


def splits(a: Architecture, n: int) -> bool:
    """Whether the engine can split `a` over n shards (rust/src/gemma4/parallel.rs `check_divisible`)."""
    widths = [a.num_attention_heads, a.vocab_size, a.moe_intermediate_size]
    widths += [layer.intermediate for layer in _layers(a)]
    kv_ok = all(kv % n == 0 or (kv < n and n % kv == 0) for kv in {layer.kv_heads for layer in _layers(a)})
    return kv_ok and all(w % n == 0 for w in widths)


def parameters(a: Architecture) -> int:
    """The text model's parameters, norms and scalars aside (one shard of one: the whole model)."""
    return weight_bytes(a, "bf16", 1, 1, int4_packed=False) - a.encoder_parameters


def weight_bytes(a: Architecture, quantization: str, dtype_bytes: int, n: int, *, int4_packed: bool) -> int:
    """Bytes of weights on the first of n shards: its share of the split matrices and the whole embeddings,
    per-layer-input tables, router and media towers (module docstring).

    Args:
        a: the architecture.
        quantization: "bf16" or "w4a16", how the checkpoint stores its Linear layers.
        dtype_bytes: bytes of the compute dtype, which dense weights and int4 scales take.
        n: the tensor-parallel size.
        int4_packed: whether the engine keeps int4 weights packed (else it dequantizes them at load).
    """
    h, ple = a.hidden_size, a.hidden_size_per_layer_input
    linear = 0  # Linear modules: int4 in a W4A16 checkpoint
    dense = 0  # the rest: embeddings, the experts' 3D weights, the router
    for layer in _layers(a):
        linear += 2 * (a.num_attention_heads // n) * layer.head_dim * h  # q_proj, o_proj
        if layer.own_kv:
            linear += (2 if layer.v_proj else 1) * shard_kv_heads(layer.kv_heads, n) * layer.head_dim * h
        linear += 3 * h * layer.intermediate // n  # gate_proj, up_proj, down_proj
        linear += 2 * h * ple  # per_layer_input_gate, per_layer_projection (whole)
        dense += 3 * a.num_experts * a.moe_intermediate_size * h // n  # experts' gate_up_proj, down_proj
        dense += a.num_experts * h  # the router's projection (whole)
    linear += a.num_hidden_layers * ple * h  # per_layer_model_projection (whole)
    # embed_tokens (lm_head is tied to it: the first shard's vocabulary rows are a view of it) and
    # embed_tokens_per_layer (whole).
    dense += a.vocab_size * h + a.vocab_size * a.num_hidden_layers * ple
    dense += a.encoder_parameters  # the towers load dense (rust/src/gemma4/weights.rs `Weights::open_media`)
    if quantization == "w4a16" and int4_packed:
        linear_bytes = linear // 2 + -(-linear // W4A16_GROUP) * dtype_bytes
    else:
        linear_bytes = linear * dtype_bytes
    return linear_bytes + dense * dtype_bytes


def kv_bytes_per_slot(a: Architecture, dtype_bytes: int, n: int, context: int, snapshots: bool = PREFIX_CACHING) -> int:
    """Bytes of KV cache one slot takes on each of n shards (rust/src/gemma4/cache.rs `CacheSize`); without
    `snapshots`, its rings alone (the chunk row of a compiling engine)."""
    total = 0
    for layer in _layers(a):
        if not layer.own_kv:
            continue
        ring = context if layer.full else min(a.sliding_window, context)
        rings = 2 * shard_kv_heads(layer.kv_heads, n) * (ring + 1) * layer.head_dim * dtype_bytes
        total += rings * (1 + (SNAPSHOTS if snapshots and not layer.full else 0))
    return total


class Plan(NamedTuple):
    """One engine's memory on its fullest chip (the first shard's), and whether it fits."""

    size: str
    quantization: str
    accelerator: str  # e.g. "v5e 1x1"
    chips: int  # in the pod
    tensor_parallel_size: int
    context: int
    max_num_seqs: int
    weight_bytes: int  # the first shard's weights
    kv_bytes_per_slot: int  # one slot's KV cache on one shard
    chunk_row_bytes: int  # with spec.engine.compile: one more row of rings, where compiled prompt chunks run
    total_bytes: int  # weight_bytes + max_num_seqs * kv_bytes_per_slot + chunk_row_bytes
    hbm_bytes: int  # one chip's HBM
    usable_bytes: int  # hbm_bytes less RUNTIME_RESERVE
    slots: int  # slots of `context` that fit beside the weights (0 when the weights alone do not), at most MAX_NUM_SEQS
    fits: bool
    explanation: str


def _size(b: int) -> str:
    return f"{b / GIB:.1f} GiB" if b >= GIB else f"{b / MIB:.1f} MiB"


def _count(k: int, what: str) -> str:
    return f"{k} {what}" if k == 1 else f"{k} {what}s"


def _int4_packed(dtype: str) -> bool:
    return INT4_PACKED_ON_TPU and dtype == "bfloat16"  # ATen's int4 kernels take bfloat16 activations


class _Footprint(NamedTuple):
    weights: int
    kv: int
    chunk_row: int
    usable: int

    def slots(self) -> int:
        return min(MAX_NUM_SEQS, max(0, (self.usable - self.weights - self.chunk_row) // self.kv))


def _footprint(size: str, quantization: str, accelerator_type: str, context: int, n: int, dtype: str,
               compiled: bool, drafter: bool = False) -> _Footprint:
    a, b = ARCHITECTURES[size], DTYPE_BYTES[dtype]
    usable = int(TPU_HBM_GIB[accelerator_type] * GIB * (1 - RUNTIME_RESERVE))
    chunk_row = kv_bytes_per_slot(a, b, n, context, snapshots=False) if compiled else 0
    weights = weight_bytes(a, quantization, b, n, int4_packed=_int4_packed(dtype))
    return _Footprint(weights + (DRAFTER_PARAMETERS * b if drafter else 0), kv_bytes_per_slot(a, b, n, context),
                      chunk_row, usable)


def divisors(c: int) -> list[int]:
    """Tensor-parallel sizes a slice of c chips can run: c's divisors, smallest first."""
    return [d for d in range(1, c + 1) if c % d == 0]


def _sizes(accelerator_type: str, topology: str, drafter: bool) -> list[int]:
    """The tensor-parallel sizes an engine on the slice may have: 1 with a drafter (DRAFTER_PARAMETERS)."""
    return [1] if drafter else divisors(TPU_TOPOLOGY_CHIPS[accelerator_type][topology])


def _smallest_fitting(size: str, quantization: str, accelerator_type: str, topology: str, context: int,
                      max_num_seqs: int, dtype: str, compiled: bool, drafter: bool = False) -> int | None:
    for n in _sizes(accelerator_type, topology, drafter):
        if not splits(ARCHITECTURES[size], n):
            continue
        fp = _footprint(size, quantization, accelerator_type, context, n, dtype, compiled, drafter)
        if fp.slots() >= max_num_seqs:
            return n
    return None


def _ways_to_fit(size: str, quantization: str, accelerator_type: str, topology: str, context: int, max_num_seqs: int,
                 n: int, dtype: str, compiled: bool, drafter: bool = False) -> list[str]:
    """What would make it fit, each a change of spec fields on its own."""
    def fp(typ: str, x: int, m: int, quant: str = quantization) -> _Footprint:
        return _footprint(size, quant, typ, x, m, dtype, compiled, drafter)

    ways = []
    c = TPU_TOPOLOGY_CHIPS[accelerator_type][topology]
    more = [d for d in _sizes(accelerator_type, topology, drafter) if d > n]
    larger = next((d for d in more if fp(accelerator_type, context, d).slots() >= max_num_seqs), None)
    if larger:
        ways.append(f"spec.engine.tensorParallelSize {larger}")
    for tpu in sorted(TPU_TOPOLOGY_CHIPS, key=lambda t: t != accelerator_type):  # this TPU type first
        for topo, topo_chips in TPU_TOPOLOGY_CHIPS[tpu].items():
            if tpu == accelerator_type and topo_chips <= c:
                continue
            fit_n = _smallest_fitting(size, quantization, tpu, topo, context, max_num_seqs, dtype, compiled, drafter)
            if fit_n:
                kind = "" if tpu == accelerator_type else f"spec.accelerator.type {tpu} with "
                ways.append(f"{kind}spec.accelerator.topology {topo} ({topo_chips} chips, tensorParallelSize {fit_n})")
                break
    if quantization == "bf16" and fp(accelerator_type, context, n, "w4a16").slots() >= max_num_seqs:
        ways.append("a W4A16 checkpoint")
    # Shorter contexts or fewer slots: at n where its weights leave room for a slot, else over all the chips.
    m = n if fp(accelerator_type, MIN_CONTEXT, n).slots() >= 1 or drafter else c
    if fp(accelerator_type, MIN_CONTEXT, m).slots() >= 1:
        also = "" if m == n else f" with spec.engine.tensorParallelSize {m}"
        shorter = [x for x in range(MIN_CONTEXT, context, MIN_CONTEXT)
                   if fp(accelerator_type, x, m).slots() >= max_num_seqs]
        if shorter:
            ways.append(f"spec.engine.context {shorter[-1]} or less{also}")
        slots = fp(accelerator_type, context, m).slots()
        if slots:
            ways.append(f"spec.engine.maxNumSeqs {slots} or less{also}")
    return ways


def plan(size: str, quantization: str, accelerator_type: str, topology: str, context: int, max_num_seqs: int,
         tensor_parallel_size: int, dtype: str = "bfloat16", compiled: bool = False, drafter: bool = False) -> Plan:
    """The memory of one engine of a pod, on its fullest chip (pure).

    Args:
        size: one of spec.MODEL_SIZES.
        quantization: "bf16" or "w4a16".
        accelerator_type: a TPU type of spec.TPU_TOPOLOGY_CHIPS.
        topology: one of its topologies.
        context: tokens per slot (spec.engine.context).
        max_num_seqs: slots per engine (spec.engine.maxNumSeqs).
        tensor_parallel_size: chips per engine, N.
        dtype: the compute dtype (spec.engine.dtype).
        compiled: spec.engine.compile is on or auto: the engine holds one more row of rings, where compiled
            prompt chunks run (rust/src/engine/chunks.rs).
        drafter: spec.engine.speculative.method is mtp: the engine holds an assistant drafter
            (DRAFTER_PARAMETERS), and runs without tensor parallelism.
    Returns:
        The plan, with an explanation that names the sizes and, when it does not fit, what would.
    Raises:
        ValueError: N does not divide the slice's chips.
    """
    n, c = tensor_parallel_size, TPU_TOPOLOGY_CHIPS[accelerator_type][topology]
    if c % n:
        raise ValueError(f"tensor-parallel size {n} does not divide the {c} chips of {topology}")
    fp = _footprint(size, quantization, accelerator_type, context, n, dtype, compiled, drafter)
    hbm = TPU_HBM_GIB[accelerator_type] * GIB
    total = fp.weights + max_num_seqs * fp.kv + fp.chunk_row
    fits = total <= fp.usable
    model = f"Gemma 4 {size.upper()} ({quantization})"
    where = f"{TPU_NAMES[accelerator_type]} {topology}"
    notes = ([f"int4 dequantized to {dtype} at load, as the engine does on a TPU"]
             if quantization == "w4a16" and not _int4_packed(dtype) else [])
    notes += ["an assistant drafter's included"] if drafter else []
    dequantized = f" ({'; '.join(notes)})" if notes else ""
    chunk_row = f" + {_size(fp.chunk_row)} for compiled prompt chunks" if fp.chunk_row else ""
    held = (f"{_size(fp.weights)} of weights{dequantized} and {max_num_seqs} x {_size(fp.kv)} of KV cache at "
            f"context {context}{chunk_row}, {_size(total)}")
    room = (f"the {_size(fp.usable)} usable of its {TPU_HBM_GIB[accelerator_type]} GiB HBM "
            f"({RUNTIME_RESERVE:.0%} kept for the runtime)")
    if fits:
        explanation = (f"{model} on {where}: tensorParallelSize {n}, {_count(c // n, 'engine')}; a chip holds {held}, "
                       f"within {room}; {_count(fp.slots(), 'slot')} would fit")
    else:
        why = "the weights alone do not fit" if fp.slots() == 0 else f"{_count(fp.slots(), 'slot')} would fit"
        ways = _ways_to_fit(size, quantization, accelerator_type, topology, context, max_num_seqs, n, dtype, compiled,
                            drafter)
        explanation = (f"{model} does not fit {where} with tensorParallelSize {n}: a chip would hold {held}, over "
                       f"{room}; {why}. " + ("It fits with any one of: " + "; ".join(ways) if ways else
                                             "No TPU slice the operator knows holds it at this context"))
    return Plan(size, quantization, where, c, n, context, max_num_seqs, fp.weights, fp.kv, fp.chunk_row, total, hbm,
                fp.usable, fp.slots(), fits, explanation)


# ---------------------------------------------------------------------------------------------------------
# A spec's model and placement

# A Gemma 4 size tag in a model's name, not inside a longer word or number: gemma-4-31B-it, gemma-4-E2B-it,
# gemma-4-26B-A4B-it.
_SIZE_TAG = re.compile(r"(?<![a-z0-9])(" + "|".join(re.escape(s) for s in MODEL_SIZES) + r")(?![a-z0-9])", re.I)
_INT4_TAG = re.compile(r"w4a16|int4", re.I)


class Model(NamedTuple):
    size: str
    quantization: str


def model_name(source: str) -> str:
    """The part of a model source that names the model: an hf:// repository (org/repo, no revision), or the
    path inside a gs:// bucket or pvc:// claim."""
    scheme, rest = source.split("://", 1)
    if scheme == "hf":
        return rest.split("@", 1)[0]
    return rest.partition("/")[2]


def model_of(model: ModelSpec) -> Model | None:
    """The size and quantization of a spec's model: spec.model.size and .quantization where set, else what the
    source's name says; None when the size is neither set nor named by exactly one tag."""
    name = model_name(model.source)
    tags = {t.lower() for t in _SIZE_TAG.findall(name)}
    size = model.size or (tags.pop() if len(tags) == 1 else None)
    if size is None:
        return None
    return Model(size, model.quantization or ("w4a16" if _INT4_TAG.search(name) else "bf16"))


class Placement(NamedTuple):
    tensor_parallel_size: int
    plan: Plan | None  # None: no TPU, or a model of unknown size


def placement(spec: GemmaRustServerSpec) -> Placement:
    """The tensor-parallel size of a spec's pods and its memory plan (pure): spec.engine.tensorParallelSize,
    or else the smallest divisor of the slice's chips that fits (the slice's chips when none does, the plan
    then saying so); 1 and no plan off TPU or when the model's size is unknown."""
    accel, e = spec.accelerator, spec.engine
    model = model_of(spec.model)
    if not is_tpu(accel) or model is None:
        return Placement(e.tensor_parallel_size or 1, None)
    topology = accel.topology or "1x1"

    compiled = e.compile != "off"
    drafter = e.speculative is not None and e.speculative.method == "mtp"

    def at(n: int) -> Plan:
        return plan(model.size, model.quantization, accel.type, topology, e.context, e.max_num_seqs, n, e.dtype,
                    compiled, drafter)

    if e.tensor_parallel_size:
        return Placement(e.tensor_parallel_size, at(e.tensor_parallel_size))
    n = _smallest_fitting(model.size, model.quantization, accel.type, topology, e.context, e.max_num_seqs,
                          e.dtype, compiled, drafter) or (1 if drafter else chips(accel))
    return Placement(n, at(n))


# ---------------------------------------------------------------------------------------------------------
# The README's table


def table(context: int = 8192, max_num_seqs: int = 8) -> str:
    """Markdown: per size (bf16) and slice, the tensor-parallel size N the operator picks for `max_num_seqs` slots
    of `context` and the slots that fit at that N; where none fits, "no", and the slots that fit over all the chips."""
    slices = [(t, topo) for t in TPU_TOPOLOGY_CHIPS for topo in TPU_TOPOLOGY_CHIPS[t]]
    head = ["model"] + [f"{TPU_NAMES[t]} {topo} ({TPU_TOPOLOGY_CHIPS[t][topo]} x {TPU_HBM_GIB[t]} GiB)"
                        for t, topo in slices]
    rows = [head, ["---"] * len(head)]
    for size in MODEL_SIZES:
        row = [size.upper()]
        for t, topo in slices:
            n = _smallest_fitting(size, "bf16", t, topo, context, max_num_seqs, "bfloat16", False)
            if n:
                row.append(f"N={n}, {plan(size, 'bf16', t, topo, context, max_num_seqs, n).slots} slots")
                continue
            c = TPU_TOPOLOGY_CHIPS[t][topo]
            most = plan(size, "bf16", t, topo, context, max_num_seqs, c).slots
            row.append(f"no ({_count(most, 'slot')} at N={c})" if most else "no")
        rows.append(row)
    return "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table())
