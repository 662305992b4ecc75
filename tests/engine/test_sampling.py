"""The engine's sampler (rust/src/engine/sampling.rs, through `gemma_engine.testing.sample` and
`gemma_engine.testing.uniform`) against Transformers 5.18's own logits processors
(`transformers/generation/logits_process.py`) on random logits.

The reference applies, in the order `GenerationMixin._get_logits_processor` does:
`SequenceBiasLogitsProcessor` (OpenAI's `logit_bias` as one-token sequences),
`RepetitionPenaltyLogitsProcessor` (over prompt and output ids), OpenAI's presence and frequency
penalties (`logits - frequency * counts - presence * (counts > 0)` over the output ids, from OpenAI's
API reference, "Parameter details"), then `TemperatureLogitsWarper`, `TopKLogitsWarper`,
`TopPLogitsWarper` and `MinPLogitsWarper`.
"""

import math

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import gemma_engine
from gemma_engine import testing

VOCAB = 256
PROMPT = [2, 17, 17, 40, 99, 5, 200, 31]
OUTPUT = [40, 7, 7, 7, 123, 31, 250]

# Each stage alone, then combinations; every penalty meets tokens of both signs of logit.
CASES = {
    "neutral": {"temperature": 1.0},
    "temperature": {"temperature": 0.6},
    "top_k": {"temperature": 1.0, "top_k": 12},
    "top_p": {"temperature": 1.0, "top_p": 0.8},
    "min_p": {"temperature": 1.0, "min_p": 0.05},
    "logit_bias": {"temperature": 1.0, "logit_bias": {3: 4.0, 40: -2.5, 255: 1.25}},
    "repetition": {"temperature": 1.0, "repetition_penalty": 1.7},
    "repetition_below_one": {"temperature": 1.0, "repetition_penalty": 0.6},
    "presence": {"temperature": 1.0, "presence_penalty": 1.5},
    "frequency": {"temperature": 1.0, "frequency_penalty": 0.7},
    "negative_penalties": {"temperature": 1.0, "presence_penalty": -0.8, "frequency_penalty": -0.4},
    "filters": {"temperature": 1.3, "top_k": 40, "top_p": 0.9, "min_p": 0.02},
    "everything": {
        "temperature": 0.8,
        "top_k": 30,
        "top_p": 0.92,
        "min_p": 0.03,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.3,
        "repetition_penalty": 1.3,
        "logit_bias": {3: 2.0, 7: -1.5, 50: 0.75},
    },
}


def _logits(rows: int, vocab: int = VOCAB, seed: int = 0, std: float = 3.0) -> torch.Tensor:
    # Spread like a model's logits (std ~3), so filters cut a real tail.
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * std


def transformers_scores(logits: torch.Tensor, params: dict, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row's scores after Transformers' processors and warpers (and OpenAI's penalties), [vocab]."""
    ids = torch.tensor([prompt + output])
    processors = LogitsProcessorList()
    if params.get("logit_bias"):
        processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params["logit_bias"].items()}))
    if params.get("repetition_penalty", 1.0) != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty=params["repetition_penalty"]))
    scores = processors(ids, logits.unsqueeze(0).clone())
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[-1]).float()
    scores = scores - params.get("frequency_penalty", 0.0) * counts - params.get("presence_penalty", 0.0) * (counts > 0).float()
    if params.get("temperature", 0.0) > 0:
        warpers = LogitsProcessorList([TemperatureLogitsWarper(params["temperature"])])
        if params.get("top_k", 0) > 0:
            warpers.append(TopKLogitsWarper(params["top_k"]))
        if params.get("top_p", 1.0) < 1.0:
            warpers.append(TopPLogitsWarper(params["top_p"]))
        if params.get("min_p", 0.0) > 0:
            warpers.append(MinPLogitsWarper(params["min_p"]))
        scores = warpers(ids, scores)
    return scores[0]


def transformers_probs(logits, params, prompt, output) -> torch.Tensor:
    return torch.softmax(transformers_scores(logits, params, prompt, output), -1)


def inverse_cdf_draw(scores: torch.Tensor, u: float) -> int:
    """The token the engine's documented draw gives for the uniform number `u` on one row's `scores`:
    the inverse CDF of softmax(scores), tokens in ascending order of score (ties in id order)."""
    order = torch.sort(scores, stable=True).indices
    cdf = torch.cumsum(torch.softmax(scores[order], -1), 0)
    return int(order[min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), len(order) - 1)])


@pytest.mark.parametrize("case", CASES)
def test_distribution_equals_transformers_processors(case):
    params = CASES[case]
    logits = _logits(8, seed=1)
    rows = [(gemma_engine.SamplingParams(seed=i, **params), PROMPT, OUTPUT, 0) for i in range(len(logits))]
    tokens, probs = testing.sample(logits, rows)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    for i, row in enumerate(logits):
        expected = transformers_probs(row, params, PROMPT, OUTPUT)
        torch.testing.assert_close(probs[i], expected, atol=1e-6, rtol=1e-5)
        # The drawn token is one the distribution allows.
        assert expected[tokens[i]] > 0


def test_filters_remove_what_transformers_removes():
    # A sharper check than closeness: exactly the same support, for several cuts of each filter.
    logits = _logits(4, seed=2)
    for params in ({"temperature": 0.7, "top_k": k, "top_p": p, "min_p": m}
                   for k, p, m in [(1, 1.0, 0.0), (5, 0.5, 0.0), (0, 0.3, 0.1), (100, 0.99, 0.001)]):
        _, probs = testing.sample(logits, [(gemma_engine.SamplingParams(**params), [], [], 0)] * 4)
        for i, row in enumerate(logits):
            expected = transformers_probs(row, params, [], [])
            assert torch.equal(probs[i] > 0, expected > 0), params


def _chi_square_critical(df: int, z: float) -> float:
    """Upper quantile of the chi-square distribution by the Wilson-Hilferty approximation
    (Wilson and Hilferty, PNAS 17, 1931; Abramowitz and Stegun 26.4.17): the cube root of
    chi2/df is close to normal with mean 1 - 2/(9 df) and variance 2/(9 df). `z` is the standard
    normal quantile of the same level."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


# Standard normal 0.999 quantile (Abramowitz and Stegun, table 26.1): a test at the 0.1 % level.
Z_999 = 3.090232
DRAWS = 20_000


def _chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs`, bins with expectation below `min_expected`
    merged into one (Cochran's rule); returns (statistic, degrees of freedom). A draw outside the
    support gives an infinite statistic."""
    n = float(counts.sum())
    expected = probs.double() * n
    if bool(((expected == 0) & (counts > 0)).any()):
        return math.inf, 0
    big = expected >= min_expected
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if float(exp[-1]) < min_expected:  # the merged bin is itself too small: fold it into the smallest big one
        j = int(torch.argmin(exp[:-1]))
        obs[j] += obs[-1]
        exp[j] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


@pytest.mark.parametrize("case", ["neutral", "filters", "everything"])
def test_seeded_draws_pass_chi_square_against_transformers(case):
    params = CASES[case]
    # Flatter than a model's logits, so that even the filtered distribution keeps many tokens (bins).
    logits = _logits(1, vocab=64, seed=3, std=1.0)[0]
    expected = transformers_probs(logits, params, PROMPT[:4], [7, 7, 40])
    rows = [(gemma_engine.SamplingParams(seed=s, **params), PROMPT[:4], [7, 7, 40], 5) for s in range(DRAWS)]
    tokens, _ = testing.sample(logits.expand(DRAWS, -1).contiguous(), rows)
    counts = torch.bincount(torch.tensor(tokens), minlength=64)
    stat, df = _chi_square(counts, expected)
    assert df >= 5, "too few bins for the test to mean anything"
    assert stat < _chi_square_critical(df, Z_999), f"chi2 = {stat:.1f} with {df} degrees of freedom"
    # The same draws are far from a wrong distribution (the unprocessed softmax), so the test can fail.
    wrong_stat, wrong_df = _chi_square(counts, torch.softmax(logits * 0.5, -1))
    assert wrong_stat > _chi_square_critical(wrong_df, Z_999)


def test_chi_square_critical_value_matches_published_tables():
    # Pearson's tables (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.4), upper 0.1 % points.
    for df, table in [(10, 29.588), (30, 59.703), (100, 149.449)]:
        assert _chi_square_critical(df, Z_999) == pytest.approx(table, rel=1e-2)


def test_temperature_zero_is_argmax_of_the_processed_logits():
    logits = _logits(16, seed=4)
    params = {k: v for k, v in CASES["everything"].items() if k != "temperature"}
    # Each row's two most likely raw tokens are penalized (as output and as prompt), so the
    # penalties decide the choice.
    top2 = logits.topk(2, dim=-1).indices.tolist()
    histories = [(PROMPT + [second], OUTPUT + [first]) for first, second in top2]
    rows = [(gemma_engine.SamplingParams(temperature=0.0, seed=i, **params), prompt, output, i)
            for i, (prompt, output) in enumerate(histories)]
    tokens, _ = testing.sample(logits, rows)
    for i, row in enumerate(logits):
        processed = transformers_scores(row, {**params, "temperature": 0.0}, *histories[i])
        assert tokens[i] == int(processed.argmax())
    assert tokens != logits.argmax(-1).tolist()


MASK = (1 << 64) - 1
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def splitmix64(seed: int, n: int) -> list[int]:
    """The first `n` outputs of splitmix64 started at `seed` (Steele, Lea and Flood, OOPSLA 2014;
    the reference C code is Vigna's splitmix64.c)."""
    state, out = seed & MASK, []
    for _ in range(n):
        state = (state + GOLDEN) & MASK
        z = state
        z = ((z ^ (z >> 30)) * MIX1) & MASK
        z = ((z ^ (z >> 27)) * MIX2) & MASK
        out.append(z ^ (z >> 31))
    return out


def test_splitmix64_reference_matches_published_outputs():
    # rust-random/rngs, rand_xoshiro/src/splitmix64.rs, test `reference`: the first outputs from seed
    # 1477776061723855037, "produced with the reference implementation" (Vigna's splitmix64.c).
    assert splitmix64(1477776061723855037, 6) == [
        1985237415132408290,
        2979275885539914483,
        13511426838097143398,
        8488337342461049707,
        15141737807933549159,
        17093170987380407015,
    ]


def test_uniform_is_splitmix64_top_24_bits():
    seeds = [0, 1, 42, 1234567, -1, -2, -(2**63), 2**63 - 1, 987654321987]
    steps = [0, 1, 2, 7, 63, 1000]
    pairs = [(s, t) for s in seeds for t in steps]
    got = testing.uniform([s for s, _ in pairs], [t for _, t in pairs])
    expected = [(splitmix64(s, t + 1)[-1] >> 40) / 2**24 for s, t in pairs]
    assert got == expected
    assert all(0.0 <= u < 1.0 for u in got)


def test_seeded_token_does_not_depend_on_the_other_rows():
    logits = _logits(1, seed=5)[0]
    params = CASES["everything"]
    seeds = list(range(100, 140))
    alone = [testing.sample(logits.unsqueeze(0), [(gemma_engine.SamplingParams(seed=s, **params), PROMPT, OUTPUT, 3)])[0][0]
             for s in seeds]
    # The same rows inside a batch with other rows around them: other logits, other parameters
    # (greedy, other seeds, no penalties, other draw indices), in a shuffled order.
    others = [
        ({"temperature": 0.0}, [], []),
        ({"temperature": 1.5, "top_k": 3, "seed": 9}, [1, 2], [3]),
        ({"temperature": 0.5, "logit_bias": {0: 5.0}, "repetition_penalty": 2.0, "seed": -4}, PROMPT, []),
    ]
    batch_logits, rows, where = [], [], {}
    order = torch.randperm(len(seeds), generator=torch.Generator().manual_seed(6)).tolist()
    for j, k in enumerate(order):
        extra, prompt, output = others[j % len(others)]
        batch_logits.append(_logits(1, seed=100 + j)[0])
        rows.append((gemma_engine.SamplingParams(**extra), prompt, output, j))
        where[k] = len(rows)
        batch_logits.append(logits)
        rows.append((gemma_engine.SamplingParams(seed=seeds[k], **params), PROMPT, OUTPUT, 3))
    tokens, _ = testing.sample(torch.stack(batch_logits), rows)
    assert [tokens[where[k]] for k in range(len(seeds))] == alone
    # The seeds do matter: forty draws from a distribution of this spread are not all one token.
    assert len(set(alone)) > 1


def test_each_row_draws_the_inverse_cdf_of_its_own_uniform_number():
    logits = _logits(1, seed=7)[0]
    rows = [(gemma_engine.SamplingParams(temperature=1.0, seed=11), [], [], step) for step in range(40)]
    tokens, _ = testing.sample(logits.expand(40, -1).contiguous(), rows)
    # Each row draws with its own uniform number: the inverse CDF of that number, in ascending order.
    us = testing.uniform([11] * 40, list(range(40)))
    assert tokens == [inverse_cdf_draw(logits, u) for u in us]


# The int64 seeds a double cannot hold: the top of the range (2**63 - 512 and up round to 2**63, which is
# not an int64), and neighbours above 2**53 that a double makes one number.
EDGE_SEEDS = [2**63 - 1, 2**63 - 512, 2**63 - 513, -(2**63), -(2**63) + 1, 2**53 + 1, 2**53 + 2, 2**60, 2**60 + 1, -1]


def test_a_slot_draws_with_its_seed_exactly_at_the_int64_edges():
    logits = _logits(1, seed=8, std=1.0)[0]
    steps = [0, 5, 17]
    rows = [(gemma_engine.SamplingParams(temperature=1.0, seed=seed), [], [], step) for seed in EDGE_SEEDS for step in steps]
    tokens, _ = testing.sample(logits.expand(len(rows), -1).contiguous(), rows)
    # Each slot's seed reached the device whole: its draws are those of splitmix64 from that very seed.
    expected = [inverse_cdf_draw(logits, (splitmix64(seed, step + 1)[-1] >> 40) / 2**24)
                for seed in EDGE_SEEDS for step in steps]
    assert tokens == expected
    # And neighbouring seeds above 2**53 are different seeds: their uniform numbers differ.
    first = {seed: testing.uniform([seed], [0])[0] for seed in EDGE_SEEDS}
    assert first[2**53 + 1] != first[2**53 + 2] and first[2**60] != first[2**60 + 1]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 2.0}, "min_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        # Positive, but a divisor that takes a logit past float32's range (5e-324 is 0 in float32).
        ({"repetition_penalty": 5e-324}, "repetition_penalty"),
        ({"temperature": 1e-31}, "temperature"),
        ({"presence_penalty": math.inf}, "presence_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: math.nan}}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
    ],
    ids=lambda v: str(v) if isinstance(v, str) else None,
)
def test_bad_parameter_is_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        gemma_engine.SamplingParams(**kwargs)


def test_sample_refuses_a_bias_outside_the_vocabulary_and_mismatched_rows():
    logits = _logits(1)
    with pytest.raises(ValueError, match=rf"logit_bias: token id {VOCAB} is outside the vocabulary"):
        testing.sample(logits, [(gemma_engine.SamplingParams(logit_bias={VOCAB: 1.0}), [], [], 0)])
    with pytest.raises(ValueError, match="rows"):
        testing.sample(logits, [])
