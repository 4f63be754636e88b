"""Drive a race from scripted provider timelines on a virtual clock (replay, tests, what-ifs).

Each provider is an :class:`Arm`: when its result arrives after submit, whether it is valid,
how long it sits QUEUED, and how its cancel behaves. :func:`run_race` performs every action the
race emits by scheduling the matching events on a virtual timeline, so the race engine under test
is exactly the one live races use; nothing here decides who wins.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..errors import ConfigError
from .clock import VirtualClock
from .jobs import JobState
from .policy_base import Policy
from .race import MAX_LIVE_JOBS, Race
from .race_events import (
    Action,
    AttemptSubmitted,
    Cancel,
    CancelAcknowledged,
    CancelConfirmed,
    CancelFailed,
    Event,
    Launch,
    PollStatus,
    ResultArrived,
    ScheduleTimer,
    StatusObserved,
    SubmitFailed,
    TimerDue,
)
from .receipts import CancelReceipt, CancelScope, Evidence

# Same-instant ordering: replies to actions first, then results, then timers, so a result that
# lands exactly on a hedge timer counts as "in by then" and no hedge is launched.
_REPLY, _RESULT, _TIMER = 0, 1, 2


@dataclass(frozen=True)
class Arm:
    """One provider's scripted behaviour for one request (times in seconds after its submit)."""

    provider: str
    wall_s: float
    valid: bool = True
    state: JobState = JobState.COMPLETED
    reasons: tuple[str, ...] = ()
    submitted: bool = True  # False: the submit itself fails
    queue_delay_s: float | None = None  # None: the provider exposes no queued state
    poll_error: bool = False  # status polls fail
    cancel_ack_s: float = 0.0  # cancel call returns this long after it is sent
    cancel_terminal_s: float | None = 0.0  # terminal state observed after send; None: never
    cancel_raises: bool = False  # the cancel call itself raises

    def status_after(self, elapsed_s: float) -> JobState:
        """What a status poll ``elapsed_s`` after submit would have said."""
        if self.queue_delay_s is None:
            return JobState.UNKNOWN
        return JobState.QUEUED if elapsed_s < self.queue_delay_s else JobState.IN_PROGRESS


def run_race(
    policy: Policy,
    arms: Mapping[str, Arm],
    *,
    race_id: str = "",
    cap_s: float | None = None,
    max_live: int = MAX_LIVE_JOBS,
    trace: list[tuple[float, Action]] | None = None,
    after_event: Callable[[Race], None] | None = None,
) -> Race:
    """Run ``policy`` against ``arms`` to the end; returns the finished race.

    ``cap_s`` right-censors each attempt like a provider adapter does: a result later than the
    cap arrives at the cap as TIMEOUT. ``trace`` (when given) receives every (time, action);
    ``after_event`` is called with the race after every event (for invariant checks).
    """
    clock = VirtualClock()
    race = Race(policy, clock, race_id=race_id, max_live=max_live)
    queue: list[tuple[float, int, int, Event]] = []
    submits: dict[str, tuple[Arm, float]] = {}
    seq = 0

    def push(t: float, prio: int, event: Event) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(queue, (t, prio, seq, event))

    def perform(actions: list[Action], t: float) -> None:
        for action in actions:
            if trace is not None:
                trace.append((t, action))
            if isinstance(action, Launch):
                arm = arms.get(action.provider)
                if arm is None:
                    known = ", ".join(sorted(arms))
                    raise ConfigError(
                        f"no recorded provider {action.provider!r} (have {known})", key="policy"
                    )
                aid = action.attempt_id
                if not arm.submitted:
                    push(t, _REPLY, SubmitFailed(aid, "; ".join(arm.reasons) or "submit failed"))
                    continue
                submits[aid] = (arm, t)
                push(t, _REPLY, AttemptSubmitted(aid, f"{race_id or 'race'}-{aid}"))
                if cap_s is not None and arm.wall_s > cap_s:
                    push(t + cap_s, _RESULT, ResultArrived(aid, JobState.TIMEOUT, False))
                else:
                    push(
                        t + arm.wall_s,
                        _RESULT,
                        ResultArrived(aid, arm.state, arm.valid, arm.reasons),
                    )
            elif isinstance(action, PollStatus):
                arm, at = submits[action.attempt_id]
                if arm.poll_error:
                    push(t, _REPLY, StatusObserved(action.attempt_id, None, "poll failed"))
                else:
                    push(t, _REPLY, StatusObserved(action.attempt_id, arm.status_after(t - at)))
            elif isinstance(action, Cancel):
                _cancel(push, action.attempt_id, *submits[action.attempt_id], t)
            elif isinstance(action, ScheduleTimer):
                push(action.at, _TIMER, TimerDue(action.key))

    perform(race.start(), 0.0)
    while queue and not race.finished:
        t, _, _, event = heapq.heappop(queue)
        clock.set(t)
        perform(race.handle(event), t)
        if after_event is not None:
            after_event(race)
    if not race.finished:
        raise RuntimeError(f"race {race_id!r} ran out of events before finishing")  # engine bug
    return race


def _cancel(
    push: Callable[[float, int, Event], None], aid: str, arm: Arm, submitted_at: float, t: float
) -> None:
    if arm.cancel_raises:
        push(t, _REPLY, CancelFailed(aid, "cancel call raised"))
        return
    queued = arm.status_after(t - submitted_at) is JobState.QUEUED
    receipt = CancelReceipt(
        provider=arm.provider,
        job_id="",
        was_running=not queued,
        evidence=Evidence.PROVIDER_ACK,
        scope=CancelScope.QUEUED_JOB if queued else CancelScope.REQUEST,
    )
    push(t + arm.cancel_ack_s, _REPLY, CancelAcknowledged(aid, receipt))
    if arm.cancel_terminal_s is None:
        push(t + arm.cancel_ack_s, _REPLY, CancelFailed(aid, "no terminal state within window"))
    else:
        push(t + arm.cancel_terminal_s, _REPLY, CancelConfirmed(aid, JobState.CANCELLED))
