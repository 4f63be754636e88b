"""Races and pooled GPU jobs on real Celery workers whose store (and results) are a Sentinel
group (a primary, two replicas, three Sentinels on loopback), through failovers, with no process
restarted: workers, their listeners, the timer service and the caller all find the new primary
through the Sentinels.

* The store and the broker on the group, two clean failovers.
* The store on the group and the broker on RabbitMQ, a clean failover and one that loses what
  the old primary alone acknowledged. A Redis broker has no such guarantee: kombu publishes and
  acknowledges without ``WAIT``, so a lossy failover of a Redis broker can lose task messages
  (``docs/operations.md``, *Failover*).

With ``GPUHEDGE_REDIS_WAIT_REPLICAS=2`` a winner is published only once both replicas hold its
claim (with 1, a claim made while Sentinel promoted one replica was acknowledged by the other,
still following the old primary, and lost). Checked for the races in flight, as after a Redis
outage (``tests/test_faults_redis.py``): every caller gets a winner or an explicit failure, the
result, the receipt and the winner claim name the same attempt, nothing is left running or
leaked. Pooled jobs run on both GPUs before and after the failovers, one job per GPU at a time,
lease tokens only growing. A pooled job *in flight* during a failover can lose its result (its
Celery result is written without ``WAIT``): that is not covered here (``docs/operations.md``).
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
    double_holds,
    run_intervals,
    send_race,
    stacks_on_failure,
    start_fault_cluster,
)
from tests.support.sentinel import SentinelGroup
from tests.test_faults_redis import Callers, check_races, probe_resumed

pytestmark = [pytest.mark.celery, pytest.mark.slow, pytest.mark.timeout(420)]

RACES = 12


def ride_through(group, tmp_path, broker_url, lossy: bool) -> dict:
    """Pooled jobs on both GPUs, then races sent, a clean failover and a second one (lossy or
    clean), every race's outcome checked, then a fresh race and fresh pooled jobs: returns the
    measured figures."""
    url = with_sentinel_options(group.url, group.master_name, group.sentinel_password)
    cluster = start_fault_cluster(
        url, tmp_path, deadline_s=60.0, gpus=2, broker_url=broker_url,
        GPUHEDGE_REDIS_WAIT_REPLICAS="2",
    )  # fmt: skip
    with stacks_on_failure(cluster):
        before = pooled_jobs(cluster, "before")
        for _ in range(2):  # warm both coordinators
            send_race(cluster, QUICK_REQUEST).get(timeout=30)
        callers = Callers([send_race(cluster, HEDGED_REQUEST) for _ in range(RACES)])
        time.sleep(1.0)  # races submitted, hedges launching
        started = time.monotonic()
        first = group.failover()
        time.sleep(1.0)
        if lossy:  # what the old primary alone acknowledged for half a second is lost
            second = group.lossy_failover(lambda _client: time.sleep(0.5))
        else:
            second = group.failover()
        resumed_s = probe_resumed(cluster, time.monotonic())
        callers.join(90)
        assert len(callers.outcomes) == RACES, "a caller's .get() is still waiting"
        counts = check_races(cluster, callers.outcomes, expect_all_won=False)
        after = pooled_jobs(cluster, "after")  # the GPU workers follow the new primary too
        # no GPU ran two jobs at once, tokens only grew
        assert double_holds(run_intervals(cluster.env["GPUHEDGE_TEST_RUN_LOG"])) == []
        # no worker stopped: every one of them is still running after both failovers
        assert all(w.alive() for w in cluster.workers), cluster.logs()
        return {
            "races": RACES, **counts,
            "primaries": [list(first[0]), list(first[1]), list(second[1])],
            "resumed_s": round(resumed_s, 2),
            "seconds": round(time.monotonic() - started, 1),
            "pooled_jobs": len(before) + len(after),
        }  # fmt: skip


def pooled_jobs(cluster, tag: str) -> list[dict]:
    """Four pooled jobs, all run (two GPUs, one job each at a time: checked by the caller)."""
    sent = [
        cluster.app.send_task(TASK_POOLED_INFER, ({"id": f"{tag}{i}", "duration_s": 0.5},))
        for i in range(4)
    ]  # fmt: skip
    jobs = [r.get(timeout=60) for r in sent]
    assert sorted(j["output"]["id"] for j in jobs) == [f"{tag}{i}" for i in range(4)]
    return jobs


def test_store_and_broker_on_sentinel_follow_two_failovers_without_a_restart(tmp_path):
    with SentinelGroup() as group:
        figures = ride_through(group, tmp_path, None, lossy=False)
    print(json.dumps({"fault": "sentinel_failovers", "broker": "sentinel", **figures}))


def test_a_lossy_failover_of_the_store_loses_no_race(tmp_path, amqp_vhosts):
    with SentinelGroup() as group:
        figures = ride_through(group, tmp_path, amqp_vhosts.new_url(), lossy=True)
    print(json.dumps({"fault": "sentinel_lossy_failover", "broker": "rabbitmq", **figures}))
