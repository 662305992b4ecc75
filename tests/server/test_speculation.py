"""The speculation limit the server sets at warmup (gemma_server/speculation.py), from measured step costs."""

import pytest

from gemma_server import speculation


def costs(*ratios: float, drafts: int = 4) -> list[dict]:
    """Costs of buckets 1, 2, 4, ... whose verify step takes `ratio` plain steps."""
    return [{"bucket": 2 ** i, "plain_s": 0.01, "verify_s": 0.01 * r, "drafts": drafts} for i, r in enumerate(ratios)]


def test_tokens_per_verify_step_is_the_geometric_sum():
    assert speculation.tokens_per_verify(4, 0.6) == pytest.approx(1 + 0.6 + 0.36 + 0.216 + 0.1296)
    assert speculation.tokens_per_verify(3, 1.0) == 4
    assert speculation.tokens_per_verify(5, 0.0) == 1


@pytest.mark.parametrize("ratios, want", [
    ((1.1, 1.3, 1.9, 3.0), 4),  # an accelerator: reading the weights dominates until batch 8
    ((2.0, 2.6, 4.0), 1),  # a CPU: only batch 1 pays (2.0 < 2.31)
    ((2.5, 1.5), 0),  # the smallest bucket does not pay: none does, whatever comes after
    ((1.0, 1.0, 2.31), 2),  # the break-even is not paying
])
def test_the_limit_is_the_last_bucket_of_the_paying_run(ratios, want):
    assert speculation.limit(list(reversed(costs(*ratios)))) == want


def test_a_higher_acceptance_allows_larger_batches():
    measured = costs(2.0, 2.6, 4.0)
    assert speculation.limit(measured, acceptance=0.9) == 4
    assert speculation.limit(measured, acceptance=0.2) == 0


def test_the_summary_names_the_limit():
    line = speculation.summary(costs(1.5, 3.0), 1)
    assert line == "speculative decoding in decode buckets up to 1 (verify/plain step time: b1 1.50x, b2 3.00x)"
    assert "unmeasured" in speculation.summary([], None)
