"""Pooled waits on workers of their own: a GPU backlog never holds the threads races step on.

A ``pooled_infer`` waiting for a GPU blocks one thread of the worker that took it. Routed to
``gpuhedge.pool`` and consumed only by workers started with
``GPUHEDGE_COORD_QUEUES=gpuhedge.pool``, a backlog of waiting requests fills those workers, and a
race coordinator (``gpuhedge.coord,gpuhedge.attempts``) with as few threads still runs races.
"""

from __future__ import annotations

import time

import pytest

from gpuhedge_celery.tasks.app import TASK_POOLED_INFER
from tests.support.faults import QUICK_REQUEST, send_race, start_fault_cluster
from tests.support.fixtures_celery import broker_url_for

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.slow, pytest.mark.timeout(180),
              pytest.mark.brokers]  # fmt: skip


def test_a_gpu_backlog_on_pool_workers_leaves_the_race_coordinator_free(
    redis_url, tmp_path, broker, request
):
    cluster = start_fault_cluster(redis_url, tmp_path, deadline_s=60.0, coordinators=0, gpus=1,
                                  beat=False,
                                  broker_url=broker_url_for(broker, request))  # fmt: skip
    try:
        waiters = cluster.start_coordinator(GPUHEDGE_COORD_QUEUES="gpuhedge.pool",
                                            GPUHEDGE_COORD_CONCURRENCY="2")  # fmt: skip
        racer = cluster.start_coordinator(GPUHEDGE_COORD_QUEUES="gpuhedge.coord,gpuhedge.attempts",
                                          GPUHEDGE_COORD_CONCURRENCY="2")  # fmt: skip
        # one GPU, 2 s jobs: one runs, the next two hold both of the pool worker's threads
        # waiting, the fourth waits in the queue
        pooled = [
            cluster.app.send_task(TASK_POOLED_INFER, ({"id": f"j{i}", "duration_s": 2},))
            for i in range(4)
        ]  # fmt: skip
        time.sleep(1.0)
        started = time.monotonic()
        races = [send_race(cluster, QUICK_REQUEST) for _ in range(3)]
        for race in races:
            assert race.get(timeout=30)["winner"]
        races_s = time.monotonic() - started
        # the races ended while the GPU backlog (about 8 s of jobs) was still waiting
        waiting = sum(not r.ready() for r in pooled)
        assert waiting >= 1, f"the races took {races_s:.1f} s: as long as the GPU backlog"
        done = [r.get(timeout=60) for r in pooled]  # and the whole backlog drains
        assert [d["output"]["id"] for d in done] == ["j0", "j1", "j2", "j3"]
        taken = f"{TASK_POOLED_INFER}["  # the log line of a task the worker received
        assert taken not in racer.log_path.read_text()
        assert taken in waiters.log_path.read_text()
    finally:
        cluster.close()
