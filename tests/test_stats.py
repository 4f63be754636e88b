"""Statistics as tables: percentiles, misses, Wilson intervals and summaries."""

from __future__ import annotations

import math

import pytest

from gpuhedge_celery.core.stats import (
    INF,
    hedge_rate,
    linear_percentile,
    misses,
    nearest_rank,
    summarise,
    wilson_interval,
)

TEN = [float(i) for i in range(1, 11)]  # 1..10


@pytest.mark.parametrize(
    "values,q,expected",
    [
        (TEN, 0.0, 1.0),
        (TEN, 1.0, 10.0),
        (TEN, 0.5, 5.0),  # round(4.5) = 4 (half to even) -> sorted[4]
        (TEN, 0.95, 10.0),  # round(8.55) = 9
        (TEN, 0.9, 9.0),  # round(8.1) = 8
        ([3.0, 1.0, 2.0], 0.5, 2.0),
        ([1.0, INF, 2.0], 1.0, INF),  # invalid results sort last
        ([1.0, None, 2.0, 3.0], 0.95, INF),  # None means "no valid result"
        ([float("nan"), 1.0], 0.0, 1.0),
        ([7.0], 0.95, 7.0),
    ],
)
def test_nearest_rank(values, q, expected):
    assert nearest_rank(values, q) == expected


@pytest.mark.parametrize(
    "values,q,expected",
    [
        (TEN, 0.5, 5.5),
        (TEN, 0.95, 9.55),
        (TEN, 0.0, 1.0),
        (TEN, 1.0, 10.0),
        ([1.0, 2.0, INF], 0.5, 2.0),
        ([1.0, 2.0, INF], 0.75, INF),  # interpolating towards +inf is +inf
        ([5.0, 5.0], 0.3, 5.0),
    ],
)
def test_linear_percentile(values, q, expected):
    assert linear_percentile(values, q) == pytest.approx(expected)


def test_nearest_rank_and_linear_disagree_at_small_n():
    values = [6.0] * 8 + [20.0, 120.0]  # n = 10: q * (n - 1) = 8.55
    assert nearest_rank(values, 0.95) == 120.0  # rounds to index 9
    assert linear_percentile(values, 0.95) == pytest.approx(75.0)  # 20 + 0.55 * 100


@pytest.mark.parametrize("bad", [-0.1, 1.1])
def test_quantile_out_of_range(bad):
    with pytest.raises(ValueError):
        nearest_rank(TEN, bad)
    with pytest.raises(ValueError):
        linear_percentile(TEN, bad)


def test_empty_is_an_error():
    with pytest.raises(ValueError):
        nearest_rank([], 0.5)


@pytest.mark.parametrize(
    "values,deadline,expected",
    [(TEN, 5.0, 5), (TEN, 10.0, 0), ([1.0, INF], 60.0, 1), ([60.0, 60.1], 60.0, 1)],
)
def test_misses_are_strictly_above_the_deadline(values, deadline, expected):
    assert misses(values, deadline) == expected


@pytest.mark.parametrize(
    "k,n,lo,hi",
    [
        # the published table's intervals, rounded to whole percent
        (11, 36, 18, 47),
        (5, 36, 6, 29),
        (1, 36, 0, 14),
        (0, 36, 0, 10),
        (36, 36, 90, 100),
    ],
)
def test_wilson_interval_matches_published_rounding(k, n, lo, hi):
    low, high = wilson_interval(k, n)
    assert (round(low * 100), round(high * 100)) == (lo, hi)
    assert 0.0 <= low <= k / n <= high <= 1.0


def test_wilson_known_value():
    low, high = wilson_interval(11, 36)
    assert low == pytest.approx(0.18004, abs=1e-4) and high == pytest.approx(0.46856, abs=1e-4)


@pytest.mark.parametrize("k,n", [(-1, 5), (6, 5), (0, 0)])
def test_wilson_rejects_bad_counts(k, n):
    with pytest.raises(ValueError):
        wilson_interval(k, n)


def test_hedge_rate():
    assert hedge_rate([True, False, True, True]) == 0.75
    assert hedge_rate([]) == 0.0


def test_summarise_row():
    s = summarise(
        [6.0, 7.0, INF, 100.0],
        [0.01, 0.02, 0.0, 0.03],
        [0.02, 0.03, 0.0, 0.05],
        [False, True, True, False],
        deadlines=(30.0, 60.0),
    )
    assert s.n == 4
    # sorted [6, 7, 100, inf]: the median index is round(1.5) = 2
    assert s.p50_s == 100.0 and s.p95_s == INF and math.isinf(s.max_s)
    assert s.misses == {30.0: 2, 60.0: 2}
    assert s.active_usd == pytest.approx(0.015) and s.billed_usd == pytest.approx(0.025)
    assert s.hedged == 2 and s.hedge_rate == 0.5
    with pytest.raises(ValueError):
        summarise([1.0], [], [], [])
