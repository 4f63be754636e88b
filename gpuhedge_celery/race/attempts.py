"""Attempt work of the race driver: submit once (and watch, from :mod:`.watch`; cancel
natively, from :mod:`.cancels`; conclude, from :mod:`.conclude`).

Mixed into :class:`~gpuhedge_celery.race.driver.RaceDriver`; every method reports what it saw
to the race through ``step`` and never decides anything itself (the engine does).
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
from ..webhooks.token import context as webhook_context
from .backstops import BackstopDrop, launch_backstop_id
from .base import due_ms, find_attempt
from .cancels import CancelWork
from .watch import MIN_WATCH_GAP_S, WatchWork

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

    def __init__(
        self, store: RaceStore, race_id: str, claim: ClaimedSubmit, attempt_id: str, mark: Any
    ) -> None:
        self.store, self.race_id, self.claim = store, race_id, claim
        self.attempt_id, self.mark = attempt_id, mark
        self._data = ""
        self._ours = False
        reserve = () if claim.budget is None else (claim.budget.store.reserve_script,)
        self.scripts = (store.submit_intent_script, *reserve)

    def queue(self, pipe: Any) -> None:
        self._data = self.store.queue_submit_intent(
            pipe, self.race_id, self.attempt_id, self.claim.intent, self.mark
        )
        if self.claim.budget is not None:
            self.claim.budget.queue_on_save(pipe, self.mark)

    def take(self, replies: list[Any]) -> None:
        """The replies of the create's extra commands (this claim's first), once it won."""
        self._ours = self.store.submit_intent_ours(replies[0], self._data)
        if self.claim.budget is not None:
            self.claim.budget.take(replies[1:])

    @property
    def ours(self) -> ClaimedSubmit | None:
        """The claim, if the create won and recorded it as this process's."""
        return self.claim if self._ours else None


UNKNOWN_SUBMIT = "submit outcome unknown: its worker died mid-submit; not submitted again"
NOT_NEEDED = "not submitted: the race no longer needs it"
NO_REQUEST = "not submitted: the race's request is gone (the race expired or finished)"

if TYPE_CHECKING:
    from ..core.clock import Clock
    from ..store.races import RaceRecord, RaceStore
    from ..store.timers import TimerStore
    from ..webhooks.settings import WebhookSettings
    from .base import Effects
    from .settings import RaceSettings


class AttemptWork(CancelWork, WatchWork):
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
        self,
        race_id: str,
        attempt_id: str,
        *,
        new_race: bool = False,
        backstop: str | None = None,
        takeover: bool = False,
        decided_here: bool = False,
        claimed: ClaimedSubmit | None = None,
    ) -> None:
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
        is read again from Redis. ``claimed``: the submit claim that rode in the round trip of
        the create that just made the race (``new_race``): the claim is this process's.
        """
        drop = BackstopDrop(self.timers, backstop)
        found = self._attempt_to_submit(race_id, attempt_id, new_race or decided_here, drop)
        if found is None:
            return
        record, race, a, known = found
        if known is None and (race.finished or race.has_winner or a.cancel_requested):
            self._submit_failed(race_id, attempt_id, NOT_NEEDED, drop, unsent=True)
            return
        intent, request = (claimed.intent, claimed.request) if claimed else (None, None)
        if claimed is not None and claimed.budget is not None and not claimed.budget.result.granted:
            self._refused(race_id, a, claimed.budget.result, drop)
            return
        if known is None and intent is None:
            claim = self._claim_submit(race_id, a, record.state, drop)
            if claim is None:  # the budget refused it
                return
            known, intent, request = claim
        if known is None:  # the claim is ours (just made, or riding in the create): submit
            claimed_intent = cast("dict[str, Any]", intent)  # recorded with the claim
            handle = self._submit_claimed(race_id, a, record.state, claimed_intent, request, drop)
            if handle is None:
                return
        elif known.get("submitting"):
            self._submitting_elsewhere(race_id, attempt_id, known, takeover, drop)
            return
        else:  # registered before: a redelivery reports that job instead of submitting again
            handle = JobHandle.from_dict(known)
        # Reported together with the job's first status (one save): see watch.
        spec = record.state["spec"]
        cap = float(spec["caps_s"].get(a.provider, 180.0))
        submitted = AttemptSubmitted(attempt_id, handle.job_id, handle.to_dict())
        self.watch(
            race_id, attempt_id, a.provider, handle.to_dict(), None, cap, spec, drop, submitted
        )

    def _attempt_to_submit(
        self, race_id: str, attempt_id: str, fresh: bool, drop: BackstopDrop
    ) -> tuple[RaceRecord, Race, Attempt, dict[str, Any] | None] | None:
        """The race's record, the race, the attempt still launching and the job registered for
        it (None if none), for :meth:`submit_attempt`; ``fresh``: this process's saved copy
        serves. None when there is nothing to submit (the backstop is then dropped): the race or
        the attempt is gone, or the attempt was reported submitted already."""
        record = self.store.load(race_id, fresh=True) if fresh else None
        jobs: dict[str, dict[str, Any]] = {}
        if record is None or (record.cached and not _launching(record.state, attempt_id)):
            # Not the copy a deciding step just saved (a launch a resume asked for, in a process
            # that last saved the race before this attempt existed): never judge from it.
            record, jobs = self.store.load_with_jobs(race_id)
        if record is None:
            drop.now()
            return None
        race = Race.from_dict(record.state["race"], self.clock)
        a = find_attempt(race, attempt_id)
        if a is None:
            drop.now()
            return None
        if a.phase is not Phase.LAUNCHING:
            # Already reported: a redelivery, whose first run may have died between its step's
            # save and the actions (timers, watch) that step asked for. Re-perform them.
            self.resume(race_id)
            drop.now()
            return None
        return record, race, a, jobs.get(attempt_id)

    def _claim_submit(
        self, race_id: str, a: Attempt, state: dict[str, Any], drop: BackstopDrop
    ) -> tuple[dict[str, Any] | None, dict[str, Any], dict[str, Any] | None] | None:
        """Claim the attempt's submit: ``(the job found registered or being submitted by
        another process, or None if the claim is ours; the intent; the request to submit)``.
        None when the budget refused the attempt (reported ended)."""
        # The intent first: a crash between the provider's reply and the handle's registration
        # must not look like "never submitted" to a redelivery. Its window tells a late-comer
        # whether the submitter may still be at work.
        intent = self._submit_intent()
        # The budget's reservation of the attempt's worst case rides in the same round trip.
        budget = self.budget.reservation(race_id, a, state) if self.budget else None
        # A claim whose answer was lost is sent again within the intent's window: the same
        # intent found is ours (store/race_jobs.py), the reservation a repeat. Failing instead
        # would leave an intent the launch backstop must judge "outcome unknown".
        known, request = self._within_window(
            f"race {race_id}: claim the submit of {a.id}",
            float(intent["until"]),
            lambda: self.store.claim_submit_with_request(race_id, a.id, intent, also=budget),
        )
        if known is None and budget is not None and not budget.result.granted:
            self._refused(race_id, a, budget.result, drop)
            return None
        return known, intent, request

    def _submit_claimed(
        self,
        race_id: str,
        a: Attempt,
        state: dict[str, Any],
        intent: dict[str, Any],
        request: dict[str, Any] | None,
        drop: BackstopDrop,
    ) -> JobHandle | None:
        """Submit the job of an attempt whose submit claim is this process's, and register
        it; None if it was not submitted (the attempt is then reported ended)."""
        # (a race created before the request had its own key still carries it inline)
        request = request if request is not None else state.get("request")
        if request is None:  # never submit a request we no longer have as something else
            self._submit_failed(race_id, a.id, NO_REQUEST, drop, unsent=True)
            return None
        provider = self.providers(a.provider)
        try:
            handle = self._submit(provider, request, race_id, a.id)
        except ProviderError as e:
            unknown = bool(getattr(e, "outcome_unknown", False))  # the job may exist
            self._submit_failed(race_id, a.id, str(e), drop, unknown=unknown)
            return None
        except Exception as e:  # an adapter bug must end the attempt, not hang the race
            self._submit_failed(race_id, a.id, f"{type(e).__name__}: {e}", drop)
            return None
        self._register_job(race_id, a.id, handle, float(intent["until"]))
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
        if until is not None and self.clock.now() < float(until):
            # It will report the job; should it die, the launch's backstop (or the janitor)
            # finds the intent past its window.
            if takeover:
                self._rearm_launch_backstop(race_id, attempt_id, float(until))
            return
        # The provider may hold a job we have no id for. Never submit blindly again: end the
        # attempt (the policy moves on).
        self._submit_failed(race_id, attempt_id, UNKNOWN_SUBMIT, drop)

    def _submit_failed(
        self,
        race_id: str,
        attempt_id: str,
        reason: str,
        drop: BackstopDrop,
        unknown: bool = False,
        unsent: bool = False,
    ) -> None:
        """Report that the attempt was not submitted (``unknown``: a job may exist; ``unsent``:
        nothing reached the provider), dropping the launch's backstop in the same round trip."""
        failed = SubmitFailed(attempt_id, reason, unknown, unsent=unsent)
        self.step(race_id, failed, None, drop.queue)
        drop.now()

    def _first_submit(
        self,
        race_id: str,
        race: Race,
        state: dict[str, Any],
        request: dict[str, Any],
        first: Any,
        save_id: str,
    ) -> FirstSubmit | None:
        """The claim of ``first`` (the Launch a create submits itself), to ride in the create
        saved with ``save_id``; None without one."""
        a = find_attempt(race, first.attempt_id) if first is not None else None
        if a is None:
            return None
        budget = self.budget.reservation(race_id, a, state) if self.budget else None
        mark = self.store.save_mark(race_id, 0, save_id)
        claim = ClaimedSubmit(self._submit_intent(), request, budget)
        return FirstSubmit(self.store, race_id, claim, a.id, mark)

    def _submit_intent(self) -> dict[str, Any]:
        """A submit intent as claimed now; its window (``until``) is the launch backstop's."""
        now = self.clock.now()
        return {"submitting": True, "at": now, "until": now + self.settings.launch_backstop_s}

    def _register_job(self, race_id: str, attempt_id: str, handle: JobHandle, until: float) -> None:
        """Register a job the provider just accepted, before it is reported: a crash now leaves
        the janitor a handle. The job is paid for from here, so a Redis blip must not lose its
        id: the registration (an ``HSET`` of the same handle, harmless to repeat) waits for
        Redis within the submit intent's window (:meth:`_within_window`)."""
        self._within_window(
            f"race {race_id}: register the job of {attempt_id}",
            until,
            lambda: self.store.add_job(race_id, attempt_id, handle.to_dict()),
        )

    def _within_window(self, what: str, until: float, call: Callable[[], Any]) -> Any:
        """``call()``, repeated while Redis is unreachable until a second before ``until`` (the
        submit intent's window). Past it the launch backstop may judge the submit unknown and
        end the attempt, so then the error goes through: a late write would sit under an
        attempt already ended, and the attempt's receipt flags what may run as leaked."""
        limit_s = max(0.0, until - self.clock.now() - 1.0)
        return through_outage(self.store.client, what, call, limit_s=limit_s)

    def _submit(
        self, provider: Provider, request: dict[str, Any], race_id: str, attempt_id: str
    ) -> JobHandle:
        """``provider.submit``, with the attempt's webhook context when webhooks are on and
        the provider takes them (its completion is then pushed to the receiver)."""
        if self._pushed(provider):
            context = webhook_context(self.webhooks, race_id, attempt_id)
            return provider.submit(request, context=context)  # type: ignore[call-arg]
        return provider.submit(request)

    def _refused(self, race_id: str, a: Attempt, refusal: Any, drop: BackstopDrop) -> None:
        """The budget refused the attempt (``refusal``: the store's Reservation): it is not
        submitted, and ends with the reason."""
        log.warning("race %s: %s not submitted: %s", race_id, a.id, refusal.reason)
        metrics.budget_refused(refusal.cap, a.role)
        self.store.remove_job(race_id, a.id)  # our submit intent: nothing was submitted
        self.step(race_id, SubmitFailed(a.id, refusal.reason, refused=True), None, drop.queue)
        drop.now()

    def _reported(
        self,
        race_id: str,
        attempt_id: str,
        saved: Race | None,
        handle: JobHandle,
        provider: Provider,
    ) -> bool:
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
