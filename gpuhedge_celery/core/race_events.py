"""The messages a race exchanges with whoever drives it: events in, actions out.

A driver (the replay, the simulator, a Celery coordinator) performs each :class:`Action` the race
emits and reports back what happened as an :class:`Event`. Both are plain data with ``to_dict`` /
``from_dict`` so they can cross process boundaries (Celery messages, Redis).

Events are idempotent where it matters for at-least-once delivery: a duplicated result, timer or
acknowledgement is ignored by the race.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from ._data import copy_data
from .jobs import JobState
from .receipts import CancelReceipt

_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    """The dataclass field names of ``cls``, looked up once: ``fields()`` is slow per message."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


# --------------------------------------------------------------------------- events (in)


@dataclass(frozen=True)
class Event:
    """Base class: something that happened to the race, reported by its driver."""

    kind: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"kind": self.kind}
        for name in _field_names(type(self)):
            value = getattr(self, name)
            if isinstance(value, JobState):
                value = value.value
            elif isinstance(value, CancelReceipt):
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = list(value)
            data[name] = value
        return data


@dataclass(frozen=True)
class Start(Event):
    """Begin the race: the policy launches its primary."""

    kind: ClassVar[str] = "start"


@dataclass(frozen=True)
class TimerDue(Event):
    """A timer the race scheduled (by key) has come due."""

    kind: ClassVar[str] = "timer_due"
    key: str


@dataclass(frozen=True)
class AttemptSubmitted(Event):
    """The provider accepted a launched attempt; ``handle`` is its serialised JobHandle."""

    kind: ClassVar[str] = "attempt_submitted"
    attempt_id: str
    job_id: str = ""
    handle: dict[str, Any] | None = None


@dataclass(frozen=True)
class SubmitFailed(Event):
    """The provider refused a launched attempt: it ends without a valid result.

    ``outcome_unknown``: the adapter says the submit may have created a job whose id never
    came back (a lost reply): nothing can cancel it, so the attempt ends as a listed leak.
    ``refused``: the budget refused the attempt's reservation; nothing was submitted. A
    refused primary ends the race (nothing more is launched); a refused hedge or fallback
    leaves the race going without it.
    ``unsent``: nothing reached the provider for another reason (the race no longer needed
    the attempt); like a refused one, the attempt is not counted as sent (not a hedge).
    """

    kind: ClassVar[str] = "submit_failed"
    attempt_id: str
    error: str = ""
    outcome_unknown: bool = False
    refused: bool = False
    unsent: bool = False


@dataclass(frozen=True)
class StatusObserved(Event):
    """A status poll answered: a state, or ``error`` when the poll itself failed."""

    kind: ClassVar[str] = "status_observed"
    attempt_id: str
    state: JobState | None = None
    error: str | None = None


@dataclass(frozen=True)
class ResultArrived(Event):
    """An attempt's result is in: its terminal state and whether it passed validation.

    After the race has finished, the result of a loser still live (its cancel never shown to
    stop it) is taken as a late result: it prices the job and ends it, and changes no winner."""

    kind: ClassVar[str] = "result_arrived"
    attempt_id: str
    state: JobState = JobState.COMPLETED
    valid: bool = True
    reasons: tuple[str, ...] = ()
    #: False for a delivery nothing could check with the provider (a Cerebrium webhook): it
    #: ends the attempt, but is no proof that a cancelled job stopped
    verified: bool = True

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        if self.verified:  # the default: left out, so a worker of the previous release reads it
            del data["verified"]
        return data


@dataclass(frozen=True)
class CancelAcknowledged(Event):
    """The provider's cancel call returned; ``receipt`` is what the provider could say."""

    kind: ClassVar[str] = "cancel_acknowledged"
    attempt_id: str
    receipt: CancelReceipt | None = None


@dataclass(frozen=True)
class CancelConfirmed(Event):
    """A cancelled attempt was observed in a terminal state (polled, not the cancel's reply)."""

    kind: ClassVar[str] = "cancel_confirmed"
    attempt_id: str
    state: JobState = JobState.CANCELLED


@dataclass(frozen=True)
class CancelFailed(Event):
    """The cancel raised or never reached a terminal state: the attempt is leaked."""

    kind: ClassVar[str] = "cancel_failed"
    attempt_id: str
    error: str = ""


@dataclass(frozen=True)
class StopRequested(Event):
    """Someone stopped the race (``by``: ``cli``, ``revoke`` or a caller's own word): like a
    passed deadline, the caller is failed, every live job is cancelled and nothing can win.
    A stop of a race already won, given up or stopped changes nothing."""

    kind: ClassVar[str] = "stop_requested"
    by: str = ""


EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        Start,
        TimerDue,
        AttemptSubmitted,
        SubmitFailed,
        StatusObserved,
        ResultArrived,
        CancelAcknowledged,
        CancelConfirmed,
        CancelFailed,
        StopRequested,
    )
}


def event_from_dict(data: dict[str, Any]) -> Event:
    """Rebuild an event from :meth:`Event.to_dict` output (e.g. a Celery message body)."""
    data = dict(data)
    kind = data.pop("kind", None)
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise ValueError(f"unknown race event kind {kind!r}")
    if data.get("state") is not None and "state" in _field_names(cls):
        data["state"] = JobState(data["state"])
    if cls is CancelAcknowledged and data.get("receipt") is not None:
        data["receipt"] = CancelReceipt.from_dict(data["receipt"])
    if cls is ResultArrived:
        data["reasons"] = tuple(data.get("reasons") or ())
    names = _field_names(cls)
    return cls(**{k: v for k, v in data.items() if k in names})  # a newer writer's extras


# --------------------------------------------------------------------------- actions (out)


@dataclass(frozen=True)
class Action:
    """Base class: something the race asks its driver to do."""

    kind: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        # What {"kind": ..., **dataclasses.asdict(self)} gave, without asdict's generic walk.
        data: dict[str, Any] = {"kind": self.kind}
        for name in _field_names(type(self)):
            data[name] = copy_data(getattr(self, name))
        return data


@dataclass(frozen=True)
class Launch(Action):
    """Submit a job to ``provider``; report AttemptSubmitted or SubmitFailed for ``attempt_id``."""

    kind: ClassVar[str] = "launch"
    attempt_id: str
    provider: str
    role: str


@dataclass(frozen=True)
class PollStatus(Action):
    """Poll the attempt's status once; report StatusObserved (state or error)."""

    kind: ClassVar[str] = "poll_status"
    attempt_id: str


@dataclass(frozen=True)
class Cancel(Action):
    """Cancel the attempt through the provider; report acknowledgement, confirmation or failure."""

    kind: ClassVar[str] = "cancel"
    attempt_id: str
    reason: str


@dataclass(frozen=True)
class ScheduleTimer(Action):
    """Deliver ``TimerDue(key)`` when the race's clock reads ``at`` or later."""

    kind: ClassVar[str] = "schedule_timer"
    key: str
    at: float


@dataclass(frozen=True)
class DeclareWinner(Action):
    """The attempt returned the first valid result: hand its result to the caller."""

    kind: ClassVar[str] = "declare_winner"
    attempt_id: str


@dataclass(frozen=True)
class GiveUp(Action):
    """The race's deadline passed (or it was stopped) without a winner: fail the caller now
    (jobs are cancelled)."""

    kind: ClassVar[str] = "give_up"
    note: str


@dataclass(frozen=True)
class RaceFinished(Action):
    """Nothing is left to do; ``winner`` is None when no attempt returned a valid result."""

    kind: ClassVar[str] = "race_finished"
    winner: str | None
    note: str = ""


ACTION_TYPES: dict[str, type[Action]] = {
    cls.kind: cls
    for cls in (Launch, PollStatus, Cancel, ScheduleTimer, DeclareWinner, GiveUp, RaceFinished)
}


def action_from_dict(data: dict[str, Any]) -> Action:
    """Rebuild an action from :meth:`Action.to_dict` output."""
    data = dict(data)
    cls = ACTION_TYPES.get(data.pop("kind", None))
    if cls is None:
        raise ValueError("unknown race action kind")
    return cls(**data)


__all__ = [
    "Action",
    "AttemptSubmitted",
    "Cancel",
    "CancelAcknowledged",
    "CancelConfirmed",
    "CancelFailed",
    "DeclareWinner",
    "Event",
    "GiveUp",
    "Launch",
    "PollStatus",
    "RaceFinished",
    "ResultArrived",
    "ScheduleTimer",
    "Start",
    "StatusObserved",
    "StopRequested",
    "SubmitFailed",
    "TimerDue",
    "action_from_dict",
    "event_from_dict",
]
