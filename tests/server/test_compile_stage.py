"""The compile stage's requests (gemma_server/compile_stage.py); the stage itself runs in tests/server/test_boot.py
and, with speculative decoding, tests/server/test_speculative.py."""

from gemma_server.compile_stage import compile_prompt


def test_compile_prompts_differ_in_their_first_id_and_stay_in_the_vocabulary():
    """A batch's prompts must not share a prefix (a prefix-cache hit would move a request to another slot and so
    another bucket), whatever the vocabulary."""
    for vocab in (262_144, 512, 97):
        prompts = [compile_prompt(k, vocab) for k in range(32)]
        assert len({p[0] for p in prompts}) == 32 and all(0 <= i < vocab for p in prompts for i in p)
    assert len(compile_prompt(3, 512, length=40)) == 40
