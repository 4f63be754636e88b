"""Races and pooled GPU jobs on real Celery workers whose store, broker and results are a
Sentinel group (a primary, two replicas, three Sentinels on loopback), through failovers: a
clean one and one that loses what the old primary alone acknowledged.

No process is restarted: the workers, their listeners, the timer service and the caller all
find the new primary through the Sentinels. With ``GPUHEDGE_REDIS_WAIT_REPLICAS=1`` a winner
is published only once a replica holds its claim. Checked as after a Redis outage
(``tests/test_faults_redis.py``): every caller gets a winner or an explicit failure, the result,
the receipt and the winner claim name the same attempt, nothing is left running or leaked, no
pooled request is lost, no GPU ran two jobs at once and lease tokens only grew.
"""

from __future__ import annotations

import json
import time

import pytest

from gpuhedge_celery.redis_url import with_sentinel_options
from gpuhedge_celery.tasks.app import TASK_POOLED_INFER
from tests.support.faults import (
    HEDGED_REQUEST,
    QUICK_REQUEST,
    run_intervals,
    send_race,
    start_fault_cluster,
)
from tests.support.sentinel import SentinelGroup
from tests.test_faults_redis import Callers, check_races, probe_resumed

pytestmark = [pytest.mark.celery, pytest.mark.slow, pytest.mark.timeout(420)]

RACES = 12


def test_races_and_pooled_jobs_ride_through_failovers_without_a_restart(tmp_path):
    with SentinelGroup() as group:
        url = with_sentinel_options(group.url, group.master_name, group.sentinel_password)
        cluster = start_fault_cluster(
            url, tmp_path, deadline_s=60.0, gpus=2, GPUHEDGE_REDIS_WAIT_REPLICAS="1"
        )
        try:
            for _ in range(2):  # warm both coordinators
                send_race(cluster, QUICK_REQUEST).get(timeout=30)
            callers = Callers([send_race(cluster, HEDGED_REQUEST) for _ in range(RACES)])
            pooled = [
                cluster.app.send_task(TASK_POOLED_INFER, ({"id": f"job{i}", "duration_s": 2},))
                for i in range(4)
            ]  # fmt: skip
            time.sleep(1.0)  # races submitted, hedges launching, pooled jobs running
            started = time.monotonic()
            clean = group.failover()
            time.sleep(1.0)
            lossy = group.lossy_failover(lambda _client: time.sleep(0.5))  # writes go unreplicated
            resumed_s = probe_resumed(cluster, time.monotonic())
            callers.join(90)
            assert len(callers.outcomes) == RACES, "a caller's .get() is still waiting"
            counts = check_races(cluster, callers.outcomes, expect_all_won=False)
            jobs = [r.get(timeout=90) for r in pooled]  # no pooled request lost
            assert sorted(j["output"]["id"] for j in jobs) == [f"job{i}" for i in range(4)]
            runs = run_intervals(cluster.env["GPUHEDGE_TEST_RUN_LOG"])
            for gpu, spans in runs.items():
                spans.sort()
                for (_, e1, t1, _), (s2, _, t2, _) in zip(spans, spans[1:], strict=False):
                    assert e1 <= s2, f"GPU {gpu} ran two jobs at once: {spans}"
                    assert t2 > t1, f"GPU {gpu}: token went from {t1} to {t2}"
            # no worker stopped: every one of them is still running after both failovers
            assert all(w.process.poll() is None for w in cluster.workers), cluster.logs()
            print(json.dumps({
                "fault": "sentinel_failovers", "races": RACES, **counts,
                "primaries": [list(clean[0]), list(clean[1]), list(lossy[1])],
                "resumed_s": round(resumed_s, 2),
                "seconds": round(time.monotonic() - started, 1),
                "pooled_jobs": len(jobs), "pooled_reruns": sum(j["attempt"] > 0 for j in jobs),
            }))  # fmt: skip
        finally:
            cluster.close()
