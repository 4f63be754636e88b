"""How a race ends, for the race driver: the winner declared to its caller, the caller failed
at the deadline, the final receipt written (and rewritten after a late cap cancel), and the
lifecycle events that mark each moment for the metrics and Flower.

The driver's step calls these once the save of the step that decided them has won; the winner
claim and the finish ride in that save (:meth:`Outcome.ride_claim`, :meth:`Outcome.ride_finish`).
With replicas to wait for (the store's ``acks``), the caller's result is published only once
they hold the claim (:meth:`Outcome.declare`), and a failure only once they hold the save that
failed the race; a durable *tell* timer, armed ahead of that save, tells the caller again
until they do, and fails the caller explicitly once the race's deadline has passed
(:meth:`Outcome.retell`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..core.attempts import Phase
from ..core.jobs import JobState
from ..core.race import Race, may_run
from ..core.race_events import DeclareWinner, GiveUp, RaceFinished, StatusObserved
from ..metrics import record as metrics
from ..store.race_keys import TOLD_FAILED, TOLD_WON, ResultWrite, SaveMark
from ..store.race_receipts import Finish
from ..store.races import RaceStore, WinnerClaim
from ..store.replicas import NotAcknowledged, ReplicaAcks
from ..store.round_trip import RoundTrip
from .adaptive import share_observation
from .base import Step, due_ms, find_attempt
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

# With replicas to wait for (the store's ``acks``): the tell timer, armed ahead of the save of a
# step that decides the race's outcome, tells the caller again should that step not.
TELL = "tell"  # its timer kind
TELL_AFTER_S = 5.0  # its first firing after the deciding save; each later try waits twice as
TELL_MAX_S = 30.0  # long, up to this
TELL_GRACE_S = 5.0  # a failure the replicas do not hold is told anyway this long past the deadline
UNHELD = "winner_unheld"  # the state's note of a winner whose caller was failed instead
UNACKNOWLEDGED = "unacknowledged"  # that failure's reason (the receipt's failure_reason)
TELL_ONCE = "tell_once"  # in the caller's dict: effects tell nobody twice (read first)
# without a deadline, a winner the replicas never hold is failed after this many tells again
TELL_MAX_TRIES = 20


def tell_timer_id(race_id: str, n: int) -> str:
    """The fixed id of a race's ``n``-th tell timer (0: the one its deciding save arms)."""
    return f"{race_id}|{TELL}|{n}"


def race_deadline(race: Race) -> float | None:
    """When the race's deadline passes (epoch s on its clock); None without one."""
    if race.deadline_s is None or race.started_at is None:
        return None
    return race.started_at + race.deadline_s


def unheld_message(race_id: str, winner: str, acks: ReplicaAcks) -> str:
    """What a caller failed because its winner was never held by the replicas is told."""
    return (
        f"race {race_id}: its winner {winner} was not acknowledged by {acks.replicas} Redis "
        f"replica(s) before the race's deadline; failed rather than risk a second result "
        f"after a failover"
    )


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
            self.acked = replies[-1]

    @property
    def held(self) -> bool:
        return self.acks is None or self.acks.held(self.acked)


class RiddenTell:
    """What a step that decides its race's outcome carries in its save when replicas must
    acknowledge it: the tell timer (armed ahead of the save) and, for a step that fails the
    race, a ``WAIT`` after everything (its reply ``acked``; ``saved``: the save's mark, to
    wait again). Once a failure was held (or found not held), it is not asked again."""

    def __init__(self, timer_id: str, saved: SaveMark, acks: ReplicaAcks) -> None:
        self.timer_id = timer_id
        self.saved = saved
        self.acks = acks
        self.acked: Any = None
        self.confirmed = False
        self.error: NotAcknowledged | None = None

    def take(self, replies: list[Any]) -> None:
        self.acked = replies[-1]

    @property
    def held(self) -> bool:
        return self.confirmed or (self.acked is not None and self.acks.held(self.acked))


def tells(step: Step) -> bool:
    """Whether the step tells the race's caller its outcome: declares its winner, gives up, or
    finishes it without a winner."""
    if step.wants(DeclareWinner):
        return step.race.winner is not None
    return step.wants(GiveUp) or (step.wants(RaceFinished) and step.race.winner is None)


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

    def ride_tell(self, trip: RoundTrip, step: Step, saved: SaveMark) -> RiddenTell | None:
        """With replicas to wait for, a step that tells its caller the outcome (:func:`tells`)
        arms the race's tell timer ahead of its save (a replica that holds the save holds the
        timer too) and, when it fails the race, rides a ``WAIT`` after everything else (to
        ride last): the failure is told only once they hold the save. None otherwise."""
        store = self.driver.store
        if not store.acks.on or not tells(step):
            return None
        race_id = step.race_id
        timers = self.driver.timers.of(race_id)  # the race's shard: one slot with its save
        riding = RiddenTell(tell_timer_id(race_id, 0), saved, store.acks)
        key, due, payload = self._tell_timer(race_id, 0, self._first_tell_at())
        trip.ahead(
            lambda pipe: timers.queue_arm(pipe, key, due, payload, riding.timer_id),
            [timers.arm_script],
        )
        if not step.wants(DeclareWinner):  # the claim's own WAIT covers a winner
            trip.ride(store.queue_wait, (), riding.take)
        return riding

    def _first_tell_at(self) -> float:
        acks = self.driver.store.acks
        # well after the deciding step's own tries are over
        wait_s = acks.tries * acks.timeout_ms / 1000.0 + acks.backoff_s * 2**acks.tries
        return self.driver.clock.now() + max(TELL_AFTER_S, 2 * wait_s)

    @staticmethod
    def _tell_timer(race_id: str, n: int, at: float) -> tuple[str, int, dict[str, Any]]:
        payload = {"race": race_id, "kind": TELL, "try": n}
        return f"{race_id}:{TELL}", due_ms(at), payload

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
            ref=result_key(self.driver.store.shards, race_id, attempt_id),
        )

    def declare(
        self, race_id: str, race: Race, state: dict[str, Any], riding: RiddenClaim | None = None
    ) -> dict[str, Any] | None:
        """Claim the winner (unless ``riding``: the claim made in the step's save) and hand
        the caller its result; returns that result (None when another attempt holds the
        claim). With replicas to wait for, only once they hold the claim: a claim they do not
        acknowledge raises the store's outage error (``NotAcknowledged``) before anything is
        published, and the step's retry (a redelivered timer, a task retry) or the race's
        tell timer declares again; nothing is published for a winner whose caller was failed
        at the deadline instead (:meth:`retell`)."""
        won = race.winner_attempt
        assert won is not None
        acks_on = self.driver.store.acks.on
        if state.get(UNHELD):  # (only ever noted with replicas to wait for)
            log.warning("race %s: %s won, but its caller was failed instead", race_id, won.id)
            return None
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
                    self.driver.store.client, self.driver.store.shards, race_id, won.id
                )
            result = self._winner_result(race_id, race, won.id, stored or {})
        caller = state.get("caller") or {}
        if acks_on:  # told once, whatever it was told before (the effects read first)
            if not self.decide_told(race_id, TOLD_WON):
                log.warning("race %s: %s won, but its caller was failed instead", race_id, won.id)
                return None
            caller = {**caller, TELL_ONCE: True}
        elif claim.first:
            caller = {**caller, "first_claim": True}  # Celery effects skip a "done?" read
            if riding is not None and riding.result is not None:
                # The claim that made the winner wrote the caller's result in its script (or
                # this save's first send did, its answer lost: the claim says first again).
                caller["result_stored"] = True
        self.event(race_id, "won", race, won.id)  # before task-succeeded, which ends it in Flower
        self.driver.effects.won(race_id, result, caller)
        return result

    def decide_told(self, race_id: str, outcome: str) -> bool:
        """With replicas to wait for: whether the caller may be told ``outcome``, decided in
        the store atomically and once (a winner and a failure racing each other: the first to
        decide is told, the other nothing). A race whose state is gone is told as before."""
        told = self.driver.store.tell_once(race_id, outcome)
        return told is None or told == outcome

    def give_up(
        self, race_id: str, race: Race, state: dict[str, Any], told: RiddenTell | None = None
    ) -> None:
        """The deadline passed without a winner: the caller's ``.get()`` raises RaceFailed now,
        with the receipt as it stands (its jobs are still being cancelled; the final receipt
        follows in Redis when they are settled). With replicas to wait for, only once they
        hold the save that gave up (``told``: what rode in it), else ``NotAcknowledged``."""
        log.warning("race %s: %s; failing the caller and cancelling its jobs", race_id, race.note)
        self._failed(race_id, race, state, None, told)

    def _failed(
        self,
        race_id: str,
        race: Race,
        state: dict[str, Any],
        receipt: dict[str, Any] | None,
        told: RiddenTell | None,
    ) -> None:
        """Tell the caller the race failed (``receipt``: the final one, else assembled now);
        with replicas to wait for, only once they hold the save that failed it."""
        if self.driver.store.acks.on:
            self._hold(race_id, told)
        self._tell_failed(race_id, race, state, receipt)

    def _tell_failed(
        self, race_id: str, race: Race, state: dict[str, Any], receipt: dict[str, Any] | None
    ) -> None:
        d = self.driver
        caller = state.get("caller") or {}
        if d.store.acks.on:  # told once, whatever it was told before (the effects read first)
            caller = {**caller, TELL_ONCE: True}
        if receipt is None:
            receipt = assemble_receipt(race, state, spec_from_state(state), now=d.clock.now())
        d.effects.failed(race_id, f"race {race_id}: {race.note}", receipt, caller)

    def _hold(self, race_id: str, told: RiddenTell | None) -> None:
        """Return once the replicas hold the race's failing save (its ``WAIT`` rode in it
        with ``told``; without, the state as it is now); ``NotAcknowledged`` otherwise."""
        if told is not None:
            if told.error is not None:  # a step that gives up and finishes: asked once
                raise told.error
            if told.held:
                return
        store = self.driver.store
        try:
            if told is None:
                store.hold_save(race_id)
            else:
                store.hold_save(race_id, told.saved, short=told.acked)
        except NotAcknowledged as e:
            if told is not None:
                told.error = e
            raise
        if told is not None:
            told.confirmed = True

    def _finish_parts(self, race: Race, state: dict[str, Any]) -> Finish:
        """The finished race's receipt, the attempts whose jobs leave the live-job index with
        it, and its record."""
        spec = spec_from_state(state)
        receipt = assemble_receipt(race, state, spec, now=self.driver.clock.now())
        # a capped job, or one a delivery nothing verified ended, stays registered until a
        # cancel confirms it stopped
        ended = tuple(a.id for a in race.attempts if not may_run(a))
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
        told: RiddenTell | None = None,
    ) -> None:
        """The race's end: its receipt and record stored (unless ``stored``, the receipt its
        step's save stored already), its metrics, and a failed caller told (with replicas to
        wait for, once they hold the save: see :meth:`give_up`)."""
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
            self._failed(race_id, race, state, receipt, told)

    # ------------------------------------------------------------------ telling again
    def retell(self, race_id: str, n: int | None = None) -> None:
        """Tell the race's caller its outcome again, with replicas to wait for: its winner
        (claimed again, published once they hold it: :meth:`declare`) or its failure (once
        they hold the save that failed it). Idempotent: the effects tell nobody twice.

        ``n``: the try of the race's tell timer that calls this (None: a webhook delivery,
        which the store's ``NotAcknowledged`` answers). A timer's try the replicas do not
        acknowledge arms the next, later, up to the race's deadline (without one, up to
        :data:`TELL_MAX_TRIES` tries): a winner they never held by then becomes an explicit
        failure of the caller (and is never published after it); a failure is told all the
        same :data:`TELL_GRACE_S` past the deadline.
        """
        d = self.driver
        record = d.store.load(race_id)
        if record is None:
            return  # expired (or never saved: the step that armed the timer lost its save)
        state = record.state
        race = Race.from_dict(state["race"], d.clock)
        failed = race.winner is None and (race.gave_up or race.finished)
        if race.winner is None and not failed:
            return  # nothing decided: the save that armed the timer lost its version check
        try:
            if failed:
                self._failed(race_id, race, state, d.store.receipt(race_id), None)
                return
            result = self.declare(race_id, race, state)
            metrics.race_won(race, result)
            if result is not None or not d.store.acks.on or d.store.told(race_id) != TOLD_FAILED:
                return
            # a failure was decided for its caller: finish telling it (it may have stopped
            # between the decision and the telling; the effects tell nobody twice)
        except NotAcknowledged:
            if n is None:
                raise
        else:
            self._fail_unheld(race_id, race)
            return
        deadline = race_deadline(race)
        until = deadline if deadline is None or not failed else deadline + TELL_GRACE_S
        now = d.clock.now()
        if until is None and n is not None and n + 1 >= TELL_MAX_TRIES:
            until = now  # no deadline: bounded all the same, then an explicit failure
        if until is None or now < until:
            at = now + min(TELL_MAX_S, TELL_AFTER_S * 2**n)
            if until is not None:
                at = min(at, until)  # one more try at the deadline
            key, due, payload = self._tell_timer(race_id, n + 1, at)
            d.timers.of(race_id).arm(key, due, payload, timer_id=tell_timer_id(race_id, n + 1))
            log.warning("race %s: its outcome is told again at %d ms", race_id, due)
        elif failed:
            log.error(
                "race %s: the replicas never held its failure; the caller is told all the same",
                race_id,
            )
            self._tell_failed(race_id, race, state, d.store.receipt(race_id))
        else:
            self._fail_unheld(race_id, race)

    def _fail_unheld(self, race_id: str, race: Race) -> None:
        """The race's deadline passed (or, without one, its tells ran out) and the replicas
        never held its winner's claim: the failure decided in the store (a winner told
        meanwhile wins: nothing more), noted in its state (for its receipt), then its caller
        is failed explicitly (``failure_reason`` :data:`UNACKNOWLEDGED`)."""
        d = self.driver
        winner = race.winner or ""
        now = d.clock.now()
        if not self.decide_told(race_id, TOLD_FAILED):
            log.warning("race %s: its winner %s was told meanwhile; not failed", race_id, winner)
            return

        def note(state: dict[str, Any]) -> dict[str, Any]:
            return {**state, UNHELD: state.get(UNHELD) or {"winner": winner, "at": now}}

        record = d.store.update(race_id, note)
        state = record.state
        message = unheld_message(race_id, winner, d.store.acks)
        log.error("%s", message)
        receipt = assemble_receipt(race, state, spec_from_state(state), now=now)
        receipt["failure_reason"] = UNACKNOWLEDGED
        caller = {**(state.get("caller") or {}), TELL_ONCE: True}
        d.effects.failed(race_id, message, receipt, caller)

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
