"""The agent checkpoint, for tool calls and thinking (``save_agent_chat`` -> fixture ``agent_checkpoint``), and
the same weights under Google's own Gemma 4 template (``save_gemma4_chat`` -> fixture ``gemma4_checkpoint``).

The chat checkpoint's layout with Gemma 4's markers (Transformers 5.18 ``transformers/cli/serving/utils.py``,
the "gemma4" response template) as special tokens, ids 0-13: ``<pad> <eos> <bos> <|turn> <turn|> <|tool>
<tool|> <|tool_call> <tool_call|> <|tool_response> <tool_response|> <|"|> <|channel> <channel|>``
(``AGENT_SPECIAL_TOKENS``); config ``eos_token_id`` = [1, 4, 9] (<eos>, <turn|>, <|tool_response>). The
byte-level BPE tokenizer is trained on chat text and the pieces of Gemma's call syntax, without a
pre-tokenizer split, so tokens span keys, colons and braces. ``AGENT_CHAT_TEMPLATE`` (after vLLM's
``examples/tool_chat_template_gemma4.jinja``) renders, for ``tools`` and a user message::

    <bos><|turn>system\n<|tool>declaration:get_weather{description:<|"|>...<|"|>,parameters:{...}}<tool|><turn|>\n
    <|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n

an assistant message with ``tool_calls`` (arguments as dicts) as
``<|turn>model\n<|tool_call>call:get_weather{location:<|"|>Paris<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>``
(keys sorted, strings between ``<|"|>``, numbers, booleans and null bare) and each tool message after it as
``<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>``, in the same model turn.
``enable_thinking`` is one of its variables: true adds a line to the system turn and lets the model open
``<|channel>thought\n...<channel|>`` itself; nothing is pre-filled either way.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer
from transformers.models.gemma4 import Gemma4TextConfig

from tests.checkpoints.chat import CHAT_CORPUS
from tests.checkpoints.shared import byte_level_bpe, save_tokenizer
from tests.checkpoints.text import save_dense, tiny_text_config

# Gemma 4's markers (Transformers 5.18 transformers/cli/serving/utils.py, the "gemma4" response template;
# vLLM examples/tool_chat_template_gemma4.jinja), ids 0-13 in this order. Gemma's own vocabulary has them
# at other ids: code looks them up by text, never by number.
AGENT_SPECIAL_TOKENS = (
    "<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
    "<|tool_response>", "<tool_response|>", '<|"|>', "<|channel>", "<channel|>",
)
AGENT_VOCAB_SIZE = 512
# <eos>, <turn|>, <|tool_response>: a reply ends at the end of the turn, or after its tool calls, where
# the model waits for the results.
AGENT_EOS_IDS = [1, 4, 9]
# Any seed gives a usable checkpoint (the tests of tool calls drive the parser and the grammars with
# rendered text, not with the random model's replies); 0 is the first.
AGENT_SEED = 0

# A value in Gemma 4's call syntax: keys bare and sorted (dictsort, case-insensitive as Jinja's is),
# strings between <|"|> tokens, numbers as Jinja prints them, booleans and null bare. The same macro
# renders the tools' parameter schemas in the declarations.
_AGENT_VALUE_MACRO = (
    "{%- macro gemma_value(v) -%}"
    "{%- if v is string -%}{{ '<|\"|>' + v + '<|\"|>' }}"
    "{%- elif v is boolean -%}{{ 'true' if v else 'false' }}"
    "{%- elif v is none -%}{{ 'null' }}"
    "{%- elif v is mapping -%}{{ '{' }}"
    "{%- for key, item in v | dictsort -%}{{ key + ':' }}{{ gemma_value(item) }}{{ ',' if not loop.last }}{%- endfor -%}"
    "{{ '}' }}"
    "{%- elif v is iterable -%}{{ '[' }}"
    "{%- for item in v -%}{{ gemma_value(item) }}{{ ',' if not loop.last }}{%- endfor -%}"
    "{{ ']' }}"
    "{%- else -%}{{ v }}"
    "{%- endif -%}"
    "{%- endmacro -%}"
)

# Gemma 4's chat format, written for the tests after vLLM's examples/tool_chat_template_gemma4.jinja:
# - a system turn when there is a system message, tools or enable_thinking: the system text, then one
#   <|tool>declaration:NAME{description:<|"|>...<|"|>,parameters:{...}}<tool|> per tool; with
#   enable_thinking it opens with a line asking for thought first (Gemma's own template puts its
#   <|think|> token there; this vocabulary has none). Nothing is pre-filled in the model turn either way:
#   with thinking on the model may open <|channel>thought\n itself.
# - user turns <|turn>user\n...<turn|>\n; assistant turns <|turn>model\n, the content, then each tool call
#   <|tool_call>call:NAME{key:value,...}<tool_call|> (arguments a dict, rendered natively; a string is
#   copied as it is, as Gemma's template does);
# - each tool message right after the calls, in the same model turn:
#   <|tool_response>response:NAME{value:<|"|>...<|"|>}<tool_response|> (NAME: the message's name, or the
#   name of the call its tool_call_id answers); an assistant message after tool messages continues that
#   turn, and a turn with tool calls ends at the next user message;
# - the generation prompt is <|turn>model\n, or nothing when a model turn is still open (after tool
#   results the model goes on in the same turn).
AGENT_CHAT_TEMPLATE = _AGENT_VALUE_MACRO + (
    "{%- macro text_of(content) -%}"
    "{%- if content is string -%}{{ content | trim }}"
    "{%- elif content -%}{%- for part in content -%}{%- if part['type'] == 'text' -%}{{ part['text'] | trim }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{{ bos_token }}"
    "{%- set loop_messages = messages -%}"
    "{%- set has_system = messages and messages[0]['role'] in ['system', 'developer'] -%}"
    "{%- if has_system or tools or enable_thinking -%}"
    "{{ '<|turn>system\n' }}"
    "{%- if enable_thinking -%}{{ 'Think step by step before you answer.\n' }}{%- endif -%}"
    "{%- if has_system -%}{{ text_of(messages[0]['content']) }}{%- set loop_messages = messages[1:] -%}{%- endif -%}"
    "{%- for tool in tools or [] -%}"
    "{%- set function = tool['function'] if 'function' in tool else tool -%}"
    "{{ '<|tool>declaration:' + function['name'] + '{description:<|\"|>' + (function['description'] or '') + '<|\"|>' }}"
    "{%- if function['parameters'] -%}{{ ',parameters:' }}{{ gemma_value(function['parameters']) }}{%- endif -%}"
    "{{ '}<tool|>' }}"
    "{%- endfor -%}"
    "{{ '<turn|>\n' }}"
    "{%- endif -%}"
    "{%- set ns = namespace(open=false, calls=[]) -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- if not ns.open -%}{{ raise_exception('A tool message must follow an assistant message with tool_calls.') }}{%- endif -%}"
    "{%- set found = namespace(name=message.get('name')) -%}"
    "{%- for call in ns.calls -%}{%- if not found.name and call.get('id') == message.get('tool_call_id') -%}"
    "{%- set found.name = call['function']['name'] -%}{%- endif -%}{%- endfor -%}"
    "{{ '<|tool_response>response:' + (found.name or 'unknown') + '{value:<|\"|>' + text_of(message['content']) + '<|\"|>}<tool_response|>' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- if not ns.open -%}{{ '<|turn>model\n' }}{%- set ns.open = true -%}{%- endif -%}"
    "{{ text_of(message['content']) }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{ '<|tool_call>call:' + call['function']['name'] }}"
    "{%- if call['function']['arguments'] is mapping -%}{{ gemma_value(call['function']['arguments']) }}"
    "{%- else -%}{{ call['function']['arguments'] }}{%- endif -%}"
    "{{ '<tool_call|>' }}"
    "{%- endfor -%}"
    "{%- if message.get('tool_calls') -%}{%- set ns.calls = message['tool_calls'] -%}"
    "{%- else -%}{{ '<turn|>\n' }}{%- set ns.open = false -%}{%- endif -%}"
    "{%- else -%}"
    "{%- if ns.open -%}{{ '<turn|>\n' }}{%- set ns.open = false -%}{%- endif -%}"
    "{{ '<|turn>' + message['role'] + '\n' + text_of(message['content']) + '<turn|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt and not ns.open -%}{{ '<|turn>model\n' }}{%- endif -%}"
)

# Training text for the agent tokenizer, written for this file: chat, and the pieces of Gemma 4's call
# syntax (without the special tokens, which are never trained), so `call:`, `{`, `location:`, `},` and
# the like get tokens of their own, some spanning a key and its colon or a value and a comma.
AGENT_CORPUS = CHAT_CORPUS + """\
call:get_weather{location:Paris,unit:celsius}
call:get_weather{location:London,unit:fahrenheit}
call:get_time{city:Tokyo,timezone:Asia/Tokyo}
call:search{query:weather in Paris,limit:10,safe:true}
call:add{a:1,b:2}call:add{a:-3.5,b:1e3}
call:book{when:{day:monday,hour:9},guests:[anna,bob],vip:false,note:null}
response:get_weather{value:sunny, 21 degrees}
response:search{value:[1,2,3]}
declaration:get_weather{description:Get the weather in a city,parameters:{properties:{location:{type:string},
unit:{enum:[celsius,fahrenheit],type:string}},required:[location],type:object}}
The weather in Paris is sunny. Let me call a tool to find out. thought
I should check the weather first, then answer the user.
"""


def build_agent_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer of AGENT_VOCAB_SIZE tokens with Gemma 4's markers as special tokens.

    Ids 0-13 are AGENT_SPECIAL_TOKENS; the 256 byte tokens follow, so any text encodes. There is no
    pre-tokenizer split (ByteLevel without its regex), so merges span punctuation and words alike:
    tokens such as ``location:`` or ``},`` cross the structure of a call, as a real vocabulary's do.
    Encoding prepends <bos>.

    Returns:
        A `tokenizers.Tokenizer`.
    """
    return byte_level_bpe(AGENT_SPECIAL_TOKENS, AGENT_VOCAB_SIZE, AGENT_CORPUS, use_regex=False)


def agent_text_config(**overrides) -> Gemma4TextConfig:
    """The tiny config with the agent tokenizer's vocabulary and eos ids (<eos>, <turn|>, <|tool_response>)."""
    kwargs = dict(
        vocab_size=AGENT_VOCAB_SIZE,
        vocab_size_per_layer_input=AGENT_VOCAB_SIZE,
        pad_token_id=0,
        eos_token_id=list(AGENT_EOS_IDS),
        bos_token_id=2,
    )
    kwargs.update(overrides)
    return tiny_text_config(**kwargs)


def save_agent_chat(out_dir: str | Path, seed: int = AGENT_SEED) -> Path:
    """Write the agent checkpoint: dense bf16 model, tokenizer.json, tokenizer_config.json.

    Like ``save_chat``, with Gemma 4's markers and ``AGENT_CHAT_TEMPLATE`` (tools, tool calls, tool
    results, enable_thinking). The replies are gibberish: the weights are random.

    Args:
        out_dir: target directory (created).
        seed: weight seed.

    Returns:
        The directory.
    """
    return _save_agent_weights(out_dir, seed, AGENT_SPECIAL_TOKENS, build_agent_tokenizer(), AGENT_CHAT_TEMPLATE)


def _save_agent_weights(out_dir: str | Path, seed: int, markers: tuple[str, ...], tokenizer: Tokenizer,
                        template: str) -> Path:
    """The agent weights (`agent_text_config`) with `tokenizer`, its `markers` as special tokens and
    `template` as the chat template; eos <turn|>."""
    out_dir = save_dense(out_dir, seed, agent_text_config())
    extra = [t for t in markers if t not in ("<pad>", "<bos>", "<turn|>")]
    return save_tokenizer(out_dir, tokenizer, AGENT_VOCAB_SIZE, "<turn|>", extra, template)


# ---------------------------------------------------------------- Gemma 4's own chat template


# Gemma 4's markers that its published template writes besides the agent ones: <|think|> opens a system turn
# that asks for thought; <|image|>, <|audio|> and <|video|> stand for media. Ids 14-17, after the agent's.
GEMMA4_SPECIAL_TOKENS = AGENT_SPECIAL_TOKENS + ("<|think|>", "<|image|>", "<|audio|>", "<|video|>")


def build_gemma4_tokenizer() -> Tokenizer:
    """The agent tokenizer's recipe with every marker Google's Gemma 4 template writes as a special token
    (GEMMA4_SPECIAL_TOKENS); AGENT_VOCAB_SIZE tokens, so the agent weights fit it."""
    return byte_level_bpe(GEMMA4_SPECIAL_TOKENS, AGENT_VOCAB_SIZE, AGENT_CORPUS, use_regex=False)


def save_gemma4_chat(out_dir: str | Path, template: str, seed: int = AGENT_SEED) -> Path:
    """Write a checkpoint that renders through Google's own Gemma 4 chat template: the agent checkpoint's
    weights and eos ids, GEMMA4_SPECIAL_TOKENS, and `template` (tests/fetch_chat_templates.py fetches
    Google's templates).

    Args:
        out_dir: target directory (created).
        template: the chat template's text.
        seed: weight seed.
    Returns:
        The directory.
    """
    return _save_agent_weights(out_dir, seed, GEMMA4_SPECIAL_TOKENS, build_gemma4_tokenizer(), template)
