"""FieldNames: a chat field's name in the front-end's request, as a table."""

import pytest

from gemma_server.errors import ApiError
from gemma_server.frontends.fields import FieldNames

NAMES = FieldNames({"messages": "input", "messages[0]": "instructions", "messages[1]": "input[0]",
                    "messages[1].tool_calls[0].function": "input[1]", "max_tokens": "max_output_tokens"},
                   whole=frozenset({"messages", "messages[0]"}), words={"max_tokens": "max_output_tokens"})


@pytest.mark.parametrize("chat, ours", [
    ("messages[1].content", "input[0].content"),  # under a key: under its value
    ("messages[1].tool_calls[0].function.arguments", "input[1].arguments"),  # the longest key wins
    ("messages[0].content", "instructions"),  # a whole field: nothing under it carried over
    ("messages[7].content", "input"),
    ("messages", "input"),
    ("max_tokens", "max_output_tokens"),
    ("max_tokens_x", "max_tokens_x"),  # a prefix of a name is not the name
    ("temperature", "temperature"),
    (None, None),
])
def test_a_chat_field_is_named_as_the_front_end_names_it(chat, ours):
    assert NAMES.field(chat) == ours


def test_an_error_is_renamed_in_its_param_and_its_message():
    err = NAMES.error(ApiError(400, "messages[1].content is empty; max_tokens is 3.", "messages[1].content",
                               {"X": "1"}))
    assert (err.param, err.message, err.headers) == (
        "input[0].content", "input[0].content is empty; max_output_tokens is 3.", {"X": "1"})
    same = ApiError(400, "temperature is wrong.", "temperature")
    assert NAMES.error(same) is same
    # A bare name is renamed in the param, and in the message only as `words` says (here: a plain word).
    assert NAMES.error(ApiError(400, "The chat template rejected the messages: x", "messages")).message == (
        "The chat template rejected the messages: x")
