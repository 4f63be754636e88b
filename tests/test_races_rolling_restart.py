"""An upgrade with races in flight: the only coordination worker stops (SIGTERM, Celery's warm
shutdown) while races wait on their hedge timers and primaries, and a new one starts after it
has gone. What docs/operations.md ("Upgrading with races in flight") promises: every race's
state and timers are in Redis, so the hedge timers the old worker armed fire on the new one,
which finishes each race with one winner, its loser cancelled and confirmed, and nothing leaked.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.fixtures_races import RACE_CONFIG, start_race_cluster, stop_race_cluster

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.slow, pytest.mark.brokers,
              pytest.mark.timeout(180)]  # fmt: skip

# The primary runs 40 s (real); the hedge timer is due 20 s after the primary's submit (a spec's
# timings are real time), later than the old worker takes to stop (a warm shutdown measured
# about 1 s on the Redis broker, 6-10 s on RabbitMQ, even idle; it fires timers until it
# exits), and the hedge wins about 0.15 s after it launches.
SLOW_PRIMARY = {"sim": {"p": {"queue_s": 1, "run_s": 4000}, "h": {"queue_s": 0.5, "run_s": 10}}}
POLICY = "hedge:p->h@20s"
HEDGE_AFTER_S = 20
RACES = 6


@pytest.fixture
def one_coordinator(redis_url, tmp_path_factory, broker, request):
    from tests.support.fixtures_celery import broker_url_for

    tmp = tmp_path_factory.mktemp("restart")
    config = tmp / "long-caps.yaml"  # the test config with room for a 40 s primary
    config.write_text(RACE_CONFIG.replace("attempt_cap_s: 180", "attempt_cap_s: 6000"))
    rc = start_race_cluster(redis_url, tmp, workers=1, broker_url=broker_url_for(broker, request),
                            GPUHEDGE_CONFIG=str(config))  # fmt: skip
    yield rc
    stop_race_cluster(rc)


def test_races_in_flight_finish_on_the_worker_that_replaces_a_stopped_one(one_coordinator):
    rc = one_coordinator
    (old,) = rc.cluster.workers
    races = [rc.send(SLOW_PRIMARY, policy=POLICY) for _ in range(RACES)]
    deadline = time.monotonic() + 20
    while not all(rc.store.live_jobs(r.id) for r in races):  # every primary submitted
        assert time.monotonic() < deadline, "the primaries were not submitted"
        time.sleep(0.02)
    old.kill(signal.SIGTERM)
    term_at = time.monotonic()
    old.process.wait(30)
    stopped_at = time.monotonic()
    assert stopped_at - term_at < HEDGE_AFTER_S - 2, "the old worker stopped before the timers"
    assert not any(r.ready() for r in races), "no race was decided before the old worker left"

    rc.cluster.start_coordinator()  # the upgraded worker; no coordinator ran in between
    for race in races:
        out = race.get(timeout=60)
        assert out["winner"] == "h", out  # the hedge timer fired on the new worker
        receipt = rc.receipt(race.id)
        assert receipt["finished"] is True and receipt["leaks"] == [], receipt
        primary, hedge = receipt["attempts"]
        assert hedge["launched_at_s"] >= primary["submitted_at_s"] + HEDGE_AFTER_S
        assert rc.running_sim_jobs(receipt) == [], "the primary was cancelled and stopped"
        assert rc.store.live_jobs(race.id) == {}
    assert time.monotonic() - stopped_at < 60
