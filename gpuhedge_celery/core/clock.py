"""Clocks injected into the pure core, so policies and races run on real or virtual time."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Seconds on a monotonic timeline. Only differences between readings are meaningful."""

    def now(self) -> float: ...


class MonotonicClock:
    """The process's monotonic clock (``time.monotonic``): immune to wall-clock steps."""

    def now(self) -> float:
        return time.monotonic()


class WallClock:
    """Epoch seconds (``time.time``): comparable across hosts, used for distributed deadlines."""

    def now(self) -> float:
        return time.time()


class VirtualClock:
    """A clock that only moves when told to: for replays, simulations and table tests."""

    def __init__(self, start: float = 0.0):
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a virtual clock cannot go backwards")
        self._now += seconds
        return self._now

    def set(self, t: float) -> float:
        if t < self._now:
            raise ValueError(f"a virtual clock cannot go backwards ({t} < {self._now})")
        self._now = float(t)
        return self._now
