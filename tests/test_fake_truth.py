"""The provider fakes' billing truth (``/admin/truth``), which the money-against-truth test and
bench row compare the product with: when a worker started, what a cancel stopped, ``billed_s``.

RunPod: a cancel removes a queued job (never started, 0 s) and stops a running one
``cancel_stop_s`` later; ``billed_s`` is the ``executionTime`` its ``/status`` reports. Cerebrium:
a running run stops at the cancel, or with ``finish_after_cancel`` runs to its end (a late result).
Modal: only running seconds bill (not the call's ``start_s``); a running call stops when its
cancel takes effect. The generic HTTP job API: as RunPod, its cancel stopping a job once it
shows terminal; one acknowledged but never terminal runs on. Injected cancel faults are counted
against the job they refused.
"""

from __future__ import annotations

import time

import httpx
import pytest

from gpuhedge_celery.bench.money_truth import compare, receipt_attempt_cost, truth_cost
from gpuhedge_celery.core.rates import ProviderRate
from tests.support.cerebrium_fake import KEY as CB_KEY
from tests.support.cerebrium_fake import FakeCerebrium
from tests.support.http_provider_server import HttpProviderServer
from tests.support.modal_fake import FakeModalServer, Knobs
from tests.support.runpod_fake import KEY, FakeRunpod

pytestmark = [pytest.mark.timeout(60)]


def wait_ended(fake, ids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        truth = fake.truth()
        if all(truth[i]["ended"] for i in ids):
            return truth
        time.sleep(0.05)
    raise AssertionError(f"jobs not ended: {fake.truth()}")


def test_runpod_truth_matches_its_execution_time():
    with FakeRunpod({"api_key": KEY, "cancel_stop_s": 0.1}) as fake:
        c = httpx.Client(base_url=fake.base_url, headers={"authorization": KEY})

        def submit(queue_s, run_s):
            fates = {"runpod_fake": {"ep": {"queue_s": queue_s, "run_s": run_s}}}
            return c.post("/ep/run", json={"input": fates}).json()["id"]

        done, queued, running, refused = (
            submit(0, 0.2),
            submit(5, 1),
            submit(0, 5),
            submit(0, 0.6),
        )
        c.post(f"/ep/cancel/{queued}")
        time.sleep(0.3)
        c.post(f"/ep/cancel/{running}")
        fake.configure(faults={"cancel": {"errors_next": 1}})
        assert c.post(f"/ep/cancel/{refused}").status_code == 500
        truth = wait_ended(fake, [done, queued, running, refused])
        assert truth[queued]["started"] is None and truth[queued]["billed_s"] == 0
        assert truth[queued]["stopped_by_cancel"] is True
        assert truth[running]["stopped_by_cancel"] is True
        assert 0.35 < truth[running]["billed_s"] < 1.0  # 0.3 s + the cancel's 0.1 s stop (+ lag)
        assert truth[refused]["cancel_refusals"] == 1 and not truth[refused]["stopped_by_cancel"]
        assert truth[refused]["billed_s"] == pytest.approx(0.6)
        assert truth[done]["billed_s"] == pytest.approx(0.2) and truth[done]["cancel_refusals"] == 0
        for job_id, t in truth.items():
            status = c.get(f"/ep/status/{job_id}").json()
            assert status["executionTime"] == round(t["billed_s"] * 1000), (job_id, t, status)


def test_cerebrium_truth_stops_at_the_cancel_or_runs_on_to_a_late_result():
    with FakeCerebrium({"webhook_gap_s": 0.1}) as fake:
        c = httpx.Client(base_url=fake.url, headers={"authorization": f"Bearer {CB_KEY}"})

        def submit(**fate):
            url = "/v4/p-test/tts/predict?async=true&webhookEndpoint=http://127.0.0.1:9/x"
            return c.post(url, json={"cerebrium_fake": fate}).json()["run_id"]

        def cancel(run_id):
            return c.delete(f"/v2/projects/p-test/apps/p-test-tts/runs/{run_id}").status_code

        queued = submit(queue_s=5, run_s=1)
        stopped = submit(queue_s=0, run_s=5)
        late = submit(queue_s=0, run_s=0.8, finish_after_cancel=True)
        time.sleep(0.3)
        assert cancel(queued) == cancel(stopped) == cancel(late) == 200
        truth = wait_ended(fake, [queued, stopped, late])
        assert truth[queued]["started"] is None and truth[queued]["billed_s"] == 0
        assert truth[stopped]["stopped_by_cancel"] is True
        assert 0.25 < truth[stopped]["billed_s"] < 0.8
        assert truth[late]["late_result"] is True and truth[late]["stopped_by_cancel"] is False
        assert truth[late]["billed_s"] == pytest.approx(0.8)


def test_modal_truth_bills_running_seconds_and_stops_at_the_cancels_effect():
    with FakeModalServer(Knobs(cancel_effect_s=0.1)) as fake:
        c = httpx.Client(base_url=fake.url)

        def spawn(**fate):
            body = {"target": "tts/synthesize", "args": [{"modal_fake": fate}]}
            return c.post("/v1/spawn", json=body).json()["object_id"]

        def cancel(call_id, **body):
            return c.post(f"/v1/calls/{call_id}/cancel", json=body).status_code

        done, queued, running, refused = (
            spawn(start_s=0.1, run_s=0.2),
            spawn(start_s=5, run_s=1),
            spawn(start_s=0, run_s=5),
            spawn(start_s=0, run_s=0.6),
        )
        time.sleep(0.3)
        assert cancel(queued) == cancel(running) == 200
        fake.knobs.cancel_errors = 1
        assert cancel(refused) == 503
        assert cancel(refused, terminate_containers=True) == 400
        truth = wait_ended(fake, [done, queued, running, refused])
        assert truth[done]["billed_s"] == pytest.approx(0.2)
        assert truth[done]["queued_s"] == pytest.approx(0.1)
        assert truth[queued]["started"] is None and truth[queued]["billed_s"] == 0
        assert truth[queued]["stopped_by_cancel"] is True
        assert 0.25 < truth[queued]["queued_s"] < 0.6  # until the cancel, not its 5 s start
        assert truth[running]["stopped_by_cancel"] is True
        assert 0.35 < truth[running]["billed_s"] < 1.0  # 0.3 s + the cancel's 0.1 s effect
        assert truth[refused]["cancel_refusals"] == 2 and not truth[refused]["stopped_by_cancel"]
        assert truth[refused]["billed_s"] == pytest.approx(0.6)
        assert truth[done]["cancel_refusals"] == 0 and not truth[done]["stopped_by_cancel"]
        seen = {i: c.get(f"/v1/calls/{i}").json()["status"] for i in truth}
        assert seen == {done: "success", queued: "failure", running: "failure",
                        refused: "success"}  # fmt: skip
        served = c.get("/_control/truth").json()  # what FakeModalProcess.truth() reads
        assert {i: t["billed_s"] for i, t in served.items()} == {
            i: t["billed_s"] for i, t in truth.items()
        }


def test_http_job_api_truth_matches_its_execution_time():
    with HttpProviderServer() as fake:
        fake.knobs.cancel_terminal_after_s = 0.1
        c = httpx.Client(base_url=fake.base_url("ep1"), headers={"authorization": "test-key"})

        def submit(queue_s, run_s):
            body = {"input": {"http_fake": {"queue_s": queue_s, "run_s": run_s}}}
            return c.post("/run", json=body).json()["id"]

        done, queued, running, refused, ran_on = (
            submit(0.1, 0.2),
            submit(5, 1),
            submit(0, 5),
            submit(0, 0.6),
            submit(0, 0.7),
        )
        time.sleep(0.3)
        assert c.post(f"/cancel/{queued}").status_code == c.post(f"/cancel/{running}").status_code
        fake.knobs.cancel_errors = 1
        assert c.post(f"/cancel/{refused}").status_code == 500
        fake.knobs.cancel_never_terminal = True
        assert c.post(f"/cancel/{ran_on}").json()["status"] == "CANCELLED"  # acknowledged only
        truth = wait_ended(fake, [done, queued, running, refused, ran_on])
        assert truth[done]["billed_s"] == pytest.approx(0.2)
        assert truth[done]["queued_s"] == pytest.approx(0.1)
        assert truth[queued]["started"] is None and truth[queued]["billed_s"] == 0
        assert truth[queued]["stopped_by_cancel"] is True
        assert truth[running]["stopped_by_cancel"] is True
        assert 0.35 < truth[running]["billed_s"] < 1.0  # 0.3 s + the cancel's 0.1 s stop (+ lag)
        assert truth[refused]["cancel_refusals"] == 1 and not truth[refused]["stopped_by_cancel"]
        assert truth[refused]["billed_s"] == pytest.approx(0.6)
        assert truth[ran_on]["late_result"] is True and not truth[ran_on]["stopped_by_cancel"]
        assert truth[ran_on]["billed_s"] == pytest.approx(0.7)
        assert {t["endpoint"] for t in truth.values()} == {"ep1"}
        for job_id, t in truth.items():
            status = c.get(f"/status/{job_id}").json()
            assert status["executionTime"] == round(t["billed_s"] * 1000), (job_id, t, status)


def test_the_comparison_prices_truth_and_receipts_by_the_same_rule():
    rate = ProviderRate(0.001, 10.0)
    t = {
        "started": 5.0,
        "billed_s": 2.0,
        "ended": True,
        "cancel_refusals": 1,
        "cancel_requested_at": None,
    }
    assert truth_cost(t, rate) == pytest.approx((0.002, 0.012))
    assert truth_cost({"started": None, "billed_s": 0.0}, rate) == (0.0, 0.0)
    attempt = {
        "id": "a1",
        "provider": "p",
        "job_id": "j1",
        "sent": True,
        "submitted_at_s": 0.5,
        "result_at_s": None,
        "timeline": [[0.5, "submitted"], [2.0, "cancel_sent (lost)"]],
        "cancel_receipt": {"was_running": True, "evidence": "provider_ack"},
    }
    assert receipt_attempt_cost(attempt, rate) == pytest.approx((0.0015, 0.0115))
    receipt = {"race_id": "r1", "winner": "a0", "wasted_usd": 0.0015, "attempts": [attempt]}
    record = {"race_id": "r1", "attempts": [{"usd": 0.0015, "billed_usd": 0.0115}]}
    ledger = [{"type": "settle", "race": "r1", "attempt": "a1", "nano": "13000000"}]
    report = compare({"j1": t}, {"p": rate}, [receipt], [record], ledger, 0)
    assert report["wasted_usd"]["truth"] == pytest.approx(0.002)
    assert report["wasted_usd"]["receipts"] == pytest.approx(0.0015)
    assert report["settled_usd"]["ledger"] == pytest.approx(0.013)
    assert report["settled_usd"]["truth_billed"] == pytest.approx(0.012)
    assert report["disagreement_counts"] == {
        "receipt active != truth active": 1,
        "receipt billed != ledger settled": 1,
        "record billed != ledger settled": 1,
        "ledger settled != truth billed": 1,
    }
    assert report["provider_ack_but_refused"] == [
        {
            "race": "r1",
            "attempt": "a1",
            "job": "j1",
            "provider": "p",
            "cancel_accepted_later": False,
        }
    ]
