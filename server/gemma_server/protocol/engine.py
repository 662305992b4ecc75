"""A request as the engine takes it (`GenerationRequest.engine_params` builds it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any




@dataclass(frozen=True)
class EngineParams:
    """One request, as the scheduler runs it.

    Attributes:
        prompt_ids: the prompt's token ids.
        max_new: most tokens to generate (already capped at context - prompt).
        stop_ids: token ids that end the decode (besides the model's eos ids).
        stop: strings that end the output, matched in the detokenized text.
        sampling: keyword arguments of gemma_engine.SamplingParams (for choice 0; `choice_sampling`
            gives each of the n choices its own seed).
        n: how many choices.
        logprobs: None, or how many top log-probabilities per token (0 for the chosen token's only).
        grammar: the llguidance Lark grammar every generated token follows, or None.
        prompt_logprobs: None, or how many top log-probabilities each prompt token carries (echo).
        tools: the request declared tools (the reply is read for calls).
        forced_calls: the calls are constrained by the grammar (tool_choice required or named), so they
            stream as they come.
        cache_salt: the request's cache_salt: it shares cached KV only with requests of the same salt.
        cache_boundary: a prompt position the engine snapshots for later requests that share the prompt up
            to there (chat: the end of the system turn and the tool declarations), or None.
        next_turn: the prompt position where the conversation's next turn departs from it, which the
            engine snapshots too (chat_template.next_turn), or None.
        media: the soft tokens of the prompt's images and audio, (start, embeds [n, hidden], key) in prompt
            order (media_encoder.place): they take positions start..start+n, which hold the placeholder id.
        speculative: False opts the request out of the server's speculative decoding.
    """

    prompt_ids: tuple[int, ...]
    max_new: int
    stop_ids: tuple[int, ...]
    stop: tuple[str, ...]
    sampling: tuple[tuple[str, Any], ...] = ()
    n: int = 1
    logprobs: int | None = None
    grammar: str | None = None
    prompt_logprobs: int | None = None
    tools: bool = False
    forced_calls: bool = False
    cache_salt: str | None = None
    cache_boundary: int | None = None
    next_turn: int | None = None
    media: tuple[tuple[int, Any, int], ...] = ()
    speculative: bool = True

    def choice_sampling(self, index: int, fresh_seed: Callable[[], int]) -> dict[str, Any]:
        """SamplingParams keywords for choice `index`: a given seed s gives choice i the seed s + i (so
        n > 1 choices differ but each is reproducible); without one every choice gets a fresh seed."""
        kwargs = dict(self.sampling)
        seed = kwargs.get("seed")
        kwargs["seed"] = fresh_seed() if seed is None else _wrap64(seed + index)
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
        return kwargs


def _wrap64(v: int) -> int:
    return (v + 2**63) % 2**64 - 2**63
