"""The sim ledger shared through Redis, installed once per worker process.

Sim jobs are pure functions of their handle, the clock and a tiny ledger of cancellations
(:mod:`.simledger`). With the in-process default ledger, a cancel recorded by one Celery worker
would be invisible to another worker watching the same job; installing a
:class:`~.simledger.RedisLedger` makes every process on the same Redis agree about every sim
job's fate. Installation is lazy and per process (never at import: a forked worker must not
inherit its parent's socket).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from .base import Provider
from .simledger import RedisLedger, SimLedger, get_default_ledger, set_default_ledger

__all__ = ["RedisLedger", "install_redis_ledger", "sim_job_running"]

_lock = threading.Lock()
_installed: dict[str, Any] = {}


def install_redis_ledger(client: Any, prefix: str) -> SimLedger:
    """Make a Redis ledger under ``prefix`` this process's default sim ledger (idempotent).

    ``client`` is a redis-py client with ``decode_responses=True``. Returns the ledger in use.
    Re-installs after a fork or when the prefix changes.
    """
    with _lock:
        key = (os.getpid(), prefix, id(client))
        if _installed.get("key") != key:
            ledger = RedisLedger(client, prefix)
            set_default_ledger(ledger)
            _installed["key"] = key
            _installed["ledger"] = ledger
        return get_default_ledger()


CLOCK_SLACK_S = 0.25


def sim_job_running(provider: Provider, handle: Any, slack_s: float = CLOCK_SLACK_S) -> bool:
    """True when a sim job is not (yet) terminal: for audits such as "no sim job left running".

    ``handle`` is a :class:`~gpuhedge_celery.core.jobs.JobHandle` or its dict form. A sim job's
    state is a function of the clock, and the worker that cancelled it read Redis's clock
    (:class:`~gpuhedge_celery.store.redis_clock.RedisClock`, exact to within a round trip) where
    this audit reads its own: the job is judged ``slack_s`` ahead of now, so a cancel whose
    terminal moment that worker's clock put a few milliseconds later is not taken for a running
    job. A job still queued or running for longer than that is.
    """
    from ..core.jobs import JobHandle

    if isinstance(handle, dict):
        handle = JobHandle.from_dict(handle)
    state_at = getattr(provider, "state_at", None)
    if state_at is not None:
        return not state_at(handle, provider.clock.now() + slack_s).terminal
    return not provider.status(handle).terminal
