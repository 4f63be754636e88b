"""Cancel work of the race driver: an attempt's job cancelled natively, with its receipt.

The race driver's :class:`Canceller`. A cancel is asked for durably (a backstop
timer first, then the cancel on this process's threads), and its outcome (confirmed,
acknowledged, failed) is reported to the race through ``step``; never Celery's revoke.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..core.attempts import Attempt, Phase
from ..core.jobs import JobHandle, JobState
from ..core.race import Race
from ..core.race_events import CancelAcknowledged, CancelFailed
from ..core.receipts import CancelReceipt, Evidence
from ..providers.base import CancelsBehindQueued, Provider
from .backstops import BackstopDrop, cancel_backstop_id
from .base import JobRef, due_ms, find_attempt, remember

if TYPE_CHECKING:
    from .base import Driver, Step

log = logging.getLogger(__name__)


class Canceller:
    """Per-attempt native cancels and their receipts."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        # A cancel's attempt as the step that decided it saved it, for the cancel that follows
        # in this process (no read on the way to the provider); bounded (base.py ``remember``).
        self.decided: dict[tuple[str, str], tuple[Attempt, dict[str, Any] | None]] = {}

    def cancel_orphan(
        self, race_id: str, attempt_id: str, provider: Provider, handle: JobHandle
    ) -> None:
        """Cancel a job whose report came after its attempt ended; unregister it once stopped.

        Registered again when the cancel is not confirmed (the race's finish may have dropped
        it meanwhile, with its ended attempt): the janitor cancels the registered jobs of races
        nobody advances, with receipts.
        """
        log.error(
            "race %s: %s's submit returned job %s after the attempt ended (its launch window "
            "passed); cancelling it",
            race_id,
            attempt_id,
            handle.job_id,
        )
        try:
            confirmed = provider.cancel(handle).confirmed_terminal
        except Exception:
            log.exception("race %s: cancel of orphan job %s failed", race_id, handle.job_id)
            confirmed = False
        if confirmed:
            self.driver.store.remove_job(race_id, attempt_id)
        else:
            self.driver.store.add_job(race_id, attempt_id, handle.to_dict())

    def request_cancel(
        self, race_id: str, attempt_id: str, provider: str, step: Step | None = None
    ) -> None:
        """Have an attempt's job cancelled now, durably: a backstop timer, then the effect.

        :meth:`Effects.cancel` runs the cancel at once (in production: on a thread of this
        process, no task hop). The backstop timer hands the cancel to any live worker if this
        process dies before :meth:`cancel_attempt` reports back; it never waits for a broker's
        visibility timeout. Its id is fixed per attempt, so re-arming is a no-op. ``step``: the
        step that decided the cancel, just saved: a cancel run in this process starts from its
        race instead of reading the race again, and its backstop rode in that save already.
        """
        d = self.driver
        if step is not None:
            a = find_attempt(step.race, attempt_id)
            if a is not None:
                snapshot = (Attempt.from_dict(a.to_dict()), step.caps)
                remember(self.decided, (race_id, attempt_id), snapshot)
        # The backstop first: a crash right after the save must still get the loser cancelled
        # (its watch keeps the race's heartbeat fresh, so the janitor would not step in).
        if step is None or not step.armed:
            key, due, payload, timer_id = self.backstop(race_id, attempt_id)
            d.timers.of(race_id).arm(key, due, payload, timer_id=timer_id)
        d.effects.cancel(race_id, attempt_id, provider)

    def backstop(self, race_id: str, attempt_id: str) -> tuple[str, int, dict[str, Any], str]:
        """Key, due time, payload and fixed id of an attempt's cancel backstop timer."""
        at = self.driver.clock.now() + self.driver.settings.cancel_backstop_s
        payload = {"race": race_id, "kind": "cancel", "attempt": attempt_id}
        timer_id = cancel_backstop_id(race_id, attempt_id)
        return f"{race_id}:c:{attempt_id}", due_ms(at), payload, timer_id

    def cancel_attempt(self, race_id: str, attempt_id: str) -> None:
        """Cancel an attempt's job natively and report the receipt (never Celery's revoke).

        Returns once the outcome (confirmed, acknowledged, failed) is saved in the race; the
        attempt's backstop timer is dropped in that save's round trip (or after it), so a crash
        before it leaves the timer to finish the job elsewhere.
        """
        timers = self.driver.timers.of(race_id)
        drop = BackstopDrop(timers, cancel_backstop_id(race_id, attempt_id))
        self._cancel_attempt(race_id, attempt_id, drop)
        drop.now()  # unless the report's save carried it

    def _cancel_attempt(self, race_id: str, attempt_id: str, drop: BackstopDrop) -> None:
        d = self.driver
        decided = self.decided.pop((race_id, attempt_id), None)
        if decided is not None and decided[0].phase is Phase.CANCELLING:
            a, caps = decided  # as the deciding step saved it: no read on the way to the call
        else:
            record = d.store.load(race_id)
            if record is None:
                return
            race = Race.from_dict(record.state["race"], d.clock)
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
            d.recovery.resume(race_id)  # a redelivery after the cancel was reported: see submit
            return
        provider = d.providers(a.provider)
        handle = JobHandle.from_dict(a.handle)
        try:
            if a.last_state == JobState.IN_PROGRESS.value and isinstance(
                provider, CancelsBehindQueued
            ):  # queued jobs' cancels first: one stopped now costs nothing
                receipt = provider.cancel_running(handle)
            else:
                receipt = provider.cancel(handle)
        except Exception as e:
            failure = CancelFailed(attempt_id, f"{type(e).__name__}: {e}")
            d.step(race_id, failure, None, drop.ride_ahead())
            return
        if receipt.confirmed_terminal and receipt.terminal_status is JobState.COMPLETED:
            # It finished before the cancel took effect: its result may still win the race.
            ack = replace(
                receipt,
                confirmed_terminal=False,
                terminal_status=None,
                terminal_ms=None,
                leaked=True,
                evidence=Evidence.PROVIDER_ACK,
            )
            d.step(race_id, CancelAcknowledged(attempt_id, ack))
            cap = float((caps or {}).get(a.provider, 180.0))
            d.concluder.conclude(JobRef(race_id, attempt_id, a.provider, a.handle, cap))
            return
        acknowledged = CancelAcknowledged(attempt_id, receipt)
        if receipt.confirmed_terminal:
            d.step(race_id, acknowledged, None, drop.ride_ahead())
        else:  # both in one save
            refused = receipt.evidence is Evidence.NO_EVIDENCE  # the provider did not accept it
            why = (
                "the provider refused the cancel or never answered"
                if refused
                else ("no terminal state within the cancel window")
            )
            failed = CancelFailed(attempt_id, why)
            d.step(race_id, (acknowledged, failed), None, drop.ride_ahead())

    def _cancel_capped(self, race_id: str, a: Attempt) -> None:
        """Cancel a job that passed its cap, and record the receipt beside the race's own.

        The engine ended the attempt as TIMEOUT (it cannot win any more), but a cap is ours,
        not the provider's: without this the job would run on, unseen, until it ends by itself.
        """
        d = self.driver
        if a.id not in d.store.live_jobs(race_id):
            return  # already stopped and unregistered (a duplicate delivery)
        provider = d.providers(a.provider)
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

        updated = d.store.update(race_id, change)
        if receipt.confirmed_terminal:
            d.store.remove_job(race_id, a.id)
            if d.budget is not None:  # shown stopped: its reservation can settle now
                race = Race.from_dict(updated.state["race"], d.clock)
                d.budget.settle_race(race_id, race, updated.state)
        d.outcome.refresh_receipt(race_id)
