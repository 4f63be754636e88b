"""Shared pieces of the race driver: the :class:`Effects` seam and small helpers."""

from __future__ import annotations

import math
from typing import Any, Protocol

from ..core.attempts import Attempt
from ..core.race import Race


class Effects(Protocol):
    """Work the driver hands to other processes, and what it tells the caller and Flower."""

    def launch(self, race_id: str, attempt_id: str, provider: str) -> None:
        """Submit the attempt's job somewhere that may block (then call submit_attempt).

        Effects with a true ``launches_here`` attribute run the submit in this process (it
        may die with it): the driver then arms the attempt's launch backstop timer first, and
        they pass its id (``launch_backstop_id``) to ``submit_attempt(..., backstop=...)``.
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
