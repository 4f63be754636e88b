"""Redis answers lost at the two worst moments of a race, on real Celery workers.

A worker plugin (``tests/support/blips.py``) runs the call, then raises StoreUnavailable, once
per race, for:

* starting the race (``RaceDriver.create``, which with the primary submitted inline has already
  submitted its job): the task waits for Redis and creates again, which resumes the race it
  finds; the caller's ``.get()`` never sees the blip;
* claiming an attempt's submit (its intent, the first thing written for it): the claim is
  repeated and finds its own intent, so the job is submitted at once, not left to the launch
  backstop to judge "outcome unknown" a minute later;
* registering a job the provider just accepted (``RaceStore.add_job``): the registration is
  repeated, so the job stays cancellable; nothing is flagged as leaked.

Each race wins, nothing leaks, and no attempt is submitted twice.
"""

from __future__ import annotations

import pytest

from gpuhedge_celery.providers.simledger import RedisLedger, seq_key
from tests.support.faults import HEDGED_REQUEST, send_race, start_fault_cluster
from tests.test_faults_redis import Callers, check_races

RACES = 4


@pytest.mark.redis
@pytest.mark.celery
@pytest.mark.timeout(180)
def test_lost_answers_when_a_race_starts_and_registers_a_job_lose_nothing(redis_url, tmp_path):
    cluster = start_fault_cluster(
        redis_url, tmp_path, deadline_s=30.0, coordinators=1, beat=False,
        GPUHEDGE_PLUGINS="tests.support.fixtures_races,tests.support.blips",
        GPUHEDGE_TEST_BLIP="create,claim_submit,add_job",
    )  # fmt: skip
    try:
        callers = Callers([send_race(cluster, HEDGED_REQUEST) for _ in range(RACES)])
        callers.join(90)
        assert len(callers.outcomes) == RACES, "a caller's .get() is still waiting"
        # the launch backstop (60 s) would end a lost claim: none needed it
        assert max(t for _, _, t in callers.outcomes.values()) < 30, callers.outcomes
        counts = check_races(cluster, callers.outcomes, expect_all_won=True)
        assert counts["settled_by_janitor"] == 0, counts
        ledger = RedisLedger(cluster.client, cluster.prefix)
        launched = {"p": 0, "h": 0}
        for race_id in callers.outcomes:
            receipt = cluster_receipt_of(cluster, race_id)
            for a in receipt["attempts"]:
                launched[a["provider"]] += 1
                assert a["handle"], (race_id, a)  # every attempt's job was registered
        submitted = {p: int(ledger.get(seq_key(p)) or 0) for p in launched}
        assert submitted == launched, (submitted, launched)  # none submitted twice
        assert launched["p"] == RACES and launched["h"] >= 1
    finally:
        cluster.close()


def cluster_receipt_of(cluster, race_id):
    from gpuhedge_celery.store.races import RaceStore

    return RaceStore(cluster.client, cluster.prefix).receipt(race_id)
