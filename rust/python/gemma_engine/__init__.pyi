"""Type stub for `gemma_engine`, the Rust Gemma 4 engine over PyTorch's ATen.

This file is the contract between the engine (rust/) and its callers (the
server, the tests, the benchmarks). Change it together with rust/src/bindings.rs:
tests/engine/test_stub.py fails when their names, methods or parameters differ.
It lives beside the package's __init__.py (maturin's mixed Rust/Python layout:
gemma_engine/__init__.py checks the torch version, then loads gemma_engine._native).

Tensor arguments (`like`) must be torch.Tensor: anything else is TypeError. The functions for tests and
benchmarks alone (ATen round trips, the kernels, the sampler on given logits, the collectives, the operator
count) are `gemma_engine.testing`'s, declared in testing.pyi beside this file.
"""

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

__version__: str

BUILD: dict[str, str | bool]
"""What built this module: keys "torch", "rustc", "python", "crate" (versions), and "cuda_graphs":
whether the shim was built with CUDA graph capture (a torch with CUDA and CUDA headers with crt/).

Importing the module under a torch other than BUILD["torch"] raises ImportError
naming both versions.
"""

LIMITS: dict[str, int]
"""The bounds every request is checked against, declared once in the engine (rust/src/engine/request.rs
`LIMITS`): "max_top_logprobs" (20: `SamplingParams(logprobs=)` is at most this), "max_logit_bias" (300:
entries of `SamplingParams(logit_bias=)`) and "max_stop_token_ids" (64: ids of `Request(stop_ids=)` and
`Engine.decode(stop_ids=)`) and "max_grammar_bytes" (65536: bytes of `Request(grammar=)`; a grammar past it,
or past llguidance's compile limits, ends the request "error"). A value past its limit is a ValueError
naming the field and the limit.
"""

def adopt_storage_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Swap the memory of `dst`'s storage and `src`'s, with no copy: every tensor that views `dst`'s storage (the
    engine's own among them) then reads what `src` held, and `src` holds the old memory. How a step compiled with
    buffer donation (`gemma_engine.compiling.StepCompiler(donate=True)`) gives its new KV rings to the engine.

    Raises:
        RuntimeError: the shapes, dtypes or devices differ, or either tensor is not the whole of its storage
            (contiguous from offset 0).
    """

def smoke(like: torch.Tensor) -> dict[str, float | str]:
    """Run one Rust ATen call on `like`'s device and report it.

    Computes sum(ones(8, 64) @ ones(64, 8)) on the device of `like`.

    Returns:
        {"value": 4096.0, "device": "<device of the result, e.g. cpu, cuda:0>"}
    Raises:
        RuntimeError: the device failed the computation.
    """

Finish = Literal["stop", "length", "cancelled", "error", "failed"]

class SamplingParams:
    """How a request chooses its tokens; OpenAI's and Transformers' meanings.

    Neutral values switch a stage off: temperature 0 is greedy (argmax after bias and penalties),
    top_k 0 keeps every token, top_p 1 and min_p 0 filter nothing, the presence and frequency
    penalties 0 and the repetition penalty 1 change nothing. The stages run in Transformers'
    order: logit_bias, repetition penalty (prompt and output tokens), presence and frequency
    penalties (output tokens), temperature, top-k, top-p, min-p. With a given `seed` a request
    draws the same tokens whatever else is in the batch, and whatever read_every or
    prefill_chunk are. `logprobs`: None for none, k in 0..LIMITS["max_top_logprobs"] (20) for the
    chosen token's log-probability and the k most likely tokens' (of the model's raw distribution).
    `logit_bias` holds at most LIMITS["max_logit_bias"] (300) entries.
    """

    def __init__(
        self,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int = 0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: dict[int, float] | None = None,
        logprobs: int | None = None,
    ) -> None:
        """Raises:
        ValueError: a value out of range, named (token ids of logit_bias are checked against the
            vocabulary when the request is admitted).
        """

class Grammars:
    """The token environment of one tokenizer for grammar-constrained sampling (llguidance 1.9.1 over
    toktrie 1.9.1; rust/src/engine/grammar.rs). Built once; thread-safe (a frozen pyclass, Send + Sync);
    every method releases the GIL.

    Grammars are llguidance Lark (its docs/syntax.md): they may embed `%json{...}` JSON Schemas and name
    special tokens as `<|"|>` (by text) or `<[52]>` (by id). When a grammar is accepting, the eos ids are
    allowed; once it has stopped (nothing more can follow), only they are.
    """

    def __init__(self, tokenizer_json: str, eos_ids: Sequence[int], vocab_size: int) -> None:
        """Args:
            tokenizer_json: path of a tokenizer.json: byte-level BPE, or SentencePiece byte fallback
                (`<0xNN>` tokens; a Metaspace or Replace decoder).
            eos_ids: the checkpoint's eos ids.
            vocab_size: the model's vocabulary; ids past the tokenizer's are never allowed.
        Raises:
            ValueError: an unsupported tokenizer, an eos id outside [0, vocab_size), no eos id, or a
                tokenizer with more tokens than vocab_size.
            OSError: the file cannot be read.
        """
    def check(self, grammar: str) -> None:
        """Compile `grammar`.

        Raises:
            ValueError: it does not compile (llguidance's message), it exceeds
                LIMITS["max_grammar_bytes"], or it exceeds llguidance's compile limits (lexer fuel,
                grammar size, nesting), so a schema built to be expensive is refused in milliseconds.
        """
    def accepts(self, grammar: str, ids: Sequence[int]) -> bool:
        """True when the grammar consumes every id and is then accepting.

        Raises:
            ValueError: the grammar does not compile.
        """
    def allowed(self, grammar: str, ids: Sequence[int]) -> list[int]:
        """The token ids allowed after `ids` (the eos ids alone once the grammar has stopped).

        Raises:
            ValueError: the grammar does not compile or refuses one of `ids`.
        """

class Request:
    """One request for `Engine.run`: prompt ids, at most `max_new` new tokens, extra stop ids (at most
    LIMITS["max_stop_token_ids"], 64; more end the request "error" at admission).

    `grammar`: an llguidance Lark grammar (see `Grammars`) every generated token follows: the tokens it
    does not allow are masked to -inf on the device before logit bias, penalties, temperature, top-k,
    top-p, min-p, the draw and the log-probabilities. When the grammar stops (nothing more can follow)
    the request ends "stop" with that last token returned. A grammar that does not compile, or one sent
    to an Engine built without `grammars=`, ends the request "error" at admission with the reason; a
    token the grammar refuses (it cannot happen under the mask) ends it "failed". While a constrained
    request decodes, tokens come back to the host every turn, whatever `read_every` is.

    `prompt_logprobs`: k in 0..LIMITS["max_top_logprobs"]: the log-probability of each prompt token
    given the ones before it and the k most likely tokens there (of the model's own distribution),
    computed on the device while the prompt is read and delivered on the request's first Event as
    `Event.prompt_logprobs`. With it `max_new` may be 0: the request then ends "length" right after its
    prompt is read, with no tokens. Such a request takes no prefix-cache hit (every position is scored).

    `cache_salt`: with prefix caching (`Engine(prefix_caching=True)`), requests with different salts never
    reuse each other's keys (vLLM's `cache_salt`), so tenants cannot probe each other's prompts by timing;
    None is a salt of its own.

    `media`: soft tokens of images and audio clips (`Encoder.image`, `Encoder.audio`) as (start, embeds,
    key) triples, sorted by start: `embeds` `[n, hidden_size]` replaces the embeddings of prompt positions
    start..start+n, which must all hold one media placeholder id of the checkpoint (`image_token_id`,
    `audio_token_id`), and no placeholder may stand outside an item. Those positions read the pad id for
    the per-layer inputs, as Transformers' Gemma4Model does. `key` (a 64-bit hash of the content) is what
    the prefix cache compares there: the same key at the same place resumes, another stops the hit. A
    request whose media break these rules ends "error" at admission, naming the item.

    `cache_boundary`: a prompt position in 1..len(ids)-1 where the engine keeps a copy of its sliding rings
    while it reads the prompt, so that later requests sharing ids[:cache_boundary] can resume there (the
    end of the system turn and tool declarations every user of an agent shares). Outside that range the
    request ends "error" at admission, naming `cache_boundary`. Ignored with prefix caching off.

    `next_turn`: a prompt position in 1..len(ids)-1 where the conversation's next turn will depart from
    this prompt (the server renders the next turn with the chat template to find it), kept the same way:
    a template may end a prompt with markup that its rendering of the reply drops (Gemma 4's empty
    thought channel), so the next turn shares all but the prompt's last few tokens. The same range and
    errors as `cache_boundary`, naming `next_turn`. The prompt is read in chunks that end at both marks.
    With `next_turn` the engine keeps no snapshot at the prompt's end, so the same prompt sent again (a
    regenerated reply) resumes at `next_turn` and reads the prompt's last few tokens again.

    `speculative`: False opts the request out of the engine's speculative decoding (no drafts are made for
    it); its tokens are the same either way.
    """

    def __init__(
        self,
        id: int,
        ids: Sequence[int],
        max_new: int,
        stop_ids: Sequence[int] = (),
        sampling: SamplingParams | None = None,
        grammar: str | None = None,
        prompt_logprobs: int | None = None,
        cache_salt: str | None = None,
        cache_boundary: int | None = None,
        media: Sequence[tuple[int, torch.Tensor, int]] = (),
        next_turn: int | None = None,
        speculative: bool = True,
    ) -> None: ...
    @property
    def id(self) -> int: ...
    @property
    def ids(self) -> list[int]: ...
    @property
    def max_new(self) -> int: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def cache_boundary(self) -> int | None: ...
    @property
    def next_turn(self) -> int | None: ...
    def __reduce__(self) -> tuple[type[Request], tuple]:
        """Pickled as its constructor's arguments, soft tokens included (requests cross to other ranks)."""

class Encoder:
    """The vision and audio towers of a Gemma 4 checkpoint with their projections into the text model
    (Transformers 5.18 Gemma4VisionModel, Gemma4AudioModel, Gemma4MultimodalEmbedder), on `like`'s
    device in `dtype`. A text-only checkpoint gives an Encoder with no modalities. Only the thread that
    built it may call it.

    Raises:
        ValueError: a bad vision_config or audio_config, a missing or misshapen tower tensor (named).
        OSError: an unreadable file.
    """

    def __init__(self, model_dir: str, like: torch.Tensor | None = None, dtype: str = "bfloat16") -> None: ...
    @property
    def modalities(self) -> list[str]:
        """A subset of ["image", "audio"]."""
    @property
    def hidden_size(self) -> int: ...
    @property
    def image_token_id(self) -> int: ...
    @property
    def audio_token_id(self) -> int: ...
    @property
    def boi_token_id(self) -> int: ...
    @property
    def eoi_token_id(self) -> int: ...
    @property
    def boa_token_id(self) -> int: ...
    @property
    def eoa_token_id(self) -> int: ...
    def image(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> list[torch.Tensor]:
        """Soft tokens of images as Gemma4ImageProcessor makes them: `pixel_values` float `[n, patches,
        3 * patch_size**2]` in [0, 1], `position_ids` int64 `[n, patches, 2]` (x, y; -1 for padding).
        One `[soft_i, hidden_size]` tensor per image (`get_image_features`' pooler output).

        Raises:
            ValueError: no vision tower; inputs of the wrong shape (named).
        """
    def audio(self, features: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
        """Soft tokens of audio clips as Gemma4AudioFeatureExtractor makes them: `features` float
        `[n, frames, mel]`, `mask` bool `[n, frames]` (true: a real frame). One `[soft_i, hidden_size]`
        tensor per clip, its valid soft tokens (`get_audio_features`).

        Raises:
            ValueError: no audio tower; inputs of the wrong shape.
        """

class Event:
    """New tokens of one request, and its end once it ended."""

    id: int
    tokens: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]]]
    """Per token, when the request asked: (its logprob, [(token id, logprob), ...] most likely first)."""
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None
    """On the request's first event when it asked for `prompt_logprobs`: one entry for each prompt
    position 1..n-1 (position 0 has none), (the prompt token's logprob, [(token id, logprob), ...] most
    likely first); None otherwise."""
    finish: Finish | None
    """None while the request runs; "error" when it was refused at admission for its own values, "failed"
    when the engine failed while admitting or running it (`error` says why in both)."""
    error: str | None
    prompt_s: float
    """On the last event: seconds from admission to the read point that delivered the first token."""
    decode_s: float
    """On the last event: seconds from then to the end."""
    cached_tokens: int
    """Prompt tokens the request took from the prefix cache (at most len(ids) - 1; 0 without a hit or
    with prefix caching off), on every event of the request."""

class Engine:
    """One Gemma 4 text model, `max_batch` sequence slots and their fixed-shape KV cache.

    `#[pyclass(unsendable)]`: only the thread that built it may call it; a call
    from another thread raises pyo3's PanicException.
    """

    def __init__(
        self,
        model_dir: str,
        emb_dir: str | None = None,
        like: torch.Tensor | None = None,
        context: int = 8192,
        dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16",
        prefill_chunk: int = 256,
        max_batch: int = 1,
        packed_int4: bool | None = None,
        cuda_graphs: bool = True,
        onednn: bool | None = None,
        grammars: Grammars | None = None,
        prefix_caching: bool = True,
        tensor_parallel_size: int = 1,
        compiler: Callable[[str, Callable[[], list[torch.Tensor]]], Callable[[], list[torch.Tensor]]] | None = None,
        tensor_parallel_rank: int | None = None,
        tensor_parallel_group: str | None = None,
        speculative_method: Literal["ngram", "mtp"] | None = None,
        num_speculative_tokens: int | None = None,
        prompt_lookup_min: int = 1,
        prompt_lookup_max: int = 4,
        speculative_max_batch: int = 1,
        speculative_model: str | None = None,
    ) -> None:
        """Load a checkpoint directory (config.json + *.safetensors).

        Args:
            model_dir: dense bf16/f32 or compressed-tensors W4A16 checkpoint.
            emb_dir: optional directory holding int4 `embed_tokens` /
                `embed_tokens_per_layer` tables that replace the model's own.
            like: a tensor on the target device (e.g. torch.zeros(1, device="cuda"));
                every weight and the cache follow it. Default: CPU.
            context: ring size of full-attention layers = the most tokens
                (prompt + generated) one request can hold.
            dtype: compute dtype.
            prefill_chunk: the most prompt tokens one forward reads (one prompt's chunk, or
                several short prompts together, padding included).
            max_batch: sequence slots; each reserves a whole context of KV cache
                (layout()["kv_bytes_per_slot"]).
            packed_int4: keep a W4A16 checkpoint's int4 linears packed on the device and
                multiply them with ATen's int4 kernels (`_weight_int4pack_mm` on CUDA, the
                `_for_cpu` variant on the CPU), which take bfloat16 activations: about a third
                of the bytes of the bfloat16 weights. None (default) does so on the CPU and on
                CUDA in bfloat16 and dequantizes elsewhere; True requires it; False dequantizes
                at load in the compute dtype, as Transformers does: the kernels round
                differently, enough to change greedy tokens of a small random model. A linear
                whose shape the kernels cannot tile stays dequantized (weights()["int4"]
                says "mixed"). Embedding tables are always dequantized.
            cuda_graphs: on CUDA, capture each decode-step shape (bucket, padding rows or
                not, the sampling stages its rows need) as a CUDA graph at its second step
                and replay it from then on: one launch a step instead of one per ATen call.
                Prompt chunks run eagerly. Ignored on other devices, and when the engine was
                built against a torch without CUDA.
            onednn: multiply dense weights with oneDNN (packed once at load into its layout,
                as torch._inductor does for a frozen CPU model) instead of ATen's matmul:
                much faster for the few rows of a decode step. None (default) uses it on the
                CPU in float32, and in bfloat16 where this torch's oneDNN computes bfloat16 on
                this CPU (torch.ops.mkldnn._is_mkldnn_bf16_supported()), when this torch has
                oneDNN; True requires it; False never. weights()["linear_note"] says why not.
                A tied lm_head keeps the embedding table and adds its packed copy.
            grammars: the token environment of the checkpoint's tokenizer, needed by any Request with
                a grammar (its vocab_size must be the model's).
            prefix_caching: keep each finished request's keys in its slot and let a later request
                that starts with the same tokens (and the same `cache_salt`) read only the rest of its
                prompt (`Event.cached_tokens` says how much it reused). Exact: the tokens are those
                of a read of the whole prompt. Each slot then also holds two snapshots of its
                sliding-window rings (where the next turn departs: at `Request.next_turn`, else at its
                prompt's end; and at `Request.cache_boundary`), so a request can resume there; layout()["snapshot_bytes_per_slot"] gives their size.
                Requests go to the free slot with the longest valid prefix, or the least recently
                used one; without it, to the lowest free slot.
            tensor_parallel_size: split the model over this many ranks, a process each (vLLM's column- and
                row-parallel layers): each holds its share of the attention heads (KV heads replicated when
                there are fewer than ranks), of every MLP's and expert's intermediate features and of the
                vocabulary, and the KV rings of its heads; embeddings, norms, the per-layer inputs and the
                router are whole on every rank. Above 1 it needs tensor_parallel_rank and
                tensor_parallel_group (gemma_engine.distributed.start starts the ranks).
            compiler: capture and compile each decode-step shape (gemma_engine.compiling.StepCompiler, or any
                `compiler(step_name, run) -> replay` with a `backend_name`): a shape's first step runs
                eagerly, its second is recorded (`run()` runs it) and compiled, later ones call `replay()`.
                A compiler that raises leaves that shape eager (`compile_report()["fallbacks"]`). With CUDA
                graphs, each compiled step's replay is captured as one (`fell_back(step, reason)` is called on
                the compiler when that capture fails and the replay runs without a graph). Prompt chunks of a
                prompt read alone are captured the same way per length bucket (`chunk_buckets`), left-padded,
                on one more row of KV rings the engine then holds (`layout()["kv_bytes"]` counts it).
            tensor_parallel_rank, tensor_parallel_group: together, this process holds shard
                `tensor_parallel_rank` of `tensor_parallel_size` (the parts kept whole too), and its layers'
                partial outputs meet the other ranks' in `_c10d_functional` all-reduces (after attention and
                after the MLP and experts) and an all-gather of the logits over the torch.distributed group
                of that `group_name` (every rank must then run the same engine calls:
                gemma_engine.distributed).
            speculative_method, num_speculative_tokens: "ngram" (prompt lookup, as vLLM's and Transformers'):
                before a decode step each slot gets up to num_speculative_tokens (1..16) drafts copied from
                what followed the earliest earlier occurrence of its context's last n tokens (the largest n
                in prompt_lookup_min..prompt_lookup_max that occurs), and the model checks them all in one
                forward, keeping those its own choices agree with and one token more: the argmax, or for a
                sampled request the seeded draw of that token's index. Output is the output without
                speculation, token for token, greedy or seeded, up to the float rounding of the verify
                forward's logits (a draft is kept with probability p(draft): rejection sampling with a
                one-token draft). Steps speculate only when no request in the
                bucket has penalties, a grammar or logprobs, and at most speculative_max_batch slots
                decode (default 1: bench/speculative.py measured a verify step paying alone in every
                run on a CPU; at 2 to 4 slots it gained or lost with the engine's slots); such runs read
                their tokens back every turn. `speculative` reports the settings, the run's stats the drafts.
            speculative_model: with speculative_method "mtp", the directory of Gemma 4's MTP assistant drafter
                (Transformers' Gemma4AssistantForCausalLM or Gemma4UnifiedAssistantForCausalLM), which drafts
                on the device from the target's KV cache and last hidden state, a batched pass a draft; the
                same verify step checks its drafts. A slot's first decode step after its prompt (and after
                plain steps) records that hidden state and is offered no drafts. Its weights count in
                `weights()["bytes"]`; it must have been made for this target (hidden size, vocabulary, the
                head geometry of the layers whose keys it reads), and tensor_parallel_size must be 1.
        Raises:
            ValueError: bad config key, missing or misshapen tensor (named, with
                the expected shape), bad dtype, context, prefill_chunk or max_batch < 1,
                packed_int4=True with a dtype other than bfloat16 or on a device without
                the int4 kernels, onednn=True off the CPU, in float16, without oneDNN or,
                in bfloat16, without its bfloat16 support, grammars of another vocab_size,
                a tensor_parallel_size that does not divide the heads, KV heads (nor is a multiple of
                them), intermediate sizes or vocabulary (the numbers named), a tensor_parallel_rank outside
                0..tensor_parallel_size or without its group (or the group without it), a
                tensor_parallel_size above 1 without a rank,
                weights that the device's free memory cannot hold (estimated from the files' headers before
                any is loaded: a rank keeps the embeddings, per-layer inputs, norms and routers whole and its
                share of the rest), or a KV cache of max_batch x kv_bytes_per_slot (snapshots
                included) that does not fit in the
                device's free memory after the weights (CPU: MemAvailable and the cgroup
                limit; CUDA: torch.cuda.mem_get_info; other devices are not checked).
        """

    @property
    def eos_ids(self) -> list[int]: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def context(self) -> int: ...
    @property
    def max_batch(self) -> int: ...
    @property
    def buckets(self) -> list[int]:
        """The decode-step batch sizes: powers of two below max_batch, then max_batch."""
    @property
    def chunk_buckets(self) -> list[int]:
        """The lengths compiled prompt chunks run at: powers of two from 16 below prefill_chunk, then
        prefill_chunk; empty for an engine made without a compiler."""
    @property
    def dtype(self) -> str: ...
    @property
    def device(self) -> str: ...
    def weights(self) -> dict[str, int | str | None]:
        """{"int4": "packed" | "dequantized" | "mixed" | "none", "bytes": int,
        "linear": "onednn" | "aten", "linear_note": str | None}: how the int4 linears reached the
        device ("none": the checkpoint has none), the bytes of every weight on the device (packed
        int4 linears at their packed size, scales included; a tied lm_head's oneDNN copy too),
        what multiplies the dense weights (`onednn`), and, on "aten", why not oneDNN (e.g. a CPU
        whose oneDNN has no bfloat16 support)."""

    @property
    def captured_steps(self) -> int:
        """CUDA graphs of decode steps captured so far (0 off CUDA or with cuda_graphs=False)."""
    def reset_prefix_cache(self) -> None:
        """Forget what every slot's rings hold (vLLM's `reset_prefix_cache`): later requests find no prefix
        hit and take the lowest free slots (a batch of b requests then runs in bucket b)."""
    def use_compiled(self, on: bool, bucket: int | None = None) -> None:
        """Replay compiled decode steps and prompt chunks (True) or run them as an engine without a compiler
        does, capturing nothing (False): every bucket's, or with `bucket` that decode bucket's alone
        (`--compile auto` keeps the faster way per bucket).

        Raises:
            ValueError: the engine was made without a compiler, or has no such bucket.
        """
    def compile_report(self) -> dict[str, Any] | None:
        """{"backend": str, "active": bool, "captured": int (decode steps and prompt chunks), "eager_buckets":
        [int] (buckets that run as without a compiler while active), "fallbacks": [(step, reason)]}, or None
        without a compiler."""
    @property
    def layer_calls(self) -> list[int]:
        """ATen calls each decoder layer made in the engine's last forward."""

    @property
    def speculative(self) -> dict[str, str | int] | None:
        """{"method": "ngram" or "mtp", "speculative_model" (the drafter's directory, or None),
        "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "speculative_max_batch",
        "speculative_max_bucket" (set by `set_speculative_max_bucket`, else None)} when speculative decoding is on,
        else None."""

    def speculation_costs(self, batch: int, turns: int = 8) -> dict[str, float | int]:
        """{"bucket", "plain_s", "verify_s", "drafts"}: the seconds of a plain decode step and of a verify step
        with "drafts" drafts a row, with `batch` requests of a made-up prompt decoding in decode bucket "bucket",
        `turns` steps of each (at most `speculation_turns`), read as a batch that speculates reads them
        (rust/src/engine/tuning.rs). Every slot's rings are forgotten before and after (`reset_prefix_cache`), the
        requests cancelled. Between runs only.

        Raises:
            ValueError: speculative decoding is off, `batch` outside 1..max_batch, turns < 1, or a context too
                short for the turns.
        """

    @property
    def speculation_turns(self) -> int:
        """The most turns `speculation_costs` can time in this engine's context (its requests hold an 8-token prompt
        and drafts + 2 tokens a turn, a compiling engine's two untimed rounds of each kind included); 0 when not
        one fits or speculative decoding is off."""

    def compile_verify(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None) -> bool:
        """Capture and compile the verify steps of the decode bucket that one request per prompt fills, keyed by
        `sampling`'s stages as serving keys them: two verify steps with every row live, and from two rows up two
        with the first row's request cancelled (the bucket's key with padding), with an MTP assistant each also
        without drafts (the step that only records the assistant's states), made-up drafts, each read at once
        (rust/src/engine/tuning.rs). Every slot's rings are forgotten before and after, the requests cancelled.
        Between runs only. Returns whether every step ran with the rows it was meant to (False when a request
        drew an eos first: try other prompts).

        Raises:
            ValueError: speculative decoding is off, the engine does not compile, no prompts or more than
                max_batch, or a prompt empty or too long to leave room for the steps.
        """

    def set_speculative_max_bucket(self, n: int) -> None:
        """No step of a decode bucket above `n` speculates (0: none does), besides `speculative_max_batch`'s limit on
        decoding requests: a step's cost is its bucket's (padding rows included). The server sets it from
        `speculation_costs` at warmup.

        Raises:
            ValueError: speculative decoding is off, or n < 0.
        """

    def layout(self) -> dict[str, int | bool | None]:
        """{"full_rings", "sliding_rings", "shared_layers", "context", "sliding_window",
        "max_batch", "kv_bytes_per_slot", "kv_bytes", "prefix_caching", "snapshot_bytes_per_slot",
        "tensor_parallel_size", "tensor_parallel_rank"}; with tensor parallelism the byte counts are this
        rank's (tensor_parallel_rank, else None).

        kv_bytes_per_slot = sum over the layers with their own K/V of
        2 * kv_heads * (ring + 1) * head_dim * dtype bytes (ring = context for full layers,
        min(sliding_window, context) for sliding ones; the extra entry takes padding rows'
        writes), plus snapshot_bytes_per_slot = 2 * the same sum over the sliding layers with their
        own K/V when prefix_caching is on (0 when off); kv_bytes = max_batch x kv_bytes_per_slot.
        """

    def run(
        self,
        poll: Callable[[int, bool], tuple[Sequence[Request], Sequence[int]] | None],
        on_events: Callable[[list[Event], dict[str, object]], object],
        read_every: int = 1,
    ) -> None:
        """The continuous-batching loop; returns when `poll` returns None.

        Each turn runs one decode step of every decoding slot and then one prompt forward of
        at most prefill_chunk tokens: the next chunk of the oldest prompt still being read, or,
        when it and the next unread prompts fit whole, those prompts together (their slots
        from the lowest to the highest, times the longest prompt, within prefill_chunk). Every
        `read_every` turns (a read point) the new tokens come to the host:
        `on_events(events, stats)` gets them (stats: {"batch_sizes": decoding rows per step,
        "prompt_tokens": prompt tokens read, "prompt_reads": prompts each prompt forward
        read, "seconds": wall time of those turns, "mask_seconds": the part of it spent computing
        grammar masks on the host, "cache_queries": prompt tokens of the requests admitted before
        those turns, "cache_hits": how many of them came from the prefix cache, "spec_drafts": slots of
        speculative steps that had drafts, "spec_draft_tokens": the drafts, "spec_accepted_tokens": those
        kept, "spec_accepted_per_position": kept drafts by their index among a slot's}), then
        `poll(free, idle)` returns the new requests (at most `free`, each taking a free slot: the
        lowest, or with prefix caching the one holding its longest prefix) and the ids of requests
        to cancel, or None to end the loop (requests still running end "cancelled").
        `idle` is True when no request runs, so `poll` may block until there is work. A
        request the engine refuses (prompt too long, id outside the vocabulary, a bad
        parameter) ends at once with finish "error" and the reason in `Event.error`. An
        error while admitting or running requests (an upload, a prompt forward, a decode
        step, a read point) ends those requests alone with finish "failed" and the error in
        `Event.error`, frees their slots, and the loop goes on.
        The GIL is released while the device works and re-taken only for the callbacks.

        Raises:
            ValueError: read_every < 1.
            Exception: whatever `poll` or `on_events` raised (the loop ends).
        """

    def decode(
        self,
        ids: Sequence[int],
        max_new: int,
        stop_ids: Sequence[int] = (),
        read_every: int = 1,
        on_tokens: Callable[[list[int]], object] | None = None,
        sampling: SamplingParams | None = None,
    ) -> tuple[list[int], Finish, float, float]:
        """One request alone through `run`.

        Reads the prompt in chunks of `prefill_chunk`, then generates until a
        token in eos_ids or stop_ids (that token is not returned nor passed to
        on_tokens: "stop"), `max_new` tokens, or a full context, i.e. prompt +
        generated == context ("length"). Tokens come back to the host every
        `read_every` steps; `on_tokens(batch)` is called with each batch and a
        falsy return cancels ("cancelled"). The tokens do not depend on
        read_every or prefill_chunk.

        Returns:
            (tokens, finish, prompt_s, decode_s): generated ids, "stop" | "length" |
            "cancelled", seconds to the first token, seconds generating after it.
        Raises:
            ValueError: empty prompt, max_new < 1, read_every < 1, a prompt of
                `context` tokens or more, a token id outside [0, vocab_size), more
                stop ids than LIMITS["max_stop_token_ids"], a sampling parameter out of range.
            Exception: whatever `on_tokens` raised.
            RuntimeError: the engine failed while running the request.
        """

    def inject_fault_for_tests(self, at: Literal["admit", "prompt", "decode"], id: int) -> None:
        """Make the engine fail request `id` once: at its admission (after its checks passed), in the
        prompt forward that reads it, or in a decode step that runs it, as a device error would. The
        one way a test can show that such an error fails those requests alone.

        Raises:
            ValueError: `at` is none of the three.
        """

    def logits(self, ids: Sequence[int], media: Sequence[tuple[int, torch.Tensor, int]] = ()) -> torch.Tensor:
        """float32 [vocab_size] logits (after softcap) for the token after `ids` (with soft tokens
        `media`, as in Request), read into slot 0 from empty, on the host. For parity checks.

        Raises:
            ValueError: as for decode, and media that break Request's rules.
        """
