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

import base64
import json
import time

import pytest

from gpuhedge_celery.bench._truth_row import submit_spread, wait_settled
from gpuhedge_celery.core.validators import tone_wav
from gpuhedge_celery.signing import sign_result
from tests.support.cerebrium_fake import FakeCerebrium
from tests.support.fleet import fleet_cluster
from tests.support.race_configs import cerebrium_provider, race_config, runpod_provider
from tests.support.runpod_fake import KEY, FakeRunpod
from tests.support.truth import compare_cluster, product_failures

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.slow, pytest.mark.timeout(300)]

SECRET = "truth-webhook-secret-0123456789"
POLICY = "cutover:rp->cb@q0.5s+s1.5s"
SUBMIT_WINDOW_S = 10.0
TOTAL_LIMIT_S = 120.0  # submits, every job ended, every receipt written, the fleet settled
SETTLE_LIMIT_S = 90.0  # from the last submit to every job ended and every receipt written
TOLERANCE = 0.05
RESULT_KEY = "money-truth-result-key-0123456789"
# Results are signed (the ``hmac`` validator): a Cerebrium webhook, which nothing can check with
# Cerebrium, then proves its run ended; unsigned, a loser whose cancel was refused would keep
# its whole reservation even after its late result (a forged delivery looks the same).
HMAC = {"name": "hmac", "key": "${GPUHEDGE_TEST_RESULT_KEY}", "then": "wav", "at": "audio_base64"}
AUDIO = base64.b64encode(tone_wav(1.0)).decode("ascii")


def signed_output(run: str) -> dict:
    """A job's output as the user's function returns it: signed, and naming its own run (a
    copy of another attempt's signed result is never taken as this one's end)."""
    return sign_result({"audio_base64": AUDIO, "run": run}, RESULT_KEY)


def config_text(runpod: str, cerebrium: str) -> str:
    caps = {"max_usd_per_day": 20}
    return race_config(
        {
            "rp": runpod_provider(
                "primary",
                0.0003,
                endpoint_id="truth-p",
                base_url=runpod,
                poll=None,
                cancel_poll_s=0.1,
                idle_billed_seconds=5,
                payload="output",  # the signed object: audio_base64 and its signature
            ),
            "cb": cerebrium_provider(
                "hedge", 0.0005, url=cerebrium, project_id="p-test", timeout_s=20, payload="result"
            ),
        },
        "cutover",
        {"queue_cutover_ms": 500, "safety_hedge_ms": 1500},
        timeouts={"attempt_cap_s": 30},
        budget={
            "max_usd_per_request": 0.05,
            "max_usd_per_day": 50,
            "ceiling_usd": 1000,
            "providers": {"rp": caps, "cb": caps},
        },
        validator=HMAC,
    )


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
    # each job returns what the user's function would: its output signed with the fleet's key
    rp, cb = {**rp, "output": signed_output(f"{i}-rp")}, {**cb, "output": signed_output(f"{i}-cb")}
    return {"text": f"race {i}", "runpod_fake": {"truth-p": rp}, "cerebrium_fake": cb}


@pytest.fixture
def cluster(redis_url, tmp_path, broker, request):
    from tests.support.fixtures_celery import broker_url_for

    with (
        FakeRunpod({"api_key": KEY, "webhook_gap_s": 0.5}) as runpod,
        FakeCerebrium({"webhook_gap_s": 0.5}) as cerebrium,
        fleet_cluster(
            redis_url,
            tmp_path,
            config_text(runpod.base_url, cerebrium.url),
            broker_url=broker_url_for(broker, request),
            env={"GPUHEDGE_TEST_RESULT_KEY": RESULT_KEY},
            webhook_secret=SECRET,
            fallback_s=10,
        ) as rc,
    ):
        rc.fakes = {"rp": runpod, "cb": cerebrium}
        yield rc


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
    failures += product_failures(report)
    assert not failures, failures
