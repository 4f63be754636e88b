"""A ``rediss://`` (TLS) Redis restarted under load: the same bar as the plain ``redis://``
outage of tests/test_faults_redis.py. The server is this test's own TLS-only ``redis-server``
(``--port 0``, a self-signed certificate generated here); workers, beat and the caller reach it
through a ``rediss://`` URL that trusts that certificate.

Checked: every race's caller gets a winner or an explicit RaceFailed, each race's receipt and
winner claim agree and nothing is left running, and no worker stops ("Unrecoverable error"):
every one is alive at the end and a fresh race completes on each coordinator; and what they
log of the outage names the Redis ``rediss://``, not ``redis://``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest

from gpuhedge_celery.tasks.app import TASK_POOLED_INFER
from gpuhedge_celery.tasks.result import GRACE_S
from tests.support.faults import (
    HEDGED_REQUEST,
    QUICK_REQUEST,
    RestartableRedis,
    send_race,
    start_fault_cluster,
)
from tests.test_faults_redis import Callers, check_races, probe_resumed

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.slow, pytest.mark.timeout(240)]

OUTAGE_S = 5.0
RACES = 10
POOLED = 3
DEADLINE_S = 40.0


def test_redis_server_speaks_tls():
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is not installed (scripts/test.sh installs it)"
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    assert "v=" in out
    tls = RestartableRedis(tls=True).start()  # fails when the build has no TLS
    tls.close()


def test_errors_name_a_tls_redis_by_its_scheme():
    import redis as redis_py

    from gpuhedge_celery.store.connection import client_location
    from gpuhedge_celery.store.leases import LeaseStore

    tls = redis_py.Redis.from_url("rediss://:pw@db.example:6380/2?ssl_cert_reqs=required")
    assert LeaseStore(tls).where == client_location(tls) == "rediss://db.example:6380/2"
    plain = redis_py.Redis.from_url("redis://:pw@db.example:6379/0")
    assert client_location(plain) == "redis://db.example:6379/0"


def test_a_rediss_restart_under_load_ends_every_race_and_no_worker_stops(tmp_path):
    redis = RestartableRedis(aof=True, tls=True).start()
    cluster = None
    try:
        assert redis.url.startswith("rediss://")
        cluster = start_fault_cluster(redis.url, tmp_path, deadline_s=DEADLINE_S, gpus=1)
        for _ in range(2):  # warm both coordinators
            send_race(cluster, QUICK_REQUEST).get(timeout=30)
        assert "rediss://" in cluster.logs()  # the workers' banner: the broker is the TLS Redis
        callers = Callers([send_race(cluster, HEDGED_REQUEST) for _ in range(RACES)])
        # pooled requests for the one GPU: the coordinators hold the waiting ones unacknowledged
        # (acks_late) through the outage, the case that stopped workers on plain redis://
        pooled = [
            cluster.app.send_task(TASK_POOLED_INFER, ({"id": f"job{i}", "duration_s": 2},))
            for i in range(POOLED)
        ]
        time.sleep(1.0)  # races submitted, hedges launching, a pooled job running
        down_at = time.monotonic()
        redis.stop()
        time.sleep(OUTAGE_S)
        redis.start()
        up_at = time.monotonic()
        resumed_s = probe_resumed(cluster, up_at)
        callers.join(DEADLINE_S + GRACE_S + 30)
        assert len(callers.outcomes) == RACES, "a caller's .get() is still waiting"
        counts = check_races(cluster, callers.outcomes, expect_all_won=False)
        jobs = [r.get(timeout=90) for r in pooled]  # no pooled request lost
        assert sorted(j["output"]["id"] for j in jobs) == [f"job{i}" for i in range(POOLED)]
        logs = "\n".join(w.log() for w in cluster.workers)  # whole logs, not their tails
        assert "Unrecoverable error" not in logs, cluster.logs()
        # what the workers said of the outage names the TLS Redis as such
        assert f"rediss://127.0.0.1:{redis.port}" in logs
        assert f"redis://127.0.0.1:{redis.port}" not in logs, "a TLS Redis named as plain redis://"
        stopped = [w.nodename for w in cluster.workers if not w.alive()]
        assert not stopped, f"workers stopped: {stopped}\n{cluster.logs()}"
        # every coordinator still takes work: more fresh races than coordinators, all won
        for result in [send_race(cluster, QUICK_REQUEST) for _ in range(4)]:
            assert result.get(timeout=30)["winner"]
        print(
            json.dumps(
                {
                    "fault": "rediss_restart",
                    "outage_s": round(up_at - down_at, 2),
                    "races": RACES,
                    **counts,
                    "pooled_jobs": len(jobs),
                    "resumed_s": round(resumed_s, 2),
                    "worst_get_s": round(max(t for *_, t in callers.outcomes.values()), 2),
                }
            )
        )
    finally:
        if cluster is not None:
            cluster.close()
        redis.close()
