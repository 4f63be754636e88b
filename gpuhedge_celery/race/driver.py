"""The race driver: performs the engine's actions against providers, the race store and timers.

A race is state in Redis, never a process. Whoever learns something about it (the task that
started it, an attempt's submit, a timer that came due, a watch poll) calls
:meth:`RaceDriver.step`, which reads top-down:

1. **load** the state and its version (this process's last saved copy when it has one);
2. **engine**: apply the event to the race (:class:`~gpuhedge_celery.core.race.Race`);
3. **plan** the step (:class:`~.step.Step`): the state to save, and what rides in its save
   (timer arms, the winner claim, budget settlements, the finish);
4. **one round trip**: the save, with a version check (reload and re-apply on a conflict:
   events are idempotent), and its riders (:class:`~gpuhedge_celery.store.round_trip.RoundTrip`);
5. **perform** the actions the engine returned, once the save has won.

The work itself is done by collaborators the driver owns and hands itself to: the
:class:`~.attempts.Submitter`, the :class:`~.watch.Watcher`, the :class:`~.conclude.Concluder`,
the :class:`~.cancels.Canceller`, the :class:`~.outcome.Outcome` and the
:class:`~.recovery.Recovery`. Work that may block on a provider (submit, cancel) is handed to
:class:`~.base.Effects` (Celery in production), so the driver runs the same under a Celery
worker, a test or a benchmark.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .. import settings as process_settings
from ..core.jobs import AttemptResult
from ..core.race import Race, late_result
from ..core.race_events import (
    Cancel,
    DeclareWinner,
    Event,
    GiveUp,
    Launch,
    PollStatus,
    RaceFinished,
    ScheduleTimer,
)
from ..errors import StoreError
from ..metrics import record as metrics
from ..store.races import RaceRecord, VersionConflict
from ..store.replicas import NotAcknowledged
from ..store.round_trip import RoundTrip
from ..store.timers import Timer
from .attempts import SubmitHow, Submitter
from .base import JobRef, RaceParts, Step, due_ms, find_attempt
from .cancels import Canceller
from .conclude import Concluder
from .outcome import Outcome
from .recovery import Recovery
from .spec import RaceSpec
from .watch import Watcher

log = logging.getLogger(__name__)

# One event, several applied in order in one step (one save), or a function of the race.
Events = Event | tuple[Event, ...]
EventSource = Events | Callable[[Race], Events | None]
StateUpdate = Callable[[dict[str, Any]], None]
MAX_CONFLICTS = 50


class RaceDriver:
    """Advances races stored in Redis; one per process, shared by every thread."""

    def __init__(self, parts: RaceParts) -> None:
        self.store = parts.store
        self.timers = parts.timers  # a race's timers: self.timers.of(race_id)
        if parts.store.shards.tags != parts.timers.shards.tags:  # a race's timers share its slot
            raise ValueError(
                f"race store shards {parts.store.shards.tags} differ from the timers' "
                f"{parts.timers.shards.tags}"
            )
        self.providers = parts.providers
        self.effects = parts.effects
        self.settings = parts.settings
        self.clock = parts.clock
        # webhooks on (GPUHEDGE_WEBHOOK_URL and _SECRET): completions are pushed, polls a net
        self.webhooks = parts.webhooks or process_settings.current().webhooks
        # reserves before each submit and settles each ended attempt (race/budget.py)
        budget = parts.budget
        self.budget = budget if budget is not None and budget.enabled else None
        self.adaptive = parts.adaptive  # finished races of adaptive policies share what they saw
        self.submitter = Submitter(self)
        self.watcher = Watcher(self)
        self.concluder = Concluder(self)
        self.canceller = Canceller(self)
        self.outcome = Outcome(self)
        self.recovery = Recovery(self)

    @property
    def prefix(self) -> str:
        return self.store.prefix

    # ------------------------------------------------------------------ the entry points
    def submit_attempt(self, race_id: str, attempt_id: str, how: SubmitHow | None = None) -> None:
        """Submit a launched attempt's job once (:meth:`.attempts.Submitter.submit`)."""
        self.submitter.submit(race_id, attempt_id, how)

    def cancel_attempt(self, race_id: str, attempt_id: str) -> None:
        """Cancel an attempt's job natively (:meth:`.cancels.Canceller.cancel_attempt`)."""
        self.canceller.cancel_attempt(race_id, attempt_id)

    def watch(self, ref: JobRef, last: str | None = None) -> None:
        """Poll a job once (:meth:`.watch.Watcher.watch`)."""
        self.watcher.watch(ref, last)

    def conclude(
        self, ref: JobRef, spec: dict[str, Any] | None = None, result: AttemptResult | None = None
    ) -> None:
        """Report a terminal job's result (:meth:`.conclude.Concluder.conclude`)."""
        self.concluder.conclude(ref, spec, result)

    def on_timer(self, timer: Timer) -> None:
        """The timer service's handler (:meth:`.recovery.Recovery.on_timer`)."""
        self.recovery.on_timer(timer)

    def resume(self, race_id: str) -> None:
        """Re-perform what a crashed step left undone (:meth:`.recovery.Recovery.resume`)."""
        self.recovery.resume(race_id)

    # ------------------------------------------------------------------ starting
    def create(
        self,
        race_id: str,
        request: dict[str, Any],
        spec: RaceSpec,
        caller: dict[str, Any] | None = None,
        *,
        submit_first: bool = False,
    ) -> bool:
        """Create and start a race; False (and a resume) if it already exists (a redelivery).

        ``caller`` (JSON) is handed back to the effects with the result: who to notify. With
        ``submit_first`` the first launched attempt is submitted here, in the caller's thread,
        instead of through :meth:`Effects.launch` (one task hop less before the primary runs).
        """
        race = Race(spec.policy, self.clock, race_id=race_id, deadline_s=spec.deadline_s)
        actions = race.start()
        state = {
            "race": race.to_dict(),
            "spec": spec.to_dict(),
            "created_at": race.started_at,
            "timer_ids": {},
            "results": {},
            "caller": caller or {},
        }
        step = Step(race_id, race, state, 0, actions, {}, [], ())
        self.note_timers(step)
        first = next((a for a in actions if isinstance(a, Launch)), None) if submit_first else None
        step.actions = [a for a in actions if a is not first]
        trip = RoundTrip()
        # The first submit's claim rides first, made only if the create wins (FirstSubmit).
        ride = None
        attempt = find_attempt(race, first.attempt_id) if first is not None else None
        if attempt is not None:
            mark = self.store.save_mark(race_id, 0, step.save_id)
            ride = self.submitter.first_submit(race_id, attempt, state, request, mark)
            ride.ride(trip, race_id)
        # The first timers ride too. Not a launch backstop for the attempt submitted inline
        # below: a crash here is covered by the redelivered create, whose resume launches it
        # behind a backstop, and once due that timer would take over the attempt's later work.
        self._ride_arms(trip, step)
        if spec.deadline_s is not None:  # for waiting callers
            deadline = (race.started_at or 0.0) + spec.deadline_s
            trip.ride(lambda pipe: self.store.queue_deadline(pipe, race_id, deadline))
        try:
            # the request has its own key, written once (each step rewrites the state)
            self.store.create(race_id, state, request, trip, step.save_id)
        except VersionConflict:
            self.resume(race_id)
            return False
        metrics.race_started(race)
        self.perform(step)
        if first is not None:
            claimed = ride.ours if ride is not None else None
            self.submitter.submit(race_id, first.attempt_id, SubmitHow(True, claimed=claimed))
        return True

    # ------------------------------------------------------------------ the step
    def step(
        self,
        race_id: str,
        event: EventSource,
        update: StateUpdate | None = None,
        trip: RoundTrip | None = None,
        answered: VersionConflict | None = None,
    ) -> Race | None:
        """Apply ``event`` (or ``event(race)``) and perform its actions; follow-ups included.

        ``update(state)``: a change to the saved state beside the race's. ``trip``: commands
        the caller sends ahead of the save in its round trip (:meth:`RoundTrip.ahead`); a step
        that saves nothing does not send them. ``answered``: a refused save of this race
        elsewhere, whose state (if it carries one) the step starts from instead of reading it.
        Returns the race as saved by the last step (None for an unknown race).
        """
        race, follow = self._step_once(race_id, event, update, trip, answered)
        pending = list(follow)
        while pending:
            race, more = self._step_once(race_id, pending.pop(0), None, None, None)
            pending.extend(more)
        return race

    def _step_once(
        self,
        race_id: str,
        source: EventSource,
        change: StateUpdate | None,
        trip: RoundTrip | None,
        answered: VersionConflict | None,
    ) -> tuple[Race | None, list[Event]]:
        reread = answered if answered is not None and answered.read else None
        for attempt in range(MAX_CONFLICTS):
            # 1. load: first from what this process saved last (no round trip). A stale copy
            # costs a failed version check, answered with the state there to decide again from;
            # a step a copy would make a no-op is checked against Redis.
            if reread is not None:
                record, reread = reread.found, None
            else:
                record = self.store.load(race_id, fresh=attempt == 0)
            if record is None:
                log.warning("race %s: no such race (expired or never created)", race_id)
                return None, []
            # 2. engine and 3. plan
            decided = self._decide(race_id, record, source, change)
            if isinstance(decided, Race):
                return decided, []
            if decided is None:  # a stale copy made it a no-op: ask Redis
                continue
            step = decided
            # 4. one round trip
            try:
                trip_now = self.riders(step, trip)
                self.store.save(race_id, step.state, record.version, trip_now, step.save_id)
            except VersionConflict as e:
                reread = e if e.read else None
                continue
            # 5. perform
            if step.late:  # its job's price changed the receipt
                self._late_result_taken(step)
                return step.race, []
            return step.race, self.perform(step)
        raise StoreError(f"race {race_id!r}: gave up after {MAX_CONFLICTS} conflicting steps")

    def _decide(
        self,
        race_id: str,
        record: RaceRecord,
        source: EventSource,
        change: StateUpdate | None,
    ) -> Step | Race | None:
        """The step ``source`` makes of the race as ``record`` holds it: a :class:`Step` to
        save, the race itself when there is nothing to save, or None when a cached copy made
        it a no-op (the step is then decided again from Redis)."""
        state = record.state
        race = Race.from_dict(state["race"], self.clock)
        if race.finished and not callable(source) and not late_result(race, source):
            return race  # finished is final: a stale copy cannot be wrong about it
        event = source(race) if callable(source) else source
        late = race.finished  # only a late result gets this far in a finished race
        if late and not late_result(race, event):
            return race
        if event is None:
            return None if record.cached else race
        phases = {a.id: a.phase for a in race.attempts}
        flags = list(race.flags)
        events = event if isinstance(event, tuple) else (event,)
        try:
            actions = [action for e in events for action in race.handle(e)]
        except ValueError as e:  # an event for an attempt this race never had
            if record.cached:
                return None
            log.warning("race %s: %s ignored: %s", race_id, events[0].kind, e)
            return race
        after = race.to_dict()
        if not actions and change is None and after == state["race"]:
            return None if record.cached else race  # a duplicate: nothing to save
        new = dict(state)
        new["race"] = after
        if change is not None:
            change(new)
        step = Step(race_id, race, new, record.version, actions, phases, flags, events)
        step.late = late
        self.note_timers(step)
        return step

    def riders(self, step: Step, ahead: RoundTrip | None) -> RoundTrip:
        """The step's round trip: the caller's commands ahead of the save, then the winner
        claim, the timer arms, the budget settlements and the finish, each acting only if the
        save wins (its mark) or harmless if it loses."""
        trip = ahead.ahead_only() if ahead is not None else RoundTrip()
        # every save lists the timer scripts: a NOSCRIPT reload must cover whatever rides in it
        trip.scripts.extend((self.timers.arm_script, self.timers.cancel_script))
        mark = self.store.save_mark(step.race_id, step.version, step.save_id)
        step.claim = step.receipt = None
        if step.wants(DeclareWinner) and step.race.winner is not None:
            step.claim = self.outcome.ride_claim(trip, step, mark)
        self._ride_arms(trip, step)
        settle = (
            self.budget.on_step(step.race_id, step.race, step.state, step.phases, mark)
            if self.budget
            else None
        )
        if settle is not None:
            trip.ride_won(settle[0], [settle[1]])
        if step.wants(RaceFinished):
            step.receipt = self.outcome.ride_finish(trip, step, mark)
        # with replicas to wait for: the tell timer ahead of the save, a failure's WAIT last
        step.told = self.outcome.ride_tell(trip, step, mark)
        return trip

    def _late_result_taken(self, step: Step) -> None:
        """A finished race took a loser's late result: the receipt and record are rewritten with
        its price; a verified one shows the job ended, so the janitor has nothing to cancel."""
        ids = [getattr(e, "attempt_id", "") for e in step.events]
        log.info("race %s: a late result priced %s", step.race_id, ", ".join(ids))
        self.outcome.refresh_receipt(step.race_id)  # first: a crash leaves the job to the janitor
        for event in step.events:
            if getattr(event, "verified", False):  # a delivery nobody checked proves no end
                self.store.remove_job(step.race_id, getattr(event, "attempt_id", ""))

    def note_timers(self, step: Step) -> None:
        """Record the ids of timers to arm in the step's state, and note the ids of timers the
        race no longer wants (``step.gone``)."""
        ids = dict(step.state.get("timer_ids") or {})
        for action in step.actions:
            if isinstance(action, ScheduleTimer):
                # The version makes every arming unique: a re-armed key never collides with
                # the in-flight delivery that asked for it.
                due = due_ms(action.at)
                ids[action.key] = f"{step.race_id}|{action.key}|{due}|{step.version + 1}"
        step.gone = [ids.pop(k) for k in list(ids) if k not in step.race.timers]
        step.state["timer_ids"] = ids

    def _ride_arms(self, trip: RoundTrip, step: Step) -> None:
        """The timer arms a step's actions need, riding in its save's round trip.

        Policy timers and cancel and launch backstops have fixed ids, so arming is idempotent,
        and one armed by a save that then loses its version check is harmless: the engine
        ignores a timer it no longer wants (or re-arms it, if it came early), a cancel backstop
        only ever cancels what the race still has in ``cancelling``, and a launch backstop only
        submits an attempt still ``launching`` (once, through the submit claim).
        """
        race_id = step.race_id
        queued: list[tuple[str, int, dict[str, Any], str]] = []
        for action in step.actions:
            if isinstance(action, ScheduleTimer):
                payload = {"race": race_id, "kind": "policy", "key": action.key}
                timer_id = step.state["timer_ids"][action.key]
                queued.append((f"{race_id}:{action.key}", due_ms(action.at), payload, timer_id))
            elif isinstance(action, Cancel):
                queued.append(self.canceller.backstop(race_id, action.attempt_id))
            elif isinstance(action, Launch) and self._launches_here:
                queued.append(self.submitter.launch_backstop(race_id, action.attempt_id))
        step.armed = bool(queued)
        if not queued:
            return

        timers = self.timers.of(race_id)  # the race's shard: one slot with its save

        def arm(pipe: Any) -> None:
            for key, due, payload, timer_id in queued:
                timers.queue_arm(pipe, key, due, payload, timer_id)

        trip.ride(arm, [self.timers.arm_script, self.timers.cancel_script])

    # ------------------------------------------------------------------ performing actions
    def perform(self, step: Step) -> list[Event]:
        """Perform a saved step's actions; returns the events they observed (polls), to step
        next. What rode in the save (arms, claim, finish) is not done again."""
        race_id, race, state = step.race_id, step.race, step.state
        follow: list[Event] = []
        unheld: NotAcknowledged | None = None
        told = step.told
        self.outcome.announce_sent(race_id, race, step.phases)  # before a win it may have brought
        # Cancels first: a loser stops billing sooner, and sending a task costs the winner's
        # caller well under a millisecond.
        for action in sorted(step.actions, key=lambda a: not isinstance(a, Cancel)):
            if isinstance(action, Launch):
                self.launch(race_id, action.attempt_id, action.provider, step.armed)
            elif isinstance(action, PollStatus):
                follow.append(self.watcher.poll(race, action.attempt_id))
            elif isinstance(action, Cancel):
                a = find_attempt(race, action.attempt_id)
                provider = a.provider if a else ""
                self.canceller.request_cancel(race_id, action.attempt_id, provider, step)
            elif isinstance(action, ScheduleTimer) and not step.armed:
                self.timers.of(race_id).arm(
                    f"{race_id}:{action.key}",
                    due_ms(action.at),
                    {"race": race_id, "kind": "policy", "key": action.key},
                    timer_id=state["timer_ids"][action.key],
                )
            elif isinstance(action, DeclareWinner):
                try:
                    metrics.race_won(race, self.outcome.declare(race_id, race, state, step.claim))
                except NotAcknowledged as e:  # nothing published: the rest still runs, then
                    unheld = e  # the step fails, so its retry (or a resume) declares again
            elif isinstance(action, GiveUp):
                try:
                    self.outcome.give_up(race_id, race, state, told)
                except NotAcknowledged as e:  # not told yet: as for the winner
                    unheld = e
            elif isinstance(action, RaceFinished):
                try:
                    self.outcome.finish(race_id, race, state, step.receipt, told)
                except NotAcknowledged as e:
                    unheld = e
        # Timers the race no longer wants (its deadline, once won): cancelled with this
        # process's next timer claim, or now without a timer service here. One that fires
        # first changes nothing: the race ignores a timer it no longer wants. The tell timer
        # too, once the caller was told (should it fire first, the effects tell nobody twice).
        gone = step.gone
        if told is not None and unheld is None:
            gone = [*gone, told.timer_id]
        self.timers.of(race_id).defer_cancels(gone)
        self.outcome.lifecycle(step)
        if unheld is not None:
            raise unheld
        return follow

    @property
    def _launches_here(self) -> bool:
        return bool(getattr(self.effects, "launches_here", False))

    def launch(self, race_id: str, attempt_id: str, provider: str, armed: bool = False) -> None:
        """Hand a launched attempt to the effects; one run in this process gets its backstop
        timer first (:meth:`Effects.launch`; ``armed``: it rode in the deciding step's save)."""
        if self._launches_here and not armed:
            key, due, payload, timer_id = self.submitter.launch_backstop(race_id, attempt_id)
            self.timers.of(race_id).arm(key, due, payload, timer_id=timer_id)
        self.effects.launch(race_id, attempt_id, provider)
