"""Process liveness for the wait queue: is the process behind a queued waiter still there?

Each waiter's queue entry names its process (``process_id``). ``wait_claim.lua`` treats that
process as dead, and removes its entries when it walks the queue for a free GPU, on either of
two signals, both read at the moment a GPU frees, never waited for as events:

* **Gone.** The process's :class:`~.listener.KeyspaceListener` stays subscribed to the process's
  own channel (``Keys.proc_channel``); when the process exits or is killed its socket closes
  and Redis drops the subscription at once, so ``PUBSUB NUMSUB`` reads 0.
* **Silent.** :class:`ProcessBeat`, a daemon thread started by the listener, records the Redis
  server's time under the process id every ``BEAT_S`` in the ``procs`` sorted set of each pool
  the process waits on (:meth:`ProcessBeat.join`): beside the pool's queue, on its hash tag, so
  one script reads both. A heartbeat
  older than ``PROCESS_TTL_MS`` means the process is paused (SIGSTOP, a debugger) or its host is
  cut off with the socket still open. Heartbeats and checks both use the server's clock
  (``TIME`` inside the scripts), so clock skew between hosts does not shift the bound.

Keyspace ``expired`` events are not used for this: with many volatile keys they arrive seconds
late.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from typing import Any

from .keys import Keys
from .scripts import lua_script

log = logging.getLogger(__name__)

# Heartbeat period, and the silence after which a process counts as dead (5 missed beats).
BEAT_S = 0.2
PROCESS_TTL_MS = 1000
# Entries of processes silent this long are deleted (a missing process counts as dead anyway).
FORGET_MS = 60_000


def new_process_id() -> str:
    """``host:pid:random``: unique per process start, never containing ``|`` or spaces."""
    host = "".join(c for c in socket.gethostname() if c.isalnum() or c in "-._") or "host"
    return f"{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class ProcessBeat:
    """A daemon thread that keeps this process marked alive for its queued waiters."""

    def __init__(self, client: Any, keys: Keys):
        self.client = client
        self.keys = keys
        self.process_id = new_process_id()
        self._script = lua_script(client, "proc_beat")
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self._lock = threading.Lock()
        self._waits: dict[str, int] = {}  # pool -> waits of this process on it now
        self._beaten: set[str] = set()  # every pool this process beat for (dropped at close)

    def join(self, pool: str) -> None:
        """One more wait of this process on ``pool``: beat there every BEAT_S (each check of
        the wait, ``wait_claim.lua``, beats there too)."""
        with self._lock:
            self._waits[pool] = self._waits.get(pool, 0) + 1
            self._beaten.add(pool)

    def leave(self, pool: str) -> None:
        """One wait on ``pool`` ended; with none left the process stops beating there."""
        with self._lock:
            left = self._waits.get(pool, 0) - 1
            if left > 0:
                self._waits[pool] = left
            else:
                self._waits.pop(pool, None)

    def beat(self) -> None:
        """Record one heartbeat now in each pool waited on (raises the driver's error when
        Redis is unreachable)."""
        with self._lock:
            pools = sorted(self._waits)
        for pool in pools:
            self._beat_pool(pool)

    def _beat_pool(self, pool: str) -> None:
        self._script(keys=[self.keys.procs(pool)], args=[self.process_id, FORGET_MS])

    def start(self) -> ProcessBeat:
        """Beat once (so a waiter queued right after is already live), then every BEAT_S."""
        self.beat()
        self._thread = threading.Thread(target=self._run, name="gpuhedge-beat", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop beating and drop the process at once (its waiters' entries then count as dead)."""
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._lock:
            pools = sorted(self._beaten)
        try:
            for pool in pools:
                self.client.zrem(self.keys.procs(pool), self.process_id)
        except Exception:  # noqa: BLE001 - the entry is forgotten after FORGET_MS anyway
            pass

    def _run(self) -> None:
        while not self._stopped.wait(BEAT_S):
            try:
                self.beat()
            except Exception as e:  # noqa: BLE001 - keep beating; waiters see Redis errors too
                if not self._failing:
                    log.warning("waiter heartbeat failed (%s); retrying every %g s", e, BEAT_S)
                self._failing = True
                continue
            self._failing = False
