"""How a race ends, for the race driver: the winner declared to its caller, the caller failed
at the deadline, the final receipt written (and rewritten after a late cap cancel), and the
lifecycle events that mark each moment for the metrics and Flower.

The driver's step calls these once the save of the step that decided them has won; the winner
claim and the finish ride in that save (:meth:`Outcome.ride_claim`, :meth:`Outcome.ride_finish`).
With replicas to wait for (the store's ``acks``), the caller's result is published only once
they hold the claim (:meth:`Outcome.declare`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..core.attempts import Phase
from ..core.jobs import JobState
from ..core.race import Race
from ..core.race_events import StatusObserved
from ..metrics import record as metrics
from ..store.race_keys import ResultWrite, SaveMark
from ..store.race_receipts import Finish
from ..store.races import RaceStore, WinnerClaim
from ..store.replicas import ReplicaAcks
from ..store.round_trip import RoundTrip
from .adaptive import share_observation
from .base import Step, find_attempt
from .receipt import (
    assemble_receipt,
    load_attempt_result,
    race_record,
    result_key,
    winner_result,
)
from .spec import spec_from_state

if TYPE_CHECKING:
    from .base import Driver

log = logging.getLogger(__name__)

_STATUS_EVENTS = {JobState.QUEUED: "queued", JobState.IN_PROGRESS: "running"}


class RiddenClaim:
    """The winner claim that rode in a step's save: its reply, read once the save won, and
    the caller's result when that rode with it (written by the claim that made the winner).
    With replicas to wait for, ``WAIT``'s reply follows the claim's: ``held`` says whether
    enough replicas acknowledged it (``saved``: the save's mark, to send the claim again)."""

    claim: WinnerClaim | None = None
    result: dict[str, Any] | None = None
    saved: SaveMark | None = None
    acks: ReplicaAcks | None = None
    acked: Any = None  # the WAIT's reply

    def take(self, replies: list[Any]) -> None:
        self.claim = RaceStore.winner_claim(replies[0])
        if self.acks is not None:
            self.acked = replies[1]

    @property
    def held(self) -> bool:
        return self.acks is None or self.acks.held(self.acked)


class Outcome:
    """The end of a race, and the lifecycle events on the way to it."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        # A valid result this process just stored, kept for the step that may declare it the
        # winner (no read back); bounded (race/base.py ``remember``).
        self.fresh_results: dict[tuple[str, str], dict[str, Any]] = {}

    def event(self, race_id: str, name: str, race: Race, attempt_id: str | None) -> None:
        """A lifecycle moment: counted in the metrics, and sent to Flower when events are on."""
        a = find_attempt(race, attempt_id) if attempt_id else None
        metrics.race_event(name, race, a)
        if not self.driver.settings.events:
            return
        fields: dict[str, Any] = {"race_id": race_id, "policy": race.policy.name}
        if a is not None:
            fields.update(attempt=a.id, provider=a.provider, role=a.role, job_id=a.job_id)
        try:
            self.driver.effects.event(race_id, name, fields)
        except Exception:  # events are for watching; they never break a race
            log.debug("race %s: event %s not sent", race_id, name, exc_info=True)

    def lifecycle(self, step: Step) -> None:
        """The lifecycle events of a performed step: a cutover, a job's queued or running
        status, a loser cancelled or leaked."""
        race_id, race = step.race_id, step.race
        if "cut_over" in race.flags and "cut_over" not in step.flags:
            self.event(race_id, "cut_over", race, None)
        for event in step.events:
            if isinstance(event, StatusObserved) and event.state is not None:
                name = _STATUS_EVENTS.get(event.state)
                if name:
                    self.event(race_id, name, race, event.attempt_id)
        for a in race.attempts:
            if step.phases.get(a.id) == a.phase:
                continue
            if a.phase is Phase.CANCELLED:
                self.event(race_id, "loser_cancelled", race, a.id)
            elif a.phase is Phase.LEAKED:
                self.event(race_id, "leaked", race, a.id)

    def announce_sent(self, race_id: str, race: Race, phases: dict[str, Phase]) -> None:
        """``hedge_launched`` / ``escalated`` once a hedge or fallback has left its launch
        sent to its provider (``phases``: before the step): one the budget refused, or that
        the race no longer needed, was never sent and is no hedge."""
        for a in race.attempts:
            if a.role == "primary" or phases.get(a.id) is not Phase.LAUNCHING:
                continue
            if a.phase is not Phase.LAUNCHING and a.sent:
                self.event(
                    race_id, "escalated" if a.role == "fallback" else "hedge_launched", race, a.id
                )

    def ride_claim(self, trip: RoundTrip, step: Step, saved: SaveMark) -> RiddenClaim:
        """The winner claim of a step that declares one, riding in its save (``saved``: its
        mark), to claim only if the save wins: no round trip of its own. The caller's result
        rides with it where the effects can say how it is stored, unless replicas must
        acknowledge the claim first: then ``WAIT`` rides after it instead."""
        race, race_id = step.race, step.race_id
        riding = RiddenClaim()
        winner = race.winner
        assert winner is not None
        store = self.driver.store
        if store.acks.on:
            riding.saved, riding.acks, result = saved, store.acks, None
        else:
            result = self._result_write(race_id, race, riding)
        trip.ride(
            lambda pipe: store.queue_claim_winner(pipe, race_id, winner, saved, result),
            [store.claim_winner_script],
            riding.take,
        )
        return riding

    def _result_write(self, race_id: str, race: Race, riding: RiddenClaim) -> ResultWrite | None:
        """The caller's result, to ride with the winner claim in the declaring save, where the
        effects say how their backend stores it (``result_write``) and this process holds the
        winning result it just validated (no read); noted on ``riding`` for the declare."""
        prepare = getattr(self.driver.effects, "result_write", None)
        won = race.winner_attempt
        stored = self.fresh_results.get((race_id, won.id)) if won is not None else None
        if prepare is None or won is None or stored is None:
            return None
        result = self._winner_result(race_id, race, won.id, stored)
        write = prepare(race_id, result)
        if write is not None:
            riding.result = result
        return write

    def _winner_result(
        self, race_id: str, race: Race, attempt_id: str, stored: dict[str, Any]
    ) -> dict[str, Any]:
        return winner_result(
            race,
            stored,
            inline_max=self.driver.settings.payload_inline_max,
            ref=result_key(self.driver.store.prefix, race_id, attempt_id),
        )

    def declare(
        self, race_id: str, race: Race, state: dict[str, Any], riding: RiddenClaim | None = None
    ) -> dict[str, Any] | None:
        """Claim the winner (unless ``riding``: the claim made in the step's save) and hand
        the caller its result; returns that result (None when another attempt holds the
        claim). With replicas to wait for, only once they hold the claim: a claim they do not
        acknowledge raises the store's outage error (``NotAcknowledged``) before anything is
        published, and the step's retry (a redelivered timer, a task retry) declares again."""
        won = race.winner_attempt
        assert won is not None
        claim = riding.claim if riding is not None else None
        if claim is None:
            claim = self.driver.store.claim_winner(race_id, won.id)
        elif claim.won and riding is not None and not riding.held:  # its WAIT came back short
            assert riding.saved is not None
            claim = self.driver.store.confirm_winner(
                race_id, won.id, riding.saved, claim, riding.acked
            )
        if not claim.won:  # cannot happen while the state's version check holds; never hide it
            log.error(
                "race %s: engine chose %s but %s holds the win", race_id, won.id, claim.winner
            )
            return None
        stored = self.fresh_results.pop((race_id, won.id), None)
        result = riding.result if riding is not None else None  # built before the save
        if result is None:
            if stored is None:
                stored = load_attempt_result(
                    self.driver.store.client, self.driver.store.prefix, race_id, won.id
                )
            result = self._winner_result(race_id, race, won.id, stored or {})
        caller = state.get("caller") or {}
        if claim.first:
            caller = {**caller, "first_claim": True}  # Celery effects skip a "done?" read
            if riding is not None and riding.result is not None:
                # The claim that made the winner wrote the caller's result in its script (or
                # this save's first send did, its answer lost: the claim says first again).
                caller["result_stored"] = True
        self.event(race_id, "won", race, won.id)  # before task-succeeded, which ends it in Flower
        self.driver.effects.won(race_id, result, caller)
        return result

    def give_up(self, race_id: str, race: Race, state: dict[str, Any]) -> None:
        """The deadline passed without a winner: the caller's ``.get()`` raises RaceFailed now,
        with the receipt as it stands (its jobs are still being cancelled; the final receipt
        follows in Redis when they are settled)."""
        log.warning("race %s: %s; failing the caller and cancelling its jobs", race_id, race.note)
        spec = spec_from_state(state)
        receipt = assemble_receipt(race, state, spec, now=self.driver.clock.now())
        message = f"race {race_id}: {race.note}"
        self.driver.effects.failed(race_id, message, receipt, state.get("caller") or {})

    def _finish_parts(self, race: Race, state: dict[str, Any]) -> Finish:
        """The finished race's receipt, the attempts whose jobs leave the live-job index with
        it, and its record."""
        spec = spec_from_state(state)
        receipt = assemble_receipt(race, state, spec, now=self.driver.clock.now())
        # a capped job stays registered until its own cancel confirms it stopped
        ended = tuple(
            a.id for a in race.attempts if not a.live and a.result_state != JobState.TIMEOUT.value
        )
        record = race_record(self.driver.store, race, state, spec, receipt)
        return Finish(receipt, self.driver.settings.receipt_ttl_s, ended, record)

    def ride_finish(self, trip: RoundTrip, step: Step, saved: SaveMark) -> dict[str, Any]:
        """The finish (receipt, record, indexes) of a step that finishes its race, riding in
        its save, last among the extra commands, to run only if the save wins: no round trip
        of its own. Returns the receipt."""
        done = self._finish_parts(step.race, step.state)
        self.driver.store.ride_finish(trip, step.race_id, done, saved)
        return done.receipt

    def finish(
        self,
        race_id: str,
        race: Race,
        state: dict[str, Any],
        stored: dict[str, Any] | None = None,
    ) -> None:
        """The race's end: its receipt and record stored (unless ``stored``, the receipt its
        step's save stored already), its metrics, and a failed caller told."""
        receipt = stored
        if receipt is None:
            done = self._finish_parts(race, state)
            receipt = done.receipt
            self.driver.store.finish(
                race_id, receipt, done.ttl_s, drop_jobs=done.drop_jobs, record=done.record
            )
        metrics.race_finished(race, receipt)
        if self.driver.adaptive is not None:
            share_observation(self.driver.adaptive, race, self.driver.clock.now())
        if race.winner is None:
            message = f"race {race_id}: {race.note}"
            self.driver.effects.failed(race_id, message, receipt, state.get("caller") or {})

    def refresh_receipt(self, race_id: str) -> None:
        """Rewrite a finished race's receipt from its state (after a late cap cancel)."""
        if self.driver.store.receipt(race_id) is None:
            return  # not finished: the receipt will be assembled from the state then
        record = self.driver.store.load(race_id)
        if record is None:
            return
        race = Race.from_dict(record.state["race"], self.driver.clock)
        spec = spec_from_state(record.state)
        receipt = assemble_receipt(race, record.state, spec, now=self.driver.clock.now())
        receipt["finished_at"] = (self.driver.store.receipt(race_id) or {}).get("finished_at")
        corrected = race_record(
            self.driver.store, race, record.state, spec, receipt
        )  # its leak flag
        self.driver.store.put_receipt(
            race_id, receipt, self.driver.settings.receipt_ttl_s, record=corrected
        )
        if not self.driver.store.live_jobs(race_id):
            self.driver.store.forget(race_id)
