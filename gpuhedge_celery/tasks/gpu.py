"""The GPU worker role: registration and host heartbeat, and ``gpu_run``, the job under a lease.

One Celery worker serves one GPU (prefork, one child). Its main process registers the GPU and
heartbeats (:class:`GpuHost`); its child runs :func:`gpu_run` for each job the pool hands it:

1. a message redelivered after this GPU's worker died running it frees the old lease and goes
   back to waiting (the crash may be the job's fault: attempts are bounded);
2. the fencing check refuses a stale or lost lease (back to waiting, bounded); a lease only
   this process's own mark refuses is freed at once and the GPU's fence counter lifted to the
   mark, so the GPU is not left idle and the next claim issues a token it accepts;
3. a :class:`LeaseKeeper` renews the lease; losing it sets the runner's stop flag, so the job
   is stopped (``cpu``/``cmd``/``server`` runners, and ``python`` models that check ``ctx``) or
   its result discarded;
4. a runner that cannot serve (its model still loading or failed to load: it waits up to
   ``GPUHEDGE_RUNNER_WAIT_S`` for it; its model server down) frees the lease at once and the
   request waits for a GPU again;
5. the lease is released and the job's duration recorded for TTL suggestions.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from celery import Task

from ..errors import GpuHedgeError, LeaseLost, StaleToken, StoreUnavailable
from ..metrics import record as metrics
from ..runners import RunContext, Runner, RunnerStopped, RunnerUnavailable, runner_from_spec
from ..store.connection import wait_for_redis
from ..store.leases import GpuInfo, Lease, LeaseKeeper, LeaseStore
from ..store.outage import OUTAGE_WAIT_S, through_outage
from .app import REDACTED_REQUEST, TASK_GPU_RUN, TASK_POOLED_INFER, app, glue_config
from .cancel import StopWatch
from .gpu_steps import STOPPED, RunningRecord, begin, clear_running, finish
from .model_host import wait_ready
from .pooled_direct import DIRECT_HEADER
from .pooled_result import PooledEndTask

log = logging.getLogger(__name__)

_stores: dict[int, LeaseStore] = {}
_runners: dict[tuple[int, str], Runner] = {}
_lock = threading.Lock()


def lease_store() -> LeaseStore:
    """This process's lease store (built lazily, rebuilt after a fork; one per process so the
    coordinator's waiting threads share one waiter and one pub/sub connection)."""
    with _lock:
        store = _stores.get(os.getpid())
        if store is None:
            config = glue_config()
            store = _stores[os.getpid()] = LeaseStore.from_settings(config.settings)
            if config.gpu_id:  # a GPU worker: its GPU's keys are on its pool's tag
                store.expect(config.gpu_id, config.pool)
        return store


def runner_for(pool: str) -> Runner:
    """The runner of this GPU worker (``GPUHEDGE_RUNNER``), built once per process."""
    spec = glue_config().runner
    key = (os.getpid(), spec)
    runner = _runners.get(key)
    if runner is None:
        runner = _runners[key] = runner_from_spec(spec)
    return runner


class GpuHost:
    """Main-process service of a GPU worker: registers its GPU and heartbeats its host."""

    def __init__(
        self, store: LeaseStore, info: GpuInfo, *, host_ttl_ms: int, pool_ttl_ms: int | None = None
    ):
        self.store = store
        self.info = info
        self.host_ttl_ms = host_ttl_ms
        self.pool_ttl_ms = pool_ttl_ms
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> GpuHost:
        """Register the GPU, beat once (so it is live before the first job) and keep beating."""
        if self.pool_ttl_ms is not None:
            self.store.set_pool_ttl(self.info.pool, self.pool_ttl_ms)
        self.store.register_gpu(self.info)
        self.store.host_heartbeat(self.info.host, self.host_ttl_ms)
        self._thread = threading.Thread(target=self._beat, name="gpuhedge-heartbeat", daemon=True)
        self._thread.start()
        log.info(
            "GPU %s registered in pool %s (host %s)",
            self.info.gpu_id,
            self.info.pool,
            self.info.host,
        )
        return self

    def stop(self, *, leave: bool = True) -> None:
        """Stop beating; with ``leave`` the host key is deleted so the GPU leaves the pool now."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if leave:
            try:
                self.store.host_leave(self.info.host)
            except Exception as e:  # noqa: BLE001 - shutting down: the TTL will do it anyway
                log.warning("could not remove host heartbeat of %s: %s", self.info.host, e)

    def _beat(self) -> None:
        interval = self.host_ttl_ms / 3000
        while not self._stop.wait(interval):
            try:
                self.store.host_heartbeat(self.info.host, self.host_ttl_ms)
            except StoreUnavailable as e:
                log.warning("host heartbeat of %s failed, retrying: %s", self.info.host, e)
            except Exception:  # noqa: BLE001 - the heartbeat thread must not die silently
                log.exception("host heartbeat of %s failed", self.info.host)


def back_to_waiting(
    task: Task,
    request: Any,
    pool: str,
    attempt: int,
    reason: str,
    labels: dict[str, str] | None = None,
) -> Any:
    """Send the request back to wait for a GPU (same task id), or fail once attempts run out."""
    limit = glue_config().max_attempts
    if attempt + 1 >= limit:
        message = f"request {task.request.id} gave up after {attempt + 1} attempt(s): {reason}"
        error = LeaseLost("", 0, message)
        error.args = ("", 0, message)  # constructor-shaped, so Celery's JSON result rebuilds it
        raise error
    log.warning(
        "request %s goes back to waiting (attempt %d): %s", task.request.id, attempt + 2, reason
    )
    # by name: pool.py builds on this module, not the other way round
    again = app.signature(
        TASK_POOLED_INFER,
        args=(request,),
        kwargs={"pool": pool, "attempt": attempt + 1, "labels": labels},
    )
    # sending it again records it in Redis first: an outage or a failover at that moment must
    # not fail the request (the record is idempotent; replace ends with Celery's Ignore)
    return through_outage(
        lease_store().client,
        f"request {task.request.id}: sending it back to wait",
        lambda: task.replace(again),
    )


def already_done(task: Task) -> tuple[bool, Any]:
    """Whether this task id already has a stored success (a duplicate delivery), and its result.

    The Redis broker re-delivers a message still unacknowledged after its visibility timeout even
    when the first delivery is alive and finishing; the duplicate must not run the job again.
    """
    try:
        meta = task.backend.get_task_meta(task.request.id)
    except Exception as e:  # noqa: BLE001 - no answer means "not known to be done": run it
        log.warning("could not read the result of %s: %s", task.request.id, e)
        return False, None
    return meta.get("status") == "SUCCESS", meta.get("result")


@app.task(
    bind=True,
    base=PooledEndTask,
    name=TASK_GPU_RUN,
    acks_late=True,
    reject_on_worker_lost=True,
    # An exception is a result (the caller sees it); only a dead worker re-queues the message.
    acks_on_failure_or_timeout=True,
    Request=REDACTED_REQUEST,  # inspect shows the request's size, not the request
)
def gpu_run(
    self: Task,
    request: Any,
    lease: dict[str, Any],
    attempt: int = 0,
    labels: dict[str, str] | None = None,
    leased_at: float | None = None,
) -> dict[str, Any]:
    """Run ``request`` on this worker's GPU under ``lease`` (see the module docstring)."""
    entered = time.time()
    config = glue_config()
    held = Lease.from_dict(lease)
    pool = held.pool
    store = lease_store()
    task_id = self.request.id

    def redis(what: str, call: Any) -> Any:  # a Redis step that waits out an outage
        return through_outage(store.client, f"request {task_id}: {what}", call)

    if held.gpu_id != config.gpu_id:  # not ours to run: free it now
        redis("free a misrouted lease", lambda: store.force_release(held.gpu_id, held.token))
        return back_to_waiting(
            self, request, pool, attempt, f"lease for {held.gpu_id} reached {config.gpu_id}", labels
        )
    done, result = already_done(self)
    if done:
        log.warning("request %s already completed: duplicate delivery ignored", task_id)
        return result
    running = RunningRecord(store, held, task_id)
    try:  # the stop flag, the fencing check and the running record: one script
        began, crashed = redis("start it", lambda: begin(store, held, running))
    except (StaleToken, LeaseLost) as e:
        metrics.lease_lost(pool, "fence")
        return back_to_waiting(self, request, pool, attempt, f"refused: {e}", labels)
    if began == STOPPED:
        finish(store, held, task_id)
        raise RunnerStopped(f"request {task_id} cancelled before it started")
    if crashed:
        # The record of this very job under this very token survived: this GPU's worker died
        # running it and the broker redelivered it. Free the GPU and let the pool decide where
        # it runs next (the crash may have been the job's fault, so attempts are bounded).
        redis("free its old lease", lambda: store.force_release(held.gpu_id, held.token))
        clear_running(store, held.gpu_id, task_id)
        return back_to_waiting(
            self, request, pool, attempt, f"GPU {held.gpu_id} worker died running it", labels
        )
    ctx = RunContext(gpu_id=held.gpu_id, token=held.token, task_id=task_id)
    keeper = LeaseKeeper(store, held, on_lost=lambda _lease, _exc: ctx.stop.set()).start()
    watch = StopWatch(store, held.pool, task_id, ctx.stop).start()
    started = time.time()
    if leased_at is not None:
        metrics.pool_handoff(pool, started - leased_at)
    if self.request.get(DIRECT_HEADER):  # sent straight to this free GPU: it never queued
        metrics.pool_waited(pool, 0.0)
    try:
        runner = runner_for(pool)
        wait_ready(runner, ctx.stop, config.runner_wait_s)
        output = runner.run(request, ctx)
        if keeper.lost.is_set():
            raise RunnerStopped(f"lease on GPU {held.gpu_id} lost while the job ran")
    except RunnerStopped as e:
        keeper.stop()
        watch.close()
        if keeper.lost.is_set() and isinstance(keeper.error, StoreUnavailable):
            # Lost with Redis itself (an outage, a restart): the request can only go back to
            # waiting once Redis answers again, so wait for that rather than fail it.
            wait_for_redis(store.client, OUTAGE_WAIT_S)
        if watch.cancelled.is_set() and not keeper.lost.is_set():
            finish(store, keeper.lease, task_id)
            raise RunnerStopped(f"request {task_id} cancelled while running") from None
        clear_running(store, held.gpu_id, task_id)
        metrics.lease_lost(pool, "running")
        return back_to_waiting(self, request, pool, attempt, str(e), labels)
    except RunnerUnavailable as e:
        keeper.stop()
        watch.close()
        finish(store, keeper.lease, task_id)  # never hold a GPU that cannot serve
        return back_to_waiting(self, request, pool, attempt, str(e), labels)
    except BaseException:
        keeper.stop()
        watch.close()
        finish(store, keeper.lease, task_id)
        raise
    keeper.stop()
    watch.close()
    run_s = time.time() - started
    if not finish(store, keeper.lease, task_id):
        metrics.lease_lost(pool, "release")
        return back_to_waiting(
            self, request, pool, attempt, f"lease on GPU {held.gpu_id} lost before release", labels
        )
    try:
        store.record_duration(pool, run_s)
    except GpuHedgeError as e:  # statistics only: never fail a finished job for them
        log.warning("could not record job duration: %s", e)
    return {
        "output": output,
        "gpu_id": held.gpu_id,
        "pool": pool,
        "token": held.token,
        "attempt": attempt,
        "started_at": started,
        "entered_at": entered,  # the job's message reached this child (its checks began)
        "dispatch_s": None if leased_at is None else max(0.0, started - leased_at),
        "run_s": run_s,
    }
