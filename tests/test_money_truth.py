"""What the product says about money, against what the providers billed, under load.

Two real coordination workers and the webhook receiver race RunPod (primary, the loopback
RunPod fake) against Cerebrium (hedge, the loopback Cerebrium fake) with the state-aware
cutover policy: a primary still queued at 0.5 s is cancelled for the hedge, one still running
at 1.5 s is hedged. A budget with caps reserves every attempt. Each race forces its jobs'
fates (a fast primary; a primary stuck in its queue; a slow running primary; a hedge cancelled
while running, some finishing anyway and posting a late result), and cancel refusals are
injected on both fakes mid-run. Hundreds of races start within 10 s; once every job has ended
at the fakes and every receipt is written (and at most 10 s more for the last reservations to
settle), the fakes' truth (``/admin/truth``: when each worker
started and stopped) is compared with every receipt, race record and ledger settlement
(``tests/support/truth.py``). The comparison is printed as JSON.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from gpuhedge_celery.bench._truth_row import submit_spread, wait_settled
from tests.support.cerebrium_fake import KEY as CB_KEY
from tests.support.cerebrium_fake import FakeCerebrium
from tests.support.receiver import start_receiver, stop_receiver
from tests.support.runpod_fake import KEY, FakeRunpod
from tests.support.truth import compare_cluster
from tests.support.webhook_server import free_port

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[1]
SECRET = "truth-webhook-secret-0123456789"
POLICY = "cutover:rp->cb@q0.5s+s1.5s"
SUBMIT_WINDOW_S = 10.0
TOTAL_LIMIT_S = 120.0  # submits, every job ended, every receipt written, the fleet settled
SETTLE_LIMIT_S = 90.0  # from the last submit to every job ended and every receipt written
TOLERANCE = 0.05

CONFIG = """
providers:
  rp:
    role: primary
    adapter: runpod
    billed_rate_per_s: 0.0003
    idle_billed_seconds: 5
    runpod:
      endpoint_id: truth-p
      api_key: "${{RUNPOD_TEST_KEY}}"
      base_url: "{runpod}"
      payload: output.audio_base64
      timeouts: {{connect_s: 2, read_s: 5}}
      cancel_confirm_s: 5
      cancel_poll_s: 0.1
  cb:
    role: hedge
    adapter: cerebrium
    billed_rate_per_s: 0.0005
    timeout_s: 20
    cerebrium:
      project_id: p-test
      app: tts
      function: predict
      api_key: "${{CEREBRIUM_TEST_KEY}}"
      api_url: "{cerebrium}"
      rest_url: "{cerebrium}"
      payload: result.audio_base64
      timeouts: {{connect_s: 2, read_s: 5}}
policy:
  name: cutover
  params: {{queue_cutover_ms: 500, safety_hedge_ms: 1500}}
timeouts:
  attempt_cap_s: 30
budget:
  max_usd_per_request: 0.05
  max_usd_per_day: 50
  ceiling_usd: 1000
  providers:
    rp: {{max_usd_per_day: 20}}
    cb: {{max_usd_per_day: 20}}
validator: wav
"""

# Each race's fates, by its index: (RunPod job, Cerebrium run), real seconds.
FATES = [
    ({"queue_s": 0.1, "run_s": 0.3}, {"queue_s": 0.1, "run_s": 0.4}),  # the primary wins alone
    ({"queue_s": 6.0, "run_s": 0.5}, {"queue_s": 0.1, "run_s": 0.4}),  # queued: cut over
    ({"queue_s": 0.1, "run_s": 5.0}, {"queue_s": 0.1, "run_s": 0.4}),  # slow: the hedge wins
    (
        {"queue_s": 0.1, "run_s": 1.9},  # the primary wins; the running hedge finishes anyway
        {"queue_s": 0.05, "run_s": 1.5, "finish_after_cancel": True},
    ),
    ({"queue_s": 0.1, "run_s": 1.9}, {"queue_s": 0.05, "run_s": 1.5}),  # the running hedge stops
]


def request_for(i: int) -> dict:
    rp, cb = FATES[i % len(FATES)]
    return {"text": f"race {i}", "runpod_fake": {"truth-p": rp}, "cerebrium_fake": cb}


@pytest.fixture
def cluster(redis_url, tmp_path, broker, request):
    import redis

    from gpuhedge_celery.store.listener import enable_notifications
    from tests.support.fixtures_celery import CeleryCluster, broker_url_for
    from tests.support.fixtures_races import RaceCluster

    enable_notifications(redis.Redis.from_url(redis_url))
    runpod = FakeRunpod({"api_key": KEY, "webhook_gap_s": 0.5})
    cerebrium = FakeCerebrium({"webhook_gap_s": 0.5})
    receiver = cc = None
    try:
        config = tmp_path / "truth.yaml"
        config.write_text(CONFIG.format(runpod=runpod.base_url, cerebrium=cerebrium.url))
        cc = CeleryCluster(
            redis_url, f"t{uuid.uuid4().hex[:10]}", tmp_path, broker_url_for(broker, request)
        )
        port = free_port()
        cc.env.update(
            {
                "GPUHEDGE_CONFIG": str(config),
                "RUNPOD_TEST_KEY": KEY,
                "CEREBRIUM_TEST_KEY": CB_KEY,
                "PYTHONPATH": str(REPO),
                "GPUHEDGE_WEBHOOK_URL": f"http://127.0.0.1:{port}/hooks",
                "GPUHEDGE_WEBHOOK_SECRET": SECRET,
                "GPUHEDGE_WEBHOOK_FALLBACK_S": "10",
            }
        )
        receiver = start_receiver(cc.env, port, tmp_path)
        cc.wait_ready(*[cc.start_coordinator(wait=False) for _ in range(2)])
        rc = RaceCluster(cc, config)
        rc.fakes = {"rp": runpod, "cb": cerebrium}
        yield rc
    finally:
        stop_receiver(receiver)
        if cc is not None:
            cc.close()
            keys = list(cc.client.scan_iter(f"{cc.prefix}:*", count=1000))
            for i in range(0, len(keys), 1000):
                cc.client.delete(*keys[i : i + 1000])
        runpod.stop()
        cerebrium.stop()


def run_load(rc, n: int) -> tuple[list[str], dict]:
    """Start ``n`` races within :data:`SUBMIT_WINDOW_S`, inject cancel refusals a third of the
    way in, then wait for every job to end, every receipt and no reservation open."""
    runpod, cerebrium = rc.fakes["rp"], rc.fakes["cb"]

    def refuse_cancels():
        runpod.configure(faults={"cancel": {"errors_next": max(3, n // 25), "error_code": 500}})
        cerebrium.configure(faults={"cancel": {"errors_next": max(2, n // 50), "error_code": 500}})

    def send(i):
        return rc.send(request_for(i), policy=POLICY).id

    ids, submit_s = submit_spread(send, n, SUBMIT_WINDOW_S, refuse_cancels)
    waited = wait_settled(rc.client, rc.prefix, ids, [runpod, cerebrium], SETTLE_LIMIT_S)
    return ids, {"races": n, "submit_s": round(submit_s, 2), **waited}


@pytest.mark.parametrize("races", [100, 300])
def test_money_reported_matches_what_the_providers_billed(cluster, races):
    t0 = time.monotonic()
    ids, timing = run_load(cluster, races)
    report = compare_cluster(cluster, ids, cluster.fakes)
    report["timing"] = {**timing, "total_s": round(time.monotonic() - t0, 2)}
    report["fake_routes"] = {name: fake.stats()["routes"] for name, fake in cluster.fakes.items()}
    print("MONEY-TRUTH " + json.dumps(report, sort_keys=True))
    if timing["races_without_receipt"]:
        print(cluster.logs())
    assert timing["submit_s"] <= SUBMIT_WINDOW_S + 1.0, timing
    failures = []
    if report["timing"]["total_s"] > TOTAL_LIMIT_S:
        failures.append(f"took {report['timing']['total_s']} s (limit {TOTAL_LIMIT_S} s)")
    if timing["races_without_receipt"]:
        failures.append(f"{timing['races_without_receipt']} races wrote no receipt")
    if report["jobs_not_ended"]:
        failures.append(f"{len(report['jobs_not_ended'])} jobs still running at the fakes")
    wasted = report["wasted_usd"]
    if abs(wasted["receipts"] - wasted["truth"]) > TOLERANCE * wasted["truth"]:
        failures.append(f"wasted $: receipts {wasted['receipts']} vs truth {wasted['truth']}")
    spend = report["settled_usd"]
    if abs(spend["ledger"] - spend["truth_billed"]) > TOLERANCE * spend["truth_billed"]:
        failures.append(f"settled $: ledger {spend['ledger']} vs truth {spend['truth_billed']}")
    if report["open_reservations"]:
        failures.append(f"{report['open_reservations']} reservations open after every job ended")
    product = (
        "receipt billed != record billed",
        "receipt billed != ledger settled",
        "record billed != ledger settled",
        "no record",
        "no ledger settlement",
    )
    split = {
        k: v
        for k, v in report["disagreement_counts"].items()
        if k in product or k.startswith("settled ")
    }
    if split:
        failures.append(f"receipt/record/ledger disagree per attempt: {split}")
    lying = [x for x in report["provider_ack_but_refused"] if not x["cancel_accepted_later"]]
    if lying:
        failures.append(f"{len(lying)} receipts say provider_ack for a cancel never accepted")
    assert not failures, failures
