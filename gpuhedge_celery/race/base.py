"""Shared pieces of the race driver: the :class:`Effects` seam, what a driver is built from
(:class:`RaceParts`), one step decided before its save (:class:`Step`), the reference to one
attempt's job (:class:`JobRef`), and small helpers."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..core.attempts import Attempt, Phase
from ..core.clock import Clock, WallClock
from ..core.jobs import JobHandle
from ..core.race import Race
from ..core.race_events import Action, Event
from ..store.races import new_save_id
from .settings import RaceSettings

if TYPE_CHECKING:
    from ..providers.base import Provider
    from ..store.races import RaceStore
    from ..store.round_trip import RoundTrip
    from ..store.timers import RaceTimers
    from ..webhooks.settings import WebhookSettings


class Effects(Protocol):
    """Work the driver hands to other processes, and what it tells the caller and Flower."""

    def launch(self, race_id: str, attempt_id: str, provider: str) -> None:
        """Submit the attempt's job somewhere that may block (then call submit_attempt).

        Effects with a true ``launches_here`` attribute run the submit in this process (it
        may die with it): the driver then arms the attempt's launch backstop timer first, and
        they pass its id (``launch_backstop_id``) to ``submit_attempt`` in its ``SubmitHow``.
        Without it (a task queue's redelivery covers a crash) no backstop is armed.
        """

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


@dataclass
class RaceParts:
    """What a :class:`~.driver.RaceDriver` is built from: the race store and the races' timers
    (a race's on its shard's timer store: ``timers.of(race_id)``), the providers by name,
    the effects, and the optional parts (``webhooks`` None: the process's settings;
    ``budget`` None: no caps; ``adaptive`` None: adaptive policies learn only in this
    process)."""

    store: RaceStore
    timers: RaceTimers
    providers: Callable[[str], Provider]
    effects: Effects
    settings: RaceSettings = field(default_factory=RaceSettings)
    clock: Clock = field(default_factory=WallClock)
    webhooks: WebhookSettings | None = None
    budget: Any = None  # a RaceBudget (race/budget.py imports modules that import this one)
    adaptive: Any = None  # an AdaptiveStore: where finished races share what they observed


@dataclass(frozen=True)
class JobRef:
    """One attempt's submitted job, as its watch polls and its conclusion know it (the watch
    timer's payload carries the same fields)."""

    race_id: str
    attempt_id: str
    provider: str
    handle: dict[str, Any]
    cap_s: float

    @property
    def job(self) -> JobHandle:
        return JobHandle.from_dict(self.handle)

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> JobRef:
        """From a watch timer's payload."""
        cap_s = float(payload.get("cap_s", 180.0))
        return cls(
            payload["race"], payload["attempt"], payload["provider"], payload["handle"], cap_s
        )


@dataclass
class Step:
    """A step decided from the race at ``version``; performed once its save has won."""

    race_id: str
    race: Race
    state: dict[str, Any]  # the state to save
    version: int  # the version the step was decided from
    actions: list[Action]
    phases: dict[str, Phase]  # each attempt's phase before the step
    flags: list[str]  # the race's flags before the step
    events: tuple[Event, ...]
    gone: list[str] = field(default_factory=list)  # ids of timers the race no longer wants
    save_id: str = field(default_factory=new_save_id)
    late: bool = False  # a loser's late result, taken by a race already finished
    # What rode in the save: its timer arms, the winner claim, the finish (its receipt).
    armed: bool = False
    claim: Any = None  # the outcome's RiddenClaim
    receipt: dict[str, Any] | None = None
    told: Any = None  # the outcome's RiddenTell (replicas to wait for, a step that tells)

    def wants(self, kind: type[Action]) -> bool:
        return any(isinstance(a, kind) for a in self.actions)

    @property
    def caps(self) -> dict[str, Any]:
        return (self.state.get("spec") or {}).get("caps_s") or {}


class Driver(Protocol):
    """What the driver's collaborators (submit, watch, conclude, cancel, outcome, recovery)
    use of the :class:`~.driver.RaceDriver` that owns them: its parts, each other, and its
    step. Typed here so that none of them imports the driver module (no import cycle)."""

    store: RaceStore
    timers: RaceTimers
    providers: Callable[[str], Provider]
    effects: Effects
    settings: RaceSettings
    clock: Clock
    webhooks: WebhookSettings
    budget: Any
    adaptive: Any
    submitter: Any
    watcher: Any
    concluder: Any
    canceller: Any
    outcome: Any
    recovery: Any

    def step(
        self,
        race_id: str,
        event: Any,
        update: Callable[[dict[str, Any]], None] | None = None,
        trip: RoundTrip | None = None,
        answered: Any = None,
    ) -> Race | None: ...

    def launch(self, race_id: str, attempt_id: str, provider: str, armed: bool = False) -> None: ...


def find_attempt(race: Race, attempt_id: str) -> Attempt | None:
    """The race's attempt called ``attempt_id``, or None."""
    return next((a for a in race.attempts if a.id == attempt_id), None)


def due_ms(at: float) -> int:
    """A race clock reading (epoch s) as the timer due time (epoch ms) that fires it."""
    # Round up, so a timer claimed at its due millisecond is never early for the engine.
    return int(math.ceil(at * 1000.0))


MAX_DECIDED = 10_000  # entries of each in-process memo (decided cancels, fresh results)


def remember(memo: dict[Any, Any], key: Any, value: Any) -> None:
    """Keep ``value`` until its consumer pops it; an unconsumed memo never grows unbounded
    (effects that run cancels elsewhere, results that never win)."""
    if len(memo) > MAX_DECIDED:
        memo.clear()
    memo[key] = value
