"""Event-driven, FIFO-fair waiting for a free GPU of a pool.

How a wait goes (``LeaseWaiter.acquire``):

1. Register a watch with the process's one :class:`~.listener.KeyspaceListener` (subscribed
   before anything is checked) and clear its event.
2. Run ``wait_claim.lua``: it joins the pool's FIFO queue and claims a free GPU only if every
   live waiter ahead has been given one first, all in one atomic step.
3. Not our turn: wait for the event, but never longer than ``recheck_s`` nor past the moment the
   script says a check may change the outcome: the soonest held lease is due (Redis's own
   ``expired`` event can be seconds late; the next check probes that lease, and reading a
   logically expired key deletes it at once), or a pass-over window closes.
4. On every wake, go back to 2 (claim again and re-validate: another waiter may have won).

Because the event is cleared before each check and set by the listener on any later change,
a GPU freed between the check and the wait cannot strand the waiter. The queue entry is
removed on every exit.

A waiter ahead that does not take a free GPU cannot keep it idle for long:

* its process exited or was killed: Redis drops the process's liveness subscription with its
  socket (:mod:`.liveness`), and the script removes the process's entries as soon as a waiter
  behind walks the queue, i.e. the moment a GPU frees;
* its process is paused (SIGSTOP) or cut off with its socket still open: once its heartbeat is
  ``PROCESS_TTL_MS`` (1 s) old its entries are removed the same way (a paused process that
  resumes joins again at the back);
* until then, or when only the waiting thread is stuck: a waiter that wakes on lease events
  but has not checked within ``PASS_OVER_S`` (75 ms) of the GPU becoming free is passed over
  for that GPU and keeps its place, so the next live waiter in FIFO order takes it;
* a waiter that stopped re-checking altogether is removed after ``3 x recheck_s + 2 s``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import AcquireTimeout, ConfigError
from .leases import Lease, LeaseStore, _check_name, _check_pool, _text, _ttl, now_ms
from .listener import KeyspaceListener, enable_notifications, listener_for
from .liveness import PROCESS_TTL_MS

__all__ = ["LeaseWaiter", "enable_notifications", "waiter_for"]

log = logging.getLogger(__name__)

CLAIMED, CANCELLED = 1, -5
# A queued waiter that has not re-checked for this long (beyond 3 re-check periods) is dead.
LIVENESS_GRACE_S = 2.0
# Probe a due lease just after its deadline: Redis expires a key only once now > deadline.
DUE_SLACK_S = 0.001
# A waiter that wakes on events and has not checked this long after a GPU it would get became
# free is passed over for that GPU (it keeps its place). Live waiters check within a few ms.
PASS_OVER_S = 0.075


class LeaseWaiter:
    """Acquires GPUs of a pool fairly, waking on lease events with a bounded re-check."""

    def __init__(
        self,
        store: LeaseStore,
        *,
        recheck_s: float = 1.0,
        listener: KeyspaceListener | None = None,
    ):
        if not recheck_s > 0:
            raise ConfigError(
                f"expected a re-check interval > 0 s, got {recheck_s!r}", key="recheck_s"
            )
        self.store = store
        self.recheck_s = float(recheck_s)
        self._listener = listener
        # Test hook: called after a check found no GPU and before waiting (the race window).
        self.after_check: Callable[[], None] | None = None

    @property
    def listener(self) -> KeyspaceListener:
        """The process's listener (started on first use, after fork too)."""
        if self._listener is None or not self._listener.alive:
            self._listener = listener_for(self.store.client, self.store.keys)
        return self._listener

    def acquire(
        self,
        pool: str,
        holder: str,
        *,
        ttl_ms: int | None = None,
        timeout_s: float | None = None,
        labels: dict[str, str] | None = None,
    ) -> Lease:
        """Wait for a free GPU of ``pool`` (matching ``labels``) in arrival order and claim it.

        ``holder`` names this wait in the queue and the lease (use the task id): two concurrent
        waits with the same holder share one place in the queue.

        Raises UnknownPool, EmptyPool, AcquireTimeout (also when another process cancelled the
        wait with :meth:`leave`); the queue entry is removed on every exit.
        """
        _check_name(holder, "holder")
        _check_pool(pool)
        if timeout_s is not None and not timeout_s >= 0:
            raise ConfigError(f"expected a timeout >= 0 s, got {timeout_s!r}", key="timeout_s")
        ttl = self.store.pool_ttl(pool) if ttl_ms is None else _ttl(ttl_ms, "ttl_ms")
        started = time.monotonic()
        deadline = None if timeout_s is None else started + timeout_s
        candidates, accepted = self._candidates(pool, labels)
        refreshed = time.monotonic()
        listener = self.listener
        watch = listener.watch(self._lease_keys(pool, candidates), pool)
        listener.beat_for(pool)  # this process's heartbeat beside the pool's queue
        claimed = False
        first = True
        rank = 0
        try:
            while True:
                watch.event.clear()
                reply, since = self._check(pool, holder, ttl, candidates, accepted, first)
                first = False
                code = int(reply[0])
                if code == CLAIMED:
                    claimed = True
                    gpu_id, token, granted = _text(reply[1]), int(reply[2]), int(reply[3])
                    return Lease(gpu_id, pool, token, holder, granted, since)
                if code == CANCELLED:
                    claimed = True  # nothing left to remove
                    raise AcquireTimeout(f"the wait of {holder!r} for pool {pool!r} was cancelled")
                rank, next_ms = int(reply[1]), int(reply[2])
                if self.after_check is not None:
                    self.after_check()
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise AcquireTimeout(
                        f"no GPU of pool {pool!r} became free within {timeout_s:g} s "
                        f"({rank} waiter(s) were ahead)"
                    )
                wait_s = self.recheck_s
                if next_ms >= 0:
                    wait_s = min(wait_s, next_ms / 1000 + DUE_SLACK_S)
                if deadline is not None:
                    wait_s = min(wait_s, deadline - now)
                watch.event.wait(wait_s)
                if time.monotonic() - refreshed >= self.recheck_s:
                    # Once per re-check period: pick up GPUs or hosts that came or went.
                    refreshed = time.monotonic()
                    candidates, accepted = self._candidates(pool, labels)
                    self.listener.rewatch(watch, self._lease_keys(pool, candidates))
        finally:
            watch.close()
            listener.beat_done(pool)
            if not claimed:
                self._leave_quietly(pool, holder)

    def leave(self, pool: str, holder: str) -> bool:
        """Cancel ``holder``'s queued wait (from any process); its acquire raises AcquireTimeout."""
        return self._leave(pool, holder, cancel=True)

    # -- internals --------------------------------------------------------------------------
    def _candidates(self, pool: str, labels: dict[str, str] | None) -> tuple[list[str], str]:
        live = [g.gpu_id for g in self.store.live_gpus(pool)]
        if not labels:
            return live, ""
        matching = [g.gpu_id for g in self.store.live_gpus(pool, labels)]
        return live, ",".join(matching)

    def _lease_keys(self, pool: str, gpu_ids: list[str]) -> list[str]:
        return [self.store.keys.lease(pool, g) for g in gpu_ids]

    def _check(
        self, pool: str, holder: str, ttl: int, gpu_ids: list[str], accepted: str, first: bool
    ) -> tuple[list[Any], int]:
        k = self.store.keys
        keys = [k.waiters(pool), k.waitinfo(pool), k.waitseq(pool), k.procs(pool), k.freeat(pool)]
        for gpu_id in gpu_ids:
            keys += [k.lease(pool, gpu_id), k.fence(pool, gpu_id), k.out(pool, gpu_id)]
        listener = self.listener
        now = now_ms()
        grace_ms = int((3 * self.recheck_s + LIVENESS_GRACE_S) * 1000)
        args = [holder, now, ttl, grace_ms, accepted, k.wake_channel(), pool, int(first)]
        # Only a waiter that wakes on events can be expected to check within the window.
        args += [listener.process_id, k.proc_channel(), PROCESS_TTL_MS, int(PASS_OVER_S * 1000)]
        args.append(int(listener.notifications))
        with self.store.guard():
            return self.store.scripts.wait_claim(keys=keys, args=args + gpu_ids), now

    def _leave(self, pool: str, holder: str, *, cancel: bool) -> bool:
        _check_pool(pool)
        k = self.store.keys
        with self.store.guard():
            removed = self.store.scripts.leave(
                keys=[k.waiters(pool), k.waitinfo(pool)],
                args=[holder, k.wake_channel(), pool, int(cancel)],
            )
        return int(removed) == 1

    def _leave_quietly(self, pool: str, holder: str) -> None:
        try:
            self._leave(pool, holder, cancel=False)
        except Exception as e:  # noqa: BLE001 - the entry ages out by itself if Redis is gone
            log.warning("could not leave the wait queue of pool %s: %s", pool, e)


_waiters: dict[tuple[int, int], LeaseWaiter] = {}
_waiters_lock = threading.Lock()


def waiter_for(store: LeaseStore) -> LeaseWaiter:
    """The per-process shared waiter of ``store`` (one listener connection serves all waits)."""
    key = (os.getpid(), id(store))
    with _waiters_lock:
        found = _waiters.get(key)
        if found is None or found.store is not store:
            found = LeaseWaiter(store)
            _waiters[key] = found
        return found
