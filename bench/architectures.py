"""The larger Gemma 4 architectures on the CPU, in one run: the Rust engine against Transformers, and the MoE
step's ATen calls against the number of experts (tensor parallelism, a process a rank: bench/tensor_parallel.py).

    python -m bench.architectures [--repeats 3] [--dtype float32|bfloat16] [--threads N]

For each architecture (small random configs of each shape: the E-series, the 31B with K=V attention, the
26B-A4B with 8 experts (2 a token) beside every MLP, the 12B "unified" text model; hidden 512, 8 query heads,
8 layers, vocabulary 8,192), from the same bf16 checkpoint, it prints the median over `--repeats` runs of

* prompt read: prompt tokens / seconds to read a 128-token prompt (Transformers: one forward; the engine:
  `Engine.logits`, its prompt path);
* decode: tokens / second over 64 greedy tokens after the prompt (Transformers: `generate` with its default
  dynamic cache, minus its prompt read; the engine: `Engine.decode`, minus its prompt read);

with the engine / Transformers ratios; then the ATen calls of one MoE layer's decode step with 4, 8 and 32
experts (`Engine.layer_calls`), which stay the same.

The weights are random; the tokens are meaningless (parity is tests/engine/test_architectures.py).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import gemma_engine
from tests.checkpoints.parity import load_hf_reference
from tests.checkpoints.text import SEED, save_dense, tiny_text_config, tiny_unified_text_config

SLIDING, FULL = "sliding_attention", "full_attention"
PROMPT = [2] + [(97 * i + 13) % 8000 + 3 for i in range(127)]
NEW = 64
# hidden 512, 8 query heads of 64 (full layers 128), 8 layers, vocabulary 8,192.
SMALL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, global_head_dim=128, sliding_window=64,
             layer_types=[SLIDING] * 3 + [FULL] + [SLIDING] * 3 + [FULL], max_position_embeddings=4096)
NO_PLE = dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False)
K_EQ_V = dict(attention_k_eq_v=True, num_global_key_value_heads=2)


def moe(num_experts: int) -> dict:
    return dict(enable_moe_block=True, num_experts=num_experts, top_k_experts=2, moe_intermediate_size=256)


ARCHITECTURES = {
    "E-series": lambda: tiny_text_config(**SMALL, vocab_size_per_layer_input=8192, hidden_size_per_layer_input=64,
                                            num_kv_shared_layers=2),
    "31B (K=V)": lambda: tiny_text_config(**SMALL, **NO_PLE, **K_EQ_V),
    "26B-A4B (MoE)": lambda: tiny_text_config(**SMALL, **NO_PLE, **K_EQ_V, **moe(8)),
    "12B (unified)": lambda: tiny_unified_text_config(**{k: v for k, v in SMALL.items()}),
}


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def engine(model_dir: Path, dtype: str) -> gemma_engine.Engine:
    return gemma_engine.Engine(str(model_dir), like=torch.zeros(1), context=1024, dtype=dtype,
                               prefill_chunk=256)


def rust_rates(e: gemma_engine.Engine, repeats: int) -> tuple[float, float]:
    """(prompt tokens/s, decode tokens/s) of the engine."""
    # Greedy with the eos ids biased away, so every run decodes NEW tokens (Transformers: min_new_tokens).
    greedy = gemma_engine.SamplingParams(logit_bias={t: -100.0 for t in e.eos_ids})
    e.decode(PROMPT, 4, sampling=greedy)  # warm: the step's buffers, oneDNN's first calls
    prompt = median_time(lambda: e.logits(PROMPT), repeats)
    whole = median_time(lambda: e.decode(PROMPT, NEW, sampling=greedy), repeats)
    assert len(e.decode(PROMPT, NEW, sampling=greedy)[0]) == NEW
    return len(PROMPT) / prompt, NEW / (whole - prompt)


def hf_rates(model_dir: Path, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    model = load_hf_reference(model_dir, dtype=dtype)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        model(ids)
        prompt = median_time(lambda: model(ids), repeats)
        whole = median_time(lambda: model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False),
                            repeats)
    return len(PROMPT) / prompt, NEW / (whole - prompt)


def moe_layer_calls(out: Path, num_experts: int) -> int:
    config = tiny_text_config(**SMALL, **NO_PLE, **K_EQ_V, **moe(num_experts))
    e = engine(save_dense(out / f"moe{num_experts}", SEED, config), "float32")
    e.decode(PROMPT[:8], 3)
    return max(e.layer_calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    print(f"# {args.dtype}, {args.threads} threads, medians of {args.repeats}; prompt {len(PROMPT)} tokens, "
          f"decode {NEW}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for name, build in ARCHITECTURES.items():
            model_dir = save_dense(out / name.split()[0], SEED, build())
            rust_prompt, rust_decode = rust_rates(engine(model_dir, args.dtype), args.repeats)
            hf_prompt, hf_decode = hf_rates(model_dir, dtype, args.repeats)
            rows.append((name, rust_prompt, hf_prompt, rust_decode, hf_decode))
        print(f"{'architecture':16} {'prompt tok/s':>24} {'ratio':>6} {'decode tok/s':>22} {'ratio':>6}")
        for name, rp, hp, rd, hd in rows:
            print(f"{name:16} {rp:11.0f} vs {hp:9.0f} {rp / hp:6.2f} {rd:10.1f} vs {hd:8.1f} {rd / hd:6.2f}")
        calls = {n: moe_layer_calls(out, n) for n in (4, 8, 32)}
        print("MoE layer, ATen calls a decode step: " + ", ".join(f"{n} experts {c}" for n, c in calls.items()))


if __name__ == "__main__":
    main()
