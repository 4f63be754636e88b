"""``pooled_infer``: wait fairly for a free GPU of a pool, then hand the job to that GPU's worker.

The waiting happens on a coordination worker (threads pool): ``LeaseWaiter.acquire`` blocks one
thread, woken by keyspace events, in the pool's FIFO queue. With the lease in hand the task
*replaces itself* with ``gpu_run`` on the GPU's own queue, carrying the lease (and its fencing
token). ``replace`` keeps the task id, so the caller's ``AsyncResult`` gets ``gpu_run``'s result,
and nothing ever blocks on ``result.get()`` inside a task.

Result: ``{"output": <runner result>, "gpu_id", "pool", "token", "attempt", "started_at",
"dispatch_s", "run_s"}``. Failures: :class:`UnknownPool`, :class:`EmptyPool`,
:class:`AcquireTimeout`, the runner's own error, or :class:`LeaseLost` once
``GPUHEDGE_MAX_ATTEMPTS`` attempts were refused or lost.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from celery import Task
from celery.exceptions import Ignore

from ..errors import (
    AcquireTimeout,
    ConfigError,
    EmptyPool,
    HandoffFailed,
    LeaseLost,
    StaleToken,
    StoreUnavailable,
    UnknownPool,
)
from ..metrics import record as metrics
from ..store.outage import through_outage
from ..store.pooled import DUPLICATE, HANDED, SUPERSEDED
from .app import REDACTED_REQUEST, TASK_POOLED_INFER, app, glue_config, gpu_queue
from .cancel import stop_requested
from .gpu import already_done, gpu_run, lease_store
from .pooled_args import check_arguments, check_request_size
from .pooled_result import PooledTask, records_for

log = logging.getLogger(__name__)


PUBLISH_RETRY_WAITS_S = (0.2, 0.5, 1.0)  # before each new try of a failed hand-off to a GPU


def celery_safe(exc: BaseException) -> BaseException:
    """Give ``exc`` constructor-shaped ``args`` so Celery's JSON result rebuilds the same type.

    Celery stores ``exc.args`` and rebuilds with ``cls(*args)``; our errors take structured
    arguments (a pool name, a GPU id and token), not their formatted message.
    """
    if isinstance(exc, (UnknownPool, EmptyPool)):
        exc.args = (exc.pool,)
    elif isinstance(exc, StaleToken):
        exc.args = (exc.gpu_id, exc.token, exc.current)
    elif isinstance(exc, LeaseLost):
        exc.args = (exc.gpu_id, exc.token, str(exc))
    elif isinstance(exc, ConfigError):
        exc.args = (str(exc),)
    return exc


OUTAGE_RETRY_S = 1.0  # how often a waiter whose Redis went away tries again


def _acquire_through_outages(
    waiter: Any, pool: str, holder: str, wait_s: float | None, labels: Any
) -> Any:
    """``waiter.acquire``, waiting out a Redis outage or restart (queueing again once it is
    back) instead of failing the request with StoreUnavailable; never past ``wait_s`` in all."""
    give_up = None if wait_s is None else time.monotonic() + wait_s
    while True:
        left = None if give_up is None else max(0.001, give_up - time.monotonic())
        try:
            return waiter.acquire(pool, holder, timeout_s=left, labels=labels)
        except StoreUnavailable as e:
            if give_up is not None and time.monotonic() + OUTAGE_RETRY_S >= give_up:
                raise
            log.warning("request %s: %s; waiting for Redis to come back", holder, e)
            time.sleep(OUTAGE_RETRY_S)


@app.task(
    bind=True,
    base=PooledTask,
    name=TASK_POOLED_INFER,
    acks_late=True,
    reject_on_worker_lost=True,
    acks_on_failure_or_timeout=True,
    throws=(ConfigError, UnknownPool),  # a caller's bad arguments: one WARNING line, no traceback
    Request=REDACTED_REQUEST,  # inspect shows the request's size, not the request
)
def pooled_infer(
    self: Task,
    request: Any,
    pool: str = "default",
    attempt: int = 0,
    labels: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> Any:
    """Run ``request`` on the next free GPU of ``pool`` (FIFO among waiters); return its result."""
    from ..store.waiter import waiter_for

    done, result = already_done(self)
    if done:  # a duplicate delivery of a request that already completed
        return result
    try:
        check_arguments(pool, labels, timeout_s)
        check_request_size(request)  # the caller's .delay() checked it too; not every caller
        store = lease_store()
        stopped = through_outage(
            store.client,
            f"request {self.request.id}: read its stop flag",
            lambda: stop_requested(store, pool, self.request.id or ""),
        )
        if stopped:
            raise AcquireTimeout(f"request {self.request.id} was cancelled before it waited")
        holder = self.request.id or f"pooled-{time.time_ns()}"
        waiter, delivery = waiter_for(store), uuid.uuid4().hex
        records = records_for(self.app).of(pool)
        took = through_outage(
            store.client,
            f"request {holder}: take it",
            lambda: records.take(holder, waiter.listener.process_id, delivery, attempt),
        )
        if took in (DUPLICATE, HANDED):  # the broker delivered it again (store/pooled.py)
            log.info(
                "request %s: a second delivery while another one has it (%s); dropped", holder, took
            )
            raise Ignore()
        config = glue_config()
        wait_s = timeout_s if timeout_s is not None else config.acquire_timeout_s
        waited = time.monotonic()
        lease = _acquire_through_outages(waiter, pool, holder, wait_s, labels)
        metrics.pool_waited(pool, time.monotonic() - waited)
    except AcquireTimeout:
        metrics.pool_wait_gave_up(pool)
        raise
    except (UnknownPool, EmptyPool, LeaseLost, StaleToken, ConfigError) as e:
        raise celery_safe(e) from None
    handed = through_outage(
        store.client,
        f"request {holder}: hand it to a GPU",
        lambda: records.handoff(holder, delivery, lease.gpu_id, lease.token),
    )
    if handed == SUPERSEDED:  # this process was judged dead meanwhile and the request re-sent
        log.warning(
            "request %s: taken again by another delivery while this one waited; GPU %s given back",
            holder,
            lease.gpu_id,
        )
        _give_back(store, lease, holder)
        raise Ignore()
    return hand_to_gpu(
        self, request, lease, attempt, labels, lambda: _give_back(store, lease, holder)
    )


def hand_to_gpu(
    task: Any,
    request: Any,
    lease: Any,
    attempt: int,
    labels: dict[str, str] | None,
    give_back: Any,
    waits_s: tuple[float, ...] = PUBLISH_RETRY_WAITS_S,
) -> Any:
    """Replace ``task`` with ``gpu_run`` on the leased GPU's queue (``Task.replace``).

    A publish that fails is tried again after each of ``waits_s`` (a fresh signature each time:
    ``replace`` links the request's callbacks into the one it is given). A broker connection
    that restarted under a worker thread can fail one publish with an error that is not a
    connection error (kombu's Redis channel closed under it: ``AttributeError``), so every
    error counts. Should a failed publish have reached the broker after all, the second copy
    finds the request's result stored or its lease gone (``gpu_run``), and is dropped. When
    every try failed the lease is given back (``give_back``) and :class:`HandoffFailed`
    raised (the broker's own error is its cause): the caller's request fails explicitly.
    """
    for wait_s in (*waits_s, None):
        job = gpu_run.s(
            request, lease.to_dict(), attempt=attempt, labels=labels, leased_at=time.time()
        ).set(queue=gpu_queue(lease.gpu_id))
        try:
            return task.replace(job)
        except Ignore:
            raise  # replace's normal way out: the GPU worker owns the request now
        except Exception as e:
            if wait_s is None:
                give_back()  # the job never reached the GPU's queue
                cause = f"{type(e).__name__}: {e}"
                raise HandoffFailed(task.request.id, lease.gpu_id, len(waits_s) + 1, cause) from e
            log.warning(
                "request %s: handing it to GPU %s failed (%s: %s); again in %.1f s",
                task.request.id,
                lease.gpu_id,
                type(e).__name__,
                e,
                wait_s,
            )
            time.sleep(wait_s)
    raise AssertionError("unreachable: the last try returns or raises")


def _give_back(store: Any, lease: Any, holder: str) -> None:
    """Release a lease this request will not use, rather than strand the GPU until its TTL."""
    try:
        through_outage(
            store.client, f"request {holder}: give its GPU back", lambda: store.release(lease)
        )
    except LeaseLost:
        pass
