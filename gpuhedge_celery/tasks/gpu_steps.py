"""The Redis steps around one GPU job (``gpu_run``): its start and its finish, one script each.

Before the runner starts, :func:`begin` reads the request's stop flag, checks the lease's
fencing token (the newest accepted, and the lease's current one) and writes the GPU's running
record (``lua/check_fence.lua`` given its optional keys); after it, :func:`finish` clears that
record and releases the lease (``lua/gpu_finish.lua``). One round trip each instead of three:
the GPU's per-job overhead is a few milliseconds, and each round trip from a worker costs a
fraction of one.
Both are safe to repeat after a lost reply, which :func:`~.outage.through_outage` does while
Redis is unreachable.

The running record (``task id|token|ms``) is how a redelivered job learns that its worker died
running it: :class:`RunningRecord`.
"""

from __future__ import annotations

import logging
import time

from ..errors import LeaseLost, StaleToken, StoreUnavailable
from ..store.leases import Lease, LeaseStore
from ..store.outage import through_outage
from ..store.scripts import lua_script, raise_for_code
from ..store.timers import as_text
from .cancel import stop_key

log = logging.getLogger(__name__)

STOPPED, STARTED = "stopped", "started"


class RunningRecord:
    """The GPU's "running" record (``task id|token|ms``) that tells a redelivered job it died."""

    def __init__(self, store: LeaseStore, lease: Lease, task_id: str):
        self.store = store
        self.key = store.keys.running(lease.pool, lease.gpu_id)
        self.token = str(lease.token)
        self.task_id = task_id
        # Written once per delivery (its time in epoch ms: the pool adapter reads it as when the
        # job started), so a repeat after a lost answer finds its own value. A crashed delivery
        # of the same job under the same token wrote its value at least one dispatch earlier.
        self.value = f"{task_id}|{lease.token}|{int(time.time() * 1000)}"

    def crashed_before(self, previous: str) -> bool:
        """Whether ``previous`` (the record this delivery replaced) is a crashed delivery's of
        this very job under this very token: the worker died running it."""
        if not previous or previous == self.value:  # none, or our own write an outage hid
            return False
        prev_task, _, rest = previous.partition("|")
        return prev_task == self.task_id and rest.partition("|")[0] == self.token


def begin(store: LeaseStore, lease: Lease, running: RunningRecord) -> tuple[str, bool]:
    """The job's start: (:data:`STOPPED`, False) when someone asked the request to stop, else
    (:data:`STARTED`, whether a crashed delivery of this job left its running record);
    :class:`~gpuhedge_celery.errors.StaleToken` / ``LeaseLost`` when the fence refuses it: in
    Redis (the token, and the holder), or this process's own mark (a token below it, or equal
    for another delivery). A lease the mark refuses is freed and the GPU's fence counter lifted
    to the mark (:meth:`~LeaseStore.unblock`), so the GPU is free again for a token it takes.
    Checked under the GPU's gate lock: of two deliveries at once, one runs."""
    token = int(lease.token)
    k = store.keys
    keys = [  # all on the pool's hash tag: one slot
        k.lease(lease.pool, lease.gpu_id),
        k.accepted(lease.pool, lease.gpu_id),
        stop_key(store, lease.pool, running.task_id),
        running.key,
    ]
    with store.fence_gate(lease.gpu_id):
        try:
            store.check_mark(lease.gpu_id, token, running.value)
        except StaleToken:
            try:
                store.unblock(lease.gpu_id, token, lease.holder)
            except StoreUnavailable as e:  # best effort: the lease's TTL frees the GPU anyway
                log.warning(
                    "GPU %s: could not free the refused lease %s: %s", lease.gpu_id, token, e
                )
            raise
        with store.guard():
            code, detail = store.scripts.check_fence(
                keys=keys, args=[token, running.value, lease.holder]
            )
        code = int(code)
        if code == 0:
            return STOPPED, False
        if code != 1:
            raise_for_code(code, lease.gpu_id, token, int(detail))
        store.record_mark(lease.gpu_id, token, running.value, lease.holder)
    return STARTED, running.crashed_before(as_text(detail))


def clear_running(store: LeaseStore, gpu_id: str, task_id: str) -> None:
    """Delete the GPU's running record if it is this job's (waiting out a Redis outage)."""

    def clear() -> None:
        key = store.keys.running(store.pool_of(gpu_id), gpu_id)
        with store.guard():
            value = store.client.get(key)
            if value is not None and str(value).startswith(f"{task_id}|"):
                store.client.delete(key)

    through_outage(store.client, f"request {task_id}: clear its running record", clear)


def finish(store: LeaseStore, lease: Lease, task_id: str) -> bool:
    """Clear the running record and release the lease; False when the lease was already lost.

    A release repeated after an outage that finds the lease gone counts as released: the first
    try may have freed it before its answer was lost, and the job itself has finished.
    """
    k = store.keys
    repeated = []

    def release() -> None:
        with store.guard():
            code = lua_script(store.client, "gpu_finish")(
                keys=[k.running(lease.pool, lease.gpu_id), k.lease(lease.pool, lease.gpu_id)],
                args=[f"{task_id}|", str(lease.token), lease.holder],
            )
        raise_for_code(int(code), lease.gpu_id, lease.token)

    try:
        through_outage(
            store.client,
            f"request {task_id}: release GPU {lease.gpu_id}",
            release,
            on_retry=lambda: repeated.append(True),
        )
        return True
    except LeaseLost:
        if repeated:
            log.warning(
                "request %s: GPU %s was already free when its release was repeated after an "
                "outage; the job had finished",
                task_id,
                lease.gpu_id,
            )
            return True
        return False
