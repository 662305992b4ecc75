"""Prompt log-probabilities (`Request(prompt_logprobs=k)`, rust/src/engine/prompt_logprobs.rs) through the
real `Engine.run` loop on the dense tiny checkpoint, in float32, against Transformers' own forward over
the prompt (`Gemma4ForCausalLM.from_pretrained(path, dtype=torch.float32)`, `log_softmax` of its
logits): for prompts read in several chunks, and for prompts read together in one forward beside
others that do not ask.
"""

import pytest
import torch

import gemma_engine
from tests.checkpoints.parity import PARITY_PROMPT, load_hf_reference
from tests.engine.test_batching import Script

PROMPTS = {
    "parity": PARITY_PROMPT,  # 28 tokens
    "other": [2] + [(53 * i + 7) % 500 + 3 for i in range(40)],  # 41
    "short": PARITY_PROMPT[:9],
    "tiny": [2, 5],
    "one": [7],
}
# Not 1e-4: float32 rounding of this random model moves prompt logprobs (logits in (-30, 30), the final
# softcap) by up to ~1e-3 on these prompts, on both sides. Measured on the 28- and 41-token prompts:
# Transformers' own one forward against its prefix-by-prefix forwards 1.6e-4 / 5.9e-4, Transformers
# float32 against float64 2.3e-4 / 5.9e-4, the engine against Transformers float32 2.5e-4 / 7.8e-4 (chunks
# of 5) and against float64 1.4e-4 / 1.1e-3.
TOLERANCE = 2e-3



@pytest.fixture(scope="module")
def reference(dense_checkpoint):
    """reference(prompt) -> float32 [len - 1] logprobs of prompt[1:] and [len - 1, vocab] log_softmax."""
    model = load_hf_reference(dense_checkpoint, dtype=torch.float32)

    def get(prompt):
        with torch.no_grad():
            lp = model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
        return lp.gather(1, torch.tensor(prompt[1:]).unsqueeze(1))[:, 0], lp

    return get


def _engine(dense_checkpoint, **kwargs):
    kwargs = {"context": 128, "dtype": "float32", "like": torch.zeros(1), **kwargs}
    return gemma_engine.Engine(str(dense_checkpoint), **kwargs)


class Recorder(Script):
    """`Script` that also keeps each request's prompt log-probabilities (first event only)."""

    def on_events(self, events, stats):
        self.prompt_lp = getattr(self, "prompt_lp", {})
        for e in events:
            if e.prompt_logprobs is not None:
                assert e.id not in self.prompt_lp, "prompt logprobs came twice"
                assert not self.outcomes[e.id].tokens, "prompt logprobs after the first tokens"
                self.prompt_lp[e.id] = e.prompt_logprobs
        super().on_events(events, stats)


def _check(reference, name, got, k):
    want, lp = reference(PROMPTS[name])
    assert len(got) == len(PROMPTS[name]) - 1
    chosen = torch.tensor([g[0] for g in got])
    assert torch.allclose(chosen, want, atol=TOLERANCE), (chosen - want).abs().max()
    top_lp, top_ids = lp.topk(k, -1)
    for i, (_, top) in enumerate(got):
        assert len(top) == k
        assert torch.allclose(torch.tensor([t[1] for t in top]), top_lp[i], atol=TOLERANCE)
        # Ids agree but where two candidates are closer than the tolerance (their order may swap).
        for j, (tid, tlp) in enumerate(top):
            assert tid == top_ids[i, j] or abs(lp[i, tid] - top_lp[i, j]) < TOLERANCE


@pytest.mark.parametrize("chunk", [5, 8, 256])
def test_prompt_logprobs_read_in_chunks_equal_transformers(dense_checkpoint, reference, chunk):
    rec = Recorder({0: [gemma_engine.Request(0, PROMPTS["parity"], 3, prompt_logprobs=5),
                        gemma_engine.Request(1, PROMPTS["other"], 2, prompt_logprobs=0)]})
    out = rec.run(_engine(dense_checkpoint, max_batch=2, prefill_chunk=chunk))
    _check(reference, "parity", rec.prompt_lp[0], 5)
    _check(reference, "other", rec.prompt_lp[1], 0)
    assert len(out[0].tokens) == 3 and out[0].finish == "length"


def test_prompts_read_together_each_get_their_own_prompt_logprobs(dense_checkpoint, reference):
    """Four short prompts in one forward (left-padded rows): two ask, one does not, and a follower
    of an asking prompt asks for fewer top entries."""
    reqs = [
        gemma_engine.Request(0, PROMPTS["short"], 2, prompt_logprobs=3),
        gemma_engine.Request(1, PROMPTS["tiny"], 2),
        gemma_engine.Request(2, PROMPTS["parity"], 2, prompt_logprobs=20),
        gemma_engine.Request(3, PROMPTS["short"], 2, prompt_logprobs=1),
        gemma_engine.Request(4, PROMPTS["one"], 2, prompt_logprobs=2),
    ]
    rec = Recorder({0: reqs})
    out = rec.run(_engine(dense_checkpoint, max_batch=5, prefill_chunk=256))
    assert [s for st in rec.stats for s in st["prompt_reads"]] == [4]  # the follower reads nothing
    _check(reference, "short", rec.prompt_lp[0], 3)
    _check(reference, "parity", rec.prompt_lp[2], 20)
    _check(reference, "short", rec.prompt_lp[3], 1)
    assert rec.prompt_lp[4] == []
    assert 1 not in rec.prompt_lp
    # The tokens are those of the same requests without prompt logprobs.
    plain = Script({0: [gemma_engine.Request(r.id, r.ids, 2) for r in reqs]}).run(
        _engine(dense_checkpoint, max_batch=5)
    )
    assert all(out[i].tokens == plain[i].tokens for i in range(5))


def test_max_new_zero_with_prompt_logprobs_ends_length_after_the_prompt(dense_checkpoint, reference):
    rec = Recorder({0: [gemma_engine.Request(0, PROMPTS["parity"], 0, prompt_logprobs=2),
                        gemma_engine.Request(1, PROMPTS["parity"], 4)]})
    out = rec.run(_engine(dense_checkpoint, max_batch=2, prefill_chunk=8))
    assert (out[0].tokens, out[0].finish) == ([], "length")
    _check(reference, "parity", rec.prompt_lp[0], 2)
    assert len(out[1].tokens) == 4 and out[1].finish == "length"


@pytest.mark.parametrize("kwargs, field", [({"max_new": 0}, "max_new"), ({"prompt_logprobs": 21}, "prompt_logprobs")])
def test_bad_prompt_logprobs_requests_end_error_naming_the_field(dense_checkpoint, kwargs, field):
    args = {"max_new": 2, **kwargs}
    out = Script({0: [gemma_engine.Request(0, PROMPTS["short"], **args)]}).run(_engine(dense_checkpoint))
    assert out[0].finish == "error" and out[0].error.startswith(field)
