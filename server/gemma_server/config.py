"""Server settings: command-line flags, each with a matching environment variable.

A flag wins over its variable, the variable over the default (`--port` / `GEMMA_PORT`, ...). The operator
sets the variables in the pod spec; people use the flags. Each setting is declared once, as a field of
`Config` with its default, variable and help (llama-cpp-python's `server/settings.py` does the same with
pydantic settings), and the parser is generated from those declarations. `HF_TOKEN` is read from the
environment only, never from a flag, so it does not show in `ps` or in the pod's args.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

DEVICES = ("cpu", "cuda", "tpu")
DTYPES = ("bfloat16", "float32", "float16")


def default_cache_root(environ: Mapping[str, str]) -> Path:
    """`$GEMMA_CACHE` (set by the Makefile) or ~/.cache/gemma-rust-operator."""
    if environ.get("GEMMA_CACHE"):
        return Path(environ["GEMMA_CACHE"])
    return Path(environ.get("HOME", "/root")) / ".cache" / "gemma-rust-operator"


def default_engine_src() -> Path:
    """rust/ beside server/ in a checkout; the image copies the repository the same way."""
    return Path(__file__).resolve().parents[2] / "rust"


def setting(default, env: str, help: str, *, flag_type: Callable[[str], Any] | None = None,
            choices: tuple[str, ...] | None = None, minimum: float | None = None) -> Any:
    """Declare one setting: its default, environment variable and help, in one place.

    Args:
        default: the value when neither the flag nor the variable is given (a callable: computed from the
            environment, e.g. a cache path).
        env: the environment variable the operator sets in the pod spec.
        help: one line for --help.
        flag_type: how the flag's text becomes a value (default: the default's type; bool is a switch).
        choices: the allowed values.
        minimum: the least allowed value, checked after parsing.
    """
    meta = {"env": env, "help": help, "type": flag_type, "choices": choices, "minimum": minimum}
    if callable(default):
        return field(default=None, metadata={**meta, "computed": default})
    return field(default=default, metadata=meta)


def _cache_default(leaf: str) -> Callable[[Mapping[str, str]], str]:
    return lambda environ: str(default_cache_root(environ) / leaf)


# The words an on/off setting takes, in its flag or its variable; anything else is a usage error naming both.
SWITCH_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def parse_switch(text: str) -> bool:
    """The text of an on/off setting: the one parser of every boolean flag's value and variable.

    Raises:
        argparse.ArgumentTypeError: the text is none of SWITCH_WORDS (so `GEMMA_PACKED_INT4=maybe` stops the
            start instead of reading as off).
    """
    value = SWITCH_WORDS.get(text.strip().lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"must be 1 or 0 (true/false, yes/no, on/off), got {text!r}")
    return value


def _devices(text: str) -> str:
    if text != "all" and not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"must be 'all' or a count >= 1, got {text!r}")
    return text


@dataclass(frozen=True)
class Config:
    """Everything `python -m gemma_server` was told. Each field is one setting: `--field-name` and its
    environment variable; `build_parser` is generated from these declarations."""

    model: str = setting(None, "GEMMA_MODEL", "checkpoint: a local directory, hf://org/repo[@revision] or "
                         "gs://bucket/path (GCS FUSE, mounted at <gcs-root>/<bucket>); required", flag_type=str)
    emb: str | None = setting(None, "GEMMA_EMB", "optional int4 embedding twin, same source forms as --model",
                              flag_type=str)
    device: str = setting("cpu", "GEMMA_DEVICE", "cpu, cuda or tpu (tpu imports torch_tpu first)", choices=DEVICES)
    devices: str | None = setting(None, "GEMMA_DEVICES", "engines to run, one per device: a count or 'all' "
                                  "(default: all on cuda and tpu, 1 on cpu)", flag_type=_devices)
    tensor_parallel_size: int = setting(1, "GEMMA_TENSOR_PARALLEL_SIZE", "devices each engine is split over "
                                        "(tensor parallelism: heads, MLP and expert features, vocabulary), a "
                                        "process per device, this one each engine's rank 0 (gloo on cpu, NCCL "
                                        "on cuda); --devices D runs D / N engines (on cpu, D engines of N ranks)",
                                        minimum=1)
    context: int = setting(8192, "GEMMA_CONTEXT", "most tokens (prompt + generated) per request", minimum=1)
    max_num_seqs: int = setting(8, "GEMMA_MAX_NUM_SEQS", "sequence slots per engine: requests decoded together "
                                "in one batch", minimum=1)
    read_every: int = setting(1, "GEMMA_READ_EVERY", "tokens come back to the host every N decode steps", minimum=1)
    dtype: str = setting("bfloat16", "GEMMA_DTYPE", "compute dtype", choices=DTYPES)
    prefill_chunk: int = setting(256, "GEMMA_PREFILL_CHUNK", "prompt tokens read per forward (one chunk per "
                                 "step, between the running requests' decode steps)", minimum=1)
    enable_prefix_caching: bool = setting(True, "GEMMA_ENABLE_PREFIX_CACHING", "reuse the KV cache of earlier "
                                          "requests: a finished request's slot keeps what it wrote, and a new "
                                          "request that starts with those tokens (same cache_salt) reads only "
                                          "the rest of its prompt (vLLM's flag; --no-enable-prefix-caching reads "
                                          "every prompt whole)")
    packed_int4: bool = setting(True, "GEMMA_PACKED_INT4", "keep a W4A16 checkpoint's int4 linears packed on "
                                "the device for ATen's int4 kernels where they run (--dtype bfloat16 on cpu or "
                                "cuda; a third of the bytes, faster decode; elsewhere they are dequantized, and "
                                "/v1/engine's weights.int4 says which); --no-packed-int4 dequantizes them at "
                                "load, as Transformers does (tokens differ slightly between the two)")
    cuda_graphs: bool = setting(True, "GEMMA_CUDA_GRAPHS", "on cuda: capture each decode-step shape as a CUDA "
                                "graph and replay it, 1 or 0 (needs an engine built with CUDA headers)",
                                flag_type=parse_switch)
    onednn: str = setting("auto", "GEMMA_ONEDNN", "multiply dense weights with oneDNN, packed once at load (auto: "
                          "on the cpu in float32, and in bfloat16 where oneDNN computes bfloat16 on this cpu, "
                          "where it is much faster than ATen's matmul for a decode step's few rows; /v1/engine's "
                          "linear_note says why not; on: require it; off: ATen's matmul)", choices=("auto", "on", "off"))
    compile: str = setting("off", "GEMMA_COMPILE", "record each decode-step shape at the dispatcher and compile it "
                           "(Inductor on cuda and the cpu, over oneDNN's packed weights where --onednn packs them; "
                           "torch_tpu's tpu backend on a tpu): on: replay the compiled "
                           "steps; auto: compile, time both at boot and keep the faster (/v1/engine's compile says "
                           "which); off: eager ATen calls", choices=("off", "on", "auto"))
    speculative_method: str | None = setting(None, "GEMMA_SPECULATIVE_METHOD", "speculative decoding: ngram "
                                             "(prompt lookup: drafts copied from what followed the context's last "
                                             "n-gram earlier in it) or mtp (Gemma 4's assistant drafter, "
                                             "--speculative-model), checked in one forward; greedy output "
                                             "unchanged; needs --num-speculative-tokens", choices=("ngram", "mtp"),
                                             flag_type=str)
    speculative_model: str | None = setting(None, "GEMMA_SPECULATIVE_MODEL", "the assistant drafter of "
                                            "--speculative-method mtp (Gemma4AssistantForCausalLM, e.g. "
                                            "google/gemma-4-e2b-it-assistant): a local directory, hf://, gs:// or "
                                            "pvc:// as --model", flag_type=str)
    num_speculative_tokens: int | None = setting(None, "GEMMA_NUM_SPECULATIVE_TOKENS", "draft tokens per "
                                                 "request and step (1..16)", flag_type=int, minimum=1)
    speculative_max_batch: int | None = setting(None, "GEMMA_SPECULATIVE_MAX_BATCH", "above this many decoding "
                                                "requests an engine's steps do not speculate (default: no such "
                                                "limit; the warmup measures each decode bucket and speculates up to "
                                                "the largest where a verify step takes less than the tokens it gives "
                                                "at 0.6 of drafts kept; /v1/engine shows the costs)", flag_type=int,
                                                minimum=1)
    prompt_lookup_min: int = setting(1, "GEMMA_PROMPT_LOOKUP_MIN", "shortest n-gram --speculative-method ngram "
                                     "looks up", minimum=1)
    prompt_lookup_max: int = setting(4, "GEMMA_PROMPT_LOOKUP_MAX", "longest n-gram --speculative-method ngram "
                                     "looks up", minimum=1)
    default_temperature: float = setting(1.0, "GEMMA_DEFAULT_TEMPERATURE", "temperature of a request that sets "
                                         "none (OpenAI's default is 1; 0 makes such requests greedy)", minimum=0)
    served_model_name: str | None = setting(None, "GEMMA_SERVED_MODEL_NAME", "the model id clients send "
                                            "(default: from --model)", flag_type=str)
    host: str = setting("0.0.0.0", "GEMMA_HOST", "listen address")
    port: int = setting(8000, "GEMMA_PORT", "listen port", minimum=1)
    probe_port: int | None = setting(None, "GEMMA_PROBE_PORT", "a second listen port that serves only /live, "
                                     "/health and /ping, on a thread and event loop of its own, so no load on the "
                                     "API reaches the kubelet's probes (the operator sets it; default: none)",
                                     flag_type=int)
    max_body_bytes: int = setting(4 * 1024 * 1024, "GEMMA_MAX_BODY_BYTES", "largest request body; a larger one is "
                                  "a 413 before it is parsed", minimum=1)
    header_read_timeout: float = setting(5.0, "GEMMA_HEADER_READ_TIMEOUT", "seconds a client has to send a "
                                         "request's headers after it connects or its previous reply ends; then "
                                         "the connection is closed (slowloris)", minimum=0.1)
    request_read_timeout: float = setting(20.0, "GEMMA_REQUEST_READ_TIMEOUT", "seconds a client has to send a "
                                          "whole request (headers and body) after it connects or its previous "
                                          "reply ends; then the connection is closed", minimum=0.5)
    max_connections: int = setting(2048, "GEMMA_MAX_CONNECTIONS", "open connections in all; a new one past it is "
                                   "closed as it opens", minimum=1)
    max_connections_per_client: int = setting(64, "GEMMA_MAX_CONNECTIONS_PER_CLIENT", "open connections from one "
                                              "client address; a new one past it is closed as it opens (behind a "
                                              "proxy, raise it: every client has the proxy's address)", minimum=1)
    max_concurrent_requests: int = setting(512, "GEMMA_MAX_CONCURRENT_REQUESTS", "requests in flight (probes "
                                           "not counted) at which a new request gets a 503", minimum=1)
    max_requests_per_client: int = setting(0, "GEMMA_MAX_REQUESTS_PER_CLIENT", "choices (a request's n) one "
                                           "client address may have queued or running; more get 429 (0: half of "
                                           "the engines' slots and the queue, at least 16)", minimum=0)
    stream_stall_timeout: float = setting(30.0, "GEMMA_STREAM_STALL_TIMEOUT", "seconds a client may leave its "
                                          "reply unread once 256 KiB of it wait; then the request is aborted and "
                                          "its slot freed (gemma_stalled_replies_total)", minimum=0.1)
    queue_limit: int = setting(64, "GEMMA_QUEUE_LIMIT", "requests admitted but not yet in an engine's slot; more "
                               "get 429", minimum=1)
    shutdown_timeout: float = setting(30.0, "GEMMA_SHUTDOWN_TIMEOUT", "seconds queued and running requests get "
                                      "to finish after SIGTERM", minimum=0)
    api_key: str | None = setting(None, "GEMMA_API_KEY", "when set, every /v1 route needs `Authorization: Bearer "
                                  "<key>` (prefer the variable: a flag shows in ps)", flag_type=str)
    max_images_per_request: int = setting(8, "GEMMA_MAX_IMAGES_PER_REQUEST", "images one request may hold (chat "
                                          "image_url parts, Responses input_image); more are a 400", minimum=0)
    max_image_pixels: int = setting(4096 * 4096, "GEMMA_MAX_IMAGE_PIXELS", "width x height of the largest image "
                                    "decoded (read from its header first); larger is a 400", minimum=1)
    max_audio_seconds: float = setting(300.0, "GEMMA_MAX_AUDIO_SECONDS", "seconds of audio one request may hold, "
                                       "every clip together (read from the file's header first); more is a 400. "
                                       "A chat clip is read for at most 30 s (the model's clip); a transcription "
                                       "is read 30 s at a time", minimum=0)
    max_media_bytes: int = setting(4 * 1024 * 1024, "GEMMA_MAX_MEDIA_BYTES", "bytes of one image or audio file as "
                                   "sent (decoded from base64, uploaded or fetched); larger is a 400 (inline media "
                                   "also count against --max-body-bytes)", minimum=1)
    media_fetch_hosts: str = setting("", "GEMMA_MEDIA_FETCH_HOSTS", "comma-separated host names whose http(s) image "
                                     "URLs the server fetches (exact names, any port; redirects are not followed); "
                                     "empty: image_url takes data URLs only", flag_type=str)
    media_fetch_timeout: float = setting(10.0, "GEMMA_MEDIA_FETCH_TIMEOUT", "seconds to fetch one image URL, "
                                         "connection to last byte", minimum=0.1)
    max_media_decoded_bytes: int = setting(256 * 1024 * 1024, "GEMMA_MAX_MEDIA_DECODED_BYTES", "bytes one "
                                           "request's images and audio may decode to, every part together: an "
                                           "image 4 a pixel (RGB), audio 4 a sample of each channel, read from "
                                           "each file's header before it is decoded; more is a 400", minimum=1)
    max_jpeg_scans: int = setting(100, "GEMMA_MAX_JPEG_SCANS", "scans one JPEG may hold, counted from its markers "
                                  "before it is decoded (each progressive scan is a pass over the whole image; "
                                  "encoders write at most 18); more is a 400", minimum=1)
    media_workers: int = setting(2, "GEMMA_MEDIA_WORKERS", "processes that decode images and audio; a request "
                                 "holds one while its media are decoded, pre-processed and encoded, and others "
                                 "wait for one", minimum=1)
    media_decode_timeout: float = setting(10.0, "GEMMA_MEDIA_DECODE_TIMEOUT", "seconds, of wall clock and of CPU, "
                                          "that decoding one image or audio file may take; past it the worker is "
                                          "killed and replaced, and the request is a 400", minimum=0.1)
    media_worker_memory: int = setting(1024 * 1024 * 1024, "GEMMA_MEDIA_WORKER_MEMORY", "bytes a media worker may "
                                       "allocate beyond its libraries (its RLIMIT_AS); a file that needs more to "
                                       "decode is a 400", minimum=64 * 1024 * 1024)
    responses_store_max_count: int = setting(1000, "GEMMA_RESPONSES_STORE_MAX_COUNT", "most /v1/responses "
                                             "responses kept for previous_response_id and GET, all API keys "
                                             "together; past it, the key that holds the most loses its oldest "
                                             "(0 keeps none)", minimum=0)
    responses_store_max_bytes: int = setting(64 * 1024 * 1024, "GEMMA_RESPONSES_STORE_MAX_BYTES", "most bytes "
                                             "of memory the stored responses and their conversations take, all "
                                             "API keys together; past it, the key that holds the most loses its "
                                             "oldest", minimum=0)
    responses_store_max_count_per_key: int = setting(
        250, "GEMMA_RESPONSES_STORE_MAX_COUNT_PER_KEY", "most stored responses of one API key (the request's bearer "
        "token); past it, that key's oldest goes, so one client's stores evict only its own. Without --api-key "
        "every bearer token is a key of its own, and a client may send many, so this bounds a token, not a "
        "client; with --api-key every client shares the one key, so this is the whole store's cap", minimum=0)
    responses_store_max_bytes_per_key: int = setting(
        16 * 1024 * 1024, "GEMMA_RESPONSES_STORE_MAX_BYTES_PER_KEY", "most bytes of memory the stored responses "
        "of one API key take (as --responses-store-max-count-per-key)", minimum=0)
    responses_store_max_age: float = setting(3600.0, "GEMMA_RESPONSES_STORE_MAX_AGE", "seconds a stored "
                                             "response is kept", minimum=0)
    enable_mcp: bool = setting(True, "GEMMA_ENABLE_MCP", "serve the Model Context Protocol at /mcp (streamable "
                               "HTTP, stateless; tools ask, stream, engine_info, endpoint_status, serving_metrics)")
    mcp_allowed_hosts: str = setting("localhost,127.0.0.1,[::1]", "GEMMA_MCP_ALLOWED_HOSTS", "comma-separated "
                                     "Host header names /mcp answers, each with any port (DNS-rebinding "
                                     "protection; the operator adds the Service's in-cluster names)", flag_type=str)
    metrics_need_key: bool = setting(False, "GEMMA_METRICS_NEED_KEY", "with --api-key, /metrics needs the key "
                                     "too (the scraper then sends it as a bearer token)")
    expose_paths: bool = setting(False, "GEMMA_EXPOSE_PATHS", "show filesystem paths (checkpoint directory, "
                                 "engine module, TPU compile cache) in /v1/models and /v1/engine, for debugging")
    build_cache: str = setting(_cache_default("engine-builds"), "GEMMA_BUILD_CACHE", "directory of engine builds "
                               "keyed by source hash, torch and python; mount a volume here so a restart skips "
                               "the compile", flag_type=str)
    engine_src: str = setting(lambda environ: str(default_engine_src()), "GEMMA_ENGINE_SRC",
                              "the engine crate (rust/) to build", flag_type=str)
    use_installed_engine: bool = setting(False, "GEMMA_USE_INSTALLED_ENGINE", "skip the build stage and import "
                                         "the gemma_engine already installed (development)")
    termination_log: str = setting("/dev/termination-log", "GEMMA_TERMINATION_LOG", "file that gets a one-line "
                                   "reason when a boot stage fails")
    gcs_root: str = setting("/gcs", "GEMMA_GCS_ROOT", "where GCS FUSE buckets are mounted: gs://B/P is read at "
                            "<gcs-root>/B/P")
    mount_timeout: float = setting(300.0, "GEMMA_MOUNT_TIMEOUT", "seconds to wait for a gs:// checkpoint to "
                                   "appear under its mount", minimum=0)
    # The two TPU settings become torch_tpu's own variables before torch is imported (boot.tpu_environment).
    tpu_defer_and_fuse: bool = setting(True, "TORCH_TPU_DEFER_AND_FUSE", "on tpu: torch_tpu's defer-and-fuse "
                                       "eager mode (queued ATen ops compiled into fused XLA programs), 1 or 0; "
                                       "the boot writes exactly 1 or 0 to the variable, since torch_tpu turns "
                                       "the mode on only for '1' (torch_tpu csrc/eager/eager_mode.cc)",
                                       flag_type=parse_switch)
    tpu_compile_cache: str | None = setting(None, "GEMMA_TPU_COMPILE_CACHE", "on tpu: directory of torch_tpu's "
                                            "persistent compilation cache, written to "
                                            "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT (torch_tpu csrc/common/"
                                            "env_vars.h), so a restart loads the compiled programs instead of "
                                            "compiling them again; 'off' leaves that variable as it is "
                                            "(default: <build-cache>/tpu-compile)", flag_type=str)
    tpu_compile_cache_local: str | None = setting(
        None, "GEMMA_TPU_COMPILE_CACHE_LOCAL", "on tpu: a directory of this server alone for torch_tpu's cache; "
        "then --tpu-compile-cache is shared by replicas without their writing it at once: its entries are copied "
        "here before torch_tpu starts, and this server's new ones are copied there after warmup and on drain, "
        "each renamed into place (gemma_server/compile_cache.py). Unset: torch_tpu writes --tpu-compile-cache "
        "itself, right for a cache one server owns", flag_type=str)
    log_level: str = setting("info", "GEMMA_LOG_LEVEL", "log level", choices=("debug", "info", "warning", "error"))

    @property
    def mcp_hosts(self) -> list[str]:
        """--mcp-allowed-hosts as a list of names."""
        return [h.strip() for h in self.mcp_allowed_hosts.split(",") if h.strip()]

    @property
    def fetch_hosts(self) -> frozenset[str]:
        """--media-fetch-hosts as a set of lower-case names (empty: no URL is fetched)."""
        return frozenset(h.strip().lower() for h in self.media_fetch_hosts.split(",") if h.strip())

    @property
    def shown_source(self) -> str | None:
        """The checkpoint source as /v1/models (`root`), /v1/engine (`model`) and the weights stage's message
        show it: an hf:// or gs:// name always, a local directory only with --expose-paths."""
        return self.model if self.expose_paths or "://" in self.model else None

    @property
    def model_name(self) -> str:
        """The id clients send as `model`: the served name, else the model source's last part."""
        if self.served_model_name:
            return self.served_model_name
        src = self.model.rstrip("/")
        if src.startswith("hf://"):
            return src[len("hf://") :].split("@", 1)[0]
        return src.rsplit("/", 1)[-1] or src


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """The flag parser, generated from Config's declarations; defaults come from `environ`."""
    p = argparse.ArgumentParser(
        prog="python -m gemma_server",
        description="OpenAI-compatible server over the gemma_engine Rust engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in fields(Config):
        meta = f.metadata
        flag = "--" + f.name.replace("_", "-")
        computed = meta.get("computed")
        default = computed(environ) if computed else f.default
        kind = meta["type"] or type(default)
        help_text = f"{meta['help']} [{meta['env']}]"
        text = environ.get(meta["env"])
        if kind is bool:  # a switch: the bare flag turns it on, --no-<flag> off (vLLM's boolean flags)
            on = _from_environment(p, meta["env"], text, parse_switch) if text is not None else default
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=on, help=help_text)
            continue
        p.add_argument(flag, type=kind, choices=meta["choices"], help=help_text,
                       default=_from_environment(p, meta["env"], text, kind) if text is not None else default)
    return p


def _from_environment(parser: argparse.ArgumentParser, env: str, text: str, kind: Callable[[str], Any]) -> Any:
    """A variable's text as its setting's value; text that does not convert is a usage error naming it."""
    try:
        return kind(text)
    except (ValueError, argparse.ArgumentTypeError) as e:
        parser.error(f"{env}={text!r}: {e}")


def parse_config(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Config:
    """Flags and environment -> Config.

    Args:
        argv: the arguments after the program name.
        environ: the environment (default: os.environ).
    Returns:
        the Config.
    Raises:
        SystemExit: argparse's exit (status 2) on a bad flag or a missing model, naming it.
    """
    environ = os.environ if environ is None else environ
    parser = build_parser(environ)
    try:
        ns = parser.parse_args(list(argv))
    except ValueError as e:  # a variable whose text does not convert
        parser.error(str(e))
    if not ns.model:
        parser.error("--model (or GEMMA_MODEL) is required")
    for f in fields(Config):
        low = f.metadata.get("minimum")
        value = getattr(ns, f.name)
        if low is not None and value is not None and value < low:
            parser.error(f"--{f.name.replace('_', '-')} must be at least {low:g}, got {value}")
    return Config(**vars(ns))
