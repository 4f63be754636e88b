"""A slow and lossy network between workers and Redis, and between a worker and a provider.

Every connection of the workers, beat and the callers to Redis goes through a loopback TCP
proxy (``tests/support/netproxy.py``) that adds delay and jitter in each direction, resets
every open connection on demand, and drops a server's answer after the command arrived (a
connection lost mid-command). The checks are the outage test's (``test_faults_redis.py``):
every caller's ``.get()`` returns or raises RaceFailed, one winner per race, no sim job left
running and no leak, no GPU held twice (runs never overlap, lease tokens only grow), no pooled
request lost. The test's own checks read Redis directly, not through the proxy.

Provider side: the native RunPod adapter reaches the RunPod fake through the same proxy with
50 ms of added delay; a status call whose answer is lost is retried, and a submit whose answer
is lost is "submit outcome unknown", never sent again.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import redis as redis_lib

from gpuhedge_celery.core.receipts import SUBMIT_OUTCOME_UNKNOWN
from gpuhedge_celery.errors import SubmitError
from gpuhedge_celery.store.leases import LeaseStore
from gpuhedge_celery.tasks.app import TASK_POOLED_INFER
from gpuhedge_celery.tasks.result import GRACE_S
from tests.support.faults import (
    HEDGED_REQUEST,
    QUICK_REQUEST,
    RestartableRedis,
    double_holds,
    run_intervals,
    send_race,
    start_fault_cluster,
)
from tests.support.netproxy import NetProxy
from tests.support.runpod_fake import runpod_provider
from tests.test_faults_redis import Callers, check_races

RACES = 12


@pytest.mark.redis
@pytest.mark.celery
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_races_and_gpu_leases_hold_through_delay_jitter_and_cut_connections(tmp_path):
    server = RestartableRedis(aof=True).start()
    proxy = NetProxy("127.0.0.1", server.port, latency_s=0.005, jitter_s=0.002, seed=1).start()
    cluster = None
    try:
        cluster = start_fault_cluster(proxy.url_for(server.url), tmp_path, deadline_s=60.0,
                                      gpus=2)  # fmt: skip
        # the test's own view of Redis does not go through the faulty network
        cluster.client = redis_lib.Redis.from_url(server.url, decode_responses=True)
        cluster.store = LeaseStore(cluster.client, cluster.prefix)
        for _ in range(2):
            send_race(cluster, QUICK_REQUEST).get(timeout=30)
        pooled = [
            cluster.app.send_task(TASK_POOLED_INFER, ({"id": f"job{i}", "duration_s": 2},))
            for i in range(4)
        ]  # fmt: skip
        callers = Callers([send_race(cluster, HEDGED_REQUEST) for _ in range(RACES)])
        faults: list[str] = []
        time.sleep(0.5)
        faults.append(f"cut {proxy.cut()} connections")
        time.sleep(1.0)
        proxy.drop_next_reply(3)
        faults.append("dropped 3 answers")
        time.sleep(0.5)
        proxy.set(0.050, 0.010)  # 50 ms +- 10 ms each way for 4 s
        time.sleep(2.0)
        faults.append(f"cut {proxy.cut()} connections at 50 ms")
        time.sleep(2.0)
        proxy.set(0.005, 0.002)
        callers.join(60 + GRACE_S + 30)
        assert len(callers.outcomes) == RACES, "a caller's .get() is still waiting"
        counts = check_races(cluster, callers.outcomes, expect_all_won=True)
        jobs = [r.get(timeout=120) for r in pooled]  # no pooled request lost
        assert sorted(j["output"]["id"] for j in jobs) == [f"job{i}" for i in range(4)]
        runs = run_intervals(cluster.env["GPUHEDGE_TEST_RUN_LOG"])
        assert not double_holds(runs), double_holds(runs)
        worst = max(t for *_, t in callers.outcomes.values())
        print(json.dumps({
            "fault": "slow_lossy_redis_link", "races": RACES, **counts, "faults": faults,
            "connections_cut": proxy.stats.cut, "answers_dropped": proxy.stats.replies_dropped,
            "worst_get_s": round(worst, 2), "pooled_jobs": len(jobs),
            "pooled_reruns": sum(1 for j in jobs if j["attempt"] > 0),
            "gpu_runs": sum(len(s) for s in runs.values()),
        }))  # fmt: skip
    finally:
        if cluster is not None:
            cluster.close()
        proxy.close()
        server.close()


def fate(queue_s: float, run_s: float) -> dict:
    return {"runpod_fake": {"*": {"queue_s": queue_s, "run_s": run_s}}}


def test_runpod_through_a_slow_link_retries_a_lost_status_answer_and_flags_a_lost_submit(runpod):
    with NetProxy.for_url(runpod.base_url, latency_s=0.05, jitter_s=0.01, seed=2) as proxy:
        p = runpod_provider(
            SimpleNamespace(base_url=proxy.url_for(runpod.base_url), url=runpod.url)
        )
        try:
            started = time.monotonic()
            handle = p.submit(fate(0.1, 0.2))
            assert time.monotonic() - started >= 0.1  # a round trip of two delayed halves
            p.status(handle)
            # a status answer lost on the way back: the call is sent again and answered
            status_before = runpod.route("ep1", "status")["requests"]
            proxy.drop_next_reply()
            assert p.status(handle) is not None
            assert runpod.route("ep1", "status")["requests"] == status_before + 2
            assert p.result(handle, cap_s=10).state.value == "COMPLETED"
            # a submit whose answer is lost: RunPod has the job, we do not know its id
            jobs_before = runpod.route("ep1", "run")["requests"]
            proxy.drop_next_reply()
            with pytest.raises(SubmitError) as caught:
                p.submit(fate(0, 0.2))
            text = str(caught.value)
            assert SUBMIT_OUTCOME_UNKNOWN in text and "\n" not in text, text
            assert runpod.route("ep1", "run")["requests"] == jobs_before + 1  # never resent
            # connections cut while idle: the next call reconnects
            proxy.cut()
            assert p.result(p.submit(fate(0, 0.1)), cap_s=10).state.value == "COMPLETED"
        finally:
            p.close()


def test_the_proxy_delays_each_direction_and_cuts_mid_command():
    """The fault itself, measured: a Redis round trip gains twice the delay; an answer dropped
    after the command arrived leaves the command done and the caller with an error."""
    server = RestartableRedis().start()
    try:
        with NetProxy("127.0.0.1", server.port, latency_s=0.02, seed=3) as proxy:
            client = redis_lib.Redis.from_url(proxy.url_for(server.url))
            client.ping()
            started = time.perf_counter()
            for _ in range(5):
                client.ping()
            per = (time.perf_counter() - started) / 5
            assert 0.04 <= per < 0.2, per
            proxy.drop_next_reply()
            with pytest.raises(redis_lib.ConnectionError):
                client.set("k", "v")
            direct = redis_lib.Redis.from_url(server.url)
            assert direct.get("k") == b"v"  # it ran: only the answer was lost
            assert client.ping() and proxy.cut() == 1  # the client's one connection
            assert client.ping() and proxy.stats.accepted == 3  # reconnected
    finally:
        server.close()


def test_a_race_save_whose_answer_was_lost_is_recognised_when_sent_again():
    """A step's save that reached Redis but whose answer was lost (the connection dropped
    mid-command) used to fail the step, which was then re-applied as a duplicate: saved, but
    its actions (declare the winner, cancel the loser) never ran until a backstop timer. It is
    now sent again with the same save id and answered "saved"; a different save of the same
    version still conflicts."""
    from gpuhedge_celery.store.races import RaceStore, VersionConflict

    server = RestartableRedis().start()
    try:
        with NetProxy("127.0.0.1", server.port, latency_s=0.002, seed=4) as proxy:
            client = redis_lib.Redis.from_url(proxy.url_for(server.url), decode_responses=True)
            store = RaceStore(client, "lostsave")
            assert store.save("r1", {"race": {"n": 0}}, 0) == 1
            proxy.drop_next_reply()
            assert store.save("r1", {"race": {"n": 1}}, 1) == 2  # landed; answer lost; re-sent
            assert proxy.stats.replies_dropped == 1
            record = store.load("r1")
            assert record.version == 2 and record.state == {"race": {"n": 1}}
            with pytest.raises(VersionConflict):  # someone else's save of version 1
                store.save("r1", {"race": {"n": -1}}, 1)
            for n in range(2, 12):  # later saves keep working, each id recorded
                assert store.save("r1", {"race": {"n": n}}, n) == n + 1
            assert store.load("r1").state == {"race": {"n": 11}}
    finally:
        server.close()
