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
import uuid
from pathlib import Path

import pytest

from tests.support.cerebrium_fake import KEY as CB_KEY
from tests.support.cerebrium_fake import FakeCerebrium
from tests.support.modal_fake import FakeModalProcess
from tests.support.receiver import start_receiver, stop_receiver
from tests.support.runpod_fake import KEY, FakeRunpod
from tests.support.webhook_server import free_port

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.timeout(240), pytest.mark.brokers]

REPO = Path(__file__).resolve().parents[1]
SECRET = "e2e-webhook-secret-0123456789"

CONFIG = """
providers:
  rp:
    role: primary
    adapter: runpod
    billed_rate_per_s: 0.0003
    runpod:
      endpoint_id: e2e-w
      api_key: "${{RUNPOD_TEST_KEY}}"
      base_url: "{runpod}"
      payload: output.audio_base64
      timeouts: {{connect_s: 2, read_s: 5}}
      poll: {{min_s: 0.05, max_s: 0.5, fraction: 0.25}}
      cancel_confirm_s: 5
      cancel_poll_s: 0.05
  cb:
    role: hedge
    adapter: cerebrium
    billed_rate_per_s: 0.0005
    timeout_s: 4                  # the cap: a run whose webhook never came ends here
    cerebrium:
      project_id: p-e2e
      app: tts
      function: predict
      api_key: "${{CEREBRIUM_TEST_KEY}}"
      api_url: "{cerebrium}"
      rest_url: "{cerebrium}"
      payload: result.audio_base64
      timeouts: {{connect_s: 2, read_s: 5}}
  m:
    role: fallback
    adapter: modal
    billed_rate_per_s: 0.000704
    modal:
      app: tts
      function: synthesize
      payload: audio_base64
      poll_interval_s: 0.05
      cancel_confirm_s: 3
      timeouts: {{spawn_s: 1.5, poll_s: 1, cancel_s: 2}}
      sdk: "tests.support.modal_fake_sdk:FakeModalClient"
      sdk_options: {{url: "{modal}"}}
policy:
  name: fixed
  params: {{hedge_after_ms: 300}}
timeouts:
  attempt_cap_s: 60
budget: {{ceiling_usd: 1000}}   # paid adapters need a ceiling (docs/costs.md)
validator: wav
"""


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
    import redis

    from gpuhedge_celery.store.listener import enable_notifications
    from tests.support.fixtures_celery import CeleryCluster, broker_url_for
    from tests.support.fixtures_races import RaceCluster

    hooks = request.param == "on"
    enable_notifications(redis.Redis.from_url(redis_url))
    tmp = tmp_path_factory.mktemp(f"webhook-races-{request.param}")
    runpod = FakeRunpod({"api_key": KEY, "webhook_gap_s": 0.5})
    cerebrium = FakeCerebrium({"webhook_gap_s": 0.5})
    modal = FakeModalProcess()
    receiver = None
    cc = None
    try:
        config = tmp / "webhook-races.yaml"
        config.write_text(CONFIG.format(runpod=runpod.base_url, cerebrium=cerebrium.url,
                                        modal=modal.url))  # fmt: skip
        cc = CeleryCluster(redis_url, f"t{uuid.uuid4().hex[:10]}", tmp,
                           broker_url_for(broker, request))  # fmt: skip
        cc.env.update({"GPUHEDGE_CONFIG": str(config), "RUNPOD_TEST_KEY": KEY,
                       "CEREBRIUM_TEST_KEY": CB_KEY, "PYTHONPATH": str(REPO)})  # fmt: skip
        if hooks:
            port = free_port()
            cc.env.update({"GPUHEDGE_WEBHOOK_URL": f"http://127.0.0.1:{port}/hooks",
                           "GPUHEDGE_WEBHOOK_SECRET": SECRET,
                           "GPUHEDGE_WEBHOOK_FALLBACK_S": "20"})  # fmt: skip
            receiver = start_receiver(cc.env, port, tmp, timeout_s=20)
        else:
            for name in ("GPUHEDGE_WEBHOOK_URL", "GPUHEDGE_WEBHOOK_SECRET"):
                cc.env.pop(name, None)
        cc.wait_ready(*[cc.start_coordinator(wait=False) for _ in range(2)])
        rc = RaceCluster(cc, config)
        yield Races(rc, runpod, cerebrium, modal, hooks, tmp / "receiver.log" if hooks else None)
    finally:
        stop_receiver(receiver)
        if cc is not None:
            cc.close()
            keys = list(cc.client.scan_iter(f"{cc.prefix}:*", count=1000))
            if keys:
                cc.client.delete(*keys)
        for fake in (runpod, cerebrium, modal):
            fake.stop()


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
