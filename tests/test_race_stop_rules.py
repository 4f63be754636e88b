"""Stopping a race (``StopRequested``), as a table run by the real race engine on a virtual
clock: each row drives a race to some point, stops it, and says what the stop must emit; the
race is then driven to its end, and whatever a stopped race does afterwards must hold for every
row (nothing launches, nothing wins, every attempt ends with a receipt)."""

from __future__ import annotations

import json

import pytest

from gpuhedge_celery.core.clock import VirtualClock
from gpuhedge_celery.core.jobs import JobState
from gpuhedge_celery.core.policies import parse_policy
from gpuhedge_celery.core.race import DEADLINE_TIMER, Race
from gpuhedge_celery.core.race_events import (
    AttemptSubmitted,
    Cancel,
    CancelConfirmed,
    GiveUp,
    Launch,
    RaceFinished,
    ResultArrived,
    StopRequested,
    SubmitFailed,
    TimerDue,
    event_from_dict,
)

HEDGE = "hedge:p->h@10s"
CASCADE = "cascade:p->h->f@q2.5s+s8.5s+e25s"
STOPPED = "stopped by cli"

# Steps before the stop: (clock reading, event).
PRIMARY_RUNNING = [(0.1, AttemptSubmitted("a1", "j1"))]
BOTH_RUNNING = [
    *PRIMARY_RUNNING,
    (10.1, TimerDue("hedge")),
    (10.2, AttemptSubmitted("a2", "j2")),
]
HEDGE_LAUNCHING = [*PRIMARY_RUNNING, (10.1, TimerDue("hedge"))]

# id, policy, steps before the stop, stop time, what the stop emits
ROWS = [
    (
        "primary-running-hedge-timer-pending",
        HEDGE,
        PRIMARY_RUNNING,
        5.0,
        [GiveUp(STOPPED), Cancel("a1", "stopped")],
    ),
    (
        "primary-still-launching",
        HEDGE,
        [],
        0.05,
        [GiveUp(STOPPED)],  # its cancel goes out once its job id is known
    ),
    (
        "both-running",
        HEDGE,
        BOTH_RUNNING,
        12.0,
        [GiveUp(STOPPED), Cancel("a1", "stopped"), Cancel("a2", "stopped")],
    ),
    (
        "hedge-launching",
        HEDGE,
        HEDGE_LAUNCHING,
        10.15,
        [GiveUp(STOPPED), Cancel("a1", "stopped")],
    ),
    (
        "cascade-before-cutover",
        CASCADE,
        PRIMARY_RUNNING,
        1.0,
        [GiveUp(STOPPED), Cancel("a1", "stopped")],
    ),
]


def _race(policy: str, clock: VirtualClock, deadline_s: float | None = None) -> Race:
    return Race(parse_policy(policy), clock, race_id="r", deadline_s=deadline_s)


def _drive(race: Race, clock: VirtualClock, steps: list) -> list:
    out = []
    for at, event in steps:
        clock.set(at)
        out += race.handle(event)
    return out


def _settle(race: Race, clock: VirtualClock, start: float) -> list:
    """Everything the world could still report after the stop: late submits, the hedge's
    timer, a valid result, the cancels confirmed. Returns what the race emitted."""
    out: list = []
    t = start
    for event in [TimerDue("hedge"), TimerDue("cutover"), TimerDue(DEADLINE_TIMER)]:
        t += 1.0
        clock.set(t)
        out += race.handle(event)
    for a in list(race.attempts):
        if a.id == "a1" and a.live and a.phase.value == "launching":
            t += 0.1
            clock.set(t)
            out += race.handle(AttemptSubmitted(a.id, f"late-{a.id}"))
        elif a.live and a.phase.value == "launching":
            t += 0.1
            clock.set(t)
            out += race.handle(SubmitFailed(a.id, "not submitted: the race no longer needs it"))
    t += 0.1
    clock.set(t)
    if race.attempts and race.attempts[0].live:
        out += race.handle(ResultArrived("a1", JobState.COMPLETED, True))  # too late to win
    for a in list(race.attempts):
        if a.live:
            t += 0.1
            clock.set(t)
            out += race.handle(CancelConfirmed(a.id, JobState.CANCELLED))
    return out


@pytest.mark.parametrize(
    ("policy", "before", "stop_at", "emitted"),
    [row[1:] for row in ROWS],
    ids=[row[0] for row in ROWS],
)
def test_a_stop_gives_up_cancels_every_live_job_and_nothing_launches_or_wins_after_it(
    policy, before, stop_at, emitted
):
    clock = VirtualClock()
    race = _race(policy, clock)
    race.start()
    _drive(race, clock, before)
    launched = len(race.attempts)
    clock.set(stop_at)
    assert race.handle(StopRequested("cli")) == emitted
    assert race.gave_up and race.stopped_by == "cli" and race.stopped_at == stop_at
    assert "stopped" in race.flags and "deadline_passed" not in race.flags
    assert race.timers == {} and race.waiting == []
    assert race.handle(StopRequested("someone else")) == []  # idempotent: the first stop holds
    assert race.stopped_by == "cli" and race.stopped_at == stop_at

    after = _settle(race, clock, stop_at)
    assert not [a for a in after if isinstance(a, Launch)]  # nothing launches after a stop
    assert len(race.attempts) == launched
    assert race.winner is None and race.finished
    assert after[-1] == RaceFinished(None, STOPPED)
    for a in race.attempts:  # every attempt has its receipt; a stopped job says why
        assert a.receipt is not None
        if a.cancel_sent_at is not None:
            assert a.cancel_reason == "stopped" and a.receipt.note.startswith("stopped")


def test_a_stop_after_the_winner_or_the_finish_or_the_deadline_changes_nothing():
    clock = VirtualClock()
    won = _race(HEDGE, clock)
    won.start()
    _drive(won, clock, BOTH_RUNNING)
    clock.set(12.0)
    won.handle(ResultArrived("a2", JobState.COMPLETED, True))  # a1 is being cancelled
    assert not won.finished
    before = won.to_dict()
    assert won.handle(StopRequested("cli")) == [] and won.to_dict() == before
    assert won.stopped_by is None and won.winner == "a2"

    clock.set(13.0)
    won.handle(CancelConfirmed("a1", JobState.CANCELLED))
    assert won.finished and won.handle(StopRequested("cli")) == []

    clock = VirtualClock()
    late = _race(HEDGE, clock, deadline_s=30.0)
    late.start()
    _drive(late, clock, PRIMARY_RUNNING)
    clock.set(30.0)
    late.handle(TimerDue(DEADLINE_TIMER))
    assert late.gave_up and late.handle(StopRequested("cli")) == [] and late.stopped_by is None


def test_a_stop_of_a_race_without_a_deadline_survives_a_json_round_trip():
    clock = VirtualClock()
    race = _race(HEDGE, clock)
    race.start()
    _drive(race, clock, PRIMARY_RUNNING)
    assert "stopped_by" not in race.to_dict()  # an unstopped race keeps its stored form
    clock.set(3.0)
    race.handle(StopRequested("nightly-batch"))
    again = Race.from_dict(json.loads(json.dumps(race.to_dict())), clock)
    assert again.gave_up and again.stopped_by == "nightly-batch" and again.stopped_at == 3.0
    assert again.deadline_s is None
    clock.set(4.0)
    assert again.handle(ResultArrived("a1", JobState.COMPLETED, True)) == [
        RaceFinished(None, "stopped by nightly-batch")
    ]
    event = StopRequested("revoke")
    assert event_from_dict(json.loads(json.dumps(event.to_dict()))) == event
    assert StopRequested().to_dict() == {"kind": "stop_requested", "by": ""}
