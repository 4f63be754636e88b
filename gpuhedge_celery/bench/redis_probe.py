"""Redis round trips and bytes sent, counted where they are sent (``bench races``).

Redis counts commands (``INFO commandstats``), not round trips: a pipeline of ten commands is
one round trip, and redis-py sends each request with one ``send_packed_command`` call (a plain
command, a whole pipeline, a transaction, a pub/sub (un)subscribe, a health-check ``PING``).
So a round trip is counted here, client-side, as one call of that method, with the bytes it
sends. Everything a process sends through redis-py is counted: the race store and timers, and
Celery's broker (kombu's ``BRPOP`` polls), result backend and task events alike.

* In the bench's coordination workers: ``GPUHEDGE_PLUGINS`` imports this module, and with
  ``GPUHEDGE_BENCH_PROBE_DIR`` set it installs the counter and a thread that writes the
  process's totals to ``<dir>/probe-<pid>.json`` every :data:`WRITE_INTERVAL_S` (a file, not
  Redis, so the counting adds no round trip). :func:`read_totals` adds the files up.
* In the bench client: :func:`install` counts its own requests (its share of Redis's
  ``total_net_input_bytes``).

Without ``GPUHEDGE_BENCH_PROBE_DIR`` importing it does nothing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

DIR_ENV = "GPUHEDGE_BENCH_PROBE_DIR"
WRITE_INTERVAL_S = 0.05

_lock = threading.Lock()
_totals = {"round_trips": 0, "bytes": 0}
_installed = False


def _size(command: Any) -> int:
    if isinstance(command, (bytes, bytearray, memoryview, str)):
        return len(command)
    return sum(len(chunk) for chunk in command)


def install() -> None:
    """Count every request redis-py sends from this process (once; idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        from redis.connection import AbstractConnection

        original = AbstractConnection.send_packed_command

        def send_packed_command(self: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
            size = _size(command)
            with _lock:
                _totals["round_trips"] += 1
                _totals["bytes"] += size
            return original(self, command, *args, **kwargs)

        AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]
        _installed = True


def totals() -> dict[str, int]:
    """This process's counts so far."""
    with _lock:
        return dict(_totals)


def _write_loop(directory: Path) -> None:
    path = directory / f"probe-{os.getpid()}.json"
    tmp = directory / f".probe-{os.getpid()}.tmp"
    while True:
        tmp.write_text(json.dumps(totals()))
        tmp.replace(path)
        time.sleep(WRITE_INTERVAL_S)


def read_totals(directory: Path) -> dict[str, int]:
    """The workers' counts so far, added up (files written within the last interval)."""
    out = {"round_trips": 0, "bytes": 0}
    for path in directory.glob("probe-*.json"):
        try:
            found = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for key in out:
            out[key] += int(found.get(key, 0))
    return out


def _start_in_worker() -> None:
    directory = os.environ.get(DIR_ENV)
    if not directory:
        return
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    install()
    threading.Thread(
        target=_write_loop, args=(path,), name="gpuhedge-bench-probe", daemon=True
    ).start()


_start_in_worker()
