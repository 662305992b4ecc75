"""Every Prometheus metric the server exports, in one place.

Names, types, meanings and buckets are vLLM's (`vllm/v1/metrics/loggers.py` `PrometheusStatLogger`,
`docs/design/metrics.md`) with `vllm:` replaced by `gemma_`, so a vLLM dashboard ports by renaming. As in
vLLM, every interval comes from one process's monotonic clock:

- TTFT: request arrival at the HTTP front end -> first token back on the host (includes queue and prompt
  read);
- queue: admitted -> the engine thread starts the decode; prefill: start -> first token;
  decode: first token -> last token; e2e: arrival -> finish;
- inter-token latency: gap between successive token arrivals. With `--read-every N` tokens arrive in
  batches, so each batch's gap is split evenly over its tokens (one observation per token), keeping the
  count at tokens-1 and the sum at the decode time, as vLLM's per-step observations do;
- time per output token: decode time / (generated tokens - 1), observed once per request at finish.

Label `model_name` on every metric (vLLM's `engine` label is dropped: the engines of one process, one per
device, are summed). `gemma_num_requests_running` counts the engines' occupied sequence slots,
`gemma_kv_cache_usage_perc` is occupied / total slots (each slot reserves its whole KV ring, so a slot is
the unit of KV capacity: rust/src/gemma4/cache.rs), and `gemma_iteration_tokens_total` observes the rows
of every decode step, as vLLM's observes the tokens of every engine step. Ours besides vLLM's:
`gemma_engine_step_seconds` (wall time of one decode turn), `gemma_prompt_tokens_read` (the prompt tokens
the engines read: below `gemma_prompt_tokens` when the `n` choices of a request share their prompt),
`gemma_boot_stage_seconds{stage}`,
`gemma_engine_ready`, `gemma_build_info`, `gemma_stalled_replies_total` (replies aborted because their client
stopped reading: connections.py), `gemma_tool_call_parse_failures_total` (tool calls of an unconstrained
reply that did not parse and came back as content), `gemma_grammar_compile_seconds` (the check of a
request's grammar before it is queued), `gemma_media_inputs_total{modality}` (images and audio clips encoded
into soft tokens), `gemma_media_encode_seconds{modality}` (one call of a tower, for all of one request's
images or clips) and `gemma_compile_fallbacks_total` (decode-step shapes whose capture or compile failed
under --compile, which then run eagerly; the log says why).

Prefix caching, as vLLM exports it (`vllm/v1/metrics/loggers.py`): `gemma_prefix_cache_queries_total` and
`gemma_prefix_cache_hits_total` count tokens (the prompt tokens of the requests the engines admitted, and
the part of them taken from the cache; the hit rate is the ratio of their rates), from the engines' own step
statistics; `gemma_cache_config_info` is vLLM's `vllm:cache_config_info`, an info gauge whose labels an
endpoint picker reads to size its prefix index (gateway-api-inference-extension
pkg/epp/datalayer/metrics/extractor.go: `block_size` and `num_gpu_blocks`).
`_created` series are off, as in vLLM.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client import gc_collector, platform_collector, process_collector

disable_created_metrics()

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISHED_REASONS = ("stop", "length", "abort", "error")
STAGES = ("build", "import", "smoke", "weights", "compile", "warmup", "serving")
MODALITIES = ("image", "audio")
# gemma_cache_config_info's labels besides model_name: the ones endpoint pickers read from vLLM's
# vllm:cache_config_info, with vLLM's spelling of their values (Python's str(): "True", "None").
CACHE_CONFIG_LABELS = ("block_size", "num_gpu_blocks", "enable_prefix_caching", "sliding_window")


def cache_config(*, slots: int, context: int, prefill_chunk: int, prefix_caching: bool,
                 sliding_window: int | None) -> dict[str, str]:
    """gemma_cache_config_info's labels for engines of `slots` sequence slots in all.

    Our engine has no KV blocks: each slot holds a whole context of ring KV cache, and a prefix hit is
    exact to the token. `block_size` is the prefill chunk, the unit of work a hit saves (the rest of a
    prompt is read one chunk per forward, so a hit shortens a read by whole forwards, and a hit of fewer
    tokens than a chunk saves little), and it is what a picker that hashes prompts in blocks of block_size
    x 4 characters (the inference extension's prefix scorer with autoTune) needs to cover a whole context
    with its default of 256 blocks; a block size of 1 token would make it match only the first 1,024
    characters. `num_gpu_blocks` is then the KV the engines hold in those units: slots x context /
    block_size, so block_size x num_gpu_blocks is the tokens of KV, as in vLLM.

    Args:
        slots: sequence slots of all the engines.
        context: tokens each slot holds.
        prefill_chunk: the engines' prefill chunk (capped at the context).
        prefix_caching: whether the engines reuse prefixes (their `layout()["prefix_caching"]`).
        sliding_window: the model's sliding window, None without one.
    """
    block = max(1, min(prefill_chunk, context))
    return {"block_size": str(block), "num_gpu_blocks": str(slots * context // block),
            "enable_prefix_caching": str(bool(prefix_caching)), "sliding_window": str(sliding_window)}


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's `build_1_2_5_buckets`)."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


class Metrics:
    """The server's registry and its metrics, each already bound to `model_name`.

    Args:
        model_name: the served model name (label on every metric).
        max_model_len: the context; sets the token-count histograms' buckets.
    """

    def __init__(self, model_name: str, max_model_len: int, speculative_tokens: int = 0) -> None:
        self.registry = r = CollectorRegistry()
        process_collector.ProcessCollector(registry=r)
        platform_collector.PlatformCollector(registry=r)
        gc_collector.GCCollector(registry=r)
        labels = ["model_name"]
        m = model_name
        self.model_name = model_name

        self.num_requests_running = Gauge(
            "gemma_num_requests_running", "Number of requests in model execution batches.", labels, registry=r
        ).labels(m)
        self.num_requests_waiting = Gauge(
            "gemma_num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=r
        ).labels(m)
        self.kv_cache_usage_perc = Gauge(
            "gemma_kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=r
        ).labels(m)
        self.iteration_tokens = Histogram(
            "gemma_iteration_tokens_total", "Histogram of number of tokens per engine_step.", labels,
            buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192], registry=r,
        ).labels(m)
        self.prompt_tokens = Counter(
            "gemma_prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        ).labels(m)
        self.prompt_tokens_read = Counter(
            "gemma_prompt_tokens_read", "Prompt tokens the engines read (a prompt several choices share is read once).",
            labels, registry=r,
        ).labels(m)
        self.generation_tokens = Counter(
            "gemma_generation_tokens", "Number of generation tokens processed.", labels, registry=r
        ).labels(m)
        self.stalled_replies = Counter(
            "gemma_stalled_replies", "Replies aborted because the client stopped reading them "
            "(--stream-stall-timeout); each freed its request's slot.", labels, registry=r,
        ).labels(m)
        self.tool_call_parse_failures = Counter(
            "gemma_tool_call_parse_failures", "Tool calls (tool_choice auto) that did not parse as Gemma 4's call "
            "syntax; their text came back as content.", labels, registry=r,
        ).labels(m)
        self.grammar_compile_seconds = Histogram(
            "gemma_grammar_compile_seconds", "Seconds to compile a request's grammar (structured outputs, forced "
            "tool calls) before it is queued.", labels,
            buckets=[0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0], registry=r,
        ).labels(m)
        media_inputs = Counter(
            "gemma_media_inputs", "Images and audio clips encoded into soft tokens.", labels + ["modality"],
            registry=r,
        )
        encode_seconds = Histogram(
            "gemma_media_encode_seconds", "Seconds of one tower call (one request's images, or its clips).",
            labels + ["modality"], buckets=[0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0],
            registry=r,
        )
        self.media_inputs = {k: media_inputs.labels(m, k) for k in MODALITIES}
        self.media_encode_seconds = {k: encode_seconds.labels(m, k) for k in MODALITIES}
        success = Counter(
            "gemma_request_success", "Count of successfully processed requests.", labels + ["finished_reason"],
            registry=r,
        )
        # One series per reason, pre-created at 0 (vLLM does the same so rate() works from the start).
        self.request_success = {reason: success.labels(m, reason) for reason in FINISHED_REASONS}
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = Histogram(
            "gemma_request_prompt_tokens", "Number of prefill tokens processed.", labels,
            buckets=token_buckets, registry=r,
        ).labels(m)
        self.request_generation_tokens = Histogram(
            "gemma_request_generation_tokens", "Number of generation tokens processed.", labels,
            buckets=token_buckets, registry=r,
        ).labels(m)
        self.time_to_first_token = Histogram(
            "gemma_time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels,
            buckets=TTFT_BUCKETS, registry=r,
        ).labels(m)
        self.inter_token_latency = Histogram(
            "gemma_inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", labels,
            buckets=ITL_BUCKETS, registry=r,
        ).labels(m)
        self.request_time_per_output_token = Histogram(
            "gemma_request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", labels, buckets=ITL_BUCKETS, registry=r,
        ).labels(m)
        latency = lambda name, doc: Histogram(  # noqa: E731
            name, doc, labels, buckets=REQUEST_LATENCY_BUCKETS, registry=r
        ).labels(m)
        self.e2e_request_latency = latency(
            "gemma_e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."
        )
        self.request_queue_time = latency(
            "gemma_request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."
        )
        self.request_prefill_time = latency(
            "gemma_request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."
        )
        self.request_decode_time = latency(
            "gemma_request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."
        )

        # Ours.
        stage_seconds = Gauge(
            "gemma_boot_stage_seconds", "Seconds each boot stage took (0 until it ends).", labels + ["stage"],
            registry=r,
        )
        self.boot_stage_seconds = {s: stage_seconds.labels(m, s) for s in STAGES}
        self.engine_step_seconds = Histogram(
            "gemma_engine_step_seconds", "Wall seconds of one engine turn (a decode step and at most one prompt "
            "chunk).", labels, buckets=[0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0],
            registry=r,
        ).labels(m)
        self.compile_fallbacks = Counter(
            "gemma_compile_fallbacks", "Decode-step shapes whose capture or compile failed (--compile): they run "
            "eagerly; or, on CUDA, whose compiled step's CUDA graph failed: replayed without one. The log names "
            "each with its reason.", labels, registry=r,
        ).labels(m)
        self.engine_ready = Gauge(
            "gemma_engine_ready", "1 when the engine has warmed up and serves; 0 while booting, draining or dead.",
            labels, registry=r,
        ).labels(m)
        self._build_info = Gauge(
            "gemma_build_info", "What built the engine (value is always 1).",
            labels + ["torch", "torch_tpu", "rustc", "python", "crate", "device"], registry=r,
        )
        self.prefix_cache_queries = Counter(
            "gemma_prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", labels,
            registry=r,
        ).labels(m)
        self.prefix_cache_hits = Counter(
            "gemma_prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels, registry=r,
        ).labels(m)
        # vLLM's spec_decode counters (vllm/v1/spec_decode/metrics.py), from the engines' step stats.
        self.spec_decode_drafts = Counter(
            "gemma_spec_decode_num_drafts", "Requests' speculative steps that had drafts.", labels, registry=r,
        ).labels(m)
        self.spec_decode_draft_tokens = Counter(
            "gemma_spec_decode_num_draft_tokens", "Draft tokens offered.", labels, registry=r,
        ).labels(m)
        self.spec_decode_accepted_tokens = Counter(
            "gemma_spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels, registry=r,
        ).labels(m)
        self.spec_decode_accepted_per_pos = Counter(
            "gemma_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each position of a request's "
            "drafts (0: the first).", labels + ["position"], registry=r,
        )
        # Every position from the start, at 0, as vLLM creates its per-position counters (SpecDecodingProm).
        for position in range(speculative_tokens):
            self.spec_decode_accepted_per_pos.labels(m, str(position))
        self._cache_config_info = Gauge(
            "gemma_cache_config_info", "Information of the engines' KV cache (value is always 1).",
            labels + list(CACHE_CONFIG_LABELS), registry=r,
        )

    def set_build_info(self, *, torch: str, torch_tpu: str, rustc: str, python: str, crate: str, device: str) -> None:
        """Publish the build info series (once, after the import stage)."""
        self._build_info.labels(self.model_name, torch, torch_tpu, rustc, python, crate, device).set(1)

    def set_cache_config(self, config: dict[str, str]) -> None:
        """Publish the cache config series (once, when the engines are loaded): `cache_config(...)`'s labels."""
        self._cache_config_info.labels(self.model_name, *(config[k] for k in CACHE_CONFIG_LABELS)).set(1)

    def record_request(
        self,
        *,
        finished_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        arrival: float,
        started: float | None,
        first_token: float | None,
        last_token: float | None,
        finished: float,
    ) -> None:
        """Record one finished request (all times from time.monotonic()).

        Args:
            finished_reason: stop, length, abort or error.
            started: when the engine thread began the decode (None if it never did).
            first_token / last_token: arrival on the host of the first / last generated token.
        """
        self.request_success[finished_reason].inc()
        self.e2e_request_latency.observe(finished - arrival)
        if started is None:
            return
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.request_queue_time.observe(started - arrival)
        if first_token is not None:
            self.time_to_first_token.observe(first_token - arrival)
            self.request_prefill_time.observe(first_token - started)
            decode = (last_token or first_token) - first_token
            self.request_decode_time.observe(decode)
            if generation_tokens > 1:
                self.request_time_per_output_token.observe(decode / (generation_tokens - 1))

    def observe_compile_fallback(self, step: str, reason: str) -> None:
        """A decode-step shape that runs eagerly although --compile is on."""
        self.compile_fallbacks.inc()

    def observe_encoded(self, modality: str, items: int, seconds: float) -> None:
        """One tower call: `items` images or clips of `modality` encoded in `seconds`."""
        self.media_inputs[modality].inc(items)
        self.media_encode_seconds[modality].observe(seconds)

    def observe_steps(self, stats: dict) -> None:
        """An engine's turns since its last read point: rows per decode step, prompt tokens, wall seconds."""
        sizes = stats.get("batch_sizes") or []
        self.prompt_tokens_read.inc(stats.get("prompt_tokens", 0))
        self.prefix_cache_queries.inc(stats.get("cache_queries", 0))
        self.prefix_cache_hits.inc(stats.get("cache_hits", 0))
        self.spec_decode_drafts.inc(stats.get("spec_drafts", 0))
        self.spec_decode_draft_tokens.inc(stats.get("spec_draft_tokens", 0))
        self.spec_decode_accepted_tokens.inc(stats.get("spec_accepted_tokens", 0))
        for position, n in enumerate(stats.get("spec_accepted_per_position") or []):
            self.spec_decode_accepted_per_pos.labels(self.model_name, str(position)).inc(n)
        for rows in sizes:
            self.iteration_tokens.observe(rows)
        turns = max(len(sizes), 1)
        for _ in range(turns):
            self.engine_step_seconds.observe(stats.get("seconds", 0.0) / turns)

    def observe_token_gap(self, gap: float, n_tokens: int) -> None:
        """A batch of n tokens arrived `gap` seconds after the previous one."""
        for _ in range(n_tokens):
            self.inter_token_latency.observe(gap / n_tokens)

    def exposition(self) -> bytes:
        """The text format for GET /metrics."""
        return generate_latest(self.registry)
