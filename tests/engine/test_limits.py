"""`gemma_engine.LIMITS`: the bounds declared once in the engine (rust/src/engine/request.rs `LIMITS`),
each enforced at its value: the limit passes, one more is a ValueError naming the field and the limit."""

import pytest
import torch

import gemma_engine
from tests.checkpoints.parity import PARITY_PROMPT

PROMPT = PARITY_PROMPT[:9]


@pytest.fixture(scope="module")
def engine(dense_checkpoint):
    return gemma_engine.Engine(str(dense_checkpoint), like=torch.zeros(1), context=64, dtype="float32")


def test_limits_are_a_dict_of_the_request_bounds():
    assert gemma_engine.LIMITS == {
        "max_top_logprobs": 20, "max_logit_bias": 300, "max_stop_token_ids": 64, "max_grammar_bytes": 65536
    }


def test_top_logprobs_at_the_limit_passes_and_one_more_names_logprobs_and_the_limit(engine):
    limit = gemma_engine.LIMITS["max_top_logprobs"]
    sampling = gemma_engine.SamplingParams(logprobs=limit)
    tokens, _, _, _ = engine.decode(PROMPT, 1, sampling=sampling)
    assert len(tokens) <= 1
    with pytest.raises(ValueError, match=rf"top_logprobs must be in \[0, {limit}\] \(max_top_logprobs\), got {limit + 1}"):
        gemma_engine.SamplingParams(logprobs=limit + 1)


def test_logit_bias_at_the_limit_passes_and_one_more_names_logit_bias_and_the_limit(engine):
    limit = gemma_engine.LIMITS["max_logit_bias"]
    assert limit < engine.vocab_size  # one distinct token id per entry
    sampling = gemma_engine.SamplingParams(logit_bias={i: 0.5 for i in range(limit)})
    engine.decode(PROMPT, 1, sampling=sampling)
    with pytest.raises(ValueError, match=rf"logit_bias holds at most {limit} entries \(max_logit_bias\), got {limit + 1}"):
        gemma_engine.SamplingParams(logit_bias={i: 0.5 for i in range(limit + 1)})


def test_stop_ids_at_the_limit_pass_and_one_more_names_stop_ids_and_the_limit(engine):
    limit = gemma_engine.LIMITS["max_stop_token_ids"]
    engine.decode(PROMPT, 1, stop_ids=[3] * limit)
    message = rf"stop_ids holds at most {limit} ids \(max_stop_token_ids\), got {limit + 1}"
    with pytest.raises(ValueError, match=message):
        engine.decode(PROMPT, 1, stop_ids=[3] * (limit + 1))
    # Through `run`, the same check refuses the request at admission, alone.
    events = []
    pending = [gemma_engine.Request(1, PROMPT, 1, stop_ids=[3] * (limit + 1)), gemma_engine.Request(2, PROMPT, 1)]

    def poll(free, idle):
        if sum(e.finish is not None for e in events) == 2:
            return None
        new, pending[:] = pending[:free], pending[free:]
        return new, []

    def on_events(new, stats):
        events.extend(new)

    engine.run(poll, on_events)
    ends = {e.id: (e.finish, e.error) for e in events if e.finish}
    assert ends[1][0] == "error" and "max_stop_token_ids" in ends[1][1]
    assert ends[2][0] in ("stop", "length")
