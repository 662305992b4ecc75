"""Unit tests of chat_template.py's cache boundary: where the part of a chat prompt that every user of one
agent shares (the leading system and developer turns, the tool declarations) ends, on the test checkpoints'
own tokenizers and templates (tests/checkpoints/). No server, no engine."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from gemma_server.chat_template import CacheMarks, chat_prompt
from gemma_server.protocol.requests import ChatCompletionRequest

SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
USER = {"role": "user", "content": "What is the weather in Paris?"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}]


@pytest.fixture(scope="module")
def agent_tokenizer(agent_checkpoint):
    return AutoTokenizer.from_pretrained(agent_checkpoint)


@pytest.fixture(scope="module")
def chat_tokenizer(chat_checkpoint):
    return AutoTokenizer.from_pretrained(chat_checkpoint)


def boundary(tokenizer, messages, tools=None, **kw) -> tuple[list[int], int | None]:
    ids, marks = chat_prompt(tokenizer, ChatCompletionRequest(messages=messages, tools=tools, **kw))
    return ids, marks.boundary


def first_user_turn(tokenizer, ids: list[int]) -> int:
    """The position of the first user turn's opening `<|turn>` (Gemma 4's format): where the shared part ends."""
    turn = tokenizer.convert_tokens_to_ids("<|turn>")
    return next(i for i, t in enumerate(ids) if t == turn and tokenizer.decode(ids[i + 1:i + 2]).startswith("user"))


def test_the_boundary_is_the_end_of_the_system_turn_as_the_template_renders_it_alone(agent_tokenizer):
    ids, b = boundary(agent_tokenizer, [SYSTEM, USER])
    system_turn = agent_tokenizer.apply_chat_template([SYSTEM], tokenize=True, add_generation_prompt=False,
                                                      return_dict=False)
    assert b == len(system_turn) == first_user_turn(agent_tokenizer, ids)
    assert ids[:b] == system_turn


@pytest.mark.parametrize("messages,tools,kwargs", [
    ([USER], TOOLS, {}),                                                              # tools alone
    ([SYSTEM, USER], TOOLS, {}),                                                      # system text and tools
    ([SYSTEM, {"role": "developer", "content": "Use metric units."}, USER], TOOLS, {}),  # every leading turn
    ([SYSTEM, USER], TOOLS, {"chat_template_kwargs": {"enable_thinking": True}}),     # the same variables
], ids=["tools", "system-and-tools", "system-and-developer", "thinking"])
def test_the_boundary_ends_where_the_first_user_turn_begins(agent_tokenizer, messages, tools, kwargs):
    ids, b = boundary(agent_tokenizer, messages, tools, **kwargs)
    assert b == first_user_turn(agent_tokenizer, ids)
    # Every conversation of the same agent shares exactly that part.
    other, b2 = boundary(agent_tokenizer, [*messages[:-1], {"role": "user", "content": "Hello"}], tools, **kwargs)
    assert b2 == b and other[:b] == ids[:b] and other[b:] != ids[b:]


def test_a_conversation_with_nothing_shared_before_the_user_has_no_boundary(agent_tokenizer):
    assert boundary(agent_tokenizer, [USER])[1] is None


def test_a_template_that_folds_the_system_text_into_the_user_turn_has_no_boundary(chat_tokenizer):
    # Gemma 3's format: the system message opens the first user turn, so alone it renders BOS alone.
    ids, b = boundary(chat_tokenizer, [SYSTEM, USER])
    assert b is None and len(ids) > 2


def test_no_boundary_when_the_shared_part_renders_differently_once_more_messages_follow(agent_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(agent_checkpoint)
    # A system turn that counts the messages: rendered alone it is not the start of the whole prompt.
    tokenizer.chat_template = ("{{ bos_token }}<|turn>system\n{{ messages[0]['content'] }} of {{ messages | length }}"
                               "<turn|>\n{% for m in messages[1:] %}<|turn>{{ m['role'] }}\n{{ m['content'] }}"
                               "<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")
    ids, b = boundary(tokenizer, [SYSTEM, USER])
    assert b is None and ids


def test_the_boundary_is_not_marked_when_prefix_caching_is_off(agent_tokenizer):
    request = ChatCompletionRequest(messages=[SYSTEM, USER], tools=TOOLS)
    ids, marks = chat_prompt(agent_tokenizer, request, mark=False)
    assert marks == CacheMarks() and ids == chat_prompt(agent_tokenizer, request)[0]
