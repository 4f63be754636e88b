"""The GPU worker role: registration and host heartbeat, and ``gpu_run``, the job under a lease.

One Celery worker serves one GPU (prefork, one child). Its main process registers the GPU and
heartbeats (:class:`GpuHost`); its child runs :func:`gpu_run` for each job the pool hands it:

1. a message redelivered after this GPU's worker died running it frees the old lease and goes
   back to waiting (the crash may be the job's fault: attempts are bounded);
2. the fencing check refuses a stale or lost lease (back to waiting, bounded);
3. a :class:`LeaseKeeper` renews the lease; losing it sets the runner's stop flag, so the job
   is stopped (``cpu``/``cmd`` runners) or its result discarded (``python`` runner);
4. the lease is released and the job's duration recorded for TTL suggestions.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from celery import Task

from ..errors import GpuHedgeError, LeaseLost, StaleToken, StoreUnavailable
from ..runners import RunContext, Runner, RunnerStopped, runner_from_spec
from ..store.leases import GpuInfo, Lease, LeaseKeeper, LeaseStore
from .app import TASK_GPU_RUN, app, glue_config
from .cancel import StopWatch, stop_requested

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
            store = _stores[os.getpid()] = LeaseStore.from_settings(glue_config().settings)
        return store


def runner_for(pool: str) -> Runner:
    """The runner of this GPU worker (``GPUHEDGE_RUNNER``), built once per process."""
    spec = glue_config().runner
    key = (os.getpid(), spec)
    runner = _runners.get(key)
    if runner is None:
        runner = _runners[key] = runner_from_spec(spec)
    return runner


def running_key(gpu_id: str) -> str:
    return lease_store().keys.running(gpu_id)


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
                self.store.client.delete(self.store.keys.host(self.info.host))
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
    from .pool import pooled_infer

    limit = glue_config().max_attempts
    if attempt + 1 >= limit:
        message = f"request {task.request.id} gave up after {attempt + 1} attempt(s): {reason}"
        error = LeaseLost("", 0, message)
        error.args = ("", 0, message)  # constructor-shaped, so Celery's JSON result rebuilds it
        raise error
    log.warning(
        "request %s goes back to waiting (attempt %d): %s", task.request.id, attempt + 2, reason
    )
    return task.replace(pooled_infer.s(request, pool=pool, attempt=attempt + 1, labels=labels))


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


def _claim_running(store: LeaseStore, lease: Lease, task_id: str) -> str | None:
    """Record the job as running on the GPU; returns the previous record's task id, if any."""
    key = running_key(lease.gpu_id)
    value = f"{task_id}|{lease.token}|{int(time.time() * 1000)}"
    with store.guard():
        previous = store.client.set(key, value, get=True)
    if previous is None:
        return None
    previous = previous.decode() if isinstance(previous, bytes) else previous
    prev_task, _, rest = previous.partition("|")
    prev_token = rest.partition("|")[0]
    return prev_task if prev_token == str(lease.token) else None


def _clear_running(store: LeaseStore, gpu_id: str, task_id: str) -> None:
    key = running_key(gpu_id)
    with store.guard():
        value = store.client.get(key)
        if value is not None and str(value).startswith(f"{task_id}|"):
            store.client.delete(key)


@app.task(
    bind=True,
    name=TASK_GPU_RUN,
    acks_late=True,
    reject_on_worker_lost=True,
    # An exception is a result (the caller sees it); only a dead worker re-queues the message.
    acks_on_failure_or_timeout=True,
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
    config = glue_config()
    held = Lease.from_dict(lease)
    pool = held.pool
    if held.gpu_id != config.gpu_id:
        lease_store().force_release(held.gpu_id, held.token)  # not ours to run: free it now
        return back_to_waiting(
            self, request, pool, attempt, f"lease for {held.gpu_id} reached {config.gpu_id}", labels
        )
    store = lease_store()
    task_id = self.request.id
    done, result = already_done(self)
    if done:
        log.warning("request %s already completed: duplicate delivery ignored", task_id)
        return result
    if stop_requested(store, task_id):
        _finish(store, held, task_id)
        raise RunnerStopped(f"request {task_id} cancelled before it started")
    try:
        store.check_fence(held.gpu_id, held.token)
    except (StaleToken, LeaseLost) as e:
        _clear_running(store, held.gpu_id, task_id)
        return back_to_waiting(self, request, pool, attempt, f"refused: {e}", labels)
    if _claim_running(store, held, task_id) == task_id:
        # The record of this very job under this very token survived: this GPU's worker died
        # running it and the broker redelivered it. Free the GPU and let the pool decide where
        # it runs next (the crash may have been the job's fault, so attempts are bounded).
        store.force_release(held.gpu_id, held.token)
        _clear_running(store, held.gpu_id, task_id)
        return back_to_waiting(
            self, request, pool, attempt, f"GPU {held.gpu_id} worker died running it", labels
        )
    ctx = RunContext(gpu_id=held.gpu_id, token=held.token, task_id=task_id)
    keeper = LeaseKeeper(store, held, on_lost=lambda _lease, _exc: ctx.stop.set()).start()
    watch = StopWatch(store, task_id, ctx.stop).start()
    started = time.time()
    try:
        output = runner_for(pool).run(request, ctx)
        if keeper.lost.is_set():
            raise RunnerStopped(f"lease on GPU {held.gpu_id} lost while the job ran")
    except RunnerStopped as e:
        keeper.stop()
        watch.close()
        if watch.cancelled.is_set() and not keeper.lost.is_set():
            _finish(store, keeper.lease, task_id)
            raise RunnerStopped(f"request {task_id} cancelled while running") from None
        _clear_running(store, held.gpu_id, task_id)
        return back_to_waiting(self, request, pool, attempt, str(e), labels)
    except BaseException:
        keeper.stop()
        watch.close()
        _finish(store, keeper.lease, task_id)
        raise
    keeper.stop()
    watch.close()
    run_s = time.time() - started
    if not _finish(store, keeper.lease, task_id):
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
        "dispatch_s": None if leased_at is None else max(0.0, started - leased_at),
        "run_s": run_s,
    }


def _finish(store: LeaseStore, lease: Lease, task_id: str) -> bool:
    """Release the lease and clear the running record; False when the lease was already lost."""
    _clear_running(store, lease.gpu_id, task_id)
    try:
        store.release(lease)
        return True
    except LeaseLost:
        return False
