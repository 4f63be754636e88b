"""Attempt work of the race driver: submit once, watch, cancel natively (and conclude, from
:mod:`.conclude`).

Mixed into :class:`~gpuhedge_celery.race.driver.RaceDriver`; every method reports what it saw
to the race through ``step`` and never decides anything itself (the engine does).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..core.attempts import Attempt, Phase
from ..core.jobs import JobHandle, JobState
from ..core.race import Race
from ..core.race_events import (
    AttemptSubmitted,
    CancelAcknowledged,
    CancelFailed,
    Event,
    StatusObserved,
    SubmitFailed,
)
from ..core.receipts import CancelReceipt, Evidence
from ..errors import ProviderError, RateLimited
from ..metrics import record as metrics
from ..providers.base import Provider
from ..webhooks.token import context as webhook_context
from .base import due_ms, find_attempt, remember
from .conclude import ResultWork

log = logging.getLogger(__name__)

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


def _launching(state: dict[str, Any], attempt_id: str) -> bool:
    """Whether a stored race state has ``attempt_id`` launched and not yet submitted."""
    attempts = state["race"].get("attempts") or []
    return any(a["id"] == attempt_id and a["phase"] == Phase.LAUNCHING.value for a in attempts)


def cancel_backstop_id(race_id: str, attempt_id: str) -> str:
    """The fixed id of an attempt's cancel backstop timer."""
    return f"{race_id}|cancel|{attempt_id}"


def launch_backstop_id(race_id: str, attempt_id: str) -> str:
    """The fixed id of an attempt's launch backstop timer (see ``submit_attempt``)."""
    return f"{race_id}|launch|{attempt_id}"


class _Drop:
    """A backstop timer (a launch's or a cancel's) to drop once its work is reported: in a
    round trip already being made (``queue``), or on its own (``now``). Without an id it does
    nothing."""

    __slots__ = ("timers", "timer_id", "queued")

    def __init__(self, timers: TimerStore, timer_id: str | None):
        self.timers, self.timer_id, self.queued = timers, timer_id, False

    def queue(self, pipe: Any) -> None:
        if self.timer_id is not None:
            self.timers.queue_cancel(pipe, self.timer_id)
            self.queued = True

    def now(self) -> None:
        """Drop it on its own, unless a round trip already carried the drop."""
        if self.timer_id is not None and not self.queued:
            self.timers.cancel(self.timer_id)
            self.queued = True


UNKNOWN_SUBMIT = "submit outcome unknown: its worker died mid-submit; not submitted again"
NO_REQUEST = "not submitted: the race's request is gone (the race expired or finished)"

if TYPE_CHECKING:
    from ..core.clock import Clock
    from ..store.races import RaceStore
    from ..store.timers import TimerStore
    from ..webhooks.settings import WebhookSettings
    from .base import Effects
    from .settings import RaceSettings


class AttemptWork(ResultWork):
    """Per-attempt work; needs the attributes and ``step``/``resume`` of the driver."""

    store: RaceStore
    timers: TimerStore
    budget: Any  # RaceBudget | None (race/budget.py, which imports this module)
    providers: Callable[[str], Provider]
    settings: RaceSettings
    webhooks: WebhookSettings
    clock: Clock
    effects: Effects
    # What this process just decided or stored, for the work that follows it here (bounded):
    # a cancel's attempt as the deciding step saved it, and a valid result that may win.
    _decided: dict[tuple[str, str], tuple[Attempt, dict[str, Any] | None]]
    _fresh_results: dict[tuple[str, str], dict[str, Any]]

    @property
    def prefix(self) -> str:
        return self.store.prefix

    def step(self, race_id: str, event: Any, update: Any = None, before: Any = None) -> Race | None:
        raise NotImplementedError

    def resume(self, race_id: str) -> None:
        raise NotImplementedError

    def submit_attempt(
        self, race_id: str, attempt_id: str, *, new_race: bool = False,
        backstop: str | None = None, takeover: bool = False, decided_here: bool = False,
    ) -> None:  # fmt: skip
        """Submit a launched attempt's job once, register it, report it, start watching it.

        Idempotent: a redelivered submit whose job was registered before a crash reports that
        job instead of submitting another; a submit after the race stopped needing it is skipped.
        Of two processes submitting the same attempt at once, one submits (an atomic claim of
        the submit intent) and the other leaves it to the first.
        ``new_race``: called by the process that just created the race, in the same thread
        (its saved state is current and no job can be registered yet: one read saved).
        ``backstop``: the id of this launch's backstop timer (an inline launch, see
        :meth:`Effects.launch`), dropped in the round trip that arms the job's first watch
        poll, or once the attempt ended: until then a crash of this process leaves the timer
        to finish the launch. ``takeover``: called by that timer. ``decided_here``: this
        process saved the step that launched the attempt just now, so its copy of the race
        serves (no read; a job registered meanwhile is found by the submit claim); a copy
        without the attempt still launching (saved here before a resume asked for the launch)
        is read again from Redis.
        """
        drop = _Drop(self.timers, backstop)
        record = self.store.load(race_id, fresh=True) if new_race or decided_here else None
        jobs: dict[str, dict[str, Any]] = {}
        if record is None or (record.cached and not _launching(record.state, attempt_id)):
            # Not the copy a deciding step just saved (a launch a resume asked for, in a process
            # that last saved the race before this attempt existed): never judge from it.
            record, jobs = self.store.load_with_jobs(race_id)
        if record is None:
            drop.now()
            return
        race = Race.from_dict(record.state["race"], self.clock)
        a = find_attempt(race, attempt_id)
        if a is None:
            drop.now()
            return
        if a.phase is not Phase.LAUNCHING:
            # Already reported: a redelivery, whose first run may have died between its step's
            # save and the actions (timers, watch) that step asked for. Re-perform them.
            self.resume(race_id)
            drop.now()
            return
        known = jobs.get(attempt_id)
        if known is None and (race.finished or race.has_winner or a.cancel_requested):
            self.step(
                race_id, SubmitFailed(attempt_id, "not submitted: the race no longer needs it"),
                None, drop.queue,
            )  # fmt: skip
            drop.now()
            return
        request = None
        if known is None:
            # The intent first: a crash between the provider's reply and the handle's
            # registration must not look like "never submitted" to a redelivery. Its window
            # tells a late-comer whether the submitter may still be at work.
            now = self.clock.now()
            intent = {"submitting": True, "at": now, "until": now + self.settings.launch_backstop_s}
            # The budget's reservation of the attempt's worst case rides in the same round trip.
            budget = self.budget.reservation(race_id, a, record.state) if self.budget else None
            known, request = self.store.claim_submit_with_request(
                race_id, attempt_id, intent, also=budget
            )
            if known is None and budget is not None and not budget.result.granted:
                self._refused(race_id, a, budget.result, drop)
                return
        if known is None:  # the claim is ours: submit
            # (a race created before the request had its own key still carries it inline)
            request = request if request is not None else record.state.get("request")
            if request is None:  # never submit a request we no longer have as something else
                self.step(race_id, SubmitFailed(attempt_id, NO_REQUEST), None, drop.queue)
                drop.now()
                return
            provider = self.providers(a.provider)
            try:
                handle = self._submit(provider, request, race_id, attempt_id)
            except ProviderError as e:
                unknown = bool(getattr(e, "outcome_unknown", False))  # the job may exist
                self.step(race_id, SubmitFailed(attempt_id, str(e), unknown), None, drop.queue)
                drop.now()
                return
            except Exception as e:  # an adapter bug must end the attempt, not hang the race
                error = f"{type(e).__name__}: {e}"
                self.step(race_id, SubmitFailed(attempt_id, error), None, drop.queue)
                drop.now()
                return
            # Registered before it is reported: a crash now leaves the janitor a handle.
            self.store.add_job(race_id, attempt_id, handle.to_dict())
        elif known.get("submitting"):
            until = known.get("until")
            if until is not None and self.clock.now() < float(until):
                # Another process is submitting it now and will report the job; should it die,
                # the launch's backstop (or the janitor) finds the intent past its window.
                if takeover:
                    self._rearm_launch_backstop(race_id, attempt_id, float(until))
                return
            # A submit was in flight when its worker died: the provider may hold a job we have
            # no id for. Never submit blindly again: end the attempt (the policy moves on).
            self.step(race_id, SubmitFailed(attempt_id, UNKNOWN_SUBMIT), None, drop.queue)
            drop.now()
            return
        else:
            handle = JobHandle.from_dict(known)
        # Reported together with the job's first status (one save): see watch.
        cap = float(record.state["spec"]["caps_s"].get(a.provider, 180.0))
        spec = record.state["spec"]
        submitted = AttemptSubmitted(attempt_id, handle.job_id, handle.to_dict())
        self.watch(
            race_id, attempt_id, a.provider, handle.to_dict(), None, cap, spec, drop, submitted
        )

    def _submit(
        self, provider: Provider, request: dict[str, Any], race_id: str, attempt_id: str
    ) -> JobHandle:
        """``provider.submit``, with the attempt's webhook context when webhooks are on and
        the provider takes them (its completion is then pushed to the receiver)."""
        if self._pushed(provider):
            context = webhook_context(self.webhooks, race_id, attempt_id)
            return provider.submit(request, context=context)  # type: ignore[call-arg]
        return provider.submit(request)

    def _pushed(self, provider: Provider) -> bool:
        """Whether ``provider``'s jobs report their end by webhook (then polled as a net)."""
        return self.webhooks.on and bool(getattr(provider, "takes_webhooks", False))

    def _refused(self, race_id: str, a: Attempt, refusal: Any, drop: _Drop) -> None:
        """The budget refused the attempt (``refusal``: the store's Reservation): it is not
        submitted, and ends with the reason."""
        log.warning("race %s: %s not submitted: %s", race_id, a.id, refusal.reason)
        metrics.budget_refused(refusal.cap, a.role)
        self.store.remove_job(race_id, a.id)  # our submit intent: nothing was submitted
        self.step(race_id, SubmitFailed(a.id, refusal.reason, refused=True), None, drop.queue)
        drop.now()

    def _reported(
        self, race_id: str, attempt_id: str, saved: Race | None, handle: JobHandle,
        provider: Provider,
    ) -> bool:  # fmt: skip
        """Whether the race took a submit's report; if it had ended the attempt before the
        report (its submit outlived the launch window and was taken for dead), nobody else
        knows this job: it is cancelled now."""
        if saved is None:
            return False
        a = find_attempt(saved, attempt_id)
        if a is not None and a.job_id == handle.job_id:
            return True
        self._cancel_orphan(race_id, attempt_id, provider, handle)
        return False

    def _rearm_launch_backstop(self, race_id: str, attempt_id: str, until: float) -> None:
        """Look at an attempt's launch again when its submitter's window ends."""
        at = until + MIN_WATCH_GAP_S
        payload = {"race": race_id, "kind": "launch", "attempt": attempt_id}
        timer_id = f"{launch_backstop_id(race_id, attempt_id)}|{due_ms(at)}"
        self.timers.arm(f"{race_id}:l:{attempt_id}", due_ms(at), payload, timer_id=timer_id)

    def _launch_backstop(
        self, race_id: str, attempt_id: str
    ) -> tuple[str, int, dict[str, Any], str]:
        """Key, due time, payload and fixed id of an attempt's launch backstop timer."""
        at = self.clock.now() + self.settings.launch_backstop_s
        payload = {"race": race_id, "kind": "launch", "attempt": attempt_id}
        timer_id = launch_backstop_id(race_id, attempt_id)
        return f"{race_id}:l:{attempt_id}", due_ms(at), payload, timer_id

    def _cancel_orphan(
        self, race_id: str, attempt_id: str, provider: Provider, handle: JobHandle
    ) -> None:
        """Cancel a job whose report came after its attempt ended; unregister it once stopped.

        Registered again when the cancel is not confirmed (the race's finish may have dropped
        it meanwhile, with its ended attempt): the janitor cancels the registered jobs of races
        nobody advances, with receipts.
        """
        log.error(
            "race %s: %s's submit returned job %s after the attempt ended (its launch window "
            "passed); cancelling it", race_id, attempt_id, handle.job_id,
        )  # fmt: skip
        try:
            confirmed = provider.cancel(handle).confirmed_terminal
        except Exception:
            log.exception("race %s: cancel of orphan job %s failed", race_id, handle.job_id)
            confirmed = False
        if confirmed:
            self.store.remove_job(race_id, attempt_id)
        else:
            self.store.add_job(race_id, attempt_id, handle.to_dict())

    def request_cancel(
        self, race_id: str, attempt_id: str, provider: str, saved: Race | None = None,
        caps: dict[str, Any] | None = None, armed: bool = False,
    ) -> None:  # fmt: skip
        """Have an attempt's job cancelled now, durably: a backstop timer, then the effect.

        :meth:`Effects.cancel` runs the cancel at once (in production: on a thread of this
        process, no task hop). The backstop timer hands the cancel to any live worker if this
        process dies before :meth:`cancel_attempt` reports back; it never waits for a broker's
        visibility timeout. Its id is fixed per attempt, so re-arming is a no-op. ``saved`` is
        the race as the step that decided the cancel just saved it (and ``caps`` its spec's
        caps): a cancel run in this process starts from it instead of reading the race again.
        ``armed``: the backstop rode in that step's save already.
        """
        if saved is not None:
            a = find_attempt(saved, attempt_id)
            if a is not None:
                snapshot = (Attempt.from_dict(a.to_dict()), caps)
                remember(self._decided, (race_id, attempt_id), snapshot)
        # The backstop first: a crash right after the save must still get the loser cancelled
        # (its watch keeps the race's heartbeat fresh, so the janitor would not step in).
        if not armed:
            key, due, payload, timer_id = self._backstop(race_id, attempt_id)
            self.timers.arm(key, due, payload, timer_id=timer_id)
        self.effects.cancel(race_id, attempt_id, provider)

    def _backstop(self, race_id: str, attempt_id: str) -> tuple[str, int, dict[str, Any], str]:
        """Key, due time, payload and fixed id of an attempt's cancel backstop timer."""
        at = self.clock.now() + self.settings.cancel_backstop_s
        payload = {"race": race_id, "kind": "cancel", "attempt": attempt_id}
        timer_id = cancel_backstop_id(race_id, attempt_id)
        return f"{race_id}:c:{attempt_id}", due_ms(at), payload, timer_id

    def cancel_attempt(self, race_id: str, attempt_id: str) -> None:
        """Cancel an attempt's job natively and report the receipt (never Celery's revoke).

        Returns once the outcome (confirmed, acknowledged, failed) is saved in the race; the
        attempt's backstop timer is dropped in that save's round trip (or after it), so a crash
        before it leaves the timer to finish the job elsewhere.
        """
        drop = _Drop(self.timers, cancel_backstop_id(race_id, attempt_id))
        self._cancel_attempt(race_id, attempt_id, drop)
        drop.now()  # unless the report's save carried it

    def _cancel_attempt(self, race_id: str, attempt_id: str, drop: _Drop) -> None:
        decided = self._decided.pop((race_id, attempt_id), None)
        if decided is not None and decided[0].phase is Phase.CANCELLING:
            a, caps = decided  # as the deciding step saved it: no read on the way to the call
        else:
            record = self.store.load(race_id)
            if record is None:
                return
            race = Race.from_dict(record.state["race"], self.clock)
            caps = record.state["spec"]["caps_s"]
            found = find_attempt(race, attempt_id)
            if found is None:
                return
            a = found
        if not a.handle:
            return
        if a.phase is Phase.ENDED and a.result_state == JobState.TIMEOUT.value:
            self._cancel_capped(race_id, a)
            return
        if a.phase is not Phase.CANCELLING:
            self.resume(race_id)  # a redelivery after the cancel was reported: see submit
            return
        provider = self.providers(a.provider)
        handle = JobHandle.from_dict(a.handle)
        try:
            receipt = provider.cancel(handle)
        except Exception as e:
            failure = CancelFailed(attempt_id, f"{type(e).__name__}: {e}")
            self.step(race_id, failure, None, drop.queue)
            return
        if receipt.confirmed_terminal and receipt.terminal_status is JobState.COMPLETED:
            # It finished before the cancel took effect: its result may still win the race.
            ack = replace(
                receipt, confirmed_terminal=False, terminal_status=None, terminal_ms=None,
                leaked=True, evidence=Evidence.PROVIDER_ACK,
            )  # fmt: skip
            self.step(race_id, CancelAcknowledged(attempt_id, ack))
            cap = float((caps or {}).get(a.provider, 180.0))
            self.conclude(race_id, attempt_id, provider, handle, cap)
            return
        acknowledged = CancelAcknowledged(attempt_id, receipt)
        if receipt.confirmed_terminal:
            self.step(race_id, acknowledged, None, drop.queue)
        else:  # both in one save
            failed = CancelFailed(attempt_id, "no terminal state within the cancel window")
            self.step(race_id, (acknowledged, failed), None, drop.queue)

    def _cancel_capped(self, race_id: str, a: Attempt) -> None:
        """Cancel a job that passed its cap, and record the receipt beside the race's own.

        The engine ended the attempt as TIMEOUT (it cannot win any more), but a cap is ours,
        not the provider's: without this the job would run on, unseen, until it ends by itself.
        """
        if a.id not in self.store.live_jobs(race_id):
            return  # already stopped and unregistered (a duplicate delivery)
        provider = self.providers(a.provider)
        try:
            receipt = provider.cancel(JobHandle.from_dict(a.handle or {}))
        except Exception as e:
            receipt = CancelReceipt(a.provider, a.job_id, note=f"cancel raised {type(e).__name__}")
        receipt.note = receipt.note or "past its cap: cancelled"
        data = receipt.to_dict()

        def change(state: dict[str, Any]) -> dict[str, Any]:
            results = dict(state.get("results") or {})
            results[a.id] = {**(results.get(a.id) or {}), "cap_cancel": data}
            return {**state, "results": results}

        updated = self.store.update(race_id, change)
        if receipt.confirmed_terminal:
            self.store.remove_job(race_id, a.id)
            if self.budget is not None:  # shown stopped: its reservation can settle now
                race = Race.from_dict(updated.state["race"], self.clock)
                self.budget.settle_race(race_id, race, updated.state)
        self.refresh_receipt(race_id)

    def refresh_receipt(self, race_id: str) -> None:
        raise NotImplementedError

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

    # ------------------------------------------------------------------ watching jobs
    def watch(
        self,
        race_id: str,
        attempt_id: str,
        provider_name: str,
        handle_data: dict[str, Any],
        last: str | None,
        cap_s: float,
        spec: dict[str, Any] | None = None,
        drop: _Drop | None = None,
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
        if at is None:
            at = now + self.settings.watch_interval_s
        if self._pushed(provider) and not deferred:
            # The webhook reports the end: poll only before decisions (below) and as a slow
            # safety net, should a delivery be lost.
            at = max(at, now + self.webhooks.fallback_s)
        at = max(at, now + MIN_WATCH_GAP_S)  # a hint at "now" must not spin the timer thread
        near = bool(getattr(provider, "polls_before_decisions", False))
        stepped: list[Race] = []  # the race this step saves (its timers: the decisions ahead)

        def arm(pipe: Any) -> None:
            # The next poll rides in the same round trip as the step (or the heartbeat) below.
            ahead = sorted(stepped[-1].timers.values()) if stepped else list(decide or ())
            ahead = [d for d in ahead if d > now] if near else []
            # (a deferred poll keeps its time: the budget may have reserved exactly that slot)
            when = _before_decision(at, ahead, now) if ahead and not deferred else at
            self._watch_arm(race_id, attempt_id, provider_name, handle_data, label, cap_s,
                            min(when, deadline), ahead or None, slot)(pipe)  # fmt: skip
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

    def arm_watch(self, *args: Any) -> None:
        """Arm the durable timer of one job's next watch poll (arguments of
        :meth:`_watch_timer`: race, attempt, provider, handle, last label, cap, when)."""
        key, due, payload, timer_id = self._watch_timer(*args)
        self.timers.arm(key, due, payload, timer_id=timer_id)

    def _watch_arm(self, *args: Any) -> Callable[[Any], None]:
        """Queue the arm of a watch timer on a pipeline (its id makes a repeat harmless)."""
        key, due, payload, timer_id = self._watch_timer(*args)

        def arm(pipe: Any) -> None:
            self.timers.queue_arm(pipe, key, due, payload, timer_id)

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
        payload = {
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
