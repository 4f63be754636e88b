"""Statistics for latency tables: percentiles, deadline misses, Wilson intervals, cost, hedge rate.

Conventions (the ones GPUHedge's published tables use, so a replay can be compared to them):

* a request without a valid result has latency ``+inf``; it sorts last and counts as a miss;
* the headline percentile is nearest-rank with index ``round(q * (n - 1))`` (Python's ``round``:
  halves go to the even index); a linear-interpolation percentile is reported beside it, because
  at n of about 20 the two can disagree and a conclusion must not hinge on one of them;
* a miss is a latency strictly above the deadline.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

INF = math.inf
Z95 = 1.959963984540054  # two-sided 95 % normal quantile


def _sorted(values: Iterable[float]) -> list[float]:
    out = []
    for v in values:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            v = INF  # an invalid result is "never", not a gap in the data
        out.append(float(v))
    out.sort()
    return out


def nearest_rank(values: Iterable[float], q: float) -> float:
    """Nearest-rank ``q``-quantile: sorted[round(q * (n - 1))], invalid as +inf sorted last."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    data = _sorted(values)
    if not data:
        raise ValueError("percentile of no values")
    return data[int(round(q * (len(data) - 1)))]


def linear_percentile(values: Iterable[float], q: float) -> float:
    """Linearly interpolated ``q``-quantile between the two nearest ranks (numpy's default)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    data = _sorted(values)
    if not data:
        raise ValueError("percentile of no values")
    h = q * (len(data) - 1)
    lo = math.floor(h)
    hi = min(lo + 1, len(data) - 1)
    frac = h - lo
    if frac == 0.0 or data[lo] == data[hi]:
        return data[lo]
    if math.isinf(data[hi]):
        return INF
    return data[lo] + frac * (data[hi] - data[lo])


def misses(values: Iterable[float], deadline_s: float) -> int:
    """How many latencies exceed ``deadline_s`` (invalid results always do)."""
    return sum(1 for v in _sorted(values) if v > deadline_s)


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95 % by default), clamped to [0, 1]."""
    if n <= 0:
        raise ValueError("a proportion needs n > 0")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be within [0, {n}], got {successes}")
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def hedge_rate(hedged: Sequence[bool]) -> float:
    """Fraction of requests that launched a second job."""
    return sum(1 for h in hedged if h) / len(hedged) if hedged else 0.0


@dataclass(frozen=True)
class Summary:
    """One policy over one subset of requests: the row of a latency/cost table."""

    n: int
    p50_s: float
    p95_s: float
    p95_linear_s: float
    max_s: float
    misses: dict[float, int]
    miss_ci: dict[float, tuple[float, float]]
    active_usd: float
    billed_usd: float
    hedged: int
    hedge_rate: float


def summarise(
    latencies: Sequence[float],
    active_usd: Sequence[float],
    billed_usd: Sequence[float],
    hedged: Sequence[bool],
    deadlines: Sequence[float] = (60.0,),
) -> Summary:
    """Summarise per-request latencies and costs (costs are means per request)."""
    n = len(latencies)
    if n == 0 or not (len(active_usd) == len(billed_usd) == len(hedged) == n):
        raise ValueError("summarise needs the same non-zero number of values in every column")
    counts = {float(d): misses(latencies, d) for d in deadlines}
    return Summary(
        n=n,
        p50_s=nearest_rank(latencies, 0.50),
        p95_s=nearest_rank(latencies, 0.95),
        p95_linear_s=linear_percentile(latencies, 0.95),
        max_s=max(_sorted(latencies)),
        misses=counts,
        miss_ci={d: wilson_interval(c, n) for d, c in counts.items()},
        active_usd=sum(active_usd) / n,
        billed_usd=sum(billed_usd) / n,
        hedged=sum(1 for h in hedged if h),
        hedge_rate=hedge_rate(hedged),
    )
