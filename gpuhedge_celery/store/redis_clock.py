"""Epoch time as Redis tells it: one clock for every coordination host, whatever their own say.

Race timers, heartbeats, deadlines and the janitor's staleness test compare epoch times taken
on different hosts. With each host's own clock, a host whose clock runs 2 s ahead claims timers
2 s early (a hedge launched before its time changes who wins) and a janitor on such a host
takes live races for dead ones. :class:`RedisClock` reads Redis's ``TIME`` once per
``sync_s`` and in between adds this host's monotonic clock, so every host reads the same epoch
time to within a round trip, and stepping a host's wall clock (NTP, a VM pause, an operator)
changes nothing.

If Redis cannot be reached to re-sync, the last offset stays in use (a monotonic clock does not
drift much in seconds); before the first sync the host's own clock is used.

A sync takes the reply as read at the middle of its round trip. A thread held up (by the GIL,
on a busy worker) between taking the time and sending, or between the reply and reading it,
makes the round trip long and that midpoint wrong by up to half of it; each sync therefore makes
three round trips and keeps the shortest.
"""

from __future__ import annotations

import threading
import time
from typing import Any

SYNC_S = 10.0
SAMPLES = 3  # TIME round trips per sync; the shortest one's midpoint is kept


class RedisClock:
    """``now()``: epoch seconds on Redis's clock (see the module docstring)."""

    def __init__(self, client: Any, sync_s: float = SYNC_S):
        if sync_s <= 0:
            raise ValueError(f"sync_s must be > 0, got {sync_s}")
        self.client = client
        self.sync_s = sync_s
        self._offset: float | None = None  # Redis epoch minus this host's monotonic clock
        self._synced_at = float("-inf")  # monotonic
        self._lock = threading.Lock()
        self.syncs = 0

    def now(self) -> float:
        mono = time.monotonic()
        if mono - self._synced_at >= self.sync_s:
            self._sync(mono)
        offset = self._offset
        if offset is None:
            return time.time()
        return mono + offset

    @property
    def skew_s(self) -> float | None:
        """This host's wall clock minus Redis's (None before the first sync)."""
        if self._offset is None:
            return None
        return time.time() - (time.monotonic() + self._offset)

    def _sync(self, mono: float) -> None:
        if not self._lock.acquire(blocking=False):
            return  # another thread is syncing; the last offset serves meanwhile
        try:
            if mono - self._synced_at < self.sync_s:
                return
            self._synced_at = mono  # also after a failure: retried at the next period
            best: tuple[float, float] | None = None  # (round trip, offset)
            for _ in range(SAMPLES):
                before = time.monotonic()
                try:
                    seconds, micros = self.client.time()
                except Exception:
                    break
                after = time.monotonic()
                redis_now = float(seconds) + float(micros) / 1e6
                sample = (after - before, redis_now - (before + after) / 2)
                best = sample if best is None or sample[0] < best[0] else best
            if best is None:
                return
            self._offset = best[1]
            self.syncs += 1
        finally:
            self._lock.release()
