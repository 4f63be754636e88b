"""Pure lease rules: state classification, TTL suggestions and the GPU worker's own fence mark,
as tables (no server)."""

from __future__ import annotations

import pytest

from gpuhedge_celery.core.lease_rules import (
    FREE,
    HELD,
    STALE,
    FenceMark,
    classify,
    percentile,
    suggest_ttl,
    validate_ttl_ms,
)
from gpuhedge_celery.store.listener import merged_flags


@pytest.mark.parametrize(
    "token, delivery, refused",
    [
        (6, "other", False),  # newer: any delivery
        (5, "d1", False),  # the same delivery again (its reply was lost)
        (5, "d2", True),  # the same number for other work (a failover re-issued it)
        (4, "d1", True),  # older than the mark, even for the same delivery
    ],
)
def test_fence_mark_refuses_older_tokens_and_repeats_only_for_the_same_delivery(
    token, delivery, refused
):
    assert FenceMark(5, "d1").refuses(token, delivery) is refused
    assert FenceMark().refuses(token, delivery) is False  # no mark yet: Redis decides alone


def test_fence_mark_never_goes_down():
    mark = FenceMark().after(5, "d1")
    assert mark == FenceMark(5, "d1")
    assert mark.after(4, "d0") == mark and mark.after(5, "d2") == mark
    assert mark.after(9, "d3") == FenceMark(9, "d3")
    assert mark.after(9, "d3", "h3") == FenceMark(9, "d3", "h3")


@pytest.mark.parametrize(
    "token, holder, freed",
    [
        (4, "h1", True),  # below the mark: no work this process accepted runs under it
        (4, "", True),
        (5, "h2", True),  # the mark's number issued again, to another holder
        (5, "h1", False),  # a duplicate delivery of the job running under the mark's lease
        (5, "", False),  # unknown holder: it may be that job's
    ],
)
def test_fence_mark_frees_a_refused_lease_only_when_no_accepted_work_runs_under_it(
    token, holder, freed
):
    assert FenceMark(5, "d1", "h1").frees(token, holder) is freed
    assert FenceMark(5, "d1").frees(5, "h2") is False  # the mark's holder unknown


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
