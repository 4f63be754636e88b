"""Races and pooled GPU jobs on real Celery workers whose store is a Redis Cluster with a replica
per primary (broker and results on a plain redis-server, as a cluster store requires), through
a failover by hand (``CLUSTER FAILOVER``) and a primary SIGKILLed mid-races (its replica takes
over once the others count it failed), with no process restarted: the workers, their listeners,
their timer coordinators and the caller follow the new primaries.

With ``GPUHEDGE_REDIS_WAIT_REPLICAS=1`` a winner counts only once the replica of its shard's
primary holds its claim, so a claim the killed primary alone held is never acted on. The killed
primary is started again and rejoins as its successor's replica (a promoted replica has none,
and every winner claim on its slots waits for one). Checked as on Sentinel
(``tests/test_failover_e2e.py``): every caller gets a winner or an explicit failure, the result,
the receipt and the winner claim name the same attempt, nothing is left running or leaked, and
pooled jobs run one per GPU at a time before and after."""

from __future__ import annotations

import json
import time

import pytest

from tests.support.faults import (
    HEDGED_REQUEST,
    QUICK_REQUEST,
    double_holds,
    run_intervals,
    send_race,
    stacks_on_failure,
    start_fault_cluster,
)
from tests.support.redis_cluster import LocalCluster
from tests.test_failover_e2e import pooled_jobs
from tests.test_faults_redis import Callers, check_races, probe_resumed

pytestmark = [pytest.mark.celery, pytest.mark.slow, pytest.mark.timeout(420)]

RACES = 12


def test_races_ride_through_a_cluster_failover_and_a_killed_primary(tmp_path, plain_redis_url):
    with LocalCluster(replicas=True, node_timeout_ms=1000) as store:
        cluster = start_fault_cluster(
            store.url, tmp_path, deadline_s=60.0, gpus=2, broker_url=plain_redis_url,
            GPUHEDGE_REDIS_WAIT_REPLICAS="1",
        )  # fmt: skip
        with stacks_on_failure(cluster):
            before = pooled_jobs(cluster, "before")
            for _ in range(2):  # warm both coordinators
                send_race(cluster, QUICK_REQUEST).get(timeout=30)
            callers = Callers([send_race(cluster, HEDGED_REQUEST) for _ in range(RACES)])
            time.sleep(1.0)  # races submitted, hedges launching
            started = time.monotonic()
            first, second = store.primaries()[:2]
            store.failover(first)
            time.sleep(1.0)
            store.kill(second)
            resumed_s = probe_resumed(cluster, time.monotonic())
            store.restart(second)  # back as a replica: the winners on its slots are held again
            callers.join(120)
            assert len(callers.outcomes) == RACES, "a caller's .get() is still waiting"
            counts = check_races(cluster, callers.outcomes, expect_all_won=False)
            after = pooled_jobs(cluster, "after")
            assert double_holds(run_intervals(cluster.env["GPUHEDGE_TEST_RUN_LOG"])) == []
            assert all(w.alive() for w in cluster.workers), cluster.logs()
            figures = {
                "races": RACES, **counts, "resumed_s": round(resumed_s, 2),
                "seconds": round(time.monotonic() - started, 1),
                "pooled_jobs": len(before) + len(after),
            }  # fmt: skip
    print(json.dumps({"fault": "cluster_failovers", "broker": "redis", **figures}))
