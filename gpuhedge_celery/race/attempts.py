"""The race driver's :class:`Submitter`: an attempt's job submitted once, registered, reported,
and handed to the watch (:mod:`.watch`). It reports what it saw to the race through the
driver's step and never decides anything itself (the engine does).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ..core.attempts import Attempt, Phase
from ..core.jobs import JobHandle
from ..core.race import Race
from ..core.race_events import AttemptSubmitted, SubmitFailed
from ..errors import ProviderError
from ..metrics import record as metrics
from ..providers.base import Provider
from ..store.outage import through_outage
from ..store.replicas import NotAcknowledged
from ..store.round_trip import RoundTrip
from ..webhooks.token import context as webhook_context
from .backstops import BackstopDrop, launch_backstop_id
from .base import JobRef, due_ms, find_attempt
from .watch import MIN_WATCH_GAP_S, FirstWatch

log = logging.getLogger(__name__)


def _launching(state: dict[str, Any], attempt_id: str) -> bool:
    """Whether a stored race state has ``attempt_id`` launched and not yet submitted."""
    attempts = state["race"].get("attempts") or []
    return any(a["id"] == attempt_id and a["phase"] == Phase.LAUNCHING.value for a in attempts)


@dataclass
class ClaimedSubmit:
    """A submit claim that rode in the round trip of the create that made the race: the
    intent recorded, the request to submit, and the budget's reservation (its reply read)."""

    intent: dict[str, Any]
    request: dict[str, Any]
    budget: Any = None  # the PendingReservation that rode with it, or None (budgets off)


class FirstSubmit:
    """The submit claim of the attempt a create submits itself, riding in the create's round
    trip: its intent and the budget's reservation, each made only if the create wins (a
    redelivered create that conflicts claims and reserves nothing). The submit that follows
    then needs no round trip before the provider's."""

    def __init__(self, store: RaceStore, claim: ClaimedSubmit, attempt_id: str, mark: Any) -> None:
        self.store, self.claim, self.attempt_id, self.mark = store, claim, attempt_id, mark
        self._ours = False

    def ride(self, trip: RoundTrip, race_id: str) -> None:
        """Ride in the create's round trip (first among its extra commands)."""
        store, claim = self.store, self.claim
        data: list[str] = []

        def queue(pipe: Any) -> None:
            data[:] = [
                store.queue_submit_intent(pipe, race_id, self.attempt_id, claim.intent, self.mark)
            ]

        def take(replies: list[Any]) -> None:
            self._ours = store.submit_intent_ours(replies[0], data[0])

        trip.ride(queue, [store.submit_intent_script], take)
        if claim.budget is not None:
            claim.budget.ride(trip, self.mark)

    @property
    def ours(self) -> ClaimedSubmit | None:
        """The claim, if the create won and recorded it as this process's."""
        return self.claim if self._ours else None


@dataclass(frozen=True)
class SubmitHow:
    """How :meth:`Submitter.submit` was asked for.

    ``decided_here``: this process saved the step that launched the attempt (or created the
    race) just now, so its copy of the race serves (no read; a job registered meanwhile is
    found by the submit claim); a copy without the attempt still launching (saved here before
    a resume asked for the launch) is read again from Redis. ``backstop``: the id of this
    launch's backstop timer (an inline launch, see :meth:`Effects.launch`), dropped in the
    round trip that arms the job's first watch poll, or once the attempt ended: until then a
    crash of this process leaves the timer to finish the launch. ``takeover``: called by that
    timer. ``claimed``: the submit claim that rode in the round trip of the create that just
    made the race: the claim is this process's.
    """

    decided_here: bool = False
    backstop: str | None = None
    takeover: bool = False
    claimed: ClaimedSubmit | None = None


UNKNOWN_SUBMIT = "submit outcome unknown: its worker died mid-submit; not submitted again"
NOT_NEEDED = "not submitted: the race no longer needs it"
NO_REQUEST = "not submitted: the race's request is gone (the race expired or finished)"

if TYPE_CHECKING:
    from ..store.races import RaceRecord, RaceStore
    from .base import Driver


class Submitter:
    """Per-attempt submits."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    def submit(self, race_id: str, attempt_id: str, how: SubmitHow | None = None) -> None:
        """Submit a launched attempt's job once, register it, report it, start watching it.

        Idempotent: a redelivered submit whose job was registered before a crash reports that
        job instead of submitting another; a submit after the race stopped needing it is skipped.
        Of two processes submitting the same attempt at once, one submits (an atomic claim of
        the submit intent) and the other leaves it to the first. ``how``: :class:`SubmitHow`.
        """
        how = how or SubmitHow()
        drop = BackstopDrop(self.driver.timers.of(race_id), how.backstop)
        found = self._attempt_to_submit(race_id, attempt_id, how.decided_here, drop)
        if found is None:
            return
        record, race, a, known = found
        if known is None and (race.finished or race.has_winner or a.cancel_requested):
            self._submit_failed(race_id, SubmitFailed(attempt_id, NOT_NEEDED, unsent=True), drop)
            return
        claimed = how.claimed
        # no answer (its round trip after the create was lost, on a cluster): sent again below
        refusal = claimed.budget.result if claimed is not None and claimed.budget else None
        if refusal is not None and not refusal.granted:
            self._refused(race_id, a, refusal, drop)
            return
        if known is None and claimed is None:
            claim = self._claim_submit(race_id, a, record.state, drop)
            if claim is None:  # the budget refused it
                return
            known, claimed = claim
        if known is None:  # the claim is ours (just made, or riding in the create): submit
            claimed = cast(ClaimedSubmit, claimed)
            if not self._reservation_held(race_id, a, claimed, drop):
                return
            handle = self._submit_claimed(race_id, a, record.state, claimed, drop)
            if handle is None:
                return
        elif known.get("submitting"):
            self._submitting_elsewhere(race_id, attempt_id, known, how.takeover, drop)
            return
        else:  # registered before: a redelivery reports that job instead of submitting again
            handle = JobHandle.from_dict(known)
        # Reported together with the job's first status (one save): see watch.
        spec = record.state["spec"]
        cap = float(spec["caps_s"].get(a.provider, 180.0))
        submitted = AttemptSubmitted(attempt_id, handle.job_id, handle.to_dict())
        ref = JobRef(race_id, attempt_id, a.provider, handle.to_dict(), cap)
        self.driver.watcher.watch(ref, first=FirstWatch(spec, drop, submitted))

    def _attempt_to_submit(
        self, race_id: str, attempt_id: str, fresh: bool, drop: BackstopDrop
    ) -> tuple[RaceRecord, Race, Attempt, dict[str, Any] | None] | None:
        """The race's record, the race, the attempt still launching and the job registered for
        it (None if none), for :meth:`submit_attempt`; ``fresh``: this process's saved copy
        serves. None when there is nothing to submit (the backstop is then dropped): the race or
        the attempt is gone, or the attempt was reported submitted already."""
        d = self.driver
        record = d.store.load(race_id, fresh=True) if fresh else None
        jobs: dict[str, dict[str, Any]] = {}
        if record is None or (record.cached and not _launching(record.state, attempt_id)):
            # Not the copy a deciding step just saved (a launch a resume asked for, in a process
            # that last saved the race before this attempt existed): never judge from it.
            record, jobs = d.store.load_with_jobs(race_id)
        if record is None:
            drop.now()
            return None
        race = Race.from_dict(record.state["race"], d.clock)
        a = find_attempt(race, attempt_id)
        if a is None:
            drop.now()
            return None
        if a.phase is not Phase.LAUNCHING:
            # Already reported: a redelivery, whose first run may have died between its step's
            # save and the actions (timers, watch) that step asked for. Re-perform them.
            d.recovery.resume(race_id)
            drop.now()
            return None
        return record, race, a, jobs.get(attempt_id)

    def _claim_submit(
        self, race_id: str, a: Attempt, state: dict[str, Any], drop: BackstopDrop
    ) -> tuple[dict[str, Any] | None, ClaimedSubmit] | None:
        """Claim the attempt's submit: ``(the job found registered or being submitted by
        another process, or None if the claim is ours; the claim)``. None when the budget
        refused the attempt (reported ended)."""
        d = self.driver
        # The intent first: a crash between the provider's reply and the handle's registration
        # must not look like "never submitted" to a redelivery. Its window tells a late-comer
        # whether the submitter may still be at work.
        intent = self._submit_intent()
        # The budget's reservation of the attempt's worst case rides in the same round trip.
        budget = d.budget.reservation(race_id, a, state) if d.budget else None

        def claim() -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
            trip = RoundTrip()
            if budget is not None:
                budget.ride(trip)
            return d.store.claim_submit_with_request(race_id, a.id, intent, trip)

        # A claim whose answer was lost is sent again within the intent's window: the same
        # intent found is ours (store/race_jobs.py), the reservation a repeat. Failing instead
        # would leave an intent the launch backstop must judge "outcome unknown".
        known, request = self._within_window(
            f"race {race_id}: claim the submit of {a.id}", float(intent["until"]), claim
        )
        refusal = budget.result if budget is not None else None
        if known is None and refusal is not None and not refusal.granted:
            self._refused(race_id, a, refusal, drop)
            return None
        return known, ClaimedSubmit(intent, request, budget)

    def _reservation_held(
        self, race_id: str, a: Attempt, claim: ClaimedSubmit, drop: BackstopDrop
    ) -> bool:
        """Whether the job may be submitted on the budget's reservation: replicas hold it, or
        none need to (the store's ``acks``). Not yet held, it is sent again until they do
        (``BudgetStore.acknowledged``); refused then (lost in a failover and no longer
        fitting), the attempt is refused. Never held, our submit intent is taken back
        (nothing was submitted, so the next try claims afresh) and ``NotAcknowledged`` is
        raised: the launch is retried (the launch backstop, a task retry), never made."""
        pending = claim.budget
        if pending is None or pending.held:
            return True
        try:
            found = pending.store.acknowledged(pending)
        except NotAcknowledged:
            self.driver.store.remove_job(race_id, a.id)
            raise
        if not found.granted:
            self._refused(race_id, a, found, drop)
            return False
        return True

    def _submit_claimed(
        self,
        race_id: str,
        a: Attempt,
        state: dict[str, Any],
        claim: ClaimedSubmit,
        drop: BackstopDrop,
    ) -> JobHandle | None:
        """Submit the job of an attempt whose submit claim is this process's, and register
        it; None if it was not submitted (the attempt is then reported ended)."""
        # (a race created before the request had its own key still carries it inline)
        request = claim.request if claim.request is not None else state.get("request")
        if request is None:  # never submit a request we no longer have as something else
            self._submit_failed(race_id, SubmitFailed(a.id, NO_REQUEST, unsent=True), drop)
            return None
        provider = self.driver.providers(a.provider)
        try:
            handle = self._submit(provider, request, race_id, a.id)
        except ProviderError as e:
            unknown = bool(getattr(e, "outcome_unknown", False))  # the job may exist
            self._submit_failed(race_id, SubmitFailed(a.id, str(e), unknown), drop)
            return None
        except Exception as e:  # an adapter bug must end the attempt, not hang the race
            self._submit_failed(race_id, SubmitFailed(a.id, f"{type(e).__name__}: {e}"), drop)
            return None
        self._register_job(race_id, a.id, handle, float(claim.intent["until"]))
        return handle

    def _submitting_elsewhere(
        self,
        race_id: str,
        attempt_id: str,
        known: dict[str, Any],
        takeover: bool,
        drop: BackstopDrop,
    ) -> None:
        """Another process claimed the submit: left to it while its window lasts; past it,
        that submitter died mid-submit and the attempt ends."""
        until = known.get("until")
        if until is not None and self.driver.clock.now() < float(until):
            # It will report the job; should it die, the launch's backstop (or the janitor)
            # finds the intent past its window.
            if takeover:
                self._rearm_launch_backstop(race_id, attempt_id, float(until))
            return
        # The provider may hold a job we have no id for. Never submit blindly again: end the
        # attempt (the policy moves on).
        self._submit_failed(race_id, SubmitFailed(attempt_id, UNKNOWN_SUBMIT), drop)

    def _submit_failed(self, race_id: str, failed: SubmitFailed, drop: BackstopDrop) -> None:
        """Report that the attempt was not submitted (``failed.unknown``: a job may exist;
        ``failed.unsent``: nothing reached the provider), dropping the launch's backstop in the
        same round trip."""
        self.driver.step(race_id, failed, None, drop.ride_ahead())
        drop.now()

    def first_submit(
        self, race_id: str, a: Attempt, state: dict[str, Any], request: dict[str, Any], mark: Any
    ) -> FirstSubmit:
        """The claim of ``a`` (the attempt a create submits itself), to ride in the create
        whose save leaves ``mark``."""
        d = self.driver
        budget = d.budget.reservation(race_id, a, state) if d.budget else None
        claim = ClaimedSubmit(self._submit_intent(), request, budget)
        return FirstSubmit(d.store, claim, a.id, mark)

    def _submit_intent(self) -> dict[str, Any]:
        """A submit intent as claimed now; its window (``until``) is the launch backstop's."""
        now = self.driver.clock.now()
        until = now + self.driver.settings.launch_backstop_s
        return {"submitting": True, "at": now, "until": until}

    def _register_job(self, race_id: str, attempt_id: str, handle: JobHandle, until: float) -> None:
        """Register a job the provider just accepted, before it is reported: a crash now leaves
        the janitor a handle. The job is paid for from here, so a Redis blip must not lose its
        id: the registration (an ``HSET`` of the same handle, harmless to repeat) waits for
        Redis within the submit intent's window (:meth:`_within_window`)."""
        self._within_window(
            f"race {race_id}: register the job of {attempt_id}",
            until,
            lambda: self.driver.store.add_job(race_id, attempt_id, handle.to_dict()),
        )

    def _within_window(self, what: str, until: float, call: Callable[[], Any]) -> Any:
        """``call()``, repeated while Redis is unreachable until a second before ``until`` (the
        submit intent's window). Past it the launch backstop may judge the submit unknown and
        end the attempt, so then the error goes through: a late write would sit under an
        attempt already ended, and the attempt's receipt flags what may run as leaked."""
        limit_s = max(0.0, until - self.driver.clock.now() - 1.0)
        return through_outage(self.driver.store.client, what, call, limit_s=limit_s)

    def _submit(
        self, provider: Provider, request: dict[str, Any], race_id: str, attempt_id: str
    ) -> JobHandle:
        """``provider.submit``, with the attempt's webhook context when webhooks are on and
        the provider takes them (its completion is then pushed to the receiver)."""
        if self.driver.watcher.pushed(provider):
            context = webhook_context(self.driver.webhooks, race_id, attempt_id)
            return provider.submit(request, context=context)  # type: ignore[call-arg]
        return provider.submit(request)

    def _refused(self, race_id: str, a: Attempt, refusal: Any, drop: BackstopDrop) -> None:
        """The budget refused the attempt (``refusal``: the store's Reservation): it is not
        submitted, and ends with the reason."""
        log.warning("race %s: %s not submitted: %s", race_id, a.id, refusal.reason)
        metrics.budget_refused(refusal.cap, a.role)
        self.driver.store.remove_job(race_id, a.id)  # our submit intent: nothing was submitted
        self._submit_failed(race_id, SubmitFailed(a.id, refusal.reason, refused=True), drop)

    def _rearm_launch_backstop(self, race_id: str, attempt_id: str, until: float) -> None:
        """Look at an attempt's launch again when its submitter's window ends."""
        at = until + MIN_WATCH_GAP_S
        payload = {"race": race_id, "kind": "launch", "attempt": attempt_id}
        timer_id = f"{launch_backstop_id(race_id, attempt_id)}|{due_ms(at)}"
        timers = self.driver.timers.of(race_id)
        timers.arm(f"{race_id}:l:{attempt_id}", due_ms(at), payload, timer_id=timer_id)

    def launch_backstop(
        self, race_id: str, attempt_id: str
    ) -> tuple[str, int, dict[str, Any], str]:
        """Key, due time, payload and fixed id of an attempt's launch backstop timer."""
        at = self.driver.clock.now() + self.driver.settings.launch_backstop_s
        payload = {"race": race_id, "kind": "launch", "attempt": attempt_id}
        timer_id = launch_backstop_id(race_id, attempt_id)
        return f"{race_id}:l:{attempt_id}", due_ms(at), payload, timer_id
