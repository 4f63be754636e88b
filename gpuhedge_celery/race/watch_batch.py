"""The batched watch loop: a batch of due watch polls stepped in memory, saved in one round trip.

The timer service of a coordination worker (with more than one timer thread) hands each
claimed batch of due timers to :meth:`WatchBatch.handle`, in its own thread, before any goes
to a handler thread. For the watch polls of providers that can answer many status polls
at once (``status_and_next_change_many``), it:

1. polls each provider's jobs of the batch in one call;
2. takes the states of the races whose jobs changed from this process's last saves, and reads
   the others in one pipeline;
3. applies every change to its race in memory, through the same engine as a step, several
   polls of one race into one save;
4. sends every save (the same versioned ``race_save.lua``), heartbeat and next-poll arm of the
   batch in one pipeline per race shard (a race's save and arms share its shard's slot);
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

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from ..core.attempts import Phase
from ..core.jobs import JobHandle
from ..core.race import Race
from ..core.race_events import AttemptSubmitted, Event, ScheduleTimer, StatusObserved
from ..errors import StoreUnavailable
from ..providers.base import PollsMany
from ..store.races import SAVE_RETRY_INTERVAL_S, RaceRecord, VersionConflict
from ..store.replicas import NotAcknowledged
from ..store.round_trip import RoundTrip
from ..store.scripts import run_pipeline
from ..store.timers import Timer, store_errors
from .base import JobRef, Step, find_attempt
from .watch import NextPoll

if TYPE_CHECKING:
    from .driver import RaceDriver

log = logging.getLogger(__name__)

WRITE_RETRY_S = 5.0  # a batch's write is sent again while Redis is unreachable, this long
WRITE_RETRY_INTERVAL_S = SAVE_RETRY_INTERVAL_S

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
    step: Step | None = None
    data: Any = None  # the step's state, encoded for the save
    # Decided once, before the first send: a pipeline sent again (NOSCRIPT, a lost answer)
    # carries the same save id and arm ids, so what already ran is recognised, not repeated.
    trip: RoundTrip | None = None  # the step's timer arms and budget settlements

    def decisions(self, poll: _Poll) -> list[float]:
        """The race's decision times as it will be saved, else as ``poll`` last saw them (for
        a provider polled just before each)."""
        if self.race is not None:
            return list(self.race.timers.values())
        return list(poll.timer.payload.get("decide") or ())


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
            if not isinstance(provider, PollsMany):
                back(timer, None)
                continue
            by_provider.setdefault(payload["provider"], []).append(_Poll(timer, handle))
        if not by_provider:
            return
        races = self._poll(by_provider, back)
        self._load(races)
        ready = [work for work in races.values() if self._apply(work, back)]
        for group in self._by_shard(ready):
            self._write(group, back)
        self.batches += 1

    def _by_shard(self, writes: list[_RaceWork]) -> list[list[_RaceWork]]:
        """The writes grouped by race shard: one pipeline per shard, each on one slot."""
        shards = self.driver.timers.shards
        groups: dict[str, list[_RaceWork]] = {}
        for work in writes:
            groups.setdefault(shards.tag_of(work.race_id), []).append(work)
        return list(groups.values())

    # -- 1. poll ----------------------------------------------------------------------------
    def _poll(self, by_provider: dict[str, list[_Poll]], back: HandBack) -> dict[str, _RaceWork]:
        d = self.driver
        races: dict[str, _RaceWork] = {}
        for name, polls in by_provider.items():
            provider: Any = d.providers(name)  # the batched poll is optional: errors fall back
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
                ref = JobRef(race_id, attempt_id, name, payload["handle"], cap_s)
                if state.terminal or now >= deadline:  # fetch, validate, report: per timer
                    back(poll.timer, functools.partial(d.conclude, ref))
                    continue
                at = d.watcher.poll_at(provider, at, now)
                poll.next = NextPoll(ref, state.value, at, now, near)
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
            for work, record in zip(
                missing, store.load_many([w.race_id for w in missing]), strict=True
            ):
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
            observed = cast(StatusObserved, p.observed)  # changed: the polls that observed one
            a = find_attempt(race, observed.attempt_id)
            if a is not None and a.phase is Phase.LAUNCHING:  # reported with its first status
                events.append(AttemptSubmitted(a.id, p.handle.job_id, p.timer.payload["handle"]))
            events.append(observed)
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
            if record.cached:  # this copy may be stale (the race may have ended): from Redis
                _all_back(work, back)
                return False
            return True  # already known (saved since): heartbeat and next arms only
        new = dict(state)
        new["race"] = after
        step = Step(work.race_id, race, new, record.version, actions, phases, flags, tuple(events))
        d.note_timers(step)
        work.step, work.data = step, d.store.encode(work.race_id, new)
        return True

    # -- 4. write, 5. perform ------------------------------------------------------------------
    def _write(self, writes: list[_RaceWork], back: HandBack) -> None:
        """Every save, heartbeat and next arm of the batch in one pipeline, then perform."""
        scripts = self._plan(writes)
        spans: list[tuple[_RaceWork, int, int]] = []  # (race, first and end reply index)

        def build(pipe: Any) -> None:
            spans.clear()
            for work in writes:
                first = len(pipe.command_stack)
                self._queue(pipe, work)
                spans.append((work, first, len(pipe.command_stack)))

        replies = self._send(build, scripts, f"a batch of {len(writes)} races' watch polls")
        if replies is None:
            # Each race's part again, alone, on a timer thread (the same save id and arms). Its
            # first timer carries that work; the others are done with it. Should Redis still
            # refuse it, that timer comes back after its lease and its race is resumed, which
            # arms a poll for every live job again.
            for work in writes:
                back(work.polls[0].timer, functools.partial(self._write_alone, work))
                for p in work.polls[1:]:
                    back(p.timer, _nothing)
            return
        for work, first, end in spans:
            skip = 1 if work.step is not None else 0  # the save's reply is taken below
            errors = [r for r in replies[first + skip : end] if isinstance(r, Exception)]
            if errors:  # an arm or settlement refused: a bug to see (the janitor resumes it)
                log.warning("race %s: batched write: %s", work.race_id, errors[0])
            if work.step is not None:
                self._saved(work, replies[first], back)

    def _write_alone(self, work: _RaceWork) -> None:
        """One race's part of a batch whose round trip failed, sent again alone (the same save
        id and arms); raises if Redis still cannot take it: its timer stays in flight and
        comes back after its lease, to the per-timer path and its crash recovery."""
        scripts = self._plan([work])
        index: list[int] = []

        def build(pipe: Any) -> None:
            index[:] = [len(pipe.command_stack)]
            self._queue(pipe, work)

        with store_errors(f"writing the watch polls of race {work.race_id!r}"):
            replies = run_pipeline(self.driver.store.client, build, scripts)
        if work.step is not None:
            self._saved(work, replies[index[0]], lambda _timer, job: job() if job else None)

    def _plan(self, writes: list[_RaceWork]) -> list[Any]:
        """Give each step its save id and extra commands, once; the scripts they use."""
        d = self.driver
        store, timers = d.store, d.timers
        scripts: list[Any] = [store.save_script, timers.arm_script, timers.cancel_script]
        for work in writes:
            if work.step is not None and work.trip is None:
                work.trip = d.riders(work.step, None)
            if work.trip is not None:
                scripts.extend(s for s in work.trip.scripts if s not in scripts)
        return scripts

    def _queue(self, pipe: Any, work: _RaceWork) -> None:
        """Queue one race's part: its save (or heartbeat), extra commands and next arms."""
        d = self.driver
        step = work.step
        if step is None:
            d.store.queue_touch(pipe, work.race_id)
        else:
            d.store.queue_save(pipe, work.race_id, work.data, step.version, step.save_id)
            cast(RoundTrip, work.trip).queue_after(pipe)
        timers = d.timers.of(work.race_id)
        for p in work.polls:
            # every polled job has its next poll
            cast(NextPoll, p.next).queue(timers, pipe, work.decisions(p))

    def _send(self, build: Callable[[Any], None], scripts: list[Any], what: str) -> list | None:
        """Run the pipeline; while Redis is unreachable, send it again (the same ids) for up
        to ``WRITE_RETRY_S``; None when it could not be sent."""
        give_up = time.monotonic() + WRITE_RETRY_S
        while True:
            try:
                with store_errors(f"writing {what}"):
                    return run_pipeline(
                        self.driver.store.client, build, scripts, raise_on_error=False
                    )
            except StoreUnavailable as e:
                if time.monotonic() >= give_up:
                    log.warning("%s: not written (%s); each race again alone", what, e)
                    return None
                time.sleep(WRITE_RETRY_INTERVAL_S)
            except Exception as e:
                log.warning("%s: not written (%s); each race again alone", what, e)
                return None

    def _saved(self, work: _RaceWork, reply: Any, back: HandBack) -> None:
        """Take one race's save reply: perform its step, or report its polls again."""
        d = self.driver
        step = cast(Step, work.step)
        if isinstance(reply, Exception):  # an error in the save itself: step it the usual way
            log.warning("race %s: batched save failed: %s", work.race_id, reply)
            reply = (0, -1)
        try:
            d.store.saved(work.race_id, reply, work.data, step.version, step.save_id)
        except VersionConflict as e:  # reported again (the next polls are armed), the first
            answer = [e] if e.read else []  # from the state the refusal was answered with
            for p in work.polls:
                if p.observed is not None:
                    back(p.timer, _restep(d, work.race_id, p, answer))
            return
        if work.trip is not None:
            work.trip.send_won(d.store.client)  # a cluster's budget settlements, after the save
        try:
            d.perform(step)
        except NotAcknowledged as e:
            # Only this race's step is left unfinished (an outcome the replicas do not hold
            # yet): its first timer resumes it on a timer thread, where a failure delivers it
            # again; the other races of the batch are performed as usual.
            log.warning("race %s: batched step not performed whole: %s", work.race_id, e)
            back(work.polls[0].timer, functools.partial(d.resume, work.race_id))


def _nothing() -> None:
    return None


def _all_back(work: _RaceWork, back: HandBack) -> None:
    for p in work.polls:
        back(p.timer, None)


def _live(race: Race, poll: _Poll) -> bool:
    a = find_attempt(race, poll.timer.payload["attempt"])
    return a is not None and a.live


def _restep(
    d: RaceDriver, race_id: str, poll: _Poll, answer: list[VersionConflict]
) -> Callable[[], Any]:
    """The per-timer work for a poll whose batched save lost its version check: the same
    report, stepped again (its next poll already rode in the batch). The first of the race's
    polls to run takes the refusal from ``answer`` and starts from the state it carries; the
    others (or all, when it carries none) load the race as usual, by then from what the first
    saved here."""
    observed = poll.observed
    assert observed is not None
    handle_data = poll.timer.payload["handle"]

    def source(race: Race) -> Event | tuple[Event, ...]:
        a = find_attempt(race, observed.attempt_id)
        if a is not None and a.phase is Phase.LAUNCHING:
            return (AttemptSubmitted(a.id, poll.handle.job_id, handle_data), observed)
        return observed

    def work() -> Any:
        try:
            answered = answer.pop()  # atomic: the polls run on several threads
        except IndexError:
            answered = None
        return d.step(race_id, source, answered=answered)

    return work


__all__ = ["HandBack", "WatchBatch"]
