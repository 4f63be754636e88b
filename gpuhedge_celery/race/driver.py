"""The race driver: performs the engine's actions against providers, the race store and timers.

A race is state in Redis, never a process. Whoever learns something about it (the task that
started it, an attempt task that submitted a job, a timer that came due, a watch poll) calls
:meth:`RaceDriver.step`: load the state and its version, apply one event to the engine, save
with a version check (reload and re-apply on a conflict: events are idempotent), and only then
perform the actions the engine returned. Work that may block on a provider (submit, cancel) is
handed to :class:`Effects` (Celery tasks in production); everything else is done inline.

This module knows nothing about Celery: :class:`Effects` is the seam, so the driver runs the
same under a Celery worker, a test or a benchmark.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .. import settings as process_settings
from ..core.attempts import Phase
from ..core.clock import Clock, WallClock
from ..core.jobs import JobState
from ..core.race import Race, late_result
from ..core.race_events import (
    Action,
    Cancel,
    DeclareWinner,
    Event,
    GiveUp,
    Launch,
    PollStatus,
    RaceFinished,
    ScheduleTimer,
    StatusObserved,
)
from ..errors import StoreError
from ..metrics import record as metrics
from ..providers.base import Provider
from ..store.race_keys import SaveMark
from ..store.races import RaceStore, VersionConflict, new_save_id
from ..store.timers import TimerStore
from ..webhooks.settings import WebhookSettings
from .attempts import AttemptWork
from .base import Effects, due_ms, find_attempt
from .budget import RaceBudget
from .outcome import OutcomeWork, RidingClaim
from .recovery import RecoveryWork
from .settings import RaceSettings
from .spec import RaceSpec

log = logging.getLogger(__name__)

# One event, several applied in order in one step (one save), or a function of the race.
Events = Event | tuple[Event, ...]
EventSource = Events | Callable[[Race], Events | None]
StateUpdate = Callable[[dict[str, Any]], None]
MAX_CONFLICTS = 50


class RaceDriver(RecoveryWork, OutcomeWork, AttemptWork):
    """Advances races stored in Redis; one per process, shared by every thread."""

    def __init__(
        self,
        store: RaceStore,
        timers: TimerStore,
        providers: Callable[[str], Provider],
        effects: Effects,
        settings: RaceSettings | None = None,
        clock: Clock | None = None,
        webhooks: WebhookSettings | None = None,
        budget: RaceBudget | None = None,
    ):
        self.store = store
        self.timers = timers
        self.providers = providers
        self.effects = effects
        self.settings = settings or RaceSettings()
        # webhooks on (GPUHEDGE_WEBHOOK_URL and _SECRET): completions are pushed, polls a net
        self.webhooks = webhooks if webhooks is not None else process_settings.current().webhooks
        self.clock = clock or WallClock()
        # reserves before each submit and settles each ended attempt (race/budget.py)
        self.budget = budget if budget is not None and budget.enabled else None
        self._decided = {}
        self._fresh_results = {}

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
        before: dict[str, Phase] = {}
        actions = race.start()
        state = {
            "race": race.to_dict(),
            "spec": spec.to_dict(),
            "created_at": race.started_at,
            "timer_ids": {},
            "results": {},
            "caller": caller or {},
        }
        self._note_timers(race_id, race, state, actions, 1)
        first = next((a for a in actions if isinstance(a, Launch)), None) if submit_first else None
        rest = [a for a in actions if a is not first]
        # The first timers ride in the create's round trip. Not a launch backstop for the
        # attempt submitted inline below: nothing would drop it (a crash here is covered by the
        # redelivered create, whose resume launches it behind a backstop: as the submit's
        # intent is already recorded, that backstop ends it "outcome unknown" past the intent's
        # window, as for a death during any submit), and once due it would take over that
        # attempt's later work (its cancel) from the timer meant for it.
        arms = self._arms(race_id, state, rest)
        deadline = None if spec.deadline_s is None else (race.started_at or 0.0) + spec.deadline_s
        # The first submit's claim rides here too, made only if the create wins (FirstSubmit).
        save_id = new_save_id()
        ride = self._first_submit(race_id, race, state, request, first, save_id)

        def also(pipe: Any) -> None:
            if ride is not None:  # first among the extras: its replies come first
                ride.queue(pipe)
            if arms is not None:
                arms(pipe)
            if deadline is not None:
                self.store.queue_deadline(pipe, race_id, deadline)  # for waiting callers

        try:
            # the request has its own key, written once (each step rewrites the state)
            self.store.create(
                race_id,
                state,
                request,
                also=also,
                save_id=save_id,
                took=ride.take if ride is not None else None,
                scripts=(
                    self.timers.arm_script,
                    self.timers.cancel_script,
                    *(ride.scripts if ride is not None else ()),
                ),
            )
        except VersionConflict:
            self.resume(race_id)
            return False
        metrics.race_started(race)
        self._perform(race_id, race, state, rest, before, [], [], (), armed=arms is not None)
        if first is not None:
            claimed = ride.ours if ride is not None else None
            self.submit_attempt(race_id, first.attempt_id, new_race=True, claimed=claimed)
        return True

    # ------------------------------------------------------------------ the step
    def step(
        self,
        race_id: str,
        event: EventSource,
        update: StateUpdate | None = None,
        before: Callable[[Any], None] | None = None,
        answered: VersionConflict | None = None,
    ) -> Race | None:
        """Apply ``event`` (or ``event(race)``) and perform its actions; follow-ups included.

        ``before(pipe)``: writes to make in the save's round trip, ahead of the state (see
        :meth:`RaceStore.save`); a step that saves nothing does not make them.
        ``answered``: a refused save of this race elsewhere, whose state (if it carries one)
        the step starts from instead of reading the race.
        Returns the race as saved by the last step (None for an unknown race).
        """
        pending: list[tuple[EventSource, StateUpdate | None]] = [(event, update)]
        race = None
        first = True
        while pending:
            source, change = pending.pop(0)
            race, follow = self._step_once(
                race_id, source, change, before if first else None, answered if first else None
            )
            first = False
            pending.extend((e, None) for e in follow)
        return race

    def _step_once(
        self,
        race_id: str,
        source: EventSource,
        change: StateUpdate | None,
        before: Callable[[Any], None] | None = None,
        answered: VersionConflict | None = None,
    ) -> tuple[Race | None, list[Event]]:
        reread = answered if answered is not None and answered.read else None
        for attempt in range(MAX_CONFLICTS):
            # First from what this process saved last (no round trip). A stale copy costs a
            # failed version check, answered with the state there to decide again from; a
            # step a copy would make a no-op is checked against Redis.
            if reread is not None:
                record, reread = reread.found, None
            else:
                record = self.store.load(race_id, fresh=attempt == 0)
            if record is None:
                log.warning("race %s: no such race (expired or never created)", race_id)
                return None, []
            state = record.state
            race = Race.from_dict(state["race"], self.clock)
            if race.finished and not callable(source) and not late_result(race, source):
                return race, []  # finished is final: a stale copy cannot be wrong about it
            event = source(race) if callable(source) else source
            late = race.finished  # only a late result gets this far in a finished race
            if late and not late_result(race, event):
                return race, []
            if event is None:
                if record.cached:
                    continue
                return race, []
            phases = {a.id: a.phase for a in race.attempts}
            flags = list(race.flags)
            events = event if isinstance(event, tuple) else (event,)
            try:
                actions = [action for e in events for action in race.handle(e)]
            except ValueError as e:  # an event for an attempt this race never had
                if record.cached:
                    continue
                log.warning("race %s: %s ignored: %s", race_id, events[0].kind, e)
                return race, []
            after = race.to_dict()
            if not actions and change is None and after == state["race"]:
                if record.cached:
                    continue
                return race, []  # a duplicate: nothing changed, nothing to save
            new = dict(state)
            new["race"] = after
            if change is not None:
                change(new)
            gone = self._note_timers(race_id, race, new, actions, record.version + 1)
            arms = self._arms(race_id, new, actions)
            save_id = new_save_id()
            saved = self.store.save_mark(race_id, record.version, save_id)
            also, scripts = self._with_settlements(race_id, race, new, phases, arms, saved)
            also, scripts, claimed = self._with_winner_claim(
                race_id, race, actions, saved, also, scripts
            )
            also, scripts, finished = self._with_finish(
                race_id, race, new, actions, saved, also, scripts
            )
            try:
                self.store.save(
                    race_id,
                    new,
                    record.version,
                    also=also,
                    before=before,
                    scripts=scripts,
                    save_id=save_id,
                    took=claimed.take if claimed else None,
                )
            except VersionConflict as e:
                reread = e if e.read else None
                continue
            if late:  # its job's price changed the receipt
                self._late_result_taken(race_id, race, events)
                return race, []
            follow = self._perform(
                race_id,
                race,
                new,
                actions,
                phases,
                flags,
                gone,
                events,
                armed=arms is not None,
                claim=claimed,
                finished=finished,
            )
            return race, follow
        raise StoreError(f"race {race_id!r}: gave up after {MAX_CONFLICTS} conflicting steps")

    def _late_result_taken(self, race_id: str, race: Race, events: tuple[Event, ...]) -> None:
        """A finished race took a loser's late result: the receipt and record are rewritten with
        its price; a verified one shows the job ended, so the janitor has nothing to cancel."""
        log.info(
            "race %s: a late result priced %s",
            race_id,
            ", ".join(getattr(e, "attempt_id", "") for e in events),
        )
        self.refresh_receipt(race_id)  # first: a crash after it leaves the job to the janitor
        for event in events:
            if getattr(event, "verified", False):  # a delivery nobody checked proves no end
                self.store.remove_job(race_id, getattr(event, "attempt_id", ""))

    def _with_settlements(
        self,
        race_id: str,
        race: Race,
        state: dict[str, Any],
        before: dict[str, Phase],
        arms: Callable[[Any], None] | None,
        saved: SaveMark,
    ) -> tuple[Callable[[Any], None] | None, tuple[Any, ...]]:
        """The save's extra commands: the timer arms, and the budget settlements of attempts
        this step ended, which run only if the save wins (``saved``: its mark): one that
        loses worked from an old copy of the race, and a reservation settles once."""
        scripts: tuple[Any, ...] = (self.timers.arm_script, self.timers.cancel_script)
        budget = self.budget
        settle = budget.on_step(race_id, race, state, before, saved) if budget else None
        if settle is None:
            return arms, scripts
        queue, script = settle

        def also(pipe: Any) -> None:
            if arms is not None:
                arms(pipe)
            queue(pipe)

        return also, (*scripts, script)

    def _with_winner_claim(
        self,
        race_id: str,
        race: Race,
        actions: list[Action],
        saved: SaveMark,
        also: Callable[[Any], None] | None,
        scripts: tuple[Any, ...],
    ) -> tuple[Callable[[Any], None] | None, tuple[Any, ...], RidingClaim | None]:
        """When the step declares a winner, its claim rides in the save, first among the extra
        commands, and claims only if the save wins: no round trip of its own. The caller's
        result rides with it where the effects can say how it is stored."""
        if not any(isinstance(a, DeclareWinner) for a in actions) or race.winner is None:
            return also, scripts, None
        riding = RidingClaim()
        winner = race.winner
        result = self._result_write(race_id, race, riding)

        def with_claim(pipe: Any) -> None:
            self.store.queue_claim_winner(pipe, race_id, winner, saved, result)
            if also is not None:
                also(pipe)

        return with_claim, (*scripts, self.store.claim_winner_script), riding

    def _note_timers(
        self, race_id: str, race: Race, state: dict[str, Any], actions: list[Action], version: int
    ) -> list[str]:
        """Record the ids of timers to arm; return the ids of timers the race no longer wants."""
        ids = dict(state.get("timer_ids") or {})
        for action in actions:
            if isinstance(action, ScheduleTimer):
                # The version makes every arming unique: a re-armed key never collides with
                # the in-flight delivery that asked for it.
                ids[action.key] = f"{race_id}|{action.key}|{due_ms(action.at)}|{version}"
        gone = [ids.pop(k) for k in list(ids) if k not in race.timers]
        state["timer_ids"] = ids
        return gone

    def _arms(
        self, race_id: str, state: dict[str, Any], actions: list[Action]
    ) -> Callable[[Any], None] | None:
        """The timer arms a step's actions need, to ride in the save's round trip.

        Policy timers and cancel and launch backstops have fixed ids, so arming is idempotent,
        and one armed by a save that then loses its version check is harmless: the engine
        ignores a timer it no longer wants (or re-arms it, if it came early), a cancel backstop
        only ever cancels what the race still has in ``cancelling``, and a launch backstop only
        submits an attempt still ``launching`` (once, through the submit claim).
        """
        queued: list[tuple[str, int, dict[str, Any], str]] = []
        for action in actions:
            if isinstance(action, ScheduleTimer):
                payload = {"race": race_id, "kind": "policy", "key": action.key}
                queued.append(
                    (
                        f"{race_id}:{action.key}",
                        due_ms(action.at),
                        payload,
                        state["timer_ids"][action.key],
                    )
                )
            elif isinstance(action, Cancel):
                queued.append(self._backstop(race_id, action.attempt_id))
            elif isinstance(action, Launch) and self._launches_here:
                queued.append(self._launch_backstop(race_id, action.attempt_id))
        if not queued:
            return None

        def also(pipe: Any) -> None:
            for key, due, payload, timer_id in queued:
                self.timers.queue_arm(pipe, key, due, payload, timer_id)

        return also

    # ------------------------------------------------------------------ performing actions
    def _perform(
        self,
        race_id: str,
        race: Race,
        state: dict[str, Any],
        actions: list[Action],
        phases: dict[str, Phase],
        flags: list[str],
        gone: list[str],
        events: tuple[Event, ...],
        *,
        armed: bool = False,
        claim: RidingClaim | None = None,
        finished: dict[str, Any] | None = None,
    ) -> list[Event]:
        """Perform a saved step's actions; ``armed``: its timers rode in the save already;
        ``claim``: the winner claim that rode in it (None: claim now), with the caller's
        result if that rode too; ``finished``: the receipt of the finish that rode in it
        (None: finish now)."""
        follow: list[Event] = []
        # Cancels first: a loser stops billing sooner, and sending a task costs the winner's
        # caller well under a millisecond.
        ordered = sorted(actions, key=lambda a: not isinstance(a, Cancel))
        self._announce_sent(race_id, race, phases)  # before a win it may have brought
        for action in ordered:
            if isinstance(action, Launch):
                self._launch(race_id, action.attempt_id, action.provider, armed)
            elif isinstance(action, PollStatus):
                follow.append(self._poll(race, action.attempt_id))
            elif isinstance(action, Cancel):
                a = find_attempt(race, action.attempt_id)
                caps = (state.get("spec") or {}).get("caps_s")
                provider = a.provider if a else ""
                self.request_cancel(race_id, action.attempt_id, provider, race, caps, armed)
            elif isinstance(action, ScheduleTimer) and not armed:
                self.timers.arm(
                    f"{race_id}:{action.key}",
                    due_ms(action.at),
                    {"race": race_id, "kind": "policy", "key": action.key},
                    timer_id=state["timer_ids"][action.key],
                )
            elif isinstance(action, DeclareWinner):
                metrics.race_won(race, self._declare(race_id, race, state, claim))
            elif isinstance(action, GiveUp):
                self._give_up(race_id, race, state)
            elif isinstance(action, RaceFinished):
                self._finish(race_id, race, state, finished)
        # Timers the race no longer wants (its deadline, once won): cancelled with this
        # process's next timer claim, or now without a timer service here. One that fires
        # first changes nothing: the race ignores a timer it no longer wants.
        self.timers.defer_cancels(gone)
        self._lifecycle(race_id, race, phases, flags, events)
        return follow

    def _lifecycle(
        self,
        race_id: str,
        race: Race,
        phases: dict[str, Phase],
        flags: list[str],
        events: tuple[Event, ...],
    ) -> None:
        if "cut_over" in race.flags and "cut_over" not in flags:
            self._event(race_id, "cut_over", race, None)
        for event in events:
            if isinstance(event, StatusObserved) and event.state is not None:
                states = {JobState.QUEUED: "queued", JobState.IN_PROGRESS: "running"}
                name = states.get(event.state)
                if name:
                    self._event(race_id, name, race, event.attempt_id)
        for a in race.attempts:
            was = phases.get(a.id)
            if was == a.phase:
                continue
            if a.phase is Phase.CANCELLED:
                self._event(race_id, "loser_cancelled", race, a.id)
            elif a.phase is Phase.LEAKED:
                self._event(race_id, "leaked", race, a.id)

    @property
    def _launches_here(self) -> bool:
        return bool(getattr(self.effects, "launches_here", False))

    def _launch(self, race_id: str, attempt_id: str, provider: str, armed: bool = False) -> None:
        """Hand a launched attempt to the effects; one run in this process gets its backstop
        timer first (``armed``: it rode in the deciding step's save)."""
        if self._launches_here and not armed:
            key, due, payload, timer_id = self._launch_backstop(race_id, attempt_id)
            self.timers.arm(key, due, payload, timer_id=timer_id)
        self.effects.launch(race_id, attempt_id, provider)
