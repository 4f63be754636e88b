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

The simulated providers keep their jobs in a ledger on the same Redis (``RedisLedger``): what a
real provider answers over HTTP, the sim answers from Redis. Those requests are counted apart
as well (``sim_round_trips``, ``sim_bytes``): the ledger's methods are wrapped to mark their
thread while they run, so the bench can report the coordination's own traffic beside the total.

Counting must cost little, or it would inflate the CPU per race it sits beside: a request costs
the probe a size sum, a thread-local read and an uncontended lock, and the totals are written
only when they changed, every :data:`WRITE_INTERVAL_S`.

With ``GPUHEDGE_BENCH_PROBE_SITES=on`` each round trip is also counted by where it was sent
from (:func:`site`): the package's innermost function that sent it and, when that is the store
layer, the function that called the store; else the library module (kombu, celery). Walking the
stack costs CPU, so the CPU figures of a run with sites on are not comparable.

Without ``GPUHEDGE_BENCH_PROBE_DIR`` importing it does nothing.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .. import envvars
from .. import settings as process_settings

DIR_ENV, SITES_ENV = envvars.PROBE_DIR_VAR, envvars.PROBE_SITES_VAR
WRITE_INTERVAL_S = 0.2
_PACKAGE = __name__.rsplit(".", 2)[0]  # gpuhedge_celery
_SKIP = (f"{_PACKAGE}.bench.redis_probe", f"{_PACKAGE}.store.connection")

_lock = threading.Lock()
_totals: dict[str, Any] = {"round_trips": 0, "bytes": 0, "sim_round_trips": 0, "sim_bytes": 0}
_sites: dict[str, int] = {}
_site_bytes: dict[str, int] = {}
_installed = False
_in_ledger = threading.local()  # .depth > 0 while a ledger method runs on this thread


def _short(module: str, function: str) -> str:
    return f"{module.removeprefix(_PACKAGE + '.')}:{function}"


def from_ledger() -> bool:
    """Whether this thread is inside a method of the simulated providers' ledger."""
    return getattr(_in_ledger, "depth", 0) > 0


def _mark_ledger() -> None:
    """Wrap ``RedisLedger``'s methods so that the requests they send are known as the sim's."""
    from ..providers.simledger import RedisLedger

    def marked(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            _in_ledger.depth = getattr(_in_ledger, "depth", 0) + 1
            try:
                return method(*args, **kwargs)
            finally:
                _in_ledger.depth -= 1

        call.__wrapped__ = method  # type: ignore[attr-defined]
        return call

    for name, method in list(vars(RedisLedger).items()):
        if callable(method) and not name.startswith("__"):
            setattr(RedisLedger, name, marked(method))


def site(frame: Any) -> str:
    """Where a request was sent from: ``module:function`` of the package's innermost frame
    (``store`` frames also name their first caller outside the store), else the innermost
    library module outside redis-py."""
    library = None
    inner = None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(_PACKAGE + ".") and module not in _SKIP:
            here = _short(module, frame.f_code.co_name)
            if inner is None:
                inner = here
                if ".store." not in module:
                    return inner
            elif ".store." not in module:
                return f"{here} > {inner}"
        elif library is None and not module.startswith(("redis", "threading")):
            library = module
        frame = frame.f_back
    return inner or library or "?"


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
        by_site = process_settings.current().probe_sites

        def send_packed_command(self: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
            size = _size(command)
            sim = from_ledger()
            where = site(sys._getframe(1)) if by_site else None
            with _lock:
                _totals["round_trips"] += 1
                _totals["bytes"] += size
                if sim:
                    _totals["sim_round_trips"] += 1
                    _totals["sim_bytes"] += size
                if where is not None:
                    _sites[where] = _sites.get(where, 0) + 1
                    _site_bytes[where] = _site_bytes.get(where, 0) + size
            return original(self, command, *args, **kwargs)

        AbstractConnection.send_packed_command = send_packed_command
        _mark_ledger()
        _installed = True


def totals() -> dict[str, Any]:
    """This process's counts so far (``sites`` and ``site_bytes``: round trips and bytes sent
    by :func:`site`, when counted)."""
    with _lock:
        out: dict[str, Any] = dict(_totals)
        if _sites:
            out["sites"] = dict(_sites)
            out["site_bytes"] = dict(_site_bytes)
        return out


def _write_loop(directory: Path) -> None:
    path = directory / f"probe-{os.getpid()}.json"
    tmp = directory / f".probe-{os.getpid()}.tmp"
    written = None
    while True:
        now = totals()
        if now != written:
            tmp.write_text(json.dumps(now))
            tmp.replace(path)
            written = now
        time.sleep(WRITE_INTERVAL_S)


def read_totals(directory: Path) -> dict[str, Any]:
    """The workers' counts so far, added up (files written within the last interval)."""
    counts = ("round_trips", "bytes", "sim_round_trips", "sim_bytes")
    out: dict[str, Any] = {**dict.fromkeys(counts, 0), "sites": {}, "site_bytes": {}}
    for path in directory.glob("probe-*.json"):
        try:
            found = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for key in counts:
            out[key] += int(found.get(key, 0))
        for field in ("sites", "site_bytes"):
            for where, n in (found.get(field) or {}).items():
                out[field][where] = out[field].get(where, 0) + int(n)
    return out


def _start_in_worker() -> None:
    directory = process_settings.current().probe_dir
    if not directory:
        return
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    install()
    threading.Thread(
        target=_write_loop, args=(path,), name="gpuhedge-bench-probe", daemon=True
    ).start()


_start_in_worker()
