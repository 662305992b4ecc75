"""Boot stages: build -> import -> smoke -> weights -> compile -> warmup -> serving.

The stages run on a boot thread while uvicorn already answers: /health is 503 with the current stage until
warmup ends, like llama.cpp's "Loading model" (vLLM's /health answers the same way while its engine starts).
One engine runs per device (`--devices`), or per group of `--tensor-parallel-size` devices (on the cpu, that
many shards of each engine); each is loaded, warmed up and then run on its own worker thread
(scheduler.EngineWorker: the engine is `unsendable`, so the thread that loads it must be the one that serves
it); the weights and warmup stages hand those tasks to the workers and wait for all of them. Each stage's start, seconds and outcome
are logged, exported as `gemma_boot_stage_seconds` and reported by GET /v1/engine. The weights stage also
builds the checkpoint's `gemma_engine.Grammars` (its tokenizer.json, eos ids and vocabulary) once: every
engine and every request's grammar check share it; and, for a checkpoint with a vision or audio tower, its
media front end (media_encoder.MediaEncoder: Transformers' processors and one `gemma_engine.Encoder` on the first
engine's device, on a thread of its own). With speculative decoding on and no --speculative-max-batch, the warmup
stage also measures up to which decode bucket it pays on each engine and sets that limit (speculation.py). A
failed stage writes a one-line reason to the termination-message file (Kubernetes shows it as the container's last state, and
the operator as a condition) and asks the process to exit non-zero, so the pod restarts with back-off.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import platform
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gemma_server import build as build_mod
from gemma_server import compile_cache, compile_stage, speculation
from gemma_server.config import Config
from gemma_server.media_encoder import MediaEncoder
from gemma_server.metrics import Metrics, cache_config
from gemma_server.scheduler import EngineWorker, Scheduler
from gemma_server.sources import materialize, parse_source

log = logging.getLogger(__name__)

WARMUP_TOKENS = 4
DEFER_AND_FUSE_VAR = "TORCH_TPU_DEFER_AND_FUSE"
TPU_COMPILE_CACHE_VAR = "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"


@dataclass
class StageRecord:
    stage: str
    status: str  # running | ok | failed | skipped
    started_at: float  # unix time
    seconds: float | None = None
    message: str = ""


@dataclass
class BootState:
    """What /v1/engine reports. Written by the engine thread, read by the asyncio side (whole-field writes)."""

    stage: str = "build"
    stages: list[StageRecord] = field(default_factory=list)
    build: dict[str, str] = field(default_factory=dict)
    layout: dict[str, int] = field(default_factory=dict)
    device: str | None = None
    dtype: str | None = None
    context: int | None = None
    model_dir: str | None = None
    load_seconds: float | None = None
    warmup_seconds: float | None = None
    #: --compile's outcome at boot: mode, backend, per engine whether it replays compiled steps, the buckets that
    #: run eagerly and, with auto, each bucket's two timings it chose by (None with --compile off). /v1/engine
    #: adds each engine's compiler's live account (steps compiled while serving, fallbacks).
    compile: dict[str, Any] | None = None
    failed: str | None = None

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = [asdict(s) for s in self.stages]
        return d


@dataclass
class Loaded:
    """What the boot hands to the scheduler and the request handlers.

    An engine is `unsendable`: even reading a property from another thread panics, so what the request
    handlers need of it (context, vocab_size) is read once here, on its worker's thread.
    """

    tokenizer: Any
    workers: list[EngineWorker]
    context: int = 0
    vocab_size: int = 0
    grammars: Any = None  # gemma_engine.Grammars, or None (then grammars_missing says why)
    grammars_missing: str = "the engine was built without grammars"
    media: Any = None  # media_encoder.MediaEncoder, or None (then media_missing says why)
    media_missing: str = "the checkpoint has no vision or audio tower"

    @property
    def modalities(self) -> tuple[str, ...]:
        """What the checkpoint takes besides text: a subset of ("image", "audio")."""
        return self.media.modalities if self.media is not None else ()


class StageFailed(Exception):
    """A boot stage failed; the message is the one-line reason."""


def one_line(stage: str, exc: BaseException) -> str:
    """`<stage>: <Type>: <message>` on one line, at most 1 KiB (the termination message limit is 4 KiB)."""
    text = " ".join(str(exc).split())
    return f"{stage}: {type(exc).__name__}: {text}"[:1024]


def write_termination_message(path: str, line: str) -> None:
    """Best effort: the reason Kubernetes shows for the container's last termination."""
    try:
        Path(path).write_text(line + "\n")
    except OSError as e:
        log.warning("could not write termination message to %s: %s", path, e)


class Boot:
    """Runs the stages. Call `run()` on the engine thread; it returns `Loaded` or raises StageFailed.

    Args:
        config: the server config.
        metrics: where stage seconds, readiness and build info go.
        on_failure: called with the one-line reason after a stage fails (the server then exits non-zero).
        scheduler: gets the engine workers once they are warm.
    """

    def __init__(self, config: Config, metrics: Metrics, on_failure: Callable[[str], None],
                 scheduler: Scheduler) -> None:
        self.config = config
        self.metrics = metrics
        self.on_failure = on_failure
        self.scheduler = scheduler
        self.devices: list[str] = []
        # Each engine's devices, `--tensor-parallel-size` of them (shard_groups).
        self.groups: list[list[str]] = []
        self.state = BootState(device=config.device, dtype=config.dtype, context=config.context)
        self.loaded: Loaded | None = None
        #: Each engine's compiler hook (gemma_engine.compiling.StepCompiler) by worker index, with --compile.
        self.compilers: dict[int, Any] = {}
        self._lock = threading.Lock()

    # ---- bookkeeping ---------------------------------------------------------------------------

    def _begin(self, stage: str) -> StageRecord:
        rec = StageRecord(stage, "running", time.time())
        with self._lock:
            self.state.stages = [*self.state.stages, rec]
            self.state.stage = stage
        log.info("stage %s: started", stage)
        return rec

    def _end(self, rec: StageRecord, status: str, t0: float, message: str = "") -> None:
        rec.seconds = round(time.monotonic() - t0, 3)
        rec.message = message
        rec.status = status
        self.metrics.boot_stage_seconds[rec.stage].set(rec.seconds)
        log.info("stage %s: %s in %.3fs%s", rec.stage, status, rec.seconds, f" ({message})" if message else "")

    def _stage(self, stage: str, fn: Callable[[], str | None], skip: str | None = None) -> None:
        rec = self._begin(stage)
        t0 = time.monotonic()
        if skip is not None:
            self._end(rec, "skipped", t0, skip)
            return
        try:
            message = fn() or ""
        except BaseException as e:
            reason = one_line(stage, e)
            self._end(rec, "failed", t0, reason)
            self.state.failed = reason
            self.scheduler.lifecycle.fail(reason)  # the server's readiness: dead, for this reason
            log.error("boot failed: %s", reason, exc_info=not isinstance(e, (FileNotFoundError, ValueError)))
            write_termination_message(self.config.termination_log, reason)
            self.on_failure(reason)
            raise StageFailed(reason) from e
        self._end(rec, "ok", t0, message)

    # ---- the stages ----------------------------------------------------------------------------

    def run(self) -> Loaded:
        """Run every stage in order, then start the engines serving.

        Returns:
            the tokenizer and the engine workers.
        Raises:
            StageFailed: a stage failed (already recorded, written and reported).
        """
        c = self.config
        self._build_path: Path | None = None
        # Before anything imports torch: torch_tpu 0.2.0 declares a `torch.backends` entry point, which
        # torch's `_import_device_backends` (torch/__init__.py) loads on `import torch` (the build stage).
        os.environ.update(tpu_environment(c))
        self._stage("build", self._build, skip="--use-installed-engine" if c.use_installed_engine else None)
        self._stage("import", self._import)
        self._stage("smoke", self._smoke)
        self._stage("weights", self._weights)
        self._stage("compile", self._compile, skip="--compile off" if c.compile == "off" else None)
        self._stage("warmup", self._warmup)
        assert self.loaded is not None
        self.scheduler.start(self.loaded.workers, c.read_every)
        rec = self._begin("serving")
        rec.seconds = 0.0
        self.metrics.engine_ready.set(1)
        return self.loaded

    def _build(self) -> str:
        import torch  # the build links against this torch

        crate = Path(self.config.engine_src)
        result = build_mod.ensure_engine(crate, Path(self.config.build_cache), torch.__version__)
        self._build_path = result.path
        return f"{'cached' if result.cached else 'compiled'} {result.key}"

    def _import(self) -> str:
        c = self.config
        seeded = ""
        if c.device == "tpu":
            # Made here, so that a cache directory that cannot be made fails this stage with its OS error;
            # torch_tpu would abort the process on it (an ABSL_CHECK in csrc/common/tier3_compilation_cache.cc).
            cache = os.environ.get(TPU_COMPILE_CACHE_VAR, "")
            if cache and "://" not in cache:
                Path(cache).mkdir(parents=True, exist_ok=True)
            dirs = compile_cache_dirs(c)
            seeded = f"; {compile_cache.seed(*dirs)} compiled programs from {dirs[0]}" if dirs else ""
            # torch_tpu registers its kernels on import; the engine's ATen calls then reach them.
            importlib.import_module("torch_tpu")
        import torch

        if self._build_path is not None:
            build_mod.activate(self._build_path)
        ge = importlib.import_module("gemma_engine")
        self.gemma_engine = ge
        built = dict(ge.BUILD)
        if built.get("torch") != torch.__version__:
            raise ImportError(f"gemma_engine was built for torch {built.get('torch')}, this is {torch.__version__}")
        info = {
            **built,
            "version": ge.__version__,
            "module": str(getattr(ge, "__file__", "")),
            "python_running": platform.python_version(),
        }
        if c.device == "tpu":
            tt = sys.modules["torch_tpu"]
            info["torch_tpu"] = getattr(tt, "__version__", "unknown")
            info["torch_tpu_defer_and_fuse"] = os.environ.get(DEFER_AND_FUSE_VAR, "")
            info["torch_tpu_eager_mode"] = eager_mode_name(torch)
            info["torch_tpu_compile_cache"] = "on" if os.environ.get(TPU_COMPILE_CACHE_VAR) else "off"
            info["torch_tpu_compile_cache_dir"] = os.environ.get(TPU_COMPILE_CACHE_VAR, "")
        self.devices = device_list(c.device, c.devices, torch)
        self.groups = shard_groups(self.devices, c.tensor_parallel_size)  # a size that does not divide them fails here
        self.state.build = info
        self.metrics.set_build_info(
            torch=built.get("torch", ""), torch_tpu=info.get("torch_tpu", ""), rustc=built.get("rustc", ""),
            python=built.get("python", ""), crate=built.get("crate", ""), device=c.device,
        )
        return f"gemma_engine {ge.__version__} for torch {built.get('torch')}{seeded}"

    def _smoke(self) -> str:
        import torch

        done = []
        for device in self.devices:
            result = self.gemma_engine.smoke(torch.zeros(1, device=device))
            if float(result["value"]) != 4096.0:
                raise RuntimeError(f"smoke test on {result.get('device')} gave {result['value']}, expected 4096")
            done.append(str(result["device"]))
        return f"4096 on {', '.join(done)}"

    def _weights(self) -> str:
        c = self.config
        t0 = time.monotonic()
        token = os.environ.get("HF_TOKEN") or None
        model_dir = materialize(parse_source(c.model), hf_token=token, gcs_root=c.gcs_root,
                                mount_timeout=c.mount_timeout)
        emb_dir = drafter_dir = None
        if c.emb:
            emb_dir = materialize(parse_source(c.emb), hf_token=token, gcs_root=c.gcs_root,
                                  mount_timeout=c.mount_timeout)
        if c.speculative_model:
            drafter_dir = materialize(parse_source(c.speculative_model), hf_token=token, gcs_root=c.gcs_root,
                                      mount_timeout=c.mount_timeout)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        grammars, missing = build_grammars(self.gemma_engine, Path(model_dir))
        workers = [EngineWorker(i, group[0], self.scheduler) for i, group in enumerate(self.groups)]
        settings = dict(
            context=c.context, dtype=c.dtype, prefill_chunk=c.prefill_chunk, max_batch=c.max_num_seqs,
            packed_int4=None if c.packed_int4 else False, cuda_graphs=c.cuda_graphs,
            onednn={"auto": None, "on": True, "off": False}[c.onednn],
            prefix_caching=c.enable_prefix_caching, speculative_method=c.speculative_method,
            num_speculative_tokens=c.num_speculative_tokens,
            speculative_max_batch=c.speculative_max_batch or c.max_num_seqs,
            prompt_lookup_min=c.prompt_lookup_min, prompt_lookup_max=c.prompt_lookup_max,
            speculative_model=str(drafter_dir) if drafter_dir else None)
        if c.compile != "off":
            self.compilers = {w.index: self.step_compiler(w.device) for w in workers}
        # Split engines: every rank past each engine's first starts now, in one world (its shards load meanwhile).
        seats = start_ranks(c, model_dir, emb_dir, self.groups, settings, bool(grammars), self.compilers) \
            if c.tensor_parallel_size > 1 else None

        def load(worker: EngineWorker) -> tuple[int, int]:
            import torch

            own = {"grammars": grammars, "compiler": self.compilers.get(worker.index)}
            if seats is not None:
                engine = seats[worker.index].lead(**own)
                engine.on_lost = lambda why, w=worker: self.scheduler.worker_died(w, why)
            else:
                engine = self.gemma_engine.Engine(
                    str(model_dir), str(emb_dir) if emb_dir else None, torch.zeros(1, device=worker.device),
                    **settings, **own)
            worker.set_engine(engine)
            return engine.context, engine.vocab_size

        # One media encoder, on the first engine's device (the engines move the soft tokens to their own), loaded
        # first: each engine sizes its KV cache against the device's free memory, which must count the towers.
        front, media_missing = MediaEncoder.load(self.gemma_engine, Path(model_dir), workers[0].device, c.dtype,
                                                 self.metrics.observe_encoded)
        sizes = run_on_workers(workers, load)
        context, vocab_size = sizes[0]
        self.loaded = Loaded(tokenizer, workers, context, vocab_size, grammars, missing, front, media_missing)
        self.state.model_dir = str(model_dir)
        self.state.layout = dict(workers[0].layout)
        self.state.device = ", ".join(w.device for w in workers)
        self.state.load_seconds = round(time.monotonic() - t0, 3)
        layout = workers[0].layout
        self.metrics.set_cache_config(cache_config(
            slots=sum(w.max_batch for w in workers), context=context, prefill_chunk=c.prefill_chunk,
            prefix_caching=bool(layout.get("prefix_caching")), sliding_window=layout.get("sliding_window")))
        media = f"; takes {' and '.join(front.modalities)}" if front is not None and front.modalities else ""
        return f"{c.shown_source or 'the model directory'} on {self.state.device}, {c.max_num_seqs} slots each{media}"

    def step_compiler(self, device: str):
        """The engine's compiler hook on `device` (gemma_engine.compiling): on a tpu torch_tpu's, with the KV rings
        a step writes donated where the device passes `storage_swap_check` (else its dynamo backend `tpu`, which
        copies them, and a warning says why); Inductor elsewhere (on cuda the engine captures each compiled step
        as a CUDA graph)."""
        from gemma_engine.compiling import StepCompiler, storage_swap_check

        kind = device.split(":")[0]
        if kind in ("tpu", "privateuseone"):
            refused = storage_swap_check(device)
            if refused:
                log.warning("compiled steps on %s copy the KV rings they write (no buffer donation): %s",
                            device, refused)
            return StepCompiler("tpu", donate=refused is None, on_fallback=self.metrics.observe_compile_fallback)
        return StepCompiler("inductor", on_fallback=self.metrics.observe_compile_fallback)

    def _compile(self) -> str:
        """Capture and compile every decode-step bucket (1, 2, 4, ... slots, and --max-num-seqs), its forward and
        its choice greedy and sampled, the first step after a read point and the later ones, on every engine: each
        bucket is filled with that many requests, decoded together (compile_stage.py `compile_buckets`; a shape's
        second step is captured, compiled.rs). Then every prompt-chunk bucket, as a prompt's first chunk and a
        later one (`compile_chunks`). With --compile auto, then time each bucket's decode steps both ways and keep
        the faster per bucket.
        A step with other sampling stages (penalties, bias, log-probabilities, grammars) replays its bucket's
        compiled forward and compiles only its choice, on its second step, while serving. These requests do not
        speculate, so their steps are decode steps; verify steps compile at warmup (`_compile_verify`)."""
        assert self.loaded is not None
        c = self.config
        vocab = self.loaded.vocab_size

        def compile_one(w: EngineWorker) -> dict[str, Any]:
            import gemma_engine

            first = compile_stage.compile_buckets(gemma_engine, w.engine, vocab)
            compile_stage.compile_chunks(gemma_engine, w.engine, vocab, first)
            report: dict[str, Any] = {}
            if c.compile == "auto":
                report["ms_per_step"] = [compile_stage.choose_per_bucket(gemma_engine, w.engine, b, vocab,
                                                                         c.read_every) for b in w.engine.buckets]
            w.engine.reset_prefix_cache()  # nothing a compile-stage request wrote is offered as a prefix
            state = w.engine.compile_report()
            report["active"], report["eager_buckets"] = state["active"], state["eager_buckets"]
            return report

        reports = run_on_workers(self.loaded.workers, compile_one)
        compilers = [self.compilers[w.index] for w in self.loaded.workers]
        self.state.compile = {"mode": c.compile, "backend": compilers[0].backend_name, "engines": reports}
        active = sum(r["active"] for r in reports)
        compiled = sum(len(x.compiled) for x in compilers)
        fallbacks = sum(len(x.fallbacks) for x in compilers)
        eager = "; ".join(f"buckets {r['eager_buckets']} ran faster eagerly" for r in reports if r["eager_buckets"])
        return (f"{compilers[0].backend_name}: {compiled} steps and prompt chunks compiled, {fallbacks} fell back; "
                f"{active} of "
                f"{len(reports)} engines replay them" + (f" ({eager})" if eager else ""))

    def _warmup(self) -> str:
        assert self.loaded is not None
        t0 = time.monotonic()
        tok = self.loaded.tokenizer
        ids = tok.encode("Hello", add_special_tokens=True) or [0]
        outs = run_on_workers(self.loaded.workers, lambda w: w.engine.decode(ids, WARMUP_TOKENS))
        self.state.warmup_seconds = round(time.monotonic() - t0, 3)
        done = ", ".join(f"{len(tokens)} tokens ({finish})" for tokens, finish, _, _ in outs)
        parts = (done, self._measure_speculation(), self._compile_verify(), self.publish_compile_cache())
        return "; ".join(part for part in parts if part)

    def _measure_speculation(self) -> str | None:
        """With speculative decoding on and no --speculative-max-batch: each engine's limit from its own steps'
        costs (speculation.py), set on the engine; /v1/engine shows the costs."""
        if not self.config.speculative_method or self.config.speculative_max_batch is not None:
            return None

        def measure(w: EngineWorker) -> str:
            costs, chosen = speculation.measure(w.engine)
            w.speculative = {**w.engine.speculative, "measured": costs}
            return speculation.summary(costs, chosen)
        assert self.loaded is not None
        return "; ".join(run_on_workers(self.loaded.workers, measure))

    def _compile_verify(self) -> str | None:
        """With --compile and speculative decoding: capture and compile each engine's verify steps in the decode
        buckets that speculate (up to its `speculative_max_bucket`, set by the measurement just before; every
        bucket it replays compiled in), greedy and sampled, with every row live and with padding (`compile_verify`),
        so none compiles while a request waits. An engine whose context cannot hold the steps says so and compiles
        them while serving."""
        if not self.compilers or not self.config.speculative_method:
            return None
        assert self.loaded is not None
        vocab = self.loaded.vocab_size

        def compile_one(w: EngineWorker) -> str:
            import gemma_engine

            report, top = w.engine.compile_report(), w.engine.speculative["speculative_max_bucket"]
            if not report["active"]:
                return "verify steps run eagerly (no step replays compiled)"
            buckets = [b for b in w.engine.buckets
                       if (top is None or b <= top) and b not in report["eager_buckets"]]
            compiler = self.compilers[w.index]
            before = len(compiler.compiled)
            try:
                compile_stage.compile_verify_steps(gemma_engine, w.engine, buckets, vocab)
            except ValueError as e:
                return f"verify steps compile while serving: {e}"
            return f"{len(compiler.compiled) - before} verify graphs compiled (decode buckets {buckets})"
        return "; ".join(run_on_workers(self.loaded.workers, compile_one))

    def publish_compile_cache(self) -> str | None:
        """After warmup and on drain: what this server compiled, to the shared cache (compile_cache.py); the
        outcome as a line, or None when torch_tpu's cache is not shared through a local one."""
        dirs = compile_cache_dirs(self.config)
        return compile_cache.publish_quietly(dirs[1], dirs[0]) if dirs else None


# torch.distributed's backend for the ranks' collectives: torch_tpu 0.2.0 registers "tpu" (`_loader.py`,
# `Backend.register_backend("tpu", ...)`) when it loads, which `import torch` does in every process, the spawned
# ranks' too, through the package's `torch.backends` entry point (`torch_tpu._loader:load`, autoloaded).
RANK_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "tpu": "tpu"}


def start_ranks(c: Config, model_dir: Path, emb_dir: Path | None, groups: list[list[str]], settings: dict[str, Any],
                grammars: bool, compilers: dict[int, Any]) -> list[Any]:
    """Every engine as `len(group)` ranks on its group's devices, a process each but the first, which is this one
    (gemma_engine.distributed.start): each engine's seat, whose `lead` makes rank 0's engine. The other ranks make
    theirs from a recipe: the same settings, the tokenizer's grammars when `grammars`, the compiler's backend and
    whether it donates.

    Raises:
        ValueError: a device with no torch.distributed backend here.
    """
    from gemma_engine.distributed import start

    backend = RANK_BACKENDS.get(c.device)
    if backend is None:
        raise ValueError(f"--tensor-parallel-size {c.tensor_parallel_size} on {c.device}: ranks run on "
                         f"{', '.join(RANK_BACKENDS)} here")
    vocab_size, eos = model_vocabulary(model_dir)
    recipes = [{"model_dir": str(model_dir), "emb_dir": str(emb_dir) if emb_dir else None, "devices": devices,
                "engine": settings, "compile_backend": compilers[g].backend_name if g in compilers else None,
                "compile_donate": compilers[g].donate if g in compilers else False,
                "grammars": (str(model_dir / "tokenizer.json"), eos, vocab_size) if grammars else None}
               for g, devices in enumerate(groups)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return start(recipes, f"tcp://127.0.0.1:{port}", backend)


def model_vocabulary(model_dir: Path) -> tuple[int, list[int]]:
    """(vocab_size, eos ids) of a checkpoint as the engine reads them (rust/src/gemma4/config.rs
    `Config::load`): config.json's own keys or its `text_config`'s, and generation_config.json's eos ids.

    Raises:
        ValueError, OSError: config.json is missing or lacks vocab_size.
    """
    root = json.loads((model_dir / "config.json").read_text())
    text = root.get("text_config") or root
    vocab_size = int(text["vocab_size"])
    eos: list[int] = []
    sources = [text.get("eos_token_id", root.get("eos_token_id"))]
    generation = model_dir / "generation_config.json"
    if generation.exists():
        sources.append(json.loads(generation.read_text()).get("eos_token_id"))
    for value in sources:
        for i in value if isinstance(value, list) else [] if value is None else [value]:
            if int(i) not in eos:
                eos.append(int(i))
    return vocab_size, eos


def build_grammars(gemma_engine, model_dir: Path) -> tuple[Any, str]:
    """The checkpoint's `gemma_engine.Grammars`, or (None, why not): a checkpoint whose tokenizer llguidance
    cannot read still serves, and its requests for structured outputs or forced tool calls get a 400 that
    says why."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return None, "the checkpoint has no tokenizer.json"
    try:
        vocab_size, eos = model_vocabulary(model_dir)
        return gemma_engine.Grammars(str(path), eos, vocab_size), ""
    except (ValueError, OSError, KeyError) as e:
        log.warning("no grammar-constrained sampling for this checkpoint: %s", e)
        return None, f"its tokenizer cannot constrain sampling ({' '.join(str(e).split())[:200]})"


def tpu_environment(config: Config) -> dict[str, str]:
    """The variables torch_tpu reads, as `config` asks for them; empty off TPU.

    - TORCH_TPU_DEFER_AND_FUSE: exactly "1" or "0". torch_tpu starts in defer-and-fuse only when the
      variable is "1" (`GetDefaultEagerMode` in torch_tpu's csrc/eager/eager_mode.cc), so "true" would be
      off; TORCH_TPU_LAUNCH_BLOCKING=1 wins over it (torch_tpu 0.2.0's `kTorchTpuLaunchBlockingEnvVar` in
      csrc/common/env_vars.h; the bare TPU_LAUNCH_BLOCKING of earlier builds is not read).
    - TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT: the persistent compilation cache (csrc/common/env_vars.h:
      "If not set, the tier-3 compilation cache is disabled"). torch_tpu keeps its entries under
      <root>/<fingerprint of torch_tpu's binary version and libtpu's PJRT version>/<key>.bin, so a
      different libtpu does not load them, and turns on its in-memory tier-2 cache
      (/dev/shm/torch_tpu_cache/default) with it (csrc/common/tier3_compilation_cache.cc,
      tier2_compilation_cache.cc). Left as the environment has it with `--tpu-compile-cache off`.
    """
    if config.device != "tpu":
        return {}
    env = {DEFER_AND_FUSE_VAR: "1" if config.tpu_defer_and_fuse else "0"}
    cache = config.tpu_compile_cache
    if cache is None:
        cache = str(Path(config.build_cache) / "tpu-compile")
    if cache != "off":
        env[TPU_COMPILE_CACHE_VAR] = config.tpu_compile_cache_local or cache
    return env


def compile_cache_dirs(config: Config) -> tuple[Path, Path] | None:
    """(shared, local) when torch_tpu's cache is shared by replicas through a local directory
    (gemma_server/compile_cache.py); None when torch_tpu writes its cache directly, or has none."""
    env = tpu_environment(config)
    if not config.tpu_compile_cache_local or TPU_COMPILE_CACHE_VAR not in env:
        return None
    shared = config.tpu_compile_cache or str(Path(config.build_cache) / "tpu-compile")
    return Path(shared), Path(config.tpu_compile_cache_local)


def eager_mode_name(torch) -> str:
    """torch_tpu's eager mode as it runs (`torch.tpu.eager_mode`, public in torch_tpu 0.2.0's
    _internal/public_api.py), e.g. "DEFER_AND_FUSE"; "unknown" where this torch_tpu has no such property."""
    try:
        mode = torch.tpu.eager_mode
    except (AttributeError, RuntimeError):
        return "unknown"
    return str(getattr(mode, "name", mode))


def run_on_workers(workers: list[EngineWorker], task: Callable[[EngineWorker], Any]) -> list[Any]:
    """Run `task(worker)` on every worker's own thread at once; the results in order, or the first error."""
    futures = [w.call(lambda w=w: task(w)) for w in workers]
    return [f.result() for f in futures]


def device_list(device: str, devices: str | None, torch) -> list[str]:
    """The torch device of each engine: `devices` engines (default: every chip on cuda and tpu, one on cpu).

    Raises:
        ValueError: more engines asked for than the machine has devices (naming both counts).
    """
    if device == "cpu":
        count = 1 if devices in (None, "all") else int(devices)
        return ["cpu"] * count
    available = torch.cuda.device_count() if device == "cuda" else _tpu_count(torch)
    count = available if devices in (None, "all") else int(devices)
    if count > available or count < 1:
        raise ValueError(f"--devices {devices} asks for {count} {device} devices; this machine has {available}")
    return [f"{device}:{i}" for i in range(count)]


def shard_groups(devices: list[str], tensor_parallel_size: int) -> list[list[str]]:
    """Each engine's shard devices: consecutive groups of `tensor_parallel_size` accelerator devices, or on
    the cpu that many shards of each engine on the cpu.

    Raises:
        ValueError: a group size that does not divide the devices (naming both).
    """
    n = tensor_parallel_size
    if devices and devices[0] == "cpu":
        return [["cpu"] * n for _ in devices]
    if n < 1 or len(devices) % n:
        raise ValueError(f"--tensor-parallel-size {n} does not divide the {len(devices)} devices; "
                         f"set --devices to a multiple of it")
    return [devices[i:i + n] for i in range(0, len(devices), n)]


def _tpu_count(torch) -> int:
    """Chips torch_tpu sees (it registers `torch.tpu` as PyTorch's other accelerator backends do)."""
    backend = getattr(torch, "tpu", None)
    if backend is None or not hasattr(backend, "device_count"):
        raise ValueError("torch_tpu did not register torch.tpu.device_count(); set --devices to the chip count")
    return int(backend.device_count())
