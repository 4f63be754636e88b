"""Bounded settlement on a real Redis: a reported cost never moves the budget by more than the
attempt's reservation, a figure that cannot be true is refused before it is priced, and a bad
argument to a budget script changes nothing (Lua is not rolled back after its first write)."""

from __future__ import annotations

import math

import pytest
import redis

from gpuhedge_celery.core.attempts import Attempt, Phase
from gpuhedge_celery.core.budget import BudgetCaps, to_nano
from gpuhedge_celery.core.clock import VirtualClock
from gpuhedge_celery.core.jobs import JobState
from gpuhedge_celery.errors import ProviderProtocolError, StoreError
from gpuhedge_celery.providers.base import MAX_REPORTED_MS, reported_ms
from gpuhedge_celery.race.budget import RaceBudget
from gpuhedge_celery.store.budget import BudgetStore, budget_report
from gpuhedge_celery.store.scripts import lua_script
from tests.support.http_provider_server import HttpProviderServer
from tests.test_http import KEY as HTTP_KEY
from tests.test_http import make as make_http

pytestmark = pytest.mark.cluster

# one attempt of provider "p": cap 100 s at $0.001/s plus 20 s idle = $0.12 worst case
SPEC = {"caps_s": {"p": 100.0}, "rates": {"p": {"rate_per_s": 0.001, "idle_s": 20.0}}}
WORST_NANO = to_nano(0.12)


@pytest.fixture
def ledger(redis_client, prefix):
    return BudgetStore(redis_client, prefix)


def reserved(ledger, race_id="r1", attempt_id="a1"):
    rb = RaceBudget(ledger, BudgetCaps(ceiling_usd=1000), VirtualClock(1_900_000_000.0))
    a = Attempt(id=attempt_id, provider="p", role="primary", launched_at=0.0)
    assert ledger.reserve(rb.reservation(race_id, a, {"spec": SPEC})).granted
    return rb, a


def ended_with_report(a: Attempt, execution_ms: float) -> dict:
    """``a`` as a completed attempt whose provider reported ``execution_ms`` of billed run."""
    a.phase = Phase.ENDED
    a.submitted_at, a.result_at, a.result_state = 0.0, 5.0, "COMPLETED"
    a.handle = {"provider": "p", "job_id": "j1"}
    cost = execution_ms / 1000 * 0.001
    return {"spec": SPEC, "results": {a.id: {"metrics": {"cost_usd": cost}}}}


def test_a_report_above_the_reservation_settles_at_the_reservation_and_is_kept(ledger):
    rb, a = reserved(ledger)
    items = rb.settlements(None, ended_with_report(a, 1e12), [a])  # $1e6 reported
    assert ledger.settle("r1", items, 1) == (1, WORST_NANO)
    totals = ledger.totals()
    assert totals["r|all"] == 0 and totals["s|all"] == WORST_NANO
    settle = [e for _, e in ledger.entries() if e["type"] == "settle"][0]
    assert settle["over_reported"] == "1" and int(settle["reported_nano"]) == to_nano(
        1e6 + 0.02
    )  # with the idle window
    assert int(settle["nano"]) == WORST_NANO
    # counted once, however often the settlement is sent again (a retried save, the janitor)
    for _ in range(2):
        assert ledger.settle("r1", items, 2) == (0, 0)
    assert ledger.totals()["o|p"] == 1
    report = budget_report(ledger, BudgetCaps(ceiling_usd=1000), ["p"], "2030-03-17")
    assert report["over_reported"] == {"p": 1}
    # and the ledger alone rebuilds that count
    assert ledger.repair(apply=False) == {}


def test_a_report_within_the_reservation_settles_as_reported_with_no_flag(ledger):
    rb, a = reserved(ledger)
    items = rb.settlements(None, ended_with_report(a, 30_000), [a])  # 30 s run + 20 s idle
    ledger.settle("r1", items, 1)
    settle = [e for _, e in ledger.entries() if e["type"] == "settle"][0]
    assert int(settle["nano"]) == to_nano(0.05) and "over_reported" not in settle


@pytest.mark.parametrize("bad", ["1e+20", "nan", "inf", "-5", "1.5", "x"])
def test_a_bad_cost_argument_changes_no_counter_and_keeps_the_reservation_open(ledger, bad):
    reserved(ledger)
    before = ledger.totals()
    entries = list(ledger.entries())
    script = lua_script(ledger.client, "budget_settle")
    keys, args = ledger._settle_call("r1", [("a1", 1, "reconciled")], 1)  # noqa: SLF001
    args[3] = bad
    for _ in range(3):  # a janitor retrying it every pass must not drift the counters either
        with pytest.raises(redis.ResponseError, match="budget_settle"):
            script(keys=keys, args=args)
    assert ledger.totals() == before and list(ledger.entries()) == entries
    assert ledger.reservation("r1", "a1").get("settled") is None and ledger.open_count() == 1


@pytest.mark.parametrize("index, bad", [(1, "1e+20"), (1, "nan"), (2, "x"), (8, "2.5")])
def test_a_bad_reservation_argument_writes_nothing(ledger, index, bad):
    rb = RaceBudget(ledger, BudgetCaps(ceiling_usd=1000), VirtualClock(1_900_000_000.0))
    a = Attempt(id="a1", provider="p", role="primary", launched_at=0.0)
    pending = rb.reservation("r1", a, {"spec": SPEC})
    pending.args[index] = bad
    with pytest.raises(StoreError, match="budget_reserve"):
        ledger.reserve(pending)
    assert ledger.totals() == {} and list(ledger.entries()) == []
    assert ledger.client.exists(*pending.keys) == 0


def test_a_settlement_figure_past_what_a_script_takes_is_passed_on_capped(ledger):
    rb, a = reserved(ledger)
    items = rb.settlements(None, ended_with_report(a, 1e30), [a])
    assert ledger.settle("r1", items, 1) == (1, WORST_NANO)
    assert ledger.totals()["s|all"] == WORST_NANO


@pytest.mark.parametrize(
    "value, ok",
    [(None, True), (0, True), (1234.5, True), (MAX_REPORTED_MS, True), (-1, False),
     (MAX_REPORTED_MS + 1, False), (1e12, False), (1e20, False), (math.inf, False),
     (math.nan, False), (True, False), ("12", False)],
)  # fmt: skip
def test_a_reported_duration_must_be_a_believable_number_of_ms(value, ok):
    if ok:
        assert reported_ms("rp", "status", "executionTime", value) == (
            None if value is None else float(value)
        )
    else:
        with pytest.raises(ProviderProtocolError, match="executionTime"):
            reported_ms("rp", "status", "executionTime", value)


@pytest.mark.parametrize("execution", [1e12, 1e20])
def test_a_runpod_webhooks_own_figures_are_never_priced(runpod, execution):
    """A delivery only wakes the race: RunPod's /status answer is what is applied, so the
    body's executionTime, however absurd, reaches no receipt and no ledger."""
    import time

    from tests.support.runpod_fake import runpod_provider

    p = runpod_provider(runpod)
    h = p.submit({"runpod_fake": {"*": {"queue_s": 0.0, "run_s": 0.05}}})
    time.sleep(0.3)  # the job has ended at the fake
    body = {"id": h.job_id, "status": "COMPLETED", "executionTime": execution, "output": {}}
    result = p.webhook_result(h, body)
    assert result.state is JobState.COMPLETED
    assert 40 <= result.metrics["execution_ms"] <= 1000  # the fake's own figure


@pytest.mark.parametrize("reported", [1e12, -5.0])
def test_an_unbelievable_execution_time_is_never_priced_and_the_result_is_kept(reported):
    with HttpProviderServer() as server:
        server.knobs.api_key = HTTP_KEY
        server.knobs.execution_ms = reported
        p = make_http(server)
        result = p.result(p.submit({}), cap_s=10)
    assert result.state is JobState.COMPLETED and result.payload
    assert "execution_ms" not in result.metrics and "cost_usd" not in result.metrics
