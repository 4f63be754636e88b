"""A cutover whose cancel found the primary running is reported as what it was: a hedge.

A queue-state cutover cancels a primary still queued, for $0. When that cancel reaches the
provider only after the job has started (it waited for the fleet's ``/cancel`` token), both
jobs ran and billed: the receipt says ``cutover_late``, not ``cut_over``.
"""

from __future__ import annotations

import pytest

from gpuhedge_celery.core.clock import VirtualClock
from gpuhedge_celery.core.jobs import JobState
from gpuhedge_celery.core.outcome import race_outcome
from gpuhedge_celery.core.policies import parse_policy
from gpuhedge_celery.core.race import Race
from gpuhedge_celery.core.race_events import (
    AttemptSubmitted,
    CancelAcknowledged,
    ResultArrived,
    StatusObserved,
    TimerDue,
)
from gpuhedge_celery.core.rates import ProviderRate
from gpuhedge_celery.core.receipts import CancelReceipt, Evidence

RATES = {"p": ProviderRate(0.001), "h": ProviderRate(0.002)}


def cut_over_race(provider_says_running: bool) -> Race:
    clock = VirtualClock(50.0)
    race = Race(parse_policy("cutover:p->h@q1s+s5s"), clock, race_id="r1")
    race.start()
    race.handle(AttemptSubmitted("a1", "job-1", {"job_id": "job-1"}))
    clock.advance(1.0)
    race.handle(TimerDue("cutover"))
    race.handle(StatusObserved("a1", JobState.QUEUED))  # still queued: cut over
    assert "cut_over" in race.flags and race.attempt_for("primary").cancel_sent_at is not None
    race.handle(AttemptSubmitted("a2", "job-2", {"job_id": "job-2"}))
    clock.advance(6.0)  # the cancel waited 6 s for a token; RunPod's confirming read:
    executed_ms = 4000.0 if provider_says_running else 0.0
    seen = CancelReceipt(
        "p",
        "job-1",
        was_running=provider_says_running,
        evidence=Evidence.PROVIDER_ACK,
        cancel_ack_ms=57_000.0,
        execution_ms_before_cancel=executed_ms,
        reconciled_cost_usd=executed_ms / 1e6,
    )
    seen.confirm_terminal(JobState.CANCELLED, 57_100.0)
    race.handle(CancelAcknowledged("a1", seen))
    clock.advance(1.0)
    race.handle(ResultArrived("a2"))
    assert race.finished and race.winner == "a2"
    return race


@pytest.mark.parametrize("running", [True, False])
def test_a_cutover_is_reported_by_what_its_cancel_found(running):
    out = race_outcome(cut_over_race(running), RATES).to_dict()
    assert out["hedged"] is True  # a second job was sent either way
    assert out["cut_over"] is (not running) and out["cutover_late"] is running
    primary = out["attempts"][0]
    # the primary is priced from RunPod's own figure: $0 when still queued, else its run
    assert primary["usd"] == pytest.approx(0.004 if running else 0.0)
    assert out["wasted_usd"] == pytest.approx(0.004 if running else 0.0)
