"""The race deadline: a race without a winner gives up at it, whatever held it up (a Redis outage,
a worker that never came back, a provider that never answers). The engine on a virtual clock,
then the spec the config builds."""

from __future__ import annotations

import pytest

from gpuhedge_celery.config import RACE_SLACK_S, load_config
from gpuhedge_celery.core.clock import VirtualClock
from gpuhedge_celery.core.jobs import JobState
from gpuhedge_celery.core.policies import parse_policy
from gpuhedge_celery.core.race import DEADLINE_TIMER, Race
from gpuhedge_celery.core.race_events import (
    AttemptSubmitted,
    Cancel,
    CancelConfirmed,
    DeclareWinner,
    GiveUp,
    Launch,
    RaceFinished,
    ResultArrived,
    ScheduleTimer,
    TimerDue,
)
from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.race.spec import build_spec


def hedged(clock: VirtualClock, deadline_s: float | None = 30.0) -> Race:
    return Race(
        parse_policy("hedge:p->h@10s"), clock, race_id="r", deadline_s=deadline_s
    )  # fmt: skip


def test_a_race_without_a_winner_gives_up_at_its_deadline_and_no_late_result_wins():
    clock = VirtualClock()
    race = hedged(clock)
    assert race.start() == [ScheduleTimer(DEADLINE_TIMER, 30.0), Launch("a1", "p", "primary")]
    clock.set(0.1)
    race.handle(AttemptSubmitted("a1", "j1"))
    clock.set(10.1)
    assert race.handle(TimerDue("hedge")) == [Launch("a2", "h", "hedge")]
    # the hedge's submit never reported (its worker lost Redis): the attempt is still launching
    clock.set(29.0)
    assert race.handle(TimerDue(DEADLINE_TIMER)) == [ScheduleTimer(DEADLINE_TIMER, 30.0)]  # early
    clock.set(30.0)
    acts = race.handle(TimerDue(DEADLINE_TIMER))
    assert acts[0] == GiveUp("no valid result within the race's deadline (30 s)")
    assert Cancel("a1", "deadline") in acts
    assert race.gave_up and not race.finished and "deadline_passed" in race.flags
    # the launching hedge is cancelled the moment its job id is known
    clock.set(30.5)
    assert race.handle(AttemptSubmitted("a2", "j2")) == [Cancel("a2", "deadline")]
    # a valid result after the deadline confirms its job ended but cannot win
    clock.set(31.0)
    assert race.handle(ResultArrived("a1", JobState.COMPLETED, True)) == []
    assert race.winner is None
    clock.set(31.5)
    assert race.handle(CancelConfirmed("a2", JobState.CANCELLED)) == [
        RaceFinished(None, "no valid result within the race's deadline (30 s)")
    ]
    assert all(a.receipt is not None for a in race.attempts)


def test_a_won_race_drops_its_deadline_and_a_late_deadline_event_changes_nothing():
    clock = VirtualClock()
    race = hedged(clock)
    race.start()
    clock.set(0.1)
    race.handle(AttemptSubmitted("a1", "j1"))
    clock.set(5.0)
    assert race.handle(ResultArrived("a1", JobState.COMPLETED, True)) == [
        DeclareWinner("a1"),
        RaceFinished("a1", ""),
    ]
    assert DEADLINE_TIMER not in race.timers
    clock.set(30.0)
    assert race.handle(TimerDue(DEADLINE_TIMER)) == [] and race.winner == "a1"


def test_a_race_that_gave_up_resumes_as_given_up_in_another_process():
    clock = VirtualClock()
    race = hedged(clock, deadline_s=2.0)
    race.start()
    clock.set(0.1)
    race.handle(AttemptSubmitted("a1", "j1"))
    clock.set(2.0)
    race.handle(TimerDue(DEADLINE_TIMER))
    again = Race.from_dict(race.to_dict(), clock)
    assert again.gave_up and again.deadline_s == 2.0
    clock.set(2.5)
    assert again.handle(ResultArrived("a1", JobState.COMPLETED, True)) == [
        RaceFinished(None, "no valid result within the race's deadline (2 s)")
    ]
    # races without a deadline keep their stored form (replays, old states)
    assert "deadline_s" not in hedged(clock, None).to_dict()
    with pytest.raises(ValueError):
        hedged(clock, 0)


def test_the_spec_deadline_is_the_caps_added_up_plus_slack_or_the_configured_one(tmp_path):
    path = tmp_path / "c.yaml"
    body = """
time_scale: 0.5
providers:
  p: {role: primary, adapter: sim, timeout_s: 100}
  h: {role: hedge, adapter: sim}
policy: {name: fixed, params: {hedge_after_ms: 1000}}
timeouts: {attempt_cap_s: 40%s}
"""
    path.write_text(body % "")
    spec = build_spec(load_config(path))
    assert spec.deadline_s == pytest.approx((100 + 40 + RACE_SLACK_S) * 0.5)
    path.write_text(body % ", race_deadline_s: 90")
    assert build_spec(load_config(path)).deadline_s == pytest.approx(45.0)
    path.write_text(body % ", race_deadline_s: -1")
    with pytest.raises(ConfigError, match="race_deadline_s"):
        load_config(path)
