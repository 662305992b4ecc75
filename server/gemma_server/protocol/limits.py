"""The bounds a request is held to, named once: the engine's own (copied, since the server is imported before
the engine is built; tests hold them to `gemma_engine.LIMITS`) and the server's."""

from __future__ import annotations

import re




# Completions default to 16 new tokens when max_tokens is absent (OpenAI reference; vLLM keeps it).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


# Caps on the lists of a body are schema bounds (pydantic's max_length), so validation stops at the first
# item past a cap instead of building every item of a 4 MB list first.
MAX_CONTENT_PARTS = 1024


# OpenAI's rule for function names (the API reference's `function.name`: "a-z, A-Z, 0-9, underscores and
# dashes, with a maximum length of 64").
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


MAX_TOOLS = 128


MAX_TOOL_CALLS = 128


# Bounds that keep one request's work small (OpenAI allows 4 stop strings; a few more do no harm, many
# would make stop matching the cost of a step).
MAX_STOP_STRINGS = 16


MAX_STOP_LENGTH = 256


MAX_N = 16


# The engine's own bounds (rust/src/engine/request.rs `LIMITS`, checked there again). They are written here,
# not read from gemma_engine: this module is imported before the boot has built the engine, to serve
# /health while it builds. tests/server/test_protocol.py holds them equal to `gemma_engine.LIMITS`.
MAX_STOP_TOKEN_IDS = 64


MAX_GRAMMAR_BYTES = 65536


MAX_LOGIT_BIAS = 300


MAX_TOP_LOGPROBS = 20


MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's own limit


# vLLM sets no bound on cache_salt; a tenant id or a random token fits in far less than this.
MAX_CACHE_SALT = 256


MAX_MESSAGES = 1024


# Characters of prompt text per token of context: no tokenizer packs more, so text past
# context x this cannot fit and is refused before it is tokenized.
MAX_CHARS_PER_TOKEN = 32


MAX_INT64 = 2**63 - 1


# The engine samples in float32 and divides logits (|x| <= 30 after Gemma's softcap) by the temperature and
# the repetition penalty: below this a quotient leaves float32's range (inf, then NaN probabilities, which
# a grammar's mask cannot survive), and 5e-324 is 0 in float32. Every value below it already acts as its
# limit (greedy; a repeated token's logit as far as float32 goes), so it is taken at this bound: the
# engine's own `MIN_DIVISOR` (rust/src/engine/sampling.rs), below which it refuses both.
MIN_DIVISOR = 1e-30


# Most log-probabilities one response carries: n x max_tokens x (top_logprobs + 1). Each is a JSON object
# of ~60 bytes built on the host, so this keeps an answer near 16 MB (n=16 x 600 tokens x 21 fits; the
# default context x 16 x 21 would be 2.8 million, gigabytes of JSON).
MAX_LOGPROB_ENTRIES = 16 * 800 * 21


# Any integer is a seed: it is taken modulo 2**64 (choice i of n uses seed + i), so no bound can be missed by
# a JSON number that a float rounds (9.2e18 is 2**63 to a JSON Schema validator).
SEED = "Any integer, taken modulo 2**64 into the engine's signed 64-bit seed."


def max_prompt_chars(context: int) -> int:
    """The longest prompt text (`check_size`) that can fit `context` tokens."""
    return context * MAX_CHARS_PER_TOKEN
