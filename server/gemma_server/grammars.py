"""Grammars that constrain a reply: JSON for structured outputs, Gemma 4's native call syntax for tool calls.

Written in llguidance's Lark dialect (llguidance 1.9.1, `src/lark/`; compiled by `gemma_engine.Grammars`):
a rule may embed a JSON Schema as `%json {...}`, and names a special token by id as `<[52]>`, which no text
can spell. Special tokens are never UTF-8, so a regex such as the string body `/(?s:.)*/` cannot run past the
`<|"|>` that closes it.

`tool_grammar` turns each tool's JSON Schema `parameters` into the call syntax that Gemma 4's chat template
renders (`<|tool_call>call:NAME{key:value,...}<tool_call|>`, Transformers 5.18 `transformers/cli/serving/
utils.py` and vLLM `examples/tool_chat_template_gemma4.jinja`): keys bare, in the template's order
(Jinja's `dictsort`, case-insensitive), strings between `<|"|>` tokens, numbers, booleans and null bare. So
a forced call always parses (`toolcalls.ReplySplitter`) and validates against its schema. A schema keyword
the grammar cannot enforce is a `SchemaError` naming where it is, never a call that might not validate.

A request states what its reply must follow as a `Constraint` (protocol/requests.py's `constraint()`: a forced
tool_choice, response_format, vLLM's structured_outputs or guided_json); `grammar_text` turns it into the
grammar the engine compiles, and a schema it cannot take into a 400 naming the request field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gemma_server.errors import bad_request
from gemma_server.toolcalls import GemmaFormat

# Logit bias that rules a token out (`forbid_calls`): the engine takes finite biases only, and no softcapped
# logit (|x| <= 30 for Gemma 4) comes back from it.
FORBID_BIAS = -1e9

# Keywords that only annotate a schema: nothing to enforce.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                          "deprecated", "readOnly", "writeOnly"})
_COMMON = frozenset({"type", "enum", "const", "anyOf", "oneOf", "nullable"})
_TYPE_KEYWORDS = {
    "string": frozenset({"minLength", "maxLength", "format"}),
    "integer": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
    "boolean": frozenset(),
    "null": frozenset(),
    "array": frozenset({"items", "minItems", "maxItems"}),
    "object": frozenset({"properties", "required", "additionalProperties"}),
}
# String formats enforced by a regex (RFC 3339 date and date-time, RFC 4122 UUID); others are refused.
_FORMATS = {
    "date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "date-time": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])[Tt ]([01][0-9]|2[0-3]):[0-5][0-9]:"
                 r"([0-5][0-9]|60)(\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
}
# Keys and function names the template writes bare and the parsers read back: Transformers' gemma4
# response template reads `call:(?P<name>\w+)` and its json parser quotes keys matching `\w+`.
_BARE_NAME = re.compile(r"\w+")
# Terminals of the call syntax (RFC 8259's number grammar; a string's text is any run of characters).
_TERMINALS = {
    "TEXT": r"/(?s:.)*/",
    "INTEGER": r"/-?(0|[1-9][0-9]*)/",
    "NUMBER": r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/",
    "KEY": r"/\w+/",
}


class SchemaError(ValueError):
    """A schema the grammar cannot enforce; `path` names the part (e.g.
    `tools[0].function.parameters.properties.when.format`)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


def _token(marker: int | str) -> str:
    """A special token in Lark: by id (`<[12]>`), or by its text (`<|channel>`)."""
    return f"<[{marker}]>" if isinstance(marker, int) else marker


def _literal(text: str) -> str:
    """A Lark string literal (llguidance reads it as a JSON string)."""
    return json.dumps(text, ensure_ascii=False)


def _thought_rules(thinking: tuple[int | str, int | str], max_tokens: int | None) -> list[str]:
    """`thought: <|channel> "thought\\n" text <channel|>`, the text bounded to `max_tokens` tokens."""
    start, end = (_token(m) for m in thinking)
    bound = f"[max_tokens={max_tokens}]" if max_tokens is not None else ""
    return [f'thought: {start} "thought\\n" thought_text {end}', f"thought_text{bound}: /(?s:.)*/"]


def json_grammar(schema: dict | None, *, thinking: tuple[int | str, int | str] | None = None,
                 thinking_max_tokens: int | None = None) -> str:
    """A reply that is one JSON value valid for `schema` (llguidance's own JSON Schema support).

    Args:
        schema: a JSON Schema; None for any JSON object (response_format json_object).
        thinking: (`<|channel>`, `<channel|>`) as ids or texts: the reply may open with a thought.
        thinking_max_tokens: the most tokens the thought may take.

    Returns:
        llguidance Lark text.
    """
    body = json.dumps({"type": "object"} if schema is None else schema, ensure_ascii=False)
    if thinking is None:
        return f"start: %json {body}\n"
    rules = ["start: thought? answer", f"answer: %json {body}", *_thought_rules(thinking, thinking_max_tokens)]
    return "\n".join(rules) + "\n"


def forbid_calls(fmt: GemmaFormat) -> dict[int, float]:
    """The logit bias of tool_choice "none": `<|tool_call>` is never sampled."""
    return {fmt.tool_call_start: FORBID_BIAS}


def tool_grammar(tools: Sequence[dict], fmt: GemmaFormat, *, name: str | None = None, parallel: bool = True,
                 thinking: tuple[int | str, int | str] | None = None, thinking_max_tokens: int | None = None) -> str:
    """A reply of tool calls in Gemma 4's syntax, each valid for its function's `parameters`.

    Args:
        tools: the request's tools (`{"type": "function", "function": {"name", "parameters", ...}}`).
        fmt: the tokenizer's markers.
        name: only this function may be called (tool_choice naming one).
        parallel: False for exactly one call; True for one or more.
        thinking: (`<|channel>`, `<channel|>`) as ids or texts: the reply may open with a thought.
        thinking_max_tokens: the most tokens the thought may take.

    Returns:
        llguidance Lark text.

    Raises:
        SchemaError: a schema part the grammar cannot enforce, a name that cannot be written bare, or a
            `name` that no tool declares.
    """
    rules = _Rules(fmt)
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") or {}
        fname = function.get("name")
        if name is not None and fname != name:
            continue
        path = f"tools[{i}].function"
        if not isinstance(fname, str) or not _BARE_NAME.fullmatch(fname):
            raise SchemaError(f"{path}.name", "a function name must be letters, digits and underscores")
        args = rules.parameters(function.get("parameters"), f"{path}.parameters")
        functions.append(rules.add(f"fn_{i}", f'{_literal(fname)} {args}'))
    if not functions:
        raise SchemaError("tool_choice.function.name", f"no tool named {name!r} is declared")
    call = f'{_token(fmt.tool_call_start)} "call:" ({" | ".join(functions)}) {_token(fmt.tool_call_end)}'
    head = ["start: thought? calls" if thinking else "start: calls", f"calls: call{'+' if parallel else ''}",
            f"call: {call}"]
    if thinking:
        head += _thought_rules(thinking, thinking_max_tokens)
    return "\n".join(head + rules.lines()) + "\n"


@dataclass(frozen=True)
class Constraint:
    """What a request's output must follow, as the request says it (protocol/requests.py's `constraint()` methods make
    it; `grammar_text` builds its grammar with the tokenizer's markers).

    Attributes:
        kind: "json" (a JSON value of `schema`; None: any object), "tools" (calls of the request's tools,
            `name` alone when named), "choice" (one of `choices`) or "grammar" (llguidance Lark `grammar`).
        param: the request field it came from (a 400 about it names this field).
    """

    kind: Literal["json", "tools", "choice", "grammar"]
    param: str
    schema: dict[str, Any] | None = None
    name: str | None = None
    choices: tuple[str, ...] = ()
    grammar: str | None = None


def _compact(schema: dict[str, Any] | None) -> dict[str, Any]:
    """`schema` (None: any object) with llguidance's `x-guidance` option for JSON without free whitespace
    (llguidance 1.9.1 src/json/compiler.rs `JsonCompileOptions.whitespace_flexible`, true by default), unless
    the schema sets its own: a model could otherwise spend every token on whitespace the grammar allows
    (vLLM's `disable_any_whitespace` for the same reason)."""
    schema = {"type": "object"} if schema is None else schema
    if "x-guidance" in schema:
        return schema
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def grammar_text(c: Constraint, tools: list[dict[str, Any]], fmt: GemmaFormat,
                 thinking: tuple[str, str] | None, parallel: bool) -> str:
    """The llguidance grammar of constraint `c`.

    Args:
        c: the request's constraint.
        tools: the request's tools as dicts (for "tools").
        fmt: the tokenizer's markers (for "tools").
        thinking: the thought channel's marker texts when the reply may think first, else None.
        parallel: several calls may follow one another (parallel_tool_calls).
    Raises:
        ApiError: 400 naming the field (and the schema path) of a schema the grammars cannot take.
    """
    try:
        if c.kind == "json":
            return json_grammar(_compact(c.schema), thinking=thinking)
        if c.kind == "tools":
            return tool_grammar(tools, fmt, name=c.name, parallel=parallel, thinking=thinking)
    except SchemaError as e:
        path = e.path
        param = path if path.startswith(("tools", "tool_choice")) else c.param + (f".{path}" if path else "")
        raise bad_request(param, f"The schema cannot be enforced: {e}") from e
    if c.kind == "choice":
        return "start: " + " | ".join(_literal(x) for x in c.choices)
    return c.grammar or ""


@dataclass
class _Rules:
    """The rules of one grammar, named as they are made; terminals and generic values added when used."""

    fmt: GemmaFormat
    rules: dict[str, str] = field(default_factory=dict)
    terminals: set[str] = field(default_factory=set)

    def add(self, name: str, body: str) -> str:
        self.rules[name] = body
        return name

    def terminal(self, name: str) -> str:
        self.terminals.add(name)
        return name

    def lines(self) -> list[str]:
        return [f"{n}: {b}" for n, b in self.rules.items()] + [f"{t}: {_TERMINALS[t]}" for t in sorted(self.terminals)]

    @property
    def quote(self) -> str:
        return _token(self.fmt.quote)

    # -- schemas

    def parameters(self, schema: Any, path: str) -> str:
        """The argument object of one function (no parameters: `{}`)."""
        if schema is None or schema == {}:
            return '"{" "}"'
        if not isinstance(schema, dict):
            raise SchemaError(path, "parameters must be a JSON Schema object")
        if schema.get("type", "object") != "object":
            raise SchemaError(f"{path}.type", 'the parameters of a function must be of type "object"')
        return self.value(schema, path)

    def value(self, schema: Any, path: str) -> str:
        """An expansion for a value valid for `schema`."""
        if schema is True or schema == {}:
            return self.any_value()
        if not isinstance(schema, dict):
            raise SchemaError(path, "a schema must be an object")
        types = _types(schema, path)
        _check_keywords(schema, types, path)
        if "const" in schema:
            alternatives = [self.literal(schema["const"], f"{path}.const")]
        elif "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise SchemaError(f"{path}.enum", "enum must be a non-empty array")
            alternatives = [self.literal(v, f"{path}.enum[{k}]") for k, v in enumerate(schema["enum"])]
        elif "anyOf" in schema or "oneOf" in schema:
            # oneOf is read as anyOf: a value matching two branches would have to be excluded, which a
            # context-free grammar of alternatives cannot do; every value it allows still validates when
            # the branches do not overlap, as in a discriminated union.
            key = "anyOf" if "anyOf" in schema else "oneOf"
            branches = schema[key]
            if not isinstance(branches, list) or not branches:
                raise SchemaError(f"{path}.{key}", f"{key} must be a non-empty array")
            alternatives = [self.value(b, f"{path}.{key}[{k}]") for k, b in enumerate(branches)]
        elif types is None:
            alternatives = [self.any_value()]
        else:
            alternatives = [self.typed(t, schema, path) for t in types]
        if schema.get("nullable") is True and '"null"' not in alternatives:
            alternatives.append('"null"')
        return alternatives[0] if len(alternatives) == 1 else "(" + " | ".join(alternatives) + ")"

    def typed(self, kind: str, schema: dict, path: str) -> str:
        if kind == "string":
            return self.string(schema, path)
        if kind in ("integer", "number"):
            return self.number(kind, schema)
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"null"'
        if kind == "array":
            return self.array(schema, path)
        return self.object(schema, path)

    def string(self, schema: dict, path: str) -> str:
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        fmt = schema.get("format")
        if fmt is not None:
            if fmt not in _FORMATS:
                raise SchemaError(f"{path}.format", f"format {fmt!r} cannot be enforced")
            if lo is not None or hi is not None:
                raise SchemaError(f"{path}.format", "format with minLength/maxLength cannot be enforced")
            return f"{self.quote} /{_FORMATS[fmt]}/ {self.quote}"
        if lo is None and hi is None:
            return f"{self.quote} {self.terminal('TEXT')} {self.quote}"
        for key, bound in (("minLength", lo), ("maxLength", hi)):
            if bound is not None and (not isinstance(bound, int) or isinstance(bound, bool) or bound < 0):
                raise SchemaError(f"{path}.{key}", f"{key} must be a non-negative integer")
        return f"{self.quote} /(?s:.){{{lo or 0},{'' if hi is None else hi}}}/ {self.quote}"

    def number(self, kind: str, schema: dict) -> str:
        bounds = {k: schema[k] for k in _TYPE_KEYWORDS[kind] if k in schema}
        if not bounds:
            return self.terminal("INTEGER" if kind == "integer" else "NUMBER")
        # A JSON number is written the same way in Gemma's syntax: llguidance's JSON Schema compiler
        # enforces the bounds.
        return "%json " + json.dumps({"type": kind, **bounds})

    def array(self, schema: dict, path: str) -> str:
        item = self.value(schema.get("items", True), f"{path}.items")
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        for key, bound in (("minItems", lo), ("maxItems", hi)):
            if bound is not None and (not isinstance(bound, int) or isinstance(bound, bool) or bound < 0):
                raise SchemaError(f"{path}.{key}", f"{key} must be a non-negative integer")
        if hi is not None and hi < lo:
            raise SchemaError(f"{path}.maxItems", "maxItems is below minItems")
        if hi == 0:
            return '"[" "]"'
        rest = f'("," {item})'
        if hi is None:
            more = f"{rest}*" if lo <= 1 else f"({rest} ~ {lo - 1}) {rest}*"
        else:
            more = f"{rest} ~ {max(lo - 1, 0)}..{hi - 1}"
        items = f"{item} {more}"
        return f'"[" {items} "]"' if lo >= 1 else f'"[" ({items})? "]"'

    def object(self, schema: dict, path: str) -> str:
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        if properties is None:
            if extra is False:
                return '"{" "}"'
            if extra not in (None, True):
                raise SchemaError(f"{path}.additionalProperties",
                                  "a schema for additional properties cannot be enforced")
            return self.any_object()
        if not isinstance(properties, dict):
            raise SchemaError(f"{path}.properties", "properties must be an object")
        if extra not in (None, False):
            raise SchemaError(f"{path}.additionalProperties",
                              "additional properties beside declared ones cannot be enforced in the "
                              "template's key order")
        required = schema.get("required", [])
        if not isinstance(required, list) or any(k not in properties for k in required):
            raise SchemaError(f"{path}.required", "required must list declared properties")
        # The template writes the keys of an argument dict through Jinja's dictsort: case-insensitive order.
        members = []
        for key in sorted(properties, key=str.lower):
            if not _BARE_NAME.fullmatch(key):
                raise SchemaError(f"{path}.properties.{key}", "a key must be letters, digits and underscores")
            value = self.value(properties[key], f"{path}.properties.{key}")
            members.append((f"{_literal(key + ':')} {value}", key in required))
        if len(members) > 1 and not all(r for _, r in members):
            # Each member appears in several alternatives (`_members`): named once, referred to by name.
            members = [(self.add(f"member_{len(self.rules)}", m), r) for m, r in members]
        return f'"{{" {_members(members)} "}}"'

    def literal(self, value: Any, path: str) -> str:
        """The expansion of one value as the template renders it."""
        if isinstance(value, str):
            return f"{self.quote} {_literal(value)} {self.quote}" if value else f"{self.quote} {self.quote}"
        if value is None or isinstance(value, bool):
            return _literal(json.dumps(value))
        if isinstance(value, (int, float)):
            return _literal(str(value))
        if isinstance(value, list):
            inner = ' "," '.join(self.literal(v, f"{path}[{k}]") for k, v in enumerate(value))
            return f'"[" {inner} "]"'
        if isinstance(value, dict):
            if not all(isinstance(k, str) and _BARE_NAME.fullmatch(k) for k in value):
                raise SchemaError(path, "a key must be letters, digits and underscores")
            inner = ' "," '.join(f"{_literal(k + ':')} {self.literal(value[k], f'{path}.{k}')}"
                                 for k in sorted(value, key=str.lower))
            return f'"{{" {inner} "}}"'
        raise SchemaError(path, f"{type(value).__name__} is not a JSON value")

    # -- any value, in Gemma's syntax

    def any_value(self) -> str:
        if "any_value" not in self.rules:
            string = f'{self.quote} {self.terminal("TEXT")} {self.quote}'
            self.add("any_value", f'{string} | {self.terminal("NUMBER")} | "true" | "false" | "null" | any_object | any_array')
            self.add("any_object", f'"{{" ({self.terminal("KEY")} ":" any_value ("," KEY ":" any_value)*)? "}}"')
            self.add("any_array", '"[" (any_value ("," any_value)*)? "]"')
        return "any_value"

    def any_object(self) -> str:
        self.any_value()
        return "any_object"


def _members(members: list[tuple[str, bool]]) -> str:
    """An object's members in order, each optional one may be absent, with commas between those present.

    The first member written is some member j such that every member before it is optional; after it,
    every later member is `("," m)` (optional: `?`). Size O(n^2) in the number of members."""
    if not members:
        return ""
    alternatives = []
    for j, (member, required) in enumerate(members):
        rest = " ".join(f'("," {m})' + ("" if r else "?") for m, r in members[j + 1:])
        alternatives.append(f"{member} {rest}".strip())
        if required:
            break
    else:
        alternatives.append("")  # every member optional: the object may be empty
    if len(alternatives) == 1:
        return alternatives[0]
    body = " | ".join(a for a in alternatives if a)
    return f"({body})" + ("?" if "" in alternatives else "")


def _types(schema: dict, path: str) -> list[str] | None:
    """The schema's types (a list), inferred as object from `properties`; None for any type."""
    kind = schema.get("type")
    if kind is None:
        return ["object"] if "properties" in schema else None
    kinds = kind if isinstance(kind, list) else [kind]
    for k in kinds:
        if k not in _TYPE_KEYWORDS:
            raise SchemaError(f"{path}.type", f"unknown type {k!r}")
    return kinds


def _check_keywords(schema: dict, types: list[str] | None, path: str) -> None:
    """Every keyword is one the grammar enforces (or an annotation); else SchemaError at it."""
    allowed = _COMMON | _ANNOTATIONS
    for kind in types or ():
        allowed |= _TYPE_KEYWORDS[kind]
    for key in schema:
        if key not in allowed:
            raise SchemaError(f"{path}.{key}", f"{key} cannot be enforced here")
    if "anyOf" in schema and "oneOf" in schema:
        raise SchemaError(f"{path}.oneOf", "anyOf and oneOf together cannot be enforced")
