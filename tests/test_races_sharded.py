"""Races on real Celery workers with races and their timers on three race shards
(``GPUHEDGE_RACE_SHARDS=3``): the two workers share the shards' timers, races on every shard end
with one winner, and a worker SIGKILLed in the middle of races on every shard loses none (the
survivor takes its shards once its coordinator lease lapses)."""

from __future__ import annotations

import signal
import time
import uuid

import pytest

from gpuhedge_celery.store.race_keys import shard_of
from gpuhedge_celery.store.timer_coordinators import Coordinators
from gpuhedge_celery.store.timers import RaceTimers
from tests.support.fixtures_races import start_race_cluster, stop_race_cluster
from tests.support.waiting import subscribers, wait_for
from tests.test_races_batched import (
    HEDGE_POLICY,
    HEDGE_WINS,
    LATE_HEDGE,
    QUEUED_THEN_WINS,
    check_race,
)

pytestmark = [pytest.mark.celery, pytest.mark.timeout(180), pytest.mark.cluster]

SHARDS = 3


@pytest.fixture(scope="module")
def sharded(redis_url, tmp_path_factory, broker, request):
    from tests.support.fixtures_celery import broker_url_for

    with pytest.MonkeyPatch.context() as env:
        env.setenv("GPUHEDGE_RACE_SHARDS", str(SHARDS))  # the workers' and the harness's
        rc = start_race_cluster(redis_url, tmp_path_factory.mktemp("sharded"),
                                broker_url=broker_url_for(broker, request),
                                GPUHEDGE_RACE_SHARDS=str(SHARDS),
                                GPUHEDGE_VISIBILITY_TIMEOUT_S="2", GPUHEDGE_LAUNCH_BACKSTOP_S="1",
                                GPUHEDGE_CANCEL_BACKSTOP_S="1")  # fmt: skip
        yield rc
        stop_race_cluster(rc)


def send_on(rc, shard: int, request: dict, policy: str):
    """``hedged_infer`` under a race id whose shard is ``shard``."""
    race_id = next(r for r in (f"sh-{uuid.uuid4().hex}" for _ in range(1000))
                   if shard_of(r, SHARDS) == shard)  # fmt: skip
    return rc.app.send_task("gpuhedge.hedged_infer", (request,), {"policy": policy},
                            queue="gpuhedge.coord", task_id=race_id)  # fmt: skip


def test_the_workers_share_the_shards_timers_one_claimer_each(sharded):
    rc = sharded
    assert rc.store.shards.count == SHARDS
    channels = [store.keys.channel for store in RaceTimers(rc.client, rc.store.shards).stores]
    registry = Coordinators(rc.client, rc.prefix)
    wait_for(lambda: len(registry.live()) == 2, 10, "both workers hold a coordinator lease")
    # two coordinators, three shards: each shard's wake-ups go to the one worker dealt it
    wait_for(lambda: all(n == 1 for _, n in subscribers(rc.client, *channels)), 10,
             "every shard's wake-ups listened to by exactly one worker")  # fmt: skip


def test_races_on_every_shard_end_right(sharded):
    rc = sharded
    sent = []
    for shard in range(SHARDS):
        sent.append((send_on(rc, shard, QUEUED_THEN_WINS, LATE_HEDGE), "p"))
        sent.append((send_on(rc, shard, HEDGE_WINS, HEDGE_POLICY), "h"))  # by its hedge timer
    for res, winner in sent:
        check_race(rc, res, winner)


def test_a_worker_killed_mid_races_loses_none_on_any_shard(sharded):
    rc = sharded
    sent = [(send_on(rc, shard, HEDGE_WINS, HEDGE_POLICY), "any")
            for shard in range(SHARDS) for _ in range(3)]  # fmt: skip
    sent += [(send_on(rc, shard, QUEUED_THEN_WINS, LATE_HEDGE), "any")
             for shard in range(SHARDS) for _ in range(3)]  # fmt: skip
    time.sleep(0.3)  # in flight: polls due, hedges launching, in both workers
    victim = rc.cluster.workers[0]
    victim.kill(signal.SIGKILL)
    victim.process.wait(timeout=10)
    for res, winner in sent:
        check_race(rc, res, winner)
