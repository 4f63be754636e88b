"""pooled_infer end to end with REAL Celery worker processes on the test Redis."""

from __future__ import annotations

import time

import pytest

from gpuhedge_celery.errors import EmptyPool, UnknownPool
from gpuhedge_celery.store.leases import GpuInfo
from gpuhedge_celery.tasks.app import TASK_GPU_RUN, TASK_POOLED_INFER, gpu_queue
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.redis,
    pytest.mark.celery,
    pytest.mark.brokers,
    pytest.mark.sentinel,
    pytest.mark.cluster,
]


def submit(cluster, request, **kwargs):
    return cluster.app.send_task(TASK_POOLED_INFER, (request,), kwargs)


def test_pooled_infer_runs_on_two_gpus_one_job_each_at_a_time(celery_cluster):
    c = celery_cluster
    workers = [
        c.start_gpu(0, wait=False),
        c.start_gpu(1, wait=False),
        c.start_coordinator(wait=False),
    ]
    c.wait_ready(*workers)
    results = [submit(c, {"duration_s": 0.4, "n": n}) for n in range(6)]
    outs = [r.get(timeout=60) for r in results]

    assert [o["output"]["echo"]["n"] for o in outs] == list(range(6))
    assert {o["gpu_id"] for o in outs} == {c.gpu_id(0), c.gpu_id(1)}
    for gpu in (c.gpu_id(0), c.gpu_id(1)):
        mine = sorted((o for o in outs if o["gpu_id"] == gpu), key=lambda o: o["started_at"])
        tokens = [o["token"] for o in mine]
        assert tokens == sorted(set(tokens)), "fencing tokens strictly increase per GPU"
        for a, b in zip(mine, mine[1:], strict=False):
            assert a["started_at"] + a["run_s"] <= b["started_at"] + 0.01, "one job at a time"
    # Both GPUs worked at once: the six 0.4 s jobs overlapped across the two GPUs.
    first_end = min(o["started_at"] + o["run_s"] for o in outs)
    assert sum(1 for o in outs if o["started_at"] < first_end) == 2
    assert all(row.state == "free" for row in c.store.table()), "every lease released"
    assert len(c.store.durations("default")) == 6


def test_control_command_reports_what_each_gpu_runs(celery_cluster):
    c = celery_cluster
    workers = [c.start_gpu(0, wait=False), c.start_coordinator(wait=False)]
    c.wait_ready(*workers)
    before = time.time()
    result = submit(c, {"duration_s": 3})
    gpu = c.gpu_id(0)
    lease = wait_for(lambda: c.store.current(gpu), 20, "the job to hold the GPU")

    def report():
        replies = c.app.control.broadcast("gpuhedge_gpus", reply=True, timeout=1.0)
        for reply in replies:
            for answer in reply.values():
                for g in answer.get("gpus", []):
                    if g["gpu_id"] == gpu and g["running"]:
                        return g["running"]
        return None

    (job,) = wait_for(report, 10, "the worker to report the running job")
    assert job["task_id"] == result.id
    assert job["token"] == lease.token
    assert before - 1 <= job["since"] <= time.time()
    result.get(timeout=30)
    # The result is stored from inside the task, a moment before the worker counts it done and
    # drops it from its active requests: the report clears right after, not before .get().
    wait_for(lambda: not report(), 10, "the finished job to leave the report")


def test_unknown_and_empty_pools_are_typed_errors(celery_cluster):
    c = celery_cluster
    c.start_coordinator()
    with pytest.raises(UnknownPool, match="nope"):
        submit(c, {"x": 1}, pool="nope").get(timeout=30)
    # A pool whose only host never heartbeats (or stopped): known, but empty.
    c.store.register_gpu(GpuInfo("ghost:0", "ghosts", f"{c.prefix}-deadhost"))
    with pytest.raises(EmptyPool, match="ghosts"):
        submit(c, {"x": 1}, pool="ghosts").get(timeout=30)


def test_bad_arguments_fail_with_one_clear_line(celery_cluster):
    c = celery_cluster
    c.start_coordinator()
    with pytest.raises(Exception, match="pool") as info:
        submit(c, {"x": 1}, pool="has space").get(timeout=30)
    assert "\n" not in str(info.value)


def test_a_duplicate_delivery_of_a_finished_request_does_not_run_again(celery_cluster):
    """What the broker does after a visibility timeout: the same message (same id, old lease)."""
    c = celery_cluster
    workers = [c.start_gpu(0, wait=False), c.start_coordinator(wait=False)]
    c.wait_ready(*workers)
    result = submit(c, {"duration_s": 0.2, "id": "dup"})
    out = result.get(timeout=30)
    gpu = out["gpu_id"]
    lease = {"gpu_id": gpu, "pool": "default", "token": out["token"], "holder": result.id,
             "ttl_ms": 60_000}  # fmt: skip
    c.app.send_task(
        TASK_GPU_RUN, ({"duration_s": 0.2, "id": "dup"}, lease), task_id=result.id,
        queue=gpu_queue(gpu),
    )  # fmt: skip
    wait_for(lambda: "duplicate delivery ignored" in workers[0].log(), 20, "the duplicate")
    assert c.app.AsyncResult(result.id).get(timeout=5) == out
    assert c.store.last_token(gpu) == out["token"], "no new lease was taken"
    assert len(c.store.durations("default")) == 1, "the job ran once"
