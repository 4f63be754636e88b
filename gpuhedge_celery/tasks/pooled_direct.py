"""The caller's side of direct dispatch: a pooled request sent straight to a free GPU's queue.

``pooled_infer.delay()`` / ``apply_async()`` and :func:`~.pooled_result.send_pooled` first try
:func:`send_direct`: when the pool's wait queue is empty and one of its GPUs is free, the caller
claims that GPU and records the request as handed to it (one script, ``store/direct.py``), then
sends ``gpu_run`` under the request's own task id to the GPU's queue. The caller's
``AsyncResult`` is the same either way: ``gpu_run``'s result, which is what ``pooled_infer``
returns after it hands its job to a GPU. This skips one Celery hop through a coordination
worker (see docs/benchmarks.md for what it saves). Anything else (somebody waits, nothing is
free, Celery options other than ``queue``, ``GPUHEDGE_POOL_DIRECT=off``) sends ``pooled_infer``
to wait as usual.

In Flower a direct request shows as ``gpuhedge.gpu_run`` only, without a ``pooled_infer``
before it. Its message carries the header :data:`DIRECT_HEADER`, so the GPU worker counts its
wait for a GPU (``gpuhedge_pool_wait_seconds``) as 0: it waited in no queue, and without that
the histogram would count only the requests that did.
"""

from __future__ import annotations

import os
import time
from functools import lru_cache
from typing import Any

from .. import settings as process_settings
from ..errors import ConfigError, GpuHedgeError, StoreUnavailable
from ..store.direct import DirectClaims
from ..store.pooled import PooledRecords
from .pooled_args import check_arguments

DIRECT_OPTIONS = frozenset({"queue"})  # Celery options a direct send can honour
# message header of a direct send: gpu_run counts the request's pool wait as 0 (it never queued)
DIRECT_HEADER = "gpuhedge_direct"
DIRECT_KWARGS = frozenset({"pool", "labels", "timeout_s"})  # pooled_infer's, as a caller sends them


def direct_enabled(app: Any) -> bool:
    """``GPUHEDGE_POOL_DIRECT`` of the app's configuration (else this process's settings): on
    unless ``off``."""
    config = getattr(app, "gpuhedge_config", None)
    if config is not None:
        return bool(config.pool_direct)
    return process_settings.current().pool_direct


def send_direct(
    app: Any, records: PooledRecords, task_id: str, args: Any, kwargs: Any, options: dict[str, Any]
) -> bool:
    """Send the request straight to a free GPU (see the module docstring): True when it went,
    False when it should be sent to wait in the queue. ``records``: the deployment's pooled
    records (``records_for(app)``). A publish that raises gives the GPU back and forgets the
    record before the error goes to the caller."""
    from .app import TASK_GPU_RUN, gpu_queue

    args, kwargs = tuple(args or ()), dict(kwargs or {})
    if (
        len(args) != 1
        or set(kwargs) - DIRECT_KWARGS
        or set(options) - DIRECT_OPTIONS
        or not direct_enabled(app)
    ):
        return False
    try:
        check_arguments(
            kwargs.get("pool", "default"), kwargs.get("labels"), kwargs.get("timeout_s")
        )
    except ConfigError:
        return False  # pooled_infer refuses it with this one-line error, as it always did
    claims = claims_for(app, records)
    try:
        lease = claims.claim(task_id, args, kwargs, options.get("queue"))
    except StoreUnavailable:
        # The script may have run and its reply been lost: asking again returns the same
        # lease (or raises again, and the caller sees Redis is away, as the queued path's
        # record write would show it).
        lease = claims.claim(task_id, args, kwargs, options.get("queue"))
    except GpuHedgeError:
        return False  # refused by Redis (not run): the queued path reports what is wrong
    if lease is None:
        return False
    job_kwargs = {"attempt": 0, "labels": kwargs.get("labels"), "leased_at": time.time()}
    try:
        app.send_task(
            TASK_GPU_RUN,
            args=(args[0], lease.to_dict()),
            kwargs=job_kwargs,
            task_id=task_id,
            queue=gpu_queue(lease.gpu_id),
            headers={DIRECT_HEADER: 1},
        )
    except BaseException:
        claims.undo(lease)
        raise
    return True


def claims_for(app: Any, records: PooledRecords) -> DirectClaims:
    """The direct claims of the deployment ``app`` belongs to (one per process)."""
    from .result import _settings

    settings = _settings(app)
    return _claims(os.getpid(), settings.redis_url, settings.prefix, records)


@lru_cache(maxsize=16)
def _claims(pid: int, redis_url: str, prefix: str, records: Any) -> DirectClaims:
    from ..store.connection import client_for
    from ..store.leases import LeaseStore

    return DirectClaims(LeaseStore(client_for(redis_url), prefix), records)
