"""Races with Modal as a provider, end to end: real Redis, real Celery workers, and the Modal
stand-in (tests/support/modal_fake.py) serving from a process of its own.

Two coordination workers race ``p`` (a sim primary) and ``m`` (adapter ``modal``, reaching the
stand-in through the adapter's ``sdk`` seam) in real time. Scenarios: a sim primary hedged by
Modal (Modal wins, the sim loser is cancelled and confirmed); a Modal primary that loses to the
sim hedge (its input is cancelled, acknowledged, then confirmed by the input's end, with scope
``request`` and no confirmed billing stop); a Modal whose cancelled input never shows its end
(the receipt stays acknowledged and the race lists the leak until the janitor sees the end); a
spawn whose reply comes too late (a listed leak; the late call is cancelled when its id comes);
Modal as a cascade's fallback. Under the config's budget: each attempt's reservation settles to
what it cost (Modal's ``estimated`` on our clock), and a cascade's fallback refused by a key's
cap is never spawned while the primary races on.
After every race: every leak is flagged, and no Modal call is left running unflagged.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from gpuhedge_celery.core.budget import to_nano, worst_case_usd
from gpuhedge_celery.core.jobs import JobHandle
from gpuhedge_celery.providers.redis_ledger import sim_job_running
from gpuhedge_celery.store.budget import BudgetStore
from tests.support.budget_ledger import settled_reservations
from tests.support.fixtures_races import start_race_cluster, stop_race_cluster
from tests.support.modal_fake import FakeModalProcess
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.timeout(180), pytest.mark.brokers]

CONFIG = """
time_scale: 1
providers:
  p:
    role: primary
    adapter: sim
    billed_rate_per_s: 0.0003
    sim:
      seed: 1
      slow_probability: 0
      fast: {{queue_s: 0.05, run_s: 0.2}}
      cancel: {{ack_s: 0.05, terminal_s: 0.1}}
  m:
    role: hedge
    adapter: modal
    billed_rate_per_s: 0.000704
    idle_billed_seconds: 60
    modal:
      app: tts
      function: synthesize
      payload: audio_base64
      poll_interval_s: 0.05
      cancel_confirm_s: 3
      timeouts: {{spawn_s: 1.5, poll_s: 1, cancel_s: 2}}
      sdk: "tests.support.modal_fake_sdk:FakeModalClient"
      sdk_options: {{url: "{url}"}}
    timeout_s: 4                   # the cap: a leaked job's watch stops here (the janitor's turn)
  h:
    role: hedge
    adapter: sim
    billed_rate_per_s: 0.0007
    sim:
      seed: 2
      slow_probability: 0
      fast: {{queue_s: 0.05, run_s: 0.2}}
      cancel: {{ack_s: 0.05, terminal_s: 0.1}}
policy:
  name: fixed
  params: {{hedge_after_ms: 300}}
timeouts:
  attempt_cap_s: 60
budget:                            # modal spends money: a ceiling is required
  ceiling_usd: 100
  keys: {{cascade: {{max_usd_total: 0.061}}, open: {{max_usd_total: 50}}}}   # cascade fits p and
  default_key: open                                  # h, not m as well (see the test)
validator: wav
"""

SLOW_SIM = {"queue_s": 0, "run_s": 60}


@pytest.fixture(scope="module")
def modal_races(redis_url, tmp_path_factory, broker, request):
    from gpuhedge_celery.store.connection import redis_from_url
    from gpuhedge_celery.store.listener import enable_notifications
    from tests.support.fixtures_celery import broker_url_for

    enable_notifications(redis_from_url(redis_url))
    tmp = tmp_path_factory.mktemp("modal-races")
    fake = FakeModalProcess()
    config = tmp / "modal-races.yaml"
    config.write_text(CONFIG.format(url=fake.url))
    rc = start_race_cluster(
        redis_url,
        tmp,
        workers=2,
        broker_url=broker_url_for(broker, request),
        GPUHEDGE_CONFIG=str(config),
        GPUHEDGE_WATCH_INTERVAL_S="0.1",
        GPUHEDGE_JANITOR_STALE_S="0.5",
    )
    from gpuhedge_celery.config import load_config

    rc.config = load_config(config)
    try:
        yield rc, fake
    finally:
        stop_race_cluster(rc)
        fake.stop()


@pytest.fixture
def races(modal_races):
    rc, fake = modal_races
    fake.set_knobs(cancelled_reads_as="remote_error", run_s=0.1, start_s=0.02, spawn_delay_s=0)
    return rc, fake


def run(rc, request: dict[str, Any], policy: str) -> tuple[dict, dict]:
    res = rc.send(request, policy=policy)
    try:
        result = res.get(timeout=30)
        receipt = rc.receipt(res.id, timeout=30)
    except Exception:
        print(rc.logs())
        raise
    return result, receipt


def attempt(receipt: dict[str, Any], provider: str) -> dict[str, Any]:
    return next(a for a in receipt["attempts"] if a["provider"] == provider)


def modal_call(fake, call_id: str) -> dict[str, Any]:
    return fake.control()["calls"][call_id]


def assert_no_unflagged_leak(rc, fake, receipt: dict[str, Any]) -> None:
    """Every leaked receipt is listed and flagged; every job not listed is stopped."""
    leaked = {x["attempt"] for x in receipt["leaks"]}
    for a in receipt["attempts"]:
        cancel = a.get("cancel_receipt") or {}
        if cancel.get("leaked"):
            assert a["id"] in leaked, a
        if a["id"] in leaked or not a.get("handle"):
            continue
        if a["provider"] == "m":
            assert modal_call(fake, a["job_id"])["ended"], a
        else:
            provider = rc.config.build(a["provider"], ledger=rc.ledger)
            assert not sim_job_running(provider, JobHandle.from_dict(a["handle"])), a
    assert receipt["leaked"] is bool(leaked)


def test_modal_hedge_wins_and_the_sim_primary_is_cancelled(races):
    rc, fake = races
    result, receipt = run(rc, {"sim": {"p": SLOW_SIM}, "text": "a"}, "hedge:p->m@300ms")
    assert result["winner"] == "m" and result["hedged"] is True
    m = attempt(receipt, "m")
    assert m["job_id"].startswith("fc-") and modal_call(fake, m["job_id"])["status"] == "success"
    assert modal_call(fake, m["job_id"])["request"]["text"] == "a"
    p = attempt(receipt, "p")
    assert p["cancel_receipt"]["evidence"] == "confirmed_terminal"
    assert p["cancel_receipt"]["terminal_status"] == "CANCELLED"
    assert receipt["leaks"] == [] and receipt["finished"] is True
    assert_no_unflagged_leak(rc, fake, receipt)


def test_modal_primary_loses_and_its_input_is_cancelled_with_a_receipt(races):
    rc, fake = races
    request = {"modal_fake": {"run_s": 60}, "text": "b"}
    result, receipt = run(rc, request, "hedge:m->p@300ms")
    assert result["winner"] == "p"
    m = attempt(receipt, "m")
    cancel = m["cancel_receipt"]
    # Confirmed only by an observed end of the input: the adapter's own poll after the cancel
    # (CANCELLED, scope request), or the race's watch seeing the terminated input first (FAILED).
    assert cancel["evidence"] == "confirmed_terminal" and cancel["leaked"] is False
    assert (cancel["terminal_status"], cancel["scope"]) in (
        ("CANCELLED", "request"),
        ("FAILED", "unknown"),
    )
    assert cancel["billing_stop_confirmed"] is False
    call = wait_for(lambda: modal_call(fake, m["job_id"]), 5, "the Modal call")
    assert call["cancelled"] and call["ended"]
    assert receipt["leaks"] == [] and receipt["leaked"] is False
    assert_no_unflagged_leak(rc, fake, receipt)


def test_a_cancel_modal_never_shows_ended_is_an_acknowledged_flagged_leak(races):
    rc, fake = races
    fake.set_knobs(cancelled_reads_as="pending")  # Modal acknowledges; the end never shows
    request = {"modal_fake": {"run_s": 60}, "text": "c"}
    result, receipt = run(rc, request, "hedge:m->p@300ms")
    assert result["winner"] == "p"
    m = attempt(receipt, "m")
    cancel = m["cancel_receipt"]
    assert cancel["evidence"] == "provider_ack" and cancel["leaked"] is True
    assert cancel["confirmed_terminal"] is False and cancel["cancel_ack_ms"] is not None
    assert modal_call(fake, m["job_id"])["cancelled"]  # the cancel did reach Modal
    assert [x["attempt"] for x in receipt["leaks"]] == [m["id"]] and receipt["leaked"] is True
    assert m["phase"] == "leaked"
    assert_no_unflagged_leak(rc, fake, receipt)
    # Later Modal shows the input ended. The race is finished (final), its watch stops at the
    # cap, and the janitor's next pass cancels the still-registered job again: the adapter
    # observes the end, and only that raises the receipt to confirmed.
    fake.set_knobs(cancelled_reads_as="remote_error")

    def janitor_confirms():
        report = rc.app.send_task("gpuhedge.janitor", queue="gpuhedge.coord").get(timeout=30)
        mine = [r for r in report["races"] if r["race_id"] == result["race_id"]]
        return mine and mine[0]["cancelled"] == [m["id"]]

    wait_for(janitor_confirms, 20, "the janitor to confirm the leaked input's end", every_s=0.5)
    later = rc.store.receipt(result["race_id"])
    cancel = attempt(later, "m")["cancel_receipt"]
    assert cancel["evidence"] == "confirmed_terminal" and cancel["terminal_status"] == "CANCELLED"
    assert (
        later["leaks"] == [] and later["leaked"] is False and cancel["note"].startswith("janitor")
    )


def test_a_spawn_whose_reply_is_lost_is_a_flagged_leak_and_its_late_call_is_cancelled(races):
    rc, fake = races
    fake.set_knobs(spawn_delay_s=2.5)  # the call exists at once; its id comes after spawn_s
    request = {"modal_fake": {"run_s": 60}, "text": "e"}
    result, receipt = run(rc, request, "hedge:m->p@300ms")
    assert result["winner"] == "p"
    m = attempt(receipt, "m")
    assert m["job_id"] in ("", None) and "submit outcome unknown" in m["reasons"][0]
    assert m["cancel_receipt"]["leaked"] is True
    assert [x["attempt"] for x in receipt["leaks"]] == [m["id"]] and receipt["leaked"] is True
    [call_id] = [c for c, v in fake.control()["calls"].items() if v["request"]["text"] == "e"]
    wait_for(lambda: modal_call(fake, call_id)["cancelled"], 10, "the late call's cancel")
    assert_no_unflagged_leak(rc, fake, receipt)


def test_modal_as_the_cascade_fallback_after_both_others_fail(races):
    rc, fake = races
    request = {"sim": {"p": {"outcome": "failed"}, "h": {"outcome": "failed"}}, "text": "d"}
    started = time.monotonic()
    result, receipt = run(rc, request, "cascade:p->h->m@q0.2s+s0.4s+e20s")
    assert result["winner"] == "m" and result["role"] == "fallback"
    assert time.monotonic() - started < 15  # launched when the others failed, not at 20 s
    assert [a["provider"] for a in receipt["attempts"]] == ["p", "h", "m"]
    assert receipt["leaks"] == []
    assert_no_unflagged_leak(rc, fake, receipt)


# -- budgets: every reservation settles to what the attempt cost (core/settlement.py) ----------

M_RATE, M_IDLE_S, M_CAP_S = 0.000704, 60, 4  # m's rate, idle window and cap in CONFIG


def ledger(rc) -> BudgetStore:
    return BudgetStore(rc.client, rc.prefix)


def at(a: dict[str, Any], label: str) -> float:
    """When the attempt's timeline first shows ``label`` (race seconds from its start)."""
    return next(t for t, text in a["timeline"] if label in text)


def assert_estimated(record: dict[str, str], billed_s: float) -> None:
    """m settled ``estimated``: our clock's ``billed_s`` from its submit to its end, at m's
    rate, plus its idle window: the figure the receipt implies, to the nano-dollar. Only the
    step whose save won settles (store/lua/budget_settle.lua), so no step that worked from an
    older copy of the race, at its own clock, leaves its figure."""
    assert record["source"] == "estimated", record
    worst = worst_case_usd(M_CAP_S, M_RATE, M_IDLE_S)
    assert int(record["amount"]) == to_nano(worst, round_up=True)
    expected = to_nano(min(max(0.0, billed_s) * M_RATE, M_CAP_S * M_RATE) + M_IDLE_S * M_RATE)
    assert int(record["settled"]) == expected, (record, billed_s, expected)


def test_a_budgeted_modal_winner_settles_estimated_from_our_clock(races):
    rc, fake = races
    result, receipt = run(rc, {"sim": {"p": SLOW_SIM}, "text": "budget-win"}, "hedge:p->m@300ms")
    assert result["winner"] == "m"
    m, p = attempt(receipt, "m"), attempt(receipt, "p")
    records = settled_reservations(ledger(rc), receipt, [p["id"], m["id"]])
    # Modal reports no billed execution: submit to result on our clock, plus the idle window
    ran_s = m["result_at_s"] - m["submitted_at_s"]
    assert 0 < ran_s < M_CAP_S
    assert_estimated(records[m["id"]], ran_s)
    # the cancelled sim loser: the execution the sim reported (no idle window)
    reported = {to_nano(x) for x in (p["cancel_receipt"]["reconciled_cost_usd"],
                                     p["metrics"].get("cost_usd")) if x is not None}  # fmt: skip
    assert records[p["id"]]["source"] == "reconciled"
    assert int(records[p["id"]]["settled"]) in reported
    assert_no_unflagged_leak(rc, fake, receipt)


def test_a_budgeted_cancelled_modal_loser_settles_estimated_to_its_cancel(races):
    rc, fake = races
    request = {"modal_fake": {"run_s": 60}, "text": "budget-lose"}
    result, receipt = run(rc, request, "hedge:m->p@300ms")
    assert result["winner"] == "p"
    m = attempt(receipt, "m")
    assert m["phase"] == "cancelled" and m["cancel_receipt"]["confirmed_terminal"] is True
    records = settled_reservations(ledger(rc), receipt, [m["id"], attempt(receipt, "p")["id"]])
    # billed from its submit until Modal had the cancel (its acknowledgement), not until its
    # end was seen, plus the idle window its start bills: the receipt's own figure
    cancel_s = at(m, "cancel_sent") - m["submitted_at_s"]
    ended_s = at(m, "(cancel confirmed)") - m["submitted_at_s"]
    assert 0 < cancel_s < ended_s < M_CAP_S
    assert m["cost_source"] == "clock" and cancel_s <= m["usd"] / M_RATE <= ended_s
    assert records[m["id"]]["source"] == "estimated"
    assert int(records[m["id"]]["settled"]) == to_nano(m["billed_usd"])
    assert_no_unflagged_leak(rc, fake, receipt)


def test_a_cascade_fallback_refused_by_a_key_cap_is_never_submitted(races):
    """Key ``cascade`` may spend $0.061: p's worst case (60 s x $0.0003 = $0.018) and h's
    ($0.042) fit, m's ($0.045056) does not while p still holds its reservation. The fallback
    is launched once h fails (two live jobs at most), is refused, and p races on and wins."""
    rc, fake = races
    request = {"sim": {"p": {"queue_s": 0, "run_s": 1.5}, "h": {"outcome": "failed"}},
               "text": "budget-cascade"}  # fmt: skip
    res = rc.send(request, policy="cascade:p->h->m@q0.1s+s0.2s+e0.3s", budget_key="cascade")
    result = res.get(timeout=30)
    receipt = rc.receipt(res.id, timeout=30)
    assert result["winner"] == "p" and receipt["failure_reason"] is None
    assert [(a["provider"], a["role"]) for a in receipt["attempts"]] == [
        ("p", "primary"), ("h", "hedge"), ("m", "fallback")]  # fmt: skip
    m = attempt(receipt, "m")
    assert m["reasons"][0].startswith("budget: refused by keys.cascade.max_usd_total"), m
    assert m["handle"] is None and m["job_id"] == ""
    assert not [c for c in fake.control()["calls"].values()
                if c["request"].get("text") == "budget-cascade"]  # fmt: skip
    budget = ledger(rc)
    refusals = [e for _, e in budget.entries() if e["type"] == "refuse" and e["race"] == res.id]
    assert [e["attempt"] for e in refusals] == [m["id"]]
    p, h = attempt(receipt, "p"), attempt(receipt, "h")
    records = settled_reservations(budget, receipt, [p["id"], h["id"]])
    assert int(records[p["id"]]["amount"]) == to_nano(0.018, round_up=True)
    assert int(records[h["id"]]["amount"]) == to_nano(0.042, round_up=True)
    # nothing of the key stays reserved: what it used is what p and h cost
    reserved, spent = budget.counters(["k:cascade"])["k:cascade"]
    assert reserved == 0 and spent == sum(int(r["settled"]) for r in records.values())
    assert_no_unflagged_leak(rc, fake, receipt)
