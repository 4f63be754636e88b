"""Race semantics end to end: real Celery workers, real Redis, sim providers on compressed time.

Each race runs through ``send_task("gpuhedge.hedged_infer")`` on two real coordination workers
(``tests/support/fixtures_races.py``; one provider second is 10 ms). Fates are forced per
request, so every scenario is deterministic; only timings vary with the machine's load, and the
assertions are about who won and what the receipts prove, not about milliseconds.
"""

from __future__ import annotations

import time

import pytest

from gpuhedge_celery.errors import RaceFailed

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.brokers,
    pytest.mark.sentinel,
    pytest.mark.cluster,
]


def run(rc, request, **kwargs):
    """Race ``request``; return (result, receipt), with the worker logs on failure."""
    res = rc.send(request, **kwargs)
    try:
        result = res.get(timeout=20)
        receipt = rc.receipt(res.id)
    except Exception:
        print(rc.logs())
        raise
    assert result["race_id"] == res.id == receipt["race_id"]
    return result, receipt


def attempt(receipt, provider):
    return next(a for a in receipt["attempts"] if a["provider"] == provider)


def assert_clean(rc, receipt):
    """Every race ends with no sim job running, nothing leaked and no live job registered."""
    assert rc.running_sim_jobs(receipt) == []
    assert receipt["leaks"] == [] and receipt["finished"] is True
    assert rc.store.live_jobs(receipt["race_id"]) == {}
    # (the janitor's heartbeat index may still list the race: a step that lost a version race
    # after the finish refreshes it; with no live job left the janitor has nothing to do)


def test_fast_primary_wins_without_hedge(race_cluster):
    result, receipt = run(race_cluster, {"sim": {"p": {"queue_s": 1, "run_s": 3}}})
    assert result["winner"] == "p" and result["role"] == "primary"
    assert result["hedged"] is False
    assert result["payload"]  # the WAV, inline (small)
    assert result["e2e_ms"] > 0 and result["provider_ms"] == pytest.approx(40.0, abs=1)
    assert [a["provider"] for a in receipt["attempts"]] == ["p"]
    assert receipt["receipts"] == [] and receipt["wasted_usd"] == 0.0
    states = [label for _, label in attempt(receipt, "p")["timeline"]]
    assert states[:2] == ["launched", "submitted"] and states[-1] == "COMPLETED (valid)"
    assert_clean(race_cluster, receipt)


def test_slow_primary_hedge_wins_primary_cancelled_with_confirmed_receipt(race_cluster):
    request = {"sim": {"p": {"queue_s": 2, "run_s": 100}, "h": {"queue_s": 0.5, "run_s": 4}}}
    result, receipt = run(race_cluster, request)
    assert result["winner"] == "h" and result["hedged"] is True
    primary = attempt(receipt, "p")
    assert primary["phase"] == "cancelled"
    cancel = primary["cancel_receipt"]
    assert cancel["evidence"] == "confirmed_terminal" and cancel["confirmed_terminal"] is True
    assert cancel["terminal_status"] == "CANCELLED" and cancel["leaked"] is False
    assert cancel["was_running"] is True and cancel["note"] == "lost"
    assert cancel["cancel_sent_ms"] <= cancel["terminal_ms"]
    assert receipt["wasted_usd"] > 0  # the primary ran ~30 s of provider time for nothing
    assert_clean(race_cluster, receipt)


def test_queued_primary_cut_over_at_no_cost(race_cluster):
    request = {"sim": {"p": {"queue_s": 30, "run_s": 5}, "h": {"queue_s": 0.5, "run_s": 4}}}
    result, receipt = run(race_cluster, request, policy="state_aware")
    assert result["winner"] == "h"
    assert receipt["cut_over"] is True and receipt["policy"].startswith("cutover:p->h")
    cancel = attempt(receipt, "p")["cancel_receipt"]
    assert cancel["was_running"] is False and cancel["scope"] == "queued_job"
    assert cancel["terminal_status"] == "CANCELLED"
    # the cost comes with the cancel's reply, unless a watch poll confirmed the cancel first
    assert cancel["estimated_cost_usd"] in (0.0, None)
    assert receipt["wasted_usd"] == 0.0  # cancelled while queued: no worker ever started
    assert_clean(race_cluster, receipt)


def test_malformed_primary_rejected_by_validator_hedge_wins(race_cluster):
    request = {"sim": {"p": {"queue_s": 0.5, "run_s": 2, "outcome": "invalid"}}}
    result, receipt = run(race_cluster, request)
    assert result["winner"] == "h"
    primary = attempt(receipt, "p")
    assert primary["state"] == "COMPLETED" and primary["valid"] is False
    assert any("rms" in r.lower() or "silent" in r.lower() for r in primary["reasons"])
    # an invalid primary launches the hedge at once, not at the 300 ms hedge time
    hedge = attempt(receipt, "h")
    assert hedge["launched_at_s"] - primary["result_at_s"] < 0.2
    assert_clean(race_cluster, receipt)


def test_both_fail_is_an_explicit_failure_carrying_the_receipt(race_cluster):
    request = {
        "sim": {
            "p": {"queue_s": 0.5, "run_s": 1, "outcome": "failed"},
            "h": {"queue_s": 0.5, "run_s": 1, "outcome": "failed"},
        }
    }
    res = race_cluster.send(request)
    with pytest.raises(RaceFailed) as info:
        res.get(timeout=20)
    receipt = info.value.receipt
    assert receipt["race_id"] == res.id and receipt["winner"] is None
    assert receipt["note"] == "no attempt returned a valid result"
    assert [a["state"] for a in receipt["attempts"]] == ["FAILED", "FAILED"]
    assert "no attempt returned a valid result" in str(info.value)
    assert race_cluster.receipt(res.id) == receipt  # the same receipt is kept in Redis
    assert_clean(race_cluster, receipt)


def test_cancelled_but_unconfirmed_primary_wins_when_the_hedge_fails(race_cluster):
    request = {
        "sim": {
            # cancelled at 3 s while running; the cancel would only take effect at ~53 s,
            # and the job completes at 8 s: it is still in the race, and wins.
            "p": {"queue_s": 0, "run_s": 8, "cancel_ack_s": 0.2, "cancel_terminal_s": 50},
            "h": {"queue_s": 0.2, "run_s": 1, "outcome": "failed"},
        }
    }
    result, receipt = run(race_cluster, request, policy="cancel_at:p->h@30ms")
    assert result["winner"] == "p"
    primary = attempt(receipt, "p")
    labels = [label for _, label in primary["timeline"]]
    assert any(label.startswith("cancel_sent") for label in labels)
    assert labels[-1] == "COMPLETED (valid)"
    assert attempt(receipt, "h")["state"] == "FAILED"
    assert_clean(race_cluster, receipt)


def test_cascade_escalates_to_the_fallback(race_cluster):
    request = {
        "sim": {
            "p": {"queue_s": 30, "run_s": 5},  # queued at the 25 ms cutover: cancelled
            "h": {"queue_s": 60, "run_s": 5},  # still queued at the 250 ms escalation
            "f": {"queue_s": 0.2, "run_s": 3},
        }
    }
    result, receipt = run(race_cluster, request, policy="cascade")
    assert result["winner"] == "f" and result["role"] == "fallback"
    assert receipt["cut_over"] is True and receipt["escalated"] is True
    assert [a["provider"] for a in receipt["attempts"]] == ["p", "h", "f"]
    assert attempt(receipt, "h")["cancel_receipt"]["terminal_status"] == "CANCELLED"
    assert_clean(race_cluster, receipt)


def test_get_returns_before_the_loser_cleanup_finishes(race_cluster):
    request = {
        "sim": {
            # the hedge wins; the primary's cancel takes ~1 s of real time to be confirmed
            "p": {"queue_s": 1, "run_s": 200, "cancel_ack_s": 0.2, "cancel_terminal_s": 100},
            "h": {"queue_s": 0.5, "run_s": 2},
        }
    }
    res = race_cluster.send(request)
    result = res.get(timeout=20)
    assert result["winner"] == "h"
    assert race_cluster.store.receipt(res.id) is None  # the loser is still being cancelled
    from gpuhedge_celery.race import receipt as read

    provisional = read(res.id, redis_url=race_cluster.redis_url, prefix=race_cluster.prefix)
    assert provisional["finished"] is False and provisional["winner_provider"] == "h"
    receipt = race_cluster.receipt(res.id)
    cancel = attempt(receipt, "p")["cancel_receipt"]
    assert cancel["confirmed_terminal"] is True and cancel["terminal_status"] == "CANCELLED"
    assert receipt["finished_at"] > receipt["won_at"] + 0.5
    assert_clean(race_cluster, receipt)


def test_providers_argument_picks_the_racers(race_cluster):
    request = {"sim": {"f": {"queue_s": 0.2, "run_s": 1}}}
    result, receipt = run(race_cluster, request, policy="single", providers=["f"])
    assert result["winner"] == "f" and receipt["policy"] == "single:f"
    assert_clean(race_cluster, receipt)


def test_a_job_past_its_cap_ends_its_attempt_and_is_still_cancelled(race_cluster):
    res = race_cluster.send({}, policy="single", providers=["c"])  # runs 1 s, capped at 200 ms
    with pytest.raises(RaceFailed) as info:
        res.get(timeout=20)
    assert [a["state"] for a in info.value.receipt["attempts"]] == ["TIMEOUT"]
    rc = race_cluster
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the capped job's own cancel refreshes the receipt
        receipt = rc.receipt(res.id)
        if (attempt(receipt, "c").get("cap_cancel") or {}).get("confirmed_terminal"):
            break
        time.sleep(0.05)
    cap_cancel = attempt(receipt, "c")["cap_cancel"]
    assert cap_cancel["terminal_status"] == "CANCELLED" and cap_cancel["leaked"] is False
    assert_clean(rc, receipt)


def test_a_failed_race_runs_its_error_links_and_fails_the_rest_of_its_chain(race_cluster):
    from celery import chain, signature

    from tests.support.fixtures_races import ERRBACK_LIST

    app = race_cluster.app
    request = {
        "sim": {
            "p": {"queue_s": 0.2, "run_s": 0.5, "outcome": "failed"},
            "h": {"queue_s": 0.2, "run_s": 0.5, "outcome": "failed"},
        }
    }
    errback = signature("tests.record_errback", app=app)
    res = app.send_task(
        "gpuhedge.hedged_infer", (request,), queue="gpuhedge.coord", link_error=errback
    )
    with pytest.raises(RaceFailed):
        res.get(timeout=20)
    key = f"{race_cluster.prefix}:{ERRBACK_LIST}"
    deadline = time.monotonic() + 10
    while not race_cluster.client.lrange(key, 0, -1) and time.monotonic() < deadline:
        time.sleep(0.02)
    [record] = race_cluster.client.lrange(key, 0, -1)
    race_id, kind, message = record.split("|", 2)
    assert (race_id, kind) == (res.id, "RaceFailed")
    assert "no attempt returned a valid result" in message

    # In a chain, the step after a failed race never runs and its result is the failure.
    after = signature("gpuhedge.race_step", args=("no-such-race",), app=app)
    workflow = chain(signature("gpuhedge.hedged_infer", args=(request,), app=app), after)
    last = workflow.apply_async()
    with pytest.raises(RaceFailed):
        last.get(timeout=20)
    assert race_cluster.store.receipt(last.parent.id)["winner"] is None
