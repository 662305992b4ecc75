"""The demo's chat checkpoint (``save_chat`` -> fixture ``chat_checkpoint``; also ``python -m tests.checkpoints
--kind chat --out DIR``).

The dense layout with ``vocab_size = 512`` matching a byte-level BPE tokenizer trained in-process
(``tokenizer.json``, ``tokenizer_config.json`` with a Gemma chat_template, class
PreTrainedTokenizerFast). Ids: ``<pad>``=0, ``<eos>``=1, ``<bos>``=2, ``<start_of_turn>``=3,
``<end_of_turn>``=4; config ``eos_token_id`` = [1, 4]. Encoding plain text prepends ``<bos>``. The
template renders ``<bos><start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoTokenizer
from transformers.models.gemma4 import Gemma4TextConfig

from tests.checkpoints.parity import GENERATE_TOKENS, greedy_reference, load_hf_reference
from tests.checkpoints.shared import byte_level_bpe, save_tokenizer
from tests.checkpoints.text import save_dense, tiny_text_config

# Special tokens and their ids: Gemma's <pad>/<eos>/<bos> ids, then the turn markers (ids 3 and 4
# here, 105 and 106 in Gemma's own vocabulary).
CHAT_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")
CHAT_VOCAB_SIZE = 512
# Chosen by `search_chat_seed()`, which returned 0: the first seed from 0 upward whose greedy reply
# to CHAT_PROMPT runs at least CHAT_MIN_REPLY tokens before an eos id, so the demo has something to
# stream. With it the reply is 49 tokens, then <end_of_turn> (finish "stop").
CHAT_SEED = 0
CHAT_MIN_REPLY = 24
CHAT_PROMPT = [{"role": "user", "content": "Write a short paragraph about the ocean."}]

# Gemma's chat format: a system message is folded into the first user turn, "assistant" is called
# "model", each turn is <start_of_turn>role\n...<end_of_turn>\n. Content may be a string or a list of
# OpenAI-style parts ({"type": "text", "text": ...}).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set first_user_prefix = (messages[0]['content'] | map(attribute='text') | join('')) + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


# Training text for the demo tokenizer, written for this file. Any text still encodes (byte-level).
CHAT_CORPUS = """\
The ocean covers most of the surface of the earth. Its water moves in long currents that carry heat from
the warm seas near the equator toward the cold seas near the poles. Waves rise when the wind blows across
the water, and tides follow the pull of the moon. Fish, whales, turtles and tiny plankton live in the
ocean, and the light of the sun reaches only its upper layers.
A model server answers questions over HTTP. The user sends a message, the model reads the prompt, and
then it writes a reply one token at a time. Each token is a small piece of text: a word, part of a word,
a space or a mark of punctuation. The server streams the tokens back so the reply appears as it is made.
What is a TPU? A TPU is a chip built to multiply large matrices quickly. Who are you? I am a small test
model. Hello! How are you today? Thank you, I am well. Please write a short story about a cat, a boat and
the sea. Once upon a time a cat sailed a small boat across the quiet sea, looking for an island of fish.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Code: def main(): print("hello, world") return 0.
"""


def build_chat_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer of CHAT_VOCAB_SIZE tokens trained on `CHAT_CORPUS`.

    Ids 0-4 are CHAT_SPECIAL_TOKENS; the 256 byte tokens follow, so any text encodes. Encoding
    prepends <bos> (as Gemma's tokenizer does); decoding drops special tokens on request.

    Returns:
        A `tokenizers.Tokenizer`.
    """
    return byte_level_bpe(CHAT_SPECIAL_TOKENS, CHAT_VOCAB_SIZE, CHAT_CORPUS)


def chat_text_config(**overrides) -> Gemma4TextConfig:
    """The tiny config with the chat tokenizer's vocabulary and eos ids (<eos>, <end_of_turn>)."""
    kwargs = dict(
        vocab_size=CHAT_VOCAB_SIZE,
        vocab_size_per_layer_input=CHAT_VOCAB_SIZE,
        pad_token_id=0,
        eos_token_id=[1, 4],
        bos_token_id=2,
    )
    kwargs.update(overrides)
    return tiny_text_config(**kwargs)


def save_chat(out_dir: str | Path, seed: int = CHAT_SEED, **config) -> Path:
    """Write the demo chat checkpoint: dense bf16 model, tokenizer.json, tokenizer_config.json.

    Loadable with ``AutoTokenizer.from_pretrained(out_dir)`` (its chat_template is Gemma's format)
    and served like any dense checkpoint. The replies are gibberish: the weights are random.

    Args:
        out_dir: target directory (created).
        seed: weight seed.
        **config: ``chat_text_config`` overrides (e.g. ``text.SMALL_LAYERS``).

    Returns:
        The directory.
    """
    out_dir = save_dense(out_dir, seed, chat_text_config(**config))
    return save_tokenizer(out_dir, build_chat_tokenizer(), CHAT_VOCAB_SIZE, "<end_of_turn>",
                           ["<start_of_turn>", "<eos>"], CHAT_TEMPLATE)


def chat_reply(model_dir: str | Path, messages=CHAT_PROMPT, max_new: int = GENERATE_TOKENS) -> list[int]:
    """The greedy reply of the chat checkpoint under Transformers (float32), eos excluded."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    model = load_hf_reference(model_dir)
    tokens, _ = greedy_reference(model, list(ids), max_new)
    eos = set(model.config.eos_token_id)
    return [t for t in tokens if t not in eos]


def search_chat_seed(start: int = 0, stop: int = 200) -> int:
    """The first seed in [start, stop) whose greedy chat reply has at least CHAT_MIN_REPLY tokens.

    Raises:
        RuntimeError: when no seed in the range qualifies.
    """
    for seed in range(start, stop):
        with tempfile.TemporaryDirectory() as tmp:
            if len(chat_reply(save_chat(tmp, seed))) >= CHAT_MIN_REPLY:
                return seed
    raise RuntimeError(f"no chat seed in [{start}, {stop}) replies with {CHAT_MIN_REPLY}+ tokens")
