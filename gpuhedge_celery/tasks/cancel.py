"""Cancelling a pooled request: leave the wait queue if queued, stop the job if running.

For the pool as a race provider (a loser must be cancelled and the cancel confirmed):

* queued (a coordinator waits for a GPU on its behalf): ``LeaseWaiter.leave`` removes it from the
  pool's FIFO; its ``acquire`` raises ``AcquireTimeout`` ("cancelled"), the request fails, no GPU
  was used. Confirmed by ``leave`` returning True.
* running (or in flight to its GPU worker): a stop flag ``<prefix>:{pool:<pool>}:stop:<task id>``
  is set (on the pool's hash tag, so the GPU's start script reads it beside the lease); the
  GPU worker checks it before starting and polls it every ``POLL_S`` while the job runs, stops
  the runner, releases the lease and fails the request with ``RunnerStopped`` ("cancelled").
  Confirmed when :func:`running_on` no longer finds the task on any GPU of the pool.

Revoke with ``terminate=True`` is deliberately not used (it can hit the next task in the process).
"""

from __future__ import annotations

import threading
from typing import Any

from ..store.leases import LeaseStore

POLL_S = 0.2
STOP_TTL_MS = 3_600_000


def stop_key(store: LeaseStore, pool: str, task_id: str) -> str:
    """The stop flag of one pooled request of ``pool``."""
    return store.keys.stop(pool, task_id)


def stop_requested(store: LeaseStore, pool: str, task_id: str) -> bool:
    """Whether someone asked the request ``task_id`` of ``pool`` to stop."""
    with store.guard():
        return bool(store.client.exists(stop_key(store, pool, task_id)))


def running_on(store: LeaseStore, pool: str, task_id: str) -> str | None:
    """The GPU of ``pool`` whose worker is running ``task_id`` right now, or None."""
    gpus = [g.gpu_id for g in store.gpus(pool, live_only=False)]
    if not gpus:
        return None
    with store.guard():
        values = store.client.mget([store.keys.running(pool, g) for g in gpus])  # one slot
    for gpu_id, value in zip(gpus, values, strict=True):
        if value is not None and str(value).startswith(f"{task_id}|"):
            return gpu_id
    return None


def cancel_pooled(store: LeaseStore, pool: str, task_id: str) -> dict[str, Any]:
    """Cancel the pooled request ``task_id`` wherever it is (see the module docstring)."""
    from ..store.waiter import waiter_for

    with store.guard():
        store.client.set(stop_key(store, pool, task_id), "1", px=STOP_TTL_MS)
    left = waiter_for(store).leave(pool, task_id)
    return {"task_id": task_id, "left_queue": left, "running_on": running_on(store, pool, task_id)}


class StopWatch:
    """Polls a request's stop flag from a daemon thread and sets ``stop`` when it appears."""

    def __init__(self, store: LeaseStore, pool: str, task_id: str, stop: threading.Event):
        self.store = store
        self.pool = pool
        self.task_id = task_id
        self.stop = stop
        self.cancelled = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuhedge-stopwatch", daemon=True)

    def start(self) -> StopWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        self._done.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._done.wait(POLL_S):
            try:
                if stop_requested(self.store, self.pool, self.task_id):
                    self.cancelled.set()
                    self.stop.set()
                    return
            except Exception:  # noqa: BLE001 - Redis trouble: the keeper decides about the lease
                continue
