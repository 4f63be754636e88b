"""The race driver's :class:`Recovery`: what a due durable timer does to a race, and how a
step that a crashed process left half-done is performed again.

A timer is delivered again when the process that claimed it died or its handler failed; every
kind's work is idempotent, so a second delivery, or a ``resume`` after it, only completes what
the first left undone.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..core.attempts import Phase
from ..core.jobs import JobState
from ..core.race import Race
from ..core.race_events import TimerDue
from ..store.timers import Timer
from .attempts import SubmitHow
from .base import JobRef, due_ms

if TYPE_CHECKING:
    from .base import Driver

log = logging.getLogger(__name__)


class Recovery:
    """The durable timers' handler and crash recovery."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    def on_timer(self, timer: Timer) -> None:
        """The TimerService handler: a policy timer steps the race, a watch timer polls a job."""
        d = self.driver
        payload = timer.payload
        kind = payload.get("kind")
        if kind == "policy":
            d.step(payload["race"], TimerDue(payload["key"]))
            if timer.deliveries > 1:  # its first claimer died, perhaps after saving the step
                self.resume(payload["race"])
        elif kind == "cancel":
            # The process that was cancelling this attempt did not report it done within the
            # backstop: it died (or its provider is very slow). Cancelling again is harmless.
            log.warning(
                "race %s: cancel of %s taken over by the backstop timer",
                payload["race"],
                payload["attempt"],
            )
            d.canceller.cancel_attempt(payload["race"], payload["attempt"])
        elif kind == "launch":
            # The process that launched this attempt did not get its job watched in time: it
            # died (before, during or after the submit). The submit claim decides what to do.
            log.warning(
                "race %s: launch of %s taken over by the backstop timer",
                payload["race"],
                payload["attempt"],
            )
            d.submitter.submit(payload["race"], payload["attempt"], SubmitHow(takeover=True))
        elif kind == "watch":
            ref = JobRef.from_payload(payload)
            d.watcher.watch(
                ref, payload.get("last"), payload.get("decide"), payload.get("reserved")
            )
            if timer.deliveries > 1:  # its first claimer may have died after saving a step
                # (this job's next poll was just armed, or it was concluded: not armed again,
                # or the job would be watched by two chains of polls from now on)
                self.resume(payload["race"], watched=payload["attempt"])
        elif kind == "tell":  # replicas to wait for: the outcome told again (outcome.py)
            d.outcome.retell(payload["race"], int(payload.get("try", 0)))
        else:
            log.warning("timer %s has an unknown kind %r; dropped", timer.id, kind)

    def resume(self, race_id: str, watched: str | None = None) -> None:
        """Re-perform whatever a crashed step may have left undone (all of it idempotent).

        ``watched``: an attempt whose watch poll the caller has just made (and re-armed), so
        no other poll is armed for it."""
        d = self.driver
        record = d.store.load(race_id)
        if record is None:
            return
        state = record.state
        race = Race.from_dict(state["race"], d.clock)
        if race.finished and d.store.receipt(race_id) is not None:
            # Receipt written; but the step that declared the winner may have died before
            # marking the result (another process finished the race): mark it again.
            if race.winner is not None:
                d.outcome.declare(race_id, race, state)
            return
        caps = state["spec"].get("caps_s") or {}
        now = d.clock.now()
        for a in race.attempts:
            if a.phase is Phase.LAUNCHING:
                d.launch(race_id, a.id, a.provider)
            elif a.result_state == JobState.TIMEOUT.value and a.handle:
                d.canceller.request_cancel(race_id, a.id, a.provider)  # a capped job left running
            elif a.live and a.handle:
                cap = float(caps.get(a.provider, 180.0))
                if a.id != watched:  # a poll now, unless the job's chain of polls is alive
                    d.watcher.arm_if_idle(
                        JobRef(race_id, a.id, a.provider, a.handle, cap), None, now
                    )
                if a.phase is Phase.CANCELLING:
                    d.canceller.request_cancel(race_id, a.id, a.provider)
        ids = state.get("timer_ids") or {}
        for key, at in race.timers.items():
            if key in ids:
                payload = {"race": race_id, "kind": "policy", "key": key}
                timers = d.timers.of(race_id)
                timers.arm(f"{race_id}:{key}", due_ms(at), payload, timer_id=ids[key])
        if race.winner is not None:
            d.outcome.declare(race_id, race, state)
        elif race.gave_up and not race.finished:
            d.outcome.give_up(race_id, race, state)
        if race.finished:
            d.outcome.finish(race_id, race, state)
