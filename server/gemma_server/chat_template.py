"""A request's prompt ids: the checkpoint's chat template rendered and tokenized (chat completions), or the
prompt tokenized (legacy completions).

The template is the checkpoint's own (Transformers' `apply_chat_template`), never one from a request, and a
request's chat_template_kwargs reach it only under the names it reads (vLLM's `resolve_chat_template_kwargs`
in vllm/entrypoints/chat_utils.py). A control token typed into a message stays text: only the template's own
markup becomes control tokens, so a message cannot forge a turn. Text the tokenizer cannot take (a lone
UTF-16 surrogate from a JSON escape) is a 400 naming the field, not a 500.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from gemma_server.errors import bad_request
from gemma_server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)


def render_chat(tokenizer, request: ChatCompletionRequest) -> list[int]:
    """Apply the checkpoint's chat template and tokenize (the template adds BOS itself).

    Message content is the client's text: a control token typed into it (`<start_of_turn>`, `<eos>`) is
    encoded as the characters it is made of, never as the control token, so a message cannot forge a
    turn. Only the template's own markup becomes control tokens.

    Raises:
        ApiError: 400 naming `messages` when the template rejects the conversation (e.g. roles that do
            not alternate) or `chat_template_kwargs` when those do not fit.
    """
    import jinja2

    kwargs = template_kwargs(tokenizer, request.chat_template_kwargs or {})
    messages = request.template_messages()
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=request.add_generation_prompt, **kwargs,
        )
    except TypeError as e:
        raise bad_request("chat_template_kwargs", f"Bad chat_template_kwargs: {e}") from e
    except (jinja2.TemplateError, ValueError, ArithmeticError, LookupError) as e:
        raise bad_request("messages", f"The chat template rejected the messages: {e}") from e
    contents = [m["content"] for m in messages]
    controls = control_tokens(tokenizer)
    if not any(c in content for content in contents for c in controls):
        return encode(tokenizer, text, "messages", add_special_tokens=False)
    return encode_with_literal_contents(tokenizer, text, contents)


# Variables the server (or Transformers' apply_chat_template) sets itself: not a request's to set.
_TEMPLATE_OWN = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tools", "documents",
                           "raise_exception", "strftime_now", "bos_token", "eos_token", "unk_token", "pad_token",
                           "sep_token", "cls_token", "mask_token", "additional_special_tokens"})


def template_kwargs(tokenizer, given: dict[str, Any]) -> dict[str, Any]:
    """The request's chat_template_kwargs that the checkpoint's template reads; the others are ignored
    (logged), as vLLM's `resolve_chat_template_kwargs` (vllm/entrypoints/chat_utils.py) keeps only
    the template's own variables.

    Raises:
        ApiError: 400 when the request names `chat_template`: a template from the request would run
            arbitrary Jinja (loops that hold the event loop, errors of any type); only the checkpoint's
            own is used, as vLLM does by default.
    """
    if "chat_template" in given:
        raise bad_request("chat_template_kwargs", "chat_template cannot be set by a request; the checkpoint's own is used.")
    template = tokenizer.chat_template
    readable = (template_variables(template) if isinstance(template, str) else frozenset()) - _TEMPLATE_OWN
    ignored = sorted(set(given) - readable)
    if ignored:
        log.warning("ignored chat_template_kwargs the chat template does not read: %s", ", ".join(ignored))
    return {k: v for k, v in given.items() if k in readable}


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The variables a Jinja chat template reads (jinja2.meta)."""
    import jinja2
    import jinja2.meta

    return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template)))


def control_tokens(tokenizer) -> list[str]:
    """The strings the tokenizer turns into special (control) tokens."""
    return [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]


def encode_with_literal_contents(tokenizer, text: str, contents: list[str]) -> list[int]:
    """Tokenize rendered chat `text` with the template's markup as control tokens and each message's
    content (found in order in `text`) with special tokens split into plain text."""
    ids: list[int] = []
    at = 0
    for i, content in enumerate(contents):
        body = content.strip()  # templates trim content (Gemma's `| trim`)
        if not body:
            continue
        found = text.find(body, at)
        if found < 0:
            raise bad_request(f"messages[{i}].content",
                              "This message holds control-token text that the chat template changed; remove it.")
        ids += encode(tokenizer, text[at:found], "messages", add_special_tokens=False)
        ids += encode(tokenizer, body, f"messages[{i}].content", add_special_tokens=False, split_special=True)
        at = found + len(body)
    return ids + encode(tokenizer, text[at:], "messages", add_special_tokens=False)


def encode(tokenizer, text: str, param: str, add_special_tokens: bool, split_special: bool = False) -> list[int]:
    """tokenizer.encode, with text it cannot take (lone UTF-16 surrogates from a JSON escape) as a 400.
    `split_special`: control-token strings in `text` are encoded as plain text."""
    if not text:
        return []
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=split_special)
    except (TypeError, ValueError, UnicodeError) as e:
        raise bad_request(param, f"The text cannot be tokenized (is it valid Unicode?): {e}") from e


def tokenize_completion(tokenizer, request: CompletionRequest) -> list[int]:
    """A text prompt is tokenized with the tokenizer's special tokens (BOS), as vLLM does; ids pass as they are.
    (A raw completion prompt is the client's own formatting: control tokens in it stay control tokens.)"""
    prompt = request.single_prompt()
    if isinstance(prompt, str):
        return encode(tokenizer, prompt, "prompt", add_special_tokens=True)
    return list(prompt)
