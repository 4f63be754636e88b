"""An attempt's backstop timers: the fixed ids of its launch's and its cancel's, and the drop of
one once the work it guards is reported.

A backstop is a durable timer armed before the work it guards (a launch on this process's
threads, a native cancel), so a crash of this process hands that work to any live worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..store.round_trip import RoundTrip

if TYPE_CHECKING:
    from ..store.timers import TimerStore


def cancel_backstop_id(race_id: str, attempt_id: str) -> str:
    """The fixed id of an attempt's cancel backstop timer."""
    return f"{race_id}|cancel|{attempt_id}"


def launch_backstop_id(race_id: str, attempt_id: str) -> str:
    """The fixed id of an attempt's launch backstop timer (see ``submit_attempt``)."""
    return f"{race_id}|launch|{attempt_id}"


class BackstopDrop:
    """A backstop timer (a launch's or a cancel's) to drop once its work is reported: in a
    round trip already being made (``queue``), or on its own (``now``). Without an id it does
    nothing."""

    __slots__ = ("timers", "timer_id", "queued")

    def __init__(self, timers: TimerStore, timer_id: str | None):
        self.timers, self.timer_id, self.queued = timers, timer_id, False

    def queue(self, pipe: Any) -> None:
        if self.timer_id is not None:
            self.timers.queue_cancel(pipe, self.timer_id)
            self.queued = True

    def ride_ahead(self) -> RoundTrip:
        """A round trip that carries the drop ahead of a save (a step's report of the work)."""
        trip = RoundTrip()
        trip.ahead(self.queue, [self.timers.cancel_script])
        return trip

    def now(self) -> None:
        """Drop it on its own, unless a round trip already carried the drop."""
        if self.timer_id is not None and not self.queued:
            self.timers.cancel(self.timer_id)
            self.queued = True
