"""Pure lease rules: state classification and TTL suggestions, as tables (no server)."""

from __future__ import annotations

import pytest

from gpuhedge_celery.core.lease_rules import (
    FREE,
    HELD,
    STALE,
    classify,
    percentile,
    suggest_ttl,
    validate_ttl_ms,
)
from gpuhedge_celery.store.listener import merged_flags


@pytest.mark.parametrize(
    "leased, host_live, token, accepted, state",
    [
        (False, True, 0, 0, FREE),
        (False, False, 0, 5, FREE),
        (True, True, 3, 3, HELD),
        (True, True, 4, 3, HELD),
        (True, False, 3, 3, STALE),  # nobody renews it: it only waits for its TTL
        (True, True, 2, 3, STALE),  # the worker already accepted a newer token
    ],
)
def test_classify(leased, host_live, token, accepted, state):
    assert classify(leased=leased, host_live=host_live, token=token, accepted=accepted) == state


@pytest.mark.parametrize("bad", [0, -1, 1.5, "100", None, True])
def test_ttl_must_be_positive_int(bad):
    with pytest.raises(ValueError, match="ttl"):
        validate_ttl_ms(bad)


@pytest.mark.parametrize(
    "values, pct, expected",
    [([1, 2, 3, 4], 50, 2), ([1, 2, 3, 4], 100, 4), ([5], 99, 5), (list(range(1, 101)), 99, 99)],
)
def test_percentile_nearest_rank(values, pct, expected):
    assert percentile(values, pct) == expected


def test_suggest_ttl_uses_p99_times_margin_and_says_so():
    durations = [10.0] * 98 + [20.0, 40.0]  # p99 = 20 s
    s = suggest_ttl(durations)
    assert s.percentile == 99 and s.percentile_s == 20.0 and s.margin == 1.5
    assert s.ttl_ms == 30_000
    assert "p99 of 100" in s.reason and "1.5" in s.reason


def test_suggest_ttl_few_samples_uses_max():
    s = suggest_ttl([1.0, 2.0, 7.0])
    assert s.percentile == 100 and s.ttl_ms == 10_500 and "max" in s.reason


def test_suggest_ttl_floor():
    s = suggest_ttl([0.01] * 50)
    assert s.ttl_ms == 1000 and "floor" in s.reason


@pytest.mark.parametrize("bad", [[], [1.0, -2.0], [float("nan")]])
def test_suggest_ttl_rejects_bad_durations(bad):
    with pytest.raises(ValueError):
        suggest_ttl(bad)


@pytest.mark.parametrize(
    "current, merged",
    [
        ("", "Egx"),
        ("Kl", "KlEgx"),
        ("xE", "xEg"),
        ("AKE", None),
        ("gxE", None),
        ("A", "AE"),
    ],
)
def test_notification_flags_are_added_never_removed(current, merged):
    assert merged_flags(current) == merged
