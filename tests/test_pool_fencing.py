"""Lease loss and stale tokens with REAL workers: a job never carries on without its lease."""

from __future__ import annotations

import time

import pytest

from gpuhedge_celery.tasks.app import TASK_GPU_RUN, TASK_POOLED_INFER, gpu_queue
from gpuhedge_celery.tasks.cancel import running_on
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.brokers, pytest.mark.cluster]


def test_a_job_whose_lease_is_taken_over_is_stopped_and_waits_again(celery_cluster):
    c = celery_cluster
    workers = [
        c.start_gpu(0, wait=False, GPUHEDGE_POOL_TTL_MS="1500"),  # renewed every 0.5 s
        c.start_coordinator(wait=False),
    ]
    c.wait_ready(*workers)
    gpu = c.gpu_id(0)
    result = c.app.send_task(TASK_POOLED_INFER, ({"duration_s": 5, "id": "victim"},))
    wait_for(lambda: running_on(c.store, "default", result.id), 20, "the job to start")
    first = c.store.current(gpu)
    # Another holder takes the GPU over (what a Redis failover or a long pause can cause).
    assert c.store.force_release(gpu, first.token)
    intruder = c.store.try_claim(gpu, "intruder", ttl_ms=60_000)
    stopped_at = wait_for(
        lambda: running_on(c.store, "default", result.id) is None and time.monotonic(),
        5,
        "the job to stop after its renewal was refused",
    )
    assert c.store.current(gpu).holder == "intruder", "the stopped job did not touch the lease"
    assert not result.ready(), "the request waits for the GPU again instead of failing"
    wait_for(lambda: result.id in c.store.queue("default"), 10, "the request to queue again")
    c.store.release(intruder)
    out = wait_for(lambda: result.ready() and result.get(), 40, "the re-run to finish")
    assert out["attempt"] == 1 and out["token"] > intruder.token
    assert out["run_s"] >= 4.9, "re-run from the start, under the new lease"
    assert stopped_at is not None


def test_a_stale_token_is_refused_before_any_work(celery_cluster):
    c = celery_cluster
    workers = [c.start_gpu(0, wait=False), c.start_coordinator(wait=False)]
    c.wait_ready(*workers)
    gpu = c.gpu_id(0)
    old = c.store.try_claim(gpu, "old-holder")
    c.store.release(old)
    newer = c.store.try_claim(gpu, "newer-holder")
    c.store.check_fence(gpu, newer.token)  # the GPU has accepted the newer token
    c.store.release(newer)
    stale = c.app.send_task(
        TASK_GPU_RUN,
        ({"duration_s": 0.1, "id": "stale"}, old.to_dict()),
        queue=gpu_queue(gpu),
    )
    out = stale.get(timeout=30)  # refused, sent back to waiting, then run under a fresh lease
    assert out["token"] > newer.token and out["attempt"] == 1
    assert "refused" in "".join(w.log() for w in workers)


def test_attempts_are_bounded_and_the_failure_is_typed(celery_cluster):
    from gpuhedge_celery.errors import LeaseLost

    c = celery_cluster
    gpu_worker = c.start_gpu(0, GPUHEDGE_MAX_ATTEMPTS="1")
    gpu = c.gpu_id(0)
    old = c.store.try_claim(gpu, "old-holder")
    c.store.release(old)
    stale = c.app.send_task(
        TASK_GPU_RUN, ({"id": "stale"}, old.to_dict()), queue=gpu_queue(gpu)
    )  # fmt: skip
    with pytest.raises(LeaseLost, match="gave up after 1 attempt"):
        stale.get(timeout=30)
    assert gpu_worker.alive()


def test_a_lease_delivered_to_the_wrong_gpu_is_freed_at_once(celery_cluster):
    c = celery_cluster
    workers = [c.start_gpu(0, wait=False), c.start_gpu(1, wait=False)]
    c.wait_ready(*workers)
    lease = c.store.try_claim(c.gpu_id(1), "misrouted")
    c.app.send_task(TASK_GPU_RUN, ({"id": "x"}, lease.to_dict()), queue=gpu_queue(c.gpu_id(0)))
    wait_for(lambda: c.store.current(c.gpu_id(1)) is None, 10, "the misrouted lease to be freed")


def test_after_a_failover_to_a_lagging_clock_a_refused_lease_frees_the_gpu(celery_cluster):
    c = celery_cluster
    workers = [c.start_gpu(0, wait=False), c.start_coordinator(wait=False)]
    c.wait_ready(*workers)
    gpu = c.gpu_id(0)
    k, pool = c.store.keys, c.store.pool_of(gpu)
    # The old primary's clock ran ahead: the first job's token is far above today's floor.
    seconds, micros = c.client.time()
    c.client.set(k.fence(pool, gpu), (seconds * 1000 + micros // 1000 + 10**9) * 1000)
    first = c.app.send_task(TASK_POOLED_INFER, ({"duration_s": 0.1, "id": "first"},))
    mark = first.get(timeout=30)["token"]  # the GPU worker's mark
    # Failover to a primary whose clock is behind, without the counter or the accepted key.
    c.client.delete(k.fence(pool, gpu), k.accepted(pool, gpu))
    second = c.app.send_task(TASK_POOLED_INFER, ({"duration_s": 0.1, "id": "second"},))
    # Refused once, its lease freed (not left for its 60 s TTL), then run under a token above
    # the mark.
    out = second.get(timeout=20)
    assert out["attempt"] == 1 and out["token"] == mark + 1
    assert f"GPU {gpu} refused token" in workers[0].log()
