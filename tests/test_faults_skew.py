"""Clock skew: coordination hosts whose wall clocks are 2 s ahead and 2 s behind.

Two real coordination workers race together, one with its clock set 2 s ahead and one 2 s
behind (``tests/support/skew.py``, a plugin that shifts ``time.time``), with beat running the
janitor every half second on a 1 s staleness threshold. Both take "now" from Redis
(``store/redis_clock.py``), so:

* a hedge timer fires at its time, never up to 2 s early on the host that runs ahead: races
  whose primary answers before the hedge is due are never hedged, and hedges that are due
  launch within a few tenths of a second of it;
* the janitor never takes a live race for a dead one (its heartbeats would look 2-4 s old to a
  host that runs ahead, past the 1 s threshold): every race ends with a winner.
"""

from __future__ import annotations

import json

import pytest

from gpuhedge_celery.store.races import RaceStore
from gpuhedge_celery.store.redis_clock import RedisClock
from tests.support.faults import send_race, start_fault_cluster, wait_until

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.timeout(240)]

SKEW_S = 2.0
HEDGE_AT_S = 1.0
ROUNDS = 6


def test_a_redis_clock_reads_redis_time_whatever_the_host_says(redis_client, monkeypatch):
    import time

    clock = RedisClock(redis_client, sync_s=60)
    seconds, micros = redis_client.time()
    assert abs(clock.now() - (seconds + micros / 1e6)) < 0.25  # a stalled thread, not 5 s
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 5.0)  # the host's clock jumps
    seconds, micros = redis_client.time()
    assert abs(clock.now() - (seconds + micros / 1e6)) < 0.25
    assert clock.skew_s == pytest.approx(5.0, abs=0.25)
    assert clock.syncs == 1  # one TIME per sync period, not one per reading


def test_a_redis_clock_sync_keeps_its_shortest_round_trip(redis_client):
    """A reply read late (the thread held up by the GIL) would put the midpoint, and so the
    clock, off by half the delay; the shortest of a sync's round trips is kept."""
    import time

    class SlowFirstReply:
        calls = 0

        def time(self):
            answer = redis_client.time()
            SlowFirstReply.calls += 1
            if SlowFirstReply.calls == 1:
                time.sleep(0.4)  # the reply sat unread for 0.4 s: a midpoint 0.2 s late
            return answer

    clock = RedisClock(SlowFirstReply(), sync_s=60)
    seconds, micros = redis_client.time()
    assert abs(clock.now() - (seconds + micros / 1e6)) < 0.05
    assert SlowFirstReply.calls == 3 and clock.syncs == 1


def test_hosts_2s_ahead_and_behind_neither_fire_timers_early_nor_reap_live_races(
    redis_url, tmp_path
):
    cluster = start_fault_cluster(
        redis_url, tmp_path, deadline_s=60.0, coordinators=0, beat=False,
        GPUHEDGE_PLUGINS="tests.support.fixtures_races,tests.support.skew",
        GPUHEDGE_JANITOR_STALE_S="1", GPUHEDGE_RECONCILE_INTERVAL_S="0.5",
    )  # fmt: skip
    try:
        ahead = cluster.start_coordinator(wait=False, GPUHEDGE_TEST_SKEW_S=str(SKEW_S))
        behind = cluster.start_coordinator(wait=False, GPUHEDGE_TEST_SKEW_S=str(-SKEW_S))
        cluster.wait_ready(ahead, behind)
        cluster.start_beat(GPUHEDGE_TEST_SKEW_S=str(SKEW_S))
        policy = f"hedge:p->h@{HEDGE_AT_S:g}s"
        quick = {"sim": {"p": {"queue_s": 0, "run_s": 30}}}  # answers at 0.3 s: no hedge due
        hedged = {  # the primary takes 3 s; the hedge, launched at 1 s, answers at 1.5 s
            "sim": {"p": {"queue_s": 0, "run_s": 300}, "h": {"queue_s": 0, "run_s": 50}}
        }
        sent = []
        for _ in range(ROUNDS):
            sent.append(("quick", send_race(cluster, quick, policy=policy)))
            sent.append(("hedged", send_race(cluster, hedged, policy=policy)))
        launches = []
        for kind, result in sent:
            out = result.get(timeout=60)  # RaceFailed here would be a janitor reaping it
            receipt = wait_until(
                lambda r=result: cluster_receipt(cluster, r.id), 30, what="the receipt"
            )
            if kind == "quick":
                assert out["winner"] == "p" and not out["hedged"], (out, receipt)
            else:
                assert out["winner"] == "h" and out["hedged"], (out, receipt)
                primary, hedge = receipt["attempts"][0], receipt["attempts"][1]
                launches.append(hedge["launched_at_s"] - primary["submitted_at_s"])
        assert all(HEDGE_AT_S - 0.01 <= t < HEDGE_AT_S + 0.5 for t in launches), launches
        store = RaceStore(cluster.client, cluster.prefix)
        reaped = [r.id for _, r in sent if (store.load(r.id).state or {}).get("janitor")]
        assert not reaped, f"the janitor took over live races: {reaped}"
        print(json.dumps({"fault": "clock_skew", "skew_s": SKEW_S, "races": len(sent),
                          "hedge_launch_s": [round(t, 3) for t in launches]}))  # fmt: skip
    finally:
        cluster.close()


def cluster_receipt(cluster, race_id):
    return RaceStore(cluster.client, cluster.prefix).receipt(race_id)
