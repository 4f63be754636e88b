"""Every policy rule as a row of one table, run by the real race engine on a virtual clock.

Each row: a policy name, scripted providers (``p`` primary, ``h`` hedge, ``f`` fallback; times
are seconds after that job's own submit), and what must happen: the winner, its end-to-end time,
every launch (time, provider), and the outcome flags.
"""

from __future__ import annotations

import pytest

from gpuhedge_celery.core.outcome import race_outcome
from gpuhedge_celery.core.policies import parse_policy
from gpuhedge_celery.core.race_events import Cancel, Launch
from gpuhedge_celery.core.scripted import Arm, run_race


def arms(**spec: dict) -> dict[str, Arm]:
    return {name: Arm(name, **kw) for name, kw in spec.items()}


SINGLE = "single:p"
FIXED = "hedge:p->h@10s"
RACE = "hedge:p->h@0s"
CUT = "cutover:p->h@q2.5s+s8.5s"
CASCADE = "cascade:p->h->f@q2.5s+s8.5s+e25s"
BAD = {"valid": False, "reasons": ("near-silent audio",)}

# id, policy, providers, winner, latency, launches, flags that must be set
ROWS = [
    ("single-valid", SINGLE, arms(p={"wall_s": 5}), "p", 5.0, [(0, "p")], set()),
    (
        "single-invalid-no-winner",
        SINGLE,
        arms(p={"wall_s": 5, **BAD}),
        None,
        None,
        [(0, "p")],
        set(),
    ),
    # fixed hedge
    (
        "fixed-fast-primary-no-hedge",
        FIXED,
        arms(p={"wall_s": 6}, h={"wall_s": 20}),
        "p",
        6.0,
        [(0, "p")],
        set(),
    ),
    (
        "fixed-slow-primary-hedge-wins",
        FIXED,
        arms(p={"wall_s": 100}, h={"wall_s": 20}),
        "h",
        30.0,
        [(0, "p"), (10, "h")],
        {"hedged"},
    ),
    (
        "fixed-primary-wins-after-hedge",
        FIXED,
        arms(p={"wall_s": 12}, h={"wall_s": 20}),
        "p",
        12.0,
        [(0, "p"), (10, "h")],
        {"hedged"},
    ),
    (
        "fixed-result-on-timer-no-hedge",
        FIXED,
        arms(p={"wall_s": 10.0}, h={"wall_s": 1}),
        "p",
        10.0,
        [(0, "p")],
        set(),
    ),
    (
        "fixed-invalid-primary-hedges-at-once",
        FIXED,
        arms(p={"wall_s": 3, **BAD}, h={"wall_s": 20}),
        "h",
        23.0,
        [(0, "p"), (3, "h")],
        {"hedged"},
    ),
    (
        "fixed-failed-primary-hedges-at-once",
        FIXED,
        arms(p={"wall_s": 4, "valid": False, "state": "FAILED"}, h={"wall_s": 20}),
        "h",
        24.0,
        [(0, "p"), (4, "h")],
        {"hedged"},
    ),
    (
        "fixed-submit-failure-hedges-at-once",
        FIXED,
        arms(p={"wall_s": 0, "submitted": False, "valid": False}, h={"wall_s": 20}),
        "h",
        20.0,
        [(0, "p"), (0, "h")],
        {"hedged"},
    ),
    (
        "fixed-invalid-hedge-never-ends-race",
        FIXED,
        arms(p={"wall_s": 100}, h={"wall_s": 5, **BAD}),
        "p",
        100.0,
        [(0, "p"), (10, "h")],
        {"hedged"},
    ),
    (
        "fixed-invalid-primary-after-hedge",
        FIXED,
        arms(p={"wall_s": 50, **BAD}, h={"wall_s": 60}),
        "h",
        70.0,
        [(0, "p"), (10, "h")],
        {"hedged"},
    ),
    (
        "fixed-both-invalid-no-winner",
        FIXED,
        arms(p={"wall_s": 50, **BAD}, h={"wall_s": 5, **BAD}),
        None,
        None,
        [(0, "p"), (10, "h")],
        {"hedged"},
    ),
    (
        "immediate-race-launches-both",
        RACE,
        arms(p={"wall_s": 6}, h={"wall_s": 20}),
        "p",
        6.0,
        [(0, "p"), (0, "h")],
        {"hedged"},
    ),
    (
        "immediate-race-hedge-wins",
        RACE,
        arms(p={"wall_s": 60}, h={"wall_s": 20}),
        "h",
        20.0,
        [(0, "p"), (0, "h")],
        {"hedged"},
    ),
    # state-aware cutover
    (
        "cutover-running-primary-kept",
        CUT,
        arms(p={"wall_s": 6, "queue_delay_s": 1.2}, h={"wall_s": 19}),
        "p",
        6.0,
        [(0, "p")],
        set(),
    ),
    (
        "cutover-queued-primary-cut-over",
        CUT,
        arms(p={"wall_s": 100, "queue_delay_s": 10}, h={"wall_s": 19}),
        "h",
        21.5,
        [(0, "p"), (2.5, "h")],
        {"hedged", "cut_over"},
    ),
    (
        "cutover-unknown-state-safety-hedge",
        CUT,
        arms(p={"wall_s": 100}, h={"wall_s": 19}),
        "h",
        27.5,
        [(0, "p"), (8.5, "h")],
        {"hedged"},
    ),
    (
        "cutover-poll-error-safety-hedge",
        CUT,
        arms(p={"wall_s": 100, "queue_delay_s": 50, "poll_error": True}, h={"wall_s": 19}),
        "h",
        27.5,
        [(0, "p"), (8.5, "h")],
        {"hedged"},
    ),
    (
        "cutover-running-slow-safety-hedge",
        CUT,
        arms(p={"wall_s": 30, "queue_delay_s": 1}, h={"wall_s": 10}),
        "h",
        18.5,
        [(0, "p"), (8.5, "h")],
        {"hedged"},
    ),
    (
        "cutover-invalid-primary-hedges-at-once",
        CUT,
        arms(p={"wall_s": 1, **BAD}, h={"wall_s": 19}),
        "h",
        20.0,
        [(0, "p"), (1, "h")],
        {"hedged"},
    ),
    (
        "cutover-unconfirmed-cancel-can-still-win",
        CUT,
        arms(p={"wall_s": 4, "queue_delay_s": 3, "cancel_terminal_s": 5}, h={"wall_s": 19}),
        "p",
        4.0,
        [(0, "p"), (2.5, "h")],
        {"hedged", "cut_over"},
    ),
    (
        "cutover-leaked-cancel-never-loses-race",
        CUT,
        arms(p={"wall_s": 100, "queue_delay_s": 10, "cancel_raises": True}, h={"wall_s": 19}),
        "h",
        21.5,
        [(0, "p"), (2.5, "h")],
        {"hedged", "cut_over", "leaked"},
    ),
    # cascade
    (
        "cascade-escalates-at-time",
        CASCADE,
        arms(p={"wall_s": 100, "queue_delay_s": 10}, h={"wall_s": 50}, f={"wall_s": 5}),
        "f",
        30.0,
        [(0, "p"), (2.5, "h"), (25, "f")],
        {"hedged", "cut_over"},
    ),
    (
        "cascade-waits-at-capacity-then-retries",
        CASCADE,
        arms(p={"wall_s": 100, "queue_delay_s": 1}, h={"wall_s": 20, **BAD}, f={"wall_s": 5}),
        "f",
        33.5,
        [(0, "p"), (8.5, "h"), (28.5, "f")],
        {"hedged", "escalation_waited"},
    ),
    (
        "cascade-all-failed-escalates-at-once",
        CASCADE,
        arms(p={"wall_s": 1, **BAD}, h={"wall_s": 2, **BAD}, f={"wall_s": 5}),
        "f",
        8.0,
        [(0, "p"), (1, "h"), (3, "f")],
        {"hedged"},
    ),
    (
        "cascade-fallback-at-most-once",
        CASCADE,
        arms(p={"wall_s": 1, **BAD}, h={"wall_s": 2, **BAD}, f={"wall_s": 5, **BAD}),
        None,
        None,
        [(0, "p"), (1, "h"), (3, "f")],
        {"hedged"},
    ),
    (
        "cascade-waiting-escalation-dropped-on-win",
        CASCADE,
        arms(p={"wall_s": 30, "queue_delay_s": 1}, h={"wall_s": 50}, f={"wall_s": 1}),
        "p",
        30.0,
        [(0, "p"), (8.5, "h")],
        {"hedged", "escalation_waited"},
    ),
    (
        "cascade-waits-for-unconfirmed-cancel",
        CASCADE,
        arms(
            p={"wall_s": 100, "queue_delay_s": 10, "cancel_terminal_s": 30},
            h={"wall_s": 50},
            f={"wall_s": 5},
        ),
        "f",
        37.5,
        [(0, "p"), (2.5, "h"), (32.5, "f")],
        {"hedged", "cut_over", "escalation_waited"},
    ),
]


@pytest.mark.parametrize(
    "policy,providers,winner,latency,launches,flags",
    [pytest.param(*row[1:], id=row[0]) for row in ROWS],
)
def test_policy_rule(policy, providers, winner, latency, launches, flags):
    from gpuhedge_celery.core.jobs import JobState

    # The table writes states as strings for brevity.
    providers = {k: Arm(**{**v.__dict__, "state": JobState(v.state)}) for k, v in providers.items()}
    trace: list = []
    live_seen: list[int] = []
    race = run_race(
        parse_policy(policy),
        providers,
        trace=trace,
        after_event=lambda r: live_seen.append(r.live_count),
    )
    won = race.winner_attempt
    assert (won.provider if won else None) == winner
    if latency is None:
        assert race.latency() is None
    else:
        assert race.latency() == pytest.approx(latency)
    assert [(t, a.provider) for t, a in trace if isinstance(a, Launch)] == [
        (pytest.approx(t), p) for t, p in launches
    ]
    outcome = race_outcome(race)
    got = {
        "hedged": outcome.hedged,
        "cut_over": outcome.cut_over,
        "escalated": outcome.escalated,
        "escalation_waited": outcome.escalation_waited,
        "leaked": "leaked" in race.flags,
    }
    for flag, value in got.items():
        expected = flag in flags or (flag == "escalated" and any(p == "f" for _, p in launches))
        assert value == expected, flag
    assert max(live_seen) <= 2
    assert race.finished
    # Every launched loser ends with a receipt; every cancelled job was cancelled exactly once.
    for attempt in race.attempts:
        if attempt.id != race.winner:
            assert attempt.receipt is not None, attempt.id
    cancels = [a.attempt_id for _, a in trace if isinstance(a, Cancel)]
    assert len(cancels) == len(set(cancels))


def test_cutover_receipt_says_queued_job_cost_nothing():
    race = run_race(
        parse_policy(CUT), arms(p={"wall_s": 100, "queue_delay_s": 10}, h={"wall_s": 19})
    )
    primary = race.attempt_for("primary")
    assert primary.receipt.was_running is False
    assert primary.receipt.scope.value == "queued_job"
    assert primary.receipt.confirmed_terminal and not primary.receipt.leaked
    from gpuhedge_celery.core.rates import ProviderRate

    outcome = race_outcome(race, {"p": ProviderRate(1.0, 60), "h": ProviderRate(1.0)})
    assert outcome.active_usd == pytest.approx(19.0)  # only the hedge ran
    assert outcome.wasted_usd == pytest.approx(0.0)


def test_leaked_cancel_receipt_is_kept_and_flagged():
    race = run_race(
        parse_policy(FIXED),
        arms(p={"wall_s": 100, "cancel_raises": True}, h={"wall_s": 20}),
    )
    loser = race.attempt_for("primary")
    assert race.winner_attempt.provider == "h"
    assert loser.receipt.leaked is True
    assert loser.receipt.evidence.value == "no_evidence"
    assert "cancel" in loser.receipt.note
    # the leaked job's own late result neither changes the winner nor unleaks it silently
    assert race.finished and race.latency() == pytest.approx(30.0)


def test_loser_that_never_confirms_is_leaked_after_ack():
    race = run_race(
        parse_policy(FIXED),
        arms(p={"wall_s": 100, "cancel_terminal_s": None, "cancel_ack_s": 0.3}, h={"wall_s": 20}),
    )
    receipt = race.attempt_for("primary").receipt
    assert receipt.leaked and receipt.evidence.value == "provider_ack"
    assert receipt.cancel_ack_ms is not None and receipt.terminal_status is None
