"""Where a translated chat request's fields came from, so that a 400 from chat's checks names the field the
client sent (the Responses API's `input[2].arguments`, the Messages API's `messages[1].content[0].input`), not
the chat request's (`messages[3].tool_calls[0].function.arguments`) that the client never saw.

vLLM's Anthropic and Responses handlers translate to chat the same way but pass chat's error through with
chat's names; here each front-end's translation records its names as data (`FieldNames`) and one function
renames.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gemma_server.errors import ApiError


@dataclass(frozen=True)
class FieldNames:
    """Where each field of a translated chat request came from in the front-end's request.

    Attributes:
        fields: chat field path -> the front-end's field path it came from (`messages[2]` -> `input[1]`); a path
            under a key maps under its value (`messages[2].content` -> `input[1].content`), by the longest key.
        whole: keys whose value names the whole field the key came from: what is under them is not carried
            over (a system message made of `instructions`: `messages[0].content` -> `instructions`).
        words: chat's names a message may mention anywhere -> the front-end's (`max_tokens` ->
            `max_output_tokens`). A path (`messages[2].content`) is renamed where a message names it; a bare
            name only as `words` says, since it is often a plain word too ("the messages").
    """

    fields: dict[str, str]
    whole: frozenset[str] = frozenset()
    words: dict[str, str] = field(default_factory=dict)

    def field(self, param: str | None) -> str | None:
        """The front-end's name of chat field `param`, or `param` itself when nothing maps it."""
        if param is None:
            return None
        keys = [k for k in self.fields if param == k or param.startswith((k + ".", k + "["))]
        if not keys:
            return param
        key = max(keys, key=len)
        return self.fields[key] + ("" if key in self.whole else param[len(key):])

    def error(self, err: ApiError) -> ApiError:
        """`err` (from chat's checks) naming the front-end's field, in its param and in its message."""
        param = self.field(err.param)
        message = err.message
        if param != err.param and re.search(r"[.\[]", err.param):
            message = re.sub(rf"(?<![\w.\[\]]){re.escape(err.param)}(?![\w\[])", param, message)
        for chat, ours in self.words.items():
            message = re.sub(rf"(?<![\w.]){re.escape(chat)}(?!\w)", ours, message)
        if param == err.param and message == err.message:
            return err
        return ApiError(err.status, message, param, err.headers)
