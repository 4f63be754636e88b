"""The batched watch loop: a batch of due watch polls stepped in memory, saved in one round trip.

With ``GPUHEDGE_COORD_LOOP=batched`` the timer service of a coordination worker hands each
claimed batch of due timers to :meth:`WatchBatch.handle`, in its own thread, instead of one
timer per handler thread. For the watch polls of providers that can answer many status polls
at once (``status_and_next_change_many``), it:

1. polls each provider's jobs of the batch in one call;
2. takes the states of the races whose jobs changed from this process's last saves, and reads
   the others in one pipeline;
3. applies every change to its race in memory, through the same engine as a step, several
   polls of one race into one save;
4. sends every save (the same versioned ``race_save.lua``), heartbeat and next-poll arm of the
   batch in one pipeline;
5. performs what the saved steps asked for (their lifecycle events, timers dropped).

Everything else is handed back to the per-timer path (:meth:`RaceDriver.on_timer`, or the
function given with the timer) on the service's handler threads: other timer kinds, a job
that ended or passed its cap (its result is fetched and validated there), a step whose
actions go beyond arming timers (a hedge, a cancel, a winner), a redelivered timer (it needs
the crash recovery), and a save that lost its version check (stepped again from Redis). The
guarantees are the per-timer path's: saves are versioned, arms have fixed ids, and a timer is
acknowledged only once its batch's round trip was answered, so a crash mid-batch delivers it
again after its lease.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.attempts import Phase
from ..core.jobs import JobHandle
from ..core.race import Race
from ..core.race_events import AttemptSubmitted, Event, ScheduleTimer, StatusObserved
from ..store.codec import dumps_dict
from ..store.races import RaceRecord, VersionConflict, new_save_id
from ..store.scripts import run_pipeline
from ..store.timers import Timer
from .base import find_attempt
from .watch import NextPoll

if TYPE_CHECKING:
    from .driver import RaceDriver

log = logging.getLogger(__name__)

#: hands a timer back to the timer threads at once, with the work to do for it (None: the
#: per-timer handler)
HandBack = Callable[[Timer, "Callable[[], Any] | None"], None]


@dataclass
class _Poll:
    """One watch timer of the batch and what its poll saw."""

    timer: Timer
    handle: JobHandle
    observed: StatusObserved | None = None  # None: the same state as the poll before
    next: NextPoll | None = None


@dataclass
class _RaceWork:
    """The polls of one race in the batch, and its step once applied in memory."""

    race_id: str
    polls: list[_Poll] = field(default_factory=list)
    record: RaceRecord | None = None
    race: Race | None = None
    step: tuple[Any, ...] | None = None  # (state, actions, phases, flags, gone, events, data)


class WatchBatch:
    """The batch handler of a coordination worker's timer service (see the module)."""

    def __init__(self, driver: RaceDriver):
        self.driver = driver
        self.batches = 0  # batches handled, and polls done in them (for tests and benches)
        self.polls = 0

    def handle(self, timers: list[Timer], back: HandBack) -> None:
        """Handle what can be batched of ``timers``; hand the rest ``back`` as soon as that is
        known, so a job that ended or a hedge due does not wait for the batch's writes."""
        by_provider: dict[str, list[_Poll]] = {}
        for timer in timers:
            payload = timer.payload
            if payload.get("kind") != "watch" or timer.deliveries > 1 or "reserved" in payload:
                back(timer, None)
                continue
            try:
                provider = self.driver.providers(payload["provider"])
                handle = JobHandle.from_dict(payload["handle"])
            except Exception:
                back(timer, None)  # the per-timer path logs what is wrong
                continue
            if not callable(getattr(provider, "status_and_next_change_many", None)):
                back(timer, None)
                continue
            by_provider.setdefault(payload["provider"], []).append(_Poll(timer, handle))
        if not by_provider:
            return
        races = self._poll(by_provider, back)
        self._load(races)
        self._write([work for work in races.values() if self._apply(work, back)], back)
        self.batches += 1

    # -- 1. poll ----------------------------------------------------------------------------
    def _poll(self, by_provider: dict[str, list[_Poll]], back: HandBack) -> dict[str, _RaceWork]:
        d = self.driver
        races: dict[str, _RaceWork] = {}
        for name, polls in by_provider.items():
            provider = d.providers(name)
            try:
                answers = provider.status_and_next_change_many([p.handle for p in polls])
            except Exception as e:  # polled again one by one, where each error is reported
                log.debug("batched poll of %s failed: %s", name, e)
                for p in polls:
                    back(p.timer, None)
                continue
            near = bool(getattr(provider, "polls_before_decisions", False))
            now = d.clock.now()
            for poll, (state, at) in zip(polls, answers, strict=True):
                payload = poll.timer.payload
                race_id, attempt_id = payload["race"], payload["attempt"]
                cap_s = float(payload.get("cap_s", 180.0))
                deadline = poll.handle.submitted_at + cap_s
                if state.terminal or now >= deadline:  # fetch, validate, report: per timer
                    back(poll.timer, _conclude(d, race_id, attempt_id, name, poll, cap_s))
                    continue
                poll.next = NextPoll(
                    race_id, attempt_id, name, payload["handle"], state.value, cap_s,
                    d._poll_at(provider, at, now), deadline, now, near,
                )  # fmt: skip
                if state.value != payload.get("last"):
                    poll.observed = StatusObserved(attempt_id, state, None)
                races.setdefault(race_id, _RaceWork(race_id)).polls.append(poll)
                self.polls += 1
        return races

    # -- 2. load ----------------------------------------------------------------------------
    def _load(self, races: dict[str, _RaceWork]) -> None:
        """The state of every race with a change to report: this process's last save of it,
        else read from Redis, all in one round trip."""
        store = self.driver.store
        missing = []
        for work in races.values():
            if any(p.observed is not None for p in work.polls):
                work.record = store.cached(work.race_id)
                if work.record is None:
                    missing.append(work)
        if missing:
            for work, record in zip(missing, store.load_many([w.race_id for w in missing]),
                                    strict=True):  # fmt: skip
                work.record = record

    # -- 3. apply ---------------------------------------------------------------------------
    def _apply(self, work: _RaceWork, back: HandBack) -> bool:
        """Step the race in memory; False when its polls were handed back or need no write."""
        d = self.driver
        changed = [p for p in work.polls if p.observed is not None]
        if not changed:
            return True  # heartbeat and next arms only
        record = work.record
        if record is None:  # expired or never created: the per-timer path logs and drops it
            _all_back(work, back)
            return False
        state = record.state
        race = Race.from_dict(state["race"], d.clock)
        work.race = race
        if race.finished:  # final: a live attempt (a leak) is still watched, nothing saved
            work.polls = [p for p in work.polls if _live(race, p)]
            return bool(work.polls)
        phases = {a.id: a.phase for a in race.attempts}
        flags = list(race.flags)
        events: list[Event] = []
        for p in changed:
            a = find_attempt(race, p.observed.attempt_id)
            if a is not None and a.phase is Phase.LAUNCHING:  # reported with its first status
                events.append(AttemptSubmitted(a.id, p.handle.job_id, p.timer.payload["handle"]))
            events.append(p.observed)
        try:
            actions = [action for e in events for action in race.handle(e)]
        except ValueError:  # an attempt this copy does not know yet: step it from Redis
            _all_back(work, back)
            return False
        if any(not isinstance(a, ScheduleTimer) for a in actions):
            _all_back(work, back)  # a hedge, a cancel, a winner...
            return False
        after = race.to_dict()
        if not actions and after == state["race"]:
            return True  # already known (a copy saved since): heartbeat and next arms only
        new = dict(state)
        new["race"] = after
        gone = d._note_timers(work.race_id, race, new, actions, record.version + 1)
        data = dumps_dict(new, f"state of race {work.race_id!r}")
        work.step = (new, actions, phases, flags, gone, tuple(events), data)
        return True

    # -- 4. write, 5. perform ------------------------------------------------------------------
    def _write(self, writes: list[_RaceWork], back: HandBack) -> None:
        d = self.driver
        store, timers = d.store, d.timers
        scripts: list[Any] = [store.save_script, timers.arm_script, timers.cancel_script]
        saves: list[tuple[_RaceWork, int, str]] = []  # (race, reply index, save id)

        def build(pipe: Any) -> None:
            saves.clear()
            for work in writes:
                race, step = work.race, work.step
                if step is None:
                    store.queue_touch(pipe, work.race_id)
                else:
                    new, actions, phases, _, _, _, data = step
                    save_id = new_save_id()
                    saves.append((work, len(pipe.command_stack), save_id))
                    store.queue_save(pipe, work.race_id, data, work.record.version, save_id)
                    mark = store.save_mark(work.race_id, work.record.version, save_id)
                    arms = d._arms(work.race_id, new, actions)
                    also, more = d._with_settlements(work.race_id, race, new, phases, arms, mark)
                    scripts.extend(s for s in more if s not in scripts)
                    if also is not None:
                        also(pipe)
                decisions = race.timers.values() if race is not None else None
                for p in work.polls:
                    p.next.queue(d, pipe, decisions or p.timer.payload.get("decide") or ())

        try:
            replies = run_pipeline(store.client, build, scripts)
        except Exception as e:  # nothing known to be written: every poll again, one by one
            log.warning("batched watch write of %d races failed: %s", len(writes), e)
            for work in writes:
                _all_back(work, back)
            return
        for work, index, _ in saves:
            new, actions, phases, flags, gone, events, data = work.step
            try:
                store.saved(work.race_id, replies[index], data, work.record.version)
            except VersionConflict:  # reported again from Redis; the next polls are armed
                for p in work.polls:
                    if p.observed is not None:
                        back(p.timer, _restep(d, work.race_id, p))
                continue
            d._perform(work.race_id, work.race, new, list(actions), phases, flags, gone, events,
                       armed=True)  # fmt: skip


def _all_back(work: _RaceWork, back: HandBack) -> None:
    for p in work.polls:
        back(p.timer, None)


def _live(race: Race, poll: _Poll) -> bool:
    a = find_attempt(race, poll.timer.payload["attempt"])
    return a is not None and a.live


def _conclude(d: RaceDriver, race_id: str, attempt_id: str, provider: str, poll: _Poll,
              cap_s: float) -> Callable[[], None]:  # fmt: skip
    """The per-timer work for a job the batch saw end: fetch, validate and report it."""
    return lambda: d.conclude(race_id, attempt_id, d.providers(provider), poll.handle, cap_s, None)


def _restep(d: RaceDriver, race_id: str, poll: _Poll) -> Callable[[], Any]:
    """The per-timer work for a poll whose batched save lost its version check: the same
    report, stepped from Redis (its next poll already rode in the batch)."""
    observed = poll.observed
    assert observed is not None
    handle_data = poll.timer.payload["handle"]

    def source(race: Race) -> Event | tuple[Event, ...]:
        a = find_attempt(race, observed.attempt_id)
        if a is not None and a.phase is Phase.LAUNCHING:
            return (AttemptSubmitted(a.id, poll.handle.job_id, handle_data), observed)
        return observed

    return lambda: d.step(race_id, source)


__all__ = ["HandBack", "WatchBatch"]
