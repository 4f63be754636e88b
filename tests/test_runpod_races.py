"""Hedged races on real Celery workers with RunPod as the primary, against the RunPod fake.

Two real coordination workers race ``rp`` (the native ``runpod`` adapter on the fake's endpoint
``e2e-p``) against a sim hedge or a second RunPod endpoint (``rpb``, ``e2e-h``), in real time.
The fake runs in its own process; the workers share its request budget through Redis. Each
request forces its jobs' fates (``runpod_fake`` per endpoint, ``sim`` per provider), so the
assertions are about who won and what the receipts prove, checked against the fake's own view
of every job, and what the budget ledger settled each attempt at (RunPod's ``executionTime``).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.support.runpod_fake import KEY, FakeRunpod

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.celery,
    pytest.mark.brokers,
    pytest.mark.sentinel,
    pytest.mark.cluster,
]

REPO = Path(__file__).resolve().parents[1]

CONFIG = """
providers:
  rp:
    role: primary
    adapter: runpod
    billed_rate_per_s: 0.0003
    idle_billed_seconds: 5
    runpod: &api
      endpoint_id: e2e-p
      api_key: "${{RUNPOD_TEST_KEY}}"
      base_url: "{base}"
      payload: output.audio_base64
      timeouts: {{connect_s: 2, read_s: 5}}
      poll: {{min_s: 0.05, max_s: 0.5, fraction: 0.25}}
      cancel_confirm_s: 5
      cancel_poll_s: 0.05
  rps:                           # the same endpoint, paced slowly: polls 1.5 s, then 3 s in
    role: primary
    adapter: runpod
    billed_rate_per_s: 0.0003
    runpod:
      <<: *api
      poll: {{min_s: 1.5, max_s: 5, fraction: 1.0}}
  rpb:
    role: hedge
    adapter: runpod
    billed_rate_per_s: 0.0005
    runpod:
      <<: *api
      endpoint_id: e2e-h
  sim:
    role: hedge
    adapter: sim
    billed_rate_per_s: 0.0007
    sim: {{seed: 2, slow_probability: 0, fast: {{queue_s: 0.05, run_s: 0.3}},
          cancel: {{ack_s: 0.05, terminal_s: 0.1}}}}
policy:
  name: fixed
  params: {{hedge_after_ms: 300}}
timeouts:
  attempt_cap_s: 60
budget: {{ceiling_usd: 1000}}   # paid adapters need a ceiling (docs/costs.md)
validator: wav
"""


@pytest.fixture(scope="module")
def cluster(redis_url, tmp_path_factory, broker, request):
    from gpuhedge_celery.store.connection import redis_from_url
    from gpuhedge_celery.store.listener import enable_notifications
    from tests.support.fixtures_celery import CeleryCluster, broker_url_for
    from tests.support.fixtures_races import RaceCluster

    enable_notifications(redis_from_url(redis_url))
    tmp = tmp_path_factory.mktemp("runpod-races")
    with FakeRunpod({"api_key": KEY}) as fake:
        config = tmp / "runpod-races.yaml"
        config.write_text(CONFIG.format(base=fake.base_url))
        cc = CeleryCluster(redis_url, f"t{uuid.uuid4().hex[:10]}", tmp,
                           broker_url_for(broker, request))  # fmt: skip
        cc.env.update({"GPUHEDGE_CONFIG": str(config), "RUNPOD_TEST_KEY": KEY,
                       "PYTHONPATH": str(REPO)})  # fmt: skip
        try:
            cc.wait_ready(*[cc.start_coordinator(wait=False) for _ in range(2)])
            rc = RaceCluster(cc, config)
            rc.fake = fake
            yield rc
        finally:
            cc.close()
            keys = list(rc.client.scan_iter(f"{cc.prefix}:*", count=1000))
            if keys:
                rc.client.delete(*keys)


def run(rc, request, policy):
    res = rc.send(request, policy=policy)
    try:
        result = res.get(timeout=60)
        receipt = rc.receipt(res.id, timeout=30)
    except Exception:
        print(rc.logs())
        raise
    return result, receipt


def race_failed(rc, request, policy):
    from gpuhedge_celery.errors import RaceFailed

    res = rc.send(request, policy=policy)
    with pytest.raises(RaceFailed):
        res.get(timeout=60)
    return rc.receipt(res.id, timeout=30)


def attempt(receipt, provider):
    return next(a for a in receipt["attempts"] if a["provider"] == provider)


def adapter_facts(cancel):
    """Whether the adapter's own receipt reached the race: when the race's watch sees the
    terminal state first, the race confirms the cancel itself and may finish before the
    adapter's acknowledgement (with RunPod's figures) arrives; the fake then holds the facts."""
    return cancel["execution_ms_before_cancel"] is not None


def fates(**endpoints):
    return {"runpod_fake": endpoints}


def assert_clean(rc, receipt):
    """No job left running at the fake, nothing unflagged, nothing registered as live."""
    from gpuhedge_celery.providers.redis_ledger import sim_job_running

    assert rc.fake.live() == []
    sim = rc.config.build("sim", ledger=rc.ledger)
    assert not any(sim_job_running(sim, a["handle"]) for a in receipt["attempts"]
                   if a["provider"] == "sim" and a["handle"])  # fmt: skip
    assert receipt["finished"] is True and rc.store.live_jobs(receipt["race_id"]) == {}


def test_a_slow_runpod_primary_loses_to_the_sim_hedge_and_is_cancelled(cluster):
    request = {**fates(**{"e2e-p": {"queue_s": 0, "run_s": 30}}),
               "sim": {"sim": {"queue_s": 0.05, "run_s": 0.3}}}  # fmt: skip
    result, receipt = run(cluster, request, "hedge:rp->sim@0.3s")
    assert result["winner"] == "sim" and result["hedged"] is True
    primary = attempt(receipt, "rp")
    cancel = primary["cancel_receipt"]
    assert primary["phase"] == "cancelled" and cancel["note"] == "lost"
    assert cancel["evidence"] == "confirmed_terminal" and cancel["leaked"] is False
    assert cancel["terminal_status"] == "CANCELLED" and cancel["was_running"] is True
    job = cluster.fake.job("e2e-p", primary["job_id"])
    assert job["status"] == "CANCELLED" and job["cancelled"] is True and job["executionTime"] > 0
    if adapter_facts(cancel):
        assert cancel["billing_stop_confirmed"] is True and cancel["scope"] == "request"
        assert cancel["execution_ms_before_cancel"] == job["executionTime"]  # RunPod's figure
    assert receipt["leaks"] == []
    assert_clean(cluster, receipt)


def test_the_runpod_primary_wins_and_the_queued_runpod_backup_costs_nothing(cluster):
    request = fates(**{"e2e-p": {"queue_s": 0.1, "run_s": 0.8},
                       "e2e-h": {"queue_s": 30, "run_s": 1}})  # fmt: skip
    result, receipt = run(cluster, request, "hedge:rp->rpb@0.2s")
    assert result["winner"] == "rp" and result["hedged"] is True
    assert result["provider_ms"] >= 800
    backup = attempt(receipt, "rpb")
    cancel = backup["cancel_receipt"]
    assert cancel["confirmed_terminal"] is True and cancel["terminal_status"] == "CANCELLED"
    assert cancel["scope"] == "queued_job" and cancel["was_running"] is False
    assert cluster.fake.job("e2e-h", backup["job_id"])["executionTime"] == 0
    if adapter_facts(cancel):
        assert cancel["reconciled_cost_usd"] == 0.0 and cancel["billing_stop_confirmed"] is True
    assert receipt["leaks"] == []
    assert_clean(cluster, receipt)


def test_cutover_cancels_a_queued_runpod_primary_for_the_runpod_backup(cluster):
    request = fates(**{"e2e-p": {"queue_s": 30, "run_s": 1},
                       "e2e-h": {"queue_s": 0.05, "run_s": 0.3}})  # fmt: skip
    result, receipt = run(cluster, request, "cutover:rp->rpb@q0.3s+s5s")
    assert result["winner"] == "rpb" and receipt["cut_over"] is True
    cancel = attempt(receipt, "rp")["cancel_receipt"]
    assert cancel["scope"] == "queued_job" and cancel["was_running"] is False
    assert cancel["confirmed_terminal"] is True
    assert cluster.fake.job("e2e-p", attempt(receipt, "rp")["job_id"])["executionTime"] == 0
    if adapter_facts(cancel):
        assert cancel["reconciled_cost_usd"] == 0.0 and cancel["billing_stop_confirmed"] is True
    assert receipt["leaks"] == []
    assert_clean(cluster, receipt)


def test_a_lost_submit_reply_is_never_resubmitted_and_is_flagged(cluster):
    before = cluster.fake.route("e2e-p", "run")["requests"]
    cluster.fake.configure(faults={"run": {"errors_next": 1, "error_code": 502}})
    try:
        request = {**fates(**{"e2e-p": {"queue_s": 0, "run_s": 0.2}}),
                   "sim": {"sim": {"queue_s": 0.05, "run_s": 0.3}}}  # fmt: skip
        result, receipt = run(cluster, request, "hedge:rp->sim@5s")
    finally:
        cluster.fake.configure(faults={"run": {}})
    assert result["winner"] == "sim"  # the primary's failed submit launched the hedge at once
    primary = attempt(receipt, "rp")
    assert primary["handle"] is None
    assert any("submit outcome unknown" in r for r in primary["reasons"]), primary["reasons"]
    assert cluster.fake.route("e2e-p", "run")["requests"] == before + 1  # never sent again
    # a job may run at RunPod under an id we never learnt: the receipt says so
    assert receipt["leaks"] == [{"attempt": primary["id"], "provider": "rp", "job_id": ""}]
    assert primary["cancel_receipt"]["leaked"] is True
    assert "submit outcome unknown" in primary["cancel_receipt"]["note"]
    assert_clean(cluster, receipt)


def test_both_runpod_jobs_failing_fails_the_race_with_every_job_accounted(cluster):
    request = fates(**{"e2e-p": {"queue_s": 0, "run_s": 0.1, "outcome": "FAILED"},
                       "e2e-h": {"queue_s": 0, "run_s": 0.1, "outcome": "TIMED_OUT"}})  # fmt: skip
    receipt = race_failed(cluster, request, "hedge:rp->rpb@5s")
    assert receipt["winner"] is None
    states = {a["provider"]: a["state"] for a in receipt["attempts"]}
    assert states == {"rp": "FAILED", "rpb": "FAILED"}  # TIMED_OUT: stopped by RunPod
    assert receipt["leaks"] == []
    assert_clean(cluster, receipt)


def test_the_watch_polls_just_before_the_hedge_so_a_finished_primary_is_not_hedged(cluster):
    # Paced alone, the primary would be looked at 1.5 s and 3 s after its submit: its end at
    # 2 s would be seen after the hedge timer (2.5 s) launched a paid hedge for nothing. The
    # watch polls 0.25 s before that decision instead, sees COMPLETED, and nobody hedges.
    request = {**fates(**{"e2e-p": {"queue_s": 0, "run_s": 2.0}}),
               "sim": {"sim": {"queue_s": 0.05, "run_s": 0.3}}}  # fmt: skip
    result, receipt = run(cluster, request, "hedge:rps->sim@2.5s")
    timeline = [label for _, label in receipt["attempts"][0]["timeline"]]
    assert result["winner"] == "rps" and result["hedged"] is False, timeline
    assert [a["provider"] for a in receipt["attempts"]] == ["rps"]
    assert "IN_PROGRESS" in timeline  # the paced poll came before the end
    assert result["provider_ms"] >= 2000
    assert_clean(cluster, receipt)


def test_a_budgeted_race_settles_each_reservation_to_runpods_execution_time(cluster):
    """With the config's budget, each RunPod attempt reserves its worst case (60 s cap plus
    idle, x rate) and settles, once it ends, to RunPod's own ``executionTime`` x the rate plus
    the idle window: the winner from its result, the cancelled loser from the terminal status
    that confirmed its cancel (core/settlement.py: both ``reconciled``)."""
    from gpuhedge_celery.core.budget import to_nano
    from gpuhedge_celery.store.budget import BudgetStore
    from tests.support.budget_ledger import settled_reservations

    request = fates(**{"e2e-p": {"queue_s": 0, "run_s": 30},
                       "e2e-h": {"queue_s": 0, "run_s": 0.3}})  # fmt: skip
    result, receipt = run(cluster, request, "hedge:rp->rpb@0.3s")
    assert result["winner"] == "rpb" and result["hedged"] is True
    primary, hedge = attempt(receipt, "rp"), attempt(receipt, "rpb")
    assert primary["phase"] == "cancelled" and primary["cancel_receipt"]["was_running"] is True
    records = settled_reservations(BudgetStore(cluster.client, cluster.prefix), receipt,
                                   [primary["id"], hedge["id"]])  # fmt: skip
    ran_ms = cluster.fake.job("e2e-p", primary["job_id"])["executionTime"]
    won_ms = cluster.fake.job("e2e-h", hedge["job_id"])["executionTime"]
    assert ran_ms > 0 and won_ms >= 300
    # rp: $0.0003/s and a 5 s idle window; rpb: $0.0005/s, no idle window
    expected = {primary["id"]: (ran_ms / 1000.0 * 0.0003 + 5 * 0.0003, 65 * 0.0003),
                hedge["id"]: (won_ms / 1000.0 * 0.0005, 60 * 0.0005)}  # fmt: skip
    for attempt_id, (cost, worst) in expected.items():
        record = records[attempt_id]
        assert record["source"] == "reconciled", record
        assert int(record["amount"]) == to_nano(worst, round_up=True)
        assert int(record["settled"]) == to_nano(cost) < int(record["amount"])
    assert_clean(cluster, receipt)
