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
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from ..core.attempts import Attempt, Phase
from ..core.clock import Clock, WallClock
from ..core.jobs import AttemptResult, JobHandle, JobState
from ..core.policies import policy_from_dict
from ..core.race import Race
from ..core.race_events import (
    Action,
    AttemptSubmitted,
    Cancel,
    CancelAcknowledged,
    CancelFailed,
    DeclareWinner,
    Event,
    Launch,
    PollStatus,
    RaceFinished,
    ResultArrived,
    ScheduleTimer,
    StatusObserved,
    SubmitFailed,
    TimerDue,
)
from ..core.receipts import Evidence
from ..core.validators import validate
from ..errors import ProviderError, StoreError
from ..providers.base import Provider
from ..store.races import RaceStore, VersionConflict
from ..store.timers import Timer, TimerStore
from .receipt import (
    assemble_receipt,
    load_attempt_result,
    result_key,
    store_attempt_result,
    winner_result,
)
from .settings import RaceSettings
from .spec import RaceSpec

log = logging.getLogger(__name__)

EventSource = Event | Callable[[Race], Event | None]
StateUpdate = Callable[[dict[str, Any]], None]
MAX_CONFLICTS = 50


class Effects(Protocol):
    """Work the driver hands to other processes, and what it tells the caller and Flower."""

    def launch(self, race_id: str, attempt_id: str, provider: str) -> None:
        """Submit the attempt's job somewhere that may block (then call submit_attempt)."""

    def cancel(self, race_id: str, attempt_id: str, provider: str) -> None:
        """Cancel the attempt's job somewhere that may block (then call cancel_attempt)."""

    def won(self, race_id: str, result: dict[str, Any], caller: dict[str, Any]) -> None:
        """Hand the caller its result (Celery: mark the task id done, run its callbacks).

        ``caller`` is what :meth:`RaceDriver.create` was given about the caller (opaque here).
        """

    def failed(
        self, race_id: str, message: str, receipt: dict[str, Any], caller: dict[str, Any]
    ) -> None:
        """Tell the caller the race produced no valid result (Celery: mark it failed)."""

    def event(self, race_id: str, name: str, fields: dict[str, Any]) -> None:
        """A lifecycle moment (queued, running, hedge_launched, won...); must never raise."""


def spec_from_state(state: dict[str, Any]) -> RaceSpec:
    """The :class:`RaceSpec` a race was created with, rebuilt from its stored state."""
    data = state["spec"]
    return RaceSpec(
        policy=policy_from_dict(state["race"]["policy"]),
        validator=data["validator"],
        validator_options=data.get("validator_options") or {},
        caps_s=data.get("caps_s") or {},
        rates=data.get("rates") or {},
        time_scale=float(data.get("time_scale", 1.0)),
    )


def _attempt(race: Race, attempt_id: str) -> Attempt | None:
    return next((a for a in race.attempts if a.id == attempt_id), None)


def _due_ms(at: float) -> int:
    # Round up, so a timer claimed at its due millisecond is never early for the engine.
    return int(math.ceil(at * 1000.0))


class RaceDriver:
    """Advances races stored in Redis; one per process, shared by every thread."""

    def __init__(
        self,
        store: RaceStore,
        timers: TimerStore,
        providers: Callable[[str], Provider],
        effects: Effects,
        settings: RaceSettings | None = None,
        clock: Clock | None = None,
    ):
        self.store = store
        self.timers = timers
        self.providers = providers
        self.effects = effects
        self.settings = settings or RaceSettings()
        self.clock = clock or WallClock()

    @property
    def prefix(self) -> str:
        return self.store.prefix

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
        race = Race(spec.policy, self.clock, race_id=race_id)
        before: dict[str, Phase] = {}
        actions = race.start()
        state = {
            "race": race.to_dict(),
            "spec": spec.to_dict(),
            "request": request,
            "created_at": race.started_at,
            "timer_ids": {},
            "results": {},
            "caller": caller or {},
        }
        self._note_timers(race_id, race, state, actions, 1)
        try:
            self.store.create(race_id, state)
        except VersionConflict:
            self.resume(race_id)
            return False
        first = next((a for a in actions if isinstance(a, Launch)), None) if submit_first else None
        rest = [a for a in actions if a is not first]
        self._perform(race_id, race, state, rest, before, [], [], None)
        if first is not None:
            self.submit_attempt(race_id, first.attempt_id)
        return True

    # ------------------------------------------------------------------ the step
    def step(
        self, race_id: str, event: EventSource, update: StateUpdate | None = None
    ) -> Race | None:
        """Apply ``event`` (or ``event(race)``) and perform its actions; follow-ups included.

        Returns the race as saved by the last step (None for an unknown race).
        """
        pending: list[tuple[EventSource, StateUpdate | None]] = [(event, update)]
        race = None
        while pending:
            source, change = pending.pop(0)
            race, follow = self._step_once(race_id, source, change)
            pending.extend((e, None) for e in follow)
        return race

    def _step_once(
        self, race_id: str, source: EventSource, change: StateUpdate | None
    ) -> tuple[Race | None, list[Event]]:
        for _ in range(MAX_CONFLICTS):
            record = self.store.load(race_id)
            if record is None:
                log.warning("race %s: no such race (expired or never created)", race_id)
                return None, []
            state = record.state
            race = Race.from_dict(state["race"], self.clock)
            if race.finished:
                return race, []
            event = source(race) if callable(source) else source
            if event is None:
                return race, []
            phases = {a.id: a.phase for a in race.attempts}
            flags = list(race.flags)
            try:
                actions = race.handle(event)
            except ValueError as e:  # an event for an attempt this race never had
                log.warning("race %s: %s ignored: %s", race_id, event.kind, e)
                return race, []
            after = race.to_dict()
            if not actions and change is None and after == state["race"]:
                return race, []  # a duplicate: nothing changed, nothing to save
            new = dict(state)
            new["race"] = after
            if change is not None:
                change(new)
            gone = self._note_timers(race_id, race, new, actions, record.version + 1)
            try:
                self.store.save(race_id, new, record.version)
            except VersionConflict:
                continue
            follow = self._perform(race_id, race, new, actions, phases, flags, gone, event)
            return race, follow
        raise StoreError(f"race {race_id!r}: gave up after {MAX_CONFLICTS} conflicting steps")

    def _note_timers(
        self, race_id: str, race: Race, state: dict[str, Any], actions: list[Action], version: int
    ) -> list[str]:
        """Record the ids of timers to arm; return the ids of timers the race no longer wants."""
        ids = dict(state.get("timer_ids") or {})
        for action in actions:
            if isinstance(action, ScheduleTimer):
                # The version makes every arming unique: a re-armed key never collides with
                # the in-flight delivery that asked for it.
                ids[action.key] = f"{race_id}|{action.key}|{_due_ms(action.at)}|{version}"
        gone = [ids.pop(k) for k in list(ids) if k not in race.timers]
        state["timer_ids"] = ids
        return gone

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
        event: Event | None,
    ) -> list[Event]:
        follow: list[Event] = []
        for action in actions:
            if isinstance(action, Launch):
                self.effects.launch(race_id, action.attempt_id, action.provider)
                if action.role == "hedge":
                    self._event(race_id, "hedge_launched", race, action.attempt_id)
                elif action.role == "fallback":
                    self._event(race_id, "escalated", race, action.attempt_id)
            elif isinstance(action, PollStatus):
                follow.append(self._poll(race, action.attempt_id))
            elif isinstance(action, Cancel):
                a = _attempt(race, action.attempt_id)
                self.effects.cancel(race_id, action.attempt_id, a.provider if a else "")
            elif isinstance(action, ScheduleTimer):
                self.timers.arm(
                    f"{race_id}:{action.key}",
                    _due_ms(action.at),
                    {"race": race_id, "kind": "policy", "key": action.key},
                    timer_id=state["timer_ids"][action.key],
                )
            elif isinstance(action, DeclareWinner):
                self._declare(race_id, race, state)
            elif isinstance(action, RaceFinished):
                self._finish(race_id, race, state)
        for timer_id in gone:
            self.timers.cancel(timer_id)
        self._lifecycle(race_id, race, phases, flags, event)
        return follow

    def _lifecycle(
        self,
        race_id: str,
        race: Race,
        phases: dict[str, Phase],
        flags: list[str],
        event: Event | None,
    ) -> None:
        if "cut_over" in race.flags and "cut_over" not in flags:
            self._event(race_id, "cut_over", race, None)
        if isinstance(event, StatusObserved) and event.state is not None:
            name = {JobState.QUEUED: "queued", JobState.IN_PROGRESS: "running"}.get(event.state)
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

    def _event(self, race_id: str, name: str, race: Race, attempt_id: str | None) -> None:
        if not self.settings.events:
            return
        fields: dict[str, Any] = {"race_id": race_id, "policy": race.policy.name}
        a = _attempt(race, attempt_id) if attempt_id else None
        if a is not None:
            fields.update(attempt=a.id, provider=a.provider, role=a.role, job_id=a.job_id)
        try:
            self.effects.event(race_id, name, fields)
        except Exception:  # events are for watching; they never break a race
            log.debug("race %s: event %s not sent", race_id, name, exc_info=True)

    def _declare(self, race_id: str, race: Race, state: dict[str, Any]) -> None:
        won = race.winner_attempt
        assert won is not None
        claim = self.store.claim_winner(race_id, won.id)
        if not claim.won:  # cannot happen while the state's version check holds; never hide it
            log.error(
                "race %s: engine chose %s but %s holds the win", race_id, won.id, claim.winner
            )
            return
        client = self.store.client
        stored = load_attempt_result(client, self.prefix, race_id, won.id) or {}
        result = winner_result(
            race,
            stored,
            inline_max=self.settings.payload_inline_max,
            ref=result_key(self.prefix, race_id, won.id),
        )
        self._event(race_id, "won", race, won.id)  # before task-succeeded, which ends it in Flower
        self.effects.won(race_id, result, state.get("caller") or {})

    def _finish(self, race_id: str, race: Race, state: dict[str, Any]) -> None:
        spec = spec_from_state(state)
        receipt = assemble_receipt(race, state, spec, now=self.clock.now())
        for a in race.attempts:
            if not a.live:
                self.store.remove_job(race_id, a.id)
        self.store.finish(race_id, receipt, self.settings.receipt_ttl_s)
        if race.winner is None:
            message = f"race {race_id}: {race.note}"
            self.effects.failed(race_id, message, receipt, state.get("caller") or {})

    # ------------------------------------------------------------------ attempt work
    def submit_attempt(self, race_id: str, attempt_id: str) -> None:
        """Submit a launched attempt's job once, register it, report it, start watching it.

        Idempotent: a redelivered submit whose job was registered before a crash reports that
        job instead of submitting another; a submit after the race stopped needing it is skipped.
        """
        record = self.store.load(race_id)
        if record is None:
            return
        race = Race.from_dict(record.state["race"], self.clock)
        a = _attempt(race, attempt_id)
        if a is None:
            return
        if a.phase is not Phase.LAUNCHING:
            # Already reported: a redelivery, whose first run may have died between its step's
            # save and the actions (timers, watch) that step asked for. Re-perform them.
            self.resume(race_id)
            return
        known = self.store.live_jobs(race_id).get(attempt_id)
        if known is not None:
            handle = JobHandle.from_dict(known)
        elif race.finished or race.has_winner or a.cancel_requested:
            self.step(
                race_id, SubmitFailed(attempt_id, "not submitted: the race no longer needs it")
            )
            return
        else:
            provider = self.providers(a.provider)
            try:
                handle = provider.submit(record.state.get("request") or {})
            except ProviderError as e:
                self.step(race_id, SubmitFailed(attempt_id, str(e)))
                return
            except Exception as e:  # an adapter bug must end the attempt, not hang the race
                self.step(race_id, SubmitFailed(attempt_id, f"{type(e).__name__}: {e}"))
                return
            # Registered before it is reported: a crash now leaves the janitor a handle.
            self.store.add_job(race_id, attempt_id, handle.to_dict())
        saved = self.step(race_id, AttemptSubmitted(attempt_id, handle.job_id, handle.to_dict()))
        if saved is not None:
            cap = float(record.state["spec"]["caps_s"].get(a.provider, 180.0))
            self.watch(race_id, attempt_id, a.provider, handle.to_dict(), None, cap)

    def cancel_attempt(self, race_id: str, attempt_id: str) -> None:
        """Cancel an attempt's job natively and report the receipt (never Celery's revoke)."""
        record = self.store.load(race_id)
        if record is None:
            return
        race = Race.from_dict(record.state["race"], self.clock)
        a = _attempt(race, attempt_id)
        if a is None or not a.handle:
            return
        if a.phase is not Phase.CANCELLING:
            self.resume(race_id)  # a redelivery after the cancel was reported: see submit
            return
        provider = self.providers(a.provider)
        handle = JobHandle.from_dict(a.handle)
        try:
            receipt = provider.cancel(handle)
        except Exception as e:
            self.step(race_id, CancelFailed(attempt_id, f"{type(e).__name__}: {e}"))
            return
        if receipt.confirmed_terminal and receipt.terminal_status is JobState.COMPLETED:
            # It finished before the cancel took effect: its result may still win the race.
            ack = replace(
                receipt, confirmed_terminal=False, terminal_status=None, terminal_ms=None,
                leaked=True, evidence=Evidence.PROVIDER_ACK,
            )  # fmt: skip
            self.step(race_id, CancelAcknowledged(attempt_id, ack))
            cap = float(record.state["spec"]["caps_s"].get(a.provider, 180.0))
            self.conclude(race_id, attempt_id, provider, handle, cap)
            return
        self.step(race_id, CancelAcknowledged(attempt_id, receipt))
        if not receipt.confirmed_terminal:
            self.step(
                race_id, CancelFailed(attempt_id, "no terminal state within the cancel window")
            )

    def _poll(self, race: Race, attempt_id: str) -> Event:
        a = _attempt(race, attempt_id)
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
    ) -> None:
        """Poll a job once: report a state change, conclude it when terminal, else re-arm."""
        provider = self.providers(provider_name)
        handle = JobHandle.from_dict(handle_data)
        try:
            state: JobState | None = provider.status(handle)
            error = None
        except Exception as e:
            state, error = None, f"{type(e).__name__}: {e}"
        now = self.clock.now()
        deadline = handle.submitted_at + cap_s
        if (state is not None and state.terminal) or now >= deadline:
            self.conclude(race_id, attempt_id, provider, handle, cap_s)
            return
        label = state.value if state is not None else "poll_error"
        if label != last:
            saved = self.step(race_id, StatusObserved(attempt_id, state, error))
            if saved is None:
                return
            a = _attempt(saved, attempt_id)
            if saved.finished and (a is None or not a.live):
                return
        else:
            self.store.touch(race_id)  # a quiet race is alive: keep it off the janitor's list
        hint = getattr(provider, "next_change_at", None)
        at = None
        if callable(hint) and state is not None:
            try:
                at = hint(handle)
            except Exception:
                at = None
        if at is None:
            at = now + self.settings.watch_interval_s
        self.arm_watch(
            race_id, attempt_id, provider_name, handle_data, label, cap_s, min(at, deadline)
        )

    def arm_watch(
        self,
        race_id: str,
        attempt_id: str,
        provider_name: str,
        handle_data: dict[str, Any],
        last: str | None,
        cap_s: float,
        at: float,
    ) -> None:
        """Arm the durable timer of the next watch poll of one job."""
        payload = {
            "race": race_id,
            "kind": "watch",
            "attempt": attempt_id,
            "provider": provider_name,
            "handle": handle_data,
            "last": last,
            "cap_s": cap_s,
        }
        self.timers.arm(f"{race_id}:w:{attempt_id}", _due_ms(at), payload)

    def conclude(
        self, race_id: str, attempt_id: str, provider: Provider, handle: JobHandle, cap_s: float
    ) -> None:
        """Fetch a terminal (or capped) job's result, validate it and report it to the race."""
        try:
            result = provider.result(handle, cap_s)  # returns at once: terminal or past the cap
        except Exception as e:
            result = AttemptResult(
                provider.name, handle.job_id, JobState.FAILED, provider.elapsed_ms(handle),
                error=f"{type(e).__name__}: {e}",
            )  # fmt: skip
        record = self.store.load(race_id)
        if record is None:
            return
        spec = record.state["spec"]
        valid, reasons = False, [result.error or f"ended {result.state}"]
        if result.state is JobState.COMPLETED:
            verdict = validate(
                spec["validator"], result.payload, **(spec.get("validator_options") or {})
            )
            valid, reasons = verdict.ok, list(verdict.reasons)
            if valid:
                store_attempt_result(
                    self.store.client, self.prefix, race_id, attempt_id,
                    result.to_dict(), self.settings.receipt_ttl_s,
                )  # fmt: skip
        summary = {**result.to_dict(include_payload=False), "valid": valid, "reasons": reasons}

        def event(race: Race) -> Event | None:
            a = _attempt(race, attempt_id)
            if a is None or not a.live:
                return None
            if (
                a.phase in (Phase.CANCELLING, Phase.LEAKED)
                and result.state is not JobState.COMPLETED
            ):
                if result.state is JobState.TIMEOUT:
                    return None  # right-censored, not observed terminal: the cancel decides
                return StatusObserved(attempt_id, result.state)  # confirms the cancel
            return ResultArrived(attempt_id, result.state, valid, tuple(reasons))

        def remember(state: dict[str, Any]) -> None:
            state["results"] = {**(state.get("results") or {}), attempt_id: summary}

        self.step(race_id, event, remember)

    # ------------------------------------------------------------------ timers and recovery
    def on_timer(self, timer: Timer) -> None:
        """The TimerService handler: a policy timer steps the race, a watch timer polls a job."""
        payload = timer.payload
        kind = payload.get("kind")
        if kind == "policy":
            self.step(payload["race"], TimerDue(payload["key"]))
            if timer.deliveries > 1:  # its first claimer died, perhaps after saving the step
                self.resume(payload["race"])
        elif kind == "watch":
            self.watch(
                payload["race"], payload["attempt"], payload["provider"], payload["handle"],
                payload.get("last"), float(payload.get("cap_s", 180.0)),
            )  # fmt: skip
        else:
            log.warning("timer %s has an unknown kind %r; dropped", timer.id, kind)

    def resume(self, race_id: str) -> None:
        """Re-perform whatever a crashed step may have left undone (all of it idempotent)."""
        record = self.store.load(race_id)
        if record is None:
            return
        state = record.state
        race = Race.from_dict(state["race"], self.clock)
        if race.finished and self.store.receipt(race_id) is not None:
            return  # fully done: its winner was marked and its receipt written
        caps = state["spec"].get("caps_s") or {}
        now = self.clock.now()
        for a in race.attempts:
            if a.phase is Phase.LAUNCHING:
                self.effects.launch(race_id, a.id, a.provider)
            elif a.live and a.handle:
                cap = float(caps.get(a.provider, 180.0))
                self.arm_watch(race_id, a.id, a.provider, a.handle, None, cap, now)
                if a.phase is Phase.CANCELLING:
                    self.effects.cancel(race_id, a.id, a.provider)
        ids = state.get("timer_ids") or {}
        for key, at in race.timers.items():
            if key in ids:
                payload = {"race": race_id, "kind": "policy", "key": key}
                self.timers.arm(f"{race_id}:{key}", _due_ms(at), payload, timer_id=ids[key])
        if race.winner is not None:
            self._declare(race_id, race, state)
        if race.finished:
            self._finish(race_id, race, state)
