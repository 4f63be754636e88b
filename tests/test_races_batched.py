"""Races on real Celery workers with the batched coordination loop (``race/watch_batch.py``).

Two real coordination workers fire their due watch polls in batches (one round trip per
batch); what a batch hands back (a job that ended, a hedge, a cancel, a winner) runs on the
timer threads. Races of every shape end with one winner and nothing left running, the
workers' metrics show the batches did the polling, and a worker SIGKILLed in the middle of
many races loses none of them: its claimed timers fire in the survivor after their lease.
"""

from __future__ import annotations

import signal
import time

import pytest

from gpuhedge_celery.errors import RaceFailed
from tests.support.fixtures_races import start_race_cluster, stop_race_cluster
from tests.support.prometheus_server import sample, scrape, wait_for_endpoint
from tests.support.redis_server import free_port
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.celery, pytest.mark.timeout(180)]

# provider seconds (one is 10 ms here): queued a while, then running, then done
QUEUED_THEN_WINS = {"sim": {"p": {"queue_s": 5, "run_s": 10}}}
LATE_HEDGE = "hedge:p->h@2s"  # far behind the primary's 150 ms
HEDGE_WINS = {"sim": {"p": {"queue_s": 5, "run_s": 150}, "h": {"queue_s": 5, "run_s": 10}}}
BOTH_FAIL = {"sim": {"p": {"queue_s": 5, "run_s": 10, "outcome": "failed"},
                     "h": {"queue_s": 5, "run_s": 10, "outcome": "failed"}}}  # fmt: skip
HEDGE_POLICY = "hedge:p->h@0.3s"


@pytest.fixture(scope="module")
def batched(redis_url, tmp_path_factory, broker, request):
    from tests.support.fixtures_celery import broker_url_for

    ports = [free_port(), free_port()]
    rc = start_race_cluster(redis_url, tmp_path_factory.mktemp("loop"), workers=0,
                            broker_url=broker_url_for(broker, request),
                            GPUHEDGE_METRICS_ADDR="127.0.0.1",
                            GPUHEDGE_VISIBILITY_TIMEOUT_S="2", GPUHEDGE_LAUNCH_BACKSTOP_S="1",
                            GPUHEDGE_CANCEL_BACKSTOP_S="1")  # fmt: skip
    started = [rc.cluster.start_coordinator(wait=False, GPUHEDGE_METRICS_PORT=str(port))
               for port in ports]  # fmt: skip
    rc.cluster.wait_ready(*started)
    for port in ports:
        wait_for_endpoint(port)
    rc.metrics_ports = ports
    rc.workers = started
    yield rc
    stop_race_cluster(rc)


def batched_counts(rc) -> tuple[float, float]:
    done = handed = 0.0
    for port in rc.metrics_ports:
        samples = scrape(port)
        done += sample(samples, "gpuhedge_timers_batched_total", outcome="done")
        handed += sample(samples, "gpuhedge_timers_batched_total", outcome="handed_back")
    return done, handed


def check_race(rc, res, expect_winner: str | None) -> None:
    """One winner (``expect_winner``; "any": whichever) or RaceFailed (None), no leak but an
    unknown submit, no sim job left running."""
    if expect_winner is None:
        with pytest.raises(RaceFailed):
            res.get(timeout=60)
    else:
        winner = res.get(timeout=60)["winner"]
        assert winner == expect_winner or expect_winner == "any", (winner, expect_winner)
    receipt = rc.receipt(res.id, 30)
    assert (receipt["winner"] is None) == (expect_winner is None), receipt
    # The only leak allowed: a submit cut off by a kill, whose outcome is unknown (no job id
    # to cancel, so it is flagged, never repeated)
    unknown = {a["id"] for a in receipt["attempts"]
               if any("outcome unknown" in r for r in a["reasons"])}  # fmt: skip
    assert {leak["attempt"] for leak in receipt["leaks"]} == unknown, receipt["leaks"]
    wait_for(lambda: not rc.running_sim_jobs(receipt), 10, "every sim job of the race ended")


def test_races_of_every_shape_end_right_and_the_batches_poll(batched):
    rc = batched
    before = batched_counts(rc)
    sent = []
    for i in range(10):
        sent.append((rc.send(QUEUED_THEN_WINS, policy=LATE_HEDGE), "p"))
        sent.append((rc.send(HEDGE_WINS, policy=HEDGE_POLICY), "h"))
        if i % 5 == 0:
            sent.append((rc.send(BOTH_FAIL, policy="hedge:p->h@0.02s"), None))
    for res, winner in sent:
        check_race(rc, res, winner)
    done, handed = (a - b for a, b in zip(batched_counts(rc), before, strict=True))
    # each race's queued -> running poll is a batched step; ends, hedges and cancels are not
    assert done >= 20, (done, handed)
    assert handed >= 20, (done, handed)


def test_a_worker_killed_mid_races_loses_none(batched):
    rc = batched
    # a hedge whose launch died with the worker is launched late, by the backstop: then the
    # primary may win
    sent = [(rc.send(HEDGE_WINS, policy=HEDGE_POLICY), "any") for _ in range(12)]
    sent += [(rc.send(QUEUED_THEN_WINS, policy=LATE_HEDGE), "any") for _ in range(12)]
    time.sleep(0.3)  # in flight: polls due, hedges launching, in both workers
    victim = rc.workers[0]
    victim.kill(signal.SIGKILL)
    victim.process.wait(timeout=10)
    for res, winner in sent:
        check_race(rc, res, winner)
