"""Engine benchmark: the Rust engine (`gemma_engine`) against Transformers on the same random Gemma 4
checkpoint and device, in one run.

    python -m bench.engine [--config small|e2b] [--device cpu|cuda] [--dtype bfloat16|float32|float16]
                           [--format dense|w4a16]

Both sides greedy-decode the same prompt from the same bf16 weights (written once with
`save_pretrained`; the Rust engine reads the files, Transformers uses the model it saved). For each
side it prints the median over `--repeats` runs of

* prompt read: prompt tokens / seconds to read the prompt and produce the first token;
* decode: (generated tokens - 1) / seconds spent on the steps after the first token;

and the Rust/Transformers ratios. Transformers runs both with its default dynamic cache and with
`cache_implementation="static"`; the faster of the two is the baseline, and the table says which.
The Rust engine reads tokens back every `--read-every` steps (1 = streaming, as the server does).

`--config small` (default) is a small-but-not-tiny CPU config (hidden 512, 8 layers, vocab 8k);
`--config tiny` the test checkpoints' size (hidden 128), where per-op overhead dominates;
`--config e2b` is bench/gemma4-e2b-text-config.json (Gemma 4 E2B's text config, as google/gemma-4-E2B's
config.json gives it) with random weights (for a GPU); `--config e2b-layers` is the same config cut to its
first 10 layers (the last 5 KV-shared, as E2B's last 20 of 35 are) and a 32k vocabulary: E2B's own matrix
shapes, where a call's fixed cost is small beside its bytes, at a size this CPU machine holds
(1.2 GB read a token in bfloat16).
On the CPU in float32, and in bfloat16 where oneDNN computes bfloat16 on the CPU, the engine multiplies dense
weights with oneDNN (packed once at load; ATen's matmul elsewhere, or with `onednn=False`); the same engine
on ATen's matmul runs beside it, so one run shows both what the kernels give and, on the same kernels as Transformers, the per-op overhead that
remains around them (it grows as the model shrinks). The last lines print the floors, the step's
matrix-vector products alone on each kernel, and how close each side comes to them.
`--format w4a16` writes the same config as a compressed-tensors W4A16 checkpoint (int4 linears, as
tests/checkpoints/quantized.py `save_w4a16` does) and runs both sides in bfloat16: the engine keeps the int4
weights packed for ATen's int4 kernels (`packed_int4=True`), the same engine with them dequantized at load
(`packed_int4=False`) runs beside it, and Transformers loads the checkpoint with the plain
`from_pretrained(path, dtype=torch.bfloat16)` (compressed-tensors decompresses it to dense bfloat16).
The engine's weight bytes on the device, the bytes a decode step reads per token (every weight but the
per-layer embedding table, of which a step reads one row) are printed, and, with the read bound measured in
the same run (`read_bound_runner`: the faster of a `sum` and a matrix-vector product over 1 GiB of float32, 20
passes each between device events, on the run's threads, interleaved with the timings), each side's effective
GB/s and its share of that bound, and on a known GPU of the device's specification.

Before the timings it prints the ATen calls the engine makes per decode step and per layer (counted by
the shim, `gemma_engine.testing.aten_calls`): the same on every machine.
The weights are random, so the tokens are meaningless; how many agree is printed for information
(in bf16 the two sides drift apart on a random model; parity is tests/engine/test_parity.py).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

E2B_CONFIG = Path(__file__).resolve().parent / "gemma4-e2b-text-config.json"
SLIDING, FULL = "sliding_attention", "full_attention"


# The small config: the test checkpoints' architecture (tests/checkpoints/text.py) at a CPU-bench size.
SMALL_OVERRIDES = dict(
    vocab_size=8192,
    vocab_size_per_layer_input=8192,
    hidden_size=512,
    hidden_size_per_layer_input=64,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    global_head_dim=128,
    num_kv_shared_layers=3,
    sliding_window=128,
    layer_types=[SLIDING] * 3 + [FULL] + [SLIDING] * 3 + [FULL],
    max_position_embeddings=131072,
)


# E2B's layers, fewer of them (`--config e2b-layers`).
E2B_LAYERS_OVERRIDES = dict(num_hidden_layers=10, num_kv_shared_layers=5, vocab_size=32768,
                            vocab_size_per_layer_input=32768)


def make_config(name: str, e2b_config: Path = E2B_CONFIG):
    """The Gemma4TextConfig for `name`, with no eos ids so both sides decode the full length."""
    from transformers import Gemma4TextConfig

    if name in ("small", "tiny"):
        # Imported here: the test checkpoints' module loads Transformers' test configs, which the E2B run does not need.
        from tests.checkpoints.text import tiny_text_config

        return tiny_text_config(eos_token_id=None, **(SMALL_OVERRIDES if name == "small" else {}))
    kwargs = json.loads(e2b_config.read_text())
    kwargs.pop("model_type", None)
    kwargs["eos_token_id"] = None
    if name == "e2b-layers":
        kwargs.update(E2B_LAYERS_OVERRIDES, layer_types=kwargs["layer_types"][:E2B_LAYERS_OVERRIDES["num_hidden_layers"]])
    return Gemma4TextConfig(**kwargs)


@torch.no_grad()
def random_model(config, device: str, seed: int = 0):
    """A Gemma4ForCausalLM with random bf16 weights on `device` (unit-scale activations)."""
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = Gemma4ForCausalLM(config).to(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.uniform_(0.5, 1.5, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            p.normal_(0.0, 0.5, generator=gen)
        elif name.endswith("embed_tokens_per_layer.weight"):
            p.normal_(0.0, 1.0 / math.sqrt(config.hidden_size_per_layer_input), generator=gen)
        else:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def rust_runner(model_dir: Path, device: str, dtype: str, prompt: list[int], new: int, read_every: int,
                packed_int4: bool | None = None, onednn: bool | None = None):
    """Load the Rust engine; returns (load seconds, run, engine) where run() -> (read tok/s, decode tok/s,
    tokens)."""
    import gemma_engine

    t0 = time.perf_counter()
    engine = gemma_engine.Engine(
        str(model_dir), like=torch.zeros(1, device=device), context=len(prompt) + new, dtype=dtype, prefill_chunk=256,
        packed_int4=packed_int4, onednn=onednn,
        # Each round reads the same prompt: with prefix caching it would be a hit, not a read
        # (bench/prefix_cache.py measures the cache).
        prefix_caching=False,
    )
    load_s = time.perf_counter() - t0
    engine.decode(prompt, min(new, 8), read_every=read_every)  # warm-up

    def run():
        tokens, _, read_s, decode_s = engine.decode(prompt, new, read_every=read_every)
        return len(prompt) / read_s, (len(tokens) - 1) / decode_s, tokens

    return load_s, run, engine


def aten_calls_per_step(engine, prompt: list[int], steps: int = 16) -> tuple[float, list[int]]:
    """ATen calls the engine makes per decode step (its whole turn: the forward, sampling, the
    position update and, at read_every 1, the read point), and per layer in the last step's forward.

    Counted by the shim (gemma_engine.testing.aten_calls), so the figure is the same on every machine: two
    decodes of the same prompt that differ by `steps` decode steps differ by `steps` times a step.
    """
    from gemma_engine import testing

    def calls(new: int) -> int:
        before = testing.aten_calls()
        engine.decode(prompt, new, read_every=1)
        return testing.aten_calls() - before

    prompt_only = calls(1)
    per_step = (calls(1 + steps) - prompt_only) / steps  # its last forward is a decode step
    return per_step, list(engine.layer_calls)


def ple_table_bytes(config, dtype: str) -> int:
    """Bytes of the per-layer embedding table on the device (a decode step reads one row of it)."""
    p = config.hidden_size_per_layer_input or 0
    return config.vocab_size_per_layer_input * config.num_hidden_layers * p * getattr(torch, dtype).itemsize


def step_read_bytes(engine, config, dtype: str) -> int:
    """The weight bytes one decode step reads: every weight on the device but the per-layer embedding table,
    of which a step reads one row, and, where a tied lm_head has its own oneDNN copy, the embedding table it
    was copied from (a step reads one row of it)."""
    weights = engine.weights()
    out = weights["bytes"] - ple_table_bytes(config, dtype)
    if weights["linear"] == "onednn" and config.tie_word_embeddings:
        out -= config.vocab_size * config.hidden_size * getattr(torch, dtype).itemsize
    return out


def describe_layer_calls(config, per_layer: list[int]) -> str:
    """'sliding 40, full 41, kv-shared sliding 30, ...': the calls of each kind of layer (equal within a kind)."""
    shared_from = config.num_hidden_layers - (config.num_kv_shared_layers or 0)
    kinds: dict[str, set[int]] = {}
    for i, (kind, n) in enumerate(zip(config.layer_types, per_layer)):
        name = ("kv-shared " if i >= shared_from else "") + kind.removesuffix("_attention")
        kinds.setdefault(name, set()).add(n)
    return ", ".join(f"{k} {'/'.join(map(str, sorted(v)))}" for k, v in kinds.items())


def hf_runner(model, device: str, prompt: list[int], new: int, cache: str | None, compile_: bool = False):
    """run() -> (read tok/s, decode tok/s, tokens) for Transformers' generate with `cache`.

    `compile_=False` keeps generate from compiling the forward (it does so on its own for a static
    cache on an accelerator): both sides then run eagerly, op by op. A compiled static cache is one
    `StaticCache` of the longest run's length, reset before each generate (the pattern of
    transformers' cache_utils.py StaticCache docstring), so every call has the same cache shapes and the
    compiled forward is not compiled again for each generate length.
    """
    ids = torch.tensor([prompt], device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, disable_compile=not compile_)
    static = None
    if cache == "static" and compile_:
        from transformers import StaticCache

        static = StaticCache(config=model.config, max_cache_len=len(prompt) + new)
        kwargs["past_key_values"] = static
    elif cache:
        kwargs["cache_implementation"] = cache

    @torch.no_grad()
    def generate(n: int):
        if static is not None:
            static.reset()
        sync(device)
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        sync(device)
        return time.perf_counter() - t, out[0, len(prompt) :].tolist()

    generate(min(new, 8))  # warm-up

    def run():
        # Prompt read = a one-token generate; decode = the rest of a full one.
        first_s, _ = generate(1)
        total_s, tokens = generate(new)
        return len(prompt) / first_s, (new - 1) / max(total_s - first_s, 1e-9), tokens

    return run


SPEC_GBPS = {"H100": 3350.0, "H200": 4800.0}  # HBM3 / HBM3e, NVIDIA's data sheets (SXM)


def read_bound_runner(device: str, gib: float = 1.0, passes: int = 20):
    """The memory read bound: run() -> (bytes per second, kernel) of the faster of two read-only kernels over one
    float32 buffer of `gib` GiB, each run `passes` times between two device events (`torch.cuda.Event` on CUDA; on
    the CPU, where there are none, the wall clock around the same loop), so launch and sync cost nothing beside the
    bytes: a plain `sum`, and a matrix-vector product over the buffer as a 4,096-wide matrix, the read a decode
    step's weights get (on a CPU one thread streams faster through a matrix-vector product than through `sum`). A
    decode step reads its weights once, so bytes a token x tokens a second cannot exceed it."""
    data = torch.ones(int(gib * 2**30) // 4 // 4096 * 4096, device=device, dtype=torch.float32)
    matrix, ones = data.view(-1, 4096), torch.ones(4096, device=device, dtype=torch.float32)
    kernels = {"sum": data.sum, "matrix-vector product": lambda: torch.mv(matrix, ones)}
    assert float(kernels["sum"]()) == data.numel() and bool((kernels["matrix-vector product"]() == 4096).all())

    @torch.no_grad()
    def run() -> tuple[float, str]:
        rates = {name: data.numel() * 4 * passes / timed(device, kernel, passes) for name, kernel in kernels.items()}
        best = max(rates, key=rates.__getitem__)
        return rates[best], best

    return run


def timed(device: str, kernel, passes: int) -> float:
    """Seconds of `passes` calls of `kernel`: between two CUDA events on CUDA, by the wall clock elsewhere."""
    sync(device)
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(passes):
            kernel()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000
    t0 = time.perf_counter()
    for _ in range(passes):
        kernel()
    return time.perf_counter() - t0


def captured(engine) -> int:
    """Step shapes `engine` has captured and compiled so far (0 without a compiler)."""
    report = engine.compile_report()
    return report["captured"] if report else 0


def spec_gbps(device: str, given: float | None = None) -> float | None:
    """The device's memory bandwidth by its specification, GB/s: `given`, or a known GPU's; else None."""
    if given:
        return given
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in SPEC_GBPS.items() if k in name), None)
    return None


def matvec_floor_runner(model, device: str, steps: int = 20, rows: int = 1, onednn: bool = False):
    """The decode floor: one step's matrix-vector products alone (every Linear, lm_head included), for
    `rows` sequences decoding together (bench/concurrency.py compares 1 and 8).

    Returns run() -> steps per second of just those products, in a bare Python loop. A decode step
    cannot be faster than this on the same kernels, so it bounds any ratio the two sides can reach.
    The kernels: ATen's `linear` (what Transformers runs), or with `onednn` oneDNN's over weights
    packed once (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`: what the engine runs
    on the CPU in float32, rust/src/gemma4/linear.rs).
    """
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], device=device, dtype=w.dtype) for w in weights}
    if onednn:
        packed = [(torch.ops.mkldnn._reorder_linear_weight(w, None), w.shape[1]) for w in weights]

        def product(p):
            return torch.ops.mkldnn._linear_pointwise(xs[p[1]], p[0], None, "none", [], "")
    else:
        packed = weights

        def product(w):
            return torch.nn.functional.linear(xs[w.shape[1]], w)

    @torch.no_grad()
    def run() -> float:
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            for w in packed:
                product(w)
        sync(device)
        return steps / (time.perf_counter() - t0)

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=("tiny", "small", "e2b-layers", "e2b"), default="small")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (a torch device string)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default=None,
                        help="compute dtype (default: float32 on cpu, bfloat16 elsewhere)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 200 for small and e2b-layers, 512 for tiny and e2b)")
    parser.add_argument("--new", type=int, default=None, help="generated tokens (default 128 for small, 64 for e2b-layers, 256 for tiny and e2b)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--read-every", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default 1 on cpu: on a small shared machine several "
                             "OpenMP/MKL threads contend with other processes and the timings thrash; torch's default elsewhere)")
    parser.add_argument("--hf-compile", action="store_true", help="let Transformers compile a static-cache forward")
    parser.add_argument("--e2b-config", type=Path, default=E2B_CONFIG, help="the E2B text config.json")
    parser.add_argument("--format", choices=("dense", "w4a16"), default="dense",
                        help="checkpoint format (w4a16: int4 linears, both sides in bfloat16)")
    parser.add_argument("--group-size", type=int, default=64, help="int4 columns per scale group (w4a16; divides every linear's input width)")
    args = parser.parse_args(argv)
    if args.format == "w4a16" and args.dtype not in (None, "bfloat16"):
        parser.error("--format w4a16 runs in bfloat16 (ATen's int4 kernels take bfloat16 activations)")

    threads = args.threads or (1 if args.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    dtype = args.dtype or ("float32" if args.device == "cpu" and args.format == "dense" else "bfloat16")
    n_prompt = args.prompt or {"small": 200, "e2b-layers": 200}.get(args.config, 512)
    new = args.new or {"small": 128, "e2b-layers": 64}.get(args.config, 256)
    config = make_config(args.config, args.e2b_config)
    prompt = [2] + [(37 * i + 11) % (config.vocab_size - 3) + 3 for i in range(n_prompt - 1)]

    import gemma_engine
    import transformers

    print(f"config {args.config}: hidden {config.hidden_size}, layers {config.num_hidden_layers}, vocab {config.vocab_size}; "
          f"device {args.device}, dtype {dtype}, prompt {n_prompt}, new {new}, repeats {args.repeats}, "
          f"read_every {args.read_every}, torch threads {torch.get_num_threads()}, format {args.format}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, gemma_engine {gemma_engine.__version__}")

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        if args.format == "w4a16":
            from tests.checkpoints.parity import load_hf_reference
            from tests.checkpoints.quantized import save_w4a16

            save_w4a16(tmp, group_size=args.group_size, config=config)
            model = load_hf_reference(tmp, None, torch.bfloat16).to(args.device)
        else:
            model = random_model(config, args.device)
            model.save_pretrained(tmp)
        print(f"random checkpoint written in {time.perf_counter() - t0:.1f} s", flush=True)
        packed = True if args.format == "w4a16" else None
        load_s, rust_run, engine = rust_runner(Path(tmp), args.device, dtype, prompt, new, args.read_every, packed)
        # Where the engine multiplies with oneDNN, the same engine on ATen's matmul runs beside it.
        onednn = engine.weights()["linear"] == "onednn"
        aten_run = rust_runner(Path(tmp), args.device, dtype, prompt, new, args.read_every, packed, False)[1] \
            if onednn else None
        # Where int4 weights stay packed, the same checkpoint dequantized at load runs beside them.
        dequantized_run, dequantized_bytes = None, 0
        if engine.weights()["int4"] == "packed":
            _, dequantized_run, dequantized = rust_runner(Path(tmp), args.device, dtype, prompt, new, args.read_every,
                                                          False)
            dequantized_bytes = step_read_bytes(dequantized, config, dtype)
    per_step, per_layer = aten_calls_per_step(engine, prompt)
    print(f"ATen calls per decode step: {per_step:.0f} ({sum(per_layer)} in the {len(per_layer)} layers: "
          f"{describe_layer_calls(config, per_layer)})", flush=True)
    weights = engine.weights()
    read_bytes = step_read_bytes(engine, config, dtype)
    print(f"engine weights on the device: {weights['bytes'] / 1e6:.1f} MB (int4: {weights['int4']}, "
          f"dense linears: {weights['linear']}); "
          f"a decode step reads {read_bytes / 1e6:.1f} MB a token", flush=True)
    model = model.to(getattr(torch, dtype))
    runners = {"rust": rust_run, **({"rust-aten": aten_run} if aten_run else {}),
               **({"rust-dequantized": dequantized_run} if dequantized_run else {})}
    runners.update({f"hf-{c or 'dynamic'}": hf_runner(model, args.device, prompt, new, c, args.hf_compile) for c in (None, "static")})
    read_bound = read_bound_runner(args.device)
    kernels: list[str] = []  # the kernel that set each sample of the read bound

    def read_sample() -> float:
        rate, kernel = read_bound()
        kernels.append(kernel)
        return rate

    floor_runs = {"aten": matvec_floor_runner(model, args.device), "read": read_sample}
    if onednn:
        floor_runs["onednn"] = matvec_floor_runner(model, args.device, onednn=True)
    # Interleave the sides, so that a change in machine load hits them alike.
    samples = {k: [] for k in runners}
    floors = {k: [] for k in floor_runs}
    for _ in range(args.repeats):
        for k, run in runners.items():
            samples[k].append(run())
            print(f"  {k}: prompt read {samples[k][-1][0]:.1f} tok/s, decode {samples[k][-1][1]:.1f} tok/s", flush=True)
        for k, run in floor_runs.items():
            floors[k].append(run())
    results = {
        k: {
            "read": statistics.median(s[0] for s in v),
            "decode": statistics.median(s[1] for s in v),
            "tokens": v[-1][2],
        }
        for k, v in samples.items()
    }
    rust = dict(results.pop("rust"), load_s=load_s)
    rust_aten = results.pop("rust-aten", None)
    rust_dequantized = results.pop("rust-dequantized", None)
    hf = {k.removeprefix("hf-"): v for k, v in results.items()}
    best = max(hf, key=lambda k: hf[k]["decode"])

    print(f"{'':28}{'prompt read tok/s':>20}{'decode tok/s':>16}")
    print(f"{'rust (gemma_engine)':28}{rust['read']:>20.1f}{rust['decode']:>16.1f}   (load {rust['load_s']:.1f} s)")
    if rust_aten:
        print(f"{'rust, ATen matmul':28}{rust_aten['read']:>20.1f}{rust_aten['decode']:>16.1f}")
    if rust_dequantized:
        print(f"{'rust, int4 dequantized':28}{rust_dequantized['read']:>20.1f}{rust_dequantized['decode']:>16.1f}")
    for k, r in hf.items():
        print(f"{'transformers, ' + k + ' cache':28}{r['read']:>20.1f}{r['decode']:>16.1f}")
    base = hf[best]
    agree = next((i for i, (a, b) in enumerate(zip(rust["tokens"], base["tokens"])) if a != b), len(base["tokens"]))
    print(f"rust/transformers ({best} cache, the faster HF decode): "
          f"decode {rust['decode'] / base['decode']:.2f}x, prompt read {rust['read'] / base['read']:.2f}x")
    if rust_aten:
        print(f"oneDNN/ATen matmul, same engine: decode {rust['decode'] / rust_aten['decode']:.2f}x, "
              f"prompt read {rust['read'] / rust_aten['read']:.2f}x")
    if rust_dequantized:
        print(f"packed/dequantized int4, same engine: decode {rust['decode'] / rust_dequantized['decode']:.2f}x, "
              f"prompt read {rust['read'] / rust_dequantized['read']:.2f}x")
    print(f"first {agree} of {new} greedy tokens agree")
    floor = {k: statistics.median(v) for k, v in floors.items()}
    bound = floor.pop("read")
    spec = spec_gbps(args.device)
    print(f"memory read bound ({torch.get_num_threads()} thread(s), 1 GiB of float32, 20 passes, the faster of a sum "
          f"and a matrix-vector product, median; faster: {' and '.join(sorted(set(kernels)))}): {bound / 1e9:.1f} GB/s"
          + (f" = {100 * bound / 1e9 / spec:.1f} % of the {spec:,.0f} GB/s spec" if spec else ""))
    # Transformers reads its own (dense) weights: every parameter but the per-layer table, a tied lm_head once.
    hf_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - ple_table_bytes(config, dtype)
    sides = (("rust", rust, read_bytes), ("rust, ATen matmul", rust_aten, read_bytes),
             ("rust, int4 dequantized", rust_dequantized, dequantized_bytes),
             (f"transformers, {best} cache", base, hf_bytes))
    for name, r, nbytes in sides:
        if r:
            gbs = nbytes * r["decode"] / 1e9
            print(f"{name} decode: {nbytes / 1e6:.1f} MB a token at {gbs:.2f} GB/s effective, "
                  f"{gbs * 1e9 / bound:.0%} of the read bound" + (f", {gbs / spec:.0%} of spec" if spec else ""))
    print(f"matrix-vector products alone, ATen's kernels: {floor['aten']:.1f} steps/s; transformers decode is "
          f"{base['decode'] / floor['aten']:.0%} of that floor" + (
              f", the engine on them {rust_aten['decode'] / floor['aten']:.0%}" if rust_aten else
              f", rust {rust['decode'] / floor['aten']:.0%}"))
    if "onednn" in floor:
        print(f"matrix-vector products alone, oneDNN's kernels: {floor['onednn']:.1f} steps/s "
              f"({floor['onednn'] / floor['aten']:.2f}x ATen's); rust decode is {rust['decode'] / floor['onednn']:.0%} "
              "of that floor")


if __name__ == "__main__":
    main()
