"""A forged Cerebrium delivery cannot win a race whose validator is ``hmac``.

Real Celery coordination workers, the real webhook receiver (``gpuhedge-celery webhooks``, its
own process) and the loopback Cerebrium fake. Two Cerebrium providers race (``cb1`` primary,
``cb2`` hedge); the function's output is signed with ``signing.sign_result`` (the fake returns
it as the run's ``result``, as a function that signs would). While ``cb1``'s run is still
going, a forger who holds its webhook URL posts a well-formed WAV signed with another key: the
race marks that result invalid ("signature does not match") and the real, signed result wins.
"""

from __future__ import annotations

import base64
import time
import uuid
from pathlib import Path

import httpx
import pytest

from gpuhedge_celery.core.validators import tone_wav
from gpuhedge_celery.race.receipt import load_payload
from gpuhedge_celery.signing import sign_result
from tests.support.cerebrium_fake import KEY as CB_KEY
from tests.support.cerebrium_fake import FakeCerebrium
from tests.support.receiver import start_receiver, stop_receiver
from tests.support.webhook_server import free_port

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[1]
SECRET = "signed-races-webhook-secret-0123"
RESULT_KEY = "signed-races-result-key-0123456789"

PROVIDER = """  {name}:
    role: {role}
    adapter: cerebrium
    billed_rate_per_s: 0.0005
    timeout_s: 20
    cerebrium:
      project_id: p-e2e
      app: tts
      function: predict
      api_key: "${{CEREBRIUM_TEST_KEY}}"
      api_url: "{url}"
      rest_url: "{url}"
      payload: result                   # the signed object: audio_base64 and signature
      timeouts: {{connect_s: 2, read_s: 5}}
"""
TAIL = """policy:
  name: fixed
  params: {hedge_after_ms: 300}
timeouts:
  attempt_cap_s: 60
budget: {ceiling_usd: 1000}
validator:
  name: hmac
  key: "${GPUHEDGE_TEST_RESULT_KEY}"
  then: wav
  at: audio_base64
"""


def config_text(url: str) -> str:
    providers = "".join(
        PROVIDER.format(name=n, role=r, url=url) for n, r in (("cb1", "primary"), ("cb2", "hedge"))
    )
    return "providers:\n" + providers + TAIL


@pytest.fixture(scope="module")
def cluster(redis_url, tmp_path_factory):
    import redis

    from gpuhedge_celery.store.listener import enable_notifications
    from tests.support.fixtures_celery import CeleryCluster
    from tests.support.fixtures_races import RaceCluster

    enable_notifications(redis.Redis.from_url(redis_url))
    tmp = tmp_path_factory.mktemp("signed-races")
    fake = FakeCerebrium({"webhook_gap_s": 0.5})
    receiver = cc = None
    try:
        config = tmp / "signed.yaml"
        config.write_text(config_text(fake.url))
        cc = CeleryCluster(redis_url, f"t{uuid.uuid4().hex[:10]}", tmp)
        port = free_port()
        cc.env.update(
            {
                "GPUHEDGE_CONFIG": str(config),
                "CEREBRIUM_TEST_KEY": CB_KEY,
                "GPUHEDGE_TEST_RESULT_KEY": RESULT_KEY,
                "PYTHONPATH": str(REPO),
                "GPUHEDGE_WEBHOOK_URL": f"http://127.0.0.1:{port}/hooks",
                "GPUHEDGE_WEBHOOK_SECRET": SECRET,
                "GPUHEDGE_WEBHOOK_FALLBACK_S": "20",
            }
        )
        receiver = start_receiver(cc.env, port, tmp, timeout_s=20)
        cc.wait_ready(cc.start_coordinator(wait=False))
        rc = RaceCluster(cc, config)
        rc.fake, rc.receiver_log = fake, tmp / "receiver.log"
        yield rc
    finally:
        stop_receiver(receiver)
        if cc is not None:
            cc.close()
            keys = list(cc.client.scan_iter(f"{cc.prefix}:*", count=1000))
            if keys:
                cc.client.delete(*keys)
        fake.stop()


def webhook_of(rc, race_id: str, provider: str, timeout_s: float = 10.0) -> tuple[str, str]:
    """(run id, webhook URL) of ``provider``'s run in the race, once it is submitted."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for job in rc.store.live_jobs(race_id).values():
            if job.get("provider") == provider and job.get("job_id"):
                run = rc.fake.run(job["job_id"])
                if run and run.get("webhook"):
                    return job["job_id"], run["webhook"]
        time.sleep(0.02)
    raise AssertionError(f"{provider} was not submitted within {timeout_s} s:\n{rc.logs()}")


def test_a_forged_delivery_is_invalid_and_the_signed_result_wins(cluster):
    rc = cluster
    audio = base64.b64encode(tone_wav(1.0)).decode("ascii")
    signed = sign_result({"audio_base64": audio}, RESULT_KEY)
    request = {"text": "hello", "cerebrium_fake": {"queue_s": 0, "run_s": 2.0, "output": signed}}
    res = rc.send(request, policy="hedge:cb1->cb2@0.3s")
    run_id, url = webhook_of(rc, res.id, "cb1")
    # a well-formed WAV, signed with a key that is not the function's
    forged = sign_result({"audio_base64": audio, "note": "forged"}, "attacker-key-0123456789")
    answer = httpx.post(url, json={"run_id": run_id, "result": forged}, timeout=5)
    assert answer.status_code < 500, answer.text
    try:
        out = res.get(timeout=60)
        receipt = rc.receipt(res.id, timeout=30)
    except BaseException:
        print(rc.logs(), rc.receiver_log.read_text())
        raise
    assert out["winner"] == "cb2"
    by_provider = {a["provider"]: a for a in receipt["attempts"]}
    assert "signature does not match" in by_provider["cb1"]["reasons"]
    assert receipt["winner"] == by_provider["cb2"]["id"]
    payload = load_payload(out, client=rc.client)
    assert payload == signed  # the function's own output, not the forgery
    # the key is in no receipt, no worker log and no receiver log
    everything = repr(receipt) + rc.logs() + rc.receiver_log.read_text()
    assert RESULT_KEY not in everything
