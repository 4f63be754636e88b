"""The race janitor: finds races nobody advances any more and cancels their provider jobs.

A race is state in Redis, advanced by short tasks and durable timers. If every process that
could advance it dies (or its messages wait out the broker's visibility timeout), its submitted
provider jobs would keep running and its caller would wait. The janitor is the backstop:

1. :meth:`RaceStore.stale_races` lists races whose heartbeat is older than ``stale_ms`` and
   that nobody owns;
2. for each, the janitor takes the race's ownership lease (so two janitors never work on one
   race), reloads it and checks that it is really dead: no timer of the race is still waiting
   to fire (a coordinator that is alive would fire it) unless no coordinator is alive at all;
3. it cancels every registered job that may still run (live attempts, attempts ended at their
   cap, jobs the race never heard of) through the provider's *native* cancel, keeps each
   :class:`~gpuhedge_celery.core.receipts.CancelReceipt` (evidence level, leak flag) in the
   race's state, marks the race finished with a note, and saves with a version check (a race
   that came back to life in the meantime wins and is left alone);
4. it writes the receipt; a race without a winner is failed explicitly through
   :meth:`Effects.failed` (``.get()`` raises ``RaceFailed``), a race whose winner was claimed
   has its result marked again (idempotent) in case the process that claimed it died first.
   With replicas to wait for, a winner is handed over only once they hold its claim (made
   again if a failover lost it), else left for a later pass and, past the race's deadline,
   its caller failed instead; a failure is told once they hold the save that ended the race
   (or past the deadline and a grace all the same).

A job whose cancel could not be confirmed stays registered as live and is retried on the next
pass (the receipt reports it as a leak until then). A submit intent left by a worker that died
mid-submit has no job id: it is dropped and its attempt ends with its outcome unknown (never
submitted again). Every attempt it ends settles its budget reservation, and each pass sweeps
reservations left open past their worst-case window (``race/budget.py``). All idempotent.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core.attempts import Phase
from ..core.clock import Clock, WallClock
from ..core.jobs import JobHandle, JobState
from ..core.race import Race, may_run, unverified_end
from ..core.race_cancels import unknown_submit_receipt
from ..core.receipts import CancelReceipt
from ..metrics import record as metrics
from ..providers.base import Provider
from ..store.races import RaceStore, VersionConflict
from ..store.replicas import NotAcknowledged
from ..store.timers import RaceTimers, as_text, store_errors
from .attempts import UNKNOWN_SUBMIT
from .base import Effects
from .budget import RaceBudget
from .outcome import (
    TELL_GRACE_S,
    TELL_ONCE,
    TOLD_FAILED,
    TOLD_WON,
    UNACKNOWLEDGED,
    UNHELD,
    race_deadline,
    unheld_message,
)
from .receipt import (
    assemble_receipt,
    load_attempt_result,
    race_record,
    result_key,
    winner_result,
)
from .spec import spec_from_state

log = logging.getLogger(__name__)

ABANDONED_NOTE = "abandoned: no coordinator advanced the race; the janitor ended it"
DEFAULT_STALE_MS = 30_000
DEFAULT_LEASE_MS = 30_000


RESULT_LOST = "winner_result_lost"  # the failure reason of a claim holder's vanished result


@dataclass
class RaceCleanup:
    """What the janitor did to one race."""

    race_id: str
    action: str  # "ended", "recancelled", "forgotten" or "skipped: <why>"
    cancelled: list[str] = field(default_factory=list)  # attempt ids confirmed stopped
    leaked: list[str] = field(default_factory=list)  # attempt ids not confirmed stopped
    failed: bool = False  # the race was ended as an explicit failure

    def to_dict(self) -> dict[str, Any]:
        return {
            "race_id": self.race_id,
            "action": self.action,
            "cancelled": list(self.cancelled),
            "leaked": list(self.leaked),
            "failed": self.failed,
        }


@dataclass
class JanitorReport:
    """One janitor pass: every race it looked at and what it did."""

    races: list[RaceCleanup] = field(default_factory=list)
    settled: int = 0  # budget reservations left open by dead workers, settled by the sweep

    @property
    def cancelled(self) -> int:
        return sum(len(r.cancelled) for r in self.races)

    @property
    def leaked(self) -> int:
        return sum(len(r.leaked) for r in self.races)

    def to_dict(self) -> dict[str, Any]:
        return {
            "races": [r.to_dict() for r in self.races],
            "cancelled": self.cancelled,
            "leaked": self.leaked,
            "ended": sum(1 for r in self.races if r.action == "ended"),
            "settled": self.settled,
        }


@dataclass(frozen=True)
class _Ending:
    """How the janitor ends a race: whether it had finished, whether its caller is told (no
    receipt yet), and, with replicas to wait for, the attempt whose win they hold (None with
    a winner: past its deadline, its caller is failed instead)."""

    was_finished: bool
    tell: bool
    holder: str | None = None


def default_owner() -> str:
    """A fresh ownership name: host, process and a per-janitor suffix (threads never share)."""
    return f"janitor-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class JanitorOptions:
    """How a :class:`Janitor` works; the defaults suit a worker."""

    stale_ms: int = DEFAULT_STALE_MS  # a race whose heartbeat is older is a candidate
    lease_ms: int = DEFAULT_LEASE_MS  # how long the janitor owns a race it cleans
    receipt_ttl_s: float | None = None  # how long its receipts live (None: the store's)
    # whether some process fires race timers now: "yes, this worker" in the Celery task, no
    # for a script run after a full outage (None: always yes)
    coordinators_alive: Callable[[], bool] | None = None
    owner: str | None = None  # its ownership name (None: a fresh one)
    payload_inline_max: int = 1_000_000  # a larger winner payload is returned by reference
    clock: Clock | None = None  # the races' clock (None: wall time)
    budget: RaceBudget | None = None  # whose reservations it settles (None or disabled: none)

    def __post_init__(self) -> None:
        if self.stale_ms < 1 or self.lease_ms < 1:
            raise ValueError(
                f"stale_ms and lease_ms must be >= 1, got {self.stale_ms}, {self.lease_ms}"
            )


class Janitor:
    """Ends dead races: native cancels with receipts, explicit failure when there was no winner.

    A race whose own timer is still waiting is only dead when nobody would ever fire it
    (:attr:`JanitorOptions.coordinators_alive`).
    """

    def __init__(
        self,
        store: RaceStore,
        timers: RaceTimers,
        providers: Callable[[str], Provider],
        effects: Effects,
        options: JanitorOptions | None = None,
    ):
        options = options or JanitorOptions()
        self.store = store
        self.timers = timers
        self.providers = providers
        self.effects = effects
        self.stale_ms = options.stale_ms
        self.lease_ms = options.lease_ms
        self.receipt_ttl_s = options.receipt_ttl_s
        self.coordinators_alive = options.coordinators_alive or (lambda: True)
        self.owner = options.owner or default_owner()
        self.payload_inline_max = options.payload_inline_max
        self.clock = options.clock or WallClock()
        budget = options.budget
        self.budget = budget if budget is not None and budget.enabled else None

    # ------------------------------------------------------------------ a pass
    def run_once(self, limit: int = 100) -> JanitorReport:
        """Look at up to ``limit`` stale races and clean each one that is really dead."""
        report = JanitorReport()
        alive: bool | None = None  # asked once per pass, and only when a race needs it
        for stale in self.store.stale_races(self.stale_ms, limit):
            if alive is None and self._has_waiting_timer(stale.race_id):
                alive = bool(self.coordinators_alive())
            report.races.append(self.clean(stale.race_id, coordinators_alive=alive))
        if self.budget is not None:  # reservations a dead worker left open: settle them
            report.settled += self.budget.sweep(self._state, self.stale_ms, limit)
        metrics.janitor_pass(report.races)
        return report

    def _state(self, race_id: str) -> dict[str, Any] | None:
        record = self.store.load(race_id)
        return None if record is None else record.state

    def clean(self, race_id: str, *, coordinators_alive: bool | None = None) -> RaceCleanup:
        """Clean one race under its ownership lease (see the module docstring)."""
        ownership = self.store.claim_owner(race_id, self.owner, self.lease_ms)
        if ownership is None:
            return RaceCleanup(race_id, "skipped: owned by another process")
        try:
            return self._clean_owned(race_id, coordinators_alive)
        finally:
            try:
                self.store.release_owner(ownership)
            except Exception:  # the lease lapses on its own
                log.debug("race %s: ownership not released", race_id, exc_info=True)

    def _clean_owned(self, race_id: str, coordinators_alive: bool | None) -> RaceCleanup:
        record = self.store.load(race_id)
        jobs = self.store.live_jobs(race_id)
        if record is None:
            if not jobs:
                self.store.forget(race_id)
                return RaceCleanup(race_id, "forgotten")
            return RaceCleanup(race_id, "skipped: live jobs but no state (expired)")
        race = Race.from_dict(record.state["race"], self.clock)
        had_receipt = self.store.receipt(race_id) is not None
        last_seen = self.store.last_seen_ms(race_id)
        if last_seen is not None and last_seen > self.store.now_ms() - self.stale_ms:
            return RaceCleanup(race_id, "skipped: advanced since the scan")
        for attempt_id in [j for j in jobs if not _may_run(race, j)]:
            self.store.remove_job(race_id, attempt_id)  # ended or cancelled: nothing to stop
            jobs.pop(attempt_id)
        if race.finished and not jobs and had_receipt:
            self.store.forget(race_id)
            return RaceCleanup(race_id, "forgotten")
        if not race.finished and self._has_waiting_timer(race_id):
            if coordinators_alive is None:
                coordinators_alive = bool(self.coordinators_alive())
            if coordinators_alive:
                return RaceCleanup(race_id, "skipped: a timer of the race is still waiting")
        handles = {k: v for k, v in jobs.items() if not v.get("submitting")}
        receipts = self._cancel_jobs(race, jobs)
        holder: str | None = None
        if not had_receipt and race.winner is not None and self.store.acks.on:
            holder = self._held_winner(race_id, race)
            if holder is None and not self._past(race):
                # ended, the race would never be looked at again: left for a later pass
                return RaceCleanup(race_id, "skipped: its winner is not held by the replicas yet")
        ending = _Ending(race.finished, not had_receipt, holder)
        return self._end(race_id, receipts, handles, ending)

    # ------------------------------------------------------------------ liveness
    def _has_waiting_timer(self, race_id: str) -> bool:
        """Whether a timer of the race is due in the future (or lately), or claimed and leased.

        A timer overdue by more than ``stale_ms`` and never claimed shows that no timer service
        is running: it does not keep the race alive.
        """
        now = self.store.now_ms()
        keys = self.timers.of(race_id).keys
        with store_errors(f"reading the timers of race {race_id!r}"):
            for zset, floor in ((keys.due, now - self.stale_ms), (keys.inflight, now)):
                for member, score in self.store.client.zscan_iter(
                    zset, match=f"{race_id}[|:]*", count=500
                ):
                    if as_text(member).split("|")[0].split(":w:")[0] != race_id:
                        continue  # another race whose id starts with this one
                    if score > floor:
                        return True
        return False

    # ------------------------------------------------------------------ cancelling
    def _cancel_jobs(
        self, race: Race, jobs: dict[str, dict[str, Any]]
    ) -> dict[str, CancelReceipt | str]:
        """Cancel every registered live job natively; attempt id -> receipt (or the error)."""
        out: dict[str, CancelReceipt | str] = {}
        for attempt_id, handle_data in jobs.items():
            if handle_data.get("submitting"):
                # A submit whose worker died: no job id to cancel. The attempt is ended with
                # its outcome unknown and the intent dropped (nothing more can be done).
                self.store.remove_job(race.race_id, attempt_id)
                out[attempt_id] = UNKNOWN_SUBMIT
                continue
            handle = JobHandle.from_dict(handle_data)
            try:
                receipt = self.providers(handle.provider).cancel(handle)
            except Exception as e:  # the job stays registered; the next pass tries again
                log.warning("race %s: cancel of %s failed: %s", race.race_id, handle.job_id, e)
                out[attempt_id] = f"{type(e).__name__}: {e}"
                continue
            receipt.note = f"janitor: {receipt.note}" if receipt.note else "janitor cancel"
            out[attempt_id] = receipt
        return out

    def _end(
        self,
        race_id: str,
        receipts: dict[str, CancelReceipt | str],
        handles: dict[str, dict[str, Any]],
        ending: _Ending,
    ) -> RaceCleanup:
        """End the race (see the module and :class:`_Ending`)."""
        was_finished, tell, holder = ending.was_finished, ending.tell, ending.holder
        now_ms = self.clock.now() * 1000.0
        acks_on = self.store.acks.on
        winner: str | None = None

        def change(state: dict[str, Any]) -> dict[str, Any]:
            nonlocal winner
            race = Race.from_dict(state["race"], self.clock)
            apply_cleanup(race, receipts, now_ms, handles)
            new = dict(state)
            new["race"] = race.to_dict()
            new["janitor"] = {"owner": self.owner, "at_ms": now_ms}
            winner = race.winner
            if acks_on and tell and race.winner is not None and holder is None:
                new[UNHELD] = {"winner": race.winner, "at": now_ms / 1000.0}
            return new

        try:
            record = self.store.update(race_id, change)
        except VersionConflict:  # the race vanished while we worked (expired)
            return RaceCleanup(race_id, "skipped: the race disappeared")
        # its caller is failed instead of told its winner (now, or by its tell timer before)
        unheld = UNHELD in record.state  # (only ever noted with replicas to wait for)
        if acks_on and tell and (winner is None or unheld) and not self._failure_held(race_id):
            # the caller is told the failure once no failover can take it back: a later pass
            return RaceCleanup(race_id, "skipped: its end is not held by the replicas yet")
        race = Race.from_dict(record.state["race"], self.clock)
        told, lost = self._as_told(race_id, race, holder) if tell else (race, False)
        cleanup = RaceCleanup(race_id, "finalised" if was_finished else "ended")
        for attempt_id, found in receipts.items():
            if found == UNKNOWN_SUBMIT:
                continue  # no job id: nothing was (or could be) cancelled
            if isinstance(found, CancelReceipt) and found.confirmed_terminal:
                cleanup.cancelled.append(attempt_id)  # unregistered with the new receipt
            else:
                cleanup.leaked.append(attempt_id)
        spec = spec_from_state(record.state)
        # the receipt and record say what the caller is told (the claim's holder, or its loss)
        receipt = assemble_receipt(told, record.state, spec, now=self.clock.now())
        receipt["janitor"] = record.state.get("janitor")
        if unheld:
            receipt["failure_reason"] = UNACKNOWLEDGED
        elif lost:
            receipt["failure_reason"] = RESULT_LOST
        final = race_record(self.store, told, record.state, spec, receipt)
        self.store.finish(
            race_id, receipt, self.receipt_ttl_s, drop_jobs=cleanup.cancelled, record=final
        )
        if self.budget is not None:  # every attempt shown stopped settles its reservation
            # a finished race's leaks may have settled at their cancel's acknowledgement: the
            # figure the janitor's cancel shows replaces it, once
            resettle = set(receipts) if was_finished else set()
            self.budget.settle_race(race_id, race, record.state, resettle)
        caller = record.state.get("caller") or {}
        if acks_on:  # told once, whatever it was told before (the effects read first)
            caller = {**caller, TELL_ONCE: True}
        if race.winner is None or unheld:
            cleanup.failed = True
            if tell:
                message = f"race {race_id}: {race.note}"
                if unheld:
                    message = unheld_message(race_id, race.winner or "", self.store.acks)
                    log.error("%s", message)
                if unheld and not self._may_tell(race_id, TOLD_FAILED):
                    log.error("race %s: its winner was told meanwhile; not failed", race_id)
                else:
                    self.effects.failed(race_id, message, receipt, caller)
        elif tell:  # its claimer may have died before marking the result
            cleanup.failed = self._mark_winner(race_id, race, caller, holder, receipt)
        return cleanup

    def _may_tell(self, race_id: str, outcome: str) -> bool:
        """With replicas to wait for: whether the caller may be told ``outcome`` (decided in
        the store once, a winner and a failure racing each other: see ``Outcome.decide_told``)."""
        if not self.store.acks.on:
            return True
        told = self.store.tell_once(race_id, outcome)
        return told is None or told == outcome

    def _past(self, race: Race, grace_s: float = 0.0) -> bool:
        """Whether the race's deadline (plus ``grace_s``) has passed."""
        deadline = race_deadline(race)
        return deadline is not None and self.clock.now() >= deadline + grace_s

    def _held_winner(self, race_id: str, race: Race) -> str | None:
        """With replicas to wait for: the attempt whose win they hold (the state's winner, its
        claim made again if a failover lost it while the save that declared it survived; or
        whichever attempt holds the claim instead), None while they hold none."""
        won = race.winner_attempt
        assert won is not None
        try:
            claim = self.store.claim_winner(race_id, won.id)  # the same claim, and WAIT
            if not claim.won:  # another attempt holds it: that one's caller is told
                log.error("race %s: %s won, but %s holds the claim", race_id, won.id, claim.winner)
                claim = self.store.claim_winner(race_id, claim.winner)
        except NotAcknowledged:
            return None
        return claim.winner

    def _as_told(self, race_id: str, race: Race, holder: str | None) -> tuple[Race, bool]:
        """The race as its caller is told it (see :meth:`_mark_winner`): with the attempt
        holding the claim (``holder``) as its winner when that is another attempt than the
        state's, or with no winner when that attempt's result is gone (then True)."""
        if holder is None or race.winner is None or holder == race.winner:
            return race, False
        told = Race.from_dict(race.to_dict(), self.clock)
        stored = load_attempt_result(self.store.client, self.store.shards, race_id, holder)
        told.winner = holder if stored is not None else None
        return told, stored is None

    def _failure_held(self, race_id: str) -> bool:
        """Whether the replicas hold the save that failed the race (or it is past its deadline
        and the grace: told all the same, never silence)."""
        try:
            self.store.hold_save(race_id)
        except NotAcknowledged:
            record = self.store.load(race_id)
            if record is None:
                return False
            if not self._past(Race.from_dict(record.state["race"], self.clock), TELL_GRACE_S):
                return False
            log.error("race %s: the replicas never held its failure; told all the same", race_id)
        return True

    def _mark_winner(
        self,
        race_id: str,
        race: Race,
        caller: dict[str, Any],
        holder: str | None = None,
        receipt: dict[str, Any] | None = None,
    ) -> bool:
        """Mark the claimed winner's result (again: the effects skip a result already marked).
        ``holder``: the attempt whose claim the replicas hold (with replicas to wait for); its
        result gone, the caller is failed instead (``receipt``: the race's final one).
        Returns whether the caller was failed."""
        won = race.winner_attempt
        if won is None:
            return False
        if holder is None:
            if self.store.winner(race_id) != won.id:
                return False
            holder = won.id
        elif holder != won.id:  # follow the claim: the result handed over is its holder's
            race = Race.from_dict(race.to_dict(), self.clock)
            race.winner = holder
        stored = load_attempt_result(self.store.client, self.store.shards, race_id, holder)
        if stored is None and holder != won.id:
            message = (
                f"race {race_id}: the result of {holder}, which holds the winner claim, is "
                f"gone; failed rather than leave its caller waiting"
            )
            log.error("%s", message)
            if not self._may_tell(race_id, TOLD_FAILED):
                return False  # a winner was told meanwhile
            failure = {**(receipt or {}), "failure_reason": RESULT_LOST}
            self.effects.failed(race_id, message, failure, caller)
            return True
        if not self._may_tell(race_id, TOLD_WON):
            log.error("race %s: %s won, but its caller was failed instead", race_id, holder)
            return False
        result = winner_result(
            race,
            stored or {},
            inline_max=self.payload_inline_max,
            ref=result_key(self.store.shards, race_id, holder),
        )
        self.effects.won(race_id, result, caller)
        return False


def apply_cleanup(
    race: Race,
    receipts: dict[str, CancelReceipt | str],
    now_ms: float,
    handles: dict[str, dict[str, Any]] | None = None,
) -> None:
    """End a dead race in its engine state: attach the janitor's receipts, mark it finished.

    Pure: ``receipts`` maps attempt id to the provider's cancel receipt (or an error text);
    ``handles`` are the registered job handles (an attempt whose worker died before reporting
    its job gets it, so the receipt shows what was submitted and cancelled).
    A launched attempt that never got a job is ended as never submitted (a redelivered submit
    then sees a finished race and submits nothing).
    """
    rel = now_ms / 1000.0 - (race.started_at or 0.0)
    for a in race.attempts:
        found = receipts.get(a.id)
        if a.handle is None and (handles or {}).get(a.id):
            a.handle = dict((handles or {})[a.id])
            a.job_id = a.job_id or str(a.handle.get("job_id") or "")
        if isinstance(found, CancelReceipt) and unverified_end(a) and a.receipt is not None:
            # priced as the delivery left it (core/outcome.py): a confirmed stop only clears it
            if found.confirmed_terminal and found.terminal_status is not None:
                a.receipt.confirm_terminal(found.terminal_status, found.terminal_ms or now_ms)
                a.timeline.append([rel, "cancelled by the janitor"])
            else:
                a.timeline.append([rel, "janitor cancel not confirmed"])
        elif isinstance(found, CancelReceipt) and a.phase is Phase.ENDED:
            # capped (TIMEOUT): it already lost; keep its result, record the stop beside it
            a.receipt = a.receipt or found
            a.timeline.append([rel, "janitor cancel after its cap"])
        elif isinstance(found, CancelReceipt):
            if a.receipt is not None:
                found.cancel_sent_ms = a.receipt.cancel_sent_ms or found.cancel_sent_ms
                # the first acknowledgement is kept; the end the janitor saw bounds the price
                found.cancel_ack_ms = a.receipt.cancel_ack_ms or found.cancel_ack_ms
            a.receipt = found
            a.job_id = a.job_id or found.job_id
            a.cancel_requested = True
            a.cancel_reason = a.cancel_reason or "abandoned"
            if found.confirmed_terminal:
                a.phase = Phase.CANCELLED
                a.last_state = found.terminal_status.value if found.terminal_status else None
                a.timeline.append([rel, "cancelled by the janitor"])
            else:
                a.phase = Phase.LEAKED
                a.timeline.append([rel, "janitor cancel not confirmed"])
        elif found == UNKNOWN_SUBMIT and a.phase is Phase.LAUNCHING:
            a.phase = Phase.ENDED
            a.cancel_requested = True
            a.reasons = [UNKNOWN_SUBMIT]
            a.receipt = unknown_submit_receipt(a)  # leaked: a job may run that nobody can stop
            a.timeline.append([rel, "abandoned mid-submit"])
        elif isinstance(found, str) and a.live:  # an attempt that ended meanwhile stays ended
            if a.receipt is None:
                a.receipt = CancelReceipt(provider=a.provider, job_id=a.job_id)
            a.receipt.leaked = True
            a.receipt.note = f"janitor cancel failed: {found}"
            a.phase = Phase.LEAKED
            a.timeline.append([rel, "janitor cancel failed"])
        elif a.phase is Phase.LAUNCHING:
            a.phase = Phase.ENDED
            a.cancel_requested = True
            a.reasons = ["never submitted: the race was abandoned"]
            a.timeline.append([rel, "abandoned before submit"])
        elif a.id != race.winner and a.receipt is None and a.phase is Phase.ENDED:
            # the receipt the engine gives a loser that ended by itself
            a.receipt = CancelReceipt(provider=a.provider, job_id=a.job_id)
            state = JobState(a.result_state) if a.result_state else JobState.FAILED
            a.receipt.confirm_terminal(state, now_ms)
            a.receipt.was_running = a.submitted_at is not None
            a.receipt.note = f"ended on its own ({state}); no cancel needed"
    if any(a.phase is Phase.LEAKED for a in race.attempts):
        race.flag("leaked")
    if not race.finished:
        race.finished = True
        race.timers.clear()
        race.waiting.clear()
        race.note = ABANDONED_NOTE if race.winner is None else race.note


def _may_run(race: Race, attempt_id: str) -> bool:
    """Whether a registered job may still be running at its provider (so it needs a cancel).

    Live attempts may; so may an attempt the race ended at its cap (TIMEOUT is our deadline,
    not the provider's), one a delivery nothing verified ended while its cancel was unconfirmed
    (:func:`~gpuhedge_celery.core.race.may_run`) and a job the race never heard of (registered,
    then its worker died).
    """
    a = next((a for a in race.attempts if a.id == attempt_id), None)
    return a is None or may_run(a)
