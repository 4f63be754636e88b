"""Races RunPod -> Cerebrium (hedged) and RunPod -> Cerebrium -> Modal (cascade) on real
Celery workers, against the three loopback fakes, with webhooks on and off.

Webhooks on: two coordination workers submit with each attempt's webhook URL, and the
receiver (``gpuhedge-celery webhooks``, its own process, a real uvicorn) applies the fakes'
deliveries to the races in Redis. Webhooks off: RunPod is polled, and Cerebrium (which reports
only by webhook) refuses to submit, with the reason in the receipt. After every race: losers
are cancelled with receipts, every leak is flagged, nothing runs on at RunPod.
"""

from __future__ import annotations

import time
from contextlib import ExitStack

import pytest

from tests.support.cerebrium_fake import KEY as CB_KEY
from tests.support.cerebrium_fake import FakeCerebrium
from tests.support.fleet import fleet_cluster
from tests.support.modal_fake import FakeModalProcess
from tests.support.race_configs import (
    PAID_CEILING,
    cerebrium_provider,
    modal_provider,
    race_config,
    runpod_provider,
)
from tests.support.runpod_fake import KEY, FakeRunpod

pytestmark = [
    pytest.mark.redis,
    pytest.mark.celery,
    pytest.mark.timeout(240),
    pytest.mark.brokers,
    pytest.mark.sentinel,
    pytest.mark.cluster,
]

SECRET = "e2e-webhook-secret-0123456789"


def config_text(runpod: str, cerebrium: str, modal: str) -> str:
    return race_config(
        {
            "rp": runpod_provider("primary", 0.0003, endpoint_id="e2e-w", base_url=runpod),
            # its 4 s cap: a run whose webhook never came ends there
            "cb": cerebrium_provider(
                "hedge", 0.0005, url=cerebrium, project_id="p-e2e", timeout_s=4
            ),
            "m": modal_provider("fallback", 0.000704, url=modal),
        },
        "fixed",
        {"hedge_after_ms": 300},
        timeouts={"attempt_cap_s": 60},
        budget=PAID_CEILING,
    )


class Races:
    def __init__(self, rc, runpod, cerebrium, modal, hooks: bool, receiver_log=None):
        self.rc, self.runpod, self.cerebrium, self.modal, self.hooks = (
            rc, runpod, cerebrium, modal, hooks)  # fmt: skip
        self.receiver_log = receiver_log

    def run(self, request, policy, fails=False):
        res = self.rc.send(request, policy=policy)
        try:
            if fails:
                from gpuhedge_celery.errors import RaceFailed

                with pytest.raises(RaceFailed):
                    res.get(timeout=60)
                result = None
            else:
                result = res.get(timeout=60)
            return result, self.rc.receipt(res.id, timeout=30)
        except BaseException:
            print(self.rc.logs())
            raise


@pytest.fixture(scope="module", params=["on", "off"])
def races(request, redis_url, tmp_path_factory, broker):
    from tests.support.fixtures_celery import broker_url_for

    hooks = request.param == "on"
    tmp = tmp_path_factory.mktemp(f"webhook-races-{request.param}")
    with ExitStack() as stack:
        runpod = stack.enter_context(FakeRunpod({"api_key": KEY, "webhook_gap_s": 0.5}))
        cerebrium = stack.enter_context(FakeCerebrium({"webhook_gap_s": 0.5}))
        modal = FakeModalProcess()
        stack.callback(modal.stop)
        rc = stack.enter_context(
            fleet_cluster(
                redis_url,
                tmp,
                config_text(runpod.base_url, cerebrium.url, modal.url),
                broker_url=broker_url_for(broker, request),
                webhook_secret=SECRET if hooks else None,
                fallback_s=20,
                receiver_timeout_s=20,
            )
        )
        yield Races(rc, runpod, cerebrium, modal, hooks, rc.receiver_log)


def attempt(receipt, provider):
    return next(a for a in receipt["attempts"] if a["provider"] == provider)


def fates(rp=None, cb=None):
    request = {"text": "hello"}
    if rp is not None:
        request["runpod_fake"] = {"e2e-w": rp}
    if cb is not None:
        request["cerebrium_fake"] = cb
    return request


def assert_clean(races, receipt):
    """Nothing runs on at RunPod, nothing registered live, every unconfirmed cancel listed."""
    assert races.runpod.live() == [] and receipt["finished"] is True
    leaks = {(x["provider"], x["job_id"]) for x in receipt["leaks"]}
    # a job still registered (for the janitor) is one the receipt lists as a leak
    live = races.rc.store.live_jobs(receipt["race_id"]).values()
    assert {(j["provider"], j["job_id"]) for j in live} <= leaks
    for a in receipt["attempts"]:
        cancel = a.get("cancel_receipt") or {}
        if cancel and cancel.get("leaked"):
            assert (a["provider"], a["job_id"]) in leaks, a  # flagged


def test_hedged_runpod_to_cerebrium(races):
    """A slow RunPod primary is hedged by Cerebrium at 0.3 s."""
    request = fates(rp={"queue_s": 0, "run_s": 4}, cb={"queue_s": 0, "run_s": 0.2})
    result, receipt = races.run(request, "hedge:rp->cb@0.3s")
    cb = attempt(receipt, "cb")
    rp = attempt(receipt, "rp")
    if races.hooks:  # Cerebrium's webhook wins; RunPod is cancelled and confirmed
        assert result["winner"] == "cb" and result["hedged"] is True
        cancel = rp["cancel_receipt"]
        assert cancel["evidence"] == "confirmed_terminal" and cancel["leaked"] is False
        assert races.runpod.job("e2e-w", rp["job_id"])["cancelled"] is True
    else:  # Cerebrium cannot report without webhooks: it refuses to submit, RunPod wins
        assert result["winner"] == "rp"
        assert "GPUHEDGE_WEBHOOK_URL" in " ".join(cb["reasons"])
        assert races.cerebrium.stats()["routes"].get("submit", 0) == 0
    assert_clean(races, receipt)


def test_the_runpod_primary_wins_and_the_cerebrium_loser_is_a_flagged_leak(races):
    """Cerebrium's cancel is acknowledged only: its loser is listed as a leak. Its run went on
    and posts its webhook: the finished race takes that late result and prices the run to it
    (what the fake billed), but nothing can check a Cerebrium delivery, so the leak stays
    listed (a forged delivery must not hide a job that may still run)."""
    request = fates(rp={"queue_s": 0, "run_s": 0.6},
                    cb={"queue_s": 0, "run_s": 0.8, "finish_after_cancel": True})  # fmt: skip
    result, receipt = races.run(request, "hedge:rp->cb@0.2s")
    assert result["winner"] == "rp"
    cb = attempt(receipt, "cb")
    if not races.hooks:
        assert "GPUHEDGE_WEBHOOK_URL" in " ".join(cb["reasons"]) and receipt["leaks"] == []
        return
    cancel = cb["cancel_receipt"]
    assert cancel["evidence"] == "provider_ack" and cancel["leaked"] is True
    assert any(x["provider"] == "cb" for x in receipt["leaks"]) and receipt["leaked"] is True
    assert races.cerebrium.run(cb["job_id"])["cancelled"] is True
    deadline = time.monotonic() + 5

    def late_taken():
        found = races.rc.store.receipt(receipt["race_id"])
        return found if attempt(found, "cb")["state"] == "COMPLETED" else None

    while time.monotonic() < deadline and not late_taken():
        time.sleep(0.05)
    late = late_taken()
    assert late is not None, "the late result was not taken"
    assert races.cerebrium.stats()["webhooks"]["sent"] >= 1  # the fake posted it
    cb = attempt(late, "cb")
    assert late["winner"] == receipt["winner"]
    cancel = cb["cancel_receipt"]
    # the run ended, but a delivery Cerebrium cannot confirm proves nothing: evidence and
    # leak flag stay
    assert cancel["evidence"] == "provider_ack" and cancel["confirmed_terminal"] is False
    assert cancel["leaked"] is True and any(x["provider"] == "cb" for x in late["leaks"])
    truth = races.cerebrium.truth()[cb["job_id"]]
    assert truth["stopped_by_cancel"] is False  # it ran to its end
    # priced from submit to the result's arrival: the billed run (within the two clocks'
    # reading of the submit) plus at most the delivery
    assert cb["usd"] >= truth["billed_s"] * 0.0005 * 0.9
    assert cb["usd"] <= (truth["billed_s"] + 0.5) * 0.0005
    assert_clean(races, late)


def test_cascade_runpod_to_cerebrium_to_modal(races):
    """RunPod stays queued (cut over at 0.3 s, cancelled for $0), Cerebrium's run fails
    (by webhook) or cannot submit (webhooks off): Modal wins."""
    request = {**fates(rp={"queue_s": 30, "run_s": 1},
                       cb={"queue_s": 0, "run_s": 0.1, "outcome": "FAILED"}),
               "sim": {}}  # fmt: skip
    result, receipt = races.run(request, "cascade:rp->cb->m@q0.3s+s5s+e10s")
    assert result["winner"] == "m"
    rp = attempt(receipt, "rp")
    cancel = rp["cancel_receipt"]
    assert cancel["confirmed_terminal"] is True and cancel["scope"] == "queued_job"
    assert races.runpod.job("e2e-w", rp["job_id"])["executionTime"] == 0
    cb = attempt(receipt, "cb")
    if races.hooks:
        assert "run failed" in " ".join(cb["reasons"])
    assert_clean(races, receipt)


def test_a_cerebrium_webhook_that_never_comes_ends_at_its_cap_as_a_flagged_leak(races):
    """RunPod fails; Cerebrium's delivery is dropped: its attempt ends at its 4 s cap as
    "outcome unknown", its cancel is sent (acknowledged only) and the receipt lists the leak."""
    races.cerebrium.configure(faults={"webhook": {"drop_next": 1}})
    request = fates(rp={"queue_s": 0, "run_s": 0.05, "outcome": "FAILED"},
                    cb={"queue_s": 0, "run_s": 0.1})  # fmt: skip
    try:
        _, receipt = races.run(request, "hedge:rp->cb@0.3s", fails=True)
    finally:
        races.cerebrium.configure(faults={})
    cb = attempt(receipt, "cb")
    said = " ".join([cb.get("error") or "", *cb["reasons"]])
    if not races.hooks:
        assert "GPUHEDGE_WEBHOOK_URL" in said and receipt["leaks"] == []
        return
    assert "outcome unknown" in said
    assert any(x["provider"] == "cb" for x in receipt["leaks"])
    # the cap's cancel runs after the race ended; its receipt is added to the race's when done
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not cb.get("cap_cancel"):
        time.sleep(0.05)
        receipt = races.rc.store.receipt(receipt["race_id"])
        cb = attempt(receipt, "cb")
    cap_cancel = cb["cap_cancel"] or {}
    assert cap_cancel.get("evidence") == "provider_ack" and cap_cancel.get("leaked") is True
    # (the run had in truth ended: only its webhook was lost, so nothing could show it)
    assert races.cerebrium.run(cb["job_id"])["state"] == "COMPLETED"
    assert any(x["provider"] == "cb" for x in receipt["leaks"])
    assert_clean(races, receipt)


def test_no_key_and_no_webhook_url_in_any_log(races):
    """Runs last: every race of the module has gone through the workers (and the receiver)."""
    import re

    if races.hooks:  # a Cerebrium submit: its query carries the attempt's receiver URL
        races.run(fates(rp={"queue_s": 5, "run_s": 60}, cb={"queue_s": 0.1, "run_s": 0.3}),
                  "hedge:rp->cb@0.3s")  # fmt: skip
    logs = races.rc.logs()
    if races.receiver_log is not None:
        logs += races.receiver_log.read_text()
    assert "HTTP Request:" not in logs, "httpx's request lines are off in every process"
    for secret in (KEY, CB_KEY, SECRET):
        assert secret not in logs
    token = re.compile(r"(/|%2F)[0-9a-f]{32}(\b|$)")  # an attempt's webhook token in a URL
    assert not token.search(logs), token.search(logs)
