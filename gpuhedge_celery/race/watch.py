"""Watch work of the race driver: poll a job once, report what changed, arm the next poll.

Mixed into :class:`~gpuhedge_celery.race.driver.RaceDriver` (through
:class:`~gpuhedge_celery.race.attempts.AttemptWork`). Each poll is a durable timer; the next
one rides in the round trip of the step (or the heartbeat) that reports this one, and a
terminal job is concluded (:mod:`.conclude`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.attempts import Phase
from ..core.jobs import JobHandle
from ..core.race import Race
from ..core.race_events import AttemptSubmitted, Event, StatusObserved
from ..errors import RateLimited
from ..providers.base import Provider
from ..store.timers import HEAD, IF_IDLE
from .backstops import BackstopDrop
from .base import due_ms, find_attempt
from .conclude import ResultWork

if TYPE_CHECKING:
    from ..core.clock import Clock
    from ..store.timers import TimerStore
    from ..webhooks.settings import WebhookSettings

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
class NextPoll:
    """The next watch poll of one job, decided by the poll just made; armed by :meth:`queue`
    in the round trip of the step (or heartbeat) that reports this one."""

    race_id: str
    attempt_id: str
    provider: str
    handle: dict[str, Any]
    label: str | None  # the state this poll saw, as the next one compares it
    cap_s: float
    at: float  # when (epoch s), before a decision moves it earlier
    deadline: float  # the job's cap: it is concluded then at the latest
    now: float
    near: bool  # the provider asks to be polled just before each of the race's decisions
    deferred: bool = False  # no poll was made (rate limit): it keeps its reserved time
    slot: float | None = None

    def queue(self, work: WatchWork, pipe: Any, decisions: Iterable[float]) -> None:
        """Queue the arm on ``pipe``; ``decisions``: the race's timers as it will be saved."""
        ahead = sorted(d for d in decisions if d > self.now) if self.near else []
        when = self.at
        if ahead and not self.deferred:  # a deferred poll keeps its reserved slot's time
            when = _before_decision(self.at, ahead, self.now)
        arm = work._watch_arm(
            self.race_id,
            self.attempt_id,
            self.provider,
            self.handle,
            self.label,
            self.cap_s,
            min(when, self.deadline),
            ahead or None,
            self.slot,
        )
        arm(pipe)


class WatchWork(ResultWork):
    """Per-job watch polls; needs the attributes and ``step`` of the driver."""

    timers: TimerStore
    providers: Callable[[str], Provider]
    webhooks: WebhookSettings
    clock: Clock

    def _reported(
        self,
        race_id: str,
        attempt_id: str,
        saved: Race | None,
        handle: JobHandle,
        provider: Provider,
    ) -> bool:
        raise NotImplementedError

    def _pushed(self, provider: Provider) -> bool:
        """Whether ``provider``'s jobs report their end by webhook (then polled as a net)."""
        return self.webhooks.on and bool(getattr(provider, "takes_webhooks", False))

    def _poll(self, race: Race, attempt_id: str) -> Event:
        a = find_attempt(race, attempt_id)
        if a is None or not a.handle:
            return StatusObserved(attempt_id, None, "no job handle to poll")
        try:
            return StatusObserved(
                attempt_id, self.providers(a.provider).status(JobHandle.from_dict(a.handle))
            )
        except Exception as e:
            return StatusObserved(attempt_id, None, f"{type(e).__name__}: {e}")

    def watch(
        self,
        race_id: str,
        attempt_id: str,
        provider_name: str,
        handle_data: dict[str, Any],
        last: str | None,
        cap_s: float,
        spec: dict[str, Any] | None = None,
        drop: BackstopDrop | None = None,
        submitted: AttemptSubmitted | None = None,
        decide: list[float] | None = None,
        reserved: float | None = None,
    ) -> None:
        """Poll a job once: report a state change, conclude it when terminal, else re-arm.

        ``spec``: the race's spec when the caller has it at hand (a terminal job's validation
        then needs no read). ``drop``: a launch backstop to drop with the first arm.
        ``submitted``: the job was just submitted and this report is still to be made: it is
        saved in the same step as the job's first status (one save less per attempt).
        ``decide``: the race's decision times (its timers, epoch s: the policy's and the race's
        deadline, where it gives up) as last seen, for a provider that asks to be polled just
        before each (``polls_before_decisions``).
        ``reserved``: the time of the request slot the provider's budget reserved for this
        poll when it deferred it (``RateLimited.reserved``), handed back to be spent; it rides
        in the timer, so whichever process fires it spends it.
        """
        provider = self.providers(provider_name)
        handle = JobHandle.from_dict(handle_data)
        both = getattr(provider, "status_and_next_change", None)
        hint = getattr(provider, "next_change_at", None)
        at: float | None = None
        deferred, slot = False, None
        try:
            if callable(both) and reserved is not None:
                state, at = both(handle, reserved=reserved)
            elif callable(both):  # one provider call instead of two
                state, at = both(handle)
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
        now = self.clock.now()
        deadline = handle.submitted_at + cap_s
        if (state is not None and state.terminal) or now >= deadline:
            if submitted is None or self._reported(
                race_id, attempt_id, self.step(race_id, submitted), handle, provider
            ):
                self.conclude(race_id, attempt_id, provider, handle, cap_s, spec)
            if drop is not None:
                drop.now()
            return
        label = state.value if state is not None else "poll_error"
        if deferred and submitted is None:
            label = last  # unchanged: the heartbeat and the next arm only
        if at is None and callable(hint) and not callable(both) and state is not None:
            try:
                at = hint(handle)
            except Exception:
                at = None
        nxt = NextPoll(
            race_id,
            attempt_id,
            provider_name,
            handle_data,
            label,
            cap_s,
            self._poll_at(provider, at, now, deferred),
            deadline,
            now,
            bool(getattr(provider, "polls_before_decisions", False)),
            deferred,
            slot,
        )
        stepped: list[Race] = []  # the race this step saves (its timers: the decisions ahead)

        def arm(pipe: Any) -> None:
            # The next poll rides in the same round trip as the step (or the heartbeat) below.
            nxt.queue(self, pipe, stepped[-1].timers.values() if stepped else (decide or ()))
            if drop is not None:
                drop.queue(pipe)

        armed: list[bool] = []

        def before(pipe: Any) -> None:
            armed.append(True)
            arm(pipe)

        if label != last:
            observed = StatusObserved(attempt_id, state, error)

            def source(race: Race) -> Event | tuple[Event, ...]:
                # The step applies the events to this very race before its save calls
                # ``before``: the arm then sees the policy's timers as they will be saved.
                stepped.append(race)
                # A job not yet reported (just submitted; or its submitter died after arming
                # this poll, in a save that then lost its version check) is reported first.
                a = find_attempt(race, attempt_id)
                if a is not None and a.phase is Phase.LAUNCHING:
                    return (AttemptSubmitted(attempt_id, handle.job_id, handle_data), observed)
                return observed

            saved = self.step(race_id, source, None, before)
            if submitted is not None and not self._reported(
                race_id, attempt_id, saved, handle, provider
            ):
                if drop is not None:
                    drop.now()
                return
            if saved is None or armed:
                return
            a = find_attempt(saved, attempt_id)
            if saved.finished and (a is None or not a.live):
                return
        # A quiet race is alive: its heartbeat keeps it off the janitor's list.
        self.store.touch(
            race_id, also=arm, scripts=(self.timers.arm_script, self.timers.cancel_script)
        )

    def _poll_at(
        self, provider: Provider, at: float | None, now: float, deferred: bool = False
    ) -> float:
        """When to poll a job next: at the provider's hint ``at`` or after the watch interval,
        a webhook provider only as a slow net, and never sooner than a minimal gap."""
        if at is None:
            at = now + self.settings.watch_interval_s
        if self._pushed(provider) and not deferred:
            # The webhook reports the end: poll only before decisions (see NextPoll) and as a
            # slow safety net, should a delivery be lost.
            at = max(at, now + self.webhooks.fallback_s)
        return max(at, now + MIN_WATCH_GAP_S)  # a hint at "now" must not spin the timer thread

    def arm_watch_if_idle(self, *args: Any) -> None:
        """Arm a poll of one job unless its chain of watch polls is alive (a poll waiting or
        in flight): a recovery cannot know whether the crash it recovers from broke the chain,
        and a second chain would poll the job twice as often until it ends. Arguments of
        :meth:`_watch_timer`: race, attempt, provider, handle, last label, cap, when."""
        key, due, payload, timer_id = self._watch_timer(*args)
        self.timers.arm(key, due, payload, timer_id=timer_id, chain=IF_IDLE)

    def _watch_arm(self, *args: Any) -> Callable[[Any], None]:
        """Queue the arm of a job's next watch poll on a pipeline, as the newest of the job's
        chain of polls (its id makes a repeat harmless)."""
        key, due, payload, timer_id = self._watch_timer(*args)

        def arm(pipe: Any) -> None:
            self.timers.queue_arm(pipe, key, due, payload, timer_id, chain=HEAD)

        return arm

    def _watch_timer(
        self,
        race_id: str,
        attempt_id: str,
        provider_name: str,
        handle_data: dict[str, Any],
        last: str | None,
        cap_s: float,
        at: float,
        decide: list[float] | None = None,
        reserved: float | None = None,
    ) -> tuple[str, int, dict[str, Any], str]:
        """Key, due ms, payload and id of the watch timer of one job's next poll.

        The id names the due millisecond, so arming the same poll twice (a step that retried
        after a version conflict) arms it once.
        """
        payload: dict[str, Any] = {
            "race": race_id,
            "kind": "watch",
            "attempt": attempt_id,
            "provider": provider_name,
            "handle": handle_data,
            "last": last,
            "cap_s": cap_s,
        }
        if decide:
            payload["decide"] = decide
        if reserved is not None:
            payload["reserved"] = reserved
        key, due = f"{race_id}:w:{attempt_id}", due_ms(at)
        return key, due, payload, f"{key}|{due}"
