"""Unit tests of text.py: stop strings across token boundaries (the detokenizer is tested on the real
tokenizer in test_api.py)."""

from gemma_server.text import StopMatcher


def run(stops, pieces):
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces)
    return out + m.flush(), m.stopped


def test_stop_string_split_over_pieces_is_found_and_cut():
    assert run(["END"], ["hello E", "N", "D more"]) == ("hello ", True)


def test_text_that_only_looks_like_a_stop_prefix_is_released():
    m = StopMatcher(["END"])
    assert m.feed("hello E") == "hello "  # "E" is held back
    assert m.feed("x") == "Ex"
    assert not m.stopped


def test_held_back_tail_is_flushed_when_the_decode_ends():
    assert run(["END"], ["abc EN"]) == ("abc EN", False)


def test_earliest_of_several_stop_strings_wins():
    assert run(["world", "lo w"], ["hel", "lo world"]) == ("hel", True)


def test_nothing_is_sent_after_a_stop():
    m = StopMatcher(["x"])
    assert m.feed("ax") == "a"
    assert m.feed("more") == ""
    assert m.flush() == ""


def test_no_stop_strings_passes_everything_through():
    assert run([], ["a", "b"]) == ("ab", False)


def test_the_stop_matcher_names_the_string_that_matched_first_in_the_text():
    m = StopMatcher(["END", "stop"])
    out = m.feed("say st") + m.feed("op now, END")
    assert (out, m.stopped, m.matched) == ("say ", True, "stop")
    assert StopMatcher(["x"]).matched is None
