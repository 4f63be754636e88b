"""A worker killed holding reservations: the janitor settles them, nothing stays reserved.

One real coordination worker runs two races on a budgeted config: in one, primary and hedge
jobs are both running (two open reservations); in the other, the primary's submit call is in
flight (reserved, submit intent recorded, no job id yet). The worker is SIGKILLed. Nobody can
advance either race, so a janitor pass (no coordinator alive) ends them: the running jobs are
cancelled natively and their reservations settle to the cancel receipts' reconciled cost; the
submit whose outcome is unknown keeps its whole reservation as spent (a job may exist).
A reservation whose race has expired is settled by the janitor's sweep, at its full amount.
"""

from __future__ import annotations

import time

import pytest

from gpuhedge_celery.core.budget import BudgetCaps, to_nano
from gpuhedge_celery.core.clock import VirtualClock
from gpuhedge_celery.errors import RaceFailed
from gpuhedge_celery.race.budget import RaceBudget
from gpuhedge_celery.race.janitor import Janitor, JanitorOptions
from gpuhedge_celery.store.budget import BudgetStore
from gpuhedge_celery.store.timers import RaceTimers
from tests.support.fixtures_celery import broker_url_for
from tests.support.fixtures_races import start_race_cluster, stop_race_cluster
from tests.support.waiting import wait_for
from tests.test_budget_races import CONFIG, H_WORST, P_WORST
from tests.test_janitor import BackendEffects, both_running

pytestmark = [pytest.mark.timeout(150), pytest.mark.brokers]

LONG = {"sim": {"p": {"queue_s": 0, "run_s": 10_000}, "h": {"queue_s": 0, "run_s": 10_000}}}
SLOW_SUBMIT = {"sim": {"p": {"submit_s": 3_000}}}  # the submit call itself takes 30 s


def test_the_janitor_settles_a_killed_workers_reservations(redis_url, tmp_path, broker, request):
    # the per-request cap must hold both worst cases of the hedged race here
    config = CONFIG.replace("max_usd_per_request: 0.10", "max_usd_per_request: 0.20")
    rc = start_race_cluster(redis_url, tmp_path, workers=1, config=config,
                            broker_url=broker_url_for(broker, request))  # fmt: skip
    try:
        ledger = BudgetStore(rc.client, rc.prefix)
        running = rc.send(LONG, policy="hedge:p->h@0.05s")
        submitting = rc.send(SLOW_SUBMIT, policy="single")
        wait_for(lambda: both_running(rc, running.id), 20, "both jobs to run")
        wait_for(lambda: ledger.reservation(submitting.id, "a1") is not None, 20,
                 "the slow submit to be reserved")  # fmt: skip
        assert ledger.open_count() == 3
        for worker in rc.cluster.workers:
            worker.kill()
            worker.process.wait(10)

        budget = RaceBudget(ledger, rc.config.budget)
        janitor = Janitor(
            rc.store,
            RaceTimers(rc.client, rc.store.shards),
            lambda name: rc.config.build(name, ledger=rc.ledger),
            BackendEffects(rc.app),
            JanitorOptions(stale_ms=300, coordinators_alive=lambda: False, budget=budget),
        )
        time.sleep(0.5)
        report = janitor.run_once()
        assert {r.race_id: r.action for r in report.races} == {
            running.id: "ended",
            submitting.id: "ended",
        }
        for res in (running, submitting):
            with pytest.raises(RaceFailed):
                res.get(timeout=20)
        # nothing stays reserved; each reservation settled once, to what can be shown
        assert ledger.open_count() == 0
        totals = ledger.totals()
        assert all(v == 0 for k, v in totals.items() if k.startswith("r|"))
        records = {
            (race, a): ledger.reservation(race, a)
            for race, a in ((running.id, "a1"), (running.id, "a2"), (submitting.id, "a1"))
        }
        for (_race, a), record in records.items():
            worst = {"a1": P_WORST, "a2": H_WORST}[a]
            assert int(record["amount"]) == to_nano(worst)
        cancelled = [records[(running.id, a)] for a in ("a1", "a2")]
        assert [r["source"] for r in cancelled] == ["reconciled", "reconciled"]
        assert all(0 < int(r["settled"]) < int(r["amount"]) for r in cancelled)
        unknown = records[(submitting.id, "a1")]
        assert unknown["source"] == "unproven" and unknown["settled"] == unknown["amount"]
        settles = [e for _, e in ledger.entries() if e["type"] == "settle"]
        assert totals["s|all"] == sum(int(e["nano"]) for e in settles)
        # a second pass finds nothing more to settle
        assert janitor.run_once().settled == 0
    except Exception:
        print(rc.logs())
        raise
    finally:
        stop_race_cluster(rc)


def test_the_sweep_settles_a_reservation_whose_race_is_gone(redis_client, prefix):
    ledger = BudgetStore(redis_client, prefix)
    budget = RaceBudget(ledger, BudgetCaps(ceiling_usd=1), VirtualClock(1_000_000.0))
    from gpuhedge_celery.core.attempts import Attempt

    state = {"spec": {"caps_s": {"p": 10.0}, "rates": {"p": {"rate_per_s": 0.01, "idle_s": 0}}}}
    pending = budget.reservation("gone", Attempt("a1", "p", "primary", 0.0), state)
    assert ledger.reserve(pending).granted
    # not yet past its window (10 s) plus the grace: left alone
    assert budget.sweep(lambda race_id: None, grace_ms=5_000) == 0
    budget.clock.advance(16.0)
    assert budget.sweep(lambda race_id: None, grace_ms=5_000) == 1
    record = ledger.reservation("gone", "a1")
    assert record["source"] == "unproven" and int(record["settled"]) == to_nano(0.1)
    assert ledger.open_count() == 0 and ledger.counters(["all"])["all"] == (0, to_nano(0.1))
