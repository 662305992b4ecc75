"""A Gemma 4 reply split into content, reasoning and tool calls, token by token.

Gemma 4 writes a tool call as `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:42,flag:true}<tool_call|>`: keys
bare, strings between the special token `<|"|>`, numbers, booleans and null bare, several calls one after
the other, then `<|tool_response>` (an eos id: the model waits for the results). Thinking is
`<|channel>thought\\n...<channel|>`. The format is Transformers 5.18's "gemma4" response template
(`transformers/cli/serving/utils.py`, parsed by `transformers/utils/chat_parsing/`) and vLLM's
`vllm/tool_parsers/gemma4_tool_parser.py`.

Unlike those, which match the decoded text, `ReplySplitter` works on token ids: a marker is its special
token, never the characters it is spelled with, so a reply that types `<|tool_call>` as text is content,
and no text can open or close a string. The call's arguments are transcoded to JSON as the tokens come,
append-only (`GemmaToJson`): `key:` becomes `"key":`, a `<|"|>` string a JSON string, `{}[],` are copied,
and a bare scalar is held until the `,`, `}` or `]` that ends it, then written as a number, true, false,
null or else a JSON string. So the fragments a stream sends always join into the final arguments.
"""

from __future__ import annotations

import codecs
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

TOOL_CALL_START = "<|tool_call>"
TOOL_CALL_END = "<tool_call|>"
QUOTE = '<|"|>'
TOOL_RESPONSE = "<|tool_response>"
TOOL_START = "<|tool>"
TOOL_END = "<tool|>"
CHANNEL_START = "<|channel>"
CHANNEL_END = "<channel|>"
# The channel name Gemma 4 writes after <|channel> for its thoughts (Transformers' gemma4 template opens
# the thinking field at "<|channel>thought\n").
THOUGHT_LABEL = b"thought\n"
CALL_PREFIX = "call:"

# RFC 8259's number grammar: a bare scalar that matches is a JSON number as it stands.
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_JSON_WHITESPACE = " \t\n\r"


def special_token_ids(tokenizer) -> dict[str, int]:
    """{text: id} of the tokenizer's special added tokens (a transformers tokenizer, or a `tokenizers.Tokenizer`)."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if added is None:
        added = tokenizer.get_added_tokens_decoder()
    return {token.content: i for i, token in added.items() if token.special}


@dataclass(frozen=True)
class GemmaFormat:
    """The ids of Gemma 4's tool-calling markers in one tokenizer."""

    tool_call_start: int
    tool_call_end: int
    quote: int
    tool_response: int
    tool_start: int | None = None
    tool_end: int | None = None
    channel_start: int | None = None
    channel_end: int | None = None

    @classmethod
    def detect(cls, tokenizer) -> GemmaFormat | None:
        """The markers of `tokenizer`, looked up by text among its special tokens.

        Returns:
            None when it lacks one of `<|tool_call>`, `<tool_call|>`, `<|"|>`, `<|tool_response>`.
        """
        ids = special_token_ids(tokenizer)
        required = (TOOL_CALL_START, TOOL_CALL_END, QUOTE, TOOL_RESPONSE)
        if not all(t in ids for t in required):
            return None
        return cls(
            tool_call_start=ids[TOOL_CALL_START], tool_call_end=ids[TOOL_CALL_END], quote=ids[QUOTE],
            tool_response=ids[TOOL_RESPONSE], tool_start=ids.get(TOOL_START), tool_end=ids.get(TOOL_END),
            channel_start=ids.get(CHANNEL_START), channel_end=ids.get(CHANNEL_END),
        )


def thinking_markers(tokenizer) -> tuple[int, int] | None:
    """(`<|channel>`, `<channel|>`) ids, or None when the tokenizer lacks either as a special token."""
    ids = special_token_ids(tokenizer)
    if CHANNEL_START in ids and CHANNEL_END in ids:
        return ids[CHANNEL_START], ids[CHANNEL_END]
    return None


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (openai/gpt-2 `encoder.py` `bytes_to_unicode`)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes_of(tokenizer) -> Callable[[int], bytes]:
    """id -> the bytes an ordinary token spells, b"" for a special token, read from the vocabulary as
    llguidance's `token_bytes_from_tokenizer_json` reads it: a byte-level BPE token through GPT-2's
    alphabet, a SentencePiece one with `\u2581` for a space and `<0xNN>` for a fallback byte. An added
    token that is not special spells its text.

    Args:
        tokenizer: a transformers fast tokenizer.
    """
    decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder")
    byte_level = '"ByteLevel"' in json.dumps(decoder)
    added = {i: t for i, t in tokenizer.added_tokens_decoder.items()}
    alphabet = _bytes_to_unicode()

    def spell(i: int, token: str | None) -> bytes:
        if i in added:
            return b"" if added[i].special else added[i].content.encode()
        if token is None:
            return b""
        if byte_level:
            return bytes(alphabet[c] for c in token)
        byte = _SENTENCEPIECE_BYTE.fullmatch(token)
        return bytes([int(byte.group(1), 16)]) if byte else token.replace("\u2581", " ").encode()

    ids = list(range(len(tokenizer)))
    table = [spell(i, t) for i, t in zip(ids, tokenizer.convert_ids_to_tokens(ids))]
    return lambda i: table[i] if 0 <= i < len(table) else b""


# ---------------------------------------------------------------- events


@dataclass
class Content:
    """Ordinary tokens of the answer (the caller detokenizes them)."""

    ids: list[int]


@dataclass
class Reasoning:
    """Tokens inside `<|channel>thought\\n ... <channel|>` (the markers and the label dropped)."""

    ids: list[int]


@dataclass(frozen=True)
class CallStart:
    """A tool call begins: its index among the reply's calls, its id and the function's name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """A fragment of call `index`'s arguments; a call's fragments joined are its arguments' JSON text."""

    index: int
    text: str


@dataclass(frozen=True)
class ToolCall:
    """A completed call: `arguments` is a JSON object's text."""

    id: str
    name: str
    arguments: str


Event = Content | Reasoning | CallStart | CallArguments


def new_call_id() -> str:
    """`call_` and 24 random hex digits (vLLM's `make_tool_call_id` form)."""
    return "call_" + secrets.token_hex(12)


# ---------------------------------------------------------------- Gemma's call syntax -> JSON


class Malformed(ValueError):
    """The text is not Gemma 4's call syntax."""


# What GemmaToJson expects next.
_KEY_OR_END = "key or }"  # after {
_KEY = "key"  # after , in an object
_BARE_KEY = "bare key"
_QUOTED_KEY = "quoted key"
_COLON = ":"  # after a quoted key
_VALUE_OR_END = "value or ]"  # after [
_VALUE = "value"
_STRING = "string"
_SCALAR = "scalar"
_AFTER_VALUE = ", or close"
_DONE = "done"


class GemmaToJson:
    """Append-only transcoder of one call's argument object, from Gemma 4's syntax to JSON.

    Starts after the object's `{` (and writes it); fed characters (`text`) and `<|"|>` tokens (`quote`),
    each returning the JSON it completes. `done` once the outer object closed.

    Raises:
        Malformed: from `text`/`quote`, at the first character that cannot continue a call.
    """

    def __init__(self) -> None:
        self._stack = ["{"]
        self._state = _KEY_OR_END
        self._buffer: list[str] = []  # the bare key, quoted key or bare scalar being read

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def start(self) -> str:
        """The JSON of the object's opening brace."""
        return "{"

    def text(self, chars: str) -> str:
        return "".join(self._char(c) for c in chars)

    def quote(self) -> str:
        state = self._state
        if state in (_KEY_OR_END, _KEY):
            self._state = _QUOTED_KEY
            return ""
        if state == _QUOTED_KEY:
            self._state = _COLON
            return ""
        if state in (_VALUE, _VALUE_OR_END):
            self._state = _STRING
            return '"'
        if state == _STRING:
            self._state = _AFTER_VALUE
            return '"'
        raise Malformed(f'<|"|> where a {state} is expected')

    def _char(self, c: str) -> str:
        state = self._state
        if state == _STRING:
            return json.dumps(c, ensure_ascii=False)[1:-1]
        if state == _QUOTED_KEY:
            self._buffer.append(c)
            return ""
        if state == _BARE_KEY:
            return self._bare_key(c)
        if state == _SCALAR:
            if c in ",}]":
                return self._scalar() + self._after_value(c)
            self._buffer.append(c)
            return ""
        if c in _JSON_WHITESPACE:
            return c
        if state in (_KEY_OR_END, _KEY):
            if c == "}" and state == _KEY_OR_END:
                return self._close(c)
            if c in "{}[],:":
                raise Malformed(f"{c!r} where a key is expected")
            self._state = _BARE_KEY
            self._buffer.append(c)
            return ""
        if state == _COLON:
            if c != ":":
                raise Malformed(f"{c!r} after a quoted key")
            return self._key()
        if state in (_VALUE, _VALUE_OR_END):
            if c == "]" and state == _VALUE_OR_END:
                return self._close(c)
            return self._value(c)
        if state == _AFTER_VALUE:
            return self._after_value(c)
        raise Malformed(f"{c!r} after the arguments closed")

    def _bare_key(self, c: str) -> str:
        if c == ":":
            return self._key()
        if c in "{}[],":
            raise Malformed(f"{c!r} inside a key")
        self._buffer.append(c)
        return ""

    def _key(self) -> str:
        key = "".join(self._buffer).strip()
        self._buffer = []
        if not key:
            raise Malformed("an empty key")
        self._state = _VALUE
        return json.dumps(key, ensure_ascii=False) + ":"

    def _value(self, c: str) -> str:
        if c in "{[":
            self._stack.append(c)
            self._state = _KEY_OR_END if c == "{" else _VALUE_OR_END
            return c
        if c in ",}]:":
            raise Malformed(f"{c!r} where a value is expected")
        self._state = _SCALAR
        self._buffer.append(c)
        return ""

    def _scalar(self) -> str:
        raw = "".join(self._buffer).strip()
        self._buffer = []
        return bare_scalar_json(raw)

    def _after_value(self, c: str) -> str:
        self._state = _AFTER_VALUE
        if c in _JSON_WHITESPACE:
            return c
        if c == ",":
            self._state = _KEY if self._stack[-1] == "{" else _VALUE
            return c
        if c in "}]":
            return self._close(c)
        raise Malformed(f"{c!r} after a value")

    def _close(self, c: str) -> str:
        if self._stack[-1] != {"}": "{", "]": "["}[c]:
            raise Malformed(f"{c!r} closes a {self._stack[-1]!r}")
        self._stack.pop()
        self._state = _AFTER_VALUE if self._stack else _DONE
        return c


def bare_scalar_json(raw: str) -> str:
    """The JSON of an unquoted Gemma value: a JSON number as it stands, true/false/null, else a string."""
    if raw in ("true", "false", "null") or _JSON_NUMBER.fullmatch(raw):
        return raw
    return json.dumps(raw, ensure_ascii=False)


# ---------------------------------------------------------------- the reply splitter

# Where ReplySplitter is.
_TEXT = "text"
_LABEL = "channel label"
_THOUGHT = "thought"
_CALL = "call"


@dataclass
class _Call:
    """The call being read: its ids (for the fallback to content), its head and its arguments."""

    ids: list[int] = field(default_factory=list)
    head: str = ""  # "call:NAME" as read so far
    name: str | None = None  # set at the "{"
    args: GemmaToJson | None = None
    json: list[str] = field(default_factory=list)
    index: int | None = None  # set once its CallStart is out (streaming)
    id: str = ""
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))


class ReplySplitter:
    """Splits one choice's generated ids into content, reasoning and tool calls as they come.

    Args:
        fmt: the tokenizer's Gemma 4 markers, or None (then no tool calls are read).
        thinking: (`<|channel>`, `<channel|>`) ids to read reasoning, or None (then they are content).
        token_bytes: id -> the bytes an ordinary token spells, b"" for a special token (`token_bytes_of`).
        tools: whether the request declared tools; without, `<|tool_call>` is content.
        stream_calls: True when the calls are constrained by a grammar, so they are valid as they come:
            `CallStart` goes out once the name is read and `CallArguments` as they are transcoded. False:
            each call is held until it closes and parses, then goes out as `CallStart` and one
            `CallArguments`; one that does not parse comes back as `Content` (its ids) and counts in
            `malformed`.

    Attributes:
        calls: the completed calls, in order.
        malformed: calls that did not parse (their ids came back as content, unless their CallStart had
            already been streamed: then they are dropped, and their index is not reused).
    """

    def __init__(self, fmt: GemmaFormat | None, thinking: tuple[int, int] | None,
                 token_bytes: Callable[[int], bytes], *, tools: bool, stream_calls: bool) -> None:
        self._fmt = fmt if tools else None
        self._thinking = thinking
        self._token_bytes = token_bytes
        self._stream = stream_calls
        self._state = _TEXT
        self._label = b""
        self._call: _Call | None = None
        self._started = 0  # calls whose CallStart went out
        self._out: list[Event] = []
        self.calls: list[ToolCall] = []
        self.malformed = 0

    def feed(self, ids: list[int]) -> list[Event]:
        """Read the next generated ids; return what they complete (runs of content or reasoning merged)."""
        for i in ids:
            self._token(i)
        out, self._out = self._out, []
        return out

    def close(self) -> list[Event]:
        """The reply ended: an unterminated call comes back as content (counted in `malformed`)."""
        if self._state == _CALL:
            self._fail()
        self._state = _TEXT
        out, self._out = self._out, []
        return out

    # -- dispatch on the state

    def _token(self, i: int) -> None:
        if self._state == _CALL:
            self._call_token(i)
        elif self._state in (_LABEL, _THOUGHT):
            self._thought_token(i)
        else:
            self._text_token(i)

    def _text_token(self, i: int) -> None:
        if self._fmt is not None and i == self._fmt.tool_call_start:
            self._state, self._call = _CALL, _Call(ids=[i])
        elif self._thinking is not None and i == self._thinking[0]:
            self._state, self._label = _LABEL, b""
        else:
            self._emit(Content, [i])

    def _thought_token(self, i: int) -> None:
        if i == self._thinking[1]:
            self._state = _TEXT
        elif self._state == _THOUGHT:
            self._emit(Reasoning, [i])
        else:
            self._label += self._token_bytes(i)
            if self._label == THOUGHT_LABEL:
                self._state = _THOUGHT
            elif not THOUGHT_LABEL.startswith(self._label):
                # Another channel name, or a token running past the label: kept as reasoning.
                self._state = _THOUGHT
                self._emit(Reasoning, [i])

    def _call_token(self, i: int) -> None:
        call = self._call
        fmt = self._fmt
        call.ids.append(i)
        try:
            if i == fmt.tool_call_end:
                self._chars(call.decoder.decode(b"", final=True))
                if call.args is None or not call.args.done:
                    raise Malformed("<tool_call|> before the arguments closed")
                self._finish()
            elif i == fmt.quote:
                self._chars(call.decoder.decode(b"", final=True))
                if call.args is None:
                    raise Malformed('<|"|> in the function name')
                self._arguments(call.args.quote())
            elif not self._token_bytes(i):
                raise _SpecialInCall()
            else:
                self._chars(call.decoder.decode(self._token_bytes(i)))
        except _SpecialInCall:
            call.ids.pop()
            self._fail()
            self._text_token(i)
        except Malformed:
            self._fail()

    def _chars(self, text: str) -> None:
        call = self._call
        for n, c in enumerate(text):
            if call.args is not None:
                self._arguments(call.args.text(text[n:]))
                return
            self._head(c)

    def _head(self, c: str) -> None:
        call = self._call
        if len(call.head) < len(CALL_PREFIX):
            if c != CALL_PREFIX[len(call.head)]:
                raise Malformed(f"{c!r} where {CALL_PREFIX!r} is expected")
            call.head += c
        elif c == "{":
            name = call.head[len(CALL_PREFIX):]
            if not name:
                raise Malformed("a call without a name")
            call.name, call.args = name, GemmaToJson()
            if self._stream:
                call.index, call.id = self._started, new_call_id()
                self._started += 1
                self._out.append(CallStart(call.index, call.id, name))
            self._arguments(call.args.start())
        elif c.isalnum() or c in "_-.":
            call.head += c
        else:
            raise Malformed(f"{c!r} in a function name")

    def _arguments(self, text: str) -> None:
        call = self._call
        if not text:
            return
        call.json.append(text)
        if call.index is not None:
            self._emit_arguments(call.index, text)

    def _finish(self) -> None:
        call = self._call
        arguments = "".join(call.json)
        if call.index is None:
            call.index, call.id = self._started, new_call_id()
            self._started += 1
            self._out.append(CallStart(call.index, call.id, call.name))
            self._emit_arguments(call.index, arguments)
        self.calls.append(ToolCall(call.id, call.name, arguments))
        self._state, self._call = _TEXT, None

    def _fail(self) -> None:
        """The call does not parse: its ids are content, unless its CallStart already went out."""
        call = self._call
        self.malformed += 1
        if call.index is None:
            self._emit(Content, call.ids)
        self._state, self._call = _TEXT, None

    # -- output

    def _emit(self, kind: type[Content] | type[Reasoning], ids: list[int]) -> None:
        if self._out and type(self._out[-1]) is kind:
            self._out[-1].ids.extend(ids)
        else:
            self._out.append(kind(list(ids)))

    def _emit_arguments(self, index: int, text: str) -> None:
        last = self._out[-1] if self._out else None
        if isinstance(last, CallArguments) and last.index == index:
            self._out[-1] = CallArguments(index, last.text + text)
        else:
            self._out.append(CallArguments(index, text))


class _SpecialInCall(Exception):
    """A special token other than `<|"|>` and `<tool_call|>` inside a call: it ends the call, and is read
    again as text (a new `<|tool_call>`, the eos that cut the call)."""

