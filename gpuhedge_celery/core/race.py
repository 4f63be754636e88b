"""The race engine: THE state machine behind live Celery races, the simulator and the replay.

Events in, actions out. A driver calls :meth:`Race.handle` with an
:mod:`~gpuhedge_celery.core.race_events` event, performs the actions it returns, and reports what
happened as further events. The engine never sleeps and reads time only from its injected clock,
so the same code runs on a :class:`~gpuhedge_celery.core.clock.VirtualClock` in a replay and on a
:class:`~gpuhedge_celery.core.clock.WallClock` in a coordinator that may crash and be resumed by
another process (:meth:`Race.to_dict` / :meth:`Race.from_dict`).

Rules enforced here for every policy:

* the first *valid* result wins; invalid or failed results never end the race;
* at most ``max_live`` (2) live jobs; a job is live from its launch until its result is in or its
  cancellation is confirmed terminal (a leaked job stays live: it may still be burning a GPU);
  a launch asked for at capacity waits and is retried whenever a job ends;
* every loser is cancelled and every non-winning attempt ends with a receipt;
* a job whose cancel is not yet confirmed stays in the race and may still win (then the other
  job is cancelled); a cancel that fails leaks a receipt and never loses a won race;
* a result nothing verified with the provider (a Cerebrium webhook) for a job we were
  cancelling, which does not win, ends the attempt for the race's decisions but proves no end,
  whether the race is running or finished (:func:`unverified_end`): its receipt stays a leak,
  its job stays registered for the janitor (:func:`may_run`), and its price never falls below
  what its cancel alone would leave (``core/outcome.py``);
* with a ``deadline_s``, a race still without a winner that long after its start gives up: the
  caller is failed at once (:class:`GiveUp`), every live job is cancelled, and no result can win
  any more (the race finishes, without a winner, once its attempts are settled).
* a stop (``StopRequested``) gives up the same way at once, and records who stopped the race
  and when; a stop of a race already won, given up or stopped changes nothing.
* an attempt the budget refused (``SubmitFailed(refused=True)``) was never submitted: a refused
  primary stops the race from launching anything more, a refused hedge or fallback leaves the
  other attempts racing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .attempts import LIVE_PHASES, UNSETTLED_PHASES, Attempt, Phase
from .clock import Clock
from .jobs import JobState
from .policies import FALLBACK, PRIMARY, Policy, policy_from_dict
from .race_cancels import CancelRules, ended_on_its_own
from .race_events import (
    Action,
    AttemptSubmitted,
    CancelAcknowledged,
    CancelConfirmed,
    CancelFailed,
    DeclareWinner,
    Event,
    GiveUp,
    Launch,
    PollStatus,
    RaceFinished,
    ResultArrived,
    ScheduleTimer,
    Start,
    StatusObserved,
    StopRequested,
    SubmitFailed,
    TimerDue,
)
from .receipts import CancelReceipt

MAX_LIVE_JOBS = 2
DEADLINE_TIMER = "race_deadline"  # the engine's own timer key (policies use other keys)
BUDGET_REFUSED = "budget_refused"  # flag: the budget refused an attempt (see SubmitFailed)
BUDGET_STOP = "budget_stop"  # flag: it refused the primary; the race launches nothing more
#: The reason an attempt carries when a result nothing verified ended it while its cancel was
#: unconfirmed (see :func:`unverified_end`).
UNVERIFIED_END = "ended by a delivery nothing verified: not shown stopped"


class Race(CancelRules):
    """One request's race, driven by events; also the :class:`RaceControl` its policy sees."""

    def __init__(
        self,
        policy: Policy,
        clock: Clock,
        *,
        race_id: str = "",
        max_live: int = MAX_LIVE_JOBS,
        deadline_s: float | None = None,
    ):
        if max_live < 1:
            raise ValueError("max_live must be at least 1")
        if deadline_s is not None and not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s!r}")
        self.policy = policy
        self.deadline_s = deadline_s
        self.gave_up = False  # the deadline passed without a winner: nothing can win now
        self.stopped_by: str | None = None  # who stopped the race (then gave_up is set too)
        self.stopped_at: float | None = None  # clock reading when it was stopped
        self.clock = clock
        self.race_id = race_id
        self.max_live = max_live
        self.started_at: float | None = None  # clock reading at Start
        self.attempts: list[Attempt] = []
        self.timers: dict[str, float] = {}  # key -> clock reading when due
        self.waiting: list[list[str]] = []  # [provider, role] launches held back at capacity
        self.state: dict[str, Any] = {}  # the policy's own per-race state
        self.flags: list[str] = []
        self.winner: str | None = None
        self.finished = False
        self.note = ""
        self._out: list[Action] = []
        self._now = 0.0

    # ------------------------------------------------------------------ driver interface
    def start(self) -> list[Action]:
        """Shorthand for ``handle(Start())``."""
        return self.handle(Start())

    def handle(self, event: Event) -> list[Action]:
        """Apply one event at the clock's current reading; return the actions to perform."""
        if self.finished:
            if late_result(self, event):
                self._late_result(event)  # type: ignore[arg-type]
            return []
        self._now = self.clock.now()
        self._out = []
        if isinstance(event, Start):
            self._on_start()
        elif self.started_at is None:
            raise ValueError(f"race {self.race_id!r} got {event.kind} before start")
        elif isinstance(event, TimerDue):
            self._on_timer(event)
        elif isinstance(event, StopRequested):
            self._on_stop(event)
        else:
            attempt = self._attempt(getattr(event, "attempt_id", ""))
            if attempt is None:
                raise ValueError(f"race {self.race_id!r} has no attempt {event.attempt_id!r}")  # type: ignore[attr-defined]
            handler = _HANDLERS[type(event)]
            handler(self, attempt, event)
        self._settle()
        out, self._out = self._out, []
        return out

    @property
    def has_winner(self) -> bool:
        return self.winner is not None

    @property
    def live_count(self) -> int:
        return sum(1 for a in self.attempts if a.phase in LIVE_PHASES)

    @property
    def winner_attempt(self) -> Attempt | None:
        return self._attempt(self.winner) if self.winner else None

    @property
    def t0(self) -> float:
        """Seconds from Start to the primary's submit: the origin of every policy time."""
        primary = self.attempt_for(PRIMARY)
        if primary is not None and primary.submitted_at is not None:
            return primary.submitted_at
        return 0.0

    def latency(self) -> float | None:
        """End-to-end seconds from the primary's submit to the winning result, or None."""
        won = self.winner_attempt
        return None if won is None or won.result_at is None else won.result_at - self.t0

    # ------------------------------------------------------------------ RaceControl
    def elapsed(self) -> float:
        return self._rel() - self.t0

    def attempt_for(self, role: str) -> Attempt | None:
        return next((a for a in self.attempts if a.role == role), None)

    def launch(self, provider: str, role: str) -> str | None:
        if self.winner is not None or self.finished or self.gave_up or BUDGET_STOP in self.flags:
            return None
        if self.live_count >= self.max_live:
            self.waiting.append([provider, role])
            self.flag("escalation_waited" if role == FALLBACK else f"{role}_waited")
            return None
        attempt = Attempt(
            id=f"a{len(self.attempts) + 1}", provider=provider, role=role, launched_at=self._rel()
        )
        attempt.timeline.append([attempt.launched_at, "launched"])
        self.attempts.append(attempt)
        self._out.append(Launch(attempt.id, provider, role))
        return attempt.id

    def poll(self, attempt_id: str) -> None:
        attempt = self._attempt(attempt_id)
        if attempt is not None and attempt.live and attempt.phase is not Phase.LAUNCHING:
            self._out.append(PollStatus(attempt_id))

    def cancel(self, attempt_id: str, reason: str) -> None:
        attempt = self._attempt(attempt_id)
        if attempt is not None:
            self._send_cancel(attempt, reason)

    def set_timer(self, key: str, after_s: float) -> None:
        at = (self.started_at or 0.0) + self.t0 + after_s
        self.timers[key] = at
        self._out.append(ScheduleTimer(key, at))

    def clear_timer(self, key: str) -> None:
        self.timers.pop(key, None)

    def flag(self, name: str) -> None:
        if name not in self.flags:
            self.flags.append(name)

    # ------------------------------------------------------------------ event handlers
    def _on_start(self) -> None:
        if self.started_at is not None:
            return  # a duplicated Start
        self.started_at = self._now
        if self.deadline_s is not None:
            at = self._now + self.deadline_s
            self.timers[DEADLINE_TIMER] = at
            self._out.append(ScheduleTimer(DEADLINE_TIMER, at))
        self.policy.on_start(self)

    def _on_timer(self, event: TimerDue) -> None:
        at = self.timers.get(event.key)
        if at is None:
            return  # cleared, already fired, or duplicated
        if self._now < at - 1e-9:  # delivered early: ask again rather than act early
            self._out.append(ScheduleTimer(event.key, at))
            return
        del self.timers[event.key]
        if event.key == DEADLINE_TIMER:
            self._give_up()
        elif self.winner is None and not self.gave_up:
            self.policy.on_timer(self, event.key)

    def _on_stop(self, event: StopRequested) -> None:
        if self.winner is not None or self.gave_up:
            return  # won, past its deadline or stopped already: nothing left to stop
        self.stopped_by = event.by or "unknown"
        self.stopped_at = self._now
        self._give_up(f"stopped by {self.stopped_by}", "stopped", "stopped")

    def _on_submitted(self, a: Attempt, event: AttemptSubmitted) -> None:
        if a.phase is not Phase.LAUNCHING:
            return
        a.phase = Phase.RUNNING
        a.submitted_at = self._rel()
        a.job_id = event.job_id
        a.handle = dict(event.handle) if event.handle else None
        a.timeline.append([a.submitted_at, "submitted"])
        if a.cancel_requested:
            self._send_cancel(a, a.cancel_reason or "lost")
        elif self.winner is None:
            self.policy.on_submitted(self, a)

    def _on_submit_failed(self, a: Attempt, event: SubmitFailed) -> None:
        if a.phase is not Phase.LAUNCHING:
            return
        unsent = event.refused or event.unsent
        label = "submit_failed"
        if unsent:
            label = "refused by the budget" if event.refused else "not sent"
        self._end(a, JobState.FAILED, False, [event.error or "submit failed"], label)
        if unsent:  # no job ever existed: no job state, no cost, not a hedge
            a.unsent = True
            a.result_state = a.last_state = None
        if event.refused:
            self.flag(BUDGET_REFUSED)
            if a.role == PRIMARY:  # the race fails: nothing more is launched
                self.flag(BUDGET_STOP)
                self.note = event.error
                return
        if event.outcome_unknown:
            # A job may run at the provider under an id we never learnt: nothing can stop it
            # or show it stopped. It holds no live slot, but its receipt is a leak, flagged.
            a.receipt = CancelReceipt(provider=a.provider, job_id="", note=event.error)
            a.timeline.append([self._rel(), "leaked (submit outcome unknown)"])
            self.flag("leaked")
        if self.winner is None:
            self.policy.on_failed(self, a)

    def _on_status(self, a: Attempt, event: StatusObserved) -> None:
        if not a.live:
            return
        label = str(event.state) if event.state is not None else "poll_error"
        a.timeline.append([self._rel(), label])
        if event.state is not None:
            a.last_state = event.state.value
            if event.state.terminal and a.phase in (Phase.CANCELLING, Phase.LEAKED):
                self._confirm_cancel(a, event.state)
                return
        if self.winner is None:
            self.policy.on_status(self, a, event.state, event.error)

    def _on_result(self, a: Attempt, event: ResultArrived) -> None:
        if not a.live:
            return  # a duplicate, or a result after its cancellation was confirmed
        # A result is terminal by definition; a driver reporting a non-terminal state failed.
        state = event.state if event.state.terminal else JobState.FAILED
        good = bool(event.valid) and state is JobState.COMPLETED
        label = "valid" if good else "invalid"
        self._end(a, state, good, list(event.reasons), f"{state} ({label})")
        wins = good and self.winner is None and not self.gave_up  # past a deadline: cannot
        if a.receipt is not None and (event.verified or wins):
            self._cancel_outrun(
                a, state, event.verified, "result arrived before the cancel took effect"
            )
        elif a.receipt is not None:  # a loser's delivery nothing checked: as after the finish
            self._unverified_end(a, "a result was delivered before its cancel was confirmed")
        if self.gave_up:
            return  # the caller was failed at the deadline: a late result cannot win
        if wins:
            self._declare(a)
        elif not good and self.winner is None:
            self.policy.on_failed(self, a)

    def _late_result(self, event: ResultArrived) -> None:
        """A loser's result after the race finished: the job ran on past its cancel. It ends
        the attempt (priced to the result, its reservation settles) and changes no winner."""
        a = self._attempt(event.attempt_id)
        assert a is not None and a.receipt is not None
        self._now = self.clock.now()
        state = event.state if event.state.terminal else JobState.FAILED
        reasons = [*event.reasons, "late: the race had finished"]
        self._end(a, state, False, reasons, f"{state} (late result)")
        if event.verified:
            self._cancel_outrun(a, state, True, "ran to its end after the race finished")
        else:
            self._unverified_end(a, "a result was delivered after the race finished")

    def _unverified_end(self, a: Attempt, why: str) -> None:
        """A delivery nothing checked ended a loser we were cancelling: it prices the job and
        ends the attempt, and proves no end. The receipt keeps its evidence and its leak; the
        attempt's reasons say why (:func:`unverified_end`)."""
        r = a.receipt
        assert r is not None
        a.reasons.append(UNVERIFIED_END)
        r.note = (r.note + "; " if r.note else "") + f"{why} (not verified with the provider)"
        self.flag("leaked")

    def _cancel_outrun(self, a: Attempt, state: JobState, verified: bool, why: str) -> None:
        """A result ended a job we were cancelling: only a verified one confirms it stopped; an
        unverified one that wins ends it (its job delivered the result the caller gets)."""
        r = a.receipt
        assert r is not None
        if verified:
            r.confirm_terminal(state, self._ms())
        else:
            r.terminal_status, r.terminal_ms, r.leaked = state, self._ms(), False
            why += " (a delivery the provider cannot confirm)"
        r.note = (r.note + "; " if r.note else "") + why

    # ------------------------------------------------------------------ internals
    def _rel(self) -> float:
        return self._now - (self.started_at or 0.0)

    def _ms(self) -> float:
        return self._now * 1000.0

    def _attempt(self, attempt_id: str | None) -> Attempt | None:
        return next((a for a in self.attempts if a.id == attempt_id), None)

    def _end(
        self, a: Attempt, state: JobState, valid: bool, reasons: list[str], label: str
    ) -> None:
        a.phase = Phase.ENDED
        a.result_state = state.value
        a.last_state = state.value
        a.valid = valid
        a.reasons = reasons
        a.result_at = self._rel()
        a.timeline.append([a.result_at, label])

    def _give_up(
        self, note: str | None = None, flag: str = "deadline_passed", reason: str = "deadline"
    ) -> None:
        """The deadline passed (or a stop came) without a winner: fail the caller now, stop
        every job with ``reason``."""
        if self.winner is not None or self.gave_up:
            return
        self.gave_up = True
        self.flag(flag)
        self.timers.clear()
        self.waiting.clear()
        if note is None:
            note = f"no valid result within the race's deadline ({self.deadline_s:g} s)"
        self.note = note
        self._out.append(GiveUp(note))
        for a in self.attempts:
            if a.phase in (Phase.LAUNCHING, Phase.RUNNING):
                self._send_cancel(a, reason)

    def _declare(self, a: Attempt) -> None:
        self.winner = a.id
        self.timers.clear()
        self.waiting.clear()
        self._out.append(DeclareWinner(a.id))
        for other in self.attempts:
            if other is not a and other.phase in (Phase.LAUNCHING, Phase.RUNNING):
                self._send_cancel(other, "lost")

    def _settle(self) -> None:
        """After every event: retry held launches, give an idle policy its turn, finish."""
        while self.winner is None and self.waiting and self.live_count < self.max_live:
            provider, role = self.waiting.pop(0)
            self.launch(provider, role)
        if self.gave_up:
            if not any(a.phase in UNSETTLED_PHASES for a in self.attempts):
                self._finish(None, self.note)
        elif self.winner is None and self.started_at is not None and self.live_count == 0:
            self.policy.on_idle(self)
            if self.live_count == 0:
                stopped = BUDGET_STOP in self.flags and self.note
                self._finish(None, self.note if stopped else "no attempt returned a valid result")
        elif self.winner is not None:
            if not any(a.phase in UNSETTLED_PHASES for a in self.attempts):
                self._finish(self.winner, "")

    def _finish(self, winner: str | None, note: str) -> None:
        self.finished = True
        self.note = note
        self.timers.clear()
        for a in self.attempts:
            if a.id != winner and a.receipt is None:
                a.receipt = ended_on_its_own(a, self._ms())
                if a.receipt.leaked:  # a job we may have started but can never cancel
                    self.flag("leaked")
        self._out.append(RaceFinished(winner, note))

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, Any]:
        """Everything needed to resume the race in another process (JSON-safe)."""
        data = {
            "race_id": self.race_id,
            "policy": self.policy.to_dict(),
            "max_live": self.max_live,
            "started_at": self.started_at,
            "attempts": [a.to_dict() for a in self.attempts],
            "timers": dict(self.timers),
            "waiting": [list(w) for w in self.waiting],
            "state": dict(self.state),
            "flags": list(self.flags),
            "winner": self.winner,
            "finished": self.finished,
            "note": self.note,
        }
        if self.deadline_s is not None:  # only races with a deadline carry its fields
            data["deadline_s"] = self.deadline_s
            data["gave_up"] = self.gave_up
        if self.stopped_by is not None:  # only stopped races carry who stopped them
            data["gave_up"] = self.gave_up
            data["stopped_by"] = self.stopped_by
            data["stopped_at"] = self.stopped_at
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], clock: Clock) -> Race:
        """Resume a race saved by :meth:`to_dict`, reading time from ``clock`` from now on."""
        race = cls(
            policy_from_dict(data["policy"]),
            clock,
            race_id=data.get("race_id", ""),
            max_live=int(data.get("max_live", MAX_LIVE_JOBS)),
            deadline_s=data.get("deadline_s"),
        )
        race.gave_up = bool(data.get("gave_up"))
        race.stopped_by = data.get("stopped_by")
        race.stopped_at = data.get("stopped_at")
        race.started_at = data.get("started_at")
        race.attempts = [Attempt.from_dict(a) for a in data.get("attempts", [])]
        race.timers = {k: float(v) for k, v in (data.get("timers") or {}).items()}
        race.waiting = [list(w) for w in data.get("waiting", [])]
        race.state = dict(data.get("state") or {})
        race.flags = list(data.get("flags") or [])
        race.winner = data.get("winner")
        race.finished = bool(data.get("finished"))
        race.note = data.get("note", "")
        return race


def late_result(race: Race, event: Any) -> bool:
    """Whether finished ``race`` takes ``event`` as a late result: the result of a loser never
    shown stopped (its job ran on past the cancel)."""
    if not race.finished or not isinstance(event, ResultArrived):
        return False
    if event.state is JobState.TIMEOUT:
        return False  # a cap passing is no sign the job ended
    a = race._attempt(event.attempt_id)
    return a is not None and a.phase is Phase.LEAKED and a.receipt is not None


def unverified_end(a: Attempt) -> bool:
    """Whether a result nothing verified with the provider ended ``a`` while we were cancelling
    it and its cancel was unconfirmed (a forged webhook looks the same as a real one): the
    attempt is over for the race, its job is not shown stopped."""
    return a.phase is Phase.ENDED and UNVERIFIED_END in a.reasons


def may_run(a: Attempt) -> bool:
    """Whether ``a``'s job may still run (and bill) at its provider, so it stays registered for
    the janitor: live; ended at its cap (the cap is ours, not the provider's); or ended by a
    delivery nothing verified and not shown stopped since."""
    if a.live or a.result_state == JobState.TIMEOUT.value:
        return True
    return unverified_end(a) and a.receipt is not None and not a.receipt.confirmed_terminal


# the event handlers that take an attempt, by event type
_HANDLERS: dict[type[Event], Callable[[Race, Attempt, Any], None]] = {
    AttemptSubmitted: Race._on_submitted,
    SubmitFailed: Race._on_submit_failed,
    StatusObserved: Race._on_status,
    ResultArrived: Race._on_result,
    CancelAcknowledged: Race._on_cancel_ack,
    CancelConfirmed: Race._on_cancel_confirmed,
    CancelFailed: Race._on_cancel_failed,
}
