"""Cancelling pooled requests with REAL workers: queued ones leave the queue, running ones stop."""

from __future__ import annotations

import time

import pytest

from gpuhedge_celery.errors import AcquireTimeout
from gpuhedge_celery.runners import RunnerStopped
from gpuhedge_celery.tasks.app import TASK_POOLED_INFER
from gpuhedge_celery.tasks.cancel import cancel_pooled, running_on
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.redis,
    pytest.mark.celery,
    pytest.mark.brokers,
    pytest.mark.sentinel,
    pytest.mark.cluster,
]


def test_cancel_a_running_and_a_queued_request(celery_cluster):
    c = celery_cluster
    workers = [c.start_gpu(0, wait=False), c.start_coordinator(wait=False)]
    c.wait_ready(*workers)
    gpu = c.gpu_id(0)
    running = c.app.send_task(TASK_POOLED_INFER, ({"duration_s": 30, "id": "long"},))
    wait_for(lambda: running_on(c.store, "default", running.id), 20, "the long job to start")
    queued = c.app.send_task(TASK_POOLED_INFER, ({"duration_s": 30, "id": "next"},))
    wait_for(lambda: queued.id in c.store.queue("default"), 20, "the second to queue")

    receipt = cancel_pooled(c.store, "default", queued.id)
    assert receipt == {"task_id": queued.id, "left_queue": True, "running_on": None}
    with pytest.raises(AcquireTimeout, match="cancelled"):
        queued.get(timeout=20)

    started = time.monotonic()
    receipt = cancel_pooled(c.store, "default", running.id)
    assert receipt["left_queue"] is False and receipt["running_on"] == gpu
    with pytest.raises(RunnerStopped, match="cancelled while running"):
        running.get(timeout=20)
    assert time.monotonic() - started < 10, "stopped, not run to the end"
    wait_for(lambda: running_on(c.store, "default", running.id) is None, 5, "confirmation")
    assert c.store.current(gpu) is None, "the lease was released"
    assert c.store.durations("default") == [], "neither job counted as run"


def test_a_request_cancelled_before_it_is_picked_up_never_runs(celery_cluster):
    c = celery_cluster
    workers = [c.start_gpu(0, wait=False), c.start_coordinator(wait=False)]
    c.wait_ready(*workers)
    cancel_pooled(c.store, "default", "early-cancel-1")  # e.g. the race was won meanwhile
    result = c.app.send_task(TASK_POOLED_INFER, ({"x": 1},), task_id="early-cancel-1")
    with pytest.raises(AcquireTimeout, match="cancelled before it waited"):
        result.get(timeout=20)
    assert c.store.last_token(c.gpu_id(0)) == 0, "the GPU was never claimed"
