"""A pooled request from send to end: its record in Redis, and a ``.get()`` that never hangs.

``pooled_infer.delay()`` / ``apply_async()`` (and :func:`send_pooled`, for apps that call
``send_task`` by name) send the request straight to a free GPU when nobody waits
(``tasks/pooled_direct.py``), else write the request's record before its message goes out
(``store/pooled.py``): a reconcile pass can then send again a request whose message the broker
lost before any worker took it (``tasks/pooled_sweep.py``). Each end of the request (a result
or an error stored by ``pooled_infer`` or ``gpu_run``) deletes the record.

They return a :class:`PooledResult`: an AsyncResult that waits in slices of
:data:`RECHECK_S`, and between slices checks that Redis still knows the request. A record that
is gone with no result stored, on two checks :data:`LOST_AFTER_S` apart, means Redis lost it
together with the message (a restart that lost its last writes): ``.get()`` raises
:class:`~gpuhedge_celery.errors.RequestLost` instead of waiting for ever. A caller that gave a
``timeout`` still gets Celery's ``TimeoutError`` at that timeout, as usual.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

from celery import Task, states
from celery.result import AsyncResult
from celery.utils import uuid

from ..errors import GpuHedgeError, RequestLost
from ..store.keys import Keys
from ..store.pooled import PooledRecords, PoolRecords, recordable
from .pooled_args import check_request_size
from .pooled_direct import send_direct
from .sending import broker_errors

RECHECK_S = 2.0  # how often a waiting caller re-reads the stored result and the record
LOST_AFTER_S = 3.0  # a record gone this long, with no result, is a lost request


class PooledResult(AsyncResult):
    """``pooled_infer``'s AsyncResult; see the module docstring."""

    def __init__(
        self,
        id: str,  # noqa: A002
        *args: Any,
        recorded: bool = False,
        pool: str = "",
        **kwargs: Any,
    ) -> None:
        super().__init__(id, *args, **kwargs)
        self.recorded = recorded  # whether its record was written (else it is never "lost")
        self.pool = pool  # the pool its record is under
        self._gone_since: float | None = None

    def get(
        self,
        timeout: float | None = None,
        propagate: bool = True,
        interval: float = 0.5,
        **kwargs: Any,
    ) -> Any:
        from .result import get_in_slices

        def fetch(slice_s: float) -> Any:
            return super(PooledResult, self).get(
                timeout=slice_s, propagate=propagate, interval=interval, **kwargs
            )

        return get_in_slices(fetch, timeout, RECHECK_S, self._check_known)

    def _check_known(self) -> None:
        if not self.recorded or not self.pool:
            return
        try:
            known = records_for(self.app).of(self.pool).known(self.id)
            if not known:  # ended meanwhile: the record goes only after the result is stored
                known = self.backend.get_task_meta(self.id).get("status") in states.READY_STATES
        except (GpuHedgeError, OSError):
            return  # Redis unreachable: nothing can be decided now; the next slice looks again
        if known:
            self._gone_since = None
            return
        now = time.monotonic()
        if self._gone_since is None:
            self._gone_since = now
        elif now - self._gone_since >= LOST_AFTER_S:
            raise RequestLost(self.id)


class PooledTask(Task):
    """``pooled_infer``'s task class: records the request before sending it; its end forgets it."""

    def AsyncResult(self, task_id: str, **kwargs: Any) -> PooledResult:  # noqa: N802 - Celery's
        kwargs.setdefault("backend", self.app.backend)
        return PooledResult(task_id, task_name=self.name, app=self.app, **kwargs)

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        if self.app.conf.task_always_eager or options.get("producer") is not None:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        _check_size(args, kwargs)
        task_id = task_id or uuid()
        records = records_for(self.app)
        pool = _pool_of(args, kwargs)
        with broker_errors(self.app):
            if send_direct(self.app, records, task_id, args, kwargs, options):  # a free GPU
                return self.AsyncResult(task_id, recorded=True, pool=pool)
        if not recordable(pool):  # pooled_infer refuses it with a one-line ConfigError
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        mine = records.of(pool)
        mine.sent(task_id, args or (), kwargs or {}, int(time.time() * 1000), options.get("queue"))
        with _unsent_forgotten(mine, task_id), broker_errors(self.app):
            result = super().apply_async(args, kwargs, task_id=task_id, **options)
        if isinstance(result, PooledResult):
            result.recorded, result.pool = True, pool
        return result

    def after_return(self, status: str, *args: Any, **kwargs: Any) -> None:
        forget_on_end(self, status)


class PooledEndTask(Task):
    """``gpu_run``'s task class: the request's end (a stored result or error) forgets it."""

    def after_return(self, status: str, *args: Any, **kwargs: Any) -> None:
        forget_on_end(self, status)


def forget_on_end(task: Task, status: str) -> None:
    """Delete the request's record once its result or error is stored (never on a replace,
    a retry or a rejection: the request goes on)."""
    if status not in (states.SUCCESS, states.FAILURE) or not task.request.id:
        return
    args, kwargs = tuple(task.request.args or ()), dict(task.request.kwargs or {})
    lease = kwargs.get("lease", args[1] if len(args) > 1 else None)
    pool = lease.get("pool") if isinstance(lease, dict) else _pool_of(args, kwargs)
    if not recordable(pool):
        return
    try:
        records_for(task.app).of(pool).forget(task.request.id)
    except GpuHedgeError:  # the record expires with its TTL; nothing waits on it
        pass


def send_pooled(
    app: Any, request: Any, *, task_id: str | None = None, direct: bool = True, **kwargs: Any
) -> Any:
    """``pooled_infer`` for an app that calls it by name (``send_task``), recorded the same way;
    ``kwargs``: ``pool``, ``labels``, ``timeout_s``, and Celery's options (``queue``, ...).
    ``direct=False`` always sends it to wait in the queue, whatever ``GPUHEDGE_POOL_DIRECT``."""
    from .app import QUEUE_POOL, TASK_POOLED_INFER

    task_kwargs = {k: kwargs.pop(k) for k in ("pool", "labels", "timeout_s") if k in kwargs}
    kwargs.setdefault("queue", QUEUE_POOL)
    check_request_size(request)
    task_id = task_id or uuid()
    records = records_for(app)
    pool = _pool_of((), task_kwargs)
    with broker_errors(app):
        if direct and send_direct(app, records, task_id, (request,), task_kwargs, kwargs):
            return PooledResult(task_id, app=app, backend=app.backend, recorded=True, pool=pool)
    if not recordable(pool):  # pooled_infer refuses it with a one-line ConfigError
        app.send_task(
            TASK_POOLED_INFER, args=(request,), kwargs=task_kwargs, task_id=task_id, **kwargs
        )
        return PooledResult(task_id, app=app, backend=app.backend)
    mine = records.of(pool)
    mine.sent(task_id, (request,), task_kwargs, int(time.time() * 1000), kwargs["queue"])
    with _unsent_forgotten(mine, task_id), broker_errors(app):
        app.send_task(
            TASK_POOLED_INFER, args=(request,), kwargs=task_kwargs, task_id=task_id, **kwargs
        )
    return PooledResult(task_id, app=app, backend=app.backend, recorded=True, pool=pool)


def _pool_of(args: Any, kwargs: Any) -> Any:
    """The pool a ``pooled_infer`` call names (its second argument, or ``pool=``)."""
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    return kwargs.get("pool", args[1] if len(args) > 1 else "default")


def _check_size(args: Any, kwargs: Any) -> None:
    """The caller's request within ``GPUHEDGE_REQUEST_MAX_BYTES`` before anything is stored or
    sent (a request given neither way is left to the worker's own error)."""
    if args:
        check_request_size(tuple(args)[0])
    elif kwargs and "request" in kwargs:
        check_request_size(kwargs["request"])


@contextlib.contextmanager
def _unsent_forgotten(records: PoolRecords, task_id: str) -> Iterator[None]:
    """A publish that raised sent nothing (the caller sees the error and may send again): its
    record goes, or the sweep would find it on no queue and send it a second time."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(GpuHedgeError):
            records.forget(task_id)
        raise


def records_for(app: Any) -> PooledRecords:
    """The pooled-request records of the deployment ``app`` belongs to."""
    from .result import _settings

    settings = _settings(app)
    return _records(os.getpid(), settings.redis_url, settings.prefix)


@lru_cache(maxsize=16)
def _records(pid: int, redis_url: str, prefix: str) -> PooledRecords:
    from ..store.connection import client_for

    return PooledRecords(client_for(redis_url), Keys(prefix))
