"""Redis outages and restarts under load, with real workers, beat and GPU workers.

Each test runs its own ``redis-server`` (never the machine's shared one) and its own workers:
two coordination workers, beat (janitor, reconcile) and, in the outage test, two GPU workers
running pooled jobs under 3 s leases. Races race sim providers at ``time_scale`` 0.01.

Checked after every fault:

* every caller's ``.get()`` (a :class:`RaceResult`, what ``hedged_infer.delay`` returns)
  returns a winner or raises RaceFailed, and none waits past its race's deadline plus the grace;
* one winner per race: the result, the receipt and the winner claim name the same attempt;
* no sim job is left running and no cancel is left unconfirmed (no leak), where Redis kept its
  data; where it lost it, the workers said so at start-up;
* no GPU ran two jobs at once, lease tokens only grew, and a job whose lease lapsed during the
  outage was stopped and run again under a new lease (no pooled request lost).

Each test prints one JSON line with what it measured (``docs/reliability.md`` quotes them).
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from gpuhedge_celery.errors import RaceFailed
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
    wait_until,
)

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.slow, pytest.mark.timeout(300)]

OUTAGE_S = 10.0
# the janitor (GPUHEDGE_JANITOR_STALE_S=5, beat every 1 s in the fault cluster) settles a job
# whose cancel was not confirmed within this bound: stale, a pass, a cancel, with margin
JANITOR_BOUND_S = 30.0
RACES = 20


class Callers:
    """One thread per race blocked in ``.get()`` with no timeout, as an app would be."""

    def __init__(self, results):
        self.outcomes: dict[str, tuple[str, object, float]] = {}
        self.started = time.monotonic()
        self.threads = [
            threading.Thread(target=self._get, args=(r,), daemon=True) for r in results
        ]  # fmt: skip
        for t in self.threads:
            t.start()

    def _get(self, result) -> None:
        try:
            out = result.get()
            self.outcomes[result.id] = ("won", out, time.monotonic() - self.started)
        except RaceFailed as e:
            self.outcomes[result.id] = ("failed", e, time.monotonic() - self.started)
        except Exception as e:  # anything else is a finding: recorded, asserted below
            self.outcomes[result.id] = (type(e).__name__, e, time.monotonic() - self.started)

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))


def probe_resumed(cluster, since: float, limit_s: float = 60.0) -> float:
    """Seconds from ``since`` until a fresh race completes again."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            send_race(cluster, QUICK_REQUEST).get(timeout=5)
            return time.monotonic() - since
        except Exception:
            time.sleep(0.2)
    raise AssertionError(f"no race completed within {limit_s} s of Redis coming back")


def check_races(cluster, outcomes, *, expect_all_won: bool) -> dict[str, int]:
    """One winner per race, no sim job left running, nothing leaked; returns counts."""
    from gpuhedge_celery.providers.redis_ledger import sim_job_running
    from gpuhedge_celery.providers.simledger import RedisLedger
    from gpuhedge_celery.settings import ProcessSettings
    from gpuhedge_celery.store.races import RaceStore
    from tests.support.fixtures_races import RaceCluster

    # the shards the workers use (the count's default follows the store's URL)
    shards = ProcessSettings.from_env(cluster.env).race_shards(cluster.prefix, cluster.redis_url)
    store = RaceStore(cluster.client, shards)
    rc = RaceCluster.__new__(RaceCluster)  # its helpers only, on this cluster's keys
    rc.client, rc.prefix, rc.store = cluster.client, cluster.prefix, store
    rc.ledger = RedisLedger(cluster.client, cluster.prefix)
    from gpuhedge_celery.config import load_config

    rc.config = load_config(cluster.env["GPUHEDGE_CONFIG"])
    counts = {"won": 0, "failed": 0, "settled_by_janitor": 0}
    for race_id, (kind, value, _) in outcomes.items():
        assert kind in ("won", "failed"), f"race {race_id}: .get() raised {kind}: {value}"
        counts[kind] += 1
        receipt = wait_until(lambda r=race_id: store.receipt(r), 60, what=f"receipt of {race_id}")
        winner = cluster.client.get(store.shards.race(race_id).winner)
        if kind == "won":
            assert value["attempt"] == receipt["winner"] == winner, (race_id, value, receipt)
        else:
            assert receipt["winner"] is None and winner is None, (race_id, receipt)
        wait_until(lambda r=receipt: not rc.running_sim_jobs(r), 30, what="sim jobs to stop")
        # A job whose cancel went out but was never confirmed (its answer lost on a cut link,
        # or the cancel window passed) stays registered and the receipt flags it; the janitor
        # (stale after 5 s, a pass every 1 s) cancels it again, confirms it and rewrites the
        # receipt. Every registered job must end stopped and unregistered, leak flag cleared.
        registered = store.live_jobs(race_id)
        if registered:
            counts["settled_by_janitor"] += len(registered)
            wait_until(lambda r=race_id: not store.live_jobs(r), JANITOR_BOUND_S,
                       what=f"the registered jobs of race {race_id} to be settled")  # fmt: skip
            for handle in registered.values():
                provider = rc.config.build(handle["provider"], ledger=rc.ledger)
                assert not sim_job_running(provider, handle), (race_id, handle)
        final = store.receipt(race_id)
        assert not final.get("leaks"), f"race {race_id} leaked: {leak_story(final)}"
    if expect_all_won:
        assert counts["won"] == len(outcomes), counts
    return counts


def leak_story(receipt: dict) -> dict:
    """What a failing check shows of a leaked race: each leaked attempt's timeline, reasons,
    error and cancel receipt, and the janitor's mark (who ended the race, if it did)."""
    leaked = {x["attempt"] for x in receipt.get("leaks") or []}
    keep = ("id", "provider", "phase", "reasons", "timeline", "error", "cancel_receipt")
    return {
        "leaks": receipt.get("leaks"),
        "attempts": [{k: a.get(k) for k in keep} for a in receipt["attempts"] if a["id"] in leaked],
        "janitor": receipt.get("janitor"),
        "note": receipt.get("note"),
    }


def test_a_10s_redis_outage_under_load_every_race_ends_and_no_gpu_is_held_twice(tmp_path):
    redis = RestartableRedis(aof=True).start()
    cluster = None
    try:
        cluster = start_fault_cluster(redis.url, tmp_path, deadline_s=60.0, gpus=2)
        for _ in range(2):  # warm both coordinators
            send_race(cluster, QUICK_REQUEST).get(timeout=30)
        callers = Callers([send_race(cluster, HEDGED_REQUEST) for _ in range(RACES)])
        time.sleep(1.0)  # races submitted, hedges launching
        # Pooled jobs sent now, so that the outage starts while one has just begun: with 3 s
        # leases, a 5 s job that began under a second before Redis went away is still running
        # when its lease lapses, and must be stopped and run again (a job sent earlier could be
        # in its last moment when the outage starts and end, correctly, on its first lease).
        pooled = [
            cluster.app.send_task(TASK_POOLED_INFER, ({"id": f"job{i}", "duration_s": 5},))
            for i in range(4)
        ]  # fmt: skip
        log = cluster.env["GPUHEDGE_TEST_RUN_LOG"]
        wait_until(
            lambda: any(end == float("inf") and time.time() - began < 1.0
                        for spans in run_intervals(log).values()
                        for began, end, _, _ in spans),
            20, interval_s=0.02, what="a pooled job that has just begun",
        )  # fmt: skip
        down_at = time.monotonic()
        redis.stop()
        time.sleep(OUTAGE_S)
        redis.start()
        up_at = time.monotonic()
        resumed_s = probe_resumed(cluster, up_at)
        callers.join(60 + GRACE_S + 30)
        assert len(callers.outcomes) == RACES, "a caller's .get() is still waiting"
        # every race finished once Redis was back: none waited past its deadline
        worst = max(t for _, _, t in callers.outcomes.values())
        assert worst < 60 + GRACE_S
        # and none waited for a backstop timer (30 s after the outage) to finish its race: a
        # step whose save's answer was lost in the outage still performs its actions
        assert worst < 1 + OUTAGE_S + 15, sorted(t for *_, t in callers.outcomes.values())
        counts = check_races(cluster, callers.outcomes, expect_all_won=True)
        jobs = [r.get(timeout=90) for r in pooled]  # no pooled request lost
        assert sorted(j["output"]["id"] for j in jobs) == [f"job{i}" for i in range(4)]
        runs = run_intervals(cluster.env["GPUHEDGE_TEST_RUN_LOG"])
        assert double_holds(runs) == []  # no GPU ran two jobs at once, tokens only grew
        reruns = sum(1 for j in jobs if j["attempt"] > 0)
        assert reruns >= 1, "the jobs running through the outage lost their leases"
        print(json.dumps({
            "fault": "redis_outage", "outage_s": round(up_at - down_at, 2), "races": RACES,
            **counts, "resumed_s": round(resumed_s, 2), "worst_get_s": round(worst, 2),
            "pooled_jobs": len(jobs), "pooled_reruns": reruns,
            "gpu_runs": sum(len(s) for s in runs.values()),
        }))  # fmt: skip
    finally:
        if cluster is not None:
            cluster.close()
        redis.close()


def test_a_race_whose_deadline_passes_during_an_outage_fails_its_caller_explicitly(tmp_path):
    redis = RestartableRedis(aof=True).start()
    cluster = None
    slow = {"sim": {"p": {"queue_s": 1, "run_s": 2000}, "h": {"queue_s": 0.5, "run_s": 2000}}}
    try:
        cluster = start_fault_cluster(redis.url, tmp_path, deadline_s=4.0)
        send_race(cluster, QUICK_REQUEST).get(timeout=30)
        callers = Callers([send_race(cluster, slow) for _ in range(6)])
        time.sleep(1.0)
        redis.stop()
        time.sleep(6.0)  # the races' 4 s deadlines pass while Redis is down
        redis.start()
        up_at = time.monotonic()
        callers.join(4 + 6 + GRACE_S + 20)
        assert len(callers.outcomes) == 6, "a caller's .get() is still waiting"
        counts = check_races(cluster, callers.outcomes, expect_all_won=False)
        assert counts["failed"] == 6
        for _, error, took in callers.outcomes.values():
            assert "deadline" in str(error)
            assert took < 4 + 6 + GRACE_S  # failed by the workers, well before the caller's grace
        failed_after_s = max(t for _, _, t in callers.outcomes.values()) - (up_at - callers.started)
        print(json.dumps({"fault": "deadline_during_outage", "races": 6, **counts,
                          "failed_after_redis_back_s": round(failed_after_s, 2)}))  # fmt: skip
    finally:
        if cluster is not None:
            cluster.close()
        redis.close()


def test_a_restart_with_aof_completes_the_races_in_flight(tmp_path):
    redis = RestartableRedis(aof=True).start()
    cluster = None
    try:
        cluster = start_fault_cluster(redis.url, tmp_path, deadline_s=60.0)
        send_race(cluster, QUICK_REQUEST).get(timeout=30)
        callers = Callers([send_race(cluster, HEDGED_REQUEST) for _ in range(10)])
        time.sleep(1.2)
        redis.kill()  # kill -9: appendfsync everysec may lose the last second of writes
        redis.start()
        up_at = time.monotonic()
        callers.join(60 + GRACE_S)
        assert len(callers.outcomes) == 10, "a caller's .get() is still waiting"
        counts = check_races(cluster, callers.outcomes, expect_all_won=False)
        resumed_s = probe_resumed(cluster, up_at)
        print(json.dumps({"fault": "redis_kill9_restart_aof", "races": 10, **counts,
                          "resumed_s": round(resumed_s, 2)}))  # fmt: skip
        assert counts["won"] >= 8, counts  # a race may fail explicitly if its last second was lost
    finally:
        if cluster is not None:
            cluster.close()
        redis.close()


def test_a_restart_without_persistence_fails_every_caller_and_workers_warned(tmp_path):
    redis = RestartableRedis(aof=False).start()
    cluster = None
    deadline_s = 4.0
    try:
        cluster = start_fault_cluster(redis.url, tmp_path, deadline_s=deadline_s, beat=False)
        send_race(cluster, QUICK_REQUEST).get(timeout=30)
        assert "Redis keeps no persistence at all" in cluster.logs()  # said at start-up
        callers = Callers([send_race(cluster, HEDGED_REQUEST) for _ in range(6)])
        time.sleep(1.0)
        redis.stop()
        redis.start()  # empty: every race's state, timers and results are gone
        up_at = time.monotonic()
        callers.join(deadline_s + GRACE_S + 20)
        assert len(callers.outcomes) == 6, "a caller's .get() is still waiting"
        for kind, error, took in callers.outcomes.values():
            assert kind == "failed" and "no state in Redis" in str(error), error
            assert took < deadline_s + GRACE_S + 15  # sent to failed, on a loaded machine
        resumed_s = probe_resumed(cluster, up_at)
        print(json.dumps({"fault": "redis_restart_no_persistence", "races": 6, "failed": 6,
                          "worst_get_s": round(max(t for *_, t in callers.outcomes.values()), 2),
                          "resumed_s": round(resumed_s, 2)}))  # fmt: skip
    finally:
        if cluster is not None:
            cluster.close()
        redis.close()
