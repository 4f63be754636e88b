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

import time
from typing import Any

from celery import Task

from ..errors import AcquireTimeout, ConfigError, EmptyPool, LeaseLost, StaleToken, UnknownPool
from .app import TASK_POOLED_INFER, app, glue_config, gpu_queue
from .cancel import stop_requested
from .gpu import already_done, gpu_run, lease_store


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


def _validate(pool: Any, labels: Any, timeout_s: Any) -> None:
    if not isinstance(pool, str) or not pool or any(c.isspace() for c in pool):
        raise ConfigError(f"expected a pool name without spaces, got {pool!r}", key="pool")
    if labels is not None and (
        not isinstance(labels, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
    ):
        raise ConfigError(f"expected a dict of str to str, got {labels!r}", key="labels")
    if timeout_s is not None and (not isinstance(timeout_s, (int, float)) or timeout_s <= 0):
        raise ConfigError(f"expected seconds > 0, got {timeout_s!r}", key="timeout_s")


@app.task(
    bind=True,
    name=TASK_POOLED_INFER,
    acks_late=True,
    reject_on_worker_lost=True,
    acks_on_failure_or_timeout=True,
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
        _validate(pool, labels, timeout_s)
        store = lease_store()
        if stop_requested(store, self.request.id or ""):
            raise AcquireTimeout(f"request {self.request.id} was cancelled before it waited")
        holder = self.request.id or f"pooled-{time.time_ns()}"
        config = glue_config()
        lease = waiter_for(store).acquire(
            pool,
            holder,
            timeout_s=timeout_s if timeout_s is not None else config.acquire_timeout_s,
            labels=labels,
        )
    except (UnknownPool, EmptyPool, LeaseLost, StaleToken, ConfigError) as e:
        raise celery_safe(e) from None
    job = gpu_run.s(
        request,
        lease.to_dict(),
        attempt=attempt,
        labels=labels,
        leased_at=time.time(),
    ).set(queue=gpu_queue(lease.gpu_id))
    try:
        return self.replace(job)
    except Exception as e:
        from celery.exceptions import Ignore

        if isinstance(e, Ignore):
            raise  # replace's normal way out: the GPU worker owns the request now
        # The job never reached the GPU's queue: give the GPU back rather than strand it.
        try:
            store.release(lease)
        except LeaseLost:
            pass
        raise
