"""Where speculative decoding stops paying: the limit the server sets at warmup from the engine's own measurement.

`Engine.speculation_costs(b)` times a plain decode step and a verify step (`k` drafts a row) in the decode bucket of
`b` requests (rust/src/engine/tuning.rs); a step computes every row of its bucket, so the ratio is the bucket's. A
verify step gives a row 1 + a tokens for a kept drafts; with each draft kept with probability `acceptance` while the
ones before it were (Leviathan et al., "Fast Inference from Transformers via Speculative Decoding", 2023, eq. 1), it
gives 1 + acceptance + ... + acceptance^k tokens on average. Speculating pays at a batch when that exceeds the ratio
of the verify step's time to the plain step's. The limit is the largest decode bucket up to which every bucket pays
at `TARGET_ACCEPTANCE`; a request whose drafts fail anyway is backed off by the engine (speculative.rs `Backoff`).
"""

import statistics
from collections.abc import Sequence

#: The share of drafts kept at which speculation is asked to pay (a design choice: at 4 drafts a verify step then
#: gives 2.3 tokens a row). A request whose drafts are kept less often is backed off by the engine one by one.
TARGET_ACCEPTANCE = 0.6

#: Measurements of each bucket's steps; their median is used (on a 2-core CPU one measurement of batch 4's ratio
#: moved between 1.87 and 2.84 from run to run).
REPEATS = 3

#: Steps of each kind a measurement times, where the context holds them (`Engine.speculation_turns`).
TURNS = 8


def tokens_per_verify(drafts: int, acceptance: float) -> float:
    """Expected tokens a verify step gives a row with `drafts` drafts kept each with probability `acceptance`."""
    return sum(acceptance ** i for i in range(drafts + 1))


def limit(costs: Sequence[dict], acceptance: float = TARGET_ACCEPTANCE) -> int:
    """The largest bucket of `costs` (`Engine.speculation_costs` dicts) up to which a verify step pays in every
    bucket at `acceptance`; 0 when it does not pay at the smallest."""
    best = 0
    for c in sorted(costs, key=lambda c: c["bucket"]):
        if c["verify_s"] >= tokens_per_verify(c["drafts"], acceptance) * c["plain_s"]:
            break
        best = c["bucket"]
    return best


def measure(engine, repeats: int = REPEATS) -> tuple[list[dict], int | None]:
    """Time `engine`'s plain and verify steps in each of its decode buckets (the median of `repeats` measurements of
    each) and set its largest speculating bucket from them (`limit`). Returns the costs and the limit; ([], None)
    when its context is too short to measure (the limit stays)."""
    n = min(TURNS, engine.speculation_turns)
    if n == 0:
        return [], None
    costs = []
    for b in engine.buckets:
        runs = [dict(engine.speculation_costs(b, n)) for _ in range(repeats)]
        costs.append({**runs[0], **{k: statistics.median(r[k] for r in runs) for k in ("plain_s", "verify_s")}})
    chosen = limit(costs)
    engine.set_speculative_max_bucket(chosen)
    return costs, chosen


def summary(costs: Sequence[dict], chosen: int | None) -> str:
    """One line for the warmup stage: each bucket's verify/plain ratio and the limit."""
    if chosen is None:
        return "speculative decoding's limit unmeasured (the context is too short for its steps)"
    ratios = ", ".join(f"b{c['bucket']} {c['verify_s'] / c['plain_s']:.2f}x"
                       for c in sorted(costs, key=lambda c: c["bucket"]))
    return f"speculative decoding in decode buckets up to {chosen} (verify/plain step time: {ratios})"
