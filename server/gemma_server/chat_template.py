"""A request's prompt ids: the checkpoint's chat template rendered and tokenized (chat completions), or the
prompt tokenized (legacy completions).

The template is the checkpoint's own (Transformers' `apply_chat_template`), never one from a request, and a
request's chat_template_kwargs reach it only under the names it reads (vLLM's `resolve_chat_template_kwargs`
in vllm/entrypoints/chat_utils.py). A control token typed into a message stays text: only the template's own
markup becomes control tokens, so a message cannot forge a turn. The same holds for every other text of the
client's that the template shows: tool descriptions, reasoning, the string arguments of an assistant's tool
calls and tool results (a `<|tool_call>` typed into a tool result stays text, so a tool's output cannot forge a
call). Where such text holds a control token's text, the template renders the conversation once more with a
placeholder for each client text, and the prompt is spliced by position (`mark`, `splice`): the markup
between placeholders is tokenized with control tokens, the client's texts as plain text, wherever the
template puts them (Google's later Gemma 4 template writes a call's results before its turn's own content).
What a template matches, sorts or reformats (names, ids, mapping keys, tool parameters, template variables)
cannot hold a placeholder, so control-token text there is a 400 naming the field; and of a tool's function
only its name, description and parameters reach the template. Text the tokenizer cannot take (a lone UTF-16
surrogate from a JSON escape) is a 400 naming the field, not a 500.

Tools reach the template as Transformers' `apply_chat_template(tools=...)` passes them (OpenAI's shape), and
an assistant's tool-call arguments as objects: Gemma 4's templates render a mapping in its own call syntax
(vLLM's `vllm/entrypoints/chat_utils.py` decodes them the same way for such templates).

Tool results go where the checkpoint's template wants them (`gemma_turns`). Google's Gemma 4 templates read
a call's results from the model turn that made it (`message['tool_responses']`: `<|tool_call>call:f{...}
<tool_call|><|tool_response>response:f{...}<tool_response|>`, the model going on in the same turn), and the
first published revision has no `tool` role: an OpenAI `tool` message would render as a `<|turn>tool` turn of
its own, after the model turn was closed, a shape the model never saw in training. For such a template each
`tool` message becomes a `tool_responses` entry of the assistant message whose call it answers, and an
assistant message after the results continues that turn; a template that renders `tool` messages itself
(the later revision, the tests' own) gets them as they are. For every template a `tool` message must answer
a call of the assistant message before its run of results, under that call's function name
(`answered_calls`): the later template would render an unanswered result under the message's own `name`.
An assistant turn's `reasoning_content` reaches a template that reads it on the turns Gemma 4's templates
render it on: those with tool calls after the last user turn.

A chat prompt's cache boundary (`cache_boundary`) is where its leading system/developer turn and tool
declarations end: the part every user of one agent shares. The engine snapshots its sliding-window KV
there, so another conversation with the same system prompt and tools reuses that prefix (Gemma 4's sliding
layers can resume only where a snapshot was taken or where an earlier request's history ends).
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from typing import Any

from gemma_server.errors import ApiError, bad_request
from gemma_server.protocol.requests import ChatCompletionRequest, CompletionRequest

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
    return chat_prompt(tokenizer, request, mark=False)[0]


@dataclass(frozen=True)
class CacheMarks:
    """Where the engine keeps copies of a chat prompt's sliding-window rings for later requests (prefix
    caching; rust/python/gemma_engine `Request`'s `cache_boundary` and `next_turn`).

    Attributes:
        boundary: where the part every user of one agent shares ends (`cache_boundary`), or None.
        next_turn: where the conversation's next turn departs from this prompt, when that is before its
            last token (`next_turn`), or None.
    """

    boundary: int | None = None
    next_turn: int | None = None


def chat_prompt(tokenizer, request: ChatCompletionRequest, mark: bool = True) -> tuple[list[int], CacheMarks]:
    """The request's prompt ids (`render_chat`) and, when `mark`, its cache marks.

    Returns:
        (ids, marks): `cache_boundary`'s and `next_turn`'s answers, both None without `mark`.
    Raises:
        ApiError: as render_chat.
    """
    kwargs = template_kwargs(tokenizer, request.chat_template_kwargs or {})
    sent = request.template_messages()
    messages = gemma_turns(sent, tokenizer.chat_template)
    tools = request.template_tools()
    ids = render_messages(tokenizer, messages, tools, kwargs, request.add_generation_prompt)
    if not mark:
        return ids, CacheMarks()
    return ids, CacheMarks(cache_boundary(tokenizer, messages, tools, kwargs, ids),
                           next_turn(tokenizer, sent, tools, kwargs, ids))


@dataclass(frozen=True)
class TemplateShape:
    """What a chat template does with tool results and thoughts (`template_shape`).

    Attributes:
        folds_tool_results: it reads results from the model turn (`tool_responses`) and renders no `tool`
            role itself, so `tool` messages are folded into the turn that called (`fold_tool_results`).
        reads_reasoning: it reads an assistant turn's `reasoning_content`.
    """

    folds_tool_results: bool
    reads_reasoning: bool


@functools.lru_cache(maxsize=8)
def template_shape(template: str | None) -> TemplateShape:
    """Read from the template's syntax tree (jinja2's parser): whether it names `tool_responses`, whether it
    compares anything with the role name 'tool' (`message['role'] == 'tool'`, `!= 'tool'`, `in [...]`),
    and whether it names `reasoning_content`."""
    import jinja2
    from jinja2 import nodes

    if not isinstance(template, str):
        return TemplateShape(False, False)
    tree = jinja2.Environment().parse(template)
    names = {n.value for n in tree.find_all(nodes.Const) if isinstance(n.value, str)}
    names |= {n.attr for n in tree.find_all(nodes.Getattr)}

    def names_tool(node) -> bool:
        return any(isinstance(c, nodes.Const) and c.value == "tool" for c in [node, *node.find_all(nodes.Const)])

    compares_tool = any(names_tool(c.expr) or any(names_tool(op.expr) for op in c.ops)
                        for c in tree.find_all(nodes.Compare))
    return TemplateShape("tool_responses" in names and not compares_tool, "reasoning_content" in names)


def gemma_turns(messages: list[dict[str, Any]], template: str | None) -> list[dict[str, Any]]:
    """`messages` (ChatCompletionRequest.template_messages) fitted to the checkpoint's `template`: tool
    results checked against the calls they answer (`answered_calls`, for every template), folded into the turn
    that called when the template wants them there, and reasoning_content kept only where it reads and renders
    it (on assistant turns with tool calls after the last user turn).

    Raises:
        ApiError: as `answered_calls`.
    """
    shape = template_shape(template)
    answered = answered_calls(messages)
    if shape.folds_tool_results:
        messages = fold_tool_results(messages, answered)
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out = []
    for i, m in enumerate(messages):
        if "reasoning_content" in m and not (shape.reads_reasoning and i > last_user and m.get("tool_calls")):
            m = {k: v for k, v in m.items() if k != "reasoning_content"}
        out.append(m)
    return out


def answered_calls(messages: list[dict[str, Any]]) -> dict[int, tuple[int, int]]:
    """For each `tool` message, the call it answers: (the calling assistant message's index, the call's
    index in its `tool_calls`). A tool message answers a call of the assistant message before its run of
    tool messages, by `tool_call_id`; its `name`, when given, is that call's function. Checked for every
    template: Google's later Gemma 4 template renders an unanswered result under the tool message's own
    `name` (`| default('unknown')`), a turn no call asked for.

    Raises:
        ApiError: 400 naming `messages[i].tool_call_id` for a tool message that answers no call of the
            assistant message before it, or `messages[i].name` for a name that is not the call's function.
    """
    out: dict[int, tuple[int, int]] = {}
    calling: int | None = None  # the assistant message whose results the tool messages give
    for i, m in enumerate(messages):
        if m["role"] != "tool":
            calling = i if m["role"] == "assistant" and m.get("tool_calls") else None
            continue
        calls = messages[calling]["tool_calls"] if calling is not None else []
        answered = next((k for k, c in enumerate(calls) if c.get("id") == m.get("tool_call_id")), None)
        if answered is None:
            raise bad_request(f"messages[{i}].tool_call_id",
                              f"messages[{i}].tool_call_id {str(m.get('tool_call_id'))[:80]!r} answers no tool "
                              "call of the assistant message before it.")
        function = calls[answered]["function"]["name"]
        if m.get("name") is not None and m["name"] != function:
            raise bad_request(f"messages[{i}].name", f"messages[{i}].name {str(m['name'])[:80]!r} is not the "
                                                     f"function of the call it answers ({function!r}).")
        out[i] = (calling, answered)
    return out


def fold_tool_results(messages: list[dict[str, Any]], answered: dict[int, tuple[int, int]]) -> list[dict[str, Any]]:
    """OpenAI's `tool` messages as Gemma 4's `tool_responses` (pure; the input is not changed).

    Each tool message becomes `{"name": <the answered call's function>, "response": <the content as a
    mapping when it is a JSON object's text, else the text>}` on the assistant message whose call it answers
    (`answered`: `answered_calls`' reading of `messages`). Results are in the order of the calls they answer.
    An assistant message without tool calls that follows the results continues that model turn: its content
    joins the turn's (Gemma 4's later template renders the two messages the same way, as one turn).
    """
    out: list[dict[str, Any]] = []
    folded: dict[int, dict[str, Any]] = {}  # a calling message's index -> its copy in `out`
    results: list[tuple[int, dict[str, Any]]] = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            calling, call = answered[i]
            results.append((call, {"name": messages[calling]["tool_calls"][call]["function"]["name"],
                                   "response": tool_response(m.get("content") or "")}))
            folded[calling]["tool_responses"] = [r for _, r in sorted(results, key=lambda r: r[0])]
            continue
        results = []
        previous = out[-1] if out else None
        if (m["role"] == "assistant" and not m.get("tool_calls") and previous is not None
                and previous.get("tool_responses")):
            previous["content"] = "\n\n".join(t for t in (previous["content"], m["content"]) if t)
            continue
        m = dict(m)
        out.append(m)
        folded[i] = m
    return out


def tool_response(content: str) -> Any:
    """A tool message's content as Gemma 4's templates take a response: the mapping when it is a JSON
    object's text (rendered `response:f{key:value,...}`), else the text (rendered `response:f{value:...}`)."""
    try:
        value = json.loads(content)
    except ValueError:
        return content
    return value if isinstance(value, dict) else content


def leading_shared(messages: list[dict[str, Any]]) -> int:
    """How many messages open the conversation as system or developer turns."""
    count = 0
    while count < len(messages) and messages[count]["role"] in ("system", "developer"):
        count += 1
    return count


def cache_boundary(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   kwargs: dict[str, Any], prompt_ids: list[int]) -> int | None:
    """Where the part of a chat prompt that every user of one agent shares ends: the leading system and
    developer messages and the tool declarations, rendered alone (same tools and template variables, no
    generation prompt) through `render_messages`. That is the boundary when its ids are a strict prefix of
    `prompt_ids` longer than one token. Otherwise None: nothing leads, the template folds the system text
    into the first user turn (Gemma 3's: the shared part is BOS alone), or it renders the shared part
    differently once more messages follow.

    Args:
        tokenizer: the checkpoint's tokenizer (with its chat template).
        messages, tools: as the full prompt rendered them (ChatCompletionRequest.template_messages,
            template_tools).
        kwargs: the template variables the full prompt was rendered with (`template_kwargs`).
        prompt_ids: the full prompt's ids.
    Returns:
        the boundary b, 1 < b < len(prompt_ids), or None.
    """
    lead = leading_shared(messages)
    if not lead and not tools:
        return None
    # Transformers renders no empty conversation, so tools without a system message are declared under an
    # empty one: Gemma 4's template writes the same system turn for both; for a template that does not,
    # the prefix test below finds no boundary.
    shared = messages[:lead] or [{"role": "system", "content": ""}]
    try:
        prefix = render_messages(tokenizer, shared, tools, kwargs, add_generation_prompt=False)
    except ApiError:  # a template that wants more than a system turn: no boundary, the prompt still serves
        return None
    if not 1 < len(prefix) < len(prompt_ids) or prompt_ids[:len(prefix)] != prefix:
        return None
    return len(prefix)


# Stand-in replies (`next_turn`): two that begin differently, so that a tokenizer merging a reply's first
# characters into the markup before them cannot move the point past where a real reply departs.
STAND_IN_REPLIES = ("A", "0")


def next_turn(tokenizer, sent: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any],
              prompt_ids: list[int]) -> int | None:
    """Where the conversation's next turn departs from this prompt: the conversation with a stand-in reply
    appended, fitted and rendered as the next request will render it (same tools and template variables),
    and its longest common prefix with `prompt_ids` (the least over STAND_IN_REPLIES). A template may end
    the generation prompt with markup that its rendering of the reply drops: Google's Gemma 4 template ends
    it with an empty thought channel when thinking is off (`<|turn>model\n<|channel>thought\n<channel|>`)
    and renders the reply after `<|turn>model\n` alone, so the next turn departs a few tokens before this
    prompt's end. The engine keeps a copy of its sliding-window rings there, which it could not rebuild
    later (rust/src/engine/prefix.rs). Any template works: the point is read from its own rendering.

    Args:
        tokenizer: the checkpoint's tokenizer (with its chat template).
        sent: the messages as the request sent them (ChatCompletionRequest.template_messages, before
            `gemma_turns`).
        tools, kwargs: as the prompt rendered them.
        prompt_ids: the prompt's ids.
    Returns:
        the point d, 1 <= d < len(prompt_ids) - 1, or None: the next turn keeps the whole prompt (or all but
        its last token, which the engine reads again anyway), the conversation ends with an assistant
        message (a prefill the reply continues), or the template refuses the stand-in.
    """
    if not sent or sent[-1]["role"] == "assistant":
        return None
    points = []
    for reply in STAND_IN_REPLIES:
        turn = gemma_turns([*sent, {"role": "assistant", "content": reply}], tokenizer.chat_template)
        try:
            ids = render_messages(tokenizer, turn, tools, kwargs, add_generation_prompt=False)
        except ApiError:
            return None
        points.append(next((i for i, (a, b) in enumerate(zip(prompt_ids, ids)) if a != b), min(len(ids),
                                                                                             len(prompt_ids))))
    point = min(points)
    return point if 1 <= point < len(prompt_ids) - 1 else None


def render_messages(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    kwargs: dict[str, Any], add_generation_prompt: bool) -> list[int]:
    """The chat template over `messages` and `tools` with template variables `kwargs`, tokenized with the
    client's texts as literals (`render_chat`).

    When no client text holds a control token's text, the rendered text is tokenized whole. Otherwise the
    template renders once more with a placeholder for each client text (`mark`), and the prompt is spliced by
    position (`splice`): the template's markup between the placeholders is tokenized with control tokens, each
    client text as plain text. What the client sends but a template cannot show as text (names, ids, keys,
    tool parameters, template variables) must hold no control token's text (`refuse_control_text`).

    Raises:
        ApiError: as render_chat; 400 naming the field whose text holds a control token's text where no
            placeholder can stand, or that the template changed.
    """
    controls = control_tokens(tokenizer)
    text = apply_template(tokenizer, messages, tools, kwargs, add_generation_prompt)
    marked = mark(messages, tools or [], kwargs, unused_marks(text))
    refuse_control_text(marked.kept, controls)
    if not any(c in body for _, body in marked.bodies for c in controls):
        return encode(tokenizer, text, "messages", add_special_tokens=False)
    with_marks = apply_template(tokenizer, marked.messages, marked.tools or None, kwargs, add_generation_prompt)
    return splice(tokenizer, text, with_marks, marked, controls)


def apply_template(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   kwargs: dict[str, Any], add_generation_prompt: bool) -> str:
    """Transformers' `apply_chat_template(tokenize=False)`, its refusals as 400s.

    Raises:
        ApiError: 400 naming `chat_template_kwargs` (variables that do not fit) or `messages` (the template
            raised).
    """
    import jinja2

    kwargs = dict(kwargs)
    if tools is not None:
        kwargs["tools"] = tools
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs,
        )
    except TypeError as e:
        raise bad_request("chat_template_kwargs", f"Bad chat_template_kwargs: {e}") from e
    except (jinja2.TemplateError, ValueError, ArithmeticError, LookupError) as e:
        raise bad_request("messages", f"The chat template rejected the messages: {e}") from e


@dataclass(frozen=True)
class Marked:
    """A conversation with each client text replaced by a placeholder (`mark`).

    Attributes:
        messages, tools: the template's inputs, each client text a placeholder: its own leading and trailing
            white space, then `open` + its index + `close` (so a template's `trim` trims what it would trim of
            the text itself, and the placeholder stands for the stripped text).
        bodies: (field, stripped text) by index.
        kept: (field, string) of what stays as it is: names, ids, keys, tool parameters, template variables.
        open, close: the two characters that enclose an index.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    bodies: list[tuple[str, str]]
    kept: list[tuple[str, str]]
    open: str
    close: str


def unused_marks(text: str) -> tuple[str, str]:
    """Two characters of Unicode's Private Use Area that `text` (a rendered prompt: the template's markup and
    every client text it shows) does not hold."""
    free = (chr(c) for c in range(0xE000, 0xF900) if chr(c) not in text)
    return next(free), next(free)


# Keys of a message the template matches on or that are enums: kept, not replaced (`mark`).
_MESSAGE_KEPT = frozenset({"role", "tool_call_id", "name"})


def mark(messages: list[dict[str, Any]], tools: list[dict[str, Any]], kwargs: dict[str, Any],
         marks: tuple[str, str]) -> Marked:
    """`messages` and `tools` (the template's, after `gemma_turns`) with every client text the template may
    show as text replaced by a placeholder (pure; the inputs are not changed): a message's content (a string
    or its text items), its reasoning, its tool calls' argument values, its folded tool results' values, and a
    tool's description. Names, ids, roles, mapping keys, tool parameters and template variables are kept and
    listed, since a template compares, sorts or reformats them."""
    open_, close = marks
    bodies: list[tuple[str, str]] = []
    kept: list[tuple[str, str]] = []

    def text(value: str, field: str) -> str:
        core = value.strip()
        if not core:
            return value
        lead, trail = value[:len(value) - len(value.lstrip())], value[len(value.rstrip()):]
        bodies.append((field, core))
        return f"{lead}{open_}{len(bodies) - 1}{close}{trail}"

    def value(v: Any, field: str) -> Any:
        if isinstance(v, str):
            return text(v, field)
        if isinstance(v, dict):
            kept.extend((field, str(k)) for k in v)
            return {k: value(x, field) for k, x in v.items()}
        if isinstance(v, list):
            return [value(x, field) for x in v]
        return v

    def keep(v: Any, field: str) -> Any:
        kept.extend((field, s) for s in _strings(v))
        return v

    def message(m: dict[str, Any], i: int) -> dict[str, Any]:
        field = f"messages[{i}]"
        out: dict[str, Any] = {}
        for key, v in m.items():
            if key in _MESSAGE_KEPT:
                out[key] = keep(v, f"{field}.{key}")
            elif key == "content" and isinstance(v, list):
                out[key] = [{**item, "text": text(item["text"], f"{field}.content")} if item.get("type") == "text"
                            else item for item in v]
            elif key == "tool_calls":
                out[key] = [{**c, "id": keep(c.get("id"), f"{field}.tool_calls[{j}].id"),
                             "function": {"name": keep(c["function"]["name"], f"{field}.tool_calls[{j}].function"),
                                          "arguments": value(c["function"]["arguments"],
                                                             f"{field}.tool_calls[{j}].function.arguments")}}
                            for j, c in enumerate(v)]
            elif key == "tool_responses":
                out[key] = [{"name": keep(r["name"], f"{field}.tool_responses"),
                             "response": value(r["response"], f"{field}.content")} for r in v]
            else:
                out[key] = value(v, f"{field}.{key}")
        return out

    def tool(t: dict[str, Any], i: int) -> dict[str, Any]:
        function = dict(t.get("function") or {})
        field = f"tools[{i}].function"
        if isinstance(function.get("description"), str):
            function["description"] = text(function["description"], f"{field}.description")
        for key in function.keys() - {"description"}:
            keep(function[key], f"{field}.{key}")
        return {**t, "function": function}

    marked_messages = [message(m, i) for i, m in enumerate(messages)]
    marked_tools = [tool(t, i) for i, t in enumerate(tools)]
    for key, v in kwargs.items():
        keep(v, f"chat_template_kwargs.{key}")
    return Marked(marked_messages, marked_tools, bodies, kept, open_, close)


def _strings(value: Any) -> list[str]:
    """Every key and string of a JSON value."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [str(k), *_strings(v)]]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def refuse_control_text(kept: list[tuple[str, str]], controls: list[str]) -> None:
    """A client string that the template copies as it is (a name, an id, a mapping key, a tool's parameter
    schema, a template variable) holding a control token's text is a 400: it has no place that needs one,
    and no placeholder can stand for it (a template sorts keys and matches names).

    Raises:
        ApiError: 400 naming the field.
    """
    for field, s in kept:
        if any(c in s for c in controls):
            raise bad_request(field, f"{field} holds a control token's text.")


def splice(tokenizer, text: str, with_marks: str, marked: Marked, controls: list[str]) -> list[int]:
    """The ids of `text` (the template's rendering) cut where `with_marks` (its rendering of `marked`) has
    placeholders: the markup between them tokenized with control tokens, each client text as plain text.

    Raises:
        ApiError: 400 naming the first field holding a control token's text when the pieces do not make
            `text` (the template changed or moved a client text, so it cannot be told from the markup).
    """
    import re

    pieces = re.split(f"{re.escape(marked.open)}([0-9]+){re.escape(marked.close)}", with_marks)
    markup, indices = pieces[0::2], [int(k) for k in pieces[1::2]]
    if any(k >= len(marked.bodies) for k in indices) or "".join(
            piece for pair in zip(markup, [marked.bodies[k][1] for k in indices] + [""]) for piece in pair) != text:
        field = next(field for field, body in marked.bodies if any(c in body for c in controls))
        raise bad_request(field, f"{field} holds control-token text that the chat template changed; remove it.")
    ids: list[int] = []
    for k, piece in zip(indices + [None], markup):
        ids += encode(tokenizer, piece, "messages", add_special_tokens=False)
        if k is not None:
            field, body = marked.bodies[k]
            ids += encode(tokenizer, body, field, add_special_tokens=False, split_special=True)
    return ids


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
