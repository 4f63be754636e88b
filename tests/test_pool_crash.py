"""kill -9 of a GPU worker mid-job, with REAL worker processes: no lost request, no stranded GPU.

* The pool child dies: the worker's main process re-queues the message at once
  (reject-on-worker-lost); the redelivered job sees its own running record, frees the GPU and
  goes back to waiting, then completes.
* The whole worker dies (main and child): the lease is not renewed and expires within its TTL;
  the unacknowledged message comes back after the broker's visibility timeout onto the dead
  GPU's queue, where the reconcile pass finds it and sends it back to waiting; another GPU runs it.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from gpuhedge_celery.tasks.app import TASK_POOLED_INFER
from gpuhedge_celery.tasks.reconcile import reconcile_once
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.redis,
    pytest.mark.celery,
    pytest.mark.slow,
    pytest.mark.brokers,
    pytest.mark.cluster,
]

TTL_MS = 3000


def running_lease(cluster, gpu):
    """The lease of a job that the GPU's worker has started (its running record exists)."""
    lease = cluster.store.current(gpu)
    if lease is None or not cluster.client.exists(
        cluster.store.keys.running(cluster.store.pool_of(gpu), gpu)
    ):
        return None
    return lease


def test_kill_pool_child_mid_job(celery_cluster):
    c = celery_cluster
    gpu = c.gpu_id(0)
    workers = [
        c.start_gpu(0, wait=False, GPUHEDGE_POOL_TTL_MS=str(TTL_MS)),
        c.start_coordinator(wait=False),
    ]
    c.wait_ready(*workers)
    result = c.app.send_task(TASK_POOLED_INFER, ({"duration_s": 2, "id": "crash-child"},))
    lease = wait_for(lambda: running_lease(c, gpu), 20, "the job to start")
    (child,) = workers[0].children()
    os.kill(child, signal.SIGKILL)
    killed_at = time.monotonic()

    def dead_lease_gone():
        now = c.store.current(gpu)
        return now is None or now.token != lease.token

    wait_for(dead_lease_gone, TTL_MS / 1000 + 1, "the dead job's lease to leave the GPU")
    assert time.monotonic() - killed_at <= TTL_MS / 1000 + 1
    out = result.get(timeout=60)
    assert out["output"]["echo"]["id"] == "crash-child"
    assert out["token"] > lease.token, "re-run under a new lease, never the dead one"
    assert out["attempt"] == 1
    assert workers[0].alive(), "the worker itself survived and replaced its child"
    wait_for(lambda: c.store.current(gpu) is None, 10, "the GPU to be free again")


def test_kill_whole_worker_mid_job(celery_cluster):
    c = celery_cluster
    short = {
        "GPUHEDGE_POOL_TTL_MS": str(TTL_MS),
        "GPUHEDGE_HOST_TTL_MS": "1500",
        "GPUHEDGE_VISIBILITY_TIMEOUT_S": "3",
    }
    victim_gpu = c.gpu_id(0)
    victim = c.start_gpu(0, wait=False, **short)
    coord = c.start_coordinator(wait=False, **short)
    c.wait_ready(victim, coord)
    result = c.app.send_task(TASK_POOLED_INFER, ({"duration_s": 3, "id": "crash-worker"},))
    lease = wait_for(lambda: running_lease(c, victim_gpu), 20, "the job to start on GPU 0")
    os.killpg(victim.pid, signal.SIGKILL)  # main process and its child: the host is gone
    killed_at = time.monotonic()
    # Started only now, so the job could not have gone there first.
    survivor = c.start_gpu(1, wait=False, **short)

    def gpu_claimable():
        now = c.store.current(victim_gpu)
        return now is None or now.token != lease.token

    wait_for(gpu_claimable, TTL_MS / 1000 + 1, "the dead worker's lease to expire")
    assert time.monotonic() - killed_at <= TTL_MS / 1000 + 1
    c.wait_ready(survivor)
    wait_for(lambda: victim_gpu not in [g.gpu_id for g in c.store.gpus()], 5,
             "GPU 0 to leave the pool")  # fmt: skip
    assert not result.ready(), "the request is still in flight, not lost or failed"

    # Beat would do this every GPUHEDGE_RECONCILE_INTERVAL_S; here the test drives the passes.
    def rescued():
        return reconcile_once(c.app, c.store, timeout_s=0.5).get("rescued")

    assert wait_for(rescued, 30, "reconcile to rescue the request") == [result.id]
    out = result.get(timeout=60)
    assert out["output"]["echo"]["id"] == "crash-worker"
    assert out["gpu_id"] == c.gpu_id(1)
    assert out["attempt"] == 1
    assert time.monotonic() - killed_at < 60
    assert survivor.alive()


def test_kill_coordinator_while_the_request_waits(celery_cluster):
    """The waiting request's message is redelivered (visibility timeout) to a new coordinator."""
    c = celery_cluster
    short = {"GPUHEDGE_VISIBILITY_TIMEOUT_S": "2"}
    gpu_worker = c.start_gpu(0, wait=False, **short)
    coord = c.start_coordinator(wait=False, **short)
    c.wait_ready(gpu_worker, coord)
    busy = c.app.send_task(TASK_POOLED_INFER, ({"duration_s": 3, "id": "busy"},))
    wait_for(lambda: running_lease(c, c.gpu_id(0)), 20, "the first job to start")
    waiting = c.app.send_task(TASK_POOLED_INFER, ({"duration_s": 0.1, "id": "waiting"},))
    wait_for(lambda: waiting.id in c.store.queue("default"), 20, "the second to queue")
    os.killpg(coord.pid, signal.SIGKILL)
    c.start_coordinator(**short)
    assert busy.get(timeout=30)["output"]["echo"]["id"] == "busy"
    out = waiting.get(timeout=60)
    assert out["output"]["echo"]["id"] == "waiting"
    wait_for(lambda: c.store.queue("default") == [], 10, "the wait queue to be empty")
