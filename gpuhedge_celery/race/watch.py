"""The race driver's :class:`Watcher`: poll a job once, report what changed, arm the next poll.

Each poll is a durable timer; the next one rides in the round trip of the step (or the
heartbeat) that reports this one, and a terminal job is concluded (:mod:`.conclude`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.attempts import Phase
from ..core.jobs import JobHandle
from ..core.race import Race
from ..core.race_events import AttemptSubmitted, Event, StatusObserved
from ..errors import RateLimited
from ..providers.base import HintsNextChange, PollsWithHint, Provider, TakesWebhooks
from ..store.round_trip import RoundTrip
from ..store.timers import HEAD, IF_IDLE
from .backstops import BackstopDrop
from .base import JobRef, due_ms, find_attempt

if TYPE_CHECKING:
    from ..store.timers import TimerStore
    from .base import Driver

MIN_WATCH_GAP_S = 0.002
DECISION_LEAD_S = 0.25  # a poll this long before a race decision, for providers that ask


def _before_decision(at: float, ahead: list[float], now: float) -> float:
    """``at``, or earlier: just before the first decision ahead that ``at`` would sleep past
    (a decision closer than the lead already has the poll just made)."""
    for decision in ahead:
        poll = decision - DECISION_LEAD_S
        if poll > now + MIN_WATCH_GAP_S:
            return min(at, poll)
    return at


@dataclass(frozen=True)
class FirstWatch:
    """What the submit that calls :meth:`Watcher.watch` hands over: the race's spec (a
    terminal job's validation then needs no read), its launch backstop (dropped with the first
    arm), and its report, still to be made (saved in the same step as the job's first status:
    one save less per attempt)."""

    spec: dict[str, Any]
    drop: BackstopDrop
    submitted: AttemptSubmitted


@dataclass(frozen=True)
class NextPoll:
    """The next watch poll of one job, decided by the poll just made; armed by :meth:`queue`
    in the round trip of the step (or heartbeat) that reports this one."""

    ref: JobRef
    label: str | None  # the state this poll saw, as the next one compares it
    at: float  # when (epoch s), before a decision moves it earlier
    now: float
    near: bool  # the provider asks to be polled just before each of the race's decisions
    deferred: bool = False  # no poll was made (rate limit): it keeps its reserved time
    slot: float | None = None

    @property
    def deadline(self) -> float:
        """The job's cap: it is concluded then at the latest."""
        return self.ref.job.submitted_at + self.ref.cap_s

    def queue(self, timers: TimerStore, pipe: Any, decisions: Iterable[float]) -> None:
        """Queue the arm on ``pipe``; ``decisions``: the race's timers as it will be saved."""
        ahead = sorted(d for d in decisions if d > self.now) if self.near else []
        when = self.at
        if ahead and not self.deferred:  # a deferred poll keeps its reserved slot's time
            when = _before_decision(self.at, ahead, self.now)
        at = min(when, self.deadline)
        key, due, payload, timer_id = watch_timer(
            self.ref, self.label, at, ahead or None, self.slot
        )
        timers.queue_arm(pipe, key, due, payload, timer_id, chain=HEAD)


def watch_timer(
    ref: JobRef,
    last: str | None,
    at: float,
    decide: list[float] | None = None,
    reserved: float | None = None,
) -> tuple[str, int, dict[str, Any], str]:
    """Key, due ms, payload and id of the watch timer of one job's next poll.

    The id names the due millisecond, so arming the same poll twice (a step that retried
    after a version conflict) arms it once.
    """
    payload: dict[str, Any] = {
        "race": ref.race_id,
        "kind": "watch",
        "attempt": ref.attempt_id,
        "provider": ref.provider,
        "handle": ref.handle,
        "last": last,
        "cap_s": ref.cap_s,
    }
    if decide:
        payload["decide"] = decide
    if reserved is not None:
        payload["reserved"] = reserved
    key, due = f"{ref.race_id}:w:{ref.attempt_id}", due_ms(at)
    return key, due, payload, f"{key}|{due}"


class Watcher:
    """Per-job watch polls."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    def pushed(self, provider: Provider) -> bool:
        """Whether ``provider``'s jobs report their end by webhook (then polled as a net)."""
        return self.driver.webhooks.on and isinstance(provider, TakesWebhooks)

    def poll(self, race: Race, attempt_id: str) -> Event:
        """One status poll of an attempt's job, as the event that reports it."""
        a = find_attempt(race, attempt_id)
        if a is None or not a.handle:
            return StatusObserved(attempt_id, None, "no job handle to poll")
        try:
            status = self.driver.providers(a.provider).status(JobHandle.from_dict(a.handle))
            return StatusObserved(attempt_id, status)
        except Exception as e:
            return StatusObserved(attempt_id, None, f"{type(e).__name__}: {e}")

    def watch(
        self,
        ref: JobRef,
        last: str | None = None,
        decide: list[float] | None = None,
        reserved: float | None = None,
        first: FirstWatch | None = None,
    ) -> None:
        """Poll a job once: report a state change, conclude it when terminal, else re-arm.

        ``last``: the state the poll before saw. ``decide``: the race's decision times (its
        timers, epoch s: the policy's and the race's deadline, where it gives up) as last seen,
        for a provider that asks to be polled just before each (``polls_before_decisions``).
        ``reserved``: the time of the request slot the provider's budget reserved for this
        poll when it deferred it (``RateLimited.reserved``), handed back to be spent; it rides
        in the timer, so whichever process fires it spends it. ``first``: the submit's
        hand-over (:class:`FirstWatch`), for a job just submitted.
        """
        d = self.driver
        race_id, attempt_id = ref.race_id, ref.attempt_id
        provider = d.providers(ref.provider)
        handle = ref.job
        drop = first.drop if first is not None else None
        submitted = first.submitted if first is not None else None
        at: float | None = None
        deferred, slot = False, None
        try:
            if isinstance(provider, PollsWithHint) and reserved is not None:
                state, at = provider.status_and_next_change(handle, reserved=reserved)
            elif isinstance(provider, PollsWithHint):  # one provider call instead of two
                state, at = provider.status_and_next_change(handle)
            else:
                state = provider.status(handle)
            error = None
        except RateLimited as e:
            # No poll was made (the fleet's request budget for the provider, or its own
            # Retry-After): nothing was observed, so nothing is reported; look again then.
            state, error, at, deferred = None, f"{type(e).__name__}: {e}", e.retry_at, True
            slot = e.retry_at if e.reserved else None
        except Exception as e:
            state, error = None, f"{type(e).__name__}: {e}"
        now = d.clock.now()
        if (state is not None and state.terminal) or now >= handle.submitted_at + ref.cap_s:
            if submitted is None or self.reported(ref, d.step(race_id, submitted), provider):
                d.concluder.conclude(ref, first.spec if first is not None else None)
            if drop is not None:
                drop.now()
            return
        label: str | None = state.value if state is not None else "poll_error"
        if deferred and submitted is None:
            label = last  # unchanged: the heartbeat and the next arm only
        if (
            at is None
            and state is not None
            and isinstance(provider, HintsNextChange)
            and not isinstance(provider, PollsWithHint)
        ):
            try:
                at = provider.next_change_at(handle)
            except Exception:
                at = None
        near = bool(getattr(provider, "polls_before_decisions", False))
        nxt = NextPoll(
            ref, label, self.poll_at(provider, at, now, deferred), now, near, deferred, slot
        )
        stepped: list[Race] = []  # the race this step saves (its timers: the decisions ahead)

        timers = d.timers.of(race_id)  # the race's shard: one slot with its save

        def arm(pipe: Any) -> None:
            # The next poll rides in the same round trip as the step (or the heartbeat) below.
            nxt.queue(timers, pipe, stepped[-1].timers.values() if stepped else (decide or ()))
            if drop is not None:
                drop.queue(pipe)

        armed: list[bool] = []

        def arm_ahead(pipe: Any) -> None:
            armed.append(True)
            arm(pipe)

        scripts = (d.timers.arm_script, d.timers.cancel_script)
        if label != last:
            observed = StatusObserved(attempt_id, state, error)

            def source(race: Race) -> Event | tuple[Event, ...]:
                # The step applies the events to this very race before its save queues the
                # arm: the arm then sees the policy's timers as they will be saved.
                stepped.append(race)
                # A job not yet reported (just submitted; or its submitter died after arming
                # this poll, in a save that then lost its version check) is reported first.
                a = find_attempt(race, attempt_id)
                if a is not None and a.phase is Phase.LAUNCHING:
                    return (AttemptSubmitted(attempt_id, handle.job_id, ref.handle), observed)
                return observed

            trip = RoundTrip()
            trip.ahead(arm_ahead, scripts)
            saved = d.step(race_id, source, None, trip)
            if submitted is not None and not self.reported(ref, saved, provider):
                if drop is not None:
                    drop.now()
                return
            if saved is None or armed:
                return
            a = find_attempt(saved, attempt_id)
            if saved.finished and (a is None or not a.live):
                return
        # A quiet race is alive: its heartbeat keeps it off the janitor's list.
        beat = RoundTrip()
        beat.ride(arm, scripts)
        d.store.touch(race_id, beat)

    def reported(self, ref: JobRef, saved: Race | None, provider: Provider) -> bool:
        """Whether the race took a submit's report; if it had ended the attempt before the
        report (its submit outlived the launch window and was taken for dead), nobody else
        knows this job: it is cancelled now."""
        if saved is None:
            return False
        handle = ref.job
        a = find_attempt(saved, ref.attempt_id)
        if a is not None and a.job_id == handle.job_id:
            return True
        self.driver.canceller.cancel_orphan(ref.race_id, ref.attempt_id, provider, handle)
        return False

    def poll_at(
        self, provider: Provider, at: float | None, now: float, deferred: bool = False
    ) -> float:
        """When to poll a job next: at the provider's hint ``at`` or after the watch interval,
        a webhook provider only as a slow net, and never sooner than a minimal gap."""
        d = self.driver
        if at is None:
            at = now + d.settings.watch_interval_s
        if self.pushed(provider) and not deferred:
            # The webhook reports the end: poll only before decisions (see NextPoll) and as a
            # slow safety net, should a delivery be lost.
            at = max(at, now + d.webhooks.fallback_s)
        return max(at, now + MIN_WATCH_GAP_S)  # a hint at "now" must not spin the timer thread

    def arm_if_idle(self, ref: JobRef, last: str | None, at: float) -> None:
        """Arm a poll of one job unless its chain of watch polls is alive (a poll waiting or
        in flight): a recovery cannot know whether the crash it recovers from broke the chain,
        and a second chain would poll the job twice as often until it ends."""
        key, due, payload, timer_id = watch_timer(ref, last, at)
        self.driver.timers.of(ref.race_id).arm(key, due, payload, timer_id=timer_id, chain=IF_IDLE)
