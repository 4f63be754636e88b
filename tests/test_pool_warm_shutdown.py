"""Draining a GPU: SIGTERM to its worker (Celery's warm shutdown), with REAL worker processes.

What docs/operations.md ("Draining a GPU host") promises: the running job finishes under its
lease and its caller gets the result once; the lease is released; the GPU leaves the pool when
the worker exits; a request that was waiting for a GPU runs on another one. A waiting request
can claim the draining GPU in the moment its job finishes (the host still heartbeats then, and
the worker no longer takes messages): it then sits on that GPU's queue until a reconcile pass
sees the host gone and sends it back to waiting; the test drives those passes as beat would.
Draining the last GPU of a pool fails the requests still waiting (EmptyPool).
"""

from __future__ import annotations

import signal

import pytest
from celery.exceptions import TimeoutError

from gpuhedge_celery.errors import EmptyPool
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


def test_sigterm_finishes_the_running_job_and_the_waiting_request_moves_on(celery_cluster):
    c = celery_cluster
    short = {"GPUHEDGE_POOL_TTL_MS": "3000", "GPUHEDGE_HOST_TTL_MS": "1500"}
    draining_gpu = c.gpu_id(0)
    draining = c.start_gpu(0, wait=False, **short)
    staying = c.start_gpu(1, wait=False, **short)
    coord = c.start_coordinator(wait=False, **short)
    c.wait_ready(draining, staying, coord)
    running = [c.app.send_task(TASK_POOLED_INFER, ({"duration_s": 3, "id": i},)) for i in (0, 1)]

    def both_started():
        found = {g: c.store.current(g) for g in (c.gpu_id(0), c.gpu_id(1))}
        if all(found.values()) and all(
            c.client.exists(c.store.keys.running(c.store.pool_of(g), g)) for g in found
        ):
            return found
        return None

    leases = wait_for(both_started, 20, "a job to start on each GPU")
    waiting = c.app.send_task(TASK_POOLED_INFER, ({"duration_s": 0.1, "id": "waiting"},))
    wait_for(lambda: waiting.id in c.store.queue("default"), 20, "the third request to queue")

    draining.kill(signal.SIGTERM)  # the main process only, as systemd and Kubernetes stop it
    outs = [r.get(timeout=30) for r in running]
    (drained,) = [out for out in outs if out["gpu_id"] == draining_gpu]
    assert (drained["attempt"], drained["token"]) == (0, leases[draining_gpu].token), "not re-run"
    draining.process.wait(30)
    assert not draining.alive()
    wait_for(lambda: draining_gpu not in [g.gpu_id for g in c.store.gpus()], 5,
             "GPU 0 to leave the pool")  # fmt: skip
    # liveness is per GPU worker: GPU 1, on the same host, stays in the pool
    assert c.gpu_id(1) in [g.gpu_id for g in c.store.gpus()]
    current = c.store.current(draining_gpu)
    assert current is None or current.token != drained["token"], "the job's lease is released"

    def waiting_done():
        reconcile_once(c.app, c.store, timeout_s=0.5)  # what beat runs every interval
        return waiting.ready()

    wait_for(waiting_done, 30, "the waiting request to run on GPU 1")
    moved = waiting.get(timeout=5)
    assert moved["output"]["echo"]["id"] == "waiting"
    assert moved["gpu_id"] == c.gpu_id(1)


def test_draining_the_last_gpu_of_a_pool_fails_the_requests_still_waiting(celery_cluster):
    """With no live GPU left in the pool, a waiting request fails with EmptyPool at its next
    re-check (new ones fail at once); one that claimed the GPU as its job finished waits on
    that GPU's queue instead, for a GPU to come back and a reconcile pass to move it."""
    c = celery_cluster
    short = {"GPUHEDGE_POOL_TTL_MS": "3000", "GPUHEDGE_HOST_TTL_MS": "1500"}
    gpu = c.start_gpu(0, wait=False, **short)
    coord = c.start_coordinator(wait=False, **short)
    c.wait_ready(gpu, coord)
    running = c.app.send_task(TASK_POOLED_INFER, ({"duration_s": 2, "id": "running"},))
    wait_for(
        lambda: c.client.exists(c.store.keys.running(c.store.pool_of(c.gpu_id(0)), c.gpu_id(0))),
        20,
        "the job to start",
    )
    waiting = [c.app.send_task(TASK_POOLED_INFER, ({"duration_s": 0.1, "id": i},)) for i in (1, 2)]
    wait_for(lambda: len(c.store.queue("default")) == 2, 20, "both requests to queue")

    gpu.kill(signal.SIGTERM)
    assert running.get(timeout=30)["output"]["echo"]["id"] == "running"
    gpu.process.wait(30)
    failed = []
    for result in waiting:
        try:
            result.get(timeout=10)
        except EmptyPool as e:
            failed.append(str(e))
        except TimeoutError:
            pass  # claimed GPU 0 as the job finished: on its queue until a GPU comes back
        else:
            pytest.fail("a request ran on a GPU that was draining")
    assert failed and all("default" in why for why in failed), failed
