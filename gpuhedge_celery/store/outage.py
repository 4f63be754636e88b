"""Redis calls that wait out an outage instead of failing the work they belong to.

A pooled request must end with a result or an explicit failure, never with "Redis was away for
a moment", and a provider job that was just submitted must be registered, or nothing could
cancel it. Every Redis call ``pooled_infer`` and ``gpu_run`` make outside the lease waiter and
keeper (which have their own outage handling), and a race's registration of a submitted job,
go through :func:`through_outage`: on :class:`StoreUnavailable` it waits for Redis to answer
PING again and repeats the call, for at most ``limit_s`` (``OUTAGE_WAIT_S`` unless told) in
all, then lets the error through.

The calls it wraps are reads, or writes whose repetition is harmless (``SET`` or ``HSET`` of
the same value, a delete of our own record); a GPU release whose first answer was lost is
handled by ``tasks/gpu_steps.py``'s ``finish``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import StoreUnavailable
from .connection import wait_for_redis

OUTAGE_WAIT_S = 120.0  # how long a pooled request waits for Redis to come back, in all
RETRY_PAUSE_S, RETRY_PAUSE_MAX_S = 0.05, 1.0  # between repeats once Redis answers PING again

log = logging.getLogger(__name__)

T = TypeVar("T")


def through_outage(
    client: Any,
    what: str,
    call: Callable[[], T],
    *,
    limit_s: float = OUTAGE_WAIT_S,
    on_retry: Callable[[], None] | None = None,
) -> T:
    """``call()``, repeated once Redis answers again while it raises StoreUnavailable.

    ``what`` names the step in the warning; ``on_retry`` runs before each repeat (to note that
    the first answer may have been lost).
    """
    give_up = time.monotonic() + limit_s
    pause = RETRY_PAUSE_S
    while True:
        try:
            return call()
        except StoreUnavailable as e:
            left = give_up - time.monotonic()
            if left <= 0:
                raise
            log.warning("%s: %s; waiting up to %.0f s for Redis to come back", what, e, left)
            if not wait_for_redis(client, left):
                raise
            # a primary demoted by a failover still answers PING: without a pause this would
            # spin until the Sentinels name the new one
            time.sleep(min(pause, max(0.0, give_up - time.monotonic())))
            pause = min(pause * 2, RETRY_PAUSE_MAX_S)
            if on_retry is not None:
                on_retry()
